"""Node-local roots: which ranks share a node, what each node holds, which step a load takes.

With ``node_local=True`` a manager's root names storage on each node (a tmpfs,
an NVMe drive) that the other nodes cannot see. Each node's *leader* (its
lowest rank) keeps its root as rank 0 keeps a shared one (lock, crash
cleanup, pointer, retention). A save commits as always (rank 0 writes
``.metadata`` on its node); every other leader then receives that ``.metadata``
over the exchange and writes it next to its ranks' files: the *node commit*
(:mod:`manager.node_level`). A node's step directory thus holds ``.metadata``
and its own ranks' files only.

A load gathers every leader's :class:`NodeReport` (its committed steps, the
partner copies it holds for another node, which save each copy is) and plans
from them alone (:func:`plan_node_load`), so every rank agrees on one step: the
newest step every file of which some node (or the durable tier) holds. Which
files move where before and during that load is :mod:`manager.node_copies`.

This module is pure apart from :func:`survey_node`, which reads one root.
"""

from __future__ import annotations

import dataclasses
import os
import socket

from dcp_datastates.format.checkpoint_layout import RankFiles
from dcp_datastates.format.file_names import METADATA_FILE
from dcp_datastates.format.metadata_envelope import CommitStamp, is_same_save
from dcp_datastates.errors import CheckpointError
from dcp_datastates.manager.checkpoint_root import is_committed, resume_order, step_dir_name, step_dirs

NODE_ENV = "DCP_DATASTATES_NODE"  # names this process's node where host names do not tell nodes apart
PARTNER_DIR = ".partner"  # under a node's root: the copies it holds of its predecessor's files
OWN, PARTNER = "own", "partner"


def node_key() -> str:
    """What tells this process's node from the others: ``$DCP_DATASTATES_NODE`` when set, else
    the host name with torchrun's node rank (``GROUP_RANK``)."""
    return os.environ.get(NODE_ENV) or f"{socket.gethostname()}/{os.environ.get('GROUP_RANK', '')}"


@dataclasses.dataclass(frozen=True)
class NodeMap:
    """The ranks of each node (nodes numbered by their lowest rank) and this rank's place."""

    members: tuple[tuple[int, ...], ...]
    rank: int

    @classmethod
    def of_keys(cls, keys: list[str], rank: int) -> NodeMap:
        """From every rank's :func:`node_key`, in rank order."""
        groups: dict[str, list[int]] = {}
        for r, key in enumerate(keys):
            groups.setdefault(key, []).append(r)
        return cls(tuple(tuple(g) for g in sorted(groups.values())), rank)

    @classmethod
    def single(cls, world: int, rank: int) -> NodeMap:
        """One root for the whole group (a shared file system, or one node)."""
        return cls((tuple(range(world)),), rank)

    @property
    def count(self) -> int:
        return len(self.members)

    def node_of(self, rank: int) -> int:
        return next(n for n, ranks in enumerate(self.members) if rank in ranks)

    @property
    def node(self) -> int:
        return self.node_of(self.rank)

    def leader(self, node: int) -> int:
        return self.members[node][0]

    @property
    def is_leader(self) -> bool:
        return self.rank == self.leader(self.node)

    def partner(self, node: int) -> int | None:
        """The node that holds ``node``'s partner copies: the next one, in a ring (None: one node)."""
        return (node + 1) % self.count if self.count > 1 else None


# -- what a node holds --------------------------------------------------------------------


@dataclasses.dataclass
class StepCopy:
    """A committed copy of a step on one node: which save it is, the files it holds
    (``{name: size}``) and each saved rank's files as its layout names them (``.metadata`` aside)."""

    stamp: CommitStamp | None
    files: dict[str, int]
    ranks: dict[int, RankFiles]

    @property
    def expected(self) -> tuple[str, ...]:
        return tuple(n for files in self.ranks.values() for n in files.file_names())

    def whole_ranks(self) -> list[int]:
        """The saved ranks every file of which this copy holds."""
        return [r for r, files in self.ranks.items() if all(n in self.files for n in files.file_names())]

    @property
    def sequence(self) -> int:
        return self.stamp.sequence if self.stamp is not None else 0


@dataclasses.dataclass
class NodeReport:
    """A leader's view of its root, gathered to every rank before a load."""

    node: int
    own: dict[int, StepCopy]  # committed steps of the root
    partner: dict[int, StepCopy]  # committed copies of another node's files held here
    abandoned: set[int]  # committed steps the root's pointer gave up (a rollback)
    unreadable: dict[int, str] = dataclasses.field(default_factory=dict)  # committed steps whose .metadata did not decode


def survey_node(node: int, root: str, allow_pickle: bool) -> NodeReport:
    """This node's committed steps and partner copies (each one's ``.metadata`` decoded once)."""
    order = resume_order(root)
    report = NodeReport(node, {}, {}, set(order.abandoned))
    for step in [*order.candidates, *order.abandoned]:
        _add_copy(report.own, report.unreadable, step, os.path.join(root, step_dir_name(step)), allow_pickle)
    partner_root = os.path.join(root, PARTNER_DIR)
    if os.path.isdir(partner_root):
        for step, name in step_dirs(partner_root).items():
            path = os.path.join(partner_root, name)
            try:
                committed = is_committed(path)
            except CheckpointError:  # a .metadata that is not a regular file: not offered
                continue
            if committed:
                _add_copy(report.partner, {}, step, path, allow_pickle)
    return report


