"""Compressed tensor chunks (zstd): ``DataStatesWriter(path, compression="zstd")``, or
``DataStatesWriter(path, _extensions=[ZStandard()])`` with DCP's own extension object.

Our format fixes every raw tensor's offset when the save is planned, but a
compressed size is known only once the bytes are compressed. So a compressed
chunk is stored like a Python object: it is cut into blocks of
``block_bytes`` raw bytes (4 MiB by default), each block is one zstd frame,
and the frames are appended after the raw tensors; the rank index's object
table (already checksummed, and written last) holds each frame's
``(offset, length)``. What planning fixes is only the ordinal of a chunk's
first block (``ItemLocation(path, -1, raw length, first ordinal)``, after
the objects' ordinals): the block count follows from the raw length, so the
metadata can still be written while the data is.

Why blocks: the frames are compressed in parallel by a thread pool
(``zstandard`` releases the GIL), overlapped with the engine writing the
frames compressed before; and a resharded load decompresses only the blocks
its slice touches. Small tensors (< 64 KiB) stay raw and packed: a frame of
their own would gain nothing. Python objects stay raw too (they are small
and a safe-mode load inspects their pickles).

Asynchronous saves: ``stage()`` must return at once and the snapshot must
stay within the host cache, so the snapshot stages raw bytes exactly as it
does without compression, into a staging file of its own (a rank file with
a save id of its own, so a crash leaves a stray that ``du``, ``verify`` and
the manager recognise). The background save reads it back (checksums
verified), compresses it into the final data file, and removes it.

The layout records ``("zstd", block_bytes)`` in
``CheckpointLayout.compression``; the level is the writer's business only.
"""

from __future__ import annotations

import collections
import concurrent.futures
import ctypes
import dataclasses
import os
import threading
from typing import Any, Callable, Sequence

import torch

from dcp_datastates import _dcp_compat
from torch.distributed.checkpoint.planner import WriteItemType

from dcp_datastates.native.engine import (
    ALIGNMENT,
    HostRegion,
    ReadRequest,
    bytearray_address,
    bytes_address,
    segment_checks,
)
from dcp_datastates.errors import ChecksumMismatchError, CheckpointError, CorruptCheckpointError, UnsupportedFormatError
from dcp_datastates.format.checkpoint_layout import BLOCK_ALIGN, COMPRESSION_CODECS, MAX_BLOCK_BYTES, compressed_blocks, location_key
from dcp_datastates.format.rank_index import RankIndex
from dcp_datastates.core.layout import PAGE, align_up, is_compressible

ZSTD = "zstd"
DEFAULT_LEVEL = 3  # zstd's default, and what DCP's ZStandard() compresses with
DEFAULT_BLOCK_BYTES = 4 << 20
FRAME_ALIGN = 64  # frames are packed at this alignment, as objects are
INSTALL_HINT = 'pip install "dcp_datastates[zstd]" (or pip install zstandard)'


def zstd_module():
    """The ``zstandard`` package, or an ImportError that says how to install it."""
    try:
        import zstandard
    except ImportError as exc:
        raise ImportError(
            f"zstd compression needs the zstandard package, which is not installed: {INSTALL_HINT}"
        ) from exc
    return zstandard


def descriptor_of(compression: Compression | None) -> tuple | None:
    """What a layout records for these settings: ``(codec, block bytes)``, or None for raw."""
    return compression.descriptor if compression is not None else None


