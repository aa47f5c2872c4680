"""The partner level: each node's files of every committed step copied to the next node's root.

After a step commits (on its node too: the node commit), every rank of every node hands the
step to :class:`PartnerTier`, whose one background thread per rank copies it, the same jobs
in the same order on every rank, over a channel of its own (:mod:`exchange`):

1. the leader of each partner node clears what an earlier copy of that step left in its
   ``ROOT/.partner/step_<N>/``; every rank says what it sends (its files and their sizes;
   each node's leader also its ``.metadata``): a gather, which is also the barrier after
   the clearing;
2. the files go to the partner node's ranks (:func:`node_copies.partner_copies`), each
   message checked against the rank index's segments as it is read and again on arrival,
   each file renamed into place once whole (:func:`exchange.files.copy_files`), paced away
   from saves (:mod:`tiers.drain_pacing`);
3. the partner's leader commits the copy of a node whose every file arrived intact
   (``.metadata`` last), removes it otherwise, and keeps ``keep_last`` copies; the leaders'
   verdicts are gathered, so every rank learns whether its node's copy committed.

A peer that dies, or does not answer within the exchange's timeout, fails the copy on every
rank (nothing half-copied is committed: a copy without ``.metadata`` is cleared at the next
start) and breaks the channel: the copies after it fail at once, and the next start makes
the copies the partner lacks (:meth:`PartnerTier.redo`). Training is never held by it.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import threading
import time

from dcp_datastates.core.reader import DataStatesReader
from dcp_datastates.errors import CheckpointError
from dcp_datastates.exchange.files import copy_files
from dcp_datastates.format.checkpoint_layout import RankFiles
from dcp_datastates.format.file_names import METADATA_FILE
from dcp_datastates.manager.checkpoint_root import step_dir_name, step_dirs
from dcp_datastates.tiers.drain_pacing import DrainPacer
from dcp_datastates.manager.node_copies import Share, partner_copies
from dcp_datastates.manager.node_level import make_channel
from dcp_datastates.manager.nodes import OWN, PARTNER, PARTNER_DIR
from dcp_datastates.manager.retention import RetentionPolicy
from dcp_datastates.tiers.copy_queue import DRAINING, DURABLE, FAILED, CopyQueue, DrainStatus, lower_priority
from dcp_datastates.tiers.drain import DrainError
from dcp_datastates.storage import commit_checkpoint, is_committed

_log = logging.getLogger(__name__)


@dataclasses.dataclass
class _Job:
    step: int
    path: str  # the step's directory in this node's root
    files: RankFiles | None  # this rank's own files (a copy after a save), or None: its node's share (a redo)
    nodes: frozenset | None = None  # the nodes whose files to copy (None: every node)


class PartnerTier(CopyQueue):
    """The partner level's background copies (module docstring), with the durable tier's face:
    ``enqueue``, ``status``, ``wait``, ``close``, ``set_paused``, ``save_started``."""

    def __init__(self, node_level, ranks, options, *, warn, on_copied) -> None:
        super().__init__()
        self.level = node_level
        self.nodes = node_level.nodes
        partner = self.nodes.partner(self.nodes.node)
        # The sender names the partner, not a path: the partner's root is its own to say (its commit
        # is logged there with the folder).
        self.url = f"node {partner}'s {PARTNER_DIR} folder"
        self.retention = RetentionPolicy(options.partner_keep_last)
        self.channel = make_channel(ranks, options, "partner copies", self.nodes)
        self._warn, self._on_copied = warn, on_copied
        self._pacer = DrainPacer()
        self._jobs: queue.Queue[_Job | None] = queue.Queue()
        self._failed: set[int] = set()
        self._thread: threading.Thread | None = None
        self._closed = False

    # -- the durable tier's face -----------------------------------------------------

    def set_paused(self, paused: bool) -> None:
        self._pacer.set_saving(paused)

    def save_started(self) -> None:
        self._pacer.save_started()

    def enqueue(self, step: int, path: str, files: RankFiles) -> None:
        """Every rank, once ``step`` committed on every node: copy it (this rank: ``files``)."""
        self._put(_Job(step, path, files))

    def redo(self, step: int, path: str, nodes: frozenset) -> None:
        """Every rank, at start: copy the files of ``nodes`` of ``step``, which their partners lack."""
        self._put(_Job(step, path, None, nodes))

    def _put(self, job: _Job) -> None:
        with self._lock:
            if self._closed:
                raise CheckpointError("the partner level is closed")
            self._queued(job.step)
            self._jobs.put(job)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="dcp_datastates-partner", daemon=True)
                self._thread.start()

    def close(self, timeout: float | None = None) -> None:
        """Wait for the copies (up to ``timeout``), stop the thread; raise a failure not raised yet,
        or a :class:`DrainError` naming the steps whose copy did not commit."""
        try:
            try:
                self.wait(timeout)
            except TimeoutError:
                raise DrainError(f"copies to {self.url} were still running when close() stopped waiting after "
                                 f"{timeout} s; the steps stay on this node only") from None
            if self._failed:
                raise DrainError(f"steps {sorted(self._failed)} were not copied to {self.url} (see the warnings); "
                                 "the next start copies what the partner lacks")
        finally:
            with self._lock:
                self._closed = True
                thread, self._thread = self._thread, None
                self._jobs.put(None)
            if thread is not None:
                thread.join(timeout)

    # -- the copies ------------------------------------------------------------------

    def _run(self) -> None:
        lower_priority()
        while True:
            job = self._jobs.get()
            if job is None:
                return
            st = self._status[job.step]
            st.state, t0 = DRAINING, time.perf_counter()
            try:
                copied = self._copy(job, st)
                st.state, st.error = DURABLE, None
                with self._lock:
                    self._failed.discard(job.step)
                if copied:
                    _log.info("step %d: node %d's files copied to %s (%d bytes) in %.3f s", job.step, self.nodes.node,
                              self.url, st.bytes_done, time.perf_counter() - t0)
                if self.nodes.is_leader:
                    self._on_copied(job.step, None)
            except Exception as exc:  # noqa: BLE001 - reported; the next start copies it again
                st.state, st.error = FAILED, f"{type(exc).__name__}: {exc}"
                err = DrainError(f"step {job.step}: copying node {self.nodes.node}'s files to {self.url} failed: {st.error}")
                err.__cause__ = exc
                with self._lock:
                    self._failed.add(job.step)
                    self._unreported.append(err)
                self._warn(f"{err}; the step is kept on this node, and the next start copies it again")
            finally:
                st.seconds = time.perf_counter() - t0
                self._ended()

    def _copy(self, job: _Job, st: DrainStatus) -> bool:
        """One step's copy on this rank (module docstring, steps 1-3); True when this rank's node
        was copied (a redo may copy other nodes only). Raises if this node's copy did not commit."""
        nodes, me = self.nodes, self.nodes.rank
        step_dir = step_dir_name(job.step)
        senders = set(range(nodes.count)) if job.nodes is None else set(job.nodes)
        origin = (nodes.node - 1) % nodes.count  # the node whose copies this node keeps
        if nodes.is_leader and origin in senders:
            self.level.store(PARTNER).delete_checkpoint(step_dir)  # an earlier copy of the step, whole or not
        share = self._share(job) if nodes.node in senders else None
        shares = self.channel.gather(share)
        copies, commits = partner_copies(shares, nodes)
        st.bytes_total = sum(c.size for c in copies if c.src == me)
        out = copy_files(self.channel, copies, source=lambda c: (self.level.store(OWN), f"{step_dir}/{c.name}"),
                         dest=lambda c: (self.level.store(PARTNER), f"{step_dir}/{c.name}"),
                         pace=self._pacer.wait_for_gap)
        st.bytes_done = st.bytes_total
        verdict = None
        for n, (_p, leader) in commits.items():
            if leader != me:
                continue
            bad = [f"{c.name}: {o.error}" for c, o in zip(copies, out) if nodes.node_of(c.src) == n and not o.ok]
            verdict = self._commit(job.step, n, bad, next(o.data for c, o in zip(copies, out)
                                                       if c.hold and nodes.node_of(c.src) == n and o.ok) if not bad else None)
        verdicts = self.channel.gather(verdict)
        if nodes.node not in senders:
            return False
        mine = commits.get(nodes.node)
        if mine is None:
            raise DrainError(f"node {nodes.node} sent no .metadata of step {job.step}")
        if verdicts[mine[1]] is not None:
            raise DrainError(verdicts[mine[1]])
        return True

    def _share(self, job: _Job) -> Share:
        """What this rank sends: its own files after a save; at a redo, its part of its node's files."""
        if job.files is not None:
            ranks = [job.files]
        else:
            reader = DataStatesReader(job.path)
            reader.load_metadata()
            here = set(os.listdir(job.path))
            whole = [f for f in reader.require_layout().own_ranks if all(n in here for n in f.file_names())]
            members = self.nodes.members[self.nodes.node]
            ranks = [f for j, f in enumerate(whole) if members[j % len(members)] == self.nodes.rank]
        files = tuple((f, tuple((n, os.path.getsize(os.path.join(job.path, n))) for n in f.file_names())) for f in ranks)
        meta = os.path.getsize(os.path.join(job.path, METADATA_FILE)) if self.nodes.is_leader else None
        return Share(self.nodes.node, files, meta)

    def _commit(self, step: int, origin: int, bad: list[str], blob: bytes | None) -> str | None:
        """The partner's leader: commit the copy of node ``origin``'s files if all arrived
        (``.metadata`` last), apply ``keep_last``; else clear it. Returns why it is not committed
        (None: it is)."""
        store = self.level.store(PARTNER)
        step_dir = step_dir_name(step)
        if bad:
            store.delete_checkpoint(step_dir)
            return f"the copy of step {step} on node {self.nodes.node} is refused: {'; '.join(bad[:3])}"
        try:
            commit_checkpoint(store, step_dir, blob)
            root = os.path.join(self.level.root, PARTNER_DIR)
            _log.info("step %d: the partner copy of node %d's files is committed in %s", step, origin,
                      os.path.join(root, step_dir))
            present = sorted(s for s, n in step_dirs(root).items() if is_committed(store, n))
            for s in self.retention.victims(step, present, lambda _s: set()):
                store.delete_checkpoint(step_dir_name(s))
                _log.info("partner retention: deleted step %d from %s", s, root)
        except Exception as exc:  # noqa: BLE001 - told to the node whose copy it is
            return f"committing the copy of step {step} on node {self.nodes.node}: {exc}"
        return None

    def clear_incomplete(self) -> None:
        """This node's leader, at start: the partner copies an interrupted copy left uncommitted."""
        root = os.path.join(self.level.root, PARTNER_DIR)
        store = self.level.store(PARTNER)
        store.sweep_partials()
        for s, n in step_dirs(root).items():
            if not is_committed(store, n):
                store.delete_checkpoint(n)
