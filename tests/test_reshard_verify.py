"""Resharding reads cut through checksum segments; every byte must still be verified."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from conftest import data_files, raises_from_checkpoint, save
from dcp_datastates import ChecksumMismatchError, DataStatesReader
from dcp_datastates.format.rank_index import RankIndex


def test_covering_range_widens_to_whole_segments():
    idx = RankIndex(0, "0" * 12, 10_000, [0, 100, 4096], [100, 3000, 5000], [0, 0, 0], [])
    assert idx.covering_range(0, 100) == (0, 100)  # exact segment
    assert idx.covering_range(150, 10) == (100, 3100)  # inside one segment
    assert idx.covering_range(50, 100) == (0, 3100)  # across two
    assert idx.covering_range(5000, 100) == (4096, 9096)
    assert idx.covering_range(3100, 500) == (3100, 3600)  # a gap: nothing to widen to


def test_stored_at_names_the_stripe_file_and_its_bounds():
    reader = DataStatesReader()
    one = RankIndex(0, "0" * 12, 10_000, [], [], [], [])
    assert reader.stored_at(one, "r.data", 5000) == ("r.data", 0, 0, None)
    striped = RankIndex(0, "0" * 12, 10_000, [], [], [], [])
    striped.apply_stripes(["r.data", "r.1.data", "r.2.data"], (4096, 8192), "r.index")
    assert reader.stored_at(striped, "r.data", 100) == ("r.data", 0, 0, 4096)
    assert reader.stored_at(striped, "r.data", 4096) == ("r.1.data", 1, 4096, 8192)
    assert reader.stored_at(striped, "r.data", 9000) == ("r.2.data", 2, 8192, 10_000)


class _SliceLoadPlanner(DefaultLoadPlanner):
    """Loads rows [lo, hi) of a saved tensor into a smaller destination, like a reshard does."""

    def __init__(self, lo):
        super().__init__()
        self.lo = lo

    def create_local_plan(self):
        from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem
        from torch.distributed.checkpoint.metadata import MetadataIndex

        dest = self.state_dict["w"]
        n = dest.shape[0]
        item = ReadItem(
            type=LoadItemType.TENSOR,
            dest_index=MetadataIndex("w", (0, 0)),
            dest_offsets=torch.Size((0, 0)),
            storage_index=MetadataIndex("w", (0, 0)),
            storage_offsets=torch.Size((self.lo, 0)),
            lengths=torch.Size((n, dest.shape[1])),
        )
        return LoadPlan([item])

    def resolve_tensor(self, read_item):
        return self.state_dict["w"]

    def commit_tensor(self, read_item, tensor):
        pass


@pytest.mark.parametrize("window", [64 << 10, 8 << 20])
def test_partial_dim0_read_is_verified_and_exact(tmp_path, window):
    full = torch.randn(4096, 64)  # 1 MiB: 16 segments with 64 KiB windows, 1 with 8 MiB
    save({"w": full}, tmp_path / "c", window_bytes=window, host_cache_bytes=4 * window)
    dest = {"w": torch.zeros(100, 64)}
    dcp.load(dest, storage_reader=DataStatesReader(tmp_path / "c"), planner=_SliceLoadPlanner(1000), no_dist=True)
    assert torch.equal(dest["w"], full[1000:1100])
    # Corrupt a byte of the saved chunk outside the rows read but inside a segment they touch.
    data = tmp_path / "c" / data_files(tmp_path / "c")[0]
    with open(data, "r+b") as f:
        pos = (1000 * 64 - 1) * 4 if window > (1 << 20) else ((1000 * 64 * 4) // window) * window
        f.seek(pos)
        b = f.read(1)
        f.seek(pos)
        f.write(bytes([b[0] ^ 0x01]))
    with raises_from_checkpoint(ChecksumMismatchError, match="'w'"):
        dcp.load({"w": torch.zeros(100, 64)}, storage_reader=DataStatesReader(tmp_path / "c"),
                 planner=_SliceLoadPlanner(1000), no_dist=True)
    out = {"w": torch.zeros(100, 64)}
    dcp.load(out, storage_reader=DataStatesReader(tmp_path / "c", verify=False), planner=_SliceLoadPlanner(1000), no_dist=True)
    assert torch.equal(out["w"], full[1000:1100])  # the flipped byte is outside the slice
