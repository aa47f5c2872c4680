"""The reader's read batch: the reads of a load plan's items handed to the store together
(:meth:`Store.read_batch`: the engine's threads for a directory, ranged reads in flight for
object storage), compressed chunks' frames decompressed, then the items committed to DCP.

A slice of a saved chunk along dim 0 (or the whole chunk) is one contiguous range, read (or
decompressed) straight into the destination when that is a contiguous CPU tensor of the
saved dtype and the range needs no widening. Any other box of a raw chunk (a column slice, a
2-D block, an inner slice) is a strided set of row-runs: only the spans holding them are read
(:func:`needed_spans`), each widened to the checksum segments it touches when reads are
verified (a segment's CRC needs all its bytes) and merged with its neighbour when the gap is
small beside the run (so the gap costs less than another request) or tiny. The spans are read
into their places in a temporary laid out as the box's bounding range, from which the box is
copied out; without widening or merging into a contiguous CPU destination of the saved dtype,
each run is read straight into its place in the destination. A compressed chunk is read as
the whole frames holding the box's bounding range: a frame is only decoded whole."""

from __future__ import annotations

import dataclasses
import io
import math
from bisect import bisect_left, bisect_right
from typing import Any, Callable

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlanner, ReadItem

from dcp_datastates.core.compression.codec import default_threads, run_parallel
from dcp_datastates.core.compression.read import add_frame_reads, block_span
from dcp_datastates.core.stock_dcp import add_stock_item
from dcp_datastates.errors import ChecksumMismatchError, CorruptCheckpointError
from dcp_datastates.format.checkpoint_layout import CheckpointLayout
from dcp_datastates.format.rank_index import RankIndex
from dcp_datastates.format.safe_objects import plain_object_stream
from dcp_datastates.native import engine as _native
from dcp_datastates.storage import RangeRead, StoreError

# Neighbouring spans of a strided box are read as one when the gap between them is at most a
# fifth of a run (the bytes read stay within 1.2 times those needed) or at most this many bytes
# (runs so short that a request each costs more than reading the gaps).
MERGE_GAP_RATIO = 5
TINY_GAP_BYTES = 1024


@dataclasses.dataclass(frozen=True)
class ReadContext:
    """What a batch needs of the load's reader (:meth:`DataStatesReader.read_context`): the
    checkpoint's decoded metadata, how files are named and found, and the one way its reads are
    carried out (the store's batch, or the load's read-once rounds)."""

    location: str  # the checkpoint, for errors
    verify: bool  # reads are checked against the rank indexes' segments
    allow_pickle: bool
    layout: CheckpointLayout | None  # ours (None: a stock DCP checkpoint, ``stock`` set)
    tensors: dict  # the metadata's state_dict_metadata: {fqn: TensorStorageMetadata or BytesStorageMetadata}
    stock: dict | None  # a stock DCP checkpoint's storage data (:mod:`stock_dcp`)
    stock_chains: dict  # its stream transforms' undoers by descriptors
    undo_frame: Callable | None  # undoes a compressed frame or a transformed object
    key: Callable[[str], str]  # a file's key in the store
    where: Callable[[str], str]  # a file, named for errors
    stored_at: Callable  # (index, data file, data offset) -> (file name, stripe, stripe base, stripe end)
    rank_index: Callable[[str], RankIndex]  # the index of the rank whose data file is named
    chunk_sizes: Callable  # MetadataIndex -> (dtype, the saved chunk's sizes)
    read_ranges: Callable[[list, bool], list]  # (RangeReads, last) -> failures


