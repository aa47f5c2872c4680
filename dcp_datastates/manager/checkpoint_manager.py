"""``CheckpointManager``: step-numbered checkpoints of a run, retention, and resume.

What torchtitan's, Lightning's and Orbax's checkpoint managers do, on top of
``DataStatesWriter``/``DataStatesReader``; docs/manager.md states its rules and
options. This module orchestrates; each decision is taken in one place:

* the root's names, its ``latest`` pointer and resume order: :mod:`checkpoint_root`;
* every deletion (crash leftovers, retention's) and the owner's lock: :mod:`cleanup`;
* what retention deletes, on every tier: :mod:`retention`;
* which checkpoints a load tries, in which order: :mod:`resume`;
* the base of an incremental save, and what each step refers to: :mod:`base_choice`;
* what rank 0 finds in the root and on the durable tier: :mod:`survey`;
* how the ranks agree (rank 0 decides, verdicts are combined): :mod:`collective`;
* the copies to the durable tier: :mod:`durable_tier`.

Distributed: every rank constructs the manager and calls :meth:`save` and
:meth:`load` with its part of the state (SPMD, like ``dcp.save``); rank 0 of
the group alone touches the pointer, retention and cleanup.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
import warnings
import weakref
from concurrent.futures import Future
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from dcp_datastates.core.async_save.fence import install_global_fence
from dcp_datastates.core.reader import DataStatesReader
from dcp_datastates.core.writer import DataStatesWriter
from dcp_datastates.errors import CheckpointError, CheckpointExistsError, CorruptCheckpointError
from dcp_datastates.format.file_names import METADATA_FILE
from dcp_datastates.format.metadata_file import CommitStamp, read_commit_sequence, read_commit_stamp
from dcp_datastates.manager.base_choice import BaseChoice
from dcp_datastates.manager.checkpoint_root import (
    LATEST_FILE,
    is_committed,
    is_link,
    newest_sequence,
    point_latest_at,
    read_pointer_if_valid,
    resume_order,
    step_dir_name,
    step_dirs,
    step_of,
)
from dcp_datastates.manager.cleanup import LOCK_FILE, delete_checkpoint_dir, lock_root, recover_root, unlock_root
from dcp_datastates.manager.collective import Raise, Ranks, classify, describe
from dcp_datastates.manager.durable_tier import DRAINING, QUEUED, DrainStatus, DurableTier
from dcp_datastates.manager.huggingface_init import load_from_huggingface
from dcp_datastates.manager.node_copies import missing_partner_copies
from dcp_datastates.manager.node_level import NodeLevel
from dcp_datastates.manager.nodes import NodeMap, plan_node_load
from dcp_datastates.manager.options import CheckpointManagerOptions
from dcp_datastates.manager.partner_tier import PartnerTier
from dcp_datastates.manager.resume import plan_load
from dcp_datastates.manager.retention import RetentionPolicy
from dcp_datastates.manager.survey import list_checkpoints, survey_tier
from dcp_datastates.storage import StoreError
from dcp_datastates.storage.url import refuse_url
from dcp_datastates.tiers.drain import DrainError


class CheckpointManagerWarning(UserWarning):
    """Something the manager did or could not do that the run should know about."""


class SkippedCheckpointWarning(CheckpointManagerWarning):
    """A checkpoint was passed over on resume (incomplete, corrupt, abandoned) or removed as a crash leftover."""


class ManagedSave(Future):
    """The future :meth:`CheckpointManager.save` returns, with the step, its directory and,
    once done, the writer's :class:`SaveStats` (``last_save_stats``). It cannot be cancelled:
    the save runs to its end either way."""

    def __init__(self, step: int, path: str, writer: DataStatesWriter) -> None:
        super().__init__()
        self.set_running_or_notify_cancel()
        self.step = step
        self.path = path
        self._writer = writer

    @property
    def last_save_stats(self):
        return self._writer.last_save_stats


@dataclasses.dataclass
class _PendingSave:
    step: int
    path: str
    seq: int
    writer: DataStatesWriter
    done: ManagedSave  # completes after the pointer and retention (rank 0) or the upload (others)
    base: str | None = None  # the base checkpoint of an incremental save (None: a full save)
    upload: Any = None  # DCP's upload future, once dcp.async_save returned


class CheckpointManager:
    """Step-numbered checkpoints under ``root`` with retention, an atomic pointer and resume.

    ``options``: a :class:`CheckpointManagerOptions` (None: the defaults; each option is
    described in README, "Options"). ``process_group``: the group DCP saves and loads on (an
    object, not a setting; by default, with asynchronous saves in a distributed run, a new
    gloo group, so the background save's collectives never interleave with training's).

    One manager owns a root at a time: rank 0 holds an exclusive lock on
    ``root/.manager.lock`` until :meth:`close`. Another manager opened on the
    same root meanwhile (an evaluation job, a notebook) may load, but does not
    clean up, move the pointer or delete anything, and refuses to save, so it
    can never remove a checkpoint the owner is writing.
    """

    def __init__(
        self, root: str | os.PathLike, options: CheckpointManagerOptions | None = None, *, process_group: Any = None,
        **settings: Any,
    ) -> None:
        if settings:  # the settings of older releases, now the options object's fields
            named = ", ".join(f"{k}=..." for k in settings)
            raise TypeError(f"CheckpointManager takes its settings as an options object: "
                            f"CheckpointManager(root, CheckpointManagerOptions({named})) (docs/manager.md)")
        self.options = opts = options if options is not None else CheckpointManagerOptions()
        if not isinstance(opts, CheckpointManagerOptions):
            raise TypeError(f"options must be a CheckpointManagerOptions, got {type(opts).__name__}")
        refuse_url(root, "CheckpointManager", "Give it a local directory, and the object storage as its durable "
                   "tier: CheckpointManager(local_root, CheckpointManagerOptions(durable=URL)) (docs/tiers.md).")
        self.root = os.path.abspath(os.fspath(root))
        self._ranks = Ranks(self.root, process_group, opts.async_save, opts.incremental)
        self._rank = self._ranks.rank
        # Which ranks share a root: all of them, or (node_local) each node's; each root's leader keeps it.
        self._nodes = NodeMap.single(self._ranks.world, self._rank)
        self._node_level: NodeLevel | None = None  # node_local: the roots' nodes and the exchange between them
        self._partner: PartnerTier | None = None  # partner=True: copies of this node's files on the next node
        self._undrained_run: set[int] = set()  # node_local with a durable tier: the run's steps to drain there
        self._retention = RetentionPolicy(opts.keep_last, opts.keep_every)
        self._lock = threading.Lock()
        self._pending: list[_PendingSave] = []
        self._replaceable: set[int] = set()  # committed steps a save may overwrite (skipped as bad)
        self._closed = False
        self._lock_fd: int | None = None  # rank 0's hold on root/.manager.lock (cleanup.lock_root)
        self._fence_handle = None  # this manager's hold on the process-wide fence, from its first async save
        # What each step refers to is read whatever this manager does (a root may hold incremental
        # steps of an earlier run): retention never deletes a base a remaining step needs.
        self._bases = BaseChoice(self.root, opts.full_every)
        self._reserved_bases: set[str] = set()  # rank 0: bases chosen for saves not registered yet
        self._tier: DurableTier | None = None
        # Steps whose local copy needs no more from the durable tier, with the save they are
        # ({step: CommitStamp}): its own save is committed there, or the tier's retention would
        # not keep it. Local retention deletes a step only then (unless delete_undrained).
        self._settled: dict[int, CommitStamp] = {}
        self._retention_anchor: int | None = None  # the step of the last commit (retention counts from it)
        # The run's rollbacks, (step resumed from, sequence of the first save after it): recorded
        # in the pointer, on every tier (checkpoint_root.given_up). Rank 0's.
        self._rollbacks: set[tuple[int, int]] = set()
        self._rolled_back_to: tuple[int, int] | None = None  # (step loaded, newest known) of a load of an older step
        self.initialized_from: str | None = None  # the Hugging Face directory a load on a fresh root filled the model from
        # The drain thread's local retention and close() giving the root up, one at a time.
        self._root_lock = threading.Lock()
        self._root_released = False

        def start() -> tuple[bool, int, tuple, bool]:
            created = not os.path.isdir(self.root)
            os.makedirs(self.root, exist_ok=True)
            if self._take_ownership() and opts.cleanup:
                recover_root(self.root, opts.allow_pickle, _warn)
            pointer = read_pointer_if_valid(self.root)  # the run's rollbacks on record
            return self._lock_fd is not None, newest_sequence(self.root), pointer.rollbacks if pointer else (), created

        try:
            if opts.node_local:
                self._node_level = NodeLevel(self.root, self._ranks, opts)
                self._nodes = self._node_level.nodes
                self._node_level.repair_commits()  # before the leaders' crash cleanup could take those steps
                found = self._ranks.on_leaders(start, "opening its checkpoint root", self._nodes)
                self.owner = all(f[0] for f in found)
                newest = max(f[1] for f in found)
                rollbacks = tuple(r for f in found for r in f[2])
                self._root_created = all(f[3] for f in found)
            else:
                self.owner, newest, rollbacks, self._root_created = self._ranks.on_rank0(start, "opening the checkpoint root")
            # Commits are numbered from the newest one in the root (every rank gets rank 0's
            # number, so every rank hands its writer the same sequence for the same save).
            self._seq = self._pointed_seq = newest
            self._rollbacks.update(rollbacks)
            if opts.durable is not None:
                self._open_durable_tier()
            if opts.partner:
                self._open_partner_tier()
        except BaseException:
            # Nothing of a manager that failed to start may outlive it: a retry in this process
            # must find the root free (its lock) and no drain thread running.
            self._closed = True
            for tier in (self._tier, self._partner):
                try:
                    if tier is not None:
                        tier.close(0)
                except Exception:  # noqa: BLE001 - the error that stopped the start is the one to raise
                    pass
            self._release()
            raise

    # -- public API -------------------------------------------------------------

    def steps(self) -> list[int]:
        """The steps of every committed checkpoint under ``root``, ascending (this rank's view)."""
        return sorted(step for step, name in step_dirs(self.root).items() if is_committed(os.path.join(self.root, name)))

    def latest(self) -> int | None:
        """The step a resume tries first: the newest commit (normally what ``root/latest`` names),
        or None. Not verified: :meth:`load` skips it if it turns out bad."""
        order = resume_order(self.root)
        return order.candidates[0] if order.candidates else None

    def path_of(self, step: int) -> str:
        return os.path.join(self.root, step_dir_name(step))

    def save(self, step: int, state: dict, *, overwrite: bool = False) -> ManagedSave:
        """Checkpoint ``state`` as step ``step``; returns a future of its completion.

        Asynchronous (the default): returns once the snapshot is enqueued; the
        future completes when the checkpoint is committed and (rank 0) the
        pointer and retention are done. Synchronous: returns after all that,
        with the future already done. A step that already has a committed
        checkpoint is refused unless ``overwrite`` (or the checkpoint was
        skipped as corrupt, or abandoned by a resume from an older step); an
        overwrite is crash-safe.
        """
        if self._closed:
            raise RuntimeError("CheckpointManager is closed")
        if not self.owner:
            raise CheckpointError(
                f"another CheckpointManager owns {self.root} (it holds {os.path.join(self.root, LOCK_FILE)}); "
                "this one may load but not save: two managers saving into one root would delete each other's checkpoints"
            )
        self._raise_finished_errors()
        for tier in (self._tier, self._partner):
            if tier is not None:
                tier.save_started()
        path = self.path_of(step)
        committed = is_committed(path)
        # resume_order lists and stats the root: only asked when the step is committed already
        replace = overwrite or step in self._replaceable or (committed and step in resume_order(self.root).abandoned)
        if not replace and committed:
            raise CheckpointExistsError(
                f"{path} already holds a committed checkpoint of step {step}; pass overwrite=True to replace it"
            )
        if replace and committed:
            self._free_for_overwrite(step)
        incremental = self.options.incremental
        base = self._ranks.on_rank0(
            lambda: self._choose_base(step), "choosing the base of an incremental save", self._ranks.base_group
        ) if incremental else None
        with self._lock:
            try:
                if any(p.step == step and not p.done.done() for p in self._pending):
                    raise CheckpointExistsError(f"a save of step {step} into {path} is still in flight")
                self._seq += 1
                if self._rolled_back_to is not None:
                    loaded, newest = self._rolled_back_to
                    # The first save after a load of an older step: a rollback when it saves a step
                    # the run had reached (it goes over that ground again), on record; a step past
                    # every known one is the run going on (an evaluation load in between).
                    if step <= newest:
                        self._rollbacks.add((loaded, self._seq))
                    self._rolled_back_to = None
                writer = DataStatesWriter(
                    path, overwrite=replace, sequence=self._seq, host_cache_bytes=self.options.host_cache_bytes,
                    io_threads=self.options.io_threads, direct_io=self.options.direct_io,
                    checksum_bytes=self.options.checksum_bytes,
                    **(dict(base=base, record_digests=True, change_tracker=self._bases.tracker) if incremental else {}),
                )
                pending = _PendingSave(step, path, self._seq, writer, ManagedSave(step, path, writer), base)
                # Registered before the save starts: retention of an earlier save never deletes it (nor,
                # from here on, its base; until now the base was reserved by _choose_base).
                self._pending.append(pending)
            finally:
                self._reserved_bases.discard(base)  # registered, or not saving
        _log.debug("step %d: %s save into %s (commit sequence %d%s%s)", step,
                   "asynchronous" if self.options.async_save else "synchronous", path, pending.seq,
                   f", incremental on {base}" if base else "", ", replacing a committed one" if replace and committed else "")
        self._saves_changed()
        if not self.options.async_save:
            try:
                try:
                    dcp.save(state, storage_writer=writer, checkpoint_id=path, **self._ranks.dcp_kwargs())
                finally:
                    writer.close()
            except (Exception, CheckpointException) as exc:  # noqa: BLE001 - one error type for both modes
                self._forget(pending)
                raise _save_error(step, path, exc) from _unwrap(exc)
            self._after_commit(pending)
            pending.done.set_result(None)
            self._forget(pending)
            self._replaceable.discard(step)
            return pending.done
        if self.options.fence and self._fence_handle is None:
            self._fence_handle = install_global_fence()
        try:
            resp = dcp.async_save(state, storage_writer=writer, checkpoint_id=path, **self._ranks.dcp_kwargs())
        except (Exception, CheckpointException) as exc:  # noqa: BLE001
            self._forget(pending)
            # dcp.async_save raised, perhaps after it staged: no save will run that snapshot
            # (and this frame still holds its future), so give it up before draining the writer.
            writer.abandon_unbegun(f"dcp.async_save of step {step} failed: {type(exc).__name__}")
            writer.close()
            raise _save_error(step, path, exc) from _unwrap(exc)
        pending.upload = getattr(resp, "upload_completion", resp)
        pending.upload.add_done_callback(lambda _f, p=pending: self._on_upload_done(p))
        return pending.done

    def wait(self) -> None:
        """Wait for every save in flight; raise the first error none has raised yet."""
        with self._lock:
            pending = list(self._pending)
        for p in pending:
            try:
                p.done.result()
            except BaseException:  # noqa: BLE001 - reported below, once
                pass
        self._raise_finished_errors()

    def wait_durable(self, timeout: float | None = None) -> None:
        """Wait for the saves in flight and for every copy to the partner node and the durable tier queued so far;
        raise the first error not yet raised (a failed drain: :class:`DrainError`)."""
        self.wait()
        for tier in (self._partner, self._tier):
            if tier is not None:
                tier.wait(timeout)

    def durable_status(self) -> dict[int, DrainStatus]:
        """This rank's drains: ``{step: DrainStatus}`` (state queued, draining, durable or
        failed; bytes done and total; seconds; error)."""
        return self._tier.status() if self._tier is not None else {}

    def durable_steps(self) -> list[int]:
        """Steps committed on the durable tier, ascending (a listing of it; [] without one)."""
        return sorted(self._tier.committed_steps()) if self._tier is not None else []

    def load(self, state: dict, step: int | None = None, *, full_verify: bool = False) -> int | None:
        """Load a checkpoint into ``state`` in place; return its step.

        ``step=None`` resumes: it tries the newest commit first (what
        ``root/latest`` names, or a checkpoint committed after it when a crash
        came between the commit and the pointer update), then older steps,
        skipping incomplete and corrupt ones with a :class:`SkippedCheckpointWarning`.
        It returns None (``state`` untouched) when the root has no committed
        checkpoint, or, with the option ``init_from_huggingface``, fills the
        model part of ``state`` from that directory, sets :attr:`initialized_from`
        and returns 0. An explicit ``step`` is loaded or raises. Every byte
        loaded is checksum-verified; ``full_verify`` first checks every byte
        of the checkpoint (:func:`dcp_datastates.verify`).

        A load that fails part-way may have filled part of ``state``; the
        next candidate overwrites every entry, and if none loads, the error
        lists why each was refused.
        """
        self.wait()
        t0 = time.perf_counter()
        listing = self._ranks.on_rank0(
            lambda: list_checkpoints(self.root, self._tier, self._rollbacks, _warn_manager), "listing the checkpoints"
        )
        if self._node_level is not None:
            if full_verify:
                raise ValueError("full_verify=True reads every byte on rank 0, which node-local roots do not allow: "
                                 "verify each node's root with `dcp-datastates verify ROOT` there")
            plan, attempt, committed = self._plan_nodes(listing, state, step, full_verify)
        else:
            plan = plan_load(listing, step, self.root, self._tier.url if self._tier is not None else None)
            committed = listing.order.candidates

            def attempt(s: int):
                return self._load_candidate(state, s, s in plan.local, s in listing.durable_same, full_verify)
        for message in plan.warnings:
            _warn(message)
        if plan.error is not None:
            raise plan.error
        refused: list[str] = []
        for s in plan.candidates:
            verdict = attempt(s)
            if verdict is None:
                self._replaceable.update(c for c in committed if c > s)
                # The state now holds step s: older than the newest step known, the next save
                # continues a rollback, and records it in the pointer (the last load decides).
                newest = plan.newest_known
                self._rolled_back_to = (s, newest) if newest is not None and s < newest else None
                if self.options.incremental:
                    self._bases.loaded(s)  # every byte was checked: the next save may refer to it
                where = self.path_of(s) if s in plan.local else f"its durable copy on {self._tier.url}"
                _log.info("%s step %d from %s in %.3f s%s", "resumed from" if step is None else "loaded", s, where,
                          time.perf_counter() - t0, f" (newest known: step {newest})" if newest is not None and s != newest else "")
                return s
            why, bad_files = verdict
            if step is not None:
                raise CorruptCheckpointError(f"cannot load step {s}: {why}")
            refused.append(f"step {s}: {why}")
            if bad_files:
                self._replaceable.add(s)
            _warn(f"skipping the checkpoint of step {s} ({self.path_of(s)}): {why}; trying an older one")
        if not plan.candidates:
            if self.options.init_from_huggingface is not None:
                return self._initialize(state)
            why = ("did not exist before this run" if self._root_created
                   else "holds no committed checkpoint" + (f" (nor does {self._tier.url})" if self._tier else ""))
            _log.info("resume: %s %s: starting from scratch", self.root, why)
            return None
        raise CorruptCheckpointError(
            f"no checkpoint under {self.root} could be loaded:\n  " + "\n  ".join(refused)
            + (f"\nand {plan.unanswered}" if plan.unanswered else "")
        )

    def _initialize(self, state: dict) -> int:
        """A root without checkpoints: fill the model part of ``state`` from the Hugging Face
        directory ``init_from_huggingface`` names (docs/huggingface.md); step 0."""
        source, part = os.fspath(self.options.init_from_huggingface), self.options.init_prefix
        if part not in state:
            raise KeyError(f"the state has no {part!r} entry to load {source} into (init_prefix); its keys: {list(state)}")
        load_from_huggingface(state[part], source, **self._ranks.dcp_kwargs())
        _log.info("resume: %s holds no committed checkpoint: %r initialized from %s", self.root, part, source)
        self.initialized_from = source
        return 0

    def close(self) -> None:
        """Wait for the saves in flight and (with a durable tier) for their copies there,
        raising their errors; then give up the root and the fence.

        The process-wide fence hook is shared by every open manager: it is
        uninstalled when the last one that installed it closes.
        """
        if self._closed:
            return
        try:
            self.wait()
        finally:
            self._closed = True
            try:
                try:
                    if self._partner is not None:
                        self._partner.close(self.options.durable_close_timeout_s)
                finally:
                    if self._tier is not None:
                        self._tier.close(self.options.durable_close_timeout_s)
            finally:
                with self._root_lock:
                    self._root_released = True
                self._release()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - an exception already propagating wins
            if exc_type is None:
                raise

    def __del__(self) -> None:
        self._release()

    # -- saving -------------------------------------------------------------------

    def _forget(self, pending: _PendingSave) -> None:
        with self._lock:
            if pending in self._pending:
                self._pending.remove(pending)
        self._saves_changed()

    def _on_upload_done(self, pending: _PendingSave) -> None:
        """Runs in DCP's save thread once the checkpoint is committed (or failed)."""
        try:
            exc = _future_exception(pending.upload)
            if exc is None:
                self._after_commit(pending)
        except BaseException as unexpected:  # noqa: BLE001 - must reach the future, not the void
            exc = unexpected
        if exc is None:
            pending.done.set_result(None)
        else:
            pending.done.set_exception(exc)
        self._saves_changed()

    def _after_commit(self, pending: _PendingSave) -> None:
        """Every rank: the next incremental save may refer to this one, and its copy to the
        durable tier is queued. Rank 0 also makes the commit durable, moves the pointer and
        applies retention.

        The checkpoint is committed already, so a failure of rank 0's part is a warning
        (the next start repairs the pointer and retention catches up), never a failed
        save: raising on rank 0 alone would also split the ranks.
        """
        if self.options.incremental:
            self._bases.committed(pending.step, pending.seq, full=pending.base is None)
        missing = None  # why this node lacks the step's commit (node-local roots)
        if self._node_level is not None:
            try:
                self._node_level.commit(pending.step)  # every rank: the commit goes to every node
            except Exception as exc:  # noqa: BLE001 - no retention on a root that lacks the step's commit
                missing = exc
        if self._nodes.is_leader:
            try:
                if missing is not None:
                    _warn_manager(f"the checkpoint of step {pending.step} is committed, but not on this node: {missing} "
                                  "(the next start copies its commit)")
                    raise _NodeCommitMissing from missing
                with self._lock:
                    moved = pending.seq > self._pointed_seq
                    if moved:
                        pointer = point_latest_at(self.root, pending.step, pending.seq, sorted(self._rollbacks))
                        self._pointed_seq = pending.seq
                        if self._tier is not None:  # before the step's copy: a rollback is seen there first
                            self._tier.mirror_pointer(pointer)
                    self._retention_anchor = pending.step
                    victims = self._local_victims(pending.step)
                _log.info("step %d committed in %s%s", pending.step, pending.path,
                          f"; {LATEST_FILE} -> step {pending.step}" if moved else " (a later save moved the pointer first)")
                self._delete_for_retention(victims)
            except _NodeCommitMissing:
                pass  # said above; the next start copies the commit (before its cleanup)
            except Exception as exc:  # noqa: BLE001
                _warn_manager(
                    f"the checkpoint of step {pending.step} is committed in {pending.path}, but updating "
                    f"{os.path.join(self.root, LATEST_FILE)} or applying retention failed: {exc}"
                )
        for tier in (self._partner, self._tier):  # the save stands whatever happens here: the step stays local-only
            if tier is None:
                continue
            try:
                tier.enqueue(pending.step, pending.path, pending.writer.last_save_stats.rank_files)
            except Exception as exc:  # noqa: BLE001
                _warn_manager(f"step {pending.step} is committed in {pending.path}, but its copy to "
                              f"{tier.url} could not be queued: {exc}")

    def _choose_base(self, step: int) -> str | None:
        """Rank 0: the base of the next save of ``step`` (every rank uses rank 0's choice, so that
        its retention protects what every rank refers to)."""
        with self._lock:
            in_flight = {p.step for p in self._pending if not p.done.done()}
            base = self._bases.base_for(step, self._seq + 1, in_flight)
            if base is not None:  # until the save is registered: retention must not take it meanwhile
                self._reserved_bases.add(base)
            return base

    def _free_for_overwrite(self, step: int) -> None:
        """Before a save replaces committed step ``step``: steps that refer to it would lose their
        bytes. Abandoned ones (a trajectory given up, which new saves replace anyway) are deleted
        first, with a warning; any other is a :class:`CheckpointError` (nothing is deleted)."""
        name = step_dir_name(step)
        with self._lock:
            waiting = sorted(p.step for p in self._pending if not p.done.done() and p.base == self.path_of(step))
        if waiting:
            raise CheckpointError(
                f"cannot replace the checkpoint of step {step}: the save(s) of step(s) {waiting} in flight refer "
                "to its bytes (incremental checkpoints); wait() for them first"
            )
        others = [n for s, n in step_dirs(self.root).items() if s != step and is_committed(os.path.join(self.root, n))]
        dependents = self._bases.dependents_of(name, others)
        if not dependents:
            return
        # abandoned: by the pointer, or by this manager's resume from an older step (_replaceable)
        abandoned = {step_dir_name(s) for s in (*resume_order(self.root).abandoned, *self._replaceable)}
        kept = [n for n in dependents if n not in abandoned]
        if kept:
            raise CheckpointError(
                f"cannot replace the checkpoint of step {step}: {', '.join(sorted(kept))} refer(s) to its bytes "
                "(incremental checkpoints); delete them first, or save under another step"
            )
        if self._nodes.is_leader:
            for n in sorted(dependents):
                _warn(f"deleting {os.path.join(self.root, n)}: an abandoned checkpoint that refers to step {step}, which is being replaced")
                delete_checkpoint_dir(os.path.join(self.root, n))

    def _local_victims(self, committed_step: int) -> list[str]:
        """The directories local retention deletes now that ``committed_step`` committed (under
        ``self._lock``), newest first. Never a save in flight or its base, nor a step linked from elsewhere; with a
        durable tier, only steps whose own save's durable copy committed (unless
        ``delete_undrained``), or that the run gave up (no durable copy is wanted)."""
        in_flight = {p.step for p in self._pending if not p.done.done()}
        bases = {p.base for p in self._pending if p.base is not None and not p.done.done() and p.step != committed_step}
        held = in_flight | {step_of(os.path.basename(b)) for b in (*bases, *self._reserved_bases)}
        if self._partner is not None:  # a copy to the partner reads the step: kept until it ended (the
            # leader's copy ends after every rank of the node confirmed its own, when it commits)
            held |= {s for s, st in self._partner.status().items() if st.state in (QUEUED, DRAINING)}
        order = resume_order(self.root)  # one listing of the root for the whole pass
        dirs = step_dirs(self.root)
        wait_for_tier = self._tier is not None and not self.options.delete_undrained

        def may_delete(s: int) -> bool:
            if s in held or is_link(self.root, dirs[s]):
                return False
            return not wait_for_tier or s in order.abandoned or self._settled_locally(s, dirs[s])

        victims = self._retention.victims(
            committed_step, dirs, self._bases.referred_steps,
            uncommitted=set(dirs) - set(order.candidates) - set(order.abandoned), given_up=order.abandoned,
            may_delete=may_delete,
        )
        return [dirs[s] for s in victims]

    def _delete_for_retention(self, victims: list[str]) -> None:
        for name in victims:
            delete_checkpoint_dir(os.path.join(self.root, name))
            _log.info("retention (keep_last=%s, keep_every=%s): deleted %s", self.options.keep_last,
                      self.options.keep_every, os.path.join(self.root, name))

    def _settled_locally(self, step: int, name: str) -> bool:
        """Whether local retention may delete ``step`` with a durable tier: its own save is
        durable (or the tier would not keep it), checked by which save it is, not by its step
        number: a step saved again is not durable because an earlier save of it was. A failed
        save's leftovers (never committed) go as before."""
        path = os.path.join(self.root, name)
        if not is_committed(path):
            return True
        stamp = self._settled.get(step)
        return stamp is not None and stamp == read_commit_stamp(os.path.join(path, METADATA_FILE))

    def _raise_finished_errors(self) -> None:
        """Close the writers of finished saves; raise the first error not yet raised."""
        with self._lock:
            finished, running = [], []
            for p in self._pending:
                (finished if p.done.done() else running).append(p)
            self._pending = running
        first: BaseException | None = None
        for p in finished:
            try:
                p.writer.close()  # raises (once) the writer's record of a failed background save
                err = p.done.exception()
            except Exception as exc:  # noqa: BLE001
                err = exc
            if err is not None and first is None:
                first = _save_error(p.step, p.path, err, background=True)
                first.__cause__ = _unwrap(err)
        if first is not None:
            raise first

    # -- the durable tier -------------------------------------------------------------

    def _open_durable_tier(self) -> None:
        """Open the store; rank 0 (the owner) surveys it (:func:`survey.survey_tier`); then every
        rank drains again the committed local steps whose own save is not durable there yet.

        A store that does not answer does not stop the run: it trains and saves locally, and
        every committed local step is queued, to be copied (or found there already) once the
        store answers; only a resume that needs the tier fails."""
        opts = self.options
        retention = RetentionPolicy(opts.durable_keep_last, opts.durable_keep_every)
        self._tier = DurableTier(
            os.fspath(opts.durable), rank=self._rank, retention=retention, read_back=opts.durable_read_back,
            retry_s=opts.durable_retry_s, store_options=opts.durable_options,
            on_durable=_weak_call(self, "_on_durable"), warn=_warn_manager,
            # node-local roots: the other nodes' leaders learn when rank 0 committed each copy
            follows_commit=self._nodes.is_leader and self._rank != 0,
        )
        if not self.owner:
            return

        def survey_root():
            return survey_tier(self.root, self._tier, retention, self._bases.referred_steps, _warn_manager)

        if self._node_level is not None:  # each node's root, surveyed by its leader
            surveys = self._ranks.on_leaders(survey_root, f"surveying the durable tier {self._tier.url}", self._nodes)
            survey = surveys[self._nodes.node]
            self._undrained_run = set(surveys[self._nodes.node_of(0)].undrained)
            for other in surveys:  # every rank the same: the run's rollbacks and newest sequence
                self._rollbacks.update(other.rollbacks)
                with self._lock:
                    self._seq = max(self._seq, other.newest_sequence)
        else:
            survey = self._ranks.on_rank0(survey_root, f"surveying the durable tier {self._tier.url}")
        self._settled.update(survey.settled)
        self._rollbacks.update(survey.rollbacks)
        with self._lock:
            self._seq = max(self._seq, survey.newest_sequence)
        if survey.error is not None:
            _warn_manager(
                f"the durable tier {self._tier.url} did not answer ({survey.error}): the run goes on locally; "
                f"the committed local steps {survey.undrained} are copied there once it answers "
                f"(retried for {opts.durable_retry_s:.0f} s at a time), and kept locally until then"
            )
        if self._rank == 0 and survey.mirror is not None:
            self._tier.mirror_pointer(survey.mirror)
        for s in survey.undrained:  # in commit order: an incremental step commits there after its bases
            try:
                mine = self._drain_share(s)
            except Exception as exc:  # noqa: BLE001 - this step stays local-only; said once
                _warn_manager(f"step {s} is committed locally but not on {self._tier.url}, and cannot be drained: {exc}")
                continue
            for files in mine:
                self._tier.enqueue(s, self.path_of(s), files)

    def _drain_share(self, step: int) -> list:
        """The saved ranks' files of ``step`` this rank drains again: of the ranks whose files the
        root holds (a node's, with node-local roots), every W-th (W: the ranks sharing the root),
        whatever the number of ranks the step was saved with."""
        reader = DataStatesReader(self.path_of(step))
        reader.load_metadata()
        files = reader.require_layout().own_ranks
        members = self._nodes.members[self._nodes.node]
        if self._node_level is not None:
            here = set(os.listdir(self.path_of(step)))
            files = [f for f in files if all(n in here for n in f.file_names())]
        return [f for j, f in enumerate(files) if members[j % len(members)] == self._rank]

    def _saves_changed(self) -> None:
        """A save started or ended: the drain pauses while any save of this manager runs (its
        snapshot copies training state, then it writes the fast tier), so that it never takes
        the cores, memory bandwidth or disk the save needs."""
        with self._lock:  # worked out and set under the lock: the last call sets the truth
            saving = any(not p.done.done() for p in self._pending)
            for tier in (self._tier, self._partner):
                if tier is not None:
                    tier.set_paused(saving)

    def _on_partner_copied(self, step: int, _stamp: CommitStamp | None) -> None:
        """A leader's partner thread, once its node's copy of ``step`` committed on the partner:
        local retention may now delete what it kept while the copy read it."""
        self._on_durable(step, None, "copied to the partner node")

    def _on_durable(self, step: int, stamp: CommitStamp | None, what: str = "durable") -> None:
        """Rank 0's drain thread, once the save ``stamp`` of ``step`` committed on the durable
        tier: local retention may now delete the local copies it kept for want of a durable one."""
        try:
            with self._root_lock:  # never after close() gave the root up (a copy it stopped waiting for)
                if self._root_released:
                    return
                with self._lock:
                    if stamp is not None:
                        self._settled[step] = stamp
                    anchor = self._retention_anchor
                    victims = self._local_victims(anchor) if anchor is not None else []
                self._delete_for_retention(victims)
        except Exception as exc:  # noqa: BLE001
            _warn_manager(f"step {step} is {what}, but local retention failed: {exc}")

    # -- loading ------------------------------------------------------------------

    def _load_candidate(self, state: dict, step: int, local: bool, durable_same: bool, full_verify: bool):
        """Try one candidate of a load: None (loaded) or (why not, its files are bad). A step on
        the durable tier only, or a bad local copy whose durable copy is the same save, is loaded
        from the tier (in place, or fetched into the root first with ``durable_resume="fetch"``)."""
        fetch = self.options.durable_resume == "fetch"
        if local:
            verdict = self._load(state, step, full_verify)
            if verdict is None or not verdict[1] or not durable_same:
                return verdict
            # The local copy is bad; a durable copy of the same save committed: load that
            # (after replacing the local copy with it, when fetching).
            _warn(f"the local copy of step {step} ({self.path_of(step)}) is bad ({verdict[0]}); loading its durable copy")
        if not fetch:
            verdict = self._load(state, step, full_verify, durable=True)
            if local:
                self._replaceable.add(step)  # a save of this step replaces the bad local copy
            return verdict
        verdict = self._fetch_durable(step, replace_bad=local)
        return self._load(state, step, full_verify) if verdict is None else verdict

    def _fetch_durable(self, step: int, replace_bad: bool):
        """Copy ``step`` from the durable tier into the local root (rank 0; then any rank that
        does not see it, such as one with a node-local root); a verdict like ``_check``'s.

        Later saves are numbered after the fetched step's commit sequence (a new node starts
        counting at 0: a restart would otherwise take the fetched step for newer than the saves
        made after it). Only the root's owner fetches: another manager (an evaluation job)
        never writes into it."""
        path, agree = self.path_of(step), self._ranks.agree
        if not self.owner:
            return agree((f"only on {self._tier.url}, and this manager does not own {self.root}", False))

        def fetch():
            if replace_bad:
                delete_checkpoint_dir(path)
            try:
                self._tier.fetch(step, path)
            except StoreError as exc:  # the store did not answer: every rank raises it (below)
                return None, describe(exc)
            return read_commit_sequence(os.path.join(path, METADATA_FILE)) or 0, None

        try:
            seq, unanswered = self._ranks.on_rank0(fetch, f"fetching step {step} from {self._tier.url}")
        except BaseException as exc:  # noqa: BLE001 - classified like a load's failure
            return agree((f"fetching it from {self._tier.url} failed: {describe(exc)}", False))
        if unanswered is not None:
            # Raised, as for a load in place: falling back to an older step would hide it.
            return agree(Raise(f"fetching step {step} from {self._tier.url}: {unanswered}"))
        try:
            with self._lock:
                self._seq = max(self._seq, seq)
            if self._rank != 0 and not is_committed(path):
                try:
                    self._tier.fetch(step, path)
                except DrainError:
                    if not is_committed(path):  # a peer on this node fetched it meanwhile: fine
                        raise
            verdict = None
        except BaseException as exc:  # noqa: BLE001 - classified like a load's failure
            if isinstance(exc, StoreError):  # another rank's own fetch: the store did not answer
                verdict = Raise(f"fetching step {step} from {self._tier.url}: {describe(exc)}")
            else:
                verdict = (f"fetching it from {self._tier.url} failed: {describe(exc)}", False)
        return agree(verdict)

    def _load(self, state: dict, step: int, full_verify: bool, durable: bool = False):
        """Load ``step``, its local copy or its durable one in place; a verdict like ``_check``'s.
        One reader: its .metadata is decoded once for the check, the verification and the load.
        A durable copy is read where it is (what each rank's shards need; nothing is written
        locally, so a manager that does not own the root may do it too), and later saves are
        numbered after its commit sequence (see :meth:`_fetch_durable`)."""
        allow_pickle = self.options.allow_pickle
        reader = (self._tier.reader(step, allow_pickle, **self._read_options()) if durable
                  else DataStatesReader(self.path_of(step), allow_pickle=allow_pickle, **self._read_options()))
        verdict = self._ranks.agree(self._check(reader, full_verify))
        verdict = self._try_load(state, reader) if verdict is None else verdict
        if verdict is None and durable:
            with self._lock:  # the sequence read with .metadata
                self._seq = max(self._seq, reader.commit_sequence or 0)
        return verdict

    # -- node-local roots ----------------------------------------------------------

    def _read_options(self) -> dict:
        """How this manager's readers take part in read-once loads (:mod:`exchange.reads`)."""
        return {"exchange_timeout_s": self.options.exchange_timeout_s, "exchange_backend": self.options.exchange_backend}

    def _plan_nodes(self, listing, state: dict, step: int | None, full_verify: bool):
        """A node-local load's plan (every leader's report of its root gathered, so that every
        rank tries the same steps: :func:`nodes.plan_node_load`), and how each is tried."""
        reports = self._node_level.reports()
        held = sorted({s for r in reports for s in (*r.own, *r.partner)} & set(listing.durable))
        stamps = self._ranks.on_rank0(lambda: self._tier.commit_stamps(held) if held else {},
                                      f"reading which saves {self._tier.url} holds") if self._tier is not None else {}
        nodes = plan_node_load(reports, listing.durable, listing.given_up, step, stamps)
        plan = plan_load(listing, None, self.root, self._tier.url if self._tier is not None else None)
        plan.candidates, plan.local, plan.newest_known = nodes.candidates, set(nodes.candidates), nodes.newest_known
        plan.error = None if plan.candidates or not plan.unanswered else plan.error
        for s, lacking in sorted(nodes.missing.items(), reverse=True):
            if not plan.candidates or s > plan.candidates[0] or step is not None:
                plan.warnings.append(f"skipping step {s}: no node holds {', '.join(lacking[:3])}"
                                     f"{' and others' if len(lacking) > 3 else ''} (a node lost its root)")
        for r in reports:
            for s, why in r.unreadable.items():
                plan.warnings.append(f"node {r.node}: the checkpoint of step {s} cannot be read ({why})")
        if step is not None and not plan.candidates:
            plan.error = CheckpointError(
                f"cannot load step {step} from the nodes' roots {self.root}"
                + (f": no node holds {', '.join(nodes.missing[step][:3])}" if step in nodes.missing else ": no node holds it")
                + (f" (nor does {self._tier.url})" if self._tier is not None else "")
            )
        committed = sorted(s for s in nodes.copies if not any(s in r.abandoned for r in reports))
        return plan, lambda s: self._load_from_nodes(state, s, nodes, reports, full_verify), committed

    def _load_from_nodes(self, state: dict, step: int, plan, reports, full_verify: bool):
        """Load ``step`` from the nodes' roots: the nodes that lost their files of it get them back
        first (from the partner copy, another node or the durable tier), then every rank reads
        each file its node holds where it is and receives the rest from a rank of a node that
        holds it (read once). A verdict like ``_check``'s."""
        if step not in plan.copies:  # no node holds it (every root lost): the durable copy, in place
            return self._load(state, step, full_verify, durable=True)
        level = self._node_level
        try:
            why, restored, memory, received = level.restore(step, plan, reports, self._tier)
            verdict = None if why is None else (why, False)
        except BaseException as exc:  # noqa: BLE001 - classified like a load's failure
            verdict, restored, memory, received = classify(exc), {}, None, []
            if not isinstance(verdict, Raise):
                verdict = (f"node {self._nodes.node} could not get its files back: {verdict[0]}", False)
        verdict = self._ranks.agree(verdict)  # also: every node's files are back before any rank reads
        if verdict is not None:
            return verdict
        reader = level.reader(step, plan, reports, restored, memory, self._tier)
        try:
            reader.load_metadata()
            mine = level.check_assignment(plan, step, reports, restored, reader.require_layout())
        except BaseException as exc:  # noqa: BLE001 - classified, and agreed on below
            verdict, mine = classify(exc), None
        if mine is not None:
            verdict = self._check(reader, False, mine)
        verdict = self._ranks.agree(verdict)
        verdict = self._try_load(state, reader) if verdict is None else verdict
        if verdict is None:
            with self._lock:
                self._seq = max(self._seq, reader.commit_sequence or 0)
            if received and self._tier is not None and step in self._undrained_run:
                for files in received:  # the part of a copy the durable tier still waits for, now here
                    self._tier.enqueue(step, self.path_of(step), files)
        return verdict

    def _open_partner_tier(self) -> None:
        """The partner level (:mod:`manager.partner_tier`); at start, every copy a partner lacks
        of the steps each node keeps is made again, in step order, on every rank alike."""
        if self._nodes.partner(self._nodes.node) is None:
            _warn_manager(f"partner=True, but the run has one node: {self.root} has no partner to copy to")
            return
        self._partner = PartnerTier(self._node_level, self._ranks, self.options, warn=_warn_manager,
                                    on_copied=_weak_call(self, "_on_partner_copied"))
        if self.owner and self._nodes.is_leader:
            self._partner.clear_incomplete()  # what interrupted copies left here
        reports = self._node_level.reports()
        for step, senders in missing_partner_copies(reports, self._nodes, self.options.partner_keep_last):
            self._partner.redo(step, self.path_of(step), senders)

    def _check(self, reader: DataStatesReader, full_verify: bool, files=None) -> tuple[str, bool] | None:
        """Why the reader's checkpoint cannot be loaded (and whether its files are bad), found
        without reading tensor data, or None. Each rank checks every W-th rank index (or the
        ranks ``files`` names); with ``full_verify`` rank 0 reads every byte."""
        try:
            if full_verify and self._rank == 0:
                from dcp_datastates.core.verify import verify

                report = verify(reader.path, reader=reader)
                if not report.ok:
                    return "; ".join(report.problems[:3]) or "not committed", True
            reader.load_metadata()
            if files is None:
                files = reader.require_layout().ranks[self._rank::self._ranks.world]  # base ranks too (format 8)
            for f in files:
                reader.rank_index(f.data_path)
        except BaseException as exc:  # noqa: BLE001 - classified; unknown errors travel to every rank
            return classify(exc)
        return None

    def _try_load(self, state: dict, reader: DataStatesReader) -> tuple[str, bool] | None:
        try:
            dcp.load(state, storage_reader=reader, checkpoint_id=reader.path, **self._ranks.dcp_kwargs())
        except (Exception, CheckpointException) as exc:  # noqa: BLE001 - DCP fails every rank alike
            verdict = classify(_unwrap(exc))
            if isinstance(verdict, Raise):
                inner = _unwrap(exc)
                if inner is exc:
                    raise
                raise inner from exc
            return verdict
        return None

    # -- owning the root and the fence ---------------------------------------------

    def _take_ownership(self) -> bool:
        self._lock_fd = lock_root(self.root)
        if self._lock_fd is None:
            warnings.warn(
                f"another CheckpointManager owns {self.root} (it holds {LOCK_FILE}); this one will load but "
                "not save, clean up, move the pointer or delete checkpoints",
                CheckpointManagerWarning,
                stacklevel=5,
            )
        return self._lock_fd is not None

    def _release(self) -> None:
        """Give up the root's lock and this manager's hold on the fence (close, or garbage collection)."""
        level = getattr(self, "_node_level", None)
        if level is not None:
            level.close()
        fd, self._lock_fd = getattr(self, "_lock_fd", None), None
        if fd is not None:
            unlock_root(fd)
        handle, self._fence_handle = getattr(self, "_fence_handle", None), None
        if handle is not None:
            handle.remove()


class _NodeCommitMissing(Exception):
    """This node could not copy a step's commit: its root's pointer and retention wait."""


def _weak_call(obj, name: str):
    """``obj.name`` without keeping ``obj`` alive (the drain thread must not pin the manager)."""
    ref = weakref.ref(obj)

    def call(*args):
        target = ref()
        return getattr(target, name)(*args) if target is not None else None

    return call


def _save_error(step: int, path: str, exc: BaseException, background: bool = False) -> CheckpointError:
    inner = _unwrap(exc)
    if isinstance(inner, CheckpointError) and not background:
        return inner
    what = "the asynchronous save" if background else "the save"
    return CheckpointError(f"{what} of step {step} into {path} failed: {describe(inner)}")


def _future_exception(fut) -> BaseException | None:
    if isinstance(fut, Future):
        return fut.exception()
    try:
        fut.wait()
    except BaseException as exc:  # noqa: BLE001 - torch futures raise the save's error
        return exc
    return None


def _unwrap(exc: BaseException) -> BaseException:
    """The error a rank raised, out of DCP's CheckpointException (first failing rank)."""
    if isinstance(exc, CheckpointException) and exc.failures:
        inner = next(iter(exc.failures.values()))
        inner = inner[0] if isinstance(inner, tuple) else getattr(inner, "exc", inner)
        return inner if isinstance(inner, BaseException) else exc
    return exc


_log = logging.getLogger(__name__)


# The manager's warnings go through ``warnings`` (what a user sees without configuring anything);
# each is also logged at INFO, so that a log alone tells why a step was skipped or what failed.
def _warn(message: str) -> None:
    _log.info("%s", message)
    warnings.warn(message, SkippedCheckpointWarning, stacklevel=3)


def _warn_manager(message: str) -> None:
    _log.info("%s", message)
    warnings.warn(message, CheckpointManagerWarning, stacklevel=3)
