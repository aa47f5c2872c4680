"""The manager's pure decisions, without a process group or DCP: its options, retention over
steps and what they refer to, the plan of a load, and how verdicts are classified and combined;
and the save orchestration with DCP replaced by a fake where a real save adds nothing."""

from __future__ import annotations

import dataclasses
import errno
import os
import pickle
import types
from concurrent.futures import Future

import pytest
import torch
from torch.distributed.checkpoint.api import CheckpointException

from dcp_datastates import CheckpointManager, CheckpointManagerOptions
from dcp_datastates.errors import (
    CheckpointError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    ChecksumMismatchError,
    IncompleteCheckpointError,
    UnsafeCheckpointError,
)
from dcp_datastates.manager import saving  # where the manager calls DCP to save
from dcp_datastates.manager.checkpoint_root import ResumeOrder
from dcp_datastates.manager.collective import Raise, Ranks, classify
from dcp_datastates.manager.resume import Listing, plan_load, with_durable_only
from dcp_datastates.manager.retention import RetentionPolicy

# -- options ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("field,value,match", [
    ("keep_last", 0, "keep_last must be a positive int or None"),
    ("keep_every", -5, "keep_every must be a positive int or None"),
    ("durable_resume", "copy", "durable_resume must be 'load' or 'fetch'"),
    ("full_every", True, "full_every must be a positive int"),
    ("full_every", 0, "full_every must be a positive int"),
    ("durable_keep_last", 0, "durable_keep_last must be a positive int or None"),
    ("durable_keep_every", 2.0, "durable_keep_every must be a positive int or None"),
    ("durable_retry_s", -1, "durable_retry_s must be a number of seconds >= 0"),
    ("durable_close_timeout_s", False, "durable_close_timeout_s must be seconds >= 0 or None"),
])
def test_options_refuse_bad_values_naming_the_field(field, value, match):
    with pytest.raises(ValueError, match=match):
        CheckpointManagerOptions(**{field: value})


