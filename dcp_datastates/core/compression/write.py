"""The write side of compression: a save's large chunks compressed into frames appended after
its raw tensors, and an asynchronous save's staging file compressed into its data file.

An asynchronous save's ``stage()`` must return at once and its snapshot stay within the host
cache, so the snapshot stages raw bytes as it does without compression, into a staging file of
its own (a rank file with a save id of its own, so a crash leaves a stray that ``du``,
``verify`` and the manager recognise). The background save reads it back (checksums
verified), compresses it into the data file (:func:`compress_staged`), and removes it."""

from __future__ import annotations

import collections
import concurrent.futures

import torch
from torch.distributed.checkpoint.planner import WriteItemType

from dcp_datastates.core.compression.codec import Compression, default_threads, frame_pool
from dcp_datastates.core.placement import PAGE, align_up, is_compressible
from dcp_datastates.errors import ChecksumMismatchError, CheckpointError
from dcp_datastates.format.checkpoint_layout import location_key
from dcp_datastates.format.rank_index import RankIndex
from dcp_datastates.native.engine import ALIGNMENT, HostRegion, ReadRequest, bytes_address, segment_checks, stop_write_job
from dcp_datastates.storage.store import memory_at

FRAME_ALIGN = 64  # frames are packed at this alignment, as objects are
STAGED_READ_BLOCKS = 4  # blocks read back from a staging file at once


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
        self.threads = default_threads()
        self.pool = frame_pool(self.threads)
        self.alignment = alignment
        self.batch_bytes = batch_bytes
        self.offset = start
        self.first_ordinal = first_ordinal
        self.table: list[tuple[int, int, str]] = []  # (offset, length, key) per frame, in ordinal order
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
        fut = self.pool.submit(self.compression.frame, data, keep)
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
        """An error: wait for the blocks in flight (they read memory the caller may free); their
        own errors are dropped (the error being raised wins)."""
        concurrent.futures.wait([fut for _, fut in self._inflight])
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
            appender.submit(key, memory_at(flat.data_ptr() + start, end - start), flat)
        else:
            part = flat[start:end].to("cpu")
            appender.submit(key, memory_at(part.data_ptr(), end - start), part)


def compress_staged(engine, snap, staged_segments, plan, finals: dict, n_objects: int, direct_io: str, staged_at: dict):
    """Write a snapshot's data file from its staging file: small tensors as they are, large ones
    compressed (``staged_at``: location_key -> (offset, nbytes) in the staging file). Returns
    ``(job, small_end, frames, end)``; a failure stops the job. Every byte read back is checked
    against the staging file's checksums."""
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
    job = snap.dest.start_write(engine, snap.data_file, regions, keep, direct_io=direct_io, preallocate=small_end)
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
            raw_offset = staged_at[key][0]  # where the snapshot staged it
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
                    futures.append(appender.submit(item.index.fqn, memory_at(buf.data_ptr() + b, m), memory))
                buffers[turn] = (memory, [f for f in futures if f is not None])
                turn = 1 - turn
                del buf, memory
        frames, end = appender.finish()
    except BaseException:
        appender.abandon()
        stop_write_job(job, "save failed")
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
