"""``CheckpointManager``: step-numbered checkpoints of a run, retention, and resume.

What torchtitan's, Lightning's and Orbax's checkpoint managers do, on top of
``DataStatesWriter``/``DataStatesReader``, with these guarantees:

* **Step directories.** Step N lives in ``ROOT/step_<N>`` (see
  :mod:`checkpoint_root`); it is a checkpoint once it is committed (its
  ``.metadata`` was renamed into place after every byte was fsynced).
* **An atomic ``latest`` pointer**, replaced only after the checkpoint it
  names is committed and its directory entry is durable (fsynced), so it
  never names a checkpoint that could vanish in a power loss.
* **Retention** (``keep_last``, ``keep_every``) deletes a checkpoint only
  after a newer one has committed, never the newest committed one, and never
  one with a larger step than the one just committed. A deletion removes
  ``.metadata`` first, so a crash during it leaves an uncommitted directory,
  never a committed one with files missing.
* **Resume** (:meth:`load` with no step) takes the newest committed
  checkpoint that loads; an incomplete or corrupt one is skipped with a
  :class:`SkippedCheckpointWarning` saying why, and the next older is tried.
  Every byte loaded is checksum-verified; ``full_verify=True`` also checks
  every byte the load would not read (:func:`dcp_datastates.verify`).
* **Cleanup of crashes.** When the manager starts (rank 0), it removes step
  directories that were never committed, files inside committed checkpoints
  that they do not name (rank files of a killed overwrite, a leftover
  ``.metadata`` temporary), and a stale pointer is moved to the newest
  committed step (the crash fell between a commit and its pointer update).
* **Asynchronous saves** go through ``dcp.async_save``: :meth:`save` returns
  once the snapshot is enqueued, and a process-wide optimizer step pre-hook
  (the fence) makes any ``optimizer.step()`` wait while a snapshot is still
  copying. Errors of background saves are raised by the next :meth:`save`,
  :meth:`wait` or :meth:`close`.

Distributed: every rank constructs the manager and calls :meth:`save` and
:meth:`load` with its part of the state (SPMD, like ``dcp.save``); rank 0 of
the group alone touches the pointer, retention and cleanup.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import threading
import warnings
from concurrent.futures import Future
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from . import _native
from .checkpoint_root import (
    LATEST_FILE,
    LATEST_TMP_RE,
    is_committed,
    read_latest,
    step_dir_name,
    step_dirs,
    write_latest,
)
from .commit import fsync_dir, remove_if_present
from .errors import (
    CheckpointError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    UnsafeCheckpointError,
    UnsupportedFormatError,
)
from .fence import install_global_fence
from .format import DATA_FILE_RE, METADATA_FILE
from .reader import DataStatesReader
from .writer import DataStatesWriter


class SkippedCheckpointWarning(UserWarning):
    """A checkpoint was passed over on resume (incomplete or corrupt) or removed as a crash leftover."""


# Errors that mean "this checkpoint's files are bad", so resume tries an older one.
# Anything else (a state dict that does not match, unsafe objects) is the caller's
# problem and is raised: falling back would hide it.
_DATA_ERRORS = (CorruptCheckpointError, IncompleteCheckpointError, CheckpointNotFoundError, UnsupportedFormatError, OSError)


class ManagedSave(Future):
    """The future :meth:`CheckpointManager.save` returns, with the step, its directory and,
    once done, the writer's :class:`SaveStats` (``last_save_stats``)."""

    def __init__(self, step: int, path: str, writer: DataStatesWriter) -> None:
        super().__init__()
        self.step = step
        self.path = path
        self._writer = writer

    @property
    def last_save_stats(self):
        return self._writer.last_save_stats


@dataclasses.dataclass
class _PendingSave:
    step: int
    path: str
    seq: int
    writer: DataStatesWriter
    upload: Any  # DCP's upload future (torch.futures-like or concurrent.futures.Future)
    done: ManagedSave  # completes after the pointer and retention (rank 0) or the upload (others)
    error: BaseException | None = None  # a pointer/retention failure after a committed save
    reported: bool = False


