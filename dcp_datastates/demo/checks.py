"""The scenario's checks, each a plain result with the problems it found (empty when it passed).

- the reference run logged every step;
- the failing run, before the failure, is a replica of the reference (same
  ranks, same code: bit-exact on CPU);
- the resumed loss curve continues the reference: exact equality when it
  runs on as many ranks as before, a relative tolerance otherwise (and
  whether it was bit-exact anyway is reported, not assumed);
- the manager's root after both runs: retention applied, ``latest`` on the
  newest checkpoint, nothing uncommitted left behind.
"""

from __future__ import annotations

import dataclasses

from dcp_datastates.demo.checkpoint_dirs import committed_step_dirs
from dcp_datastates.manager.checkpoint_root import read_latest, step_dirs


def check_reference(reference: dict[int, float], last_step: int) -> list[str]:
    """The uninterrupted run logged every step (the curve the others are checked against)."""
    if sorted(reference) != list(range(1, last_step + 1)):
        return ["the reference run did not log every step"]
    return []


@dataclasses.dataclass
class ReplicaCheck:
    """The failing run against the reference over the steps it finished before the failure."""

    steps: list[int]
    exact: bool
    max_diff: float
    problems: list[str]


def check_replica(reference: dict[int, float], failed: dict[int, float], fail_at: int, device: str) -> ReplicaCheck:
    steps = list(range(1, fail_at))
    missing = [s for s in steps if s not in failed]
    max_diff = max((abs(failed[s] - reference[s]) for s in steps if s in failed), default=0.0)
    exact = not missing and all(failed[s] == reference[s] for s in steps)
    problems = []
    if missing:
        problems.append(f"the failing run did not log steps {missing[:5]}...")
    elif not exact and device == "cpu":
        problems.append(f"the failing run diverged from the reference before the failure (max |diff| {max_diff:.3e})")
    return ReplicaCheck(steps, exact, max_diff, problems)


@dataclasses.dataclass
class ContinuationCheck:
    """The resumed run's losses against the reference's, from the first step after the resume."""

    steps: list[int]
    diffs: dict[int, float]  # |resumed - reference| per step both logged
    rels: dict[int, float]  # the same, relative to the reference
    bit_exact: bool
    continuous: bool  # within the check's tolerance
    tol_text: str
    first_bad: int | None
    problems: list[str]

    @property
    def max_abs(self) -> float:
        return max(self.diffs.values(), default=0.0)

    @property
    def max_rel(self) -> float:
        return max(self.rels.values(), default=0.0)


def check_continuation(reference: dict[int, float], resumed: dict[int, float], resume_step: int, last_step: int,
                       *, same_world: bool, rtol: float) -> ContinuationCheck:
    steps = list(range(resume_step + 1, last_step + 1))
    missing = [s for s in steps if s not in resumed]
    diffs = {s: abs(resumed[s] - reference[s]) for s in steps if s in resumed and s in reference}
    rels = {s: diffs[s] / max(abs(reference[s]), 1e-12) for s in diffs}
    bit_exact = not missing and all(resumed[s] == reference[s] for s in steps)
    if same_world:
        tol_text = "exact equality (M == P)"
        continuous = bit_exact
    else:
        tol_text = f"relative tolerance {rtol:g} (M != P)"
        continuous = not missing and all(rels[s] <= rtol for s in steps)
    first_bad = next((s for s in steps if s in diffs and not (
        diffs[s] == 0 if same_world else rels[s] <= rtol)), None)
    check = ContinuationCheck(steps, diffs, rels, bit_exact, continuous, tol_text, first_bad, [])
    if missing:
        check.problems.append(f"the resumed run did not log steps {missing[:5]}")
    if not continuous:
        check.problems.append(f"the resumed loss curve diverges from the reference (first at step {first_bad}, "
                              f"max |diff| {check.max_abs:.3e}, max rel {check.max_rel:.3e}; {tol_text})")
    return check


@dataclasses.dataclass
class RootCheck:
    """The manager's checkpoint root after both runs."""

    kept: list[int]  # committed steps
    pointer: int | None  # the step ``latest`` names
    problems: list[str]


def check_manager_root(root: str, keep_last: int) -> RootCheck:
    """``keep_last`` 0 means keep all (no retention to check)."""
    kept = sorted(committed_step_dirs(root))
    pointer = read_latest(root)
    problems = []
    if not kept or pointer != kept[-1] or sorted(step_dirs(root)) != kept:
        problems.append(f"checkpoint root {root}: committed {kept}, directories {sorted(step_dirs(root))}, "
                        f"latest -> {pointer}")
    if keep_last and len(kept) > keep_last:
        problems.append(f"retention kept {len(kept)} checkpoints, --keep-last is {keep_last}")
    return RootCheck(kept, pointer, problems)
