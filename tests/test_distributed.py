"""Multi-process save/load through DCP with gloo on CPU, bit-exact against full references.

Ranks run as subprocesses (see dist_helpers.run_ranks): one launch saves the
2-rank checkpoints that several tests share; 1-process loads run in the
pytest process itself with ``no_dist=True`` and no process group.
"""

from __future__ import annotations

import collections
import os
import shutil
import types

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException


import dist_helpers as dh  # noqa: E402
from dcp_datastates import ChecksumMismatchError, DataStatesReader, verify  # noqa: E402
from dcp_datastates.format.checkpoint_layout import CheckpointLayout  # noqa: E402

pytestmark = [pytest.mark.dist, pytest.mark.slow, pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")]


def _load_1proc(state, path, **reader_kwargs):
    dcp.load(state, storage_reader=DataStatesReader(path, **reader_kwargs), no_dist=True)
    return state


# ---------------------------------------------------------------------------
# the harness itself
# ---------------------------------------------------------------------------


def test_harness_reports_worker_assertions(tmp_path):
    with pytest.raises(dh.WorkersFailed) as info:
        dh.run_ranks("selftest_fail", 2, tmp_path)
    text = str(info.value)
    for rank in (0, 1):
        assert f"deliberate failure on rank {rank}" in text
    assert "Traceback" in text and "AssertionError" in text


def test_harness_kills_hung_workers(tmp_path):
    with pytest.raises(dh.WorkersFailed, match="timed out"):
        dh.run_ranks("selftest_hang", 2, tmp_path, timeout=6)


# ---------------------------------------------------------------------------
# 2-rank checkpoint of plain tensors, DTensors and objects
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dtensor_ckpts(tmp_path_factory):
    """Saved once on 2 ranks: with DCP's default planner and with DataStatesSavePlanner."""
    root = tmp_path_factory.mktemp("dist_dtensor")
    paths = types.SimpleNamespace(
        default=root / "default", planner=root / "planner", striped=root / "striped", logs=root / "logs"
    )
    dh.run_ranks(
        "save_dtensor_state", 2, paths.logs, default_path=paths.default, planner_path=paths.planner,
        striped_path=paths.striped,
    )
    return paths


def _check_two_rank_layout(path):
    metadata = DataStatesReader(path).read_metadata()
    layout = metadata.storage_data
    assert isinstance(layout, CheckpointLayout)
    assert [r.rank for r in layout.ranks] == [0, 1]
    chunks = collections.defaultdict(list)
    for index, loc in layout.locations.items():
        chunks[index.fqn].append(loc)
    # Replicated tensors (plain and Replicate() DTensors) were deduplicated: stored once.
    for key in dh.PLAIN_KEYS + ("dt_rep",):
        assert len(chunks[key]) == 1, f"{key} stored {len(chunks[key])} times"
    # Each evenly-populated sharded DTensor has one chunk per rank, in that rank's file.
    for key, (_, _, code) in dh.DTENSOR_SPECS.items():
        if code != "R" and key != "dt_tiny":
            files = sorted(loc.relative_path for loc in chunks[key])
            assert len(files) == 2 and files[0].startswith("rank00000-") and files[1].startswith("rank00001-"), (key, files)
    # Objects (flattened: nested dicts become dotted keys) are stored once, as objects.
    for key in ("epoch", "name", "cfg.lr", "cfg.betas", "cfg.nested.flag", "cfg.nested.tags"):
        assert len(chunks[key]) == 1 and chunks[key][0].is_object, (key, chunks[key])
    on_disk = sorted(f for f in os.listdir(path) if f.endswith(".data"))
    assert on_disk == sorted(r.data_file for r in layout.ranks)
    return layout


def test_a_load_of_no_checkpoint_raises_the_same_typed_error_on_every_rank(tmp_path):
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "README.txt").write_text("not a checkpoint")
    dh.run_ranks("load_missing_checkpoint", 2, tmp_path / "logs", missing=str(tmp_path / "nope"),
                 not_a_checkpoint=str(tmp_path / "notes"))
    for rank in range(2):
        log = (tmp_path / "logs" / f"load_missing_checkpoint-rank{rank}.log").read_text()
        assert f"rank {rank}: every load raised CheckpointNotFoundError" in log, log
        assert "Global metadata is not found" not in log and "Traceback" not in log, log