class CheckpointManager:
    """Step-numbered checkpoints under ``root`` with retention, an atomic pointer and resume.

    Args:
        root: the run's checkpoint directory (created if missing).
        keep_last: keep the newest ``keep_last`` committed checkpoints (``None``: keep all).
        keep_every: also keep every checkpoint whose step is a multiple of this, forever.
        async_save: save with ``dcp.async_save`` (:meth:`save` returns at once) or ``dcp.save``.
        host_cache_bytes, io_threads, direct_io: passed to :class:`DataStatesWriter`.
        process_group: the group DCP saves and loads on. By default, with
            ``async_save`` in a distributed run, a new gloo group, so the
            background save's collectives never interleave with training's.
        fence: install the process-wide optimizer step pre-hook that waits
            for in-flight snapshots (asynchronous saves only).
        allow_pickle: load checkpoints whose objects need arbitrary unpickling
            (only checkpoints you trust; see :class:`DataStatesReader`).
        cleanup: on start (rank 0), remove crash leftovers (see module docs).
    """

    def __init__(
        self,
        root: str | os.PathLike,
        *,
        keep_last: int | None = 3,
        keep_every: int | None = None,
        async_save: bool = True,
        host_cache_bytes: int = _native.DEFAULT_HOST_CACHE_BYTES,
        io_threads: int = _native.DEFAULT_IO_THREADS,
        direct_io: str = "auto",
        process_group: Any = None,
        fence: bool = True,
        allow_pickle: bool = False,
        cleanup: bool = True,
    ) -> None:
        if keep_last is not None and (not isinstance(keep_last, int) or keep_last < 1):
            raise ValueError(f"keep_last must be a positive int or None (keep all), got {keep_last!r}")
        if keep_every is not None and (not isinstance(keep_every, int) or keep_every < 1):
            raise ValueError(f"keep_every must be a positive int or None, got {keep_every!r}")
        self.root = os.path.abspath(os.fspath(root))
        self.keep_last = keep_last
        self.keep_every = keep_every
        self.async_save = async_save
        self.allow_pickle = allow_pickle
        self._writer_options = dict(host_cache_bytes=host_cache_bytes, io_threads=io_threads, direct_io=direct_io)
        self._distributed = dist.is_available() and dist.is_initialized()
        if self._distributed and process_group is None and async_save:
            process_group = dist.new_group(backend="gloo")
        self._group = process_group
        self._rank = dist.get_rank(process_group) if self._distributed else 0
        self._fence = fence and async_save
        self._lock = threading.Lock()
        self._pending: list[_PendingSave] = []
        self._seq = 0
        self._pointed_seq = -1
        self._replaceable: set[int] = set()  # committed steps a save may overwrite (skipped or abandoned)
        self._closed = False
        os.makedirs(self.root, exist_ok=True)
        if self._rank == 0 and cleanup:
            self._recover()
        self._barrier()

    # -- public API -------------------------------------------------------------

    def steps(self) -> list[int]:
        """The steps of every committed checkpoint under ``root``, ascending."""
        return sorted(step for step, name in step_dirs(self.root).items() if is_committed(os.path.join(self.root, name)))

    def latest(self) -> int | None:
        """The newest committed step, or None. (Not verified: :meth:`load` skips a bad one.)"""
        steps = self.steps()
        return steps[-1] if steps else None

    def path_of(self, step: int) -> str:
        return os.path.join(self.root, step_dir_name(step))

    def save(self, step: int, state: dict, *, overwrite: bool = False) -> ManagedSave:
        """Checkpoint ``state`` as step ``step``; returns a future of its completion.

        Asynchronous (the default): returns once the snapshot is enqueued; the
        future completes when the checkpoint is committed and (rank 0) the
        pointer and retention are done. Synchronous: returns after all that,
        with the future already done. A step that already has a committed
        checkpoint is refused unless ``overwrite`` (or the checkpoint was
        skipped or abandoned by :meth:`load`); an overwrite is crash-safe.
        """
        if self._closed:
            raise RuntimeError("CheckpointManager is closed")
        self._raise_finished_errors()
        path = self.path_of(step)
        replace = overwrite or step in self._replaceable
        if not replace and is_committed(path):
            raise CheckpointExistsError(
                f"{path} already holds a committed checkpoint of step {step}; pass overwrite=True to replace it"
            )
        if any(p.step == step and not p.done.done() for p in self._pending):
            raise CheckpointExistsError(f"a save of step {step} into {path} is still in flight")
        writer = DataStatesWriter(path, overwrite=replace, **self._writer_options)
        with self._lock:
            self._seq += 1
            seq = self._seq
        if not self.async_save:
            try:
                dcp.save(state, storage_writer=writer, checkpoint_id=path, **self._dcp_kwargs())
            finally:
                writer.close()
            pending = _PendingSave(step, path, seq, writer, None, ManagedSave(step, path, writer), reported=True)
            self._after_commit(pending)
            pending.done.set_result(None)
            if pending.error is not None:
                raise pending.error
            self._replaceable.discard(step)
            return pending.done
        if self._fence:
            install_global_fence()
        resp = dcp.async_save(state, storage_writer=writer, checkpoint_id=path, **self._dcp_kwargs())
        upload = getattr(resp, "upload_completion", resp)
        pending = _PendingSave(step, path, seq, writer, upload, ManagedSave(step, path, writer))
        with self._lock:
            self._pending.append(pending)
        self._replaceable.discard(step)
        upload.add_done_callback(lambda _f, p=pending: self._on_upload_done(p))
        return pending.done

    def wait(self) -> None:
        """Wait for every save in flight; raise the first error none has raised yet."""
        with self._lock:
            pending = list(self._pending)
        for p in pending:
            try:
                p.done.result()
            except BaseException:  # noqa: BLE001 - reported below, once
                pass
        self._raise_finished_errors()

    def load(self, state: dict, step: int | None = None, *, full_verify: bool = False) -> int | None:
        """Load a checkpoint into ``state`` in place; return its step.

        ``step=None`` resumes from the newest committed checkpoint that loads,
        skipping incomplete and corrupt ones with a :class:`SkippedCheckpointWarning`,
        and returns None (``state`` untouched) when the root has no committed
        checkpoint at all. An explicit ``step`` is loaded or raises. Every byte
        loaded is checksum-verified; ``full_verify`` first checks every byte of
        the checkpoint (rank 0, with :func:`dcp_datastates.verify`).

        A load that fails part-way may have filled part of ``state``; the
        next candidate overwrites every entry, and if none loads, the error
        lists why each was refused.
        """
        self.wait()
        # Rank 0's view of the root, so every rank tries the same candidates in the same order.
        committed, on_disk = self._from_rank0((self.steps(), sorted(step_dirs(self.root))) if self._rank == 0 else None)
        if step is not None:
            if step not in committed:
                path = self.path_of(step)
                if os.path.isdir(path):
                    raise IncompleteCheckpointError(
                        f"{path}: the checkpoint of step {step} was never committed (an interrupted or failed save)"
                    )
                raise CheckpointNotFoundError(f"no checkpoint of step {step} under {self.root} (committed: {committed})")
            candidates = [step]
        else:
            candidates = committed[::-1]
            uncommitted = sorted(set(on_disk) - set(committed))
            for s in uncommitted:
                if not candidates or s > candidates[0]:
                    _warn(f"skipping {self.path_of(s)}: it was never committed (an interrupted or failed save)")
            if not candidates:
                return None
        refused: list[str] = []
        for s in candidates:
            path = self.path_of(s)
            why = self._agree(self._check(path, full_verify))
            if why is None:
                why = self._try_load(state, path)
            if why is None:
                self._replaceable.update(c for c in committed if c > s)
                return s
            if step is not None:
                raise CorruptCheckpointError(f"cannot load step {s}: {why}")
            refused.append(f"step {s}: {why}")
            self._replaceable.add(s)
            _warn(f"skipping the checkpoint of step {s} ({path}): {why}; trying an older one")
        raise CorruptCheckpointError(
            f"no checkpoint under {self.root} could be loaded:\n  " + "\n  ".join(refused)
        )

    def close(self) -> None:
        """Wait for the saves in flight (raising their errors); the manager cannot save afterwards."""
        if self._closed:
            return
        try:
            self.wait()
        finally:
            self._closed = True

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            try:
                self.close()
            except Exception:  # noqa: BLE001 - the exception already propagating wins
                pass

    # -- saving -------------------------------------------------------------------

    def _dcp_kwargs(self) -> dict:
        if not self._distributed:
            return {"no_dist": True}
        return {"process_group": self._group}

    def _on_upload_done(self, pending: _PendingSave) -> None:
        """Runs in DCP's save thread once the checkpoint is committed (or failed)."""
        exc: BaseException | None = None
        try:
            exc = _future_exception(pending.upload)
            if exc is None:
                self._after_commit(pending)
        except BaseException as unexpected:  # noqa: BLE001 - must reach the future, not the void
            exc = unexpected
        finally:
            exc = pending.error or exc
            if exc is None:
                pending.done.set_result(None)
            else:
                pending.done.set_exception(exc)

    def _after_commit(self, pending: _PendingSave) -> None:
        """Rank 0: make the commit durable, move the pointer, apply retention."""
        if self._rank != 0:
            return
        try:
            with self._lock:
                fsync_dir(pending.path)
                fsync_dir(self.root)  # the step directory's own entry
                if pending.seq > self._pointed_seq:
                    write_latest(self.root, pending.step)
                    self._pointed_seq = pending.seq
                self._apply_retention(pending.step)
        except BaseException as exc:  # noqa: BLE001 - the checkpoint itself is committed
            pending.error = CheckpointError(
                f"the checkpoint of step {pending.step} is committed in {pending.path}, but updating "
                f"{os.path.join(self.root, LATEST_FILE)} or applying retention failed: {exc}"
            )
            pending.error.__cause__ = exc

    def _apply_retention(self, committed_step: int) -> None:
        """Delete committed checkpoints older than ``committed_step`` that the policy does not keep,
        and uncommitted step directories older than it that no save of ours is writing."""
        dirs = step_dirs(self.root)
        committed = sorted(s for s, name in dirs.items() if is_committed(os.path.join(self.root, name)))
        keep = {committed_step}
        if self.keep_last is None:
            keep.update(committed)
        else:
            keep.update(committed[-self.keep_last:])
        if self.keep_every is not None:
            keep.update(s for s in committed if s % self.keep_every == 0)
        in_flight = {p.step for p in self._pending if not p.done.done()}
        for s, name in sorted(dirs.items()):
            if s >= committed_step or s in keep or s in in_flight:
                continue
            delete_checkpoint_dir(os.path.join(self.root, name))

    def _raise_finished_errors(self) -> None:
        """Close the writers of finished saves; raise the first error not yet raised."""
        with self._lock:
            finished = [p for p in self._pending if p.done.done()]
            self._pending = [p for p in self._pending if not p.done.done()]
        first: BaseException | None = None
        for p in finished:
            try:
                p.writer.close()  # raises the writer's record of a failed background save
            except Exception as exc:  # noqa: BLE001
                first = first or CheckpointError(f"the asynchronous save of step {p.step} into {p.path} failed: {exc}")
                if first.__cause__ is None:
                    first.__cause__ = exc
                continue
            err = p.done.exception()
            if err is not None and first is None:
                first = err if isinstance(err, CheckpointError) else CheckpointError(
                    f"the asynchronous save of step {p.step} into {p.path} failed: {_describe(err)}"
                )
        if first is not None:
            raise first

    # -- loading ------------------------------------------------------------------

    def _check(self, path: str, full_verify: bool) -> str | None:
        """Why ``path`` cannot be loaded, found without reading tensor data (or all of it with
        ``full_verify``, on rank 0); None when it looks loadable."""
        try:
            if full_verify:
                if self._rank == 0:
                    from .verify import verify

                    report = verify(path, allow_pickle=self.allow_pickle)
                    if not report.ok:
                        return "; ".join(report.problems[:3]) or "not committed"
                return None
            reader = DataStatesReader(path, allow_pickle=self.allow_pickle)
            reader.read_metadata()
            for files in reader._layout.ranks:
                reader.rank_index(files.data_file)
        except UnsafeCheckpointError:
            raise
        except _DATA_ERRORS as exc:
            return _describe(exc)
        return None

    def _try_load(self, state: dict, path: str) -> str | None:
        reader = DataStatesReader(path, allow_pickle=self.allow_pickle)
        kwargs = {"process_group": self._group} if self._distributed else {"no_dist": True}
        try:
            dcp.load(state, storage_reader=reader, checkpoint_id=path, **kwargs)
        except (Exception, CheckpointException) as exc:  # noqa: BLE001 - classified below
            inner = _unwrap(exc)
            if isinstance(inner, _DATA_ERRORS) and not isinstance(inner, UnsafeCheckpointError):
                return _describe(inner)
            if inner is exc:
                raise
            raise inner from exc
        return None

    def _agree(self, why: str | None) -> str | None:
        """Every rank's verdict on a checkpoint, combined: bad on one rank is bad on all."""
        if not self._distributed:
            return why
        verdicts: list[Any] = [None] * dist.get_world_size(self._group)
        dist.all_gather_object(verdicts, why, group=self._group)
        bad = [f"rank {r}: {v}" for r, v in enumerate(verdicts) if v is not None]
        return "; ".join(bad) if bad else None

    def _from_rank0(self, value: Any) -> Any:
        if not self._distributed:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=dist.get_global_rank(self._group, 0) if self._group else 0, group=self._group)
        return box[0]

    def _barrier(self) -> None:
        if self._distributed:
            dist.barrier(group=self._group)

    # -- crash recovery -----------------------------------------------------------

    def _recover(self) -> None:
        """Remove what crashed saves left behind and repair a stale pointer (rank 0, at start)."""
        for name in os.listdir(self.root):
            if LATEST_TMP_RE.match(name):
                remove_if_present([os.path.join(self.root, name)])
        dirs = step_dirs(self.root)
        committed = []
        for s, name in sorted(dirs.items()):
            path = os.path.join(self.root, name)
            if not is_committed(path):
                _warn(f"removing {path}: a checkpoint that was never committed (left by an interrupted save)")
                delete_checkpoint_dir(path)
                continue
            committed.append(s)
            for stray in stray_files(path, self.allow_pickle):
                remove_if_present([os.path.join(path, stray)])
        try:
            pointed = read_latest(self.root)
        except ValueError as exc:
            _warn(f"{exc}; rewriting it")
            pointed = None
        if committed and pointed != committed[-1]:
            newest = self.path_of(committed[-1])
            fsync_dir(newest)
            fsync_dir(self.root)
            write_latest(self.root, committed[-1])
        elif not committed and pointed is not None:
            remove_if_present([os.path.join(self.root, LATEST_FILE)])
            fsync_dir(self.root)


