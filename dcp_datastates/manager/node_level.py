"""The node level of a manager whose roots are node-local: everything that crosses nodes.

Which ranks share a node is gathered once (:class:`manager.nodes.NodeMap`). The bytes that
cross nodes move through the exchange (:mod:`exchange`), on channels of the manager's own:

* the node commit: after each save, rank 0's ``.metadata`` goes to every other node's
  leader, which writes it next to its node's files (:meth:`NodeLevel.commit`); at start, a
  step directory whose ``.metadata`` a crash kept from coming gets it from a node that has it
  (:meth:`NodeLevel.repair_commits`);
* a load: every leader's report of its root (:meth:`NodeLevel.reports`); the nodes that lost
  the step get their files back (:meth:`NodeLevel.restore`: from the partner copy, another
  node, or the durable tier), then every rank reads through a store routed to what its node
  holds, the rest read once by a rank of a node that holds it (:meth:`NodeLevel.reader`).

The plans are :mod:`manager.node_copies`'s, the same on every rank.
"""

from __future__ import annotations

import datetime
import logging
import os
import time

import torch.distributed as dist

from dcp_datastates.core.reader import DataStatesReader
from dcp_datastates.errors import CheckpointError
from dcp_datastates.exchange.channel import Channel
from dcp_datastates.exchange.files import FileCopy, copy_files
from dcp_datastates.format.checkpoint_layout import CheckpointLayout
from dcp_datastates.format.file_names import METADATA_FILE
from dcp_datastates.format.metadata_file import decode_metadata
from dcp_datastates.manager.checkpoint_root import is_committed, is_link, step_dir_name, step_dirs
from dcp_datastates.manager.cleanup import delete_checkpoint_dir
from dcp_datastates.manager.node_copies import (
    DURABLE_TAG,
    MEMORY,
    access_of,
    commit_copies,
    holdings,
    restore_copies,
)
from dcp_datastates.manager.nodes import OWN, PARTNER, PARTNER_DIR, NodeMap, node_key, survey_node
from dcp_datastates.storage import commit_checkpoint
from dcp_datastates.storage.local import LocalStore
from dcp_datastates.storage.memory import MemoryStore
from dcp_datastates.storage.routed import RoutedStore

_log = logging.getLogger("dcp_datastates.manager.checkpoint_manager")


def make_channel(ranks, options, desc: str, nodes: NodeMap | None = None) -> Channel | None:
    """A channel of the exchange over the manager's ranks (None: one process). Over the whole
    job every rank makes it; over part of it, only those ranks (a group synchronized locally)."""
    if not ranks.distributed:
        return None
    members = [dist.get_global_rank(ranks.group, r) for r in range(ranks.world)] if ranks.group is not None else None
    whole = members is None or members == list(range(dist.get_world_size()))
    group = dist.new_group(ranks=None if whole else members, backend=options.exchange_backend,
                           timeout=datetime.timedelta(seconds=options.exchange_timeout_s),
                           use_local_synchronization=not whole, group_desc=f"dcp_datastates {desc}")
    channel = Channel(group, backend=options.exchange_backend, timeout_s=options.exchange_timeout_s)
    if nodes is not None:
        channel.with_nodes([nodes.node_of(r) for r in range(ranks.world)])
    return channel


def gather_nodes(ranks) -> NodeMap:
    """Which ranks share a node (every rank's :func:`nodes.node_key`, gathered)."""
    if not ranks.distributed:
        return NodeMap.single(1, 0)
    keys = [None] * ranks.world
    dist.all_gather_object(keys, node_key(), group=ranks.group)
    return NodeMap.of_keys(keys, ranks.rank)