class ReadBatch:
    """A set of reads handed to the store together, then committed to DCP."""

    def __init__(self, reader: ReadContext) -> None:
        self.reader = reader
        self.reads: list[RangeRead] = []
        self.keys: list[str] = []
        self.keep: list[Any] = []
        self.after: list[Callable[[], None]] = []
        self.decode: list[Callable[[], None]] = []  # decompressions, run in parallel before ``after``
        self.temp_bytes = 0
        self.read_bytes = 0  # stored bytes requested (compressed frames as stored)
        self.needed_bytes = 0  # bytes of the boxes the items ask for (objects: as stored)
        self.shared: dict = {}  # stock DCP records read by this batch, by (file, offset): read once

    def request(self, key: str, relative_path: str, offset: int, nbytes: int, pointer: int, idx: RankIndex) -> None:
        """Read ``nbytes`` at data offset ``offset`` of the rank whose data file is ``relative_path``
        (from the stripe's file that holds them) into ``pointer``, verified against the rank's
        segments unless the reader's ``verify`` is off."""
        name, stripe, base, end = self.reader.stored_at(idx, relative_path, offset)
        if end is not None and offset + nbytes > end:
            raise CorruptCheckpointError(
                f"{self.reader.where(name)}: {key!r} (bytes {offset}..{offset + nbytes}) "
                f"crosses the end of its stripe at {end} (the metadata is damaged)"
            )
        self.reads.append(RangeRead(
            self.reader.key(name), offset - base, nbytes, pointer,
            index=idx if self.reader.verify else None, stripe=stripe, data_offset=offset,
        ))
        self.keys.append(key)
        self.read_bytes += nbytes

    def request_spans(self, key: str, relative_path: str, offsets, lengths, pointers, idx: RankIndex) -> None:
        """:meth:`request` for each of the sorted spans at data offsets ``offsets`` (numpy arrays of
        the same length: offsets, byte counts, destination addresses), all of one stripe."""
        reader = self.reader
        name, stripe, base, end = reader.stored_at(idx, relative_path, int(offsets[0]))
        last = int(offsets[-1] + lengths[-1])
        if end is not None and last > end:
            raise CorruptCheckpointError(
                f"{reader.where(name)}: {key!r} (bytes {int(offsets[0])}..{last}) "
                f"crosses the end of its stripe at {end} (the metadata is damaged)"
            )
        file_key = reader.key(name)
        index = idx if reader.verify else None
        self.reads.extend(
            RangeRead(file_key, o - base, n, p, index=index, stripe=stripe, data_offset=o)
            for o, n, p in zip(offsets.tolist(), lengths.tolist(), pointers.tolist())
        )
        self.keys.extend([key] * len(offsets))
        self.read_bytes += int(lengths.sum())

    def request_unverified(self, key: str, name: str, offset: int, buf: bytearray) -> None:
        """Read all of ``buf`` from ``offset`` of the file ``name`` (a stock DCP record: no
        segments to check it against)."""
        if buf:
            self.reads.append(RangeRead(self.reader.key(name), offset, len(buf), _native.bytearray_address(buf)))
            self.keys.append(key)
        self.temp_bytes += len(buf)
        self.read_bytes += len(buf)

    def then(self, step: Callable[[], None]) -> None:
        """Run ``step`` once every read of the batch is done (in the order given)."""
        self.after.append(step)

    def add(self, item: ReadItem, planner: LoadPlanner) -> None:
        if item.type == LoadItemType.BYTE_IO:
            before = self.read_bytes
            self._add(item, planner)
            self.needed_bytes += self.read_bytes - before
        else:
            self._add(item, planner)  # a tensor the metadata does not describe is refused here
            md = self.reader.tensors.get(item.storage_index.fqn)
            if isinstance(md, TensorStorageMetadata):
                self.needed_bytes += math.prod(item.lengths) * md.properties.dtype.itemsize

    def _add(self, item: ReadItem, planner: LoadPlanner) -> None:
        reader = self.reader
        if reader.stock is not None:  # a stock DCP checkpoint: its records, as stock_dcp reads them
            add_stock_item(self, item, planner)
            return
        loc = reader.layout.location(item.storage_index)
        if loc is None:
            raise CorruptCheckpointError(
                f"{reader.location}: metadata has no stored location for {item.storage_index.fqn!r}"
            )
        idx = reader.rank_index(loc.relative_path)
        if item.type == LoadItemType.BYTE_IO:
            self._add_object(item, planner, loc, idx)
        else:
            self._add_tensor(item, planner, loc, idx)

    def _add_object(self, item: ReadItem, planner: LoadPlanner, loc, idx: RankIndex) -> None:
        reader = self.reader
        key = item.storage_index.fqn
        if not 0 <= loc.object_ordinal < len(idx.objects):
            raise CorruptCheckpointError(
                f"{reader.location}: object {key!r} refers to entry {loc.object_ordinal} of an "
                f"index with {len(idx.objects)} objects"
            )
        offset, nbytes = idx.objects[loc.object_ordinal]
        buf = bytearray(nbytes)
        if nbytes:
            self.request(key, loc.relative_path, offset, nbytes, _native.bytearray_address(buf), idx)
            self.keep.append(buf)
        allow = reader.allow_pickle
        where = reader.where(loc.relative_path)
        undo = reader.undo_frame if reader.layout.objects_transformed else None

        def load_object() -> None:
            blob = buf if undo is None else undo(buf, None, f"{where}: object {key!r}")
            # Safe mode: DCP unpickles our own pickle of the checked values, never the saved bytes.
            stream = io.BytesIO(blob) if allow else plain_object_stream(blob, key, where, map_location=None)
            planner.load_bytes(item, stream)

        self.after.append(load_object)

    def _add_tensor(self, item: ReadItem, planner: LoadPlanner, loc, idx: RankIndex) -> None:
        reader = self.reader
        key = item.storage_index.fqn
        dtype, sizes = reader.chunk_sizes(item.storage_index)
        itemsize = dtype.itemsize
        if loc.length != math.prod(sizes) * itemsize:
            raise CorruptCheckpointError(
                f"{reader.location}: {key!r} has {loc.length} stored bytes for a {dtype} chunk of shape {sizes}"
            )
        start, count, exact = contiguous_range(sizes, item.storage_offsets, item.lengths)
        target = planner.resolve_tensor(item).detach()
        if tuple(target.shape) != tuple(item.lengths):
            raise CorruptCheckpointError(
                f"{key!r}: destination shape {tuple(target.shape)} does not match the read of {tuple(item.lengths)}"
            )
        if count == 0:
            self.after.append(lambda: planner.commit_tensor(item, target))
            return
        if not exact and not loc.is_compressed:
            self._add_box(item, planner, loc, idx, dtype, sizes, target)
            return
        lo, hi = start * itemsize, (start + count) * itemsize  # the chunk's bytes the item needs
        # What is read: the whole blocks of a compressed chunk; with verification on, a raw
        # range that cuts through checksum segments (a reshard slice) widened to whole segments
        # so no byte goes unchecked. Both at offsets in the chunk.
        if loc.is_compressed:
            block = reader.layout.compression[1]
            first, end = block_span(lo, hi, loc.length, block)
        elif reader.verify:
            first, end = idx.covering_range(loc.offset + lo, hi - lo)
            first, end = first - loc.offset, end - loc.offset
        else:
            first, end = lo, hi
        in_place = (
            exact and (first, end) == (lo, hi) and target.device.type == "cpu" and target.dtype == dtype
            and target.is_contiguous()
        )
        dest = target if in_place else torch.empty(end - first, dtype=torch.uint8)
        self.keep.append(dest)
        self.temp_bytes += 0 if in_place else end - first
        if loc.is_compressed:
            where = reader.where(loc.relative_path)
            self.temp_bytes += add_frame_reads(self, key, loc, idx, block, first, end, dest, where)
        else:
            self.request(key, loc.relative_path, loc.offset + first, end - first, dest.data_ptr(), idx)
        if in_place:
            self.after.append(lambda: planner.commit_tensor(item, target))
        else:
            # ``lo - first`` is a multiple of the itemsize: items, blocks and segments are 64-byte aligned
            self.after.append(copy_box_out(dest, lo - first, hi - lo, dtype, sizes, item, target, planner))

    def _add_box(self, item: ReadItem, planner: LoadPlanner, loc, idx: RankIndex, dtype, sizes, target) -> None:
        """Queue the reads of a box that is not one range of the raw chunk at ``loc``: only the
        spans holding its row-runs (:func:`needed_spans`), into a temporary laid out as the
        bounding range, or straight into ``target`` when nothing is widened or merged."""
        key = item.storage_index.fqn
        itemsize = dtype.itemsize
        run, starts = box_runs(sizes, item.storage_offsets, item.lengths)
        run_bytes = run * itemsize
        lo = starts * itemsize  # byte offsets in the chunk of the runs
        lo_first, hi_last = int(lo[0]), int(lo[-1]) + run_bytes
        if hi_last > loc.length:
            raise CorruptCheckpointError(
                f"{self.reader.location}: the read of {key!r} at {tuple(item.storage_offsets)} of "
                f"{tuple(item.lengths)} lies outside its saved chunk of shape {tuple(sizes)}"
            )
        segments = chunk_segments(idx, loc.offset, lo_first, hi_last) if self.reader.verify else None
        span_lo, span_hi = needed_spans(lo, run_bytes, segments, max(TINY_GAP_BYTES, run_bytes // MERGE_GAP_RATIO))
        direct = (
            len(span_lo) == len(lo) and bool((span_hi - span_lo == run_bytes).all()) and bool((span_lo == lo).all())
            and target.device.type == "cpu" and target.dtype == dtype and target.is_contiguous()
        )
        if direct:  # each run read into its place in the destination
            pointers = target.data_ptr() + np.arange(len(lo), dtype=np.int64) * run_bytes
            self.keep.append(target)
            self.after.append(lambda: planner.commit_tensor(item, target))
        else:
            first, end = int(span_lo[0]), int(span_hi[-1])
            dest = torch.empty(end - first, dtype=torch.uint8)  # bytes never read are never copied out
            self.keep.append(dest)
            self.temp_bytes += end - first
            pointers = dest.data_ptr() + (span_lo - first)
            self.after.append(copy_box_out(dest, lo_first - first, hi_last - lo_first, dtype, sizes, item, target, planner))
        self.request_spans(key, loc.relative_path, loc.offset + span_lo, span_hi - span_lo, pointers, idx)

    def run(self, last: bool = True) -> None:
        """Read, decompress, commit. ``last``: no batch of this load follows (the read-once
        rounds of the other ranks are told)."""
        self._read(last)
        run_parallel(self.decode, default_threads())
        for fn in self.after:
            fn()

    def _read(self, last: bool) -> None:
        """Carry out every read (in parallel, verified); the first failure is raised, naming the
        file and the key. A read-once load takes part in its round even with nothing to read."""
        try:
            failures = self.reader.read_ranges(self.reads, last)
        except StoreError as exc:
            keys = sorted(set(self.keys))
            more = f" and {len(keys) - 3} more" if len(keys) > 3 else ""
            raise StoreError(f"{exc} (loading {', '.join(map(repr, keys[:3]))}{more})", transient=exc.transient) from exc
        if failures:
            raise _read_error(failures[0], self.keys, len(failures))


def contiguous_range(sizes, offsets, lengths) -> tuple[int, int, bool]:
    """Element range [start, start+count) of a sub-block in a row-major chunk.

    Returns (start, count, exact): exact when the block is that whole range
    (a dim-0 slice, or a slice that is full in every inner dim); otherwise
    the range is the bounding range from its first to its last element.
    """
    ndim = len(sizes)
    if ndim == 0:
        return 0, 1, True
    if ndim == 1:  # the common case, kept cheap: one call per saved item on every load
        return offsets[0], lengths[0], True
    start = last = 0
    stride = numel = 1
    for d in range(ndim - 1, -1, -1):
        o, n = offsets[d], lengths[d]
        if n == 0:
            return 0, 0, True
        start += o * stride
        last += (o + n - 1) * stride
        numel *= n
        stride *= sizes[d]
    count = last - start + 1
    return start, count, count == numel


def box_runs(sizes, offsets, lengths) -> tuple[int, np.ndarray]:
    """The box ``offsets``/``lengths`` of a row-major chunk of ``sizes`` (no length zero) as runs
    of contiguous elements: ``(elements per run, sorted element offset of each run)``. The
    inner dimensions the box spans whole join the run."""
    ndim = len(sizes)
    d = ndim - 1
    run = 1
    while d > 0 and offsets[d] == 0 and lengths[d] == sizes[d]:
        run *= sizes[d]
        d -= 1
    stride = run  # elements between steps of dimension d
    run *= lengths[d]
    starts = np.array([offsets[d] * stride], dtype=np.int64)
    for k in range(d - 1, -1, -1):
        stride *= sizes[k + 1]
        steps = (offsets[k] + np.arange(lengths[k], dtype=np.int64)) * stride
        starts = (steps[:, None] + starts[None, :]).reshape(-1)
    return run, starts


def chunk_segments(idx: RankIndex, chunk_offset: int, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
    """``(starts, ends)`` of the checksum segments overlapping bytes ``[lo, hi)`` of the chunk at
    data offset ``chunk_offset``, at offsets in the chunk."""
    offs = idx.seg_offsets
    i = max(bisect_right(offs, chunk_offset + lo) - 1, 0)
    j = bisect_left(offs, chunk_offset + hi)
    starts = np.array(offs[i:j], dtype=np.int64) - chunk_offset
    return starts, starts + np.array(idx.seg_lengths[i:j], dtype=np.int64)


def needed_spans(starts: np.ndarray, run: int, segments=None, gap: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """The byte spans to read for runs of ``run`` bytes at the sorted ``starts``: each run
    widened to the ``(starts, ends)`` of the segments it cuts through (``segments``, sorted and
    disjoint; a run end no segment covers stays), then neighbours at most ``gap`` apart (or
    overlapping) joined. Returns ``(span starts, span ends)``."""
    lo, hi = starts, starts + run
    if segments is not None and len(segments[0]):
        seg_lo, seg_hi = segments
        last = len(seg_lo) - 1
        i = np.searchsorted(seg_lo, lo, side="right") - 1
        ic = np.clip(i, 0, last)
        lo = np.where((i >= 0) & (seg_hi[ic] > lo), seg_lo[ic], lo)
        j = np.searchsorted(seg_lo, hi, side="left") - 1
        jc = np.clip(j, 0, last)
        hi = np.where((j >= 0) & (seg_hi[jc] > hi), seg_hi[jc], hi)
    breaks = np.flatnonzero(lo[1:] - hi[:-1] > gap)
    return lo[np.concatenate(([0], breaks + 1))], hi[np.concatenate((breaks, [len(hi) - 1]))]


def copy_box_out(buffer: torch.Tensor, lead: int, nbytes: int, dtype, sizes, item: ReadItem, target, planner):
    """The step after a read of a bounding range: ``buffer[lead : lead + nbytes]`` holds a
    row-major chunk of shape ``sizes`` from the item's first element on; copy the item's
    box out of it into ``target`` and commit it."""
    strides = [1] * len(sizes)
    for d in range(len(sizes) - 2, -1, -1):
        strides[d] = strides[d + 1] * sizes[d + 1]

    def finish() -> None:
        elems = buffer[lead : lead + nbytes].view(dtype)
        src = elems.as_strided(tuple(item.lengths), tuple(strides), elems.storage_offset())
        target.copy_(src)
        planner.commit_tensor(item, target)

    return finish


def _read_error(failure: _native.ReadFailure, keys: list[str], total: int) -> Exception:
    more = f" ({total - 1} more read failures)" if total > 1 else ""
    key = keys[failure.request]
    where = f"{failure.path} while reading {key!r}"
    if failure.kind == "checksum":
        return ChecksumMismatchError(f"{where}: {failure.message}; the file is corrupt{more}")
    if failure.kind == "truncated":
        return CorruptCheckpointError(f"{where}: the data file is truncated: {failure.message}{more}")
    err = OSError(failure.errno, f"reading {key!r} failed: {failure.message}{more}", failure.path)
    err.offset = failure.offset
    return err
