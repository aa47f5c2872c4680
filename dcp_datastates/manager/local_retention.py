"""The local tier's retention: what the root's leader deletes once a step committed, or once a
copy the root kept a step for (to the durable tier, to the partner node) ended.

Which steps retention would delete is :class:`retention.RetentionPolicy`'s pure decision; this
module adds what only the running manager knows: the saves in flight and their bases (never
deleted), the partner copies still reading a step, and, with a durable tier, whether a step's own
save is durable there yet (checked by which save it is, not by its step number)."""

from __future__ import annotations

import os
import threading

from dcp_datastates.format.file_names import METADATA_FILE
from dcp_datastates.format.metadata_envelope import is_same_save
from dcp_datastates.format.metadata_file import CommitStamp, read_commit_stamp
from dcp_datastates.manager.checkpoint_root import is_committed, is_link, resume_order, step_dirs, step_of
from dcp_datastates.manager.cleanup import delete_checkpoint_dir
from dcp_datastates.manager.manager_state import ManagerState
from dcp_datastates.manager.reporting import log, warn_manager
from dcp_datastates.manager.retention import RetentionPolicy
from dcp_datastates.tiers.copy_queue import DRAINING, QUEUED


class LocalRetention:
    def __init__(self, state: ManagerState) -> None:
        self.state = state
        opts = state.options
        self.policy = RetentionPolicy(opts.keep_last, opts.keep_every)
        self.anchor: int | None = None  # the step of the last commit (retention counts from it)
        # The drain thread's retention and close() giving the root up, one at a time.
        self._root_lock = threading.Lock()
        self._root_released = False

    def release(self) -> None:
        """The manager gave the root up: no copy that ends later deletes anything in it."""
        with self._root_lock:
            self._root_released = True

    def after_commit(self, step: int) -> list[str]:
        """``step`` committed (under the state's lock): retention counts from it from now on;
        the directories it deletes now (:meth:`victims`)."""
        self.anchor = step
        return self.victims(step)

    def victims(self, committed_step: int) -> list[str]:
        """The directories local retention deletes now that ``committed_step`` was the last
        commit (under the state's lock), newest first. Never a save in flight or its base, nor a step linked
        from elsewhere; with a durable tier, only steps whose own save's durable copy committed
        (unless ``delete_undrained``), or that the run gave up (no durable copy is wanted)."""
        st = self.state
        running = st.in_flight()
        bases = {p.base for p in running if p.base is not None and p.step != committed_step}
        held = {p.step for p in running} | {step_of(os.path.basename(b)) for b in (*bases, *st.reserved_bases)}
        if st.partner is not None:  # a copy to the partner reads the step: kept until it ended (the
            # leader's copy ends after every rank of the node confirmed its own, when it commits)
            held |= {s for s, status in st.partner.status().items() if status.state in (QUEUED, DRAINING)}
        order = resume_order(st.root)  # one listing of the root for the whole pass
        dirs = step_dirs(st.root)
        wait_for_tier = st.tier is not None and not st.options.delete_undrained

        def may_delete(s: int) -> bool:
            if s in held or is_link(st.root, dirs[s]):
                return False
            return not wait_for_tier or s in order.abandoned or self._settled(s, dirs[s])

        chosen = self.policy.victims(
            committed_step, dirs, st.bases.referred_steps,
            uncommitted=set(dirs) - set(order.candidates) - set(order.abandoned), given_up=order.abandoned,
            may_delete=may_delete,
        )
        return [dirs[s] for s in chosen]

    def delete(self, victims: list[str]) -> None:
        opts = self.state.options
        for name in victims:
            delete_checkpoint_dir(os.path.join(self.state.root, name))
            log.info("retention (keep_last=%s, keep_every=%s): deleted %s", opts.keep_last, opts.keep_every,
                     os.path.join(self.state.root, name))

    def _settled(self, step: int, name: str) -> bool:
        """Whether local retention may delete ``step`` with a durable tier: its own save is
        durable (or the tier would not keep it). A step saved again is not durable because an
        earlier save of it was. A failed save's leftovers (never committed) go as before."""
        path = os.path.join(self.state.root, name)
        if not is_committed(path):
            return True
        return is_same_save(self.state.settled.get(step), read_commit_stamp(os.path.join(path, METADATA_FILE)))

    def on_partner_copied(self, step: int, _stamp: CommitStamp | None) -> None:
        """A leader's partner thread, once its node's copy of ``step`` committed on the partner:
        retention may now delete what it kept while the copy read it."""
        self.on_durable(step, None, "copied to the partner node")

    def on_durable(self, step: int, stamp: CommitStamp | None, what: str = "durable") -> None:
        """Rank 0's drain thread, once the save ``stamp`` of ``step`` committed on the durable
        tier: retention may now delete the local copies it kept for want of a durable one."""
        st = self.state
        try:
            with self._root_lock:  # never after the manager gave the root up (a copy close() stopped waiting for)
                if self._root_released:
                    return
                with st.lock:
                    if stamp is not None:
                        st.settled[step] = stamp
                    victims = self.victims(self.anchor) if self.anchor is not None else []
                self.delete(victims)
        except Exception as exc:  # noqa: BLE001
            warn_manager(f"step {step} is {what}, but local retention failed: {exc}")