def _add_copy(into: dict, unreadable: dict, step: int, path: str, allow_pickle: bool) -> None:
    from dcp_datastates.core.reader import DataStatesReader
    from dcp_datastates.format.metadata_file import read_commit_stamp

    try:
        reader = DataStatesReader(path, allow_pickle=allow_pickle)
        reader.load_metadata()
        layout = reader.require_layout()
        ranks = {r.rank: r for r in layout.own_ranks}
        stamp = read_commit_stamp(os.path.join(path, METADATA_FILE))
        files = {e.name: e.stat().st_size for e in os.scandir(path) if e.is_file() and not e.name.startswith(".")}
        files[METADATA_FILE] = os.path.getsize(os.path.join(path, METADATA_FILE))
    except Exception as exc:  # noqa: BLE001 - this copy is not offered; the others may be
        unreadable[step] = f"{type(exc).__name__}: {exc}"
        return
    into[step] = StepCopy(stamp, files, ranks)


# -- planning a load ----------------------------------------------------------------------

Source = tuple  # (node, OWN or PARTNER), or (None, "durable")
DURABLE: Source = (None, "durable")


@dataclasses.dataclass
class NodePlan:
    """Every rank's plan of a node-local load: the steps to try, in order, and where each file
    of each is (:meth:`sources`)."""

    candidates: list[int]
    copies: dict[int, list[tuple[Source, StepCopy]]]  # step -> the copies of its chosen save
    durable: set[int]  # steps whose chosen save the durable tier holds (committed there)
    missing: dict[int, list[str]] = dataclasses.field(default_factory=dict)  # step -> files no one holds
    newest_known: int | None = None

    def expected(self, step: int) -> tuple[str, ...]:
        copies = self.copies.get(step)
        return copies[0][1].expected if copies else ()

    def sources(self, step: int, node: int) -> dict[str, Source]:
        """Where ``node`` reads each file of ``step`` (``.metadata`` included): its own root,
        then the partner copy it holds, then another node's root, then a partner copy held
        elsewhere, then the durable tier."""
        order = {(node, OWN): 0, (node, PARTNER): 1}
        copies = sorted(self.copies.get(step, []), key=lambda c: (order.get(c[0], 2), c[0][1] != OWN, c[0][0]))
        out: dict[str, Source] = {}
        for name in (*self.expected(step), METADATA_FILE):
            held = next((src for src, copy in copies if name in copy.files), None)
            if held is None and step in self.durable:
                held = DURABLE
            if held is not None:
                out[name] = held
        return out


def plan_node_load(reports: list[NodeReport], durable: list[int], given_up: list[int], step: int | None,
                   durable_stamps: dict | None = None) -> NodePlan:
    """Which steps a load tries, newest commit first: a step is a candidate when some node (or
    the durable tier) holds each of its files. Of a step saved more than once (a rollback saved
    it again while a node was away) the newest save counts, and the durable tier stands in for
    a node's files only when it holds that very save (``durable_stamps``: each durable step's
    commit stamp there); a step a node's pointer gave up is never resumed. A step no node holds
    (every node lost its root) is the durable tier's alone: :meth:`NodePlan.sources` is empty."""
    abandoned = set().union(*(r.abandoned for r in reports)) if reports else set()
    by_step: dict[int, list[tuple[Source, StepCopy]]] = {}
    for r in reports:
        for kind, copies in ((OWN, r.own), (PARTNER, r.partner)):
            for s, copy in copies.items():
                by_step.setdefault(s, []).append(((r.node, kind), copy))
    plan = NodePlan([], {}, set(durable) - set(given_up))
    for s, copies in by_step.items():
        newest = max(c.sequence for _src, c in copies)
        plan.copies[s] = [(src, c) for src, c in copies if c.sequence == newest]
        if s in plan.durable and not is_same_save((durable_stamps or {}).get(s), plan.copies[s][0][1].stamp):
            plan.durable.discard(s)  # another save of the step there: its files are not these
    known = sorted(set(by_step) | set(durable) - set(given_up))
    plan.newest_known = max(known) if known else None
    order = sorted((s for s in by_step if s not in abandoned), key=lambda s: (plan.copies[s][0][1].sequence, s), reverse=True)
    for s in sorted(plan.durable - set(by_step) - abandoned, reverse=True):  # durable only: by step among the others
        at = next((i for i, c in enumerate(order) if c < s), len(order))
        order.insert(at, s)
    if step is not None:
        order = [s for s in order if s == step]
    for s in order:
        if s in by_step:
            lacking = [n for n in (*plan.expected(s), METADATA_FILE) if n not in plan.sources(s, 0)]
            if lacking:
                plan.missing[s] = lacking
                continue
        plan.candidates.append(s)
    return plan
