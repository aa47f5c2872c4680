"""CheckpointManager: step directories, the latest pointer, retention, resume, crash cleanup."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import warnings

import pytest
import torch

from conftest import assert_same
from dcp_datastates import CheckpointError, CheckpointExistsError, CorruptCheckpointError, verify
from dcp_datastates.native.faults import inject_fault
from dcp_datastates.manager.checkpoint_root import LATEST_FILE, is_committed, read_latest, step_dirs
from dcp_datastates.errors import CheckpointNotFoundError, IncompleteCheckpointError
from dcp_datastates.format.file_names import METADATA_FILE
from dcp_datastates.format.metadata_file import read_commit_sequence
from dcp_datastates.manager import CheckpointManagerOptions as Options
from dcp_datastates.manager.checkpoint_manager import CheckpointManager, CheckpointManagerWarning, SkippedCheckpointWarning
from dcp_datastates.manager.cleanup import LOCK_FILE
from manager_workers import load_step, run_ranks, state_at, zeros_like_state

pytestmark = [pytest.mark.dist, pytest.mark.subprocess, pytest.mark.slow]

HERE = os.path.dirname(os.path.abspath(__file__))
MODES = [pytest.param(True, id="async"), pytest.param(False, id="sync")]


def saved_steps(root) -> list[int]:
    return sorted(s for s, name in step_dirs(str(root)).items() if is_committed(os.path.join(root, name)))


def data_file(path) -> str:
    return os.path.join(path, next(n for n in sorted(os.listdir(path)) if n.endswith(".data")))


def flip_byte(path: str, offset: int = 100) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


# ---------------------------------------------------------------------------
# saving, the pointer, retention
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("async_save", MODES)
def test_save_layout_pointer_and_load(tmp_path, async_save):
    root = tmp_path / "run"
    with CheckpointManager(root, Options(keep_last=None, async_save=async_save)) as mgr:
        for step in (0, 5, 12):
            fut = mgr.save(step, state_at(step))
            if not async_save:
                assert fut.done()
        mgr.wait()
        assert sorted(os.listdir(root)) == [LOCK_FILE, LATEST_FILE, "step_00000000", "step_00000005", "step_00000012"]
        assert mgr.steps() == [0, 5, 12] and mgr.latest() == 12
        assert json.loads((root / LATEST_FILE).read_text()) == {"step": 12, "dir": "step_00000012", "sequence": 3}
        for step in (0, 5, 12):
            assert verify(mgr.path_of(step)).ok
            got, target = load_step(mgr, step)
            assert got == step
            assert_same(target, state_at(step))
        got, target = load_step(mgr)  # resume: the newest
        assert got == 12
        assert_same(target, state_at(12))


def test_load_of_empty_root_returns_none_and_leaves_state(tmp_path):
    mgr = CheckpointManager(tmp_path / "fresh")
    target = zeros_like_state()
    assert mgr.load(target) is None and mgr.latest() is None and mgr.steps() == []
    assert_same(target, zeros_like_state())
    with pytest.raises(CheckpointNotFoundError, match="no checkpoint of step 3"):
        mgr.load(target, 3)


@pytest.mark.parametrize("async_save", MODES)
def test_retention_keep_last_and_keep_every(tmp_path, async_save):
    root = tmp_path / "run"
    mgr = CheckpointManager(root, Options(keep_last=2, keep_every=30, async_save=async_save))
    history = []
    for step in range(10, 110, 10):
        mgr.save(step, state_at(step))
        mgr.wait()
        history.append(saved_steps(root))
    mgr.close()
    # keep_every=30 keeps 30, 60, 90 forever; keep_last=2 the two newest
    assert history[-1] == [30, 60, 90, 100]
    assert history[2] == [20, 30]  # after step 30: 10 went once 20 and 30 were committed
    assert read_latest(str(root)) == 100
    # never fewer than the newest committed one, at any point
    assert all(h and h[-1] == s for h, s in zip(history, range(10, 110, 10)))


def test_pointer_moves_only_after_commit_and_fsync(tmp_path, monkeypatch):
    import dcp_datastates.manager.checkpoint_root as root_module

    root = str(tmp_path / "run")
    events = []
    real_fsync, real_write = root_module.fsync_dir, root_module.write_latest

    def fsync_spy(path):
        events.append(("fsync", os.path.relpath(path, root)))
        real_fsync(path)

    def write_spy(r, step, sequence=None, rollbacks=()):
        path = os.path.join(r, f"step_{step:08d}")
        # the checkpoint is committed and both its directory and its entry in root are durable
        assert is_committed(path) and verify(path).ok
        events.append(("pointer", step))
        return real_write(r, step, sequence, rollbacks)

    monkeypatch.setattr(root_module, "fsync_dir", fsync_spy)
    monkeypatch.setattr(root_module, "write_latest", write_spy)
    with CheckpointManager(root, Options(async_save=True)) as mgr:
        mgr.save(7, state_at(7))
    pointer = events.index(("pointer", 7))
    assert events[pointer - 2:pointer + 1] == [("fsync", "step_00000007"), ("fsync", "."), ("pointer", 7)]


@pytest.mark.parametrize("async_save", MODES)
def test_failed_save_moves_no_pointer_and_deletes_nothing(tmp_path, async_save):
    root = tmp_path / "run"
    mgr = CheckpointManager(root, Options(keep_last=1, async_save=async_save))
    mgr.save(10, state_at(10))
    mgr.wait()
    with inject_fault("write", path="step_00000020", offset=None, errno=errno.ENOSPC):
        if async_save:
            fut = mgr.save(20, state_at(20))
            with pytest.raises(CheckpointError, match="step 20"):
                mgr.wait()
            assert fut.exception() is not None
        else:
            with pytest.raises(CheckpointError, match="step 20.*No space left"):
                mgr.save(20, state_at(20))
    # keep_last=1, yet the last committed checkpoint survives a failed newer save
    assert saved_steps(root) == [10] and read_latest(str(root)) == 10
    got, target = load_step(mgr)
    assert got == 10
    assert_same(target, state_at(10))
    mgr.save(20, state_at(20))  # the failed step can be saved again
    mgr.wait()
    assert saved_steps(root) == [20] and read_latest(str(root)) == 20
    mgr.close()


def test_retention_never_deletes_newer_steps(tmp_path):
    """A save of a smaller step than existing ones (after an explicit older load) deletes nothing above it."""
    root = tmp_path / "run"
    with CheckpointManager(root, Options(keep_last=1, async_save=False)) as mgr:
        for step in (10, 20):
            mgr.save(step, state_at(step))
        assert load_step(mgr, 20)[0] == 20
        mgr.save(15, state_at(15))
        assert mgr.steps() == [15, 20]


def test_committed_step_is_refused_unless_overwrite(tmp_path):
    root = tmp_path / "run"
    with CheckpointManager(root, Options(async_save=False)) as mgr:
        mgr.save(10, state_at(10))
        with pytest.raises(CheckpointExistsError, match="step_00000010.*overwrite=True"):
            mgr.save(10, state_at(11))
        mgr.save(10, state_at(11), overwrite=True)
        got, target = load_step(mgr, 10)
        assert_same(target, state_at(11))
        assert verify(mgr.path_of(10)).notes == []  # the replaced files are gone


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="keep_last"):
        CheckpointManager(tmp_path, Options(keep_last=0))
    with pytest.raises(ValueError, match="keep_every"):
        CheckpointManager(tmp_path, Options(keep_every=-5))
    mgr = CheckpointManager(tmp_path, Options(async_save=False))
    with pytest.raises(ValueError, match="non-negative int"):
        mgr.save(-1, state_at(0))
    mgr.close()
    with pytest.raises(RuntimeError, match="closed"):
        mgr.save(1, state_at(1))


def test_async_save_fence_waits_before_optimizer_step(tmp_path):
    """save() returns at once; an optimizer step right after it must not tear the snapshot."""
    root = tmp_path / "run"
    param = torch.nn.Parameter(torch.randn(8192, 1024))  # 32 MiB: still copying when the step runs
    opt = torch.optim.SGD([param], lr=0.5)
    expect = param.detach().clone()
    with CheckpointManager(root, Options(async_save=True, host_cache_bytes=16 << 20)) as mgr:
        mgr.save(1, {"p": param})
        param.grad = torch.ones_like(param)
        opt.step()  # the process-wide fence: waits while the snapshot still reads param
    target = {"p": torch.zeros_like(expect)}
    CheckpointManager(root).load(target)
    assert torch.equal(target["p"], expect)


_FENCE_HOLDERS = """
import sys, torch
from dcp_datastates import CheckpointManager
from dcp_datastates.core.async_save import fence

