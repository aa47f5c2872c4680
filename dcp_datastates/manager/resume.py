"""Which checkpoints a load tries, in which order, and what it says first: a pure planner.

Rank 0 lists the root and the durable tier (:class:`Listing`, handed to every rank); the plan
(:func:`plan_load`) follows from it alone, so every rank tries the same candidates in the same
order. The manager then tries them one by one (``CheckpointManager.load``).
"""

from __future__ import annotations

import dataclasses
import os

from dcp_datastates.errors import CheckpointError, CheckpointNotFoundError, IncompleteCheckpointError
from dcp_datastates.manager.checkpoint_root import LATEST_FILE, ResumeOrder, step_dir_name
from dcp_datastates.manager.nodes import NodePlan, NodeReport


@dataclasses.dataclass
class Listing:
    """Rank 0's view of the checkpoints for a load (handed to every rank)."""

    order: ResumeOrder  # of the local root
    uncommitted: list[int]  # local step directories never committed
    durable: list[int] = dataclasses.field(default_factory=list)  # steps committed on the durable tier
    given_up: list[int] = dataclasses.field(default_factory=list)  # durable-only steps of a trajectory given up
    durable_same: set = dataclasses.field(default_factory=set)  # local steps whose durable copy is the same save
    tier_error: str | None = None  # why the durable tier did not answer

    @property
    def local(self) -> set[int]:
        return set(self.order.candidates) | set(self.order.abandoned)

    def durable_only(self) -> list[int]:
        """Steps to resume from the durable tier alone (not local, not of a trajectory given up)."""
        local = self.local
        return [s for s in self.durable if s not in local and s not in self.given_up]


@dataclasses.dataclass
class LoadPlan:
    candidates: list[int]  # tried in this order (empty: nothing to load)
    local: set[int]  # the steps with a committed local copy (the others are on the durable tier only)
    warnings: list[str]  # said before the first try
    error: CheckpointError | None = None  # raised after the warnings instead of trying anything
    unanswered: str | None = None  # the durable tier did not answer: why (added to a final error)
    newest_known: int | None = None  # the newest step committed on any tier (a load of an older one rolls back)


def plan_load(listing: Listing, step: int | None, root: str, tier_url: str | None) -> LoadPlan:
    """The plan of a load of ``step`` (None: resume from the newest that loads) from ``listing``."""
    order, local = listing.order, listing.local
    durable_only = listing.durable_only()
    known = [*order.candidates, *durable_only]
    unanswered = f"the durable tier {tier_url} did not answer ({listing.tier_error})" if listing.tier_error else None
    plan = LoadPlan([], local, [], None, unanswered, max(known) if known else None)
    if step is not None:
        if step in local or step in listing.durable:
            plan.candidates = [step]
        elif step in listing.uncommitted:
            plan.error = IncompleteCheckpointError(
                f"{os.path.join(root, step_dir_name(step))}: the checkpoint of step {step} was never committed "
                "(an interrupted or failed save)"
            )
        elif unanswered:
            plan.error = CheckpointError(f"no checkpoint of step {step} under {root}, and {unanswered}")
        else:
            plan.error = CheckpointNotFoundError(
                f"no checkpoint of step {step} under {root} (committed: {sorted(order.candidates + order.abandoned)})"
                + (f" or {tier_url} (durable: {listing.durable})" if tier_url is not None else "")
            )
        return plan
    plan.candidates = candidates = with_durable_only(order.candidates, durable_only)
    say = plan.warnings.append
    for s in listing.given_up:
        say(f"skipping the durable copy of step {s} in {tier_url}: it belongs to a trajectory the run "
            f"gave up (it resumed from an older step since); a new save of step {s} replaces it")
    if order.pointer_error:
        say(f"{order.pointer_error}; resuming from the newest committed checkpoint")
    for s in listing.uncommitted:
        if not candidates or s > candidates[0]:
            say(f"skipping {os.path.join(root, step_dir_name(s))}: it was never committed (an interrupted or failed save)")
    for s in order.abandoned:
        say(f"skipping the checkpoint of step {s}: it was committed before {LATEST_FILE} moved to step "
            f"{order.pointer} (a run resumed from an older step since); a new save of step {s} replaces it")
    if unanswered and candidates:
        say(f"{unanswered}: resuming from {root} alone")
    if unanswered and not candidates:  # a fresh start would hide the checkpoints the tier may hold
        plan.error = CheckpointError(f"{root} holds no committed checkpoint, and {unanswered}")
    return plan


def with_durable_only(local: list[int], durable_only: list[int]) -> list[int]:
    """Resume candidates: the local ones in their order, each durable-only step placed before
    the first local one with a smaller step."""
    out = list(local)
    for s in sorted(durable_only, reverse=True):
        at = next((i for i, c in enumerate(out) if c < s), len(out))
        out.insert(at, s)
    return out


def plan_node_resume(listing: Listing, nodes: NodePlan, reports: list[NodeReport], step: int | None, root: str,
                     tier_url: str | None) -> LoadPlan:
    """The plan of a load from node-local roots: the candidates and newest step of ``nodes``
    (:func:`nodes.plan_node_load`, from every leader's report), the warnings of rank 0's listing
    (:func:`plan_load` of a resume), and what the nodes' reports add: the steps no node holds
    whole, the copies a node could not read. Every candidate is loaded from the nodes' roots."""
    listed = plan_load(listing, None, root, tier_url)
    plan = LoadPlan(list(nodes.candidates), set(nodes.candidates), list(listed.warnings), None, listed.unanswered,
                    nodes.newest_known)
    if not plan.candidates and plan.unanswered:
        plan.error = listed.error
    for s, lacking in sorted(nodes.missing.items(), reverse=True):
        if not plan.candidates or s > plan.candidates[0] or step is not None:
            plan.warnings.append(f"skipping step {s}: no node holds {', '.join(lacking[:3])}"
                                 f"{' and others' if len(lacking) > 3 else ''} (a node lost its root)")
    for r in reports:
        for s, why in r.unreadable.items():
            plan.warnings.append(f"node {r.node}: the checkpoint of step {s} cannot be read ({why})")
    if step is not None and not plan.candidates:
        plan.error = CheckpointError(
            f"cannot load step {step} from the nodes' roots {root}"
            + (f": no node holds {', '.join(nodes.missing[step][:3])}" if step in nodes.missing else ": no node holds it")
            + (f" (nor does {tier_url})" if tier_url is not None else "")
        )
    return plan
