"""Which checkpoints retention deletes: one pure policy over a tier's steps and what they refer to.

Every tier applies it (the local root after each commit and each durable copy, the durable tier
after each commit there, and the survey at start, which skips draining what the durable tier
would delete at once); each gathers its steps and hands over how to read what a step refers to.
The rules: a step is deleted only when it is older than the step just committed, the policy
does not keep it (the ``keep_last`` newest committed up to that step, every multiple of
``keep_every``, the step itself), the caller may delete it, and no step that stays refers to it
(to a fixed point, so whatever stays stays loadable). Deletions go newest first: a base is older
than what refers to it, so a crash part-way never leaves a step whose base is gone.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Iterable

BasesOf = Callable[[int], "set[int] | None"]  # the steps a step refers to (None: cannot be read)


@dataclasses.dataclass(frozen=True)
class RetentionPolicy:
    keep_last: int | None = None
    keep_every: int | None = None

    def keeps(self, committed: Iterable[int], committed_step: int) -> set[int]:
        """The steps of ``committed`` the policy keeps now that ``committed_step`` committed."""
        committed = sorted(committed)
        upto = [s for s in committed if s <= committed_step]
        keep = {committed_step}
        keep.update(upto if self.keep_last is None else upto[-self.keep_last:])
        if self.keep_every is not None:
            keep.update(s for s in committed if s % self.keep_every == 0)
        return keep

    def victims(
        self,
        committed_step: int,
        present: Collection[int],
        bases_of: BasesOf,
        *,
        uncommitted: Collection[int] = (),
        given_up: Collection[int] = (),
        may_delete: Callable[[int], bool] = lambda _s: True,
    ) -> list[int]:
        """The steps of ``present`` (every step on the tier) to delete now that ``committed_step``
        committed, newest first. ``uncommitted`` steps (failed saves) and ``given_up`` ones below
        ``committed_step`` (a trajectory the run left) take no slot of the policy; ``may_delete``
        is asked about each step the policy would delete (a step it holds still protects its bases)."""
        gone = {s for s in given_up if s < committed_step}
        keep = self.keeps((s for s in present if s not in uncommitted and s not in gone), committed_step)
        candidates = {s for s in present if s < committed_step and s not in keep and may_delete(s)}
        return sorted(_spare_referred(candidates, present, bases_of), reverse=True)


def _spare_referred(victims: Iterable[int], present: Iterable[int], bases_of: BasesOf) -> set[int]:
    """``victims`` less every step a remaining one of ``present`` refers to, to a fixed point.
    A step whose bases cannot be read (None) spares every older victim: a base is always older
    than what refers to it."""
    victims, present = set(victims), list(present)
    while victims:
        spared: set[int] = set()
        for s in present:
            if s in victims:
                continue
            bases = bases_of(s)
            spared |= {v for v in victims if v < s} if bases is None else bases & victims
        if not spared:
            break
        victims -= spared
    return victims
