"""CheckpointManager with a durable tier: background drains, retention per tier, resume
from the nearest good copy, and recovery of interrupted drains."""

from __future__ import annotations

import os
import shutil
import warnings

import pytest

from conftest import FailingReads, assert_resumes, new_durable_url
from dcp_datastates import CheckpointError, CorruptCheckpointError, verify
from dcp_datastates.storage import StoreError
from dcp_datastates.manager import CheckpointManagerOptions as Options
from dcp_datastates.manager.checkpoint_manager import CheckpointManager, CheckpointManagerWarning
from dcp_datastates.manager.checkpoint_root import step_dirs
from dcp_datastates.manager.durable_tier import DELETED, DURABLE, FAILED
from dcp_datastates.storage import open_store
from dcp_datastates.tiers.drain import DrainError, durable_steps
from manager_workers import load_step, run_ranks, state_at
from test_manager import data_file, flip_byte

pytestmark = [pytest.mark.s3, pytest.mark.dist, pytest.mark.slow]

MODES = [pytest.param(True, id="async"), pytest.param(False, id="sync")]


def _steps(root):
    return sorted(step_dirs(str(root)))


def _durable(url):
    return {s: c for s, (_n, c) in durable_steps(open_store(url)).items()}


@pytest.mark.parametrize("async_save", MODES)
def test_every_commit_is_drained_and_retention_runs_per_tier(tmp_path, durable_url, async_save):
    root = tmp_path / "run"
    with CheckpointManager(root, Options(keep_last=1, durable=durable_url, durable_keep_last=2, durable_keep_every=20,
                           async_save=async_save)) as mgr:
        for step in (10, 20, 30, 40):
            mgr.save(step, state_at(step))
        mgr.wait_durable()
        status = mgr.durable_status()
        assert {s: st.state for s, st in status.items()} == {10: DELETED, 20: DURABLE, 30: DURABLE, 40: DURABLE}
        assert all(st.bytes_done == st.bytes_total > 4 << 20 for st in status.values())
        assert mgr.durable_steps() == [20, 30, 40]  # the last 2, and every 20th: the steps durable_status calls durable
    assert _steps(root) == [40]  # locally the last one: the others were durable before they went
    assert _durable(durable_url) == {20: True, 30: True, 40: True}


@pytest.mark.parametrize("how", ["load", "fetch"])
def test_a_new_node_resumes_from_the_durable_tier(tmp_path, durable_url, how):
    root = tmp_path / "run"
    with CheckpointManager(root, Options(keep_last=2, durable=durable_url, async_save=False)) as mgr:
        for step in (10, 20):
            mgr.save(step, state_at(step))
    shutil.rmtree(root)  # the node is gone; a new one has an empty local disk
    with CheckpointManager(root, Options(durable=durable_url, durable_resume=how)) as mgr:
        assert_resumes(mgr, 20)
        # "load" reads the durable copy in place; "fetch" copies it into the local tier first
        assert mgr.steps() == ([20] if how == "fetch" else [])
        assert_resumes(mgr, 10, step=10)  # an explicit step, from the durable tier too
        mgr.save(30, state_at(30))  # numbered after the durable commits: a restart resumes from it
        mgr.wait_durable()
    shutil.rmtree(root)  # the durable tier alone tells 30 is newest: by its commit sequence
    with CheckpointManager(root, Options(durable=durable_url)) as mgr:
        assert_resumes(mgr, 30)


def test_a_manager_that_does_not_own_the_root_loads_the_durable_tier_in_place(tmp_path, durable_url):
    root = tmp_path / "run"
    with CheckpointManager(root, Options(durable=durable_url, async_save=False)) as mgr:
        mgr.save(10, state_at(10))
    shutil.rmtree(root)
    with CheckpointManager(root, Options(durable=durable_url)) as owner:
        with CheckpointManager(root, Options(durable=durable_url)) as evaluation:  # an evaluation job
            assert not evaluation.owner
            assert_resumes(evaluation, 10)  # it writes nothing, so it may
            assert not os.path.exists(root / "step_00000010")
        with CheckpointManager(root, Options(durable=durable_url, durable_resume="fetch")) as evaluation:
            with pytest.raises(CorruptCheckpointError, match="does not own"):
                load_step(evaluation, 10)  # fetching would write into the owner's root
        assert_resumes(owner, 10)


