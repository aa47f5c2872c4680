"""The manager's loads: which checkpoints a load tries (:mod:`resume`'s pure plans), and each
try, from the local root, the durable tier (in place, or fetched first) or the nodes' roots.

Every rank tries the same candidates in the same order and agrees on each verdict
(:meth:`Ranks.agree`): ``None`` (loaded), ``(why, the files are bad)`` (the next candidate is
tried), or a :class:`collective.Raise` (raised on every rank)."""

from __future__ import annotations

import os
import time

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from dcp_datastates.core.reader import DataStatesReader
from dcp_datastates.errors import CorruptCheckpointError
from dcp_datastates.format.file_names import METADATA_FILE
from dcp_datastates.format.metadata_file import read_commit_sequence
from dcp_datastates.manager.checkpoint_root import is_committed
from dcp_datastates.manager.cleanup import delete_checkpoint_dir
from dcp_datastates.manager.collective import Raise, classify, describe, unwrap
from dcp_datastates.manager.huggingface_init import load_from_huggingface
from dcp_datastates.manager.manager_state import ManagerState
from dcp_datastates.manager.nodes import plan_node_load
from dcp_datastates.manager.reporting import log, warn_manager, warn_skipped
from dcp_datastates.manager.resume import LoadPlan, plan_load, plan_node_resume
from dcp_datastates.manager.survey import list_checkpoints
from dcp_datastates.storage import StoreError
from dcp_datastates.tiers.drain import DrainError


