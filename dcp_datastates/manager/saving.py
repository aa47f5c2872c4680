"""The manager's saves: each step's writer and DCP call, the saves in flight, and what follows a
commit (the node commit, the pointer, local retention, the copies to the partner and the
durable tier).

Every rank runs a save (SPMD, like ``dcp.save``); the leader of each root alone moves its
pointer and applies its retention. Once a checkpoint is committed, a failure of what follows is
a warning (the next start repairs the pointer, retention catches up), never a failed save:
raising on one rank alone would split the ranks."""

from __future__ import annotations

import dataclasses
import os
from concurrent.futures import Future
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from dcp_datastates.core.async_save.fence import install_global_fence
from dcp_datastates.core.writer import DataStatesWriter
from dcp_datastates.errors import CheckpointError, CheckpointExistsError
from dcp_datastates.manager.checkpoint_root import (
    LATEST_FILE,
    is_committed,
    point_latest_at,
    resume_order,
    step_dir_name,
    step_dirs,
)
from dcp_datastates.manager.cleanup import LOCK_FILE, delete_checkpoint_dir
from dcp_datastates.manager.collective import describe, unwrap
from dcp_datastates.manager.local_retention import LocalRetention
from dcp_datastates.manager.manager_state import ManagerState
from dcp_datastates.manager.reporting import log, warn_manager, warn_skipped


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


@dataclasses.dataclass(eq=False)
class PendingSave:
    step: int
    path: str
    seq: int
    writer: DataStatesWriter
    done: ManagedSave  # completes after the pointer and retention (the leader) or the upload (others)
    base: str | None = None  # the base checkpoint of an incremental save (None: a full save)
    upload: Any = None  # DCP's upload future, once dcp.async_save returned