def test_save_2ranks_load_1proc_without_process_group(dtensor_ckpts):
    path = dtensor_ckpts.default
    _check_two_rank_layout(path)
    state = _load_1proc(dh.full_targets(), path)
    dh.assert_equal_exact(state, dh.reference_state())


def test_save_2ranks_load_1proc_without_targets(dtensor_ckpts):
    """What dcp_to_torch_save does: load everything into an empty state dict."""
    from dcp_datastates._dcp_compat import load_into_empty_state_dict

    state = load_into_empty_state_dict(DataStatesReader(dtensor_ckpts.default))
    dh.assert_equal_exact(state, dh.reference_state())


def test_save_2ranks_load_2ranks_same_placements(dtensor_ckpts):
    dh.run_ranks("load_dtensor_state", 2, dtensor_ckpts.logs, path=dtensor_ckpts.default)


def test_save_2ranks_load_3ranks_resharded(dtensor_ckpts):
    dh.run_ranks("load_resharded", 3, dtensor_ckpts.logs, path=dtensor_ckpts.default)


def test_save_2ranks_striped_load_1proc_and_3ranks_resharded(dtensor_ckpts):
    """Each rank's data over several files (format 7): a reshard reads slices from each."""
    path = dtensor_ckpts.striped
    layout = DataStatesReader(path).read_metadata().storage_data
    assert [len(r.stripes) for r in layout.ranks] == [1, 1]  # each rank has two large tensors
    on_disk = sorted(f for f in os.listdir(path) if f.endswith(".data"))
    assert on_disk == sorted(f for r in layout.ranks for f in r.data_files())
    state = _load_1proc(dh.full_targets(), path)
    dh.assert_equal_exact(state, dh.reference_state())
    dh.run_ranks("load_resharded", 3, dtensor_ckpts.logs, path=path)
    assert verify(path).ok


def test_save_2ranks_with_datastates_planner_load_1proc(dtensor_ckpts):
    path = dtensor_ckpts.planner
    _check_two_rank_layout(path)
    state = _load_1proc(dh.full_targets(), path)
    dh.assert_equal_exact(state, dh.reference_state())


_unwrap = dh.unwrap_checkpoint_exception


def _flip_byte(path, relative_path, offset):
    with open(os.path.join(path, relative_path), "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x10]))


def test_corrupt_rank1_data_file_fails_1proc_load(dtensor_ckpts, tmp_path):
    path = tmp_path / "ckpt"
    shutil.copytree(dtensor_ckpts.default, path)
    layout = DataStatesReader(path).read_metadata().storage_data
    rank1_file = next(r.data_file for r in layout.ranks if r.rank == 1)
    assert rank1_file.startswith("rank00001-") and rank1_file.endswith(".data")
    # The largest tensor chunk stored in rank 1's file; flip one byte in its middle.
    index, loc = max(
        ((i, l) for i, l in layout.locations.items() if l.relative_path == rank1_file and not l.is_object),
        key=lambda il: il[1].length,
    )
    assert loc.length > 0
    _flip_byte(path, rank1_file, loc.offset + loc.length // 2)

    with pytest.raises((ChecksumMismatchError, CheckpointException)) as info:
        _load_1proc(dh.full_targets(), path)
    err = _unwrap(info.value)
    assert isinstance(err, ChecksumMismatchError), f"{type(err).__name__}: {err}"
    assert rank1_file in str(err), str(err)
    assert repr(index.fqn) in str(err), str(err)

    # With verification off the load goes through and only that key differs.
    state = _load_1proc(dh.full_targets(), path, verify=False)
    ref = dh.reference_state()
    assert not torch.equal(state[index.fqn], ref[index.fqn])
    del state[index.fqn], ref[index.fqn]
    dh.assert_equal_exact(state, ref)


# ---------------------------------------------------------------------------
# FSDP2 model + AdamW state
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fsdp_ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("dist_fsdp")
    paths = types.SimpleNamespace(path=root / "ckpt", reference=root / "reference.pt", logs=root / "logs")
    dh.run_ranks("fsdp_save", 2, paths.logs, path=paths.path, reference_path=paths.reference)
    return paths


def test_fsdp2_save_2ranks_load_1proc_plain_model(fsdp_ckpt):
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    ref = torch.load(fsdp_ckpt.reference, weights_only=False)
    model, optim = dh.new_model_and_optim(dh.MLP_SEED + 7)
    msd, osd = get_state_dict(model, optim)  # also creates the optimizer state to load into
    state = {"model": msd, "optim": osd}
    _load_1proc(state, fsdp_ckpt.path)
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])

    dh.assert_equal_exact(dict(model.state_dict()), ref["model"], "model")
    msd2, osd2 = get_state_dict(model, optim)
    dh.assert_equal_exact(msd2, ref["model"], "model")
    dh.assert_equal_exact(osd2, ref["optim"], "optim")
    # The optimizer itself (not only the state dict view) holds the loaded state.
    for name, param in model.named_parameters():
        st = optim.state[param]
        for k in ("step", "exp_avg", "exp_avg_sq"):
            dh.assert_equal_exact(st[k], ref["optim"]["state"][name][k], f"optim.state[{name}].{k}")


