"""The reader's read batch: the reads of a load plan's items handed to the store together
(:meth:`Store.read_batch`: the engine's threads for a directory, ranged reads in flight for
object storage), compressed chunks' frames decompressed, then the items committed to DCP.

A slice of a saved chunk along dim 0 (or the whole chunk) is one contiguous range, read (or
decompressed) straight into the destination when that is a contiguous CPU tensor of the
saved dtype and the range needs no widening; other slices go through a temporary holding
their bounding range, from which their box is copied out."""

from __future__ import annotations

import io
import math
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlanner, ReadItem

from dcp_datastates.core.compression.codec import default_threads, run_parallel
from dcp_datastates.core.compression.read import add_frame_reads, block_span
from dcp_datastates.core.stock_dcp import add_stock_item
from dcp_datastates.errors import ChecksumMismatchError, CorruptCheckpointError
from dcp_datastates.format.rank_index import RankIndex
from dcp_datastates.format.safe_objects import plain_object_stream
from dcp_datastates.native import engine as _native
from dcp_datastates.storage import RangeRead, StoreError

if TYPE_CHECKING:
    from dcp_datastates.core.reader import DataStatesReader


class ReadBatch:
    """A set of reads handed to the store together, then committed to DCP."""

    def __init__(self, reader: DataStatesReader) -> None:
        self.reader = reader
        self.reads: list[RangeRead] = []
        self.keys: list[str] = []
        self.keep: list[Any] = []
        self.after: list[Callable[[], None]] = []
        self.decode: list[Callable[[], None]] = []  # decompressions, run in parallel before ``after``
        self.temp_bytes = 0
        self.read_bytes = 0  # stored bytes requested (compressed frames as stored)
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

    def add(self, item: ReadItem, planner: LoadPlanner) -> None:
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

    def run(self) -> None:
        self._read()
        run_parallel(self.decode, default_threads())
        for fn in self.after:
            fn()

    def _read(self) -> None:
        """Carry out every read (in parallel, verified); the first failure is raised, naming the
        file and the key."""
        if not self.reads:
            return
        try:
            failures = self.reader.store.read_batch(self.reads, threads=self.reader.concurrency)
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
