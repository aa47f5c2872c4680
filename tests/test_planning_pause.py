"""The cyclic GC is paused while DCP plans and runs a save or a load with our writer or reader on
the caller's thread (core/planning_pause.py): off inside DCP's planner, on again once the call is
over whatever happened in it, never touched where the application switched it off or for a save
running beside the training loop."""

from __future__ import annotations

import gc
import threading
import time
import weakref

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner

from dcp_datastates import DataStatesReader, DataStatesSavePlanner, DataStatesWriter, _dcp_compat
from dcp_datastates.core import planning_pause


class _Cycle:
    def __init__(self) -> None:
        self.me = self


class RecordingSavePlanner(DefaultSavePlanner):
    """DCP's own planner, noting whether the collector runs while it plans; it may fail, and it
    leaves a reference cycle made during the save."""

    def __init__(self, fail: bool = False) -> None:
        super().__init__()
        self.fail, self.seen, self.cycle = fail, [], None

    def create_local_plan(self):
        self.seen.append(gc.isenabled())
        cycle = _Cycle()
        self.cycle = weakref.ref(cycle)
        if self.fail:
            raise ValueError("the planner refuses")
        return super().create_local_plan()

    def create_global_plan(self, plans):
        self.seen.append(gc.isenabled())
        return super().create_global_plan(plans)


class RecordingLoadPlanner(DefaultLoadPlanner):
    def __init__(self, fail: bool = False) -> None:
        super().__init__()
        self.fail, self.seen = fail, []

    def create_local_plan(self):
        self.seen.append(gc.isenabled())
        if self.fail:
            raise ValueError("the load planner refuses")
        return super().create_local_plan()


def _state() -> dict:
    return {f"t{i}": torch.full((8,), float(i)) for i in range(4)}


def _wait_enabled(limit_s: float = 5.0) -> float:
    t0 = time.perf_counter()
    while not gc.isenabled():
        assert time.perf_counter() - t0 < limit_s, "the collector stayed off after the DCP call ended"
        time.sleep(0.01)
    return time.perf_counter() - t0


@pytest.fixture(autouse=True)
def _collector_on():
    assert gc.isenabled() and not planning_pause.paused()
    yield
    _wait_enabled()
    assert not planning_pause.paused()


def test_dcp_plans_a_save_and_a_load_with_the_collector_off_and_it_is_on_after(tmp_path):
    path = str(tmp_path / "ckpt")
    planner = RecordingSavePlanner()
    dcp.save(_state(), storage_writer=DataStatesWriter(path), planner=planner, no_dist=True)
    assert planner.seen == [False, False] and gc.isenabled()
    # the cycle made while the collector was off is collected by the next collection
    gc.collect()
    assert planner.cycle() is None
    dest = {k: torch.zeros(8) for k in _state()}
    loader = RecordingLoadPlanner()
    dcp.load(dest, storage_reader=DataStatesReader(path), planner=loader, no_dist=True)
    assert loader.seen == [False] and gc.isenabled()
    assert all(torch.equal(dest[k], v) for k, v in _state().items())
    # our own planner too; DCP's writer, as a control, plans with the collector on
    ours = DataStatesSavePlanner()
    seen = []
    original = ours.create_local_plan
    ours.create_local_plan = lambda: (seen.append(gc.isenabled()), original())[1]
    dcp.save(_state(), storage_writer=DataStatesWriter(str(tmp_path / "ours")), planner=ours, no_dist=True)
    assert seen == [False] and gc.isenabled()
    control = RecordingSavePlanner()
    dcp.save(_state(), storage_writer=dcp.FileSystemWriter(str(tmp_path / "dcp")), planner=control, no_dist=True)
    assert control.seen == [True, True]


def test_a_dcp_error_between_our_hooks_does_not_leave_the_collector_off(tmp_path):
    planner = RecordingSavePlanner(fail=True)
    with pytest.raises(BaseException, match="the planner refuses"):
        dcp.save(_state(), storage_writer=DataStatesWriter(str(tmp_path / "a")), planner=planner, no_dist=True)
    assert planner.seen == [False]
    # no hook of ours ran after the planner's error: the guard sees dcp.save gone
    assert _wait_enabled() <= 1.0 + 5 * planning_pause.GUARD_POLL_S
    dcp.save(_state(), storage_writer=DataStatesWriter(str(tmp_path / "b")), no_dist=True)
    loader = RecordingLoadPlanner(fail=True)
    with pytest.raises(BaseException, match="the load planner refuses"):
        dcp.load(_state(), storage_reader=DataStatesReader(str(tmp_path / "b")), planner=loader, no_dist=True)
    assert loader.seen == [False]
    _wait_enabled()


def test_a_collector_the_application_switched_off_stays_off(tmp_path):
    gc.disable()
    try:
        planner = RecordingSavePlanner()
        dcp.save(_state(), storage_writer=DataStatesWriter(str(tmp_path / "a")), planner=planner, no_dist=True)
        dcp.load(_state(), storage_reader=DataStatesReader(str(tmp_path / "a")), no_dist=True)
        time.sleep(3 * planning_pause.GUARD_POLL_S)
        assert planner.seen == [False, False] and not gc.isenabled() and not planning_pause.paused()
    finally:
        gc.enable()


def test_no_pause_outside_a_dcp_call_or_for_an_async_save(tmp_path):
    path = str(tmp_path / "a")
    dcp.save(_state(), storage_writer=DataStatesWriter(path), no_dist=True)
    reader = DataStatesReader(path)
    reader.read_metadata()  # our own use of the reader (the manager's, the CLI's): no DCP call
    assert gc.isenabled() and not planning_pause.paused()
    # an asynchronous save plans in DCP's thread while training goes on: the collector stays on
    planner = RecordingSavePlanner()
    writer = DataStatesWriter(str(tmp_path / "b"))
    resp = dcp.async_save(_state(), storage_writer=writer, planner=planner, no_dist=True)
    (resp.upload_completion if hasattr(resp, "upload_completion") else resp).result()
    writer.close()
    assert planner.seen == [True, True]


def test_one_threads_pause_is_not_ended_by_another(tmp_path):
    """Two threads' saves at once: the second finds the first's pause and leaves it; the first's
    end ends it; the collector is on once both are over."""
    barrier = threading.Barrier(2)
    errors = []

    def save(name: str) -> None:
        try:
            barrier.wait()
            dcp.save(_state(), storage_writer=DataStatesWriter(str(tmp_path / name)), no_dist=True)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=save, args=(n,)) for n in ("x", "y")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    _wait_enabled()


def test_the_dcp_call_frame_is_the_outermost_frame_of_dcps_code(tmp_path):
    frames = []

    class Probe(DefaultSavePlanner):
        def create_local_plan(self):
            import sys

            frames.append(_dcp_compat.dcp_call_frame(sys._getframe(0)))
            return super().create_local_plan()

    assert _dcp_compat.dcp_call_frame(__import__("sys")._getframe(0)) is None
    dcp.save(_state(), storage_writer=DataStatesWriter(str(tmp_path / "a")), planner=Probe(), no_dist=True)
    (frame,) = frames
    assert frame.f_globals["__name__"].startswith("torch.distributed.checkpoint")
    assert not frame.f_back.f_globals["__name__"].startswith("torch.distributed.checkpoint")  # this test's frame