class NodeLevel:
    """A manager's node-local roots and the exchange between them (module docstring)."""

    def __init__(self, root: str, ranks, options) -> None:
        self.root = root
        self.options = options
        self.nodes = gather_nodes(ranks)
        self.ranks = ranks
        self.loads = make_channel(ranks, options, "node-local loads", self.nodes)
        self.commits = make_channel(ranks, options, "node commits", self.nodes)
        self._stores: dict[str, LocalStore] = {}

    def store(self, kind: str = OWN) -> LocalStore:
        """This node's root (``own``) or the partner copies it holds (``partner``), as a store
        (one each: a store starts its engine's threads on its first read)."""
        if kind not in self._stores:
            self._stores[kind] = LocalStore(os.path.join(self.root, PARTNER_DIR) if kind == PARTNER else self.root)
        return self._stores[kind]

    def close(self) -> None:
        for store in self._stores.values():
            store.close()
        self._stores = {}

    # -- the node commit -------------------------------------------------------------

    def commit(self, step: int) -> None:
        """Every rank, once ``step`` committed on rank 0's node: every other node's leader gets
        that ``.metadata`` and writes it next to its node's files. A leader that could not
        raises :class:`CheckpointError` (the next start repairs it)."""
        if self.nodes.count < 2:
            return
        step_dir = step_dir_name(step)
        key = f"{step_dir}/{METADATA_FILE}"
        first = self.nodes.node_of(0)
        size = self.store().size(key) if self.nodes.rank == 0 else None
        size = self.commits.gather(size)[0]
        if size is None:
            raise CheckpointError(f"{self.root}: rank 0 has no {key} to pass on")
        copies = [FileCopy(0, self.nodes.leader(n), key, size, None, True, OWN)
                  for n in range(self.nodes.count) if n != first]
        out = copy_files(self.commits, copies, source=lambda c: (self.store(), c.name),
                         dest=lambda c: (self.store(), c.name))
        for c, o in zip(copies, out):
            if c.dst == self.nodes.rank:
                if not o.ok:
                    raise CheckpointError(f"receiving the commit of step {step} from rank 0: {o.error}")
                commit_checkpoint(self.store(), step_dir, o.data)

    def repair_commits(self) -> None:
        """Every rank, at start, before the leaders' crash cleanup: a step directory of a node
        without ``.metadata`` whose save committed on another node (a crash came between the
        commit and the node commit) gets it now, if it holds every file of the saved ranks it
        holds any of, rather than being removed as never committed."""
        if self.nodes.count < 2 or self.loads is None:
            return
        listing = self._listing() if self.nodes.is_leader else None
        listings = self.loads.gather(listing)
        per_node = [listings[self.nodes.leader(n)] for n in range(self.nodes.count)]
        copies = commit_copies(per_node, self.nodes)
        if not copies:
            return
        out = copy_files(self.loads, copies, source=lambda c: (self.store(), c.name),
                         dest=lambda c: (self.store(), c.name))
        for c, o in zip(copies, out):
            if c.dst == self.nodes.rank and o.ok:
                self._commit_if_whole(c.name, o.data, self.nodes.node_of(c.src))

    def _listing(self) -> tuple[dict[int, int], list[int]]:
        """This node's committed steps (with the size of each ``.metadata``) and uncommitted ones."""
        done, open_ = {}, []
        for step, name in sorted(step_dirs(self.root).items()):
            path = os.path.join(self.root, name)
            if is_committed(path):
                done[step] = os.path.getsize(os.path.join(path, METADATA_FILE))
            elif not is_link(self.root, name):
                open_.append(step)
        return done, open_

    def _commit_if_whole(self, key: str, blob: bytes, source_node: int) -> None:
        step_dir = key.rsplit("/", 1)[0]
        path = os.path.join(self.root, step_dir)
        try:
            metadata, _ = decode_metadata(blob, key, allow_pickle=self.options.allow_pickle)
        except CheckpointError:
            return  # cannot tell: the cleanup removes the directory
        layout = metadata.storage_data
        here = {e.name for e in os.scandir(path) if e.is_file()}
        if not isinstance(layout, CheckpointLayout):
            return
        held = [r for r in layout.own_ranks if any(n in here for n in r.file_names())]
        if held and all(n in here for r in held for n in r.file_names()):
            commit_checkpoint(self.store(), step_dir, blob)
            _log.info("node %d: %s was committed on node %d before this node received its .metadata: committed now",
                      self.nodes.node, path, source_node)

    # -- loads -----------------------------------------------------------------------

    def reports(self) -> list:
        """Every node's report of its root (:func:`nodes.survey_node`, by its leader)."""
        return self.ranks.on_leaders(lambda: survey_node(self.nodes.node, self.root, self.options.allow_pickle),
                                     "surveying its root", self.nodes)

    def restore(self, step: int, plan, reports, tier) -> tuple[str | None, dict, bytes | None, list]:
        """Every rank: the nodes that lost ``step`` get their home files back, ``.metadata`` last
        (:func:`node_copies.restore_copies`). Returns why it failed (None: it did not), what each
        node got back, the ``.metadata`` this rank holds in memory (its node keeps none) and the
        saved ranks' files this rank received (to drain to the durable tier)."""
        restore = restore_copies(plan, step, reports, self.nodes)
        if not restore.copies:
            return None, {}, None, []
        step_dir = step_dir_name(step)
        path = os.path.join(self.root, step_dir)
        if self.nodes.is_leader and self.nodes.node in restore.restored and os.path.isdir(path) and not is_committed(path):
            delete_checkpoint_dir(path)  # what an interrupted save or restore left
        self.loads.gather(None)  # every leader cleared its leftovers before any copy lands there
        t0 = time.perf_counter()

        def source(c: FileCopy):
            store = tier.store if c.tag == DURABLE_TAG else self.store(c.tag)
            return store, f"{step_dir}/{c.name}"

        out = copy_files(self.loads, restore.copies, source=source, dest=lambda c: (self.store(), f"{step_dir}/{c.name}"))
        failed = {}
        for c, o, purpose in zip(restore.copies, out, restore.purpose):
            if not o.ok:
                failed.setdefault(self.nodes.node_of(c.dst), f"{c.name}: {o.error}")
        commit_error = None
        if not failed:
            for c, o, purpose in zip(restore.copies, out, restore.purpose):
                if purpose == "commit" and c.dst == self.nodes.rank:
                    try:
                        commit_checkpoint(self.store(), step_dir, o.data)
                    except Exception as exc:  # noqa: BLE001 - agreed on below
                        commit_error = f"committing the copy: {exc}"
        errors = self.loads.gather(commit_error)
        for r, e in enumerate(errors):
            if e is not None:
                failed.setdefault(self.nodes.node_of(r), e)
        if failed:
            why = "; ".join(f"node {n} could not get its files of step {step} back ({e})" for n, e in sorted(failed.items()))
            return why, {}, None, []
        if self.nodes.is_leader and self.nodes.node in restore.restored:
            self._log_restore(step, restore, time.perf_counter() - t0)
        memory = next((o.data for c, o, p in zip(restore.copies, out, restore.purpose)
                       if p == MEMORY and c.dst == self.nodes.rank), None)
        received = sorted({c.files.rank: c.files for c in restore.copies
                           if c.files is not None and c.dst == self.nodes.rank}.items())
        return None, restore.restored, memory, [f for _r, f in received]

    def _log_restore(self, step: int, restore, seconds: float) -> None:
        node = self.nodes.node
        mine = [c for c in restore.copies if self.nodes.node_of(c.dst) == node and c.name != METADATA_FILE]
        froms = sorted({"the durable tier" if c.tag == DURABLE_TAG else
                        f"node {self.nodes.node_of(c.src)}" + (" (partner copy)" if c.tag == PARTNER else "")
                        for c in mine})
        size = sum(max(c.size, 0) for c in mine)
        _log.info("node %d: copied back its %d files of step %d (%d bytes%s) from %s in %.3f s", node, len(mine), step,
                  size, ", and those read from the durable tier" if any(c.size < 0 for c in mine) else "",
                  ", ".join(froms), seconds)

    def reader(self, step: int, plan, reports, restored: dict, memory: bytes | None, tier) -> DataStatesReader:
        """A reader of ``step`` for this rank: every file its node holds read where it is, the
        durable tier's where no node holds it, the rest read once by a rank of a node that does."""
        held = holdings(plan, step, reports, self.nodes.count, restored)
        mine = held[self.nodes.node]
        step_dir = step_dir_name(step)
        routes, elsewhere = {}, {}
        for name, where in mine.items():
            key = f"{step_dir}/{name}"
            if where == MEMORY:
                if memory is not None:
                    routes[key] = MemoryStore({key: memory}, os.path.join(self.root, step_dir) + " (received)")
            else:
                routes[key] = tier.store if where == DURABLE_TAG else self.store(where)
        for src, copy in plan.copies.get(step, []):
            for name, size in copy.files.items():
                elsewhere.setdefault(f"{step_dir}/{name}", size)
        store = RoutedStore(routes, self.root, elsewhere)  # its keys are step_<N>/<file>, under the root
        opts = self.options
        return DataStatesReader(step_dir, store=store, allow_pickle=opts.allow_pickle, exchange=self.loads,
                                access=access_of(held, self.nodes, step), exchange_timeout_s=opts.exchange_timeout_s,
                                exchange_backend=opts.exchange_backend)

    def check_assignment(self, plan, step: int, reports, restored: dict, layout) -> list:
        """The saved ranks whose index this rank checks before the load: each index by one of the
        ranks whose node can read it (round those ranks), every index once."""
        held = holdings(plan, step, reports, self.nodes.count, restored)
        world = sum(len(m) for m in self.nodes.members)
        out = []
        for j, files in enumerate(layout.ranks):
            able = [r for r in range(world) if files.index_file in held[self.nodes.node_of(r)]]
            if able and able[j % len(able)] == self.nodes.rank:
                out.append(files)
        return out
