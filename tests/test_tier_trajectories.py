"""A durable tier never loses a committed step: rollbacks, interrupted drains, outages at start.

Against a real S3 server of the tests' own (SeaweedFS on a free port, killed and restarted on
the same data) and a directory tier on a second file system, with the process SIGKILLed at
several points of a drain and of a rollback. The new trajectory's step ``s`` holds
``state_at(TRAJECTORY + s)``, so every resume says which trajectory it found.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import warnings

import pytest

from conftest import assert_resumes
from dcp_datastates import CheckpointError
from dcp_datastates.manager import CheckpointManagerOptions as Options
from dcp_datastates.manager.checkpoint_manager import CheckpointManager, CheckpointManagerWarning
from dcp_datastates.manager.checkpoint_root import read_pointer, step_dirs
from dcp_datastates.manager.durable_tier import DURABLE, read_tier_pointer
from dcp_datastates.storage import open_store
from dcp_datastates.tiers.drain import DrainError, durable_commit_stamp, durable_steps
from dcp_datastates.format.metadata_file import read_commit_stamp
from manager_workers import TRAJECTORY, state_at

pytestmark = [pytest.mark.s3, pytest.mark.subprocess, pytest.mark.slow]

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture
def server():
    pytest.importorskip("obstore", reason="the s3 extra (obstore) is not installed")
    from s3_server import WeedServer, running

    with running(WeedServer(bucket="trajectories")) as srv:
        yield srv


def _options(endpoint, **kw):
    # a dead server is given up on in seconds by the client itself: the manager's own retries are tested
    return {"endpoint": endpoint, "max_retries": 1, "retry_timeout_s": 3, "request_timeout_s": 10, **kw}


def _local(root) -> list[int]:
    return sorted(s for s, n in step_dirs(str(root)).items() if os.path.exists(os.path.join(root, n, ".metadata")))


def _committed(url, **options) -> list[int]:
    return sorted(s for s, (_n, c) in durable_steps(open_store(url, **options)).items() if c)


def _trajectory_0(root, url, options, keep_last=3):
    with CheckpointManager(root, Options(keep_last=keep_last, durable=url, async_save=False, durable_options=options)) as mgr:
        for step in range(1, 6):
            mgr.save(step, state_at(step))
        mgr.wait_durable()


def test_a_rollback_interrupted_by_an_outage_loses_no_committed_step(tmp_path, server):
    """The issue's run, step by step: a rollback, the server killed while the new trajectory's
    step 4 drains, a restart. Step 4 is drained again (the tier's step 4 is the other
    trajectory's), a new node resumes it and never the abandoned step 5, and retention deletes
    nothing whose own save is not durable."""
    root, url = tmp_path / "run", f"s3://{server.bucket}/rollback"
    options = _options(server.endpoint)
    _trajectory_0(root, url, options)
    mgr = CheckpointManager(root, Options(keep_last=3, durable=url, async_save=False, durable_options=options,
                                          durable_retry_s=0))
    assert_resumes(mgr, 3, step=3)  # the rollback
    server.kill()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CheckpointManagerWarning)
        mgr.save(4, state_at(TRAJECTORY + 4))  # committed locally; its drain fails
        with pytest.raises(DrainError, match="step 4"):
            mgr.close()
    server.start()  # the same data: the tier still holds trajectory 0's steps 1..5

    with CheckpointManager(root, Options(keep_last=3, durable=url, async_save=False, durable_options=options)) as mgr:
        assert_resumes(mgr, 4, values_of=TRAJECTORY + 4)
        mgr.wait_durable()
        assert mgr.durable_status()[4].state == DURABLE  # drained again: the tier's step 4 was another save
        assert durable_commit_stamp(open_store(url, **options), "step_00000004") == read_commit_stamp(
            os.path.join(root, "step_00000004", ".metadata"))
        with CheckpointManager(tmp_path / "node2", Options(durable=url, durable_options=options)) as node:
            with pytest.warns(UserWarning, match="durable copy of step 5.*gave up"):
                assert_resumes(node, 4, values_of=TRAJECTORY + 4)  # not trajectory 0's step 5
        for step in (5, 6, 7):
            mgr.save(step, state_at(TRAJECTORY + step))
        mgr.wait_durable()
        assert _local(root) == [5, 6, 7]
    assert _committed(url, **options) == [1, 2, 3, 4, 5, 6, 7]
    with CheckpointManager(tmp_path / "node3", Options(durable=url, durable_options=options)) as node:
        for step in range(1, 8):
            assert_resumes(node, step, step=step, values_of=step if step <= 3 else TRAJECTORY + step)


def test_local_retention_keeps_a_step_whose_own_save_is_not_durable(tmp_path, server):
    """After a rollback the tier holds a step 4 (trajectory 0's): the new step 4 is still kept
    locally until its own save is durable, whatever keep_last says."""
    root, url = tmp_path / "run", f"s3://{server.bucket}/retention"
    options = _options(server.endpoint)
    _trajectory_0(root, url, options)
    mgr = CheckpointManager(root, Options(keep_last=2, durable=url, async_save=False, durable_options=options,
                                          durable_retry_s=0))
    assert_resumes(mgr, 3, step=3)
    server.kill()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CheckpointManagerWarning)
        for step in (4, 5, 6):
            mgr.save(step, state_at(TRAJECTORY + step))
        with pytest.raises(DrainError):
            mgr.wait_durable()
        # 3 is durable (its own save): it may go; 4, 5 and 6 may not, though keep_last=2
        assert _local(root) == [4, 5, 6]
    server.start()
    mgr.save(7, state_at(TRAJECTORY + 7))  # the failed drains are retried first, in order
    mgr.wait_durable()
    assert _local(root) == [6, 7]
    mgr.close()
    assert _committed(url, **options) == [1, 2, 3, 4, 5, 6, 7]


def test_the_rollback_is_on_the_tier_before_any_step_after_it(tmp_path, server):
    """While the new trajectory's first step is still uploading (a slow link), the run's pointer
    is on the tier already: a new node resumes the step the run went back to, not the
    abandoned steps 4 and 5 there; once the copy is in, the new step 4."""
    from s3_proxy import S3Proxy

    root, url = tmp_path / "run", f"s3://{server.bucket}/visible"
    proxy = S3Proxy(server.port)
    try:
        options = _options(proxy.endpoint)
        _trajectory_0(root, url, options)
        with CheckpointManager(root, Options(keep_last=3, durable=url, async_save=False, durable_options=options)) as mgr:
            assert_resumes(mgr, 3, step=3)
            proxy.throttle(1e6)  # the 4.3 MB step takes seconds to leave
            mgr.save(4, state_at(TRAJECTORY + 4))
            deadline = time.monotonic() + 30
            while mgr.durable_status()[4].bytes_done == 0 and time.monotonic() < deadline:
                time.sleep(0.02)
            pointer = read_tier_pointer(open_store(url, endpoint=server.endpoint))
            assert (pointer.step, pointer.rollbacks) == (4, ((3, pointer.sequence),))
            assert mgr.durable_status()[4].state != DURABLE
            with CheckpointManager(tmp_path / "node2", Options(durable=url, durable_options=_options(server.endpoint))) as node:
                with pytest.warns(UserWarning, match="durable copy of step 4.*gave up"):
                    assert_resumes(node, 3)
            proxy.throttle(None)
            mgr.wait_durable()
        with CheckpointManager(tmp_path / "node3", Options(durable=url, durable_options=_options(server.endpoint))) as node:
            with pytest.warns(UserWarning, match="durable copy of step 5.*gave up"):
                assert_resumes(node, 4, values_of=TRAJECTORY + 4)
    finally:
        proxy.close()


@pytest.mark.parametrize("durable_keep_last, drained", [(None, True), (2, True), (1, False)])
def test_an_older_step_missing_on_the_tier_is_drained_on_start_unless_the_tier_would_not_keep_it(
    tmp_path, server, durable_keep_last, drained
):
    """Step 2's durable copy is missing (its drain failed, step 3's succeeded after it): on start
    it is drained again, though older than the newest durable step; unless the tier's own
    retention would delete it at once, and then local retention may let it go."""
    root, url = tmp_path / "run", f"s3://{server.bucket}/older{durable_keep_last}"
    options = _options(server.endpoint)
    tier = dict(durable=url, durable_options=options, durable_keep_last=durable_keep_last)
    with CheckpointManager(root, Options(keep_last=None, async_save=False, **tier)) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, state_at(step))
        mgr.wait_durable()
    open_store(url, **options).delete_checkpoint("step_00000002")  # never there, as after a failed drain
    with CheckpointManager(root, Options(keep_last=1, async_save=False, **tier)) as mgr:
        mgr.wait_durable()
        assert (2 in mgr.durable_status()) == drained
        mgr.save(4, state_at(4))  # retention: every older step's own save is durable, or needs not be
        mgr.wait_durable()
    assert _local(root) == [4]
    expected = {None: [1, 2, 3, 4], 2: [3, 4], 1: [4]}[durable_keep_last]
    assert _committed(url, **options) == expected


def test_the_run_starts_and_saves_locally_while_the_tier_is_down(tmp_path, server):
    """The store is down when the run starts: the manager starts (a warning), resumes from its
    own root, saves, and the drains ride the outage out in the background; a new node, which
    needs the tier, fails clearly instead of starting from scratch."""
    root, url = tmp_path / "run", f"s3://{server.bucket}/down"
    options = _options(server.endpoint)
    with CheckpointManager(root, Options(durable=url, async_save=False, durable_options=options)) as mgr:
        mgr.save(10, state_at(10))
        mgr.wait_durable()
    server.kill()
    t0 = time.monotonic()
    with pytest.warns(CheckpointManagerWarning, match="did not answer"):
        mgr = CheckpointManager(root, Options(durable=url, async_save=False, durable_options=options, durable_retry_s=120))
    with pytest.warns(UserWarning, match="did not answer.*resuming from"):
        assert_resumes(mgr, 10)
    mgr.save(20, state_at(20))  # commits locally and returns: the copy waits for the store
    assert time.monotonic() - t0 < 60 and 20 in mgr.steps()
    with CheckpointManager(tmp_path / "node2", Options(durable=url, durable_options=options)) as node:
        with pytest.raises(CheckpointError, match="holds no committed checkpoint, and the durable tier .* did not answer"):
            node.load(state_at(0))
    time.sleep(3)  # an outage of seconds: a drain fails once or twice, and is retried
    server.start()
    mgr.wait_durable(timeout=120)  # no DrainError: the outage was ridden out
    assert {s: st.state for s, st in mgr.durable_status().items()} == {10: DURABLE, 20: DURABLE}
    mgr.close()
    assert _committed(url, **options) == [10, 20]


def test_close_gives_up_on_drains_after_its_timeout_and_says_which(tmp_path, server):
    root, url = tmp_path / "run", f"s3://{server.bucket}/close"
    server.kill()
    with pytest.warns(CheckpointManagerWarning, match="did not answer"):
        mgr = CheckpointManager(root, Options(durable=url, async_save=False, durable_options=_options(server.endpoint),
                                              durable_retry_s=600, durable_close_timeout_s=2))
    mgr.save(10, state_at(10))
    t0 = time.monotonic()
    with pytest.raises(DrainError, match=r"steps \[10\].*after 2 s"):
        mgr.close()
    assert time.monotonic() - t0 < 30
    assert _local(root) == [10]  # kept
    mgr = CheckpointManager(root)  # the root was released
    assert mgr.owner
    mgr.close()


def test_a_manager_that_fails_to_start_releases_the_root(tmp_path):
    root = tmp_path / "run"
    with pytest.raises(Exception, match="no_such_option"):
        CheckpointManager(root, Options(durable="s3://bucket/x", durable_options={"no_such_option": 1}))
    with warnings.catch_warnings():
        warnings.simplefilter("error", CheckpointManagerWarning)  # "another CheckpointManager owns ..." fails
        mgr = CheckpointManager(root)
    assert mgr.owner
    mgr.save(1, state_at(1))
    mgr.close()


@pytest.mark.parametrize("point", ["local_pointer", "mirror", "drain_data", "drain_commit"])
def test_a_kill_during_a_rollbacks_save_or_drain_loses_nothing(tmp_path, shared_mount, point):
    """SIGKILL after the rollback's first save committed locally: while the local pointer moves,
    while the pointer is mirrored, while the step's data is published on the tier, while its
    .metadata is. On restart the new step 4 is the resume, it is drained, and a new node resumes
    it too (never trajectory 0's steps 4 or 5, which the tier still holds)."""
    root, durable = tmp_path / "run", os.path.join(shared_mount, f"kill_{point}")
    proc = subprocess.run(
        [sys.executable, os.path.join(HERE, "support", "manager_workers.py"), "tier_rollback_crash", str(root), durable, point],
        capture_output=True, text=True, timeout=180,
    )
    assert proc.returncode == -signal.SIGKILL, (proc.returncode, proc.stdout, proc.stderr)
    assert "armed" in proc.stdout and "survived" not in proc.stdout
    assert 4 in _local(root)  # committed before the kill
    # trajectory 0's step 4 is still committed there: the new .metadata replaces it in one step
    # (a rename over it), and the kill came before that rename at the latest
    assert 4 in _committed(durable)
    with CheckpointManager(root, Options(keep_last=3, durable=durable, async_save=False)) as mgr:
        assert_resumes(mgr, 4, values_of=TRAJECTORY + 4)
        mgr.wait_durable()
        pointer = read_pointer(str(root))
    assert read_tier_pointer(open_store(durable)) == pointer
    shutil.rmtree(root)
    with CheckpointManager(root, Options(durable=durable)) as node:
        with pytest.warns(UserWarning, match="durable copy of step 5.*gave up"):
            assert_resumes(node, 4, values_of=TRAJECTORY + 4)


def test_a_tier_written_before_the_pointer_mirror_still_resumes(tmp_path, shared_mount):
    """A tier without the run's pointer (written before it was mirrored) is judged by its copies'
    commit sequences alone, as before; the next start of the run mirrors the pointer there."""
    root, durable = tmp_path / "run", os.path.join(shared_mount, "old_tier")
    with CheckpointManager(root, Options(durable=durable, async_save=False)) as mgr:
        for step in (10, 20):
            mgr.save(step, state_at(step))
        mgr.wait_durable()
    open_store(durable).delete(["latest"])
    with CheckpointManager(tmp_path / "node2", Options(durable=durable)) as node:
        assert_resumes(node, 20)
    with CheckpointManager(root, Options(durable=durable, async_save=False)) as mgr:
        mgr.wait_durable()
    assert read_tier_pointer(open_store(durable)) == read_pointer(str(root))


def test_a_node_that_returns_behind_the_run_never_replaces_its_newer_copies(tmp_path, shared_mount):
    """Node A's step 11 never reached the tier; node B resumed step 10 from the tier and saved
    its own 11 and 12. When A starts again, its 11 is not drained over B's (the tier's pointer
    is newer than A's: the run went on elsewhere), and A resumes B's step 12."""
    durable = os.path.join(shared_mount, "two_nodes")
    a, b = tmp_path / "a", tmp_path / "b"
    with CheckpointManager(a, Options(durable=durable, async_save=False)) as mgr:
        mgr.save(10, state_at(10))
    with CheckpointManager(a, Options(async_save=False)) as mgr:  # as if its drain had never succeeded
        mgr.save(11, state_at(11))
    with CheckpointManager(b, Options(durable=durable, async_save=False)) as mgr:
        assert_resumes(mgr, 10)
        for step in (11, 12):
            mgr.save(step, state_at(TRAJECTORY + step))
        mgr.wait_durable()
        b11 = read_commit_stamp(os.path.join(b, "step_00000011", ".metadata"))
    with CheckpointManager(a, Options(durable=durable, async_save=False)) as mgr:
        mgr.wait_durable()
        assert 11 not in mgr.durable_status()  # not drained
        assert durable_commit_stamp(open_store(durable), "step_00000011") == b11
        assert_resumes(mgr, 12, values_of=TRAJECTORY + 12)


def test_a_base_of_a_step_drained_on_start_is_drained_too(tmp_path, shared_mount):
    """10 full, 20 refers to 10, 30 full; 10 and 20 are missing on the tier at start, which
    keeps 2: its retention alone would leave 10 out, but 20 cannot commit there without it."""
    from manager_workers import frozen_state

    root, durable = tmp_path / "run", os.path.join(shared_mount, "bases")
    state = frozen_state()
    with CheckpointManager(root, Options(keep_last=None, durable=durable, full_every=2, async_save=False)) as mgr:
        for step in (10, 20, 30):
            state["step"] = step
            mgr.save(step, state)
        mgr.wait_durable()
    store = open_store(durable)
    for step in (20, 10):
        store.delete_checkpoint(f"step_{step:08d}")
    with CheckpointManager(root, Options(keep_last=None, durable=durable, durable_keep_last=2, async_save=False)) as mgr:
        mgr.wait_durable()  # no DrainError: 10 went first
        assert sorted(mgr.durable_status()) == [10, 20]
    assert _committed(durable) == [10, 20, 30]  # 10 kept there: 20 refers to it


def test_a_refusing_tier_stops_the_start_and_releases_the_root(tmp_path):
    """A tier the store refuses (here a file where the directory should be: the listing fails
    with ENOTDIR, no outage) is a misconfiguration: raised at start, not warned and trained past."""
    from dcp_datastates.storage import StoreError

    root, durable = tmp_path / "run", tmp_path / "not_a_directory"
    durable.write_bytes(b"")
    with pytest.raises(StoreError, match="not_a_directory"):
        CheckpointManager(root, Options(durable=str(durable)))
    mgr = CheckpointManager(root)
    assert mgr.owner
    mgr.close()


def test_one_outage_is_retried_for_one_window_whatever_the_steps_waiting(tmp_path, server):
    root, url = tmp_path / "run", f"s3://{server.bucket}/window"
    options = _options(server.endpoint)
    with CheckpointManager(root, Options(durable=url, async_save=False, durable_options=options, keep_last=None)) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, state_at(step))
        mgr.wait_durable()
    server.kill()
    with pytest.warns(CheckpointManagerWarning, match="did not answer"):  # every committed step queued
        mgr = CheckpointManager(root, Options(durable=url, async_save=False, durable_options=options, keep_last=None,
                                              durable_retry_s=6))
    t0 = time.monotonic()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CheckpointManagerWarning)
        with pytest.raises(DrainError):
            mgr.close()
    assert time.monotonic() - t0 < 14  # one 6 s window, not one per queued step
    assert _local(root) == [1, 2, 3]


def test_close_stopping_early_never_lets_a_late_copy_touch_the_root(tmp_path, server):
    """close() stops waiting while a copy is still uploading; the copy may still commit on the
    tier, but its retention must not delete local steps of a root the manager gave up."""
    from s3_proxy import S3Proxy

    root, url = tmp_path / "run", f"s3://{server.bucket}/late"
    proxy = S3Proxy(server.port)
    try:
        mgr = CheckpointManager(root, Options(keep_last=1, durable=url, async_save=False,
                                              durable_options=_options(proxy.endpoint), durable_close_timeout_s=0.5))
        proxy.throttle(2e6)  # 4.3 MB a step: about 2 s each
        mgr.save(1, state_at(1))
        mgr.save(2, state_at(2))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", CheckpointManagerWarning)
            with pytest.raises(DrainError, match="close\\(\\) stopped waiting"):
                mgr.close()
        owner = CheckpointManager(root, Options(keep_last=None))  # the root is free: a new owner
        assert owner.owner
        time.sleep(5)  # longer than the copy under way needed
        assert _local(root) == [1, 2]
        owner.close()
    finally:
        proxy.close()