def test_full_verify_checks_every_byte_of_the_durable_copy(tmp_path, durable_url):
    root = tmp_path / "run"
    with CheckpointManager(root, Options(keep_last=None, durable=durable_url, async_save=False)) as mgr:
        for step in (10, 20):
            mgr.save(step, state_at(step))
    shutil.rmtree(root)
    store = open_store(durable_url)
    key = next(k for k in store.list("step_00000020/") if k.endswith(".data"))
    data = bytearray(store.read(key))
    data[100] ^= 1
    store.delete([key])
    store.put_bytes(key, bytes(data))
    with CheckpointManager(root, Options(durable=durable_url)) as mgr:
        # verify's words ("in 'key'", the same through either store), not a load's ("while reading 'key'")
        with pytest.warns(UserWarning, match="step 20.*in 'model.b': checksum mismatch for"):
            got, target = load_step(mgr, None, full_verify=True)
        assert got == 10


@pytest.mark.parametrize("tier,how", [("s3", "load"), ("posix", "load"), ("posix", "fetch")])
def test_a_durable_tier_that_does_not_answer_stops_the_resume(tmp_path, request, tier, how):
    durable_url = new_durable_url(request, tier)
    root = tmp_path / "run"
    with CheckpointManager(root, Options(keep_last=None, durable=durable_url, async_save=False)) as mgr:
        for step in (10, 20):
            mgr.save(step, state_at(step))
    shutil.rmtree(root)
    with CheckpointManager(root, Options(durable=durable_url, durable_resume=how)) as mgr:
        # step 20's data objects unreadable, as an unreachable server's would be (after the
        # client's retries); listing, small objects and step 10 still answer
        mgr._tier.store = FailingReads(
            mgr._tier.store, lambda key, _offset: key.startswith("step_00000020/") and key.endswith(".data"),
            "connection refused",
        )
        # Not a fallback to step 10 (which reads fine): that would hide the outage, and the
        # next save would make step 20 look abandoned.
        with pytest.raises((StoreError, CheckpointError), match="connection refused"):
            load_step(mgr)
        assert mgr.steps() == []


def test_a_new_node_never_resumes_a_trajectory_the_run_gave_up(tmp_path, durable_url):
    root = tmp_path / "run"
    with CheckpointManager(root, Options(keep_last=None, durable=durable_url, async_save=False)) as mgr:
        for step in (10, 20, 30):
            mgr.save(step, state_at(step))
    with CheckpointManager(root, Options(keep_last=None, durable=durable_url, async_save=False)) as mgr:
        assert_resumes(mgr, 10, step=10)  # a rollback: the run goes on from step 10
        mgr.save(15, state_at(15))
    shutil.rmtree(root)  # a new node: only the durable tier, without the local pointer
    with CheckpointManager(root, Options(durable=durable_url)) as mgr:
        assert mgr.durable_steps() == [10, 15, 20, 30]
        with pytest.warns(UserWarning, match="durable copy of step 30.*resumed from an older step"):
            assert_resumes(mgr, 15)  # not 30 or 20: they belong to the trajectory given up
        mgr.save(20, state_at(20))  # the new trajectory's step 20 replaces the old one's
        mgr.wait_durable()
    shutil.rmtree(root)
    with CheckpointManager(root, Options(durable=durable_url)) as mgr:
        with pytest.warns(UserWarning, match="durable copy of step 30"):
            assert_resumes(mgr, 20)


@pytest.mark.parametrize("how", ["load", "fetch"])
def test_a_bad_local_copy_falls_back_to_the_durable_one(tmp_path, durable_url, how):
    root = tmp_path / "run"
    with CheckpointManager(root, Options(durable=durable_url, async_save=False)) as mgr:
        mgr.save(10, state_at(10))
    flip_byte(data_file(root / "step_00000010"))
    with CheckpointManager(root, Options(durable=durable_url, durable_resume=how)) as mgr:
        with pytest.warns(UserWarning, match="local copy of step 10.*is bad"):
            assert_resumes(mgr, 10)
        # "fetch" replaced the local copy; "load" left it, and a save of step 10 replaces it
        assert verify(str(root / "step_00000010")).ok == (how == "fetch")
        mgr.save(10, state_at(11), overwrite=how == "fetch")
        mgr.wait()
        assert verify(str(root / "step_00000010")).ok


