"""The cyclic GC paused across a synchronous save's or a load's DCP call on the caller's thread
(native/gc_pause.py): DCP's own planning between our hooks runs without collections; the
collector is on again after every way the call can end (done, raised in our hooks, abandoned by
DCP between them: by the deadline, or by the next call), and never touched where it was off, in
another thread's call, or for reads without a DCP load."""

from __future__ import annotations

import gc
import threading
import time
import weakref

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner

from dcp_datastates import DataStatesReader, DataStatesWriter
from dcp_datastates.native import gc_pause
from dcp_datastates.native.gc_pause import CallPause
from dcp_datastates.tools.checkpoint_view import CheckpointView


@pytest.fixture(autouse=True)
def _collector_on():
    """Every case starts and ends with the collector on and no pause left over."""
    gc.enable()
    yield
    for pause in list(gc_pause._current.values()):
        pause.end()
    on, threshold = gc.isenabled(), gc.get_threshold()
    gc.enable()
    assert on, "a case left the collector off"
    assert threshold[2] < gc_pause.DEFERRED_THRESHOLD, "a case left full collections deferred"


def _state(n=6):
    return {f"t{i}": torch.full((4,), float(i)) for i in range(n)}


class SavingProbe(DefaultSavePlanner):
    """DCP's default save planner, recording whether the collector runs while it plans."""

    def __init__(self, fail_in_global=False):
        super().__init__()
        self.seen = []
        self.fail_in_global = fail_in_global

    def create_local_plan(self):
        self.seen.append(("local", gc.isenabled()))
        return super().create_local_plan()

    def create_global_plan(self, all_plans):
        self.seen.append(("global", gc.isenabled()))
        if self.fail_in_global:
            raise RuntimeError("planner refused the save")
        return super().create_global_plan(all_plans)


class LoadingProbe(DefaultLoadPlanner):
    def __init__(self):
        super().__init__()
        self.seen = []

    def create_local_plan(self):
        self.seen.append(("local", gc.isenabled()))
        return super().create_local_plan()

    def create_global_plan(self, global_plan):
        self.seen.append(("global", gc.isenabled()))
        return super().create_global_plan(global_plan)


def test_dcp_plans_a_save_and_a_load_without_collections_and_the_collector_is_on_after(tmp_path):
    state = _state()
    probe = SavingProbe()
    dcp.save(state, storage_writer=DataStatesWriter(str(tmp_path / "c")), planner=probe, no_dist=True)
    assert probe.seen == [("local", False), ("global", False)] and gc.isenabled()
    assert not gc_pause._current
    back = {k: torch.zeros_like(v) for k, v in state.items()}
    loading = LoadingProbe()
    dcp.load(back, storage_reader=DataStatesReader(str(tmp_path / "c")), planner=loading, no_dist=True)
    assert loading.seen == [("local", False), ("global", False)] and gc.isenabled()
    assert all(torch.equal(back[k], state[k]) for k in state)


def test_a_save_dcp_abandons_between_our_calls_ends_the_pause_by_the_deadline(tmp_path, monkeypatch):
    monkeypatch.setattr(gc_pause, "CALL_PAUSE_LIMIT_S", 0.2)
    with pytest.raises(CheckpointException):
        dcp.save(_state(), storage_writer=DataStatesWriter(str(tmp_path / "c")),
                 planner=SavingProbe(fail_in_global=True), no_dist=True)
    assert not gc.isenabled()  # DCP raised between our hooks: nothing of ours ran since
    deadline = time.monotonic() + 10
    while not gc.isenabled() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert gc.isenabled() and not gc_pause._current


def test_the_next_call_takes_an_abandoned_pause_over_and_ends_it(tmp_path):
    writer = DataStatesWriter(str(tmp_path / "c"))
    with pytest.raises(CheckpointException):
        dcp.save(_state(), storage_writer=writer, planner=SavingProbe(fail_in_global=True), no_dist=True)
    assert not gc.isenabled()
    probe = SavingProbe()
    dcp.save(_state(), storage_writer=writer, planner=probe, no_dist=True)
    assert probe.seen == [("local", False), ("global", False)]
    assert gc.isenabled() and not gc_pause._current  # on again at once, not at the deadline


