"""What a rank does once its files of a step are copied to a tier: the commit rule of that rank,
a strategy its tier is given (not flags it reads).

* :class:`CommitWhenAllConfirmed`: the coordinator (rank 0) waits until every rank confirmed its
  files, commits the copy (``.metadata`` last, :func:`drain.commit_durable`), then applies the
  tier's retention;
* :class:`AwaitCommit`: a rank that does not commit but must learn when the copy is committed
  (another node's leader: its local retention waits for the durable copy), :func:`drain.await_commit`;
* :class:`LeaveCommit`: a rank whose part ends with its confirmed files.
"""

from __future__ import annotations

import abc
from collections.abc import Callable

from dcp_datastates.format.metadata_envelope import CommitStamp
from dcp_datastates.storage import Store
from dcp_datastates.tiers.drain import await_commit, commit_durable

Outcome = tuple[CommitStamp | None, str | None, list[int]]  # (stamp committed there, a warning, steps retention deleted)


class CommitRule(abc.ABC):
    settles = False  # this rank learns that the copy is committed (its local copy may then go)
    done_note = ""  # what the log line of a finished copy adds

    @abc.abstractmethod
    def after_copy(self, store: Store, local: Store, step: int, step_dir: str, timeout_s: float,
                   stop: Callable[[], bool] | None) -> Outcome:
        """Once this rank's files of ``step`` (the local copy at the root of ``local``) are on
        ``store`` (under ``step_dir``): what it does."""


class CommitWhenAllConfirmed(CommitRule):
    """``retention(store, step)``: the tier's retention once ``step`` committed there (the steps
    it deleted); a failure of it is a warning, the commit stands. ``ranks``: the ranks whose
    confirmations the commit waits for (None: every rank the step was saved with)."""

    settles = True
    done_note = "; the durable copy is committed"

    def __init__(self, retention: Callable[[Store, int], list[int]], ranks: tuple | None = None) -> None:
        self.retention, self.ranks = retention, ranks

    def after_copy(self, store, local, step, step_dir, timeout_s, stop) -> Outcome:
        stamp = commit_durable(local, step_dir, store, timeout_s=timeout_s, stop=stop, ranks=self.ranks)
        try:
            deleted = self.retention(store, step)
        except Exception as exc:  # noqa: BLE001 - the commit stands; retention catches up next time
            return stamp, f"step {step} is durable in {store.where('')}, but retention there failed: {exc}", []
        return stamp, None, deleted


class AwaitCommit(CommitRule):
    settles = True

    def after_copy(self, store, local, step, step_dir, timeout_s, stop) -> Outcome:
        return await_commit(local, step_dir, store, timeout_s=timeout_s, stop=stop), None, []


class LeaveCommit(CommitRule):
    def after_copy(self, store, local, step, step_dir, timeout_s, stop) -> Outcome:
        return None, None, []
