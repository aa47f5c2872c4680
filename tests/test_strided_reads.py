"""Resharded loads of boxes that are not one range of a saved chunk (column slices, 2-D blocks,
inner slices) read only the spans holding the box's row-runs, still verified."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
from torch.distributed.checkpoint.planner import LoadPlan
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from conftest import data_files, raises_from_checkpoint, save
from dcp_datastates import ChecksumMismatchError, DataStatesReader
from dcp_datastates.core.read_batch import box_runs, needed_spans
from dcp_datastates.storage import Store
from dcp_datastates.storage.local import LocalStore

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "support"))


class BoxLoadPlanner(DefaultLoadPlanner):
    """DCP's planner, loading box ``(offsets, sizes)`` of each saved tensor named in ``boxes`` into
    the state dict's tensor of that name (which has the box's shape): DCP computes which saved
    chunks overlap the box and the read items, as it does for a resharded DTensor."""

    def __init__(self, boxes):
        super().__init__()
        self.boxes = boxes

    def create_local_plan(self):
        items = []
        for fqn, (offsets, sizes) in self.boxes.items():
            md = self.metadata.state_dict_metadata[fqn]
            items += create_read_items_for_chunk_list(fqn, md, [ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes))])
        return LoadPlan(items)

    def lookup_tensor(self, index: MetadataIndex):
        return self.state_dict[index.fqn]


def load_box(path, fqn, offsets, sizes, dest=None, **reader_kwargs):
    dest = torch.zeros(sizes, dtype=torch.float32) if dest is None else dest
    reader = DataStatesReader(path, **reader_kwargs)
    dcp.load({fqn: dest}, storage_reader=reader, planner=BoxLoadPlanner({fqn: (offsets, sizes)}), no_dist=True)
    return dest, reader


def box_of(full, offsets, sizes):
    return full[tuple(slice(o, o + n) for o, n in zip(offsets, sizes))]


def reference(shape, dtype, seed=7):
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, shape, generator=g, dtype=torch.int64).to(dtype)


def test_box_runs_of_column_slices_blocks_and_inner_slices():
    run, starts = box_runs((4, 6), (0, 2), (4, 3))
    assert run == 3 and starts.tolist() == [2, 8, 14, 20]
    run, starts = box_runs((5, 4, 3), (1, 1, 0), (2, 2, 3))  # the last dim whole joins the run
    assert run == 6 and starts.tolist() == [15, 27]
    run, starts = box_runs((5, 4, 3), (1, 0, 1), (2, 4, 1))
    assert run == 1 and starts.tolist() == [13, 16, 19, 22, 25, 28, 31, 34]


def test_needed_spans_widen_to_segments_then_merge_small_gaps():
    starts = np.array([0, 100, 200, 1000], dtype=np.int64)
    lo, hi = needed_spans(starts, 10)
    assert lo.tolist() == [0, 100, 200, 1000] and hi.tolist() == [10, 110, 210, 1010]
    lo, hi = needed_spans(starts, 10, gap=90)
    assert lo.tolist() == [0, 1000] and hi.tolist() == [210, 1010]
    segs = (np.arange(0, 1088, 64, dtype=np.int64), np.arange(64, 1152, 64, dtype=np.int64))
    lo, hi = needed_spans(starts, 10, segs)  # widened to 64-byte segments; touching spans are one
    assert lo.tolist() == [0, 192, 960] and hi.tolist() == [128, 256, 1024]
    lo, hi = needed_spans(np.array([96, 600], dtype=np.int64), 100, segs)  # a run across two segments
    assert lo.tolist() == [64, 576] and hi.tolist() == [256, 704]


BOXES = [
    ((64, 1024), (0, 256), (64, 512)),  # a column slice (Shard(1) of a Shard(0) save)
    ((64, 1024), (16, 512), (32, 512)),  # a 2-D block
    ((64, 1024), (3, 1), (61, 5)),  # narrow: runs merged across small gaps
    ((8, 16, 256), (2, 4, 64), (5, 8, 128)),  # a 3-D inner slice
    ((8, 16, 256), (0, 4, 0), (8, 8, 256)),  # whole inner rows: runs of 8 x 256
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64, torch.int8])
@pytest.mark.parametrize("shape,offsets,sizes", BOXES)
@pytest.mark.parametrize("verify", [True, False])
def test_box_loads_are_bit_exact(tmp_path, dtype, shape, offsets, sizes, verify):
    full = reference(shape, dtype)
    save({"w": full}, tmp_path / "c", window_bytes=4096, host_cache_bytes=4 << 20)
    out, reader = load_box(tmp_path / "c", "w", offsets, sizes, torch.zeros(sizes, dtype=dtype), verify=verify)
    assert torch.equal(out.view(torch.uint8), box_of(full, offsets, sizes).contiguous().view(torch.uint8))
    assert reader.bytes_needed == out.numel() * dtype.itemsize
    # widened to whole 4 KiB segments, a box may need a byte of every one
    assert reader.bytes_needed <= reader.bytes_read <= full.numel() * dtype.itemsize
    if not verify:
        assert reader.bytes_read < full.numel() * dtype.itemsize


def test_non_contiguous_destination(tmp_path):
    full = reference((128, 256), torch.float32)
    save({"w": full}, tmp_path / "c")
    dest = torch.zeros(96, 40).t()  # a transposed view: (40, 96)
    out, _ = load_box(tmp_path / "c", "w", (50, 100), (40, 96), dest)
    assert out is dest and torch.equal(out, full[50:90, 100:196])


def _chunk_start(path, fqn="w"):
    reader = DataStatesReader(path)
    reader.load_metadata()
    loc = reader.layout.location(MetadataIndex(fqn, (0, 0)))
    return os.path.join(path, loc.relative_path), loc.offset


def _flip(path, pos):
    with open(path, "r+b") as f:
        f.seek(pos)
        b = f.read(1)
        f.seek(pos)
        f.write(bytes([b[0] ^ 0x10]))


def test_reads_read_the_needed_segments_only_and_verify_them(tmp_path):
    # rows of 16 KiB, 4 KiB segments: columns [0, 1024) are one segment of each row
    full = reference((64, 4096), torch.float32)
    ckpt = tmp_path / "c"
    save({"w": full}, ckpt, window_bytes=4096, host_cache_bytes=4 << 20)
    data, start = _chunk_start(ckpt)
    assert start % 4096 == 0
    out, reader = load_box(ckpt, "w", (0, 0), (64, 1024))
    assert torch.equal(out, full[:, :1024]) and reader.bytes_read == reader.bytes_needed == 64 * 4096
    _flip(data, start + 10 * 16384 + 8192)  # row 10, column 2048: in no segment read
    out, reader = load_box(ckpt, "w", (0, 0), (64, 1024))
    assert torch.equal(out, full[:, :1024])
    with raises_from_checkpoint(ChecksumMismatchError, match="'w'"):
        load_box(ckpt, "w", (0, 2048), (64, 1024))  # that byte read now
    _flip(data, start + 20 * 16384 + 100)  # row 20, column 25: read
    with raises_from_checkpoint(ChecksumMismatchError, match=f"{data_files(ckpt)[0]} while reading 'w'") as info:
        load_box(ckpt, "w", (0, 0), (64, 1024))
    assert f"at offset {start + 20 * 16384}" in str(info.value)  # the segment of row 20's run
    out, _ = load_box(ckpt, "w", (0, 0), (64, 1024), verify=False)
    assert not torch.equal(out, full[:, :1024])  # unverified, the flipped byte comes through


def test_a_needed_run_cutting_a_segment_is_verified_whole(tmp_path):
    """With the default 8 MiB windows a column slice cuts through segments: the bytes beside it
    in those segments are read too, and a flipped one fails the load."""
    full = reference((64, 1024), torch.float32)
    ckpt = tmp_path / "c"
    save({"w": full}, ckpt)
    data, start = _chunk_start(ckpt)
    _flip(data, start + 5 * 4096 + 2048)  # row 5, column 512: outside the box [0, 256)
    with raises_from_checkpoint(ChecksumMismatchError, match="'w'"):
        load_box(ckpt, "w", (0, 0), (64, 256))
    out, reader = load_box(ckpt, "w", (0, 0), (64, 256), verify=False)
    assert torch.equal(out, full[:, :256]) and reader.bytes_read == reader.bytes_needed


@pytest.mark.dist
@pytest.mark.slow
def test_shard0_save_on_2_ranks_loads_as_shard1(tmp_path):
    import strided_workers

    path = tmp_path / "ckpt"
    strided_workers.CASES.run_ranks("save_shard0", 2, tmp_path / "logs", path=str(path))
    strided_workers.CASES.run_ranks("load_shard1", 2, tmp_path / "logs", path=str(path))


class _RangedStore(LocalStore):
    """A directory read the way an object store is (``Store.read_batch``: ranged reads, merged
    within ``merge_gap_bytes``, verified in Python), counting the bytes fetched."""

    def __init__(self, root, merge_gap_bytes):
        super().__init__(str(root))
        self.merge_gap_bytes = merge_gap_bytes
        self.fetched = 0

    def read_into(self, key, offset, out):  # read_range reads through this too
        self.fetched += len(out)
        super().read_into(key, offset, out)

    def read_batch(self, reads, *, threads=None):
        return Store.read_batch(self, reads, threads=threads)


@pytest.mark.parametrize("gap", [0, 1 << 20])
def test_object_store_path_reads_sub_ranges_merged_and_verified(tmp_path, gap):
    full = reference((64, 4096), torch.float32)
    save({"w": full}, tmp_path / "c", window_bytes=4096, host_cache_bytes=4 << 20)
    store = _RangedStore(tmp_path, gap)
    out, reader = load_box("c", "w", (0, 1024), (64, 1024), store=store)
    assert torch.equal(out, full[:, 1024:2048]) and reader.bytes_read == reader.bytes_needed
    # ranges closer than the store's merge gap are one request, the gaps fetched and dropped
    assert store.fetched == (64 * 4096 if gap == 0 else 63 * 16384 + 4096)
    data, start = _chunk_start(tmp_path / "c")
    _flip(data, start + 7 * 16384 + 3 * 4096)  # row 7, column 3072: fetched only when merged
    out, _ = load_box("c", "w", (0, 1024), (64, 1024), store=_RangedStore(tmp_path, gap))
    assert torch.equal(out, full[:, 1024:2048])
    _flip(data, start + 9 * 16384 + 4096 + 8)  # row 9, column 1026: needed
    with raises_from_checkpoint(ChecksumMismatchError, match=f"{data_files(tmp_path / 'c')[0]} while reading 'w'"):
        load_box("c", "w", (0, 1024), (64, 1024), store=_RangedStore(tmp_path, gap))


def _rank_index(path):
    from dcp_datastates.format.rank_index import decode_index

    (name,) = [f for f in os.listdir(path) if f.endswith(".index")]
    with open(os.path.join(path, name), "rb") as f:
        return decode_index(f.read(), name)


def test_checksum_bytes_segments_tile_the_data_at_its_multiples(tmp_path):
    """Segments finer than the write window (default 8 MiB windows here): every tensor is tiled by
    segments cut at multiples of checksum_bytes in the rank's data, and loads bit-exact."""
    full, small = reference((300, 1000), torch.float32), reference((7,), torch.float32, seed=8)
    save({"w": full, "s": small}, tmp_path / "c", checksum_bytes=4096)
    idx = _rank_index(tmp_path / "c")
    _, start = _chunk_start(tmp_path / "c")
    segs = list(zip(idx.seg_offsets, idx.seg_lengths))
    mine = [(o, n) for o, n in segs if start <= o < start + full.nbytes]
    cuts = list(range(start, start + full.nbytes, 4096))
    assert mine == [(c, min(4096, start + full.nbytes - c)) for c in cuts]
    assert all(o // 4096 == (o + n - 1) // 4096 for o, n in segs)  # none crosses a multiple of 4096
    out = {"w": torch.zeros_like(full), "s": torch.zeros_like(small)}
    dcp.load(out, storage_reader=DataStatesReader(tmp_path / "c"), no_dist=True)
    assert torch.equal(out["w"], full) and torch.equal(out["s"], small)


@pytest.mark.parametrize("store", [False, True])
def test_column_slices_of_small_segments_read_little_more_than_needed(tmp_path, store):
    """A Shard(1)-style load (left half of each row: 8 KiB runs in 16 KiB rows) with 4 KiB segments
    and the default 8 MiB windows reads at most 1.2x what it needs, still verified."""
    full = reference((1024, 4096), torch.float32)
    save({"w": full}, tmp_path / "c", checksum_bytes=4096)
    kwargs = {"store": _RangedStore(tmp_path, 0)} if store else {}
    out, reader = load_box("c" if store else tmp_path / "c", "w", (0, 0), (1024, 2048), **kwargs)
    assert torch.equal(out, full[:, :2048])
    assert reader.bytes_read <= 1.2 * reader.bytes_needed
    data, start = _chunk_start(tmp_path / "c")
    _flip(data, start + 33 * 16384 + 4096 + 5)  # row 33, column 1025: needed
    with raises_from_checkpoint(ChecksumMismatchError, match=f"{data_files(tmp_path / 'c')[0]} while reading 'w'") as info:
        load_box("c" if store else tmp_path / "c", "w", (0, 0), (1024, 2048),
                 **({"store": _RangedStore(tmp_path, 0)} if store else {}))
    assert str(start + 33 * 16384 + 4096) in str(info.value)  # the 4 KiB segment holding it


@pytest.mark.parametrize("bad", [1000, 2048, 3 * 4096, 16 << 20, True, 4096.0])
def test_an_invalid_checksum_bytes_is_refused_by_name(tmp_path, bad):
    from dcp_datastates import DataStatesWriter

    with pytest.raises(ValueError, match="checksum_bytes"):
        DataStatesWriter(tmp_path / "c", checksum_bytes=bad)
