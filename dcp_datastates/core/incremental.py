"""Incremental saves: refer to a base checkpoint's bytes instead of writing them again.

A save given a *base* (a committed checkpoint in a sibling directory) writes
only the large tensor chunks whose bytes changed since the base; for every
other one the new checkpoint's layout refers to the base's file, offset and
checksums (format 8, ``RankFiles.base``). Loading, resharding and verify
follow the reference like any other rank's files: the bytes are checked
against the base rank's own index, whose save id the reference records.

Proving "identical" (docs/incremental.md):

- A chunk is a *candidate* when the base holds a raw (uncompressed) chunk at
  the same key and chunk offsets, of the same dtype, shape and byte length,
  with a content digest recorded when it was saved.
- It is referred to only when its XXH3-128 digest, computed now from the
  tensor itself, equals the base's. The CRC-32C the engine computes is no
  first filter here: it costs more per byte than XXH3 (benchmarks/bench_hashes.py),
  and a candidate's bytes are not written, so no CRC of them is computed.
- Version counters are never a proof (writes through ``.data``, NumPy or
  DLPack aliases and kernels writing by pointer do not bump them). They only
  ever save work in the safe direction: a chunk whose tensor's counter or
  storage changed since the previous save of the same :class:`ChangeTracker`
  is written without hashing (and without a digest: a later save hashes it
  once it stops changing). A chunk is never referred to without a digest
  match.

Chains stay one hop: a chunk the base itself refers to is referred to in the
base's base directly (its ``RankFiles`` is taken over as the base lists it).
"""

from __future__ import annotations

import dataclasses
import math
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType

from dcp_datastates.core.placement import SMALL_TENSOR_BYTES
from dcp_datastates.core.providers import ready_event
from dcp_datastates.errors import CheckpointError
from dcp_datastates.format.checkpoint_layout import ItemLocation, RankFiles, location_key
from dcp_datastates.format.file_names import BASE_NAME_RE

HASH_PIECE_BYTES = 64 << 20  # a device tensor is hashed through host copies of at most this


def load_xxhash():
    try:
        import xxhash
    except ImportError as exc:  # a dependency; a --no-deps install may lack it
        raise ImportError(
            "incremental checkpoints hash tensor chunks with XXH3-128: pip install xxhash"
        ) from exc
    return xxhash


def content_digest(tensor: torch.Tensor, ready: torch.cuda.Event | None = None) -> str:
    """XXH3-128 of the tensor's bytes in row-major order, as 32 lowercase hex digits.

    Host tensors are hashed where they are (the binding releases the
    interpreter lock, so several hash in parallel); a non-contiguous one
    through a contiguous copy. A CUDA tensor is hashed on the host, through
    pieces of at most ``HASH_PIECE_BYTES`` copied into pinned memory
    (:func:`_cuda_digest`; ``ready``: an event the copies wait for first);
    another accelerator's through synchronous copies of such pieces.
    """
    t = tensor.detach()
    if t.device.type == "cpu":
        return load_xxhash().xxh3_128_hexdigest(_host_bytes(t.contiguous()))
    if t.device.type == "cuda":
        return _cuda_digest(t, ready)
    return digest_in_pieces(_flat_bytes(t.contiguous()), HASH_PIECE_BYTES)


