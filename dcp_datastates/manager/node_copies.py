"""Which files move between nodes, and which rank reads which file where: pure plans.

Every rank computes these from what every node reported (:mod:`manager.nodes`), so every
rank holds the same list of :class:`exchange.files.FileCopy` and the exchange pairs their
sends and receives. Each copy's ``tag`` says where its sending rank finds the file: its
node's root (``own``), the partner copies its node holds (``partner``), or the durable tier
(``durable``: the receiving rank reads it itself).

* :func:`restore_copies`: before a load, a node that lost its files of the step gets back
  the files it is *home* to (:func:`homes`), whatever the number of ranks per node now;
* :func:`holdings`: after that, where each node reads each file of the step, which is what
  a read-once load asks of the ranks (nearest first, and who cannot read a file at all);
* :func:`partner_copies`: each node's files to the ranks of its partner node;
* :func:`commit_copies`: a node whose step directory lacks a ``.metadata`` its save
  committed elsewhere (a crash came between the commit and the node commit) gets it.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from dcp_datastates.exchange.files import FileCopy
from dcp_datastates.format.checkpoint_layout import RankFiles
from dcp_datastates.format.file_names import METADATA_FILE
from dcp_datastates.manager.checkpoint_root import step_dir_name
from dcp_datastates.manager.nodes import DURABLE, OWN, PARTNER, NodeMap, NodePlan, NodeReport

DURABLE_TAG = "durable"
MEMORY = "memory"  # a .metadata held in each rank's memory for the load (its node keeps no copy)


def lacking(reports: list[NodeReport], step: int, count: int) -> list[int]:
    """The nodes (of ``count`` now) with no committed copy of ``step`` in their root."""
    return [n for n in range(count) if n >= len(reports) or step not in reports[n].own]


def homes(plan: NodePlan, step: int, reports: list[NodeReport], count: int) -> dict[int, int]:
    """Each saved rank's home node now: the node whose root holds its files; a rank no root
    holds goes to a node that lost the step: the one whose files a partner copy holds (the
    node before it in the ring), else the nodes that lost it share the rest in rank order.
    Ranks are left without a home when no node lost the step (fewer nodes than at the save):
    their files are read where they are."""
    copies = plan.copies.get(step, [])
    if not copies:
        return {}
    saved = sorted(copies[0][1].ranks)
    home: dict[int, int] = {}
    for (node, kind), copy in copies:
        if kind == OWN and node < count:
            for r in copy.whole_ranks():
                home.setdefault(r, node)
    empty = lacking(reports, step, count)
    if not empty:
        return home
    given: dict[int, int] = {n: 0 for n in empty}
    for (node, kind), copy in sorted(copies, key=lambda c: c[0]):  # a partner copy holds one node's files
        if kind != PARTNER:
            continue
        group = [r for r in copy.whole_ranks() if r not in home]
        if not group:
            continue
        before = (node - 1) % count
        target = before if before in given else min(given, key=lambda n: (given[n], n))
        for r in group:
            home[r] = target
        given[target] += len(group)
    rest = [r for r in saved if r not in home]
    targets = [n for n in empty if given[n] == 0] or empty
    for n, block in zip(targets, np.array_split(np.array(rest, dtype=np.int64), len(targets))):
        for r in block.tolist():
            home[r] = n
    return home


@dataclasses.dataclass
class Restore:
    """A load's copies back into the nodes that lost the step: ``copies``, and what each
    copy is for: a file of the node's root, the ``.metadata`` its leader commits with, or a
    ``.metadata`` each rank of a node without files of the step holds in memory."""

    copies: list[FileCopy]
    purpose: list[str]  # "file", "commit" or MEMORY, by copy
    restored: dict[int, list[str]]  # node -> the names its root gets back (.metadata last)


def restore_copies(plan: NodePlan, step: int, reports: list[NodeReport], nodes: NodeMap) -> Restore:
    """The copies that give every node that lost ``step`` its home files back (module docstring)."""
    out = Restore([], [], {})
    copies = plan.copies.get(step)
    if not copies:
        return out
    layout = copies[0][1].ranks
    home = homes(plan, step, reports, nodes.count)
    for n in lacking(reports, step, nodes.count):
        sources = plan.sources(step, n)
        mine = sorted(r for r, h in home.items() if h == n)
        members = nodes.members[n]
        for j, r in enumerate(mine):
            dst = members[j % len(members)]
            for name in layout[r].file_names():
                out.copies.append(_copy_of(sources[name], name, dst, j, nodes, plan, step, layout[r]))
                out.purpose.append("file")
        if mine:
            out.copies.append(_copy_of(sources[METADATA_FILE], METADATA_FILE, nodes.leader(n), 0, nodes, plan, step,
                                       None, hold=True))
            out.purpose.append("commit")
            out.restored[n] = [*(name for r in mine for name in layout[r].file_names()), METADATA_FILE]
        else:
            for q in members:
                out.copies.append(_copy_of(sources[METADATA_FILE], METADATA_FILE, q, 0, nodes, plan, step, None,
                                           hold=True))
                out.purpose.append(MEMORY)
    return out


def _copy_of(source, name: str, dst: int, j: int, nodes: NodeMap, plan: NodePlan, step: int,
             files: RankFiles | None, hold: bool = False) -> FileCopy:
    if source == DURABLE:
        return FileCopy(dst, dst, name, -1, files, hold, DURABLE_TAG)
    node, kind = source
    members = nodes.members[node]
    size = next(c.files[name] for src, c in plan.copies[step] if src == source)
    return FileCopy(members[j % len(members)], dst, name, size, files, hold, kind)


def holdings(plan: NodePlan, step: int, reports: list[NodeReport], count: int,
             restored: dict[int, list[str]]) -> list[dict[str, str]]:
    """For each node: where it reads each file of ``step`` (``own``, ``partner``, ``durable``,
    or :data:`MEMORY` for a ``.metadata`` its ranks received); a file it cannot read itself
    is absent (another node's rank reads it for the load)."""
    names = (*plan.expected(step), METADATA_FILE)
    out = []
    for n in range(count):
        report = reports[n] if n < len(reports) else None
        own = set(report.own[step].files) if report is not None and step in report.own else set()
        own |= set(restored.get(n, ()))
        partner = set(report.partner[step].files) if report is not None and step in report.partner else set()
        where = {}
        for name in names:
            if name in own:
                where[name] = OWN
            elif name in partner:
                where[name] = PARTNER
            elif step in plan.durable:
                where[name] = DURABLE_TAG
        if METADATA_FILE not in where:
            where[METADATA_FILE] = MEMORY
        out.append(where)
    return out


LEVELS = {OWN: 0, PARTNER: 0, MEMORY: 0, DURABLE_TAG: 1}  # the node's own storage, then the durable tier


def access_of(held: list[dict[str, str]], nodes: NodeMap, step: int):
    """``access(rank, key)`` for a read-once load of ``step`` (:func:`exchange.plan.plan_reads`):
    0 for a file on the rank's node, 1 for one on the durable tier only, None for one only
    another node holds."""
    prefix = step_dir_name(step) + "/"
    by_rank = [held[nodes.node_of(r)] for r in range(sum(len(m) for m in nodes.members))]

    def access(rank: int, key: str):
        where = by_rank[rank].get(key[len(prefix):]) if key.startswith(prefix) else None
        return LEVELS[where] if where is not None else None

    return access


# -- partner copies and the node commit ------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Share:
    """What one rank sends of a step to its partner node: its node, its saved ranks' files
    (each with ``{name: size}``), and (its node's leader) the size of the step's ``.metadata``."""

    node: int
    files: tuple[tuple[RankFiles, tuple[tuple[str, int], ...]], ...]
    metadata: int | None = None


def partner_copies(shares: list[Share | None], nodes: NodeMap) -> tuple[list[FileCopy], dict[int, tuple[int, int]]]:
    """Every rank's share to the ranks of its node's partner (the next node in the ring; the
    j-th rank of a node sends to the j-th of the partner, round the partner's ranks), the
    ``.metadata`` from leader to leader (held: the partner's leader commits the copy with it).
    Also ``{node: (partner, leader of the partner)}`` for each node that sends."""
    copies: list[FileCopy] = []
    commits: dict[int, tuple[int, int]] = {}
    for q, share in enumerate(shares):
        if share is None:
            continue
        partner = nodes.partner(share.node)
        if partner is None:
            continue
        members, receivers = nodes.members[share.node], nodes.members[partner]
        dst = receivers[members.index(q) % len(receivers)]
        for files, sizes in share.files:
            copies.extend(FileCopy(q, dst, name, size, files, False, OWN) for name, size in sizes)
        if share.metadata is not None:
            copies.append(FileCopy(q, nodes.leader(partner), METADATA_FILE, share.metadata, None, True, OWN))
            commits[share.node] = (partner, nodes.leader(partner))
    return copies, commits


def commit_copies(listings: list, nodes: NodeMap) -> list[FileCopy]:
    """The start-time repair: ``listings[n]`` is node ``n``'s ``(committed {step: size of its
    .metadata}, uncommitted steps)``; each uncommitted step another node committed gets that
    node's ``.metadata`` (rank 0's node first), held for the leader to check and commit. The
    copies name ``step_<N>/.metadata`` under the roots."""
    out = []
    first = nodes.node_of(0)
    for n, (_committed, uncommitted) in enumerate(listings):
        for step in uncommitted:
            holders = sorted((m for m, (done, _u) in enumerate(listings) if step in done and m != n),
                             key=lambda m: (m != first, m))
            if holders:
                m = holders[0]
                out.append(FileCopy(nodes.leader(m), nodes.leader(n), f"{step_dir_name(step)}/{METADATA_FILE}",
                                    listings[m][0][step], None, True, OWN))
    return out


def missing_partner_copies(reports: list[NodeReport], nodes: NodeMap, keep_last: int) -> list[tuple[int, frozenset]]:
    """At start: for each of the ``keep_last`` newest steps each node holds, whether its partner
    holds a copy of that very save (by commit stamp); ``(step, nodes whose copy is missing)``,
    in step order."""
    missing: dict[int, set[int]] = {}
    for n in range(nodes.count):
        partner = nodes.partner(n)
        if partner is None or n >= len(reports) or partner >= len(reports):
            continue
        own = reports[n].own
        kept = sorted((s for s in own if s not in reports[n].abandoned), reverse=True)[:keep_last]
        for step in kept:
            there = reports[partner].partner.get(step)
            if there is None or there.stamp != own[step].stamp:
                missing.setdefault(step, set()).add(n)
    return [(step, frozenset(ns)) for step, ns in sorted(missing.items())]