def test_options_are_frozen_and_replaced_whole():
    opts = CheckpointManagerOptions(keep_last=None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.keep_last = 2
    assert dataclasses.replace(opts, keep_every=10).keep_every == 10
    with pytest.raises(ValueError, match="keep_every"):
        dataclasses.replace(opts, keep_every=0)


def test_a_manager_takes_options_not_keywords(tmp_path):
    with pytest.raises(TypeError, match=r"CheckpointManager\(root, CheckpointManagerOptions\(keep_last=\.\.\., durable=\.\.\.\)\)"):
        CheckpointManager(tmp_path, keep_last=1, durable="/x")  # named, and nothing is created
    assert not os.path.exists(tmp_path / ".lock") and os.listdir(tmp_path) == []
    with pytest.raises(TypeError, match="CheckpointManagerOptions"):
        CheckpointManager(tmp_path, {"keep_last": 1})
    assert CheckpointManager(tmp_path).options == CheckpointManagerOptions()


# -- retention --------------------------------------------------------------------------------------


def _refs(graph: dict):
    """bases_of over ``{step: {bases}}`` (a step not listed refers to nothing)."""
    return lambda s: graph.get(s, set())


def test_retention_keeps_the_newest_up_to_the_committed_step_and_every_multiple():
    policy = RetentionPolicy(keep_last=2, keep_every=30)
    assert policy.keeps([10, 20, 30, 40, 50, 60], 50) == {30, 40, 50, 60}
    assert RetentionPolicy().keeps([1, 2, 3], 2) == {1, 2}  # keep all up to it (3 is not retention's)
    assert policy.victims(50, [10, 20, 30, 40, 50, 60], _refs({})) == [20, 10]  # newest first, none above 50


def test_retention_never_deletes_what_a_remaining_step_refers_to():
    policy = RetentionPolicy(keep_last=1)
    # 40 refers to 30, which refers to 20 (a chain): all stay; 10 goes
    assert policy.victims(40, [10, 20, 30, 40], _refs({40: {30}, 30: {20}})) == [10]
    # a step whose references cannot be read protects every older one
    assert policy.victims(40, [10, 20, 30, 40], lambda s: None if s == 40 else set()) == []
    # a step the caller holds is not deleted, and protects what it refers to
    held = policy.victims(40, [10, 20, 30, 40], _refs({20: {10}}), may_delete=lambda s: s != 20)
    assert held == [30]


def test_retention_failed_saves_and_a_trajectory_given_up_take_no_slot():
    policy = RetentionPolicy(keep_last=2, keep_every=15)
    # 21 never committed: no slot, and it goes; 15 (given up, a multiple of 15) goes too, and
    # leaves its slot to 20; 25 and 30 (above the committed step) are not retention's to delete
    victims = policy.victims(22, [10, 15, 20, 21, 22, 25, 30], _refs({}), uncommitted=[21], given_up=[15, 30])
    assert victims == [21, 15, 10]


def test_retention_asks_may_delete_only_about_its_candidates():
    asked = []
    RetentionPolicy(keep_last=1).victims(3, [1, 2, 3], _refs({}), may_delete=lambda s: asked.append(s) or True)
    assert sorted(asked) == [1, 2]


# -- the plan of a load -----------------------------------------------------------------------------


def _listing(candidates, abandoned=(), pointer=None, uncommitted=(), durable=(), given_up=(), tier_error=None,
             pointer_error=None) -> Listing:
    order = ResumeOrder(list(candidates), list(abandoned), pointer, pointer_error)
    return Listing(order, list(uncommitted), list(durable), list(given_up), set(), tier_error)


def test_a_resume_tries_local_commits_with_durable_only_steps_in_step_order():
    plan = plan_load(_listing([30, 20, 10], durable=[10, 25, 40]), None, "/r", "s3://b/r")
    assert plan.candidates == [40, 30, 25, 20, 10] and plan.local == {10, 20, 30}
    assert plan.warnings == [] and plan.error is None and plan.newest_known == 40
    assert with_durable_only([21, 30, 10], [25]) == [25, 21, 30, 10]  # before the first smaller local step


def test_a_resume_says_what_it_skips_in_order():
    listing = _listing([20, 10], abandoned=[30], pointer=20, uncommitted=[5, 40], durable=[50], given_up=[50],
                       pointer_error="/r/latest is not a checkpoint pointer")
    plan = plan_load(listing, None, "/r", "s3://b/r")
    assert plan.candidates == [20, 10]
    said = plan.warnings
    assert len(said) == 4
    assert "durable copy of step 50 in s3://b/r" in said[0] and "gave up" in said[0]
    assert said[1] == "/r/latest is not a checkpoint pointer; resuming from the newest committed checkpoint"
    assert "/r/step_00000040: it was never committed" in said[2]  # 5 is older than the newest commit: not said
    assert "step 30" in said[3] and "moved to step 20" in said[3]


def test_a_resume_with_a_silent_tier():
    silent = dict(tier_error="connection refused")
    plan = plan_load(_listing([10], **silent), None, "/r", "s3://b/r")
    assert plan.candidates == [10] and plan.error is None
    assert plan.warnings == ["the durable tier s3://b/r did not answer (connection refused): resuming from /r alone"]
    assert "did not answer" in plan.unanswered
    empty = plan_load(_listing([], **silent), None, "/r", "s3://b/r")  # a fresh start would hide the tier's
    assert isinstance(empty.error, CheckpointError) and "/r holds no committed checkpoint" in str(empty.error)
    fresh = plan_load(_listing([]), None, "/r", None)
    assert fresh.candidates == [] and fresh.error is None and fresh.warnings == []


def test_an_explicit_step_is_tried_alone_or_refused_with_the_reason():
    listing = _listing([20, 10], abandoned=[30], uncommitted=[40], durable=[50])
    assert plan_load(listing, 30, "/r", "s3://b/r").candidates == [30]  # abandoned, but asked for
    assert plan_load(listing, 50, "/r", "s3://b/r").candidates == [50]  # on the durable tier only
    assert isinstance(plan_load(listing, 40, "/r", None).error, IncompleteCheckpointError)
    missing = plan_load(listing, 7, "/r", "s3://b/r").error
    assert isinstance(missing, CheckpointNotFoundError)
    assert str(missing) == "no checkpoint of step 7 under /r (committed: [10, 20, 30]) or s3://b/r (durable: [50])"
    silent = plan_load(_listing([10], tier_error="timeout"), 7, "/r", "s3://b/r").error
    assert type(silent) is CheckpointError and "did not answer (timeout)" in str(silent)


# -- verdicts ---------------------------------------------------------------------------------------


def test_verdicts_classify_bad_files_unreadable_ones_and_errors_to_raise():
    assert classify(ChecksumMismatchError("step_1/x.data: checksum   mismatch")) == (
        "step_1/x.data: checksum mismatch", True)
    assert classify(OSError(errno.EIO, "I/O error")) == ("[Errno 5] I/O error", False)
    assert classify(OSError(errno.EACCES, "denied")) == Raise("PermissionError: [Errno 13] denied")
    unsafe = classify(UnsafeCheckpointError("runs code"))
    assert isinstance(unsafe.error("rank 1: "), UnsafeCheckpointError)
    assert pickle.loads(pickle.dumps(unsafe)) == unsafe  # verdicts travel between ranks pickled


def test_one_process_agrees_with_itself():
    ranks = Ranks("/r", None, async_save=True, incremental=True)
    assert (ranks.rank, ranks.world, ranks.dcp_kwargs()) == (0, 1, {"no_dist": True})
    assert ranks.agree(None) is None and ranks.agree(("bad", True)) == ("bad", True)
    with pytest.raises(CheckpointError, match="^EACCES$"):
        ranks.agree(Raise("EACCES"))
    with pytest.raises(ValueError, match="boom"):  # one process: raised as it is
        ranks.on_rank0(lambda: (_ for _ in ()).throw(ValueError("boom")), "testing")


# -- saves with DCP replaced by a fake --------------------------------------------------------------


class FakeDCP:
    """``dcp`` as the manager calls it: saves that end when the test says, or fail."""

    def __init__(self, fail: BaseException | None = None) -> None:
        self.fail = fail
        self.uploads: list[Future] = []

    def save(self, state, storage_writer, checkpoint_id, **kw):
        raise self.fail

    def async_save(self, state, storage_writer, checkpoint_id, **kw):
        self.uploads.append(Future())
        return types.SimpleNamespace(upload_completion=self.uploads[-1])


@pytest.fixture
def fake_dcp(monkeypatch):
    fake = FakeDCP()
    monkeypatch.setattr(saving, "dcp", fake)
    return fake


def test_a_step_in_flight_is_not_saved_twice(tmp_path, fake_dcp):
    mgr = CheckpointManager(tmp_path, CheckpointManagerOptions(fence=False, incremental=False))
    first = mgr.save(5, {"x": torch.zeros(2)})
    with pytest.raises(CheckpointExistsError, match="a save of step 5 into .* is still in flight"):
        mgr.save(5, {"x": torch.zeros(2)})
    assert not first.done() and (first.step, first.path) == (5, mgr.path_of(5))
    fake_dcp.uploads[0].set_exception(OSError(errno.EIO, "lost"))
    assert isinstance(first.exception(), OSError)
    with pytest.raises(CheckpointError, match="the asynchronous save of step 5 into .* failed: .*lost$") as info:
        mgr.wait()  # the first error not yet raised, as one error type, chained to its cause
    assert isinstance(info.value.__cause__, OSError)
    mgr.wait()  # raised once
    mgr.save(5, {"x": torch.zeros(2)})  # the failed save is over: the step may be saved again
    fake_dcp.uploads[1].set_exception(OSError(errno.EIO, "lost again"))
    with pytest.raises(CheckpointError, match="lost again"):
        mgr.close()
    with pytest.raises(RuntimeError, match="closed"):
        mgr.save(6, {"x": torch.zeros(2)})


def test_a_failed_synchronous_save_raises_the_rank_error(tmp_path, monkeypatch):
    inner = CheckpointError("step_00000001: no space left")
    monkeypatch.setattr(saving, "dcp", FakeDCP(CheckpointException("save", {0: inner})))
    with CheckpointManager(tmp_path, CheckpointManagerOptions(async_save=False)) as mgr:
        with pytest.raises(CheckpointError, match="no space left") as info:
            mgr.save(1, {"x": torch.zeros(2)})
        assert info.value is inner and mgr.steps() == []
    monkeypatch.setattr(saving, "dcp", FakeDCP(RuntimeError("collective timed out")))
    with CheckpointManager(tmp_path, CheckpointManagerOptions(async_save=False)) as mgr:
        with pytest.raises(CheckpointError, match=r"the save of step 2 into .*step_00000002 failed: collective timed out"):
            mgr.save(2, {"x": torch.zeros(2)})


def test_one_rule_tells_two_copies_of_a_step_hold_the_same_save(tmp_path):
    import torch.distributed.checkpoint as dcp

    from dcp_datastates import DataStatesWriter
    from dcp_datastates.format.metadata_envelope import CommitStamp, is_newer_save, is_same_save
    from dcp_datastates.format.metadata_file import read_commit_stamp

    # two saves of one step: their stamps differ; a copy of one (same bytes) has the same stamp
    first, second = tmp_path / "a", tmp_path / "b"
    for path, value in ((first, 1.0), (second, 2.0)):
        dcp.save({"x": torch.full((4,), value)}, storage_writer=DataStatesWriter(path, sequence=7))
    a, b = (read_commit_stamp(str(p / ".metadata")) for p in (first, second))
    copy = tmp_path / "copy.metadata"
    copy.write_bytes((first / ".metadata").read_bytes())
    assert is_same_save(a, read_commit_stamp(str(copy))) and not is_same_save(a, b)
    # a copy whose stamp cannot be told is the same as nothing, not even another unknown one
    assert not is_same_save(None, None) and not is_same_save(None, a) and not is_same_save(a, None)
    assert is_newer_save(CommitStamp(8, 0, 1), a) and not is_newer_save(a, CommitStamp(8, 0, 1))
    assert not is_newer_save(a, b) and not is_newer_save(None, a) and not is_newer_save(a, None)


def test_each_rank_of_the_durable_tier_has_one_commit_rule():
    from dcp_datastates.manager.durable_tier import commit_rule_for
    from dcp_datastates.manager.retention import RetentionPolicy
    from dcp_datastates.tiers.commit_rules import AwaitCommit, CommitWhenAllConfirmed, LeaveCommit

    policy = RetentionPolicy(2, None)
    # rank 0 commits (node-local or not); another node's leader waits for that commit; any other rank leaves it
    assert isinstance(commit_rule_for(0, True, policy), CommitWhenAllConfirmed)
    assert isinstance(commit_rule_for(0, False, policy), CommitWhenAllConfirmed)
    assert isinstance(commit_rule_for(4, True, policy), AwaitCommit)
    assert isinstance(commit_rule_for(3, False, policy), LeaveCommit)
    # who learns that the copy is committed (and so may free the local copy): the first two only
    assert [commit_rule_for(r, lead, policy).settles for r, lead in ((0, False), (4, True), (3, False))] == [True, True, False]
    assert LeaveCommit().after_copy(None, "/nowhere", 5, "step_00000005", 1.0, None) == (None, None, [])
