"""What rank 0 finds in the root and on the durable tier (handed to every rank by the manager).

:func:`list_checkpoints` before a load (what :mod:`resume` plans from) and :func:`survey_tier`
when the manager starts with a durable tier (which committed local steps to drain again). Copies
are told apart by the save they hold (:class:`CommitStamp`), not by their step numbers.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable

from dcp_datastates.format.file_names import METADATA_FILE
from dcp_datastates.format.metadata_envelope import is_newer_save, is_same_save
from dcp_datastates.format.metadata_file import read_commit_stamp
from dcp_datastates.manager.checkpoint_root import (
    given_up,
    newest_pointer,
    read_pointer_if_valid,
    resume_order,
    step_dir_name,
    step_dirs,
)
from dcp_datastates.manager.collective import describe
from dcp_datastates.manager.resume import Listing
from dcp_datastates.manager.retention import BasesOf, RetentionPolicy
from dcp_datastates.storage import StoreError


@dataclasses.dataclass
class TierSurvey:
    """What rank 0 found on the durable tier at start (handed to every rank)."""

    undrained: list[int]  # committed local steps to drain, in commit order
    settled: dict  # {step: CommitStamp}: steps whose local copy needs nothing more from the tier
    rollbacks: tuple = ()  # the run's rollbacks, as the tier's pointer records them
    newest_sequence: int = 0  # the largest commit sequence the tier knows: later saves are numbered above it
    mirror: Any = None  # the pointer to mirror there (the local one, with the tier's rollbacks), or None
    error: str | None = None  # why the tier did not answer (then every committed local step is queued)


def list_checkpoints(root: str, tier, rollbacks, warn: Callable[[str], None]) -> Listing:
    """The checkpoints of ``root`` and of the durable ``tier`` (None: none). Durable copies are
    judged by the run's pointer (the local one, or the tier's mirror when newer, with every
    rollback either records, and ``rollbacks``); a durable copy that is the very save of a local
    step (``durable_same``) may stand in for it. A store that does not answer is said in
    ``tier_error``; one that refuses is raised (a fallback would hide it)."""
    order = resume_order(root)
    local = set(order.candidates) | set(order.abandoned)
    listing = Listing(order, sorted(set(step_dirs(root)) - local))
    if tier is None:
        return listing
    try:
        durable = sorted(tier.committed_steps())
        durable_only = [s for s in durable if s not in local]
        both = [s for s in order.candidates if s in set(durable)]
        there = tier.commit_stamps([*durable_only, *both])
        tier_pointer = _tier_pointer(tier, warn)
    except StoreError as exc:
        if not exc.transient:
            raise
        listing.tier_error = describe(exc)
        return listing
    pointer = newest_pointer(read_pointer_if_valid(root), tier_pointer, rollbacks=rollbacks)
    sequences = {**order.sequences, **{s: there[s].sequence for s in durable_only if there.get(s) is not None}}
    listing.durable = durable
    listing.given_up = [s for s in given_up(sequences, pointer) if s in durable_only]
    for s in both:
        mine = read_commit_stamp(os.path.join(root, step_dir_name(s), METADATA_FILE))
        if is_same_save(there.get(s), mine) or (
            there.get(s) is not None and mine is None and not given_up({s: there[s].sequence}, pointer)
        ):
            listing.durable_same.add(s)
    return listing


def survey_tier(root: str, tier, retention: RetentionPolicy, bases_of: BasesOf, warn: Callable[[str], None]) -> TierSurvey:
    """At start: which committed local steps the tier holds the very save of, which it would not
    keep anyway (``retention`` applied as if they had been drained in order, bases spared), which
    the run has gone past there (another node went on from the tier: its pointer is newer than
    ours), and so which must be drained again; what interrupted drains left there is removed,
    and the run's pointer merged with the tier's. A store that does not answer is said in
    ``error`` (every committed local step is then queued); one that refuses (credentials,
    permissions, a wrong bucket) is raised: the tier is misconfigured."""
    order = resume_order(root)
    by_commit = sorted(order.candidates, key=lambda s: (order.sequences.get(s, 0), s))
    local_pointer = read_pointer_if_valid(root)
    try:
        durable, incomplete = tier.steps_by_state()  # one listing of the store
        tier_pointer = _tier_pointer(tier, warn)
        tier.clear_incomplete(incomplete)
        there = tier.commit_stamps([s for s in by_commit if s in durable])
    except StoreError as exc:
        if not exc.transient:
            raise
        return TierSurvey(by_commit, {}, error=describe(exc))
    mine = {s: read_commit_stamp(os.path.join(root, step_dir_name(s), METADATA_FILE)) for s in by_commit}
    settled = {s: st for s, st in mine.items() if is_same_save(st, there.get(s))}
    # The tier's pointer newer than ours: another node resumed from the tier and went on.
    behind = tier_pointer is not None and (tier_pointer.sequence or 0) > (
        (local_pointer.sequence or 0) if local_pointer is not None else 0)
    missing = []
    for s in by_commit:
        if s in settled:
            continue
        other = there.get(s)
        if other is not None and mine[s] is not None and (behind or is_newer_save(other, mine[s])):
            settled[s] = mine[s]  # the run saved this step again since: the tier's copy is the run's
        elif not behind:  # behind: a step the run did not take from here; kept, not drained
            missing.append(s)
    if settled and missing and (retention.keep_last is not None or retention.keep_every is not None):
        # Drained, the tier's retention would delete these at once: they count as settled. Only
        # the steps to drain protect their bases (a base of a drained step must be drained first).
        superseded = retention.victims(
            max(settled), sorted(set(durable) | set(missing)),
            lambda s: bases_of(s) if s in missing else set(),
            may_delete=lambda s: s in missing and mine[s] is not None,
        )
        settled.update({s: mine[s] for s in superseded})
        missing = [s for s in missing if s not in superseded]
    sequences = [st.sequence for st in there.values() if st is not None]
    newest_sequence = max([*sequences, (tier_pointer.sequence or 0) if tier_pointer else 0])
    rollbacks = tuple(tier_pointer.rollbacks) if tier_pointer else ()
    # Ours, with the tier's rollbacks too (not behind: ours names the newest commit)
    mirror = newest_pointer(local_pointer, tier_pointer) if local_pointer is not None and not behind else None
    return TierSurvey(missing, settled, rollbacks, newest_sequence, mirror)


def _tier_pointer(tier, warn):
    """The run's pointer mirrored on the tier; one that cannot be read is warned about and
    passed over (copies are then judged by their sequences alone; the next mirror replaces it)."""
    try:
        return tier.read_pointer()
    except ValueError as exc:
        warn(f"{exc}: judging the durable copies by their commit sequences alone")
        return None
