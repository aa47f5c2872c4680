"""The save contract, once, for both kinds of destination a save writes to (core/destination.py):
a directory (``LocalStore``) and a prefix in object storage (``S3Store``, a real SeaweedFS
server). Through the public API only: ``dcp.save``/``dcp.async_save`` with ``DataStatesWriter``,
``dcp.load`` with ``DataStatesReader``, ``verify``.

* a save round-trips bit-exactly (sync and async);
* a committed checkpoint is refused unless ``overwrite=True``, and stays loadable;
* ``overwrite=True`` replaces it and removes the old save's rank files;
* a save that fails part-way commits nothing and leaves none of its files;
* two saves racing into one empty location: exactly one commits;
* ``verify`` reports a committed save ok.

Single-kind tests stay where they are (test_errors.py and test_async.py for directories,
test_store_writer.py for object storage, test_concurrent_commit.py for racing processes).
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import textwrap
import uuid

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner

from conftest import assert_same, raises_from_checkpoint, zeros_like_state
from dcp_datastates import CheckpointError, CheckpointExistsError, DataStatesReader, DataStatesWriter, verify
from dcp_datastates.storage import open_store

METADATA = ".metadata"


@pytest.fixture(params=["directory", pytest.param("s3", marks=pytest.mark.s3)])
def location(request, tmp_path):
    """A fresh checkpoint location: ``tmp_path/"c"`` or a fresh prefix in the test bucket."""
    if request.param == "directory":
        return os.fspath(tmp_path / "c")
    bucket = request.getfixturevalue("s3_server").bucket
    return f"s3://{bucket}/dest-{uuid.uuid4().hex[:12]}/c"


def _state(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    special = torch.tensor([float("nan"), -0.0, float("inf"), -float("inf"), 1e-45])
    return {
        "w": torch.randn(256, 129, generator=g),
        "t": torch.randn(64, 48, generator=g).t(),  # not contiguous
        "half": torch.randn(33, 65, generator=g).to(torch.float16),
        "bf16": torch.randn(1000, generator=g).to(torch.bfloat16),
        "i64": torch.randint(-(1 << 62), 1 << 62, (77,), generator=g, dtype=torch.int64),
        "u8": torch.randint(0, 256, (301,), generator=g, dtype=torch.uint8),
        "mask": torch.rand(50, generator=g) > 0.5,
        "special": special + seed,  # NaN, -0.0, infinities, a subnormal (seed 0)
        "scalar": torch.tensor(3.5 + seed),
        "step": 7 + seed,
        "extra": {"name": f"run{seed}", "lrs": [0.1, 0.01]},
    }


def _files(location: str) -> list[str]:
    """Every name in the checkpoint's location (a directory's entries, or the prefix's objects)."""
    if location.startswith("s3://"):
        store = open_store(location)
        try:
            return sorted(store.list())
        finally:
            store.close()
    return sorted(os.listdir(location)) if os.path.isdir(location) else []


def _save(state, location, mode: str, **writer_kwargs) -> DataStatesWriter:
    writer = DataStatesWriter(location, **writer_kwargs)
    if mode == "sync":
        dcp.save(state, storage_writer=writer, no_dist=True)
    else:
        response = dcp.async_save(state, storage_writer=writer, no_dist=True)
        response.upload_completion.result(timeout=60)
        writer.close()
    return writer


def _load(location, like):
    out = zeros_like_state(like)
    dcp.load(out, storage_reader=DataStatesReader(location), no_dist=True)
    return out


def _own_files(writer: DataStatesWriter) -> list[str]:
    """The rank files the writer's last save wrote (the only rank here)."""
    return list(writer.last_save_stats.rank_files.file_names())


MODES = pytest.mark.parametrize("mode", ["sync", "async"])


# -- 1. a save round-trips --------------------------------------------------------------


@MODES
def test_a_save_loads_back_bit_exact(location, mode):
    state = _state(1)
    writer = _save(state, location, mode)
    out = _load(location, state)
    assert_same(out, state)  # torch.equal on the bytes: NaN payloads and -0.0 too
    for key, value in state.items():
        if isinstance(value, torch.Tensor) and key != "special":  # NaN != NaN: assert_same compares its bytes
            assert out[key].dtype == value.dtype and torch.equal(out[key], value), key
    assert out["extra"] == {"name": "run1", "lrs": [0.1, 0.01]} and out["step"] == 8
    assert _files(location) == sorted([METADATA, *_own_files(writer)])


# -- 2. a committed checkpoint is refused unless overwriting ----------------------------


@MODES
def test_saving_over_a_committed_checkpoint_is_refused_and_the_old_one_stays(location, mode):
    old = _state(1)
    _save(old, location, "sync")
    before = _files(location)
    with raises_from_checkpoint(CheckpointExistsError, match="overwrite=True") as info:
        _save(_state(2), location, mode)
    assert location in str(info.value)
    assert _files(location) == before  # nothing of the refused save was written
    assert_same(_load(location, old), old)


# -- 3. overwrite=True replaces it ------------------------------------------------------