@dataclasses.dataclass(frozen=True)
class Compression:
    """A writer's compression settings. ``descriptor`` is what the layout records."""

    codec: str = ZSTD
    level: int = DEFAULT_LEVEL
    block_bytes: int = DEFAULT_BLOCK_BYTES
    threads: int = 0  # 0: one per CPU this process may run on, at most 8

    @property
    def descriptor(self) -> tuple:
        return (self.codec, self.block_bytes)

    @property
    def thread_count(self) -> int:
        if self.threads > 0:
            return self.threads
        try:
            cpus = len(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            cpus = os.cpu_count() or 1
        return max(1, min(8, cpus))


def resolve_compression(
    compression: str | None,
    level: int | None,
    extensions: Sequence[Any] | None,
    block_bytes: int | None = None,  # None: DEFAULT_BLOCK_BYTES (read now: tests shrink it)
    threads: int = 0,
) -> Compression | None:
    """The writer's settings from its arguments, or None for raw tensors.

    ``_extensions=[ZStandard()]`` (DCP's stream transform) means zstd at DCP's
    level; any other extension is refused: our format has no stream transforms,
    and silently dropping one (say, encryption) would be worse than failing.
    """
    if compression not in (None, "none", ZSTD):
        raise ValueError(f"compression must be None, 'none' or {ZSTD!r}, got {compression!r}")
    codec = None if compression in (None, "none") else compression
    zstd_cls = _dcp_compat.zstandard_extension_class()
    for ext in extensions or ():
        if zstd_cls is not None and isinstance(ext, zstd_cls) and type(ext).get_descriptor is zstd_cls.get_descriptor:
            codec = ZSTD
            continue
        name = type(ext).__name__
        try:
            desc = ext.get_descriptor()
        except Exception:  # noqa: BLE001 - only for the message
            desc = "?"
        raise ValueError(
            f"DataStatesWriter does not support the DCP extension {name} ({desc}); the only stream "
            f"transform it accepts is torch.distributed.checkpoint._extension.ZStandard (stored as "
            f"{ZSTD} compression of tensor blocks), also available as compression={ZSTD!r}"
        )
    if codec is None:
        if level is not None:
            raise ValueError("compression_level was given without compression='zstd'")
        return None
    assert codec in COMPRESSION_CODECS
    zstd = zstd_module()
    level = DEFAULT_LEVEL if level is None else level
    if not isinstance(level, int) or not -(1 << 17) <= level <= zstd.MAX_COMPRESSION_LEVEL:
        raise ValueError(f"compression_level must be an integer up to {zstd.MAX_COMPRESSION_LEVEL}, got {level!r}")
    block_bytes = DEFAULT_BLOCK_BYTES if block_bytes is None else block_bytes
    if not isinstance(block_bytes, int) or not 4096 <= block_bytes <= MAX_BLOCK_BYTES or block_bytes % BLOCK_ALIGN:
        raise ValueError(
            f"compression block size must be a multiple of {BLOCK_ALIGN} bytes from 4096 to "
            f"{MAX_BLOCK_BYTES}, got {block_bytes!r}"
        )
    if threads < 0:
        raise ValueError(f"compression threads must be >= 0, got {threads}")
    return Compression(codec, level, block_bytes, threads)


# -- thread pool --------------------------------------------------------------

_pools: dict[int, concurrent.futures.ThreadPoolExecutor] = {}
_pools_lock = threading.Lock()
_local = threading.local()


def _forget_pools_after_fork() -> None:
    """A fork child has none of the parent's pool threads: a task submitted to an
    inherited pool would never run. The child makes its own pools on first use
    (the inherited executors are dropped, never shut down: that would wait for
    threads that do not exist here)."""
    global _pools_lock
    _pools_lock = threading.Lock()
    _pools.clear()


os.register_at_fork(after_in_child=_forget_pools_after_fork)


def _pool(threads: int) -> concurrent.futures.ThreadPoolExecutor:
    with _pools_lock:
        pool = _pools.get(threads)
        if pool is None:
            pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="dcp_datastates-zstd")
            _pools[threads] = pool
        return pool


def _compress(level: int, data, keep) -> bytes:
    """One zstd frame (runs on a pool thread; zstandard releases the GIL). ``keep``
    holds the memory ``data`` points into until the frame is made."""
    cache = getattr(_local, "compressors", None)
    if cache is None:
        cache = _local.compressors = {}
    cctx = cache.get(level)
    if cctx is None:
        cctx = cache[level] = zstd_module().ZstdCompressor(level=level, write_content_size=True)
    return cctx.compress(data)


def decompress_block(blob, expected: int, where: str) -> bytes:
    """Decompress one frame of ``expected`` raw bytes; anything else is a corrupt checkpoint."""
    zstd = zstd_module()
    try:
        size = zstd.frame_content_size(blob)
    except zstd.ZstdError as exc:
        raise CorruptCheckpointError(f"{where}: not a zstd frame: {exc}") from None
    if size != expected:  # checked before decompressing: never allocate what a header claims
        raise CorruptCheckpointError(f"{where}: the frame holds {size} bytes, {expected} expected")
    dctx = getattr(_local, "decompressor", None)
    if dctx is None:
        dctx = _local.decompressor = zstd.ZstdDecompressor()
    try:
        out = dctx.decompress(blob, max_output_size=expected)
    except zstd.ZstdError as exc:
        raise CorruptCheckpointError(f"{where}: the frame does not decompress: {exc}") from None
    if len(out) != expected:
        raise CorruptCheckpointError(f"{where}: the frame decompressed to {len(out)} bytes, {expected} expected")
    return out