def test_an_unreachable_durable_tier_keeps_local_copies_and_reports(tmp_path, shared_mount):
    root = tmp_path / "run"
    durable = os.path.join(shared_mount, "readonly")
    os.makedirs(durable)
    os.chmod(durable, 0o500)
    try:
        mgr = CheckpointManager(root, Options(keep_last=1, durable=durable, async_save=False))
        if os.access(durable, os.W_OK):  # root ignores modes: make writes fail another way
            os.chmod(durable, 0o700)
            open(os.path.join(durable, "step_00000010"), "w").close()  # a file where the step's directory goes
            open(os.path.join(durable, "step_00000020"), "w").close()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", CheckpointManagerWarning)
            mgr.save(10, state_at(10))
            mgr.save(20, state_at(20))
            with pytest.raises(DrainError, match="step 10"):
                mgr.wait_durable()
        assert {s: st.state for s, st in mgr.durable_status().items()} == {10: FAILED, 20: FAILED}
        assert _steps(root) == [10, 20]  # keep_last=1, but neither is durable: both kept
        with pytest.raises(DrainError):
            mgr.close()
    finally:
        os.chmod(durable, 0o700)


def test_an_interrupted_drain_is_finished_when_the_manager_starts_again(tmp_path, durable_url):
    root = tmp_path / "run"
    with CheckpointManager(root, Options(durable=None, async_save=False)) as mgr:  # committed locally, never drained
        mgr.save(10, state_at(10))
    store = open_store(durable_url)
    store.put_bytes("step_00000010/rank00000-leftover.data", b"torn")  # what a killed drain left
    store.put_bytes("step_00000007/rank00000-x.data", b"orphan")  # an incomplete step with no local copy
    with CheckpointManager(root, Options(durable=durable_url)) as mgr:
        mgr.wait_durable()
        assert mgr.durable_steps() == [10]
    keys = open_store(durable_url).list()
    assert not any("leftover" in k or "step_00000007" in k for k in keys)


# The fetch is the same code for both stores (test_drain.py fetches from both): run once.
@pytest.mark.parametrize("tier,how", [("posix", "load"), ("s3", "load"), ("posix", "fetch")])
def test_two_ranks_drain_their_own_files_and_two_new_nodes_resume_from_them(tmp_path, request, tier, how):
    durable_url = new_durable_url(request, tier)
    run_ranks("manager_durable_saves", 2, tmp_path / "logs", root=str(tmp_path / "run"), durable=durable_url)
    assert _durable(durable_url) == {10: True, 20: True}  # each rank drained its files; rank 0 committed
    run_ranks("manager_durable_resume", 2, tmp_path / "logs2", root=str(tmp_path / "new"), durable=durable_url, how=how)
    assert _durable(durable_url) == {10: True, 20: True, 30: True}
    # On one rank, resharded, with no local copy: 30 was numbered after 20's commit on both ranks.
    with CheckpointManager(tmp_path / "newer", Options(durable=durable_url)) as mgr:
        assert_resumes(mgr, 30)


def test_an_overwritten_step_replaces_its_durable_copy(tmp_path, durable_url):
    root = tmp_path / "run"
    with CheckpointManager(root, Options(durable=durable_url, async_save=False)) as mgr:
        mgr.save(10, state_at(10))
        mgr.wait_durable()
        first = set(open_store(durable_url).list("step_00000010/"))
        mgr.save(10, state_at(11), overwrite=True)
        mgr.wait_durable()
    keys = set(open_store(durable_url).list("step_00000010/"))
    assert len(keys) == len(first) and keys != first  # the old save's files are gone
    shutil.rmtree(root)
    with CheckpointManager(root, Options(durable=durable_url)) as mgr:
        assert_resumes(mgr, 10, values_of=11)
