"""Child processes of tests/test_manager.py.

* ``python manager_workers.py crash ROOT SCENARIO MODE``: one process saves
  steps with a ``CheckpointManager`` and is killed (SIGKILL, by an armed
  fault rule) at a chosen point after a commit: while writing the ``latest``
  pointer, at its rename, or while retention deletes an old checkpoint.
* the gloo rank cases (``@case``), launched by ``dist_helpers.run_ranks``
  with this file as the worker script.

The saved values are a deterministic function of the step
(:func:`state_at`), so the pytest process checks loads bit-exactly without
talking to the children.
"""

from __future__ import annotations

import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import dist_helpers as dh  # noqa: E402
import torch  # noqa: E402


def state_at(step: int) -> dict:
    """The state saved at ``step``: a few tensors (one 4 MiB) and objects, all functions of the step."""
    g = torch.Generator().manual_seed(1000 + step)
    return {
        "model": {
            "w": torch.randn(1024, 1024, generator=g),
            "b": torch.randn(1024, generator=g).to(torch.bfloat16),
        },
        "optim": {"m": torch.randn(257, 3, generator=g, dtype=torch.float64)},
        "step": step,
        "data": {"epoch": step // 10, "name": f"run@{step}"},
    }


def frozen_state() -> dict:
    """A state whose large tensor never changes (an incremental save refers to it)."""
    g = torch.Generator().manual_seed(99)
    return {"model": {"frozen": torch.randn(512, 512, generator=g)}, "step": 0}


def load_step(mgr, step=None, **kw):
    """``mgr.load`` into a zeroed state of :func:`state_at`'s shapes: ``(step loaded, state)``."""
    target = zeros_like_state()
    got = mgr.load(target, step, **kw)
    return got, target


def zeros_like_state() -> dict:
    ref = state_at(0)
    out = {"model": {k: torch.zeros_like(v) for k, v in ref["model"].items()},
           "optim": {"m": torch.zeros_like(ref["optim"]["m"])}}
    out["step"] = -1
    out["data"] = {"epoch": -1, "name": ""}
    return out


# ---------------------------------------------------------------------------
# crash child
# ---------------------------------------------------------------------------


def crash(root: str, scenario: str, mode: str) -> None:
    from dcp_datastates.native.faults import arm
    from dcp_datastates.manager.checkpoint_manager import CheckpointManager
    from dcp_datastates.manager import CheckpointManagerOptions as Options

    async_save = mode == "async"
    if scenario == "incremental_retention":
        # 10 full, 20 refers to 10's frozen bytes, 30 full (full_every=2): at 30's commit retention
        # deletes 20, then 10; killed while deleting the first of them
        mgr = CheckpointManager(root, Options(keep_last=1, full_every=2, async_save=async_save))
        state = frozen_state()
        for step in (10, 20):
            state["step"] = step
            mgr.save(step, state)
            mgr.wait()
        arm("fsync", path=os.path.join(root, "step_00000020"), action="kill")
        print("armed", flush=True)
        state["step"] = 30
        mgr.save(30, state)
        mgr.wait()
        print("survived", flush=True)  # the test fails if this is reached
        return
    mgr = CheckpointManager(root, Options(keep_last=1 if scenario == "retention" else 3, async_save=async_save))
    mgr.save(10, state_at(10))
    mgr.wait()
    if scenario == "pointer_write":  # the temporary pointer is being written
        arm("write", path=os.path.join(root, "latest."), action="kill", offset=None)
    elif scenario == "pointer_rename":  # the pointer is complete but not renamed over the old one
        arm("rename", path=os.path.join(root, "latest"), action="kill")
    elif scenario == "retention":  # step 10's .metadata is gone, its data files are not
        arm("fsync", path=os.path.join(root, "step_00000010"), action="kill")
    else:
        raise ValueError(scenario)
    print("armed", flush=True)
    mgr.save(20, state_at(20))
    mgr.wait()
    print("survived", flush=True)  # the test fails if this is reached


TRAJECTORY = 100  # the new trajectory's step s holds state_at(TRAJECTORY + s)


def tier_rollback_crash(root: str, durable: str, point: str) -> None:
    """Steps 1..5 durable on a directory tier; the run rolls back to step 3 and saves the new
    trajectory's step 4; the process is SIGKILLed at ``point``: while the local pointer is
    renamed over (``local_pointer``), while the pointer's mirror on the tier is (``mirror``),
    while step 4's first data object is published there (``drain_data``), or its
    ``.metadata`` (``drain_commit``)."""
    from dcp_datastates.native.faults import arm
    from dcp_datastates.manager.checkpoint_manager import CheckpointManager
    from dcp_datastates.manager import CheckpointManagerOptions as Options

    with CheckpointManager(root, Options(keep_last=3, durable=durable, async_save=False)) as mgr:
        for step in range(1, 6):
            mgr.save(step, state_at(step))
        mgr.wait_durable()
    mgr = CheckpointManager(root, Options(keep_last=3, durable=durable, async_save=False))
    assert load_step(mgr, 3)[0] == 3
    while mgr._tier._small:  # the start's mirror of the pointer written: the kill is for the rollback's
        time.sleep(0.01)
    target = {
        "local_pointer": os.path.join(root, "latest"),
        "mirror": os.path.join(durable, "latest"),
        "drain_data": os.path.join(durable, "step_00000004", "rank00000-"),
        "drain_commit": os.path.join(durable, "step_00000004", ".metadata"),
    }[point]
    arm("rename", path=target, action="kill")
    print("armed", flush=True)
    mgr.save(4, state_at(TRAJECTORY + 4))
    mgr.wait_durable()
    print("survived", flush=True)  # the test fails if this is reached


# ---------------------------------------------------------------------------
# gloo rank cases
# ---------------------------------------------------------------------------

CASES = dh.WorkerCases(__file__)
case = CASES.case


def _dtensor_state(step: int, mesh) -> dict:
    from torch.distributed.tensor import Shard, distribute_tensor

    full = state_at(step)
    full["model"] = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in full["model"].items()}
    return full


