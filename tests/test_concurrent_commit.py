"""Two saves into one directory at the same time: exactly one commits.

Before the commit was a no-replace rename, both saves reported success and
the later rename silently replaced the checkpoint the earlier one had
committed (8 of 8 trials). Now the loser fails with CheckpointExistsError,
removes its own files, and the winner's checkpoint loads bit-exactly.

The race is made deterministic: the losing save is paused after its checks
(inside ``resolve_data``, during ``write_data``), and another process
commits a checkpoint into the same directory meanwhile.
"""

from __future__ import annotations

import errno
import multiprocessing
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner

from conftest import assert_same, data_files, index_files, load, raises_from_checkpoint
from dcp_datastates import DataStatesWriter, verify
from dcp_datastates.storage import fsync_files
from dcp_datastates.errors import CheckpointExistsError

pytestmark = [pytest.mark.subprocess, pytest.mark.slow]

_OTHER_SAVE = textwrap.dedent(
    """
    import sys, warnings, torch
    warnings.filterwarnings("ignore")
    import torch.distributed.checkpoint as dcp
    from dcp_datastates import DataStatesWriter
    torch.manual_seed(7)
    dcp.save({"w": torch.randn(300, 300), "step": 7}, storage_writer=DataStatesWriter(sys.argv[1]), no_dist=True)
    """
)


def _winner_state():
    torch.manual_seed(7)
    return {"w": torch.randn(300, 300), "step": 7}


def _commit_from_another_process(path: str) -> None:
    subprocess.run([sys.executable, "-c", _OTHER_SAVE, path], check=True, timeout=120)


class _RacingPlanner(DefaultSavePlanner):
    """Commits another process's checkpoint into the same directory while this save writes."""

    def __init__(self, path: str) -> None:
        super().__init__()
        self.path = path
        self.raced = False

    def resolve_data(self, write_item):
        if not self.raced:
            self.raced = True
            _commit_from_another_process(self.path)
        return super().resolve_data(write_item)


def _loser_state():
    return {"w": torch.full((300, 300), -1.0), "step": 99}


def _check_winner_intact(path):
    assert sorted(n for n in os.listdir(path) if not n.startswith(".")) == sorted(data_files(path) + index_files(path))
    assert len(data_files(path)) == 1 and len(index_files(path)) == 1, os.listdir(path)
    assert verify(str(path)).ok
    out = {"w": torch.zeros(300, 300), "step": 0}
    load(out, path)
    assert_same(out, _winner_state())


def test_sync_save_loses_race_and_leaves_the_winner(tmp_path):
    path = tmp_path / "ckpt"
    planner = _RacingPlanner(str(path))
    with raises_from_checkpoint(CheckpointExistsError, match="another save committed"):
        dcp.save(_loser_state(), storage_writer=DataStatesWriter(path), planner=planner, no_dist=True)
    assert planner.raced
    _check_winner_intact(path)


def test_async_save_loses_race_and_leaves_the_winner(tmp_path):
    path = tmp_path / "ckpt"
    planner = _RacingPlanner(str(path))
    writer = DataStatesWriter(path)
    resp = dcp.async_save(_loser_state(), storage_writer=writer, planner=planner, no_dist=True)
    resp.staging_completion.result(timeout=120)
    with raises_from_checkpoint(CheckpointExistsError, match="another save committed"):
        resp.upload_completion.result(timeout=120)
    with pytest.raises(Exception):  # the background error is raised once more, by close()
        writer.close()
    assert planner.raced
    _check_winner_intact(path)


def test_overwrite_true_still_replaces(tmp_path):
    path = tmp_path / "ckpt"
    planner = _RacingPlanner(str(path))
    dcp.save(_loser_state(), storage_writer=DataStatesWriter(path, overwrite=True), planner=planner, no_dist=True)
    out = {"w": torch.zeros(300, 300), "step": 0}
    load(out, path)
    assert_same(out, _loser_state())
    assert len(data_files(path)) == 1


def _race_worker(path_root: str, trials: int, barrier, tag: int, results) -> None:
    import warnings

    warnings.filterwarnings("ignore")
    outcomes = []
    for trial in range(trials):
        path = os.path.join(path_root, f"t{trial}")
        state = {"w": torch.full((256, 256), float(tag)), "who": tag}
        barrier.wait(timeout=60)
        try:
            dcp.save(state, storage_writer=DataStatesWriter(path), no_dist=True)
            outcomes.append("committed")
        except BaseException as exc:  # noqa: BLE001 - classified by the parent
            inner = exc
            failures = getattr(exc, "failures", None)
            if failures:
                inner = next(iter(failures.values()))[0]
            outcomes.append("exists" if isinstance(inner, CheckpointExistsError) else f"error: {inner!r}")
    results.put((tag, outcomes))


def test_two_processes_racing_exactly_one_commits(tmp_path):
    """No pause: two processes start the same saves at a barrier, several times."""
    trials = 4
    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_race_worker, args=(str(tmp_path), trials, barrier, tag, results)) for tag in (1, 2)]
    for p in procs:
        p.start()
    got = dict(results.get(timeout=240) for _ in procs)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    for trial in range(trials):
        outcomes = sorted(got[tag][trial] for tag in (1, 2))
        assert outcomes == ["committed", "exists"], (trial, got)
        winner = 1 if got[1][trial] == "committed" else 2
        out = {"w": torch.zeros(256, 256), "who": 0}
        path = tmp_path / f"t{trial}"
        load(out, path)
        assert_same(out, {"w": torch.full((256, 256), float(winner)), "who": winner})
        assert len(data_files(path)) == 1 and len(index_files(path)) == 1


# -- the three ways rename_without_replacing commits ---------------------------------


def _prepare(tmp_path, existing: bool):
    d = tmp_path / "d"
    d.mkdir()
    (d / "tmp").write_bytes(b"new")
    if existing:
        (d / "final").write_bytes(b"old")
    return str(d / "tmp"), str(d / "final"), str(d)


@pytest.mark.parametrize("mechanism", ["renameat2", "link", "flock"])
def test_rename_without_replacing(tmp_path, monkeypatch, mechanism):
    if mechanism != "renameat2":
        monkeypatch.setattr(fsync_files, "_rename_noreplace", lambda src, dst: False)
    if mechanism == "flock":
        def no_links(src, dst):
            raise OSError(errno.EPERM, "Operation not permitted", src)

        monkeypatch.setattr(fsync_files.os, "link", no_links)
    tmp, final, d = _prepare(tmp_path, existing=False)
    fsync_files.rename_without_replacing(tmp, final, d)
    assert not os.path.exists(tmp) and open(final, "rb").read() == b"new"

    other = tmp_path / "other"
    other.mkdir()
    tmp, final, d = _prepare(other, existing=True)
    with pytest.raises(FileExistsError) as info:
        fsync_files.rename_without_replacing(tmp, final, d)
    assert info.value.filename == final
    assert open(final, "rb").read() == b"old" and os.path.exists(tmp)