def run_parallel(tasks: list[Callable[[], None]], threads: int) -> None:
    """Run ``tasks`` on the pool (their C work releases the GIL); raise the first error."""
    if not tasks:
        return
    if len(tasks) == 1 or threads <= 1:
        for task in tasks:
            task()
        return
    futures = [_pool(threads).submit(task) for task in tasks]
    concurrent.futures.wait(futures)
    for f in futures:
        f.result()


def _memory(address: int, nbytes: int) -> memoryview:
    return memoryview((ctypes.c_char * nbytes).from_address(address)).cast("B")


# -- write side -----------------------------------------------------------------


class BlockAppender:
    """Compresses blocks on the pool and appends the frames to an engine write job, in order.

    Frames are packed from ``start`` at 64-byte alignment and handed to the
    engine a batch at a time (a batch ends on a write-window boundary: the
    engine continues at the next aligned offset). At most ``2 x threads``
    blocks are in flight, and each batch is released once the engine has
    staged it, so memory stays bounded whatever the state's size.
    """

    def __init__(self, job, compression: Compression, start: int, first_ordinal: int, alignment: int,
                 batch_bytes: int) -> None:
        self.job = job
        self.compression = compression
        self.threads = compression.thread_count
        self.pool = _pool(self.threads)
        self.alignment = alignment
        self.batch_bytes = batch_bytes
        self.offset = start
        self.first_ordinal = first_ordinal
        self.table: list[tuple[int, int, str]] = []  # (offset, length, key) per frame, in ordinal order
        self.raw_bytes = 0
        self._inflight: collections.deque = collections.deque()
        self._batch: list[tuple[str, bytes]] = []
        self._batch_len = 0
        self.failed = False  # the engine job failed: its wait() raises the error

    @property
    def next_ordinal(self) -> int:
        return self.first_ordinal + len(self.table) + len(self._batch) + len(self._inflight)

    def check_ordinal(self, key: str, ordinal: int) -> None:
        if ordinal != self.next_ordinal:
            raise CheckpointError(f"{key!r}: planned at block {ordinal}, but the next block is {self.next_ordinal}")

    def submit(self, key: str, data, keep) -> concurrent.futures.Future | None:
        """Compress ``data`` (a buffer that ``keep`` keeps valid) as the next block; its future
        (None once the job failed: nothing more is compressed)."""
        if self.failed:
            return
        self.raw_bytes += len(data)
        fut = self.pool.submit(_compress, self.compression.level, data, keep)
        self._inflight.append((key, fut))
        while len(self._inflight) > 2 * self.threads:
            self._collect_one()
        return fut

    def _collect_one(self) -> None:
        key, fut = self._inflight.popleft()
        blob = fut.result()
        self._batch.append((key, blob))
        self._batch_len += len(blob)
        if self._batch_len >= self.batch_bytes:
            self._flush()

    def _flush(self) -> None:
        if not self._batch or self.failed:
            self._batch, self._batch_len = [], 0
            return
        regions, blobs = [], []
        offset = self.offset
        for key, blob in self._batch:
            offset = align_up(offset, FRAME_ALIGN)
            regions.append(HostRegion(address=bytes_address(blob), nbytes=len(blob), file_offset=offset))
            self.table.append((offset, len(blob), key))
            blobs.append(blob)
            offset += len(blob)
        self._batch, self._batch_len = [], 0
        self.job.append(regions, blobs)
        del blobs, regions
        self.offset = align_up(offset, self.alignment)  # the engine's frontier
        if not self.job.release_staged():
            self.failed = True

    def finish(self) -> tuple[list[tuple[int, int, str]], int]:
        """Every frame appended: ``(table, end)``, ``end`` the aligned offset after the last frame."""
        while self._inflight:
            self._collect_one()
        self._flush()
        return self.table, self.offset

    def abandon(self) -> None:
        """An error: wait for the blocks in flight (they read memory the caller may free)."""
        for _, fut in self._inflight:
            try:
                fut.result()
            except Exception:  # noqa: BLE001 - the error being raised wins
                pass
        self._inflight.clear()
        self._batch = []