def stray_files(path: str, allow_pickle: bool = False) -> list[str]:
    """Files in the committed checkpoint ``path`` that it does not name (safe to delete).

    Rank files of an earlier save into the same directory that was killed,
    and ``.metadata`` temporaries. Returns [] when the metadata cannot be read
    (a damaged checkpoint is left exactly as it is).
    """
    try:
        reader = DataStatesReader(path, allow_pickle=allow_pickle)
        reader.read_metadata()
    except (CheckpointError, OSError):
        return []
    named = {n for r in reader._layout.ranks for n in (r.data_file, r.index_file)}
    out = []
    for name in sorted(os.listdir(path)):
        if DATA_FILE_RE.match(name) and name not in named:
            out.append(name)
        elif name.startswith(METADATA_FILE + ".") and name.endswith(".tmp"):
            out.append(name)
    return out


def delete_checkpoint_dir(path: str) -> None:
    """Delete a checkpoint directory so that no crash can leave it committed but partial.

    ``.metadata`` goes first and the directory is fsynced: from then on the
    directory is an uncommitted leftover, which readers refuse and the next
    manager start removes.
    """
    remove_if_present([os.path.join(path, METADATA_FILE)])
    fsync_dir(path)
    shutil.rmtree(path)
    fsync_dir(os.path.dirname(path))


def _future_exception(fut) -> BaseException | None:
    if isinstance(fut, Future):
        return fut.exception()
    try:
        fut.wait()
    except BaseException as exc:  # noqa: BLE001 - torch futures raise the save's error
        return exc
    return None


def _unwrap(exc: BaseException) -> BaseException:
    """The error a rank raised, out of DCP's CheckpointException (first failing rank)."""
    if isinstance(exc, CheckpointException) and exc.failures:
        inner = next(iter(exc.failures.values()))
        inner = inner[0] if isinstance(inner, tuple) else getattr(inner, "exc", inner)
        return inner if isinstance(inner, BaseException) else exc
    return exc


def _describe(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return " ".join(text.split())


def _warn(message: str) -> None:
    warnings.warn(message, SkippedCheckpointWarning, stacklevel=3)
