"""Stock DCP and ours: DataStatesReader loads FileSystemWriter's checkpoints (core/stock_dcp.py),
and stock DCP's FileSystemReader, given one of ours, fails naming what it is.

A user switching to dcp_datastates keeps their older checkpoints: one reader loads both, at
any world size, from a directory or a store, through whatever stream transforms DCP applied
(ZStandard, or one of their own given in an ExtensionRegistry)."""

from __future__ import annotations

import copy
import os
import types

import pytest
import torch
import torch.distributed.checkpoint as dcp

from conftest import assert_same, load, raises_from_checkpoint, save, zeros_like_state
from dcp_datastates import CorruptCheckpointError, DataStatesReader, UnsupportedFormatError
from dcp_datastates._dcp_compat import zstandard_extension_class
from dcp_datastates.format.storage_data import STOCK_READER_FILE
from dcp_datastates.tools.checkpoint_view import FORMAT_DCP, CheckpointView
from stream_transforms import DESCRIPTOR, Rot13Bytes, registry
from test_reshard_verify import _SliceLoadPlanner

ZStandard = zstandard_extension_class()


def _state() -> dict:
    g = torch.Generator().manual_seed(3)
    return {
        "w": torch.randn(64, 48, generator=g),  # the slice load below reads rows of it
        "model": {
            "bf16": torch.randn(33, 7, generator=g).to(torch.bfloat16),
            "ints": torch.arange(-500, 500, dtype=torch.int64),
            "strided": torch.arange(35, dtype=torch.int32).reshape(5, 7).t(),
            "mask": torch.arange(10) % 3 == 0,
            "scalar": torch.tensor(2.5),
            "empty": torch.zeros(0, 4),
        },
        "step": 17,
        "meta": {"name": "run-a", "lrs": [0.1, 0.01]},
    }


def _stock(path, *extensions) -> dict:
    state = _state()
    dcp.save(state, storage_writer=dcp.FileSystemWriter(path, _extensions=list(extensions) or None), no_dist=True)
    return _state()


@pytest.mark.parametrize("transform", ["none", "zstd", "zstd+rot13"])
def test_stock_checkpoints_load_bit_exactly_and_resharded(tmp_path, transform):
    """Every kind of item, through no transform, DCP's ZStandard, or a chain of two (ZStandard
    then a transform of the user's: DCP's own reader undoes such a chain in the wrong order)."""
    extensions = {"none": [], "zstd": [ZStandard()], "zstd+rot13": [ZStandard(), Rot13Bytes()]}[transform]
    ref = _stock(tmp_path / "s", *extensions)
    kwargs = {"_extension_registry": registry()} if transform == "zstd+rot13" else {}
    assert_same(load(zeros_like_state(ref), tmp_path / "s", **kwargs), ref)
    part = {"w": torch.zeros(20, 48)}  # rows 30..50 of one saved chunk, as a reshard reads them
    dcp.load(part, storage_reader=DataStatesReader(tmp_path / "s", **kwargs), planner=_SliceLoadPlanner(30), no_dist=True)
    assert torch.equal(part["w"], ref["w"][30:50])


def test_one_reader_serves_a_switching_users_old_and_new_checkpoints(tmp_path):
    ref = _stock(tmp_path / "old")
    save(_state(), tmp_path / "new")
    reader = DataStatesReader()
    for path in ("old", "new", "old"):
        target = zeros_like_state(ref)
        dcp.load(target, checkpoint_id=tmp_path / path, storage_reader=reader, no_dist=True)
        assert_same(target, ref)
        assert (reader.layout is None) == (path == "old") and (reader.stock is None) == (path == "new")


def test_a_transform_the_reader_lacks_is_named_and_a_registry_supplies_it(tmp_path):
    ref = _stock(tmp_path / "s", Rot13Bytes())
    with raises_from_checkpoint((UnsupportedFormatError, AssertionError), match=f"'{DESCRIPTOR}'"):
        load(zeros_like_state(ref), tmp_path / "s")
    assert_same(load(zeros_like_state(ref), tmp_path / "s", _extension_registry=registry()), ref)
    view = CheckpointView(tmp_path / "s", extension_registry=registry())  # the tools read it the same way
    assert view.format == FORMAT_DCP and torch.equal(view.read_block("w", (3, 5), (4, 6)), ref["w"][3:7, 5:11])


