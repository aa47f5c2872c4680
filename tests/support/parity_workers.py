"""Gloo rank cases of tests/test_dcp_parity.py, launched by ``dist_helpers.run_ranks``.

``cached_saves`` saves the same state structure several times (values shifted
by the save's number, see :func:`shifted_full`) with DCP's
``DefaultSavePlanner(enable_plan_caching=True)``, each save into its own
directory, and checks on every rank that the second and later saves took
their plans from DCP's cache. The pytest process then loads every checkpoint
and compares it bit-exactly with :func:`shifted_full`.
"""

from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import dist_helpers as dh  # noqa: E402
import torch  # noqa: E402
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner  # noqa: E402

CASES = dh.WorkerCases(__file__)
case = CASES.case


class RecordingPlanner(DefaultSavePlanner):
    """DCP's default planner; records whether each local plan was sent (usable) or cached."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.local_plan_usable: list[bool] = []

    def create_local_plan(self):
        plan = super().create_local_plan()
        self.local_plan_usable.append(plan.usable)
        return plan


def shifted_full(i: int) -> dict:
    """The full state of save ``i``: the reference tensors plus ``i``, and the objects."""
    out = {k: v + i for k, v in dh.reference_tensors().items()}
    out.update(dh.OBJECTS)
    out["save"] = i
    return out


def shifted_state(mesh, i: int) -> dict:
    state = dh.dtensor_state(mesh, zeros=False)
    for value in state.values():
        if isinstance(value, torch.Tensor):
            (value.to_local() if hasattr(value, "to_local") else value).add_(i)
    state["save"] = i
    return state


def clear_plan_caches() -> None:
    """Forget DCP's class-level save-plan caches (their names differ between torch releases)."""
    from torch.distributed.checkpoint.planner import SavePlanner

    for name in ("_cached_save_plan", "_cached_final_save_plan", "_cached_all_plans", "_cached_global_plan", "_cached_metadata"):
        cache = getattr(SavePlanner, name, None)
        if isinstance(cache, dict):
            cache.clear()


@case
def cached_saves(rank, world_size, path, mode, saves=3):
    """``saves`` saves with a caching planner into ``{path}.{i}``; ``mode`` is "sync" or "async"."""
    import torch.distributed.checkpoint as dcp

    from dcp_datastates import DataStatesWriter

    clear_plan_caches()
    mesh = dh._mesh(world_size)
    planner = RecordingPlanner(enable_plan_caching=True)
    from_cache = []
    for i in range(saves):
        state = shifted_state(mesh, i)
        with DataStatesWriter(f"{path}.{i}") as writer:
            if mode == "sync":
                dcp.save(state, storage_writer=writer, planner=planner)
            else:
                resp = dcp.async_save(state, storage_writer=writer, planner=planner)
                resp.staging_completion.result()
                resp.upload_completion.result()
        from_cache.append(writer.last_save_stats.plan_from_cache)
        if mode == "sync" and rank == 0:  # the coordinator placed every rank's cached plan itself
            assert writer.last_save_stats.metadata_serialize_s > 0, i
    expected = [False] + [True] * (saves - 1)
    assert planner.local_plan_usable == [not c for c in expected], planner.local_plan_usable
    assert from_cache == expected, from_cache


run_ranks = CASES.run_ranks


if __name__ == "__main__":
    CASES.main()
