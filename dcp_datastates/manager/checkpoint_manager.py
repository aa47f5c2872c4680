"""``CheckpointManager``: step-numbered checkpoints of a run, retention, and resume.

What torchtitan's, Lightning's and Orbax's checkpoint managers do, on top of
``DataStatesWriter``/``DataStatesReader``; docs/manager.md states its rules and options. This
module is the public face and its wiring; each part is a module of its own, and each decision
is taken in one place:

* the state the parts share: :mod:`manager_state`;
* saving, and what follows a commit: :mod:`saving`;
* loading (each candidate, from the root, the durable tier or the nodes' roots): :mod:`loading`;
* which checkpoints a load tries, in which order: :mod:`resume` (pure);
* what local retention deletes, and when: :mod:`local_retention` (on :mod:`retention`'s pure policy);
* the root's names, its ``latest`` pointer and resume order: :mod:`checkpoint_root`;
* every deletion (crash leftovers, retention's) and the owner's lock: :mod:`cleanup`;
* the base of an incremental save, and what each step refers to: :mod:`base_choice`;
* what the leaders find in their roots and on the durable tier: :mod:`survey`;
* how the ranks agree (rank 0 decides, verdicts are combined): :mod:`collective`;
* opening the durable tier and the partner level: :mod:`tier_wiring`;
* node-local roots and the bytes between nodes: :mod:`node_level`.

Distributed: every rank constructs the manager and calls :meth:`save` and :meth:`load` with
its part of the state (SPMD, like ``dcp.save``); the leader of each root alone touches its
pointer, retention and cleanup.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

from dcp_datastates.manager.base_choice import BaseChoice
from dcp_datastates.manager.checkpoint_root import (
    is_committed,
    newest_sequence,
    read_pointer_if_valid,
    resume_order,
    step_dirs,
)
from dcp_datastates.manager.cleanup import LOCK_FILE, lock_root, recover_root, unlock_root
from dcp_datastates.manager.collective import Ranks
from dcp_datastates.manager.durable_tier import DrainStatus
from dcp_datastates.manager.loading import Loads
from dcp_datastates.manager.local_retention import LocalRetention
from dcp_datastates.manager.manager_state import ManagerState
from dcp_datastates.manager.node_level import NodeLevel
from dcp_datastates.manager.nodes import NodeMap
from dcp_datastates.manager.options import CheckpointManagerOptions
from dcp_datastates.manager.reporting import CheckpointManagerWarning, SkippedCheckpointWarning, warn_skipped
from dcp_datastates.manager.saving import ManagedSave, Saves
from dcp_datastates.manager.tier_wiring import open_durable_tier, open_partner_tier
from dcp_datastates.storage.url import refuse_url

__all__ = ["CheckpointManager", "CheckpointManagerWarning", "ManagedSave", "SkippedCheckpointWarning"]


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
        self._lock_fd: int | None = None  # rank 0's hold on root/.manager.lock (cleanup.lock_root)
        ranks = Ranks(self.root, process_group, opts.async_save, opts.incremental)
        self._state = st = ManagerState(
            self.root, opts, ranks, NodeMap.single(ranks.world, ranks.rank), BaseChoice(self.root, opts.full_every)
        )
        self._retention = LocalRetention(st)
        self._saves = Saves(st, self._retention)
        self._loads = Loads(st)
        try:
            self._start()
            if opts.durable is not None:
                open_durable_tier(st, self._retention)
            if opts.partner:
                open_partner_tier(st, self._retention)
        except BaseException:
            # Nothing of a manager that failed to start may outlive it: a retry in this process
            # must find the root free (its lock) and no copy thread running.
            st.closed = True
            for tier in st.each_tier():
                try:
                    tier.close(0)
                except Exception:  # noqa: BLE001 - the error that stopped the start is the one to raise
                    pass
            self._release()
            raise

    def _start(self) -> None:
        """Take the root (each node's, node-local): its lock, its crash cleanup, the commit
        numbering from its newest commit (every rank gets the same number, so every rank hands
        its writer the same sequence for the same save) and the run's rollbacks on record."""
        st, opts = self._state, self.options

        def start() -> tuple[bool, int, tuple, bool]:
            created = not os.path.isdir(self.root)
            os.makedirs(self.root, exist_ok=True)
            if self._take_ownership() and opts.cleanup:
                recover_root(self.root, opts.allow_pickle, warn_skipped)
            pointer = read_pointer_if_valid(self.root)
            return self._lock_fd is not None, newest_sequence(self.root), pointer.rollbacks if pointer else (), created

        if opts.node_local:
            st.node_level = NodeLevel(self.root, st.ranks, opts)
            st.nodes = st.node_level.nodes
            st.node_level.repair_commits()  # before the leaders' crash cleanup could take those steps
            found = st.ranks.on_leaders(start, "opening its checkpoint root", st.nodes)
        else:
            found = [st.ranks.on_rank0(start, "opening the checkpoint root")]
        st.owner = all(f[0] for f in found)
        st.seq = st.pointed_seq = max(f[1] for f in found)
        st.rollbacks.update(r for f in found for r in f[2])
        st.root_created = all(f[3] for f in found)

    # -- public API -------------------------------------------------------------

    @property
    def owner(self) -> bool:
        """Whether this manager owns its root (holds its lock): only the owner saves and deletes."""
        return self._state.owner

    @property
    def initialized_from(self) -> str | None:
        """The Hugging Face directory a load on a fresh root filled the model from (``init_from_huggingface``)."""
        return self._loads.initialized_from

    @property
    def _tier(self):
        return self._state.tier

    def steps(self) -> list[int]:
        """The steps of every committed checkpoint under ``root``, ascending (this rank's view)."""
        return sorted(step for step, name in step_dirs(self.root).items() if is_committed(os.path.join(self.root, name)))

    def latest(self) -> int | None:
        """The step a resume tries first: the newest commit (normally what ``root/latest`` names),
        or None. Not verified: :meth:`load` skips it if it turns out bad."""
        order = resume_order(self.root)
        return order.candidates[0] if order.candidates else None

    def path_of(self, step: int) -> str:
        return self._state.path_of(step)

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
        return self._saves.start(step, state, overwrite)

    def wait(self) -> None:
        """Wait for every save in flight; raise the first error none has raised yet."""
        self._saves.wait()

    def wait_durable(self, timeout: float | None = None) -> None:
        """Wait for the saves in flight and for every copy to the partner node and the durable tier queued so far;
        raise the first error not yet raised (a failed drain: :class:`DrainError`)."""
        self.wait()
        for tier in self._state.each_tier():
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
        return self._loads.load(state, step, full_verify)

    def close(self) -> None:
        """Wait for the saves in flight and (with a durable tier) for their copies there,
        raising their errors; then give up the root and the fence.

        The process-wide fence hook is shared by every open manager: it is
        uninstalled when the last one that installed it closes.
        """
        st = self._state
        if st.closed:
            return
        try:
            self.wait()
        finally:
            st.closed = True
            try:
                try:
                    if st.partner is not None:
                        st.partner.close(self.options.durable_close_timeout_s)
                finally:
                    if st.tier is not None:
                        st.tier.close(self.options.durable_close_timeout_s)
            finally:
                self._retention.release()
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

    # -- owning the root and the fence ---------------------------------------------

    def _take_ownership(self) -> bool:
        self._lock_fd = lock_root(self.root)
        if self._lock_fd is None:
            warnings.warn(
                f"another CheckpointManager owns {self.root} (it holds {LOCK_FILE}); this one will load but "
                "not save, clean up, move the pointer or delete checkpoints",
                CheckpointManagerWarning,
                stacklevel=6,
            )
        return self._lock_fd is not None

    def _release(self) -> None:
        """Give up the root's lock and this manager's hold on the fence (close, or garbage collection)."""
        st = getattr(self, "_state", None)
        if st is not None and st.node_level is not None:
            st.node_level.close()
        fd, self._lock_fd = getattr(self, "_lock_fd", None), None
        if fd is not None:
            unlock_root(fd)
        saves = getattr(self, "_saves", None)
        if saves is not None:
            saves.release()