@case
def manager_async_saves(rank, world_size, root):
    """Async saves of sharded state on every rank; rank 0 alone moves the pointer and applies retention."""
    from torch.distributed.device_mesh import init_device_mesh

    from dcp_datastates.manager.checkpoint_root import read_latest
    from dcp_datastates.manager.checkpoint_manager import CheckpointManager
    from dcp_datastates.manager import CheckpointManagerOptions as Options

    mesh = init_device_mesh("cpu", (world_size,))
    mgr = CheckpointManager(root, Options(keep_last=2, keep_every=20, async_save=True))
    for step in (10, 20, 30, 40):
        state = _dtensor_state(step, mesh)
        mgr.save(step, state)
        # the fence: an optimizer step waits for the snapshot before mutating
        opt = torch.optim.SGD([state["model"]["w"]], lr=1.0)
        state["model"]["w"].grad = torch.ones_like(state["model"]["w"])
        opt.step()
    mgr.wait()  # on rank 0 this includes the pointer and retention
    if rank == 0:
        assert mgr.steps() == [20, 30, 40], mgr.steps()
        assert read_latest(root) == 40
    target = _dtensor_state(0, mesh)
    for v in target["model"].values():
        v.to_local().zero_()
    target["optim"]["m"].zero_()
    assert mgr.load(target) == 40
    expect = state_at(40)
    for k, v in target["model"].items():
        assert torch.equal(v.full_tensor(), expect["model"][k]), k
    assert torch.equal(target["optim"]["m"], expect["optim"]["m"])
    assert target["step"] == 40 and target["data"] == expect["data"]
    mgr.close()


@case
def manager_durable_saves(rank, world_size, root, durable):
    """Sharded async saves with a durable tier: each rank drains its own files, rank 0 commits."""
    from torch.distributed.device_mesh import init_device_mesh

    from dcp_datastates.manager.checkpoint_manager import CheckpointManager
    from dcp_datastates.manager import CheckpointManagerOptions as Options

    mesh = init_device_mesh("cpu", (world_size,))
    mgr = CheckpointManager(root, Options(keep_last=1, durable=durable, async_save=True))
    for step in (10, 20):
        mgr.save(step, _dtensor_state(step, mesh))
    mgr.wait_durable()
    assert all(st.state == "durable" for st in mgr.durable_status().values()), mgr.durable_status()
    mgr.close()


@case
def manager_durable_resume(rank, world_size, root, durable, how):
    """2 new nodes (empty local roots) resume sharded state from the durable tier: each rank
    loads only its shards, in place ("load") or after rank 0 fetched the step ("fetch")."""
    from torch.distributed.device_mesh import init_device_mesh

    from dcp_datastates.manager.checkpoint_manager import CheckpointManager
    from dcp_datastates.manager import CheckpointManagerOptions as Options

    mesh = init_device_mesh("cpu", (world_size,))
    mgr = CheckpointManager(root, Options(durable=durable, durable_resume=how, async_save=True))
    target = _dtensor_state(0, mesh)
    for v in target["model"].values():
        v.to_local().zero_()
    assert mgr.load(target) == 20
    expect = state_at(20)
    for k, v in target["model"].items():
        assert torch.equal(v.full_tensor(), expect["model"][k]), k
    assert mgr.steps() == ([20] if how == "fetch" else [])
    mgr.save(30, _dtensor_state(30, mesh))  # numbered after the durable copy's commit
    mgr.wait_durable()
    mgr.close()


