"""Lazy snapshots: what ``DataStatesWriter.stage()`` starts and returns at once.

``stage(state_dict)`` must not take time proportional to the bytes of the
state. It walks the state dict once (per-tensor work only), places every
distinct tensor in the rank's data file, creates that file and hands the
engine one region per tensor; the engine copies them into its bounded host
pool and flushes them to the file in the background (back-pressure when the
pool is full). Offsets are fixed here, before DCP plans, so a state larger
than the pool streams to disk while training continues.

What DCP later plans and saves is the *staged* state dict: the same
structure, with tensors that alias the caller's (for metadata only: their
bytes are taken from the snapshot, never read again) and deep copies of
every non-tensor value (DCP pickles those later, after training has moved
on). The save finds each planned item's bytes through DCP's own flattening
of that staged dict (:meth:`Snapshot.locations_for`).

Incremental snapshots (a base, or digests recorded: :mod:`incremental`):
the large plain tensors whose version counter did not move since the last
save are *hashed*, not placed, in ``stage()``. Everything else is placed and
streams at once; a background thread hashes those tensors (from the caller's
memory: forward and backward do not change them, and the fence waits for
the hashing as for a copy), refers to the base's chunk for each one whose
digest matches, and places the rest after the others, appending them to the
same engine job. The staging future completes once that is done and every
byte placed has left the caller's tensors.

Consistency is checked, not assumed: the version counter of every tensor is
recorded here and compared once the copies are complete; an in-place change
in between fails the save instead of committing a torn checkpoint.

A snapshot's life, each step explicit (see :mod:`handoff` for who moves it):

    captured --(staged: bytes out of the caller's tensors)--> staged
    staged/captured --(a thread takes the staged dict: DCP's save thread)--> taken
    taken --(the save begins on the writer, storage_meta)--> begun --> ended
    any state before begun --(abandon(): close(), the manager, exit, nobody holds it)--> abandoned

``begin`` and ``abandon`` exclude each other under one lock: a snapshot whose
save has begun is never abandoned, and a save whose snapshot was abandoned
fails instead of saving tensors that have moved on.
"""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.planner import WriteItemType

from dcp_datastates import _dcp_compat
from dcp_datastates.core import incremental
from dcp_datastates.core.async_save.order import Ticket
from dcp_datastates.core.async_save.runtime import runtime
from dcp_datastates.core.placement import PAGE, SMALL_TENSOR_BYTES, align_up, new_save_id, place_tensors, tensor_item_nbytes
from dcp_datastates.core.providers import TensorSource, finish_regions, tensor_source
from dcp_datastates.core.stripes import with_reserved_keys
from dcp_datastates.errors import CheckpointError, SnapshotMutatedError
from dcp_datastates.format.file_names import data_file_name, index_file_name
from dcp_datastates.format.checkpoint_layout import location_key
from dcp_datastates.native.engine import stop_write_job

_IMMUTABLE = (int, float, complex, bool, str, bytes, type(None), torch.dtype, torch.device, torch.Size)


def source_key(t: torch.Tensor) -> tuple:
    """What identifies a tensor's bytes: the same key means the same bytes."""
    return (t.device, t.data_ptr(), t.dtype, tuple(t.shape), tuple(t.stride()))


