"""The asynchronous hand-off (core/async_save: handoff.py, order.py): which save writes which
snapshot, when a save has ended, and when a snapshot is given up, each by an explicit event."""

from __future__ import annotations

import gc
import os
import sys
import threading
import time

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from dcp_datastates import CheckpointError, DataStatesWriter
from dcp_datastates.core.async_save.runtime import runtime

from conftest import assert_same, data_files, load, raises_from_checkpoint

pytestmark = pytest.mark.slow

MiB = 1 << 20


def state_of(seed: int, n: int = 4096) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(n, generator=g), "b": torch.randn(7, 3, generator=g).t(), "step": seed}


def zeros(state: dict) -> dict:
    return {"w": torch.zeros_like(state["w"]), "b": torch.zeros_like(state["b"]), "step": 0}


def async_save(state, writer):
    return dcp.async_save(state, storage_writer=writer, no_dist=True)


def test_the_thread_that_takes_the_staged_dict_runs_its_save(tmp_path):
    """Two snapshots of one writer, taken by two threads in the opposite order: each thread
    saves the snapshot it took (FIFO per writer, per taking thread), never the other one."""
    writer = DataStatesWriter()
    a, b = state_of(1), state_of(2)
    writer.reset(tmp_path / "a")
    fut_a = writer.stage(a)
    writer.reset(tmp_path / "b")
    fut_b = writer.stage(b)
    expected_a, expected_b = zeros(a), zeros(b)
    for src, dst in ((a, expected_a), (b, expected_b)):
        dst["w"].copy_(src["w"]), dst["b"].copy_(src["b"])
        dst["step"] = src["step"]
    errors = []

    def save(fut):
        try:
            dcp.save(fut.result(), storage_writer=writer, no_dist=True)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    # b's thread begins first: it must wait for a's save (earlier ticket), not take a's snapshot.
    tb = threading.Thread(target=save, args=(fut_b,))
    tb.start()
    time.sleep(0.2)
    ta = threading.Thread(target=save, args=(fut_a,))
    ta.start()
    for t in (ta, tb):
        t.join(60)
    assert not errors, errors
    writer.close()
    assert_same(load(zeros(a), tmp_path / "a"), expected_a)
    assert_same(load(zeros(b), tmp_path / "b"), expected_b)


def test_a_synchronous_save_in_the_staging_thread_is_not_paired(tmp_path):
    """dcp.save in the thread that staged (and did not take) an asynchronous snapshot saves the
    live state synchronously, after the asynchronous save has ended."""
    state = state_of(3)
    resp = async_save(state, DataStatesWriter(tmp_path / "async"))
    resp.staging_completion.result()
    snapshot_values = state["w"].clone()
    state["w"].add_(1)
    dcp.save(state, storage_writer=DataStatesWriter(tmp_path / "sync"), no_dist=True)
    assert resp.upload_completion.done()  # the sync save began only after it ended
    resp.upload_completion.result()
    assert torch.equal(load(zeros(state), tmp_path / "async")["w"], snapshot_values)
    assert torch.equal(load(zeros(state), tmp_path / "sync")["w"], state["w"])


def test_abandon_unbegun_gives_up_a_snapshot_and_frees_the_order(tmp_path):
    writer = DataStatesWriter(tmp_path / "given_up")
    future = writer.stage(state_of(4))  # staged by hand, no save coming
    assert writer.abandon_unbegun("no save is coming") == 1
    assert writer.abandon_unbegun() == 0
    assert data_files(tmp_path / "given_up") == []
    with pytest.raises(CheckpointError, match="given up"):  # a save that still tries fails clearly
        dcp.save(future.result(), storage_writer=writer, no_dist=True)
    # later saves are not held back by its ticket
    state = state_of(5)
    async_save(state, DataStatesWriter(tmp_path / "next")).upload_completion.result(timeout=60)
    assert_same(load(zeros(state), tmp_path / "next"), state)
    writer.close()


def test_a_with_block_that_raises_gives_up_what_no_save_took(tmp_path):
    future = None
    with pytest.raises(RuntimeError, match="training failed"):
        with DataStatesWriter(tmp_path / "c") as writer:
            future = writer.stage(state_of(6))
            raise RuntimeError("training failed")
    assert future.snapshot.abandoned and data_files(tmp_path / "c") == []
    state = state_of(7)
    async_save(state, DataStatesWriter(tmp_path / "next")).upload_completion.result(timeout=60)