def test_a_load_that_dcp_abandons_is_ended_by_the_next_load_of_the_reader(tmp_path):
    dcp.save(_state(), storage_writer=DataStatesWriter(str(tmp_path / "c")), no_dist=True)
    reader = DataStatesReader(str(tmp_path / "c"))
    with pytest.raises(CheckpointException):  # DCP's planner: a key the checkpoint lacks
        dcp.load({"missing_key": torch.zeros(4)}, storage_reader=reader, no_dist=True)
    assert not gc.isenabled()
    back = {k: torch.zeros_like(v) for k, v in _state().items()}
    dcp.load(back, storage_reader=reader, no_dist=True)
    assert gc.isenabled() and torch.equal(back["t3"], _state()["t3"])


def test_an_error_in_our_own_call_ends_the_pause_at_once(tmp_path):
    path = tmp_path / "c"
    dcp.save(_state(), storage_writer=DataStatesWriter(str(path)), no_dist=True)
    data = next(path.glob("*.data"))
    blob = bytearray(data.read_bytes())
    blob[0] ^= 0xFF  # a flipped bit in the first tensor: read_data raises
    data.write_bytes(bytes(blob))
    with pytest.raises(CheckpointException, match="checksum mismatch"):
        dcp.load({k: torch.zeros_like(v) for k, v in _state().items()}, storage_reader=DataStatesReader(str(path)), no_dist=True)
    assert gc.isenabled() and not gc_pause._current


def test_the_collector_the_application_switched_off_stays_off(tmp_path):
    gc.disable()
    try:
        probe = SavingProbe()
        dcp.save(_state(), storage_writer=DataStatesWriter(str(tmp_path / "c")), planner=probe, no_dist=True)
        assert probe.seen == [("local", False), ("global", False)] and not gc.isenabled()
        pause = CallPause.begin()
        assert not pause.active
        pause.end()
        assert not gc.isenabled()
    finally:
        gc.enable()