@MODES
def test_overwrite_replaces_and_removes_the_old_rank_files(location, mode):
    old_writer = _save(_state(1), location, "sync")
    old_files = _own_files(old_writer)
    assert set(old_files) < set(_files(location))
    new = _state(2)
    new_writer = _save(new, location, mode, overwrite=True)
    new_files = _own_files(new_writer)
    assert not set(new_files) & set(old_files)
    assert _files(location) == sorted([METADATA, *new_files])  # the old save's files are gone
    assert_same(_load(location, new), new)
    report = verify(location)
    assert report.ok and not report.notes, report.summary()  # no strays left


# -- 4. a failed save commits nothing and leaves nothing of its own ---------------------


@MODES
def test_a_save_failing_part_way_commits_nothing_and_removes_its_files(location, mode):
    state = _state(1)
    state["bad"] = lambda: None  # cannot be pickled: fails while the tensors are written
    writer = DataStatesWriter(location)
    with raises_from_checkpoint((pickle.PicklingError, AttributeError), match="Can't pickle"):
        if mode == "sync":
            dcp.save(state, storage_writer=writer, no_dist=True)
        else:
            dcp.async_save(state, storage_writer=writer, no_dist=True).upload_completion.result(timeout=60)
    if mode == "async":
        with raises_from_checkpoint(CheckpointError, match="Can't pickle"):  # the background error, raised again
            writer.close()
    names = _files(location)
    assert METADATA not in names
    assert not [n for n in names if n.endswith((".data", ".index")) or n.startswith(METADATA)], names
    assert not verify(location).committed
    # The location is as good as new: the next save into it commits.
    state.pop("bad")
    _save(state, location, "sync")
    assert_same(_load(location, state), state)


# -- 5. two saves racing into one empty location: exactly one commits --------------------

# Another process that saves the winner's state into the locations it is sent (one JSON line
# each: the location and the environment the store reads) and answers with its files' names.
_COMMITTER = textwrap.dedent(
    """
    import json, os, sys, warnings
    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed.checkpoint as dcp
    from dcp_datastates import DataStatesWriter
    print("ready", flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        os.environ.update(request["env"])
        writer = DataStatesWriter(request["location"])
        dcp.save({"w": torch.arange(300.0).reshape(10, 30), "step": 7}, storage_writer=writer, no_dist=True)
        print(json.dumps(list(writer.last_save_stats.rank_files.file_names())), flush=True)
    """
)


def _winner_state():
    return {"w": torch.arange(300.0).reshape(10, 30), "step": 7}


class _Committer:
    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", _COMMITTER], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)

    def save(self, location: str) -> list[str]:
        env = {k: v for k, v in os.environ.items() if k.startswith("AWS_")}
        self.proc.stdin.write(json.dumps({"location": location, "env": env}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if line.strip() == "ready":
            line = self.proc.stdout.readline()
        assert line, f"the committing process exited with {self.proc.wait(timeout=30)}"
        return json.loads(line)

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


_RACE_TEST = "test_two_saves_racing_into_one_location_exactly_one_commits"


@pytest.fixture(scope="module", autouse=True)
def _committer_process(request):
    """One committing process for the module's races, started with the module's first case
    when a race is selected: its interpreter starts while the other cases run."""
    if not any(item.name.startswith(_RACE_TEST) for item in request.session.items):
        yield None
        return
    c = _Committer()
    yield c
    c.close()


@pytest.fixture
def committer(_committer_process):
    return _committer_process


class _RacingPlanner(DefaultSavePlanner):
    """Has the other process commit into the same location while this save writes (after the
    save's own checks that nothing is committed there): the race, made deterministic."""

    def __init__(self, committer: _Committer, location: str) -> None:
        super().__init__()
        self.committer, self.location = committer, location
        self.winner_files: list[str] | None = None

    def resolve_data(self, write_item):
        if self.winner_files is None:
            self.winner_files = self.committer.save(self.location)
        return super().resolve_data(write_item)


@pytest.mark.subprocess
@MODES
def test_two_saves_racing_into_one_location_exactly_one_commits(location, mode, committer):
    loser = {"w": torch.full((10, 30), -1.0), "step": 99}
    planner = _RacingPlanner(committer, location)
    writer = DataStatesWriter(location)
    with raises_from_checkpoint(CheckpointExistsError, match="another save committed"):
        if mode == "sync":
            dcp.save(loser, storage_writer=writer, planner=planner, no_dist=True)
        else:
            response = dcp.async_save(loser, storage_writer=writer, planner=planner, no_dist=True)
            response.upload_completion.result(timeout=60)
    if mode == "async":
        with raises_from_checkpoint(CheckpointError, match="another save committed"):
            writer.close()  # the background error, raised once more
    assert planner.winner_files is not None  # the other save committed during this one
    assert _files(location) == sorted([METADATA, *planner.winner_files])  # the loser's files are gone
    assert_same(_load(location, _winner_state()), _winner_state())
    assert verify(location).ok


# -- 6. verify ----------------------------------------------------------------------------


@MODES
def test_verify_reports_a_committed_save_ok(location, mode):
    state = _state(3)
    _save(state, location, mode)
    report = verify(location)
    assert report.ok and report.committed and not report.problems and not report.notes, report.summary()
    tensors = [v for v in state.values() if isinstance(v, torch.Tensor)]
    assert report.ranks == 1 and report.items >= len(tensors) + 2, report.summary()
    assert report.segments_checked > 0 and report.bytes_checked >= sum(t.nbytes for t in tensors), report.summary()