class Snapshot:
    """One rank's lazy copy of a state dict, on its way into one data file."""

    def __init__(self, dest, rank: int, compression=None, increment: incremental.SnapshotIncrement | None = None) -> None:
        self.dest = dest  # where the save writes (core.destination)
        self.directory = dest.location  # as messages name it
        self.increment = increment  # None with compression: the writer refuses both together
        self.references: dict[tuple, incremental.BaseChunk] = {}  # source_key -> the base's identical chunk
        self.digests: dict[tuple, str] = {}  # source_key -> content digest
        self.item_references: dict[tuple, incremental.BaseChunk] = {}  # location_key -> chunk (locations_for)
        self.item_digests: dict[tuple, str] = {}  # location_key -> digest (locations_for)
        self.hashed = threading.Event()  # the hashed tensors are referred to or placed
        self._hashing: threading.Thread | None = None
        self.rank = rank
        self.save_id = new_save_id()
        self.data_file = data_file_name(rank, self.save_id)
        self.index_file = index_file_name(rank, self.save_id)
        # Compressed saves stage raw bytes into a file of their own (a rank file name with
        # another save id, so a crash leaves a recognisable stray); the save compresses it
        # into ``data_file`` and removes it (see compression.py).
        self.compression = compression
        self.staging_file = data_file_name(rank, new_save_id()) if compression is not None else None
        self.staged_dict: Any = None
        self.placed: dict[tuple, tuple[int, int]] = {}  # source_key -> (offset, nbytes)
        self.tensor_bytes_end = 0
        self.job = None
        self.ticket: Ticket | None = None  # its place in the order of saves
        self.staging_error: BaseException | None = None
        self.stage_call_s = 0.0  # seconds the caller spent in stage()
        self.staged_s = 0.0  # seconds from capture to every byte out of the caller's tensors
        self.captured_at = 0.0  # time.perf_counter() when capture() began
        self.staged = threading.Event()  # every byte left the caller's tensors (or it was abandoned)
        self._versions: list[tuple[str, torch.Tensor, int]] = []
        self._lock = threading.Lock()
        self.taker: threading.Thread | None = None  # the thread that took the staged dict
        self.begun = False
        self.abandoned: str | None = None  # why, once abandoned
        self.future_ref = lambda: None  # the StagingFuture, held weakly (see handoff.py)

    @property
    def staging_path(self) -> str:
        """The file the engine writes the snapshot's raw tensors to (a compressed save's, which
        is always a directory's)."""
        return self.dest.where(self.staging_file or self.data_file)

    @property
    def objects_base(self) -> int:
        return align_up(self.tensor_bytes_end, PAGE)

    # -- capture (caller's thread) ----------------------------------------------

    def capture(self, state_dict: Any, engine, direct_io: str) -> None:
        self.captured_at = time.perf_counter()
        sources: list[TensorSource] = []
        index: dict[tuple, int] = {}
        to_hash: list[tuple] = []  # (source index, key, tensor to hash, name) of the tensors hashed
        inc = self.increment

        def on_tensor(value: torch.Tensor, name: str) -> torch.Tensor:
            local = _dcp_compat.local_shard(value)
            try:
                key = source_key(local)
            except RuntimeError as exc:  # tensor subclasses without storage
                raise TypeError(f"state dict entry {name!r} ({type(value).__name__}) has no plain storage to save") from exc
            if key not in index:
                index[key] = len(sources)
                sources.append(tensor_source(value, name))
                self._versions.append((name, local, _dcp_compat.version_counter(local)))
                # Hashed: large tensors that did not change since the tracker's last save (never a
                # proof; see incremental.py), keyed as DCP's plan will name their chunk.
                if inc is not None and sources[-1].nbytes >= SMALL_TENSOR_BYTES:
                    offsets = (0,) * value.dim() if local is value else _dcp_compat.dtensor_chunk_offsets(value)
                    chunk_key = (name, offsets)
                    wrapper = value if local is not value else None
                    if offsets is not None and (
                        inc.tracker is None or not inc.tracker.changed_since_last(chunk_key, local, wrapper)
                    ):
                        # The source's tensor: a CUDA one is contiguous already (copied on the
                        # caller's stream, before the ready event), another accelerator's on the host.
                        to_hash.append((len(sources) - 1, key, sources[-1].tensor, chunk_key))
            if local is not value:
                # In-place ops on a DTensor bump the DTensor's counter, not its shard's
                # (they reach the shard below autograd): watch both.
                self._versions.append((name, value, _dcp_compat.version_counter(value)))
            # Staged entries alias the caller's memory (metadata only). A plain
            # tensor is detached so that reassigning ``param.data`` later does
            # not change what the staged entry points at.
            return value if local is not value else value.detach()

        self.staged_dict = _copy_structure(state_dict, on_tensor, "")
        # CUDA: what the hashing thread reads and copies was written on the caller's streams
        # (recorded after every contiguous() above was queued).
        self._ready = incremental.ready_events(t for _, _, t, _ in to_hash) if to_hash else {}
        hashed = {i for i, *_ in to_hash}
        now = [i for i in range(len(sources)) if i not in hashed]
        offsets, self.tensor_bytes_end = place_tensors([sources[i].nbytes for i in now])
        at = dict(zip(now, offsets))
        self.placed = {k: (at[i], sources[i].nbytes) for k, i in index.items() if i in at}
        regions, keep = finish_regions([(sources[i], at[i]) for i in now])
        staging_only = self.compression is not None  # a scratch file, compressed into the data file and removed
        try:
            self.job = self.dest.start_write(
                engine, self.staging_file or self.data_file, regions, keep, preallocate=self.tensor_bytes_end,
                # Buffered and never fsynced: read back at once (from the page cache) and removed.
                direct_io="off" if staging_only else direct_io, durable=not staging_only,
            )
        except OSError as exc:
            raise with_reserved_keys(exc, list(dict.fromkeys(name for name, *_ in self._versions))) from exc
        if not to_hash:
            self.hashed.set()
            return
        work = [(sources[i], key, tensor, chunk_key) for i, key, tensor, chunk_key in to_hash]
        self._hashing = threading.Thread(
            target=self._hash_and_place, args=(work,), name="dcp_datastates-snapshot-hash", daemon=True
        )
        self._hashing.start()

    def _hash_and_place(self, work: list) -> None:
        """Background: hash the set-aside tensors, refer to the base's identical chunks, place and
        append the others to the job after the tensors placed at capture."""
        inc = self.increment
        try:
            base = inc.load_base()
            if base is not None:
                base.check_sibling_of(self.directory)
            digests = incremental.hash_all(
                [tensor for _, _, tensor, _ in work], inc.threads, [ck[0] for _, _, _, ck in work], self._ready
            )
            changed = []
            for (source, key, tensor, chunk_key), digest in zip(work, digests):
                self.digests[key] = digest
                chunk = None
                if base is not None:
                    chunk = base.candidate_at(chunk_key, tensor.dtype, tuple(tensor.shape), source.nbytes)
                if chunk is not None and chunk.digest == digest:
                    self.references[key] = chunk
                else:
                    changed.append((source, key))
            if base is not None:
                base.confirm(self.references.values())
            if changed:
                start = align_up(self.tensor_bytes_end, PAGE)
                offsets, end = place_tensors([source.nbytes for source, _ in changed])
                for (source, key), off in zip(changed, offsets):
                    self.placed[key] = (start + off, source.nbytes)
                regions, keep = finish_regions(
                    [(source, start + off) for (source, _), off in zip(changed, offsets)], self._ready
                )
                keep += list(self._ready.values())
                self.job.append(regions, keep)
                self.tensor_bytes_end = start + end
        except BaseException as exc:  # noqa: BLE001 - delivered through the save
            self.staging_error = exc
            stop_write_job(self.job, f"hashing for an incremental snapshot failed: {exc}")
        finally:
            self.hashed.set()

    # -- placement, read by the save ------------------------------------------------

    def locations_for(self, items) -> dict:
        """``location_key -> (offset, nbytes)`` of the plan's tensor items, as placed by
        :meth:`capture`.

        Items name tensors by DCP's flattened keys; the staged dict is
        flattened by DCP's own function (a planner that does not flatten
        names top-level keys, which are looked up as they are).
        """
        self.hashed.wait()
        if self.staging_error is not None:
            raise self.staging_error
        staged = self.staged_dict
        flat = _dcp_compat.flatten_state_dict(staged) if isinstance(staged, Mapping) else {}
        out = {}
        self.item_references, self.item_digests = {}, {}
        for item in items:
            if item.type == WriteItemType.BYTE_IO:
                continue
            fqn = item.index.fqn
            value = flat.get(fqn)
            if value is None and isinstance(staged, Mapping):
                value = staged.get(fqn)
            skey = self._source_key_of(value) if isinstance(value, torch.Tensor) else None
            placed = self.placed.get(skey) if skey is not None else None
            lkey = location_key(fqn, item.index.offset)
            if skey in self.digests:
                self.item_digests[lkey] = self.digests[skey]
            if placed is None and skey in self.references:
                chunk = self.references[skey]
                if chunk.length != tensor_item_nbytes(item):
                    raise CheckpointError(f"{fqn!r}: the snapshot refers to {chunk.length} bytes, the plan expects {tensor_item_nbytes(item)}")
                self.item_references[lkey] = chunk
                continue
            if placed is None:
                raise CheckpointError(
                    f"the save plan holds {fqn!r}, which the snapshot taken by stage() does not; a planner "
                    "that changes the state dict's tensors is not supported with dcp.async_save"
                )
            expected = tensor_item_nbytes(item)
            if placed[1] != expected:
                raise CheckpointError(f"{fqn!r}: the snapshot holds {placed[1]} bytes, the plan expects {expected}")
            out[lkey] = placed
        return out

    def _source_key_of(self, value: torch.Tensor) -> tuple | None:
        try:
            return source_key(_dcp_compat.local_shard(value))
        except RuntimeError:
            return None

    # -- staging completion (the staging monitor's thread) -------------------------

    def await_staged(self) -> None:
        """Wait until every byte left the caller's tensors; record why not, if so."""
        try:
            self.hashed.wait()  # the hashed tensors are referred to or appended to the job
            if self.staging_error is not None:
                return  # raised by the save (locations_for)
            ok = self.job.wait_staged()
            self.staged_s = time.perf_counter() - self.captured_at
            if not ok:
                return  # the job's own error (file, offset, errno) is raised by write_data
            changed = [name for name, t, v in self._versions if _dcp_compat.version_counter(t) != v]
            self._versions = []
            if changed:
                shown = ", ".join(repr(n) for n in changed[:5]) + (f" and {len(changed) - 5} more" if len(changed) > 5 else "")
                self.staging_error = SnapshotMutatedError(
                    f"{len(changed)} tensor(s) were modified in place while the snapshot for {self.directory} "
                    f"was still copying them ({shown}); the save is failed rather than committing a torn "
                    "checkpoint. Wait for the staging future, or use dcp_datastates.install_fence(optimizer), "
                    "before the optimizer step."
                )
        except BaseException as exc:  # noqa: BLE001 - delivered through the save
            self.staging_error = exc
        finally:
            self.staged.set()

    # -- the hand-off: taken, begun, ended, or abandoned --------------------------------

    def take(self, thread: threading.Thread) -> None:
        """``thread`` took the staged dict: it runs this snapshot's save (first taker wins)."""
        with self._lock:
            if self.taker is not None or self.abandoned:
                return
            self.taker = thread
        runtime().order.assign(self.ticket, thread)

    def begin(self) -> None:
        """The save of this snapshot begins (the writer's ``storage_meta``); raises if abandoned."""
        with self._lock:
            if self.abandoned:
                raise CheckpointError(
                    f"the asynchronous snapshot staged into {self.directory} was given up before its save "
                    f"began ({self.abandoned}), so nothing was saved (the tensors may have changed since); "
                    "save again"
                )
            self.begun = True

    def abandon(self, why: str) -> bool:
        """Give up a snapshot whose save has not begun: stop its copies, remove its files,
        release its place in the order. Returns False (and does nothing) once begun."""
        with self._lock:
            if self.begun or self.abandoned:
                return False
            self.abandoned = why
        self.cancel(why)
        self.staged.set()
        self.release()
        if self.ticket is not None:
            runtime().order.end(self.ticket)
        runtime().forget(self)
        return True

    def end(self) -> None:
        """The save of this snapshot ended (committed or failed): drop what it held."""
        self.release()
        runtime().forget(self)

    def release(self) -> None:
        """Drop the aliases of the caller's tensors and the engine job, so that a writer used for
        thousands of saves holds nothing (the staged dict stays in the future DCP holds)."""
        self.staged_dict = None
        self.placed = {}
        self._versions = []
        self.job = None
        self.references, self.digests = {}, {}

    def cancel(self, why: str, remove: bool = True) -> None:
        """Stop the engine job and (``remove``) remove this snapshot's files (the save failed or
        was given up)."""
        stop_write_job(self.job, why)
        if remove:
            self.dest.remove([self.data_file, self.index_file, self.staging_file or self.data_file])


def _copy_structure(obj: Any, on_tensor, name: str) -> Any:
    """The state dict's structure with tensors passed to ``on_tensor`` and other values copied."""
    if isinstance(obj, torch.Tensor):
        return on_tensor(obj, name)
    if isinstance(obj, Mapping):
        items = [(k, _copy_structure(v, on_tensor, f"{name}.{k}" if name else str(k))) for k, v in obj.items()]
        if type(obj) is dict:
            return dict(items)
        out = copy.copy(obj)
        for k, v in items:
            out[k] = v
        return out
    if isinstance(obj, list):
        return [_copy_structure(v, on_tensor, f"{name}.{i}") for i, v in enumerate(obj)]
    if isinstance(obj, tuple):
        values = [_copy_structure(v, on_tensor, f"{name}.{i}") for i, v in enumerate(obj)]
        return type(obj)(*values) if hasattr(obj, "_fields") else type(obj)(values)
    if isinstance(obj, _IMMUTABLE):
        return obj
    try:
        return copy.deepcopy(obj)
    except Exception as exc:
        raise TypeError(
            f"state dict entry {name!r} ({type(obj).__name__}) cannot be copied for an asynchronous "
            f"snapshot: {exc}"
        ) from exc

