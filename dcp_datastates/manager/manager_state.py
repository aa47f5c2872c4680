"""The state a :class:`CheckpointManager` shares between its parts (saving, loading, local
retention, the tiers' wiring): one object, so that each part is a module of its own and each
field has one owner of its rules. Guarded by ``lock`` where a background thread reads it."""

from __future__ import annotations

import dataclasses
import os
import threading
from typing import TYPE_CHECKING, Any

from dcp_datastates.format.metadata_file import CommitStamp
from dcp_datastates.manager.checkpoint_root import step_dir_name

if TYPE_CHECKING:
    from dcp_datastates.manager.base_choice import BaseChoice
    from dcp_datastates.manager.collective import Ranks
    from dcp_datastates.manager.durable_tier import DurableTier
    from dcp_datastates.manager.node_level import NodeLevel
    from dcp_datastates.manager.nodes import NodeMap
    from dcp_datastates.manager.options import CheckpointManagerOptions
    from dcp_datastates.manager.partner_tier import PartnerTier


@dataclasses.dataclass(eq=False)
class ManagerState:
    root: str
    options: CheckpointManagerOptions
    ranks: Ranks
    nodes: NodeMap  # which ranks share a root: all of them, or (node_local) each node's
    # What each step refers to is read whatever this manager does (a root may hold incremental
    # steps of an earlier run): retention never deletes a base a remaining step needs.
    bases: BaseChoice
    node_level: NodeLevel | None = None  # node_local: the roots' nodes and the exchange between them
    tier: DurableTier | None = None
    partner: PartnerTier | None = None  # partner=True: copies of this node's files on the next node
    owner: bool = False  # this manager holds the root's lock (all leaders' roots, node-local)
    root_created: bool = False  # the root did not exist before this manager
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    pending: list[Any] = dataclasses.field(default_factory=list)  # saving.PendingSave, in start order
    seq: int = 0  # the newest commit sequence handed out or seen (every rank the same)
    pointed_seq: int = 0  # the sequence ``latest`` names
    replaceable: set[int] = dataclasses.field(default_factory=set)  # committed steps a save may overwrite (skipped as bad)
    reserved_bases: set[str] = dataclasses.field(default_factory=set)  # rank 0: bases chosen for saves not registered yet
    # The run's rollbacks, (step resumed from, sequence of the first save after it): recorded in
    # the pointer, on every tier (checkpoint_root.given_up). Rank 0's.
    rollbacks: set[tuple[int, int]] = dataclasses.field(default_factory=set)
    rolled_back_to: tuple[int, int] | None = None  # (step loaded, newest known) of a load of an older step
    # Steps whose local copy needs no more from the durable tier, with the save they are
    # ({step: CommitStamp}): its own save is committed there, or the tier's retention would not
    # keep it. Local retention deletes a step only then (unless delete_undrained).
    settled: dict[int, CommitStamp] = dataclasses.field(default_factory=dict)
    undrained_run: set[int] = dataclasses.field(default_factory=set)  # node_local + durable: the run's steps to drain
    closed: bool = False

    @property
    def rank(self) -> int:
        return self.ranks.rank

    def path_of(self, step: int) -> str:
        return os.path.join(self.root, step_dir_name(step))

    def saw_sequence(self, seq: int | None) -> None:
        """Later saves are numbered after ``seq`` (a commit read from a tier or another node)."""
        with self.lock:
            self.seq = max(self.seq, seq or 0)

    def in_flight(self) -> list[Any]:
        """The saves not done yet (under ``lock``)."""
        return [p for p in self.pending if not p.done.done()]

    def each_tier(self):
        """The background copy queues this manager runs (the partner level first, then the durable tier)."""
        return [t for t in (self.partner, self.tier) if t is not None]