def test_a_truncated_stock_file_is_a_named_error(tmp_path):
    ref = _stock(tmp_path / "s")
    (data,) = [p for p in (tmp_path / "s").iterdir() if p.suffix == ".distcp"]
    os.truncate(data, data.stat().st_size // 2)
    with raises_from_checkpoint(CorruptCheckpointError, match=data.name):
        load(zeros_like_state(ref), tmp_path / "s")


def test_stock_dcp_fails_on_ours_naming_what_to_load_it_with(tmp_path):
    """Format 9: stock DCP's FileSystemReader (dcp.load's default, torchtitan's load,
    dcp_to_torch_save) opens the file our storage data names and fails on it by name."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    save(_state(), tmp_path / "ours")
    ref = _state()
    expected = f"No such file or directory: '{tmp_path / 'ours' / STOCK_READER_FILE}'"
    for attempt in (
        lambda: dcp.load(zeros_like_state(ref), storage_reader=dcp.FileSystemReader(tmp_path / "ours"), no_dist=True),
        lambda: dcp_to_torch_save(tmp_path / "ours", tmp_path / "out.pt"),
    ):
        with pytest.raises(BaseException, match="FileNotFoundError") as info:  # DCP wraps it in CheckpointException
            attempt()
        assert expected in str(info.value) and "KeyError" not in str(info.value)
    assert not (tmp_path / "ours" / STOCK_READER_FILE).exists() and not (tmp_path / "out.pt").exists()


# -- several ranks, and object storage -----------------------------------------------------------


@pytest.fixture(scope="module")
def stock_two_ranks(tmp_path_factory):
    """The dist_helpers DTensor state saved by FileSystemWriter on 2 ranks, through ZStandard."""
    import stock_workers

    root = tmp_path_factory.mktemp("stock_dist")
    paths = types.SimpleNamespace(path=root / "zstd", logs=root / "logs")
    stock_workers.run_ranks("save_dtensor_state_stock", 2, paths.logs, path=str(paths.path), transforms=["zstd"])
    return paths


@pytest.mark.dist
@pytest.mark.slow
def test_a_two_rank_stock_checkpoint_loads_on_three_ranks_and_on_one(stock_two_ranks):
    import dist_helpers as dh
    import stock_workers

    stock_workers.run_ranks("load_resharded", 3, stock_two_ranks.logs, path=str(stock_two_ranks.path))
    target = dh.full_targets()
    load(target, stock_two_ranks.path)
    dh.assert_equal_exact(target, dh.reference_state())


@pytest.mark.slow
def test_a_stock_checkpoint_loads_from_object_storage(tmp_path, s3_server):
    from dcp_datastates.storage import open_store

    ref = _stock(tmp_path / "s", ZStandard())
    url = f"s3://{s3_server.bucket}/stock-{os.getpid()}-{id(ref):x}/step_1"
    store = open_store(url.rsplit("/", 1)[0])
    try:
        for name in sorted(os.listdir(tmp_path / "s"), key=lambda n: n == ".metadata"):  # .metadata last
            store.put_file(f"step_1/{name}", str(tmp_path / "s" / name))
    finally:
        store.close()
    assert_same(load(zeros_like_state(ref), url), copy.deepcopy(ref))
    view = CheckpointView(url)
    assert view.format == FORMAT_DCP and torch.equal(view.read_tensor("model.ints"), ref["model"]["ints"])


def test_a_stock_checkpoint_cannot_be_an_incremental_base(tmp_path):
    """What needs our layout (an incremental save's base, the manager's steps) names a stock
    checkpoint instead of failing on its missing layout."""
    _stock(tmp_path / "step_1")
    with raises_from_checkpoint(UnsupportedFormatError, match="a stock DCP checkpoint"):
        save(_state(), tmp_path / "step_2", base=tmp_path / "step_1")