steps = []
fence.wait_for_snapshots = lambda timeout=None: steps.append(timeout)  # what the hook calls
param = torch.nn.Parameter(torch.zeros(4))
opt = torch.optim.SGD([param], lr=0.1)
param.grad = torch.ones_like(param)

def fenced():
    steps.clear()
    opt.step()
    return bool(steps)

a = CheckpointManager(sys.argv[1] + "/a")
b = CheckpointManager(sys.argv[1] + "/b")
seen = [fenced()]
a.save(1, {"p": param}).result()
b.save(1, {"p": param}).result()
seen.append(fenced())
a.close()
seen.append(fenced())  # b is still open: the one process-wide hook stays
b.close()
seen.append(fenced())  # the last manager closed: no hook left behind
print(seen)
"""


def test_closed_managers_leave_no_fence_hook_behind(tmp_path):
    """Two managers share the process-wide fence; it goes when the last one closes.

    In a fresh interpreter: a manager another test left open would hold the hook here.
    """
    proc = subprocess.run(
        [sys.executable, "-c", _FENCE_HOLDERS, str(tmp_path)], capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split("\n")[-2] == "[False, True, True, False]"


# ---------------------------------------------------------------------------
# resume: skipping bad checkpoints
# ---------------------------------------------------------------------------


def _three_steps(root) -> None:
    with CheckpointManager(root, Options(keep_last=None, async_save=False)) as mgr:
        for step in (10, 20, 30):
            mgr.save(step, state_at(step))


def _resume(root, **kw):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mgr = CheckpointManager(root, Options(keep_last=None, async_save=False, **kw))
        got, target = load_step(mgr)
    skipped = [str(w.message) for w in caught if issubclass(w.category, SkippedCheckpointWarning)]
    return mgr, got, target, skipped


def test_resume_skips_corrupt_data_with_a_warning(tmp_path):
    root = tmp_path / "run"
    _three_steps(root)
    flip_byte(data_file(root / "step_00000030"))
    mgr, got, target, skipped = _resume(root)
    assert got == 20
    assert_same(target, state_at(20))
    assert len(skipped) == 1 and "step 30" in skipped[0] and "checksum" in skipped[0].lower()
    # the skipped step may be saved again without overwrite=True
    mgr.save(30, state_at(30))
    assert load_step(mgr)[0] == 30


def test_resume_skips_corrupt_metadata_and_missing_rank_files(tmp_path):
    root = tmp_path / "run"
    _three_steps(root)
    with open(root / "step_00000030" / METADATA_FILE, "r+b") as f:
        f.truncate(50)
    os.unlink(data_file(root / "step_00000020"))
    _, got, target, skipped = _resume(root, cleanup=False)
    assert got == 10
    assert_same(target, state_at(10))
    assert len(skipped) == 2 and "step 30" in skipped[0] and "step 20" in skipped[1]
    assert "missing" in skipped[1]


def test_resume_full_verify_finds_damage_a_load_would_not_read(tmp_path):
    root = tmp_path / "run"
    _three_steps(root)
    flip_byte(data_file(root / "step_00000030"))
    # a load of only "step" would not read the damaged tensor; full_verify checks everything
    mgr = CheckpointManager(root, Options(keep_last=None, async_save=False))
    target = {"step": -1}
    assert mgr.load(target) == 30  # only the damaged tensor is bad, and it is not read
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert mgr.load(target, full_verify=True) == 20
    assert target["step"] == 20
    assert any("step 30" in str(w.message) for w in caught)


def test_resume_when_every_checkpoint_is_bad_raises_with_each_reason(tmp_path):
    root = tmp_path / "run"
    _three_steps(root)
    for step in (10, 20, 30):
        flip_byte(data_file(root / f"step_{step:08d}"))
    mgr = CheckpointManager(root, Options(keep_last=None, async_save=False))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SkippedCheckpointWarning)
        with pytest.raises(CorruptCheckpointError, match=r"could be loaded:\n  step 30: .*\n  step 20: .*\n  step 10: "):
            load_step(mgr)
    with pytest.raises(CorruptCheckpointError, match="cannot load step 20"):
        load_step(mgr, 20)


def test_explicit_uncommitted_step_is_refused(tmp_path):
    root = tmp_path / "run"
    _three_steps(root)
    os.unlink(root / "step_00000030" / METADATA_FILE)
    mgr = CheckpointManager(root, Options(async_save=False, cleanup=False))
    with pytest.raises(IncompleteCheckpointError, match="never committed"):
        load_step(mgr, 30)
    with pytest.warns(SkippedCheckpointWarning, match="never committed"):
        assert load_step(mgr)[0] == 20


# ---------------------------------------------------------------------------
# crash leftovers and crashes around the pointer
# ---------------------------------------------------------------------------


def test_start_removes_crash_leftovers(tmp_path):
    root = tmp_path / "run"
    _three_steps(root)
    # an uncommitted step directory (killed save), a stray rank file of a killed
    # overwrite inside a committed checkpoint, a leftover metadata and pointer temporary
    os.makedirs(root / "step_00000040")
    (root / "step_00000040" / "rank00000-0123456789ab.data").write_bytes(b"x" * 4096)
    (root / "step_00000020" / "rank00001-00000000beef.data").write_bytes(b"y" * 100)
    (root / "step_00000020" / ".metadata.00000000beef.tmp").write_bytes(b"z")
    (root / "latest.1a2b.tmp").write_text("{}")
    named = sorted(os.listdir(root / "step_00000020"))
    with pytest.warns(SkippedCheckpointWarning, match="step_00000040.*never committed"):
        mgr = CheckpointManager(root, Options(keep_last=None))
    assert sorted(os.listdir(root)) == [LOCK_FILE, LATEST_FILE, "step_00000010", "step_00000020", "step_00000030"]
    assert sorted(os.listdir(root / "step_00000020")) == [
        n for n in named if n not in ("rank00001-00000000beef.data", ".metadata.00000000beef.tmp")
    ]
    assert verify(root / "step_00000020").ok and verify(root / "step_00000020").notes == []
    assert load_step(mgr)[0] == 30


def test_start_leaves_a_damaged_checkpoint_alone(tmp_path):
    root = tmp_path / "run"
    _three_steps(root)
    (root / "step_00000030" / METADATA_FILE).write_bytes(b"garbage")
    (root / "step_00000030" / "rank00007-0123456789ab.data").write_bytes(b"?")
    before = sorted(os.listdir(root / "step_00000030"))
    CheckpointManager(root, Options(keep_last=None))
    assert sorted(os.listdir(root / "step_00000030")) == before


def test_start_rewrites_a_damaged_pointer(tmp_path):
    root = tmp_path / "run"
    _three_steps(root)
    (root / LATEST_FILE).write_text("not json")
    with pytest.warns(SkippedCheckpointWarning, match="not a checkpoint pointer"):
        CheckpointManager(root).close()
    assert read_latest(str(root)) == 30


def test_rollback_abandons_newer_steps_across_restarts(tmp_path):
    """Resume from an older step, train on: the newer steps are an abandoned trajectory.

    They take no retention slot, a restart resumes the new trajectory (not the
    larger step numbers), and the new trajectory's save of such a step replaces it.
    """
    root = tmp_path / "run"
    with CheckpointManager(root, Options(keep_last=2, async_save=False)) as mgr:
        for step in (10, 20):
            mgr.save(step, state_at(step))
        assert load_step(mgr, 10)[0] == 10  # roll back
        for step in (11, 12, 13):
            mgr.save(step, state_at(step))
        assert mgr.steps() == [12, 13, 20]  # 20 took no slot of keep_last=2
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mgr = CheckpointManager(root, Options(keep_last=2, async_save=False))
        got, target = load_step(mgr)
    assert got == 13 and read_latest(str(root)) == 13
    assert_same(target, state_at(13))
    assert any("step 20" in str(w.message) and "resumed from an older step" in str(w.message) for w in caught)
    assert mgr.latest() == 13
    mgr.save(20, state_at(21))  # replaces the abandoned step 20 without overwrite=True
    assert load_step(mgr)[0] == 20 and mgr.steps() == [13, 20]
    assert_same(load_step(mgr, 20)[1], state_at(21))
    mgr.close()


def test_a_rollback_is_recorded_when_the_run_saves_a_step_it_had_reached(tmp_path):
    """Back to step 3 and saving step 4 again: the pointer records the rollback, and steps it
    went back past take no retention slot, also once the pointer has moved above them. Loading
    step 3 to look at it and then saving step 6 (past every step saved) records nothing."""
    from dcp_datastates.manager.checkpoint_root import read_pointer, resume_order

    root = tmp_path / "run"
    with CheckpointManager(root, Options(keep_last=None, async_save=False)) as mgr:
        for step in range(1, 6):
            mgr.save(step, state_at(step))
        load_step(mgr, 3)  # an evaluation of an older step ...
        mgr.save(6, state_at(6))  # ... while training goes on: no rollback
    assert read_pointer(str(root)).rollbacks == ()
    assert resume_order(str(root)).candidates == [6, 5, 4, 3, 2, 1]
    root = tmp_path / "run2"
    with CheckpointManager(root, Options(keep_last=3, async_save=False)) as mgr:
        for step in range(1, 6):
            mgr.save(step, state_at(step))
        load_step(mgr, 3)
        mgr.save(4, state_at(104))  # the rollback, on record with its save's sequence
        pointer = read_pointer(str(root))
        assert pointer.rollbacks == ((3, pointer.sequence),)
        mgr.save(6, state_at(106))
        # 5 (the old trajectory's, below the pointer now) takes no slot of keep_last=3
        assert mgr.steps() == [3, 4, 6]
    order = resume_order(str(root))
    assert order.candidates == [6, 4, 3]


def test_retention_and_cleanup_never_follow_symlinks(tmp_path):
    elsewhere = tmp_path / "pretrained"
    with CheckpointManager(elsewhere, Options(async_save=False)) as mgr:
        mgr.save(100, state_at(100))
    (elsewhere / "step_00000100" / "rank00009-0123456789ab.data").write_bytes(b"stray?")
    root = tmp_path / "run"
    root.mkdir()
    os.symlink(elsewhere / "step_00000100", root / "step_00000000")  # warm start, linked
    with CheckpointManager(root, Options(keep_last=1, async_save=False)) as mgr:
        got, target = load_step(mgr)
        assert got == 0
        assert_same(target, state_at(100))
        mgr.save(1, state_at(1))
        mgr.save(2, state_at(2))
    # the linked checkpoint and everything in it are untouched
    assert os.path.islink(root / "step_00000000") and verify(elsewhere / "step_00000100").ok
    assert (elsewhere / "step_00000100" / "rank00009-0123456789ab.data").exists()
    assert saved_steps(root) == [0, 2]


def test_a_second_manager_on_the_root_loads_but_never_deletes(tmp_path):
    root = tmp_path / "run"
    owner = CheckpointManager(root, Options(keep_last=1, async_save=False))
    owner.save(10, state_at(10))
    # the owner's save of step 20 is under way: its directory has files, no .metadata yet
    os.makedirs(root / "step_00000020")
    (root / "step_00000020" / "rank00000-0123456789ab.data").write_bytes(b"in flight")
    with pytest.warns(CheckpointManagerWarning, match="another CheckpointManager owns"):
        reader = CheckpointManager(root, Options(keep_last=1))
    assert (root / "step_00000020" / "rank00000-0123456789ab.data").exists()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SkippedCheckpointWarning)
        assert load_step(reader)[0] == 10
    with pytest.raises(CheckpointError, match="may load but not save"):
        reader.save(30, state_at(30))
    reader.close()
    owner.close()
    with pytest.warns(SkippedCheckpointWarning, match="step_00000020"):
        CheckpointManager(root).close()  # the owner is gone: the leftover is cleaned now
    assert not (root / "step_00000020").exists()


def _crash_child(root, scenario, mode):
    proc = subprocess.run(
        [sys.executable, os.path.join(HERE, "support", "manager_workers.py"), "crash", str(root), scenario, mode],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == -signal.SIGKILL, (proc.returncode, proc.stdout, proc.stderr)
    assert "armed" in proc.stdout and "survived" not in proc.stdout


@pytest.mark.parametrize("mode", ["async", "sync"])
@pytest.mark.parametrize("scenario", ["pointer_write", "pointer_rename"])
def test_crash_between_commit_and_pointer_update(tmp_path, scenario, mode):
    root = tmp_path / "run"
    _crash_child(root, scenario, mode)
    # the kill came after step 20 committed and before the pointer moved
    assert read_latest(str(root)) == 10
    assert is_committed(str(root / "step_00000020"))
    mgr = CheckpointManager(root)  # start: the pointer is repaired, the temporary removed
    assert read_latest(str(root)) == 20
    assert sorted(os.listdir(root)) == [LOCK_FILE, LATEST_FILE, "step_00000010", "step_00000020"]
    got, target = load_step(mgr)
    assert got == 20
    assert_same(target, state_at(20))


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_resume_orders_commits_by_sequence_not_by_clock(tmp_path, mode):
    """A kill between a commit and the pointer update, where the pointer's clock says later.

    Resume used to compare the ``st_ctime`` of ``.metadata`` and ``latest``;
    their clock ticks in milliseconds, so a commit and the pointer update
    often shared one value and the newest checkpoint was taken for abandoned
    (5 of 30 SIGKILLs). Here the pointer's ctime is made later than the
    commit (chmod, as a copy or a restore of the root would), which the old
    order misread every time: the commit sequence must still win.
    """
    import time

    root = tmp_path / "run"
    _crash_child(root, "pointer_write", mode)
    assert read_latest(str(root)) == 10 and is_committed(str(root / "step_00000020"))
    time.sleep(0.01)
    os.chmod(root / LATEST_FILE, 0o644)  # ctime of latest is now after step 20's commit
    pointer = json.loads((root / LATEST_FILE).read_text())
    assert pointer["sequence"] == 1
    assert read_commit_sequence(str(root / "step_00000020" / METADATA_FILE)) == 2
    mgr = CheckpointManager(root)
    assert read_latest(str(root)) == 20 and json.loads((root / LATEST_FILE).read_text())["sequence"] == 2
    got, target = load_step(mgr)
    assert got == 20
    assert_same(target, state_at(20))
    mgr.save(30, state_at(30)).result()  # numbering goes on from the root's newest commit
    mgr.close()
    assert read_commit_sequence(str(root / "step_00000030" / METADATA_FILE)) == 3


def _as_unsequenced(root) -> None:
    """Rewrite a root as the previous version wrote it: version 3 metadata trailers and a
    pointer without a sequence (each .metadata replaced in order, so ctimes keep their order)."""
    import pickle
    import time

    sys.path.insert(0, os.path.join(HERE, "fixtures"))
    from pickle_tools import crafted, old_paths_importable  # the class paths format 3 pickled

    from dcp_datastates.native.engine import crc32c
    from dcp_datastates.format.metadata_file import _TRAILER_V3, TRAILER_MAGIC_V3, read_metadata_file

    for name in sorted(step_dirs(str(root)).values(), key=lambda n: os.stat(root / n / METADATA_FILE).st_ctime_ns):
        md = root / name / METADATA_FILE
        metadata, _ = read_metadata_file(str(md), False)
        layout = metadata.storage_data
        metadata.storage_data = crafted("CheckpointLayout", {
            "format": layout.format, "version": 3, "save_id": layout.save_id,
            "ranks": [crafted("RankFiles", {k: v for k, v in r.__dict__.items() if k not in ("stripes", "base")}) for r in layout.ranks],
            "entries": layout.entries,
        })
        with old_paths_importable():
            blob = pickle.dumps(metadata)
        tmp = root / name / "md.tmp"
        tmp.write_bytes(blob + _TRAILER_V3.pack(TRAILER_MAGIC_V3, len(blob), crc32c(blob), 0))
        os.replace(tmp, md)
        time.sleep(0.01)
    pointer = json.loads((root / LATEST_FILE).read_text())
    tmp = root / "latest.tmp"
    tmp.write_text(json.dumps({"step": pointer["step"], "dir": pointer["dir"]}))
    os.replace(tmp, root / LATEST_FILE)


def test_roots_written_before_sequences_still_resume(tmp_path):
    """A root of the previous version (no sequences): rollback still abandons, a new save orders after."""
    root = tmp_path / "run"
    with CheckpointManager(root, Options(async_save=False)) as mgr:
        for step in (10, 20, 30):
            mgr.save(step, state_at(step))
        assert load_step(mgr, 10)[0] == 10  # roll back
        mgr.save(15, state_at(15))
    _as_unsequenced(root)
    assert "sequence" not in json.loads((root / LATEST_FILE).read_text())
    assert read_commit_sequence(str(root / "step_00000015" / METADATA_FILE)) is None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mgr = CheckpointManager(root, Options(async_save=False))
        got, target = load_step(mgr)
    assert got == 15
    assert_same(target, state_at(15))
    assert any("step 20" in str(w.message) for w in caught)  # 20 and 30 stay abandoned
    mgr.save(16, state_at(16))
    assert json.loads((root / LATEST_FILE).read_text()) == {"step": 16, "dir": "step_00000016", "sequence": 1}
    mgr.close()
    mgr = CheckpointManager(root, Options(async_save=False))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert load_step(mgr)[0] == 16
    said = " ".join(str(w.message) for w in caught)
    assert "checkpoint of step 20" in said and "checkpoint of step 30" in said  # still abandoned, and said so
    mgr.close()


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_crash_during_retention(tmp_path, mode):
    root = tmp_path / "run"
    _crash_child(root, "retention", mode)
    # step 10 was being deleted: its .metadata went first, so it is not a checkpoint any more
    assert not is_committed(str(root / "step_00000010")) and os.listdir(root / "step_00000010")
    assert read_latest(str(root)) == 20
    with pytest.warns(SkippedCheckpointWarning, match="step_00000010"):
        mgr = CheckpointManager(root, Options(keep_last=1))
    assert sorted(os.listdir(root)) == [LOCK_FILE, LATEST_FILE, "step_00000020"]
    got, target = load_step(mgr)
    assert got == 20
    assert_same(target, state_at(20))


# ---------------------------------------------------------------------------
# distributed (gloo)
# ---------------------------------------------------------------------------


def test_two_ranks_async_saves_retention_and_resume(tmp_path):
    root = tmp_path / "run"
    run_ranks("manager_async_saves", 2, tmp_path / "logs", root=str(root))
    assert saved_steps(root) == [20, 30, 40] and read_latest(str(root)) == 40
    # saved on 2 ranks, resumed on 1 (resharded)
    got, target = load_step(CheckpointManager(root, Options(keep_last=2)))
    assert got == 40
    assert_same(target, state_at(40))


def test_two_ranks_agree_to_skip_a_checkpoint_only_one_rank_finds_corrupt(tmp_path):
    root = tmp_path / "run"
    _three_steps(root)
    flip_byte(data_file(root / "step_00000030"), offset=64)  # in the rows rank 0 reads
    run_ranks("manager_resume_skips_corrupt", 2, tmp_path / "logs", root=str(root))


def test_an_async_save_that_fails_after_staging_neither_hangs_nor_blocks_the_next(tmp_path, monkeypatch):
    """dcp.async_save stages, then raises (its executor refused the work): the manager gives the
    staged snapshot up explicitly (its error path), so closing its writer does not wait for a
    save that will never run, and the next save is not held back by it."""
    import threading

    from dcp_datastates._dcp_compat import async_thread_executor_module

    _async_thread_executor = async_thread_executor_module()

    def refuse(self, *args, **kwargs):
        raise RuntimeError("cannot schedule new futures after interpreter shutdown")

    outcome = {}

    def run():
        with CheckpointManager(tmp_path / "run", Options(keep_last=2)) as mgr:
            monkeypatch.setattr(_async_thread_executor._ThreadBasedAsyncCheckpointExecutor, "execute_save", refuse)
            try:
                mgr.save(10, state_at(10))
            except CheckpointError as exc:
                outcome["error"] = str(exc)
            monkeypatch.undo()
            mgr.save(20, state_at(20)).result(timeout=60)
        outcome["done"] = True

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(120)
    assert not t.is_alive(), "the manager hung on a snapshot no save will run"
    assert "cannot schedule" in outcome.get("error", "") and outcome.get("done")
    assert saved_steps(tmp_path / "run") == [20] and read_latest(tmp_path / "run") == 20
    assert os.listdir(tmp_path / "run" / "step_00000010") == [] if os.path.exists(tmp_path / "run" / "step_00000010") else True


@pytest.mark.parametrize("async_save", [True, False], ids=["async", "sync"])
def test_the_documented_loop_resumes_model_and_optimizer(tmp_path, async_save):
    """docs/manager.md's loop, followed literally: the resumed optimizer has the saved lr and
    moments (a load alone fills the state dict; ``set_state_dict`` puts it back)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    def make():
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 8)
        return model, torch.optim.AdamW(model.parameters(), lr=1.0)

    model, optimizer = make()
    model(torch.ones(2, 8)).sum().backward()
    optimizer.step()
    optimizer.param_groups[0]["lr"] = 0.125  # as a scheduler would leave it
    options = Options(async_save=async_save)
    with CheckpointManager(tmp_path, options) as mgr:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        mgr.save(1, {"model": model_sd, "optim": optim_sd, "step": 1})

    model2, optimizer2 = make()
    with CheckpointManager(tmp_path, options) as mgr:
        model_sd, optim_sd = get_state_dict(model2, optimizer2)
        state = {"model": model_sd, "optim": optim_sd, "step": 0}
        start = mgr.load(state)
        if start is not None:
            set_state_dict(model2, optimizer2, model_state_dict=state["model"], optim_state_dict=state["optim"])
    assert start == 1 and state["step"] == 1
    assert optimizer2.param_groups[0]["lr"] == 0.125
    assert_same(dict(model2.state_dict()), dict(model.state_dict()))
    assert_same(optimizer2.state_dict()["state"], optimizer.state_dict()["state"])