def test_a_dropped_staging_future_gives_its_snapshot_up(tmp_path):
    writer = DataStatesWriter(tmp_path / "dropped")
    writer.stage(state_of(8))  # the future is dropped at once
    state = state_of(9)
    async_save(state, DataStatesWriter(tmp_path / "next")).upload_completion.result(timeout=60)
    assert data_files(tmp_path / "dropped") == []
    writer.close(timeout=10)


def test_a_thread_that_took_a_snapshot_and_ended_without_saving_orphans_it(tmp_path):
    writer = DataStatesWriter(tmp_path / "orphan")
    future = writer.stage(state_of(10))
    holder = [future]  # kept alive: only the taker thread's end can tell
    t = threading.Thread(target=lambda: future.result(), name="AsyncCheckpointExecutor_test")
    t.start()
    t.join()
    state = state_of(11)
    async_save(state, DataStatesWriter(tmp_path / "next")).upload_completion.result(timeout=60)
    assert holder[0].snapshot.abandoned and data_files(tmp_path / "orphan") == []
    writer.close(timeout=10)


def test_gc_stays_on_in_the_callers_thread_during_a_background_save(tmp_path):
    """A background save must not switch Python's cyclic GC off for the training loop."""
    release = threading.Event()

    class SlowObjects(DefaultSavePlanner):
        def resolve_data(self, item):
            if item.index.fqn == "step":
                release.wait(30)  # the background thread sits in write_data meanwhile
            return super().resolve_data(item)

    writer = DataStatesWriter(tmp_path / "c")
    resp = dcp.async_save(state_of(12), storage_writer=writer, planner=SlowObjects(), no_dist=True)
    seen_disabled = False
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline:
        seen_disabled |= not gc.isenabled()
        time.sleep(0.001)
    release.set()
    resp.upload_completion.result(timeout=60)
    writer.close()
    assert not seen_disabled


def test_saves_never_look_at_other_threads_stacks(tmp_path, monkeypatch):
    def refuse():
        raise AssertionError("sys._current_frames() called")

    monkeypatch.setattr(sys, "_current_frames", refuse)
    writers, responses = [], []
    for i in range(4):
        writers.append(DataStatesWriter(tmp_path / f"c{i}"))
        responses.append(async_save(state_of(i), writers[-1]))
    dcp.save(state_of(9), storage_writer=DataStatesWriter(tmp_path / "sync"), no_dist=True)
    for r, w in zip(responses, writers):
        r.upload_completion.result(timeout=60)
        w.close()


def test_background_errors_belong_to_their_writer(tmp_path):
    """close() raises the errors of its own writer's saves (told apart by a serial number, not
    by id(), which a new writer may reuse), and the next save call raises any writer's."""
    failing = DataStatesWriter(tmp_path / "f")
    other = DataStatesWriter(tmp_path / "g")
    resp = dcp.async_save(state_of(14), checkpoint_id=tmp_path / "elsewhere", storage_writer=failing, no_dist=True)
    with raises_from_checkpoint(ValueError, match="staged into"):
        resp.upload_completion.result(timeout=60)
    other.close()  # not the failed writer's error
    with pytest.raises(CheckpointError, match="staged into"):
        failing.close()
    assert runtime().errors.drain() == []


def test_close_waits_for_the_save_thread_to_end(tmp_path):
    """close() returns once DCP's thread has left the save (its upload future is done)."""
    writer = DataStatesWriter(tmp_path / "c")
    resp = async_save(state_of(13), writer)
    writer.close(timeout=60)
    assert resp.upload_completion.done() and os.path.exists(tmp_path / "c" / ".metadata")
    assert not [t for t in threading.enumerate() if t.name.startswith("AsyncCheckpointExecutor")]


def test_no_snapshot_or_ticket_is_left_behind(tmp_path):
    for i in range(3):
        with DataStatesWriter(tmp_path / f"c{i}") as writer:
            async_save(state_of(i), writer)
    assert runtime().unbegun() == [] and runtime().staging_in_flight() == []
    assert runtime().order.wait_ended(lambda t: True, timeout=10)