def _flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as a 1-D uint8 view."""
    return t.view(-1).view(torch.uint8)


_HASH_STREAMS: dict[int, torch.Stream] = {}
_HASH_STREAMS_LOCK = threading.Lock()


def _hash_stream(device: torch.device):
    """The stream CUDA tensors on ``device`` are copied for hashing on: one per device for the
    process, created by the engine rather than taken from torch's pool of streams (which
    NCCL's and FSDP's streams are taken from too, so copies there could delay collectives)."""
    with _HASH_STREAMS_LOCK:
        stream = _HASH_STREAMS.get(device.index)
        if stream is None:
            from dcp_datastates.native.engine import new_cuda_stream

            with torch.cuda.device(device):
                stream = torch.cuda.ExternalStream(new_cuda_stream(), device=device)
            _HASH_STREAMS[device.index] = stream
        return stream


def _cuda_digest(t: torch.Tensor, ready: torch.cuda.Event | None) -> str:
    """A CUDA tensor's digest, from copies on a stream of the hashing's own.

    The stream first waits for ``ready`` (recorded on the caller's stream
    when the save began; without one, for the caller's current stream now).
    On the caller's stream the copies would queue behind the forward and
    backward kernels the training loop issues while an asynchronous snapshot
    hashes, and hold those up in turn.
    """
    stream = _hash_stream(t.device)
    if ready is not None:
        stream.wait_event(ready)
    else:
        stream.wait_stream(torch.cuda.current_stream(t.device))
    try:
        with torch.cuda.stream(stream):
            return digest_in_pieces(_flat_bytes(t.contiguous()), HASH_PIECE_BYTES, pin_memory=True)
    finally:
        # On an error, nothing queued may still read ``t`` (or the contiguous copy) once it is freed.
        stream.synchronize()


def digest_in_pieces(flat: torch.Tensor, piece_bytes: int, pin_memory: bool = False) -> str:
    """XXH3-128 of a 1-D uint8 tensor, copied to the host a piece at a time.

    Two host buffers alternate: the copy of piece k+1 is queued before piece
    k is hashed, so on a device the transfer and the hashing overlap. On a
    CUDA stream (the current one) the copies are asynchronous into pinned
    buffers of exactly ``piece_bytes`` (one size, so torch's caching host
    allocator reuses them from call to call), and each piece is hashed once
    its own event completed; elsewhere they are plain copies (how the piece
    logic is tested without a device).
    """
    state = load_xxhash().xxh3_128()
    n = flat.numel()
    if n == 0:
        return state.hexdigest()
    cuda = flat.device.type == "cuda"
    pinned = pin_memory and cuda
    size = piece_bytes if pinned else min(piece_bytes, n)
    buffers = [torch.empty(size, dtype=torch.uint8, pin_memory=pinned) for _ in range(1 if n <= piece_bytes else 2)]
    pending = None  # (host bytes of the piece in flight, its event or None)
    for k, start in enumerate(range(0, n, piece_bytes)):
        length = min(piece_bytes, n - start)
        host = buffers[k % 2][:length]
        host.copy_(flat[start : start + length], non_blocking=cuda)
        event = None
        if cuda:
            event = torch.cuda.Event(blocking=True)  # a waiting thread sleeps instead of spinning
            event.record()
        if pending is not None:
            _hash_piece(state, *pending)
        pending = (host, event)
    _hash_piece(state, *pending)
    return state.hexdigest()


def _hash_piece(state, host: torch.Tensor, event) -> None:
    if event is not None:
        event.synchronize()  # releases the interpreter lock while it waits
    state.update(_host_bytes(host))


def _host_bytes(t: torch.Tensor) -> memoryview:
    """A contiguous host tensor's bytes, without a copy."""
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


@dataclasses.dataclass(frozen=True)
class BaseChunk:
    """A raw chunk of the base whose content digest is known: where its bytes are."""

    files: RankFiles  # as the new checkpoint lists it (``base`` set: one hop)
    offset: int
    length: int
    digest: str
    dtype: torch.dtype
    sizes: tuple

    def location(self) -> ItemLocation:
        """The new checkpoint's location of an item referred to this chunk (its write result)."""
        return ItemLocation(self.files.data_path, self.offset, self.length, -1)


class BaseCheckpoint:
    """A committed checkpoint an incremental save refers to, read once: its chunks with digests.

    ``path`` must be a sibling of the checkpoints saved against it (the
    reference is ``../<name>/<file>``). The base is read with every check a
    load makes (its ``.metadata`` and layout); the bytes themselves are checked
    whenever a checkpoint referring to them is loaded or verified.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        from dcp_datastates.core.reader import DataStatesReader

        self.path = os.path.abspath(os.fspath(path))
        self.name = os.path.basename(self.path)
        if not BASE_NAME_RE.match(self.name):
            raise ValueError(f"base checkpoint {self.path}: its directory name {self.name!r} cannot be referred to")
        reader = DataStatesReader(self.path)
        metadata = reader.load_metadata()
        layout = reader.require_layout()  # a stock DCP checkpoint cannot be a base
        self.bases = set(layout.bases)
        slots = layout.slots()
        self._reader = reader
        self._in_base: dict[str, str] = {}  # a BaseChunk's files.data_path -> the same file as the base names it
        self.chunks: dict[tuple, BaseChunk] = {}
        for fqn, off, slot, offset, length, ordinal in layout.entries:
            digest = layout.digests.get((fqn, off))
            if digest is None or ordinal >= 0:
                continue
            md = metadata.state_dict_metadata.get(fqn)
            if not isinstance(md, TensorStorageMetadata):
                continue
            sizes = next((tuple(c.sizes) for c in md.chunks if tuple(c.offsets) == off), None)
            if sizes is None:
                continue
            files = slots[slot]
            in_base = files.data_path
            if not files.base:  # the base's own bytes: referred to in its directory
                files = dataclasses.replace(files, save_id=files.files_save_id(layout.save_id), base=self.name)
            self._in_base[files.data_path] = in_base
            self.chunks[(fqn, off)] = BaseChunk(files, offset, length, digest, md.properties.dtype, sizes)

    def confirm(self, chunks) -> None:
        """Every rank file ``chunks`` (the ones a save will refer to) are in is there, of the save
        the base names (its index's save id, checked by the base's reader as a load checks it): a
        file deleted or saved again since (a base's own base, say) is refused now, not committed
        into a checkpoint that cannot load. Only the files referred to: each index is read once."""
        for path in {chunk.files.data_path for chunk in chunks}:
            self._reader.rank_index(self._in_base[path])

    def check_sibling_of(self, path: str) -> None:
        """``path`` can save against this base: a sibling, not the base itself, and not a
        checkpoint the base refers to (saved again, its old files would go at the commit)."""
        check_sibling(path, self.path)
        name = os.path.basename(os.path.abspath(path))
        if name in self.bases:
            raise ValueError(
                f"an incremental save into {path} cannot refer to base checkpoint {self.path}: that base "
                f"refers to {name} itself, whose files the save would replace"
            )

    def candidate(self, item: WriteItem, nbytes: int) -> BaseChunk | None:
        """The base's chunk ``item`` may be identical to: same key, offsets, dtype, shape, length."""
        td = item.tensor_data
        if td is None:
            return None
        key = location_key(item.index.fqn, item.index.offset)
        return self.candidate_at(key, td.properties.dtype, tuple(td.chunk.sizes), nbytes)

    def candidate_at(self, key: tuple, dtype: torch.dtype, sizes: tuple, nbytes: int) -> BaseChunk | None:
        chunk = self.chunks.get(key)
        if chunk is None or chunk.length != nbytes or chunk.dtype != dtype or chunk.sizes != sizes:
            return None
        return chunk


class ChangeTracker:
    """What each large chunk's tensor looked like at the previous save (its storage and version
    counter), so that a chunk that changed since is written without hashing it.

    Only ever saves work: a chunk it calls unchanged is still hashed and
    compared before anything refers to it. One per run (``CheckpointManager``
    keeps one); thread-safe.
    """

    def __init__(self) -> None:
        self._seen: dict[tuple, tuple] = {}
        self._lock = threading.Lock()

    def changed_since_last(self, key: tuple, tensor: torch.Tensor, wrapper: torch.Tensor | None = None) -> bool:
        """Whether ``tensor`` (the chunk ``key``; ``wrapper``: the DTensor whose local shard it
        is, whose counter in-place ops bump) changed since the last call for ``key``; records
        it. A chunk never seen counts as unchanged (it is hashed)."""
        from dcp_datastates import _dcp_compat

        state = (
            tensor.device, tensor.untyped_storage().data_ptr(), tensor.storage_offset(),
            _dcp_compat.version_counter(tensor),
            _dcp_compat.version_counter(wrapper) if wrapper is not None else None,
        )
        with self._lock:
            before = self._seen.get(key)
            self._seen[key] = state
        return before is not None and before != state


@dataclasses.dataclass
class RankIncrement:
    """One rank's decisions: the chunks referred to, and the digests recorded."""

    references: dict = dataclasses.field(default_factory=dict)  # MetadataIndex -> BaseChunk
    digests: dict = dataclasses.field(default_factory=dict)  # location_key -> digest
    hashed_bytes: int = 0
    referenced_bytes: int = 0
    hash_s: float = 0.0


def decide(
    plan: SavePlan, resolve, base: BaseCheckpoint | None, tracker: ChangeTracker | None, threads: int,
) -> RankIncrement:
    """Hash the plan's large raw tensor chunks (``resolve(item)`` gives each one's tensor) and decide
    which the base holds identically. Chunks whose tensor changed since the tracker's last save
    are neither hashed nor referred to."""
    t0 = time.perf_counter()
    out = RankIncrement()
    work = []
    for item in plan.items:
        if item.type == WriteItemType.BYTE_IO or item.tensor_data is None:
            continue
        td = item.tensor_data
        nbytes = math.prod(td.chunk.sizes) * td.properties.dtype.itemsize
        if nbytes < SMALL_TENSOR_BYTES:
            continue  # small chunks are packed and written: a reference would save little
        tensor = resolve(item)
        key = location_key(item.index.fqn, item.index.offset)
        if tracker is not None and tracker.changed_since_last(key, tensor):
            continue
        work.append((item, key, tensor, base.candidate(item, nbytes) if base is not None else None, nbytes))
    if work:
        digests = hash_all([w[2] for w in work], threads, [w[0].index.fqn for w in work], ready_events(w[2] for w in work))
        for (item, key, _tensor, chunk, nbytes), digest in zip(work, digests):
            out.digests[key] = digest
            out.hashed_bytes += nbytes
            if chunk is not None and chunk.digest == digest:
                out.references[item.index] = chunk
                out.referenced_bytes += nbytes
        if base is not None:
            base.confirm(out.references.values())
    out.hash_s = time.perf_counter() - t0
    return out


@dataclasses.dataclass
class SnapshotIncrement:
    """What an asynchronous snapshot needs to save incrementally (see :mod:`snapshot`).

    ``base_path``: the base checkpoint, read by the snapshot's hashing thread (decoding its
    ``.metadata`` takes time proportional to its items: not in the caller's ``stage()``)."""

    base_path: str | None
    tracker: ChangeTracker | None
    threads: int

    def load_base(self) -> BaseCheckpoint | None:
        return BaseCheckpoint(self.base_path) if self.base_path is not None else None


def hash_all(tensors: list, threads: int, names: list[str] | None = None, ready: dict | None = None) -> list[str]:
    """The content digests of ``tensors``, computed on up to ``threads`` threads; an error names
    the tensor (``names``). ``ready`` (device index -> CUDA event recorded on the caller's
    stream): a device tensor is copied on a stream that waits for it first, so it is read after
    every kernel the caller queued before the save and before none it queues later."""
    names = names or [f"tensor {i}" for i in range(len(tensors))]

    def one(i: int) -> str:
        try:
            t = tensors[i]
            return content_digest(t, (ready or {}).get(t.device.index) if t.device.type == "cuda" else None)
        except Exception as exc:  # noqa: BLE001 - re-raised with the key
            raise IncrementalError(f"hashing {names[i]!r} for an incremental save failed: {type(exc).__name__}: {exc}") from exc

    if len(tensors) <= 1 or threads <= 1:
        return [one(i) for i in range(len(tensors))]
    with ThreadPoolExecutor(min(threads, len(tensors)), thread_name_prefix="dcp_datastates-hash") as pool:
        return list(pool.map(one, range(len(tensors))))


def ready_events(tensors) -> dict:
    """``{device index: providers.ready_event}`` for every CUDA device among ``tensors``, recorded
    on this thread's current streams (what :func:`hash_all` takes as ``ready``)."""
    return {d: ready_event(d) for d in sorted({t.device.index for t in tensors if t.device.type == "cuda"})}


def report_increments(report, references, digests: dict):
    """A rank's report (``rank_reports.RankReport``) with what its incremental save refers to: the
    base ranks of ``references`` (BaseChunks), once each in a stable order, and ``digests``
    (location_key -> digest). Synchronous and asynchronous saves report alike."""
    bases = {}
    for chunk in references:
        bases.setdefault(chunk.files.data_path, chunk.files)
    return dataclasses.replace(
        report, bases=tuple(bases[k] for k in sorted(bases)),
        digests=tuple((fqn, off, d) for (fqn, off), d in digests.items()),
    )


def without_references(plan: SavePlan, increment: RankIncrement) -> SavePlan:
    """The plan's items that are written (those referred to are not)."""
    if not increment.references:
        return plan
    return dataclasses.replace(plan, items=[i for i in plan.items if i.index not in increment.references])


def check_sibling(path: str | os.PathLike, base: str | os.PathLike) -> None:
    """A checkpoint saved into ``path`` can refer to ``base``: they share a parent directory (by
    name: ``../<base>``, resolved lexically as the reader resolves it), and are not the same."""
    path, base = os.path.abspath(os.fspath(path)), os.path.abspath(os.fspath(base))
    if os.path.dirname(path) != os.path.dirname(base):
        raise ValueError(
            f"an incremental save into {path} cannot refer to base checkpoint {base}: a base must "
            "be a sibling directory (checkpoints refer to ../<base>/<file>)"
        )
    if path == base:
        raise ValueError(f"a checkpoint cannot be its own base ({base}); save into another directory")


def check_options(base: Any, record_digests: bool, compressed: bool) -> None:
    """A writer's incremental options fit its others: references and digests are of raw chunks."""
    if base is not None and compressed:
        raise ValueError(
            "incremental saves (base=...) write raw chunks: they cannot be combined with compression"
        )
    if record_digests and compressed:
        raise ValueError("record_digests=True needs raw chunks: it cannot be combined with compression")


class IncrementalError(CheckpointError):
    """An incremental save that cannot refer to its base as asked."""