class DeferralProbe(DefaultSavePlanner):
    """Records, while DCP plans, whether the collector runs and whether full collections do."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def create_local_plan(self):
        self.seen.append((gc.isenabled(), gc.get_threshold()[2] >= gc_pause.DEFERRED_THRESHOLD))
        return super().create_local_plan()


def test_a_call_on_another_thread_only_defers_full_collections(tmp_path):
    """Beside the caller's loop the collector stays on (young collections free its short-lived
    cycles); only the heap walks are deferred, and given back after."""
    before = gc.get_threshold()
    probes, errors = [], []

    def save():
        try:
            probes.append(DeferralProbe())
            dcp.save(_state(), storage_writer=DataStatesWriter(str(tmp_path / "c")), planner=probes[0], no_dist=True)
        except BaseException as exc:  # reported below
            errors.append(exc)

    worker = threading.Thread(target=save)
    worker.start()
    worker.join()
    assert not errors and probes[0].seen == [(True, True)]
    assert gc.get_threshold() == before and not gc_pause._current


def test_an_async_save_defers_full_collections_in_its_background_thread_only(tmp_path):
    before = gc.get_threshold()
    probe = DeferralProbe()
    state = _state()
    resp = dcp.async_save(state, storage_writer=DataStatesWriter(str(tmp_path / "c")), planner=probe, no_dist=True)
    (resp.upload_completion if hasattr(resp, "upload_completion") else resp).result()
    assert probe.seen == [(True, True)]
    assert gc.get_threshold() == before and gc.isenabled() and not gc_pause._current
    back = {k: torch.zeros_like(v) for k, v in state.items()}
    dcp.load(back, storage_reader=DataStatesReader(str(tmp_path / "c")), no_dist=True)
    assert all(torch.equal(back[k], state[k]) for k in state)


def test_a_deferral_leaves_thresholds_the_application_set_meanwhile():
    before = gc.get_threshold()
    results = []

    def call():
        pause = CallPause.begin()
        results.append((pause.kind, gc.get_threshold()[2]))
        gc.set_threshold(before[0], before[1], 25)  # the application's own, during the call
        pause.end()
        results.append(gc.get_threshold()[2])

    try:
        worker = threading.Thread(target=call)
        worker.start()
        worker.join()
        assert results == [("full", gc_pause.DEFERRED_THRESHOLD), 25]
    finally:
        gc.set_threshold(*before)


def test_reads_without_a_dcp_load_do_not_pause_the_collector(tmp_path):
    dcp.save(_state(), storage_writer=DataStatesWriter(str(tmp_path / "c")), no_dist=True)
    view = CheckpointView(str(tmp_path / "c"))
    assert gc.isenabled() and not gc_pause._current
    assert torch.equal(view.read_tensor("t2"), _state()["t2"])
    assert gc.isenabled()


def test_ending_twice_and_the_deadline_after_the_end_are_harmless():
    pause = CallPause.begin(limit_s=0.05)
    assert pause.active and not gc.isenabled()
    pause.end()
    pause.end()
    assert gc.isenabled()
    gc.disable()  # the application's own switch, after the pause ended
    try:
        time.sleep(0.15)  # the cancelled deadline must not switch it on
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_what_the_pause_made_joins_the_oldest_generation_and_its_garbage_is_still_collected():
    class Node:
        pass

    with gc_pause.gc_paused():
        kept = [[i] for i in range(50_000)]  # objects that live on: no young collection walks them
        cycle = Node()
        cycle.self = cycle  # garbage that only the collector frees
        probe = weakref.ref(cycle)
        del cycle
    assert gc.isenabled() and gc.get_count()[0] < 700 and gc.get_count()[1] == 0
    assert probe() is not None  # not collected yet: in the oldest generation
    gc.collect()
    assert probe() is None and len(kept) == 50_000


def test_the_objects_the_application_froze_stay_frozen():
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        pause = CallPause.begin()
        [object() for _ in range(10)]
        pause.end()
        with gc_pause.gc_paused():
            pass
        assert gc.isenabled() and gc.get_freeze_count() == frozen
    finally:
        gc.unfreeze()


@pytest.mark.parametrize("on_main", [True, False])
def test_a_forked_child_gets_back_what_its_parent_held(on_main):
    """A data loader's worker forked during a pause: no deadline runs in the child, so the fork
    gives the collector back there at once (off, or full collections deferred)."""
    import os

    before = gc.get_threshold()
    held = []

    def begin():
        held.append(CallPause.begin())

    if on_main:
        begin()
    else:
        worker = threading.Thread(target=begin)
        worker.start()
        worker.join()
    try:
        assert held[0].active
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: report and leave at once
            os.close(read)
            ok = gc.isenabled() and gc.get_threshold() == before and not gc_pause._current
            os.write(write, b"1" if ok else b"0")
            os._exit(0)
        os.close(write)
        got = os.read(read, 1)
        os.close(read)
        os.waitpid(pid, 0)
        assert got == b"1"
        assert held[0].active  # the parent's pause goes on
    finally:
        held[0].end()
    assert gc.isenabled() and gc.get_threshold() == before


def test_a_pause_that_holds_nothing_does_not_stand_in_the_next_ones_way():
    gc.disable()  # the application's own switch: this call's pause holds nothing
    try:
        abandoned = CallPause.begin()
        assert not abandoned.active and not gc_pause._current
    finally:
        gc.enable()
    nxt = CallPause.begin()  # the next call holds the collector itself
    assert nxt.active and not gc.isenabled()
    nxt.end()
    assert gc.isenabled()