def submit_tensor(appender: BlockAppender, key: str, tensor: torch.Tensor, nbytes: int) -> None:
    """Compress a tensor's bytes block by block (row-major, as a raw chunk would be stored).

    Contiguous host tensors are read in place; other tensors are copied to
    host memory a block at a time (CUDA) or made contiguous once (strided).
    """
    block = appender.compression.block_bytes
    t = tensor.detach()
    if t.device.type == "cpu" and not t.is_contiguous():
        t = t.contiguous()
    flat = t.reshape(-1).view(torch.uint8) if t.dim() else t.reshape(1).view(torch.uint8)
    for start in range(0, nbytes, block):
        end = min(start + block, nbytes)
        if t.device.type == "cpu":
            appender.submit(key, _memory(flat.data_ptr() + start, end - start), flat)
        else:
            part = flat[start:end].to("cpu")
            appender.submit(key, _memory(part.data_ptr(), end - start), part)


STAGED_READ_BLOCKS = 4  # blocks read back from a staging file at once


def compress_staged(engine, snap, staged_segments, plan, finals: dict, n_objects: int, direct_io: str, save):
    """Write a snapshot's data file from its staging file: small tensors as they are, large ones
    compressed. Returns ``(job, small_end, frames, end)``; ``save.job`` is the new job (so a
    failure stops it). Every byte read back is checked against the staging file's checksums."""
    compression = snap.compression
    descriptor = compression.descriptor
    segments = sorted(staged_segments, key=lambda s: s.offset)
    staged = RankIndex(snap.rank, snap.save_id, 0, [s.offset for s in segments], [s.nbytes for s in segments],
                       [s.crc32c for s in segments], [])
    path = snap.staging_path
    small_end = max((o + n for o, n in snap.placed.values() if not is_compressible(n, descriptor)), default=0)
    regions, keep = [], []
    if small_end:  # one region per small tensor of the plan: each gets checksum segments of its own
        head = _read_verified(engine, path, staged, 0, small_end, "the snapshot's small tensors")
        raw = sorted({(o, n) for o, n, ordinal in finals.values() if ordinal < 0 and n > 0})
        regions = [HostRegion(address=head.data_ptr() + o, nbytes=n, file_offset=o) for o, n in raw]
        keep = [head]
    job = engine.write(snap.data_path, regions, keep, direct_io=direct_io, preallocate=small_end)
    save.job = job
    del regions, keep
    appender = BlockAppender(job, compression, align_up(small_end, PAGE), n_objects, ALIGNMENT, engine.window_bytes)
    # Two read buffers, reused: a buffer is refilled only once the blocks read into it
    # are compressed. (Fresh 16 MiB buffers per read made glibc keep hundreds of MiB.)
    step = STAGED_READ_BLOCKS * compression.block_bytes
    widest = step + 2 * engine.window_bytes  # a read is widened to whole checksum segments
    buffers = [(torch.empty(0, dtype=torch.uint8), []) for _ in range(2)]
    turn = 0
    try:
        for item in plan.items:
            if item.type == WriteItemType.BYTE_IO:
                continue
            key = location_key(item.index.fqn, item.index.offset)
            offset, length, ordinal = finals[key]
            if ordinal < 0:
                continue
            appender.check_ordinal(item.index.fqn, ordinal)
            raw_offset = save.tensor_locations[key][0]  # where the snapshot staged it
            for start in range(0, length, step):
                n = min(step, length - start)
                memory, pending = buffers[turn]
                concurrent.futures.wait(pending)
                if memory.numel() < widest:
                    memory = torch.empty(widest, dtype=torch.uint8)
                buf = _read_verified(engine, path, staged, raw_offset + start, n, item.index.fqn, memory)
                futures = []
                for b in range(0, n, compression.block_bytes):
                    m = min(compression.block_bytes, n - b)
                    futures.append(appender.submit(item.index.fqn, _memory(buf.data_ptr() + b, m), memory))
                buffers[turn] = (memory, [f for f in futures if f is not None])
                turn = 1 - turn
                del buf, memory
        frames, end = appender.finish()
    except BaseException:
        appender.abandon()
        raise
    return job, small_end, frames, end