class Loads:
    def __init__(self, state: ManagerState) -> None:
        self.state = state
        self.initialized_from: str | None = None  # the Hugging Face directory a load on a fresh root filled the model from

    def load(self, state: dict, step: int | None, full_verify: bool) -> int | None:
        """:meth:`CheckpointManager.load` (after the saves in flight ended)."""
        st = self.state
        t0 = time.perf_counter()
        listing = st.ranks.on_rank0(
            lambda: list_checkpoints(st.root, st.tier, st.rollbacks, warn_manager), "listing the checkpoints"
        )
        tier_url = st.tier.url if st.tier is not None else None
        if st.node_level is not None:
            if full_verify:
                raise ValueError("full_verify=True reads every byte on rank 0, which node-local roots do not allow: "
                                 "verify each node's root with `dcp-datastates verify ROOT` there")
            plan, attempt, committed = self._plan_nodes(listing, state, step)
        else:
            plan = plan_load(listing, step, st.root, tier_url)
            committed = listing.order.candidates

            def attempt(s: int):
                return self._load_candidate(state, s, s in plan.local, s in listing.durable_same, full_verify)
        for message in plan.warnings:  # said where the user called CheckpointManager.load
            warn_skipped(message, stacklevel=4)
        if plan.error is not None:
            raise plan.error
        refused: list[str] = []
        for s in plan.candidates:
            verdict = attempt(s)
            if verdict is None:
                self._loaded(s, step, plan, committed, t0)
                return s
            why, bad_files = verdict
            if step is not None:
                raise CorruptCheckpointError(f"cannot load step {s}: {why}")
            refused.append(f"step {s}: {why}")
            if bad_files:
                st.replaceable.add(s)
            warn_skipped(f"skipping the checkpoint of step {s} ({st.path_of(s)}): {why}; trying an older one", stacklevel=4)
        if not plan.candidates:
            if st.options.init_from_huggingface is not None:
                return self._initialize(state)
            why = ("did not exist before this run" if st.root_created
                   else "holds no committed checkpoint" + (f" (nor does {tier_url})" if tier_url else ""))
            log.info("resume: %s %s: starting from scratch", st.root, why)
            return None
        raise CorruptCheckpointError(
            f"no checkpoint under {st.root} could be loaded:\n  " + "\n  ".join(refused)
            + (f"\nand {plan.unanswered}" if plan.unanswered else "")
        )

    def _loaded(self, s: int, step: int | None, plan: LoadPlan, committed: list[int], t0: float) -> None:
        """The state holds step ``s``: the committed steps after it may be replaced, and, older than
        the newest step known, the next save continues a rollback and records it in the pointer
        (the last load decides)."""
        st = self.state
        st.replaceable.update(c for c in committed if c > s)
        newest = plan.newest_known
        st.rolled_back_to = (s, newest) if newest is not None and s < newest else None
        if st.options.incremental:
            st.bases.loaded(s)  # every byte was checked: the next save may refer to it
        where = st.path_of(s) if s in plan.local else f"its durable copy on {st.tier.url}"
        log.info("%s step %d from %s in %.3f s%s", "resumed from" if step is None else "loaded", s, where,
                 time.perf_counter() - t0, f" (newest known: step {newest})" if newest is not None and s != newest else "")

    def _initialize(self, state: dict) -> int:
        """A root without checkpoints: fill the model part of ``state`` from the Hugging Face
        directory ``init_from_huggingface`` names (docs/huggingface.md); step 0."""
        st = self.state
        source, part = os.fspath(st.options.init_from_huggingface), st.options.init_prefix
        if part not in state:
            raise KeyError(f"the state has no {part!r} entry to load {source} into (init_prefix); its keys: {list(state)}")
        load_from_huggingface(state[part], source, **st.ranks.dcp_kwargs())
        log.info("resume: %s holds no committed checkpoint: %r initialized from %s", st.root, part, source)
        self.initialized_from = source
        return 0

    # -- one root and the durable tier -----------------------------------------------

    def _load_candidate(self, state: dict, step: int, local: bool, durable_same: bool, full_verify: bool):
        """Try one candidate: a step on the durable tier only, or a bad local copy whose durable
        copy is the same save, is loaded from the tier (in place, or fetched into the root first
        with ``durable_resume="fetch"``)."""
        st = self.state
        fetch = st.options.durable_resume == "fetch"
        if local:
            verdict = self._load(state, step, full_verify)
            if verdict is None or not verdict[1] or not durable_same:
                return verdict
            # The local copy is bad; a durable copy of the same save committed: load that
            # (after replacing the local copy with it, when fetching).
            warn_skipped(f"the local copy of step {step} ({st.path_of(step)}) is bad ({verdict[0]}); loading its durable copy")
        if not fetch:
            verdict = self._load(state, step, full_verify, durable=True)
            if local:
                st.replaceable.add(step)  # a save of this step replaces the bad local copy
            return verdict
        verdict = self._fetch_durable(step, replace_bad=local)
        return self._load(state, step, full_verify) if verdict is None else verdict

    def _fetch_durable(self, step: int, replace_bad: bool):
        """Copy ``step`` from the durable tier into the local root (rank 0; then any rank that
        does not see it, such as one with a node-local root).

        Later saves are numbered after the fetched step's commit sequence (a new node starts
        counting at 0: a restart would otherwise take the fetched step for newer than the saves
        made after it). Only the root's owner fetches: another manager (an evaluation job)
        never writes into it."""
        st = self.state
        path, agree, url = st.path_of(step), st.ranks.agree, st.tier.url
        if not st.owner:
            return agree((f"only on {url}, and this manager does not own {st.root}", False))

        def fetch():
            if replace_bad:
                delete_checkpoint_dir(path)
            try:
                st.tier.fetch(step, path)
            except StoreError as exc:  # the store did not answer: every rank raises it (below)
                return None, describe(exc)
            return read_commit_sequence(os.path.join(path, METADATA_FILE)) or 0, None

        try:
            seq, unanswered = st.ranks.on_rank0(fetch, f"fetching step {step} from {url}")
        except BaseException as exc:  # noqa: BLE001 - classified like a load's failure
            return agree((f"fetching it from {url} failed: {describe(exc)}", False))
        if unanswered is not None:
            # Raised, as for a load in place: falling back to an older step would hide it.
            return agree(Raise(f"fetching step {step} from {url}: {unanswered}"))
        try:
            st.saw_sequence(seq)
            if st.rank != 0 and not is_committed(path):
                try:
                    st.tier.fetch(step, path)
                except DrainError:
                    if not is_committed(path):  # a peer on this node fetched it meanwhile: fine
                        raise
            verdict = None
        except BaseException as exc:  # noqa: BLE001 - classified like a load's failure
            if isinstance(exc, StoreError):  # another rank's own fetch: the store did not answer
                verdict = Raise(f"fetching step {step} from {url}: {describe(exc)}")
            else:
                verdict = (f"fetching it from {url} failed: {describe(exc)}", False)
        return agree(verdict)

    def _load(self, state: dict, step: int, full_verify: bool, durable: bool = False):
        """Load ``step``, its local copy or its durable one, in place. One reader: its .metadata is
        decoded once for the check, the verification and the load. A durable copy is read where
        it is (what each rank's shards need; nothing is written locally, so a manager that does
        not own the root may do it too), and later saves are numbered after its commit sequence."""
        st = self.state
        allow_pickle = st.options.allow_pickle
        try:  # a reader finds a missing .metadata when it is made: classified and agreed on, as the check's
            reader = (st.tier.reader(step, allow_pickle, **self._read_options()) if durable
                      else DataStatesReader(st.path_of(step), allow_pickle=allow_pickle, **self._read_options()))
        except BaseException as exc:  # noqa: BLE001 - classified; unknown errors travel to every rank
            reader, verdict = None, classify(exc)
        else:
            verdict = self._check(reader, full_verify)
        verdict = st.ranks.agree(verdict)
        verdict = self._try_load(state, reader) if verdict is None else verdict
        if verdict is None and durable:
            st.saw_sequence(reader.commit_sequence)
        return verdict

    def _read_options(self) -> dict:
        """How this manager's readers take part in read-once loads (:mod:`exchange.reads`)."""
        opts = self.state.options
        return {"exchange_timeout_s": opts.exchange_timeout_s, "exchange_backend": opts.exchange_backend}

    def _check(self, reader: DataStatesReader, full_verify: bool, files=None) -> tuple[str, bool] | None:
        """Why the reader's checkpoint cannot be loaded (and whether its files are bad), found
        without reading tensor data, or None. Each rank checks every W-th rank index (or the
        ranks ``files`` names); with ``full_verify`` rank 0 reads every byte."""
        st = self.state
        try:
            if full_verify and st.rank == 0:
                from dcp_datastates.core.verify import verify

                report = verify(reader.path, reader=reader)
                if not report.ok:
                    return "; ".join(report.problems[:3]) or "not committed", True
            reader.load_metadata()
            if files is None:
                files = reader.require_layout().ranks[st.rank::st.ranks.world]  # base ranks too (format 8)
            for f in files:
                reader.rank_index(f.data_path)
        except BaseException as exc:  # noqa: BLE001 - classified; unknown errors travel to every rank
            return classify(exc)
        return None

    def _try_load(self, state: dict, reader: DataStatesReader) -> tuple[str, bool] | None:
        try:
            dcp.load(state, storage_reader=reader, checkpoint_id=reader.path, **self.state.ranks.dcp_kwargs())
        except (Exception, CheckpointException) as exc:  # noqa: BLE001 - DCP fails every rank alike
            inner = unwrap(exc)
            verdict = classify(inner)
            if isinstance(verdict, Raise):
                if inner is exc:
                    raise
                raise inner from exc
            return verdict
        return None

    # -- node-local roots ----------------------------------------------------------

    def _plan_nodes(self, listing, state: dict, step: int | None):
        """A node-local load's plan (every leader's report of its root gathered, so that every
        rank tries the same steps: :func:`resume.plan_node_resume`), and how each is tried."""
        st = self.state
        reports = st.node_level.reports()
        held = sorted({s for r in reports for s in (*r.own, *r.partner)} & set(listing.durable))
        stamps = st.ranks.on_rank0(lambda: st.tier.commit_stamps(held) if held else {},
                                   f"reading which saves {st.tier.url} holds") if st.tier is not None else {}
        nodes = plan_node_load(reports, listing.durable, listing.given_up, step, stamps)
        plan = plan_node_resume(listing, nodes, reports, step, st.root, st.tier.url if st.tier is not None else None)
        committed = sorted(s for s in nodes.copies if not any(s in r.abandoned for r in reports))
        return plan, lambda s: self._load_from_nodes(state, s, nodes, reports), committed

    def _load_from_nodes(self, state: dict, step: int, plan, reports):
        """Load ``step`` from the nodes' roots: the nodes that lost their files of it get them back
        first (from the partner copy, another node or the durable tier), then every rank reads
        each file its node holds where it is and receives the rest from a rank of a node that
        holds it (read once)."""
        st = self.state
        if step not in plan.copies:  # no node holds it (every root lost): the durable copy, in place
            return self._load(state, step, False, durable=True)
        level = st.node_level
        try:
            why, restored, memory, received = level.restore(step, plan, reports, st.tier)
            verdict = None if why is None else (why, False)
        except BaseException as exc:  # noqa: BLE001 - classified like a load's failure
            verdict, restored, memory, received = classify(exc), {}, None, []
            if not isinstance(verdict, Raise):
                verdict = (f"node {st.nodes.node} could not get its files back: {verdict[0]}", False)
        verdict = st.ranks.agree(verdict)  # also: every node's files are back before any rank reads
        if verdict is not None:
            return verdict
        try:
            reader = level.reader(step, plan, reports, restored, memory, st.tier)
            reader.load_metadata()
            mine = level.check_assignment(plan, step, reports, restored, reader.require_layout())
        except BaseException as exc:  # noqa: BLE001 - classified, and agreed on below
            verdict, mine = classify(exc), None
        if mine is not None:
            verdict = self._check(reader, False, mine)
        verdict = st.ranks.agree(verdict)
        verdict = self._try_load(state, reader) if verdict is None else verdict
        if verdict is None:
            st.saw_sequence(reader.commit_sequence)
            if received and st.tier is not None and step in st.undrained_run:
                for files in received:  # the part of a copy the durable tier still waits for, now here
                    st.tier.enqueue(step, st.path_of(step), files)
        return verdict