@case
def manager_resume_skips_corrupt(rank, world_size, root):
    """2 ranks resume from a root whose newest checkpoint is corrupt: both fall back to the same step."""
    import warnings

    from torch.distributed.device_mesh import init_device_mesh

    from dcp_datastates.manager.checkpoint_manager import CheckpointManager, SkippedCheckpointWarning
    from dcp_datastates.manager import CheckpointManagerOptions as Options

    mesh = init_device_mesh("cpu", (world_size,))
    mgr = CheckpointManager(root, Options(keep_last=None, async_save=False))
    target = _dtensor_state(0, mesh)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step = mgr.load(target)
    assert step == 20, step
    assert any(issubclass(w.category, SkippedCheckpointWarning) and "step 30" in str(w.message) for w in caught)
    expect = state_at(20)
    for k, v in target["model"].items():
        assert torch.equal(v.full_tensor(), expect["model"][k]), k
    # the skipped step is saved again: no refusal, it replaces the corrupt one
    mgr.save(30, _dtensor_state(30, mesh))
    assert mgr.load(_dtensor_state(0, mesh)) == 30
    mgr.close()


run_ranks = CASES.run_ranks


@case
def manager_incremental_dtensor_saves(rank, world_size, root):
    """Async incremental saves of sharded state: each rank refers to its own unchanged shards of
    the previous step (a frozen DTensor), writes the changed ones, and every rank resumes."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from dcp_datastates.manager.checkpoint_manager import CheckpointManager
    from dcp_datastates.manager import CheckpointManagerOptions as Options

    mesh = init_device_mesh("cpu", (world_size,))
    g = torch.Generator().manual_seed(7)
    frozen = distribute_tensor(torch.randn(512, 256, generator=g), mesh, [Shard(0)])  # 256 KiB a rank
    moving = distribute_tensor(torch.randn(512, 256, generator=g), mesh, [Shard(0)])
    state = {"model": {"frozen": frozen, "moving": moving}, "step": 0}
    mgr = CheckpointManager(root, Options(keep_last=1, async_save=True))
    for step in (1, 2, 3):
        state["step"] = step
        done = mgr.save(step, state)
        saved_moving = moving.full_tensor()  # a read: the snapshot may still be copying
        opt = torch.optim.SGD([moving], lr=1.0)  # the fence holds this until the snapshot is out
        moving.grad = torch.ones_like(moving)
        opt.step()
        done.result()  # committed before the next save starts: that one refers to it
    mgr.wait()
    target = {
        "model": {k: distribute_tensor(torch.zeros(512, 256), mesh, [Shard(0)]) for k in ("frozen", "moving")},
        "step": -1,
    }
    assert mgr.load(target) == 3
    assert torch.equal(target["model"]["frozen"].full_tensor(), frozen.full_tensor())
    assert torch.equal(target["model"]["moving"].full_tensor(), saved_moving)  # before the third step
    assert target["step"] == 3
    mgr.close()


@case
def manager_hostile_metadata_raises(rank, world_size, root):
    """2 ranks resume from a root whose newest .metadata would run code: every rank raises
    UnsafeCheckpointError, none falls back to the older step."""
    from dcp_datastates import UnsafeCheckpointError
    from dcp_datastates.manager.checkpoint_manager import CheckpointManager
    from dcp_datastates.manager import CheckpointManagerOptions as Options

    mgr = CheckpointManager(root, Options(keep_last=None, async_save=False))
    try:
        mgr.load({"w": torch.zeros(3)})
    except UnsafeCheckpointError as exc:
        assert "system" in str(exc) and "rank 0" in str(exc), exc
    else:
        raise AssertionError("the hostile checkpoint was not refused")
    mgr.close()


if __name__ == "__main__":
    if sys.argv[1] == "crash":
        crash(*sys.argv[2:5])
        sys.exit(0)
    if sys.argv[1] == "tier_rollback_crash":
        tier_rollback_crash(*sys.argv[2:5])
        sys.exit(0)
    CASES.main()