def test_fsdp2_save_2ranks_load_2ranks_fsdp(fsdp_ckpt):
    dh.run_ranks("fsdp_load", 2, fsdp_ckpt.logs, path=fsdp_ckpt.path, reference_path=fsdp_ckpt.reference)


def test_corrupt_rank1_data_file_fails_resharded_2rank_load(dtensor_ckpts, tmp_path):
    """Same corruption check when the load reshards (dt_big_s0 saved Shard(0), loaded Shard(1))."""
    path = tmp_path / "ckpt"
    shutil.copytree(dtensor_ckpts.default, path)
    layout = DataStatesReader(path).read_metadata().storage_data
    rank1_file = next(r.data_file for r in layout.ranks if r.rank == 1)
    ((index, loc),) = [
        (i, l) for i, l in layout.locations.items() if i.fqn == "dt_big_s0" and l.relative_path == rank1_file
    ]
    # Row 2, column 3 of rank 1's chunk (rows 129.. of the full tensor): read by rank 0 for its
    # Shard(1) columns 0..64 (full columns are read in one bounding range per saved chunk).
    itemsize = dh.DTENSOR_SPECS["dt_big_s0"][1].itemsize
    cols = dh.DTENSOR_SPECS["dt_big_s0"][0][1]
    _flip_byte(path, rank1_file, loc.offset + (2 * cols + 3) * itemsize)
    dh.run_ranks(
        "load_expect_checksum_error", 2, tmp_path / "logs",
        path=path, placements={"dt_big_s0": "S1"}, data_file=rank1_file, key="dt_big_s0",
    )


# -- dcp.async_save on 2 ranks ---------------------------------------------------


@pytest.fixture(scope="module")
def async_ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("dist_async")
    paths = types.SimpleNamespace(
        dtensor=root / "dtensor", fsdp=root / "fsdp", reference=root / "reference.pt", logs=root / "logs"
    )
    dh.run_ranks("async_save_dtensor_state", 2, paths.logs, path=paths.dtensor)
    dh.run_ranks("fsdp_async_saves", 2, paths.logs, path=paths.fsdp, reference_path=paths.reference)
    return paths


def test_async_save_2ranks_holds_state_at_call_time(async_ckpts):
    # Every tensor was mutated right after the fence; the checkpoint holds the values before.
    _check_two_rank_layout(async_ckpts.dtensor)
    dh.run_ranks("load_dtensor_state", 2, async_ckpts.logs, path=async_ckpts.dtensor)
    state = _load_1proc(dh.full_targets(), async_ckpts.dtensor)
    dh.assert_equal_exact(state, dh.reference_state())


def test_async_save_2ranks_load_3ranks_resharded(async_ckpts):
    dh.run_ranks("load_resharded", 3, async_ckpts.logs, path=async_ckpts.dtensor)


@pytest.mark.parametrize("i", [0, 2])
def test_fsdp2_async_saves_in_flight_each_hold_their_step(async_ckpts, i):
    dh.run_ranks(
        "fsdp_load", 2, async_ckpts.logs, path=f"{async_ckpts.fsdp}.{i}", reference_path=f"{async_ckpts.reference}.{i}"
    )