def _read_verified(engine, path: str, index, start: int, nbytes: int, what: str, into=None) -> torch.Tensor:
    """Bytes ``[start, start + nbytes)`` of a file the engine wrote, every segment they touch
    verified; read into ``into`` when it is large enough."""
    lo, hi = index.covering_range(start, nbytes)
    buf = into[: hi - lo] if into is not None and into.numel() >= hi - lo else torch.empty(hi - lo, dtype=torch.uint8)
    checks = segment_checks(index.checks_within(lo, hi - lo))
    request = ReadRequest(file_index=0, offset=lo, nbytes=hi - lo, address=buf.data_ptr(), checks=checks)
    failures = engine.read([path], [request], [buf]).wait()
    if failures:
        f = failures[0]
        if f.kind == "checksum":
            raise ChecksumMismatchError(f"{f.path} (staged snapshot, {what!r}): {f.message}")
        err = OSError(f.errno, f"reading back the staged snapshot ({what!r}) failed: {f.message}", f.path)
        err.offset = f.offset
        raise err
    return buf[start - lo : start - lo + nbytes]


# -- read side ------------------------------------------------------------------


def add_compressed_read(batch, item, planner, loc, idx, dtype, sizes, target, start: int, count: int,
                        exact: bool) -> None:
    """Queue the reads of the blocks a read item needs, their decompression, and the copy.

    ``[start, start + count)`` is the element range of the chunk the item
    needs (a bounding range when not ``exact``). The frames are read (and
    checksum-verified) by the engine; ``batch.decode`` tasks decompress them in
    parallel, straight into the destination when it is the whole chunk, else
    into a temporary from which ``finish`` copies the item's box.
    """
    reader = batch.reader
    layout = reader.layout
    block = layout.compression[1]
    key = item.storage_index.fqn
    where = reader._where(loc.relative_path)
    itemsize = dtype.itemsize
    nbytes = loc.length
    nblocks = compressed_blocks(nbytes, block)
    if loc.object_ordinal + nblocks > len(idx.objects):
        raise CorruptCheckpointError(
            f"{where}: {key!r} is stored as blocks {loc.object_ordinal}..{loc.object_ordinal + nblocks - 1} "
            f"of an object table with {len(idx.objects)} entries"
        )
    lo, hi = start * itemsize, (start + count) * itemsize
    b0, b1 = lo // block, (hi - 1) // block
    base = b0 * block
    span = min((b1 + 1) * block, nbytes) - base
    direct = (
        exact and (lo, hi) == (0, nbytes) and target.device.type == "cpu" and target.dtype == dtype
        and target.is_contiguous()
    )
    dest = target if direct else torch.empty(span, dtype=torch.uint8)
    batch.keep.append(dest)
    batch.temp_bytes += 0 if direct else span
    for b in range(b0, b1 + 1):
        offset, length = idx.objects[loc.object_ordinal + b]
        raw = min(block, nbytes - b * block)
        buf = bytearray(length)
        batch._request(key, loc.relative_path, offset, length, bytearray_address(buf), idx)
        batch.temp_bytes += length
        batch.decode.append(_decode_task(buf, raw, dest, b * block - base, f"{where}: block {b} of {key!r}"))
    if direct:
        batch.after.append(lambda: planner.commit_tensor(item, target))
        return
    from dcp_datastates.core.reader import copy_box_out

    batch.after.append(copy_box_out(dest, lo - base, count * itemsize, dtype, sizes, item, target, planner))


def _decode_task(buf: bytearray, raw: int, dest: torch.Tensor, pos: int, where: str) -> Callable[[], None]:
    def decode() -> None:
        out = decompress_block(buf, raw, where)
        ctypes.memmove(dest.data_ptr() + pos, out, raw)  # a foreign call: the GIL is released

    return decode


def decode_threads() -> int:
    return Compression().thread_count


# -- stock DCP checkpoints --------------------------------------------------------


def check_stock_transforms(storage_data: dict, where: str) -> None:
    """A stock DCP checkpoint's stream transforms (``_StorageInfo.transform_descriptors``)
    must be ones DCP's reader can undo here: zstd needs its package, others are refused."""
    descriptors = set()
    for info in storage_data.values():
        for desc in getattr(info, "transform_descriptors", None) or ():
            descriptors.add(desc)
    for desc in sorted(descriptors):
        name, _, version = str(desc).partition("/")
        if name == "stream.zstd":
            if version.partition(".")[0] != "1":
                raise UnsupportedFormatError(f"{where}: items are compressed with {desc}, a zstd stream version this torch does not know")
            zstd_module()
            continue
        raise UnsupportedFormatError(
            f"{where}: items were written through the DCP extension {desc!r}, which dcp_datastates "
            "cannot undo (it reads stream.zstd only)"
        )