class Saves:
    """The saves of one manager (its state's ``pending``) and the steps after each commit."""

    def __init__(self, state: ManagerState, retention: LocalRetention) -> None:
        self.state = state
        self.retention = retention
        self._fence_handle = None  # this manager's hold on the process-wide fence, from its first async save

    def start(self, step: int, state: dict, overwrite: bool) -> ManagedSave:
        """:meth:`CheckpointManager.save`."""
        st, opts = self.state, self.state.options
        if st.closed:
            raise RuntimeError("CheckpointManager is closed")
        if not st.owner:
            raise CheckpointError(
                f"another CheckpointManager owns {st.root} (it holds {os.path.join(st.root, LOCK_FILE)}); "
                "this one may load but not save: two managers saving into one root would delete each other's checkpoints"
            )
        self.raise_finished_errors()
        for tier in st.each_tier():
            tier.save_started()
        path = st.path_of(step)
        committed = is_committed(path)
        # resume_order lists and stats the root: only asked when the step is committed already
        replace = overwrite or step in st.replaceable or (committed and step in resume_order(st.root).abandoned)
        if not replace and committed:
            raise CheckpointExistsError(
                f"{path} already holds a committed checkpoint of step {step}; pass overwrite=True to replace it"
            )
        if replace and committed:
            self._free_for_overwrite(step)
        base = st.ranks.on_rank0(
            lambda: self._choose_base(step), "choosing the base of an incremental save", st.ranks.base_group
        ) if opts.incremental else None
        pending = self._register(step, path, replace, base)
        log.debug("step %d: %s save into %s (commit sequence %d%s%s)", step,
                  "asynchronous" if opts.async_save else "synchronous", path, pending.seq,
                  f", incremental on {base}" if base else "", ", replacing a committed one" if replace and committed else "")
        self.saves_changed()
        writer = pending.writer
        if not opts.async_save:
            try:
                try:
                    dcp.save(state, storage_writer=writer, checkpoint_id=path, **st.ranks.dcp_kwargs())
                finally:
                    writer.close()
            except (Exception, CheckpointException) as exc:  # noqa: BLE001 - one error type for both modes
                self._forget(pending)
                raise save_error(step, path, exc) from unwrap(exc)
            self._after_commit(pending)
            pending.done.set_result(None)
            self._forget(pending)
            st.replaceable.discard(step)
            return pending.done
        if opts.fence and self._fence_handle is None:
            self._fence_handle = install_global_fence()
        try:
            resp = dcp.async_save(state, storage_writer=writer, checkpoint_id=path, **st.ranks.dcp_kwargs())
        except (Exception, CheckpointException) as exc:  # noqa: BLE001
            self._forget(pending)
            # dcp.async_save raised, perhaps after it staged: no save will run that snapshot
            # (and this frame still holds its future), so give it up before draining the writer.
            writer.abandon_unbegun(f"dcp.async_save of step {step} failed: {type(exc).__name__}")
            writer.close()
            raise save_error(step, path, exc) from unwrap(exc)
        pending.upload = getattr(resp, "upload_completion", resp)
        pending.upload.add_done_callback(lambda _f, p=pending: self._on_upload_done(p))
        return pending.done

    def _register(self, step: int, path: str, replace: bool, base: str | None) -> PendingSave:
        """The save's writer and record, numbered and registered before the save starts: retention
        of an earlier save never deletes it (nor, from here on, its base: until now the base was
        reserved by :meth:`_choose_base`)."""
        st, opts = self.state, self.state.options
        with st.lock:
            try:
                if any(p.step == step for p in st.in_flight()):
                    raise CheckpointExistsError(f"a save of step {step} into {path} is still in flight")
                st.seq += 1
                if st.rolled_back_to is not None:
                    loaded, newest = st.rolled_back_to
                    # The first save after a load of an older step: a rollback when it saves a step
                    # the run had reached (it goes over that ground again), on record; a step past
                    # every known one is the run going on (an evaluation load in between).
                    if step <= newest:
                        st.rollbacks.add((loaded, st.seq))
                    st.rolled_back_to = None
                writer = DataStatesWriter(
                    path, overwrite=replace, sequence=st.seq, host_cache_bytes=opts.host_cache_bytes,
                    io_threads=opts.io_threads, direct_io=opts.direct_io, checksum_bytes=opts.checksum_bytes,
                    **(dict(base=base, record_digests=True, change_tracker=st.bases.tracker) if opts.incremental else {}),
                )
                pending = PendingSave(step, path, st.seq, writer, ManagedSave(step, path, writer), base)
                st.pending.append(pending)
                return pending
            finally:
                st.reserved_bases.discard(base)  # registered, or not saving

    def wait(self) -> None:
        """Wait for every save in flight; raise the first error none has raised yet."""
        with self.state.lock:
            pending = list(self.state.pending)
        for p in pending:
            try:
                p.done.result()
            except BaseException:  # noqa: BLE001 - reported below, once
                pass
        self.raise_finished_errors()

    def raise_finished_errors(self) -> None:
        """Close the writers of finished saves; raise the first error not yet raised."""
        st = self.state
        with st.lock:
            finished, running = [], []
            for p in st.pending:  # one look at each: a save ending meanwhile is in exactly one list
                (finished if p.done.done() else running).append(p)
            st.pending = running
        first: BaseException | None = None
        for p in finished:
            try:
                p.writer.close()  # raises (once) the writer's record of a failed background save
                err = p.done.exception()
            except Exception as exc:  # noqa: BLE001
                err = exc
            if err is not None and first is None:
                first = save_error(p.step, p.path, err, background=True)
                first.__cause__ = unwrap(err)
        if first is not None:
            raise first

    def release(self) -> None:
        """Give up this manager's hold on the fence (close, or garbage collection)."""
        handle, self._fence_handle = self._fence_handle, None
        if handle is not None:
            handle.remove()

    def saves_changed(self) -> None:
        """A save started or ended: the copies pause while any save of this manager runs (its
        snapshot copies training state, then it writes the fast tier), so that they never take
        the cores, memory bandwidth or disk the save needs."""
        st = self.state
        with st.lock:  # worked out and set under the lock: the last call sets the truth
            saving = bool(st.in_flight())
            for tier in st.each_tier():
                tier.set_paused(saving)

    def _forget(self, pending: PendingSave) -> None:
        with self.state.lock:
            if pending in self.state.pending:
                self.state.pending.remove(pending)
        self.saves_changed()

    def _on_upload_done(self, pending: PendingSave) -> None:
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
        self.saves_changed()

    def _after_commit(self, pending: PendingSave) -> None:
        """Every rank: the next incremental save may refer to this one, the node commit, and the
        step's copies queued. The root's leader also moves the pointer (mirrored on the durable
        tier before the step's copy: a rollback is seen there first) and applies retention."""
        st = self.state
        if st.options.incremental:
            st.bases.committed(pending.step, pending.seq, full=pending.base is None)
        missing = None  # why this node lacks the step's commit (node-local roots)
        if st.node_level is not None:
            try:
                st.node_level.commit(pending.step)  # every rank: the commit goes to every node
            except Exception as exc:  # noqa: BLE001 - no retention on a root that lacks the step's commit
                missing = exc
        if st.nodes.is_leader:
            if missing is not None:  # the next start copies its commit (before its cleanup)
                warn_manager(f"the checkpoint of step {pending.step} is committed, but not on this node: {missing} "
                             "(the next start copies its commit)")
            else:
                self._point_and_retain(pending)
        for tier in st.each_tier():  # the save stands whatever happens here: the step stays local-only
            try:
                tier.enqueue(pending.step, pending.path, pending.writer.last_save_stats.rank_files)
            except Exception as exc:  # noqa: BLE001
                warn_manager(f"step {pending.step} is committed in {pending.path}, but its copy to "
                             f"{tier.url} could not be queued: {exc}")

    def _point_and_retain(self, pending: PendingSave) -> None:
        st = self.state
        try:
            with st.lock:
                moved = pending.seq > st.pointed_seq
                if moved:
                    pointer = point_latest_at(st.root, pending.step, pending.seq, sorted(st.rollbacks))
                    st.pointed_seq = pending.seq
                    if st.tier is not None:
                        st.tier.mirror_pointer(pointer)
                victims = self.retention.after_commit(pending.step)
            log.info("step %d committed in %s%s", pending.step, pending.path,
                     f"; {LATEST_FILE} -> step {pending.step}" if moved else " (a later save moved the pointer first)")
            self.retention.delete(victims)
        except Exception as exc:  # noqa: BLE001
            warn_manager(
                f"the checkpoint of step {pending.step} is committed in {pending.path}, but updating "
                f"{os.path.join(st.root, LATEST_FILE)} or applying retention failed: {exc}"
            )

    def _choose_base(self, step: int) -> str | None:
        """Rank 0: the base of the next save of ``step`` (every rank uses rank 0's choice, so that
        its retention protects what every rank refers to)."""
        st = self.state
        with st.lock:
            in_flight = {p.step for p in st.in_flight()}
            base = st.bases.base_for(step, st.seq + 1, in_flight)
            if base is not None:  # until the save is registered: retention must not take it meanwhile
                st.reserved_bases.add(base)
            return base

    def _free_for_overwrite(self, step: int) -> None:
        """Before a save replaces committed step ``step``: steps that refer to it would lose their
        bytes. Abandoned ones (a trajectory given up, which new saves replace anyway) are deleted
        first, with a warning; any other is a :class:`CheckpointError` (nothing is deleted)."""
        st = self.state
        name = step_dir_name(step)
        with st.lock:
            waiting = sorted(p.step for p in st.in_flight() if p.base == st.path_of(step))
        if waiting:
            raise CheckpointError(
                f"cannot replace the checkpoint of step {step}: the save(s) of step(s) {waiting} in flight refer "
                "to its bytes (incremental checkpoints); wait() for them first"
            )
        others = [n for s, n in step_dirs(st.root).items() if s != step and is_committed(os.path.join(st.root, n))]
        dependents = st.bases.dependents_of(name, others)
        if not dependents:
            return
        # abandoned: by the pointer, or by this manager's resume from an older step (replaceable)
        abandoned = {step_dir_name(s) for s in (*resume_order(st.root).abandoned, *st.replaceable)}
        kept = [n for n in dependents if n not in abandoned]
        if kept:
            raise CheckpointError(
                f"cannot replace the checkpoint of step {step}: {', '.join(sorted(kept))} refer(s) to its bytes "
                "(incremental checkpoints); delete them first, or save under another step"
            )
        if st.nodes.is_leader:
            for n in sorted(dependents):
                warn_skipped(f"deleting {os.path.join(st.root, n)}: an abandoned checkpoint that refers to step {step}, "
                             "which is being replaced")
                delete_checkpoint_dir(os.path.join(st.root, n))


def save_error(step: int, path: str, exc: BaseException, background: bool = False) -> CheckpointError:
    inner = unwrap(exc)
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
