"""``CheckpointManager``: step-numbered checkpoints of a run, retention, and resume.

What torchtitan's, Lightning's and Orbax's checkpoint managers do, on top of
``DataStatesWriter``/``DataStatesReader``, with these guarantees. The root's
names, its pointer and the resume order are :mod:`checkpoint_root`; every
deletion (crash leftovers, retention) and the owner's lock are
:mod:`cleanup`; this module decides when each happens.

* **Step directories.** Step N lives in ``ROOT/step_<N>`` (see
  :mod:`checkpoint_root`); it is a checkpoint once it is committed (its
  ``.metadata`` was renamed into place after every byte was fsynced).
* **An atomic ``latest`` pointer**, replaced only after the checkpoint it
  names is committed and its directory entry is durable (fsynced), so it
  never names a checkpoint that could vanish in a power loss.
* **Retention** (``keep_last``, ``keep_every``) deletes a checkpoint only
  after a newer one has committed, never the newest committed one, and never
  one with a larger step than the one just committed. A deletion removes
  ``.metadata`` first, so a crash during it leaves an uncommitted directory,
  never a committed one with files missing (see :mod:`cleanup`).
* **Resume** (:meth:`load` with no step) takes the newest committed
  checkpoint that loads; an incomplete or corrupt one is skipped with a
  :class:`SkippedCheckpointWarning` saying why, and the next older is tried.
  Every byte loaded is checksum-verified; ``full_verify=True`` also checks
  every byte the load would not read (:func:`dcp_datastates.verify`).
* **Cleanup of crashes.** When the manager starts (rank 0), it removes step
  directories that were never committed, files inside committed checkpoints
  that they do not name (rank files of a killed overwrite, a leftover
  ``.metadata`` temporary), and a stale pointer is moved to the newest
  committed step (the crash fell between a commit and its pointer update).
* **Asynchronous saves** go through ``dcp.async_save``: :meth:`save` returns
  once the snapshot is enqueued, and a process-wide optimizer step pre-hook
  (the fence) makes any ``optimizer.step()`` wait while a snapshot is still
  copying. Managers open at once share that one hook; the last of them to
  close removes it. Errors of background saves are raised by the next
  :meth:`save`, :meth:`wait` or :meth:`close`.

Distributed: every rank constructs the manager and calls :meth:`save` and
:meth:`load` with its part of the state (SPMD, like ``dcp.save``); rank 0 of
the group alone touches the pointer, retention and cleanup.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import threading
import warnings
import weakref
from concurrent.futures import Future
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from dcp_datastates.core.fence import install_global_fence
from dcp_datastates.core.reader import DataStatesReader
from dcp_datastates.core.writer import DataStatesWriter
from dcp_datastates.manager.increments import Increments
from dcp_datastates.errors import (
    CheckpointError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    UnsafeCheckpointError,
    UnsupportedFormatError,
)
from dcp_datastates.manager.checkpoint_root import (
    LATEST_FILE,
    is_committed,
    newest_sequence,
    given_up,
    newest_pointer,
    point_latest_at,
    read_pointer,
    resume_order,
    step_dir_name,
    step_dirs,
    step_of,
)
from dcp_datastates.manager.durable_tier import RETRY_S, DrainStatus, DurableTier
from dcp_datastates.storage import StoreError
from dcp_datastates.format.file_names import METADATA_FILE
from dcp_datastates.storage.url import refuse_url
from dcp_datastates.format.metadata_file import CommitStamp, read_commit_sequence, read_commit_stamp
from dcp_datastates.tiers.drain import DrainError
from dcp_datastates.manager.cleanup import (
    LOCK_FILE,
    delete_checkpoint_dir,
    lock_root,
    recover_root,
    retention_keeps,
    retention_victims,
    spare_referred,
    unlock_root,
)
from dcp_datastates.native import engine as _native


class CheckpointManagerWarning(UserWarning):
    """Something the manager did or could not do that the run should know about."""


class SkippedCheckpointWarning(CheckpointManagerWarning):
    """A checkpoint was passed over on resume (incomplete, corrupt, abandoned) or removed as a crash leftover."""


# Resume skips a checkpoint for these, and a new save may replace it: its files are bad.
_BAD_FILES = (CorruptCheckpointError, IncompleteCheckpointError)
# Resume skips a checkpoint for these too, but leaves it alone: it may be fine (it vanished
# while we looked, it is another format, the disk failed to read it this time).
_UNREADABLE = (CheckpointNotFoundError, UnsupportedFormatError)
_READ_ERRNOS = {errno.EIO, errno.ENOENT, errno.ESTALE, errno.ENODATA}
# Anything else (a state dict that does not match, unsafe objects, EACCES, EMFILE, a durable
# store that does not answer: StoreError, after the client's own retries) is raised: falling
# back to an older checkpoint would hide it (and a save after it would make the newer step
# look abandoned).


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
class _TierSurvey:
    """What rank 0 found on the durable tier at start (handed to every rank)."""

    undrained: list[int]  # committed local steps to drain, in commit order
    settled: dict  # {step: CommitStamp}: steps whose local copy needs nothing more from the tier
    rollbacks: tuple  # the run's rollbacks, as the tier's pointer records them
    newest_sequence: int  # the largest commit sequence the tier knows: later saves are numbered above it
    mirror: Any  # the pointer to mirror there (the local one, with the tier's rollbacks), or None
    error: str | None  # why the tier did not answer (then every committed local step is queued)


@dataclasses.dataclass
class _Listing:
    """Rank 0's view of the checkpoints for a load (handed to every rank)."""

    order: Any  # checkpoint_root.ResumeOrder of the local root
    uncommitted: list[int]  # local step directories never committed
    durable: list[int]  # steps committed on the durable tier ([] without one, or when it did not answer)
    given_up: list[int]  # durable-only steps of a trajectory the run gave up
    durable_same: set  # local steps whose durable copy is the same save (may stand in for a bad local copy)
    tier_error: str | None  # why the durable tier did not answer


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

    Args:
        root: the run's checkpoint directory (created if missing).
        keep_last: keep the newest ``keep_last`` committed checkpoints (``None``: keep all).
        keep_every: also keep every checkpoint whose step is a multiple of this, forever.
        async_save: save with ``dcp.async_save`` (:meth:`save` returns at once) or ``dcp.save``.
        host_cache_bytes, io_threads, direct_io: passed to :class:`DataStatesWriter`.
        process_group: the group DCP saves and loads on. By default, with
            ``async_save`` in a distributed run, a new gloo group, so the
            background save's collectives never interleave with training's.
        fence: install the process-wide optimizer step pre-hook that waits
            for in-flight snapshots (asynchronous saves only; from the first
            save until :meth:`close`, shared with other open managers).
        allow_pickle: load checkpoints whose objects need arbitrary unpickling
            (only checkpoints you trust; see :class:`DataStatesReader`).
        cleanup: on start, remove crash leftovers (see module docs).
        durable: a durable tier every committed step is copied to in the
            background (docs/manager.md, "Tiers"): a directory on a shared
            file system, or ``s3://bucket/prefix`` (``pip install
            "dcp_datastates[s3]"``; endpoint and credentials from the usual
            ``AWS_*`` environment variables). ``None``: the local root only.
        durable_keep_last, durable_keep_every: retention on the durable tier
            (``None``: keep every durable copy).
        delete_undrained: let local retention delete a step whose durable copy
            has not committed (default False: such a step is kept until it has).
        durable_read_back: read every copied object back from the durable tier
            and compare its CRC-32C (default True).
        durable_options: keyword arguments of the store (``S3Store``: ``endpoint``,
            ``region``, ``part_bytes``, ``upload_concurrency``, ``max_retries``, ...).
        durable_resume: how a resume loads a step found only on the durable tier (or
            whose local copy is bad): ``"load"`` (default) loads it in place, with ranged
            reads from object storage (:class:`StoreReader`) or the local reader on a
            directory tier; ``"fetch"`` copies it into the local root first, then loads
            the local copy (which stays, for the node's next restart).
            ``bench_tiers.py`` measures both (docs/benchmarks.md).
        incremental: save each step against the previous one (docs/incremental.md):
            a tensor chunk of 64 KiB or more whose bytes did not change is
            referred to, not written again (default True; ``False``: every
            save is full). Retention on both tiers keeps every step a kept
            step refers to; a step commits on the durable tier after its bases.
        full_every: with ``incremental``, a full save at least every this many
            saves, so no chain of references outlives it (default 10).
        durable_retry_s: how long a drain that fails because the durable store
            does not answer (an outage) is retried in the background, with
            backoff from 1 s doubling to 60 s, before it is reported failed
            (then retried after the next save). Default 1800.
        durable_close_timeout_s: how long :meth:`close` waits for drains still
            running or retrying (None, the default: until each ended); what is
            not durable by then is named in a :class:`DrainError`, its local
            copy kept.

    One manager owns a root at a time: rank 0 holds an exclusive lock on
    ``root/.manager.lock`` until :meth:`close`. Another manager opened on the
    same root meanwhile (an evaluation job, a notebook) may load, but does not
    clean up, move the pointer or delete anything, and refuses to save, so it
    can never remove a checkpoint the owner is writing.
    """

    def __init__(
        self,
        root: str | os.PathLike,
        *,
        keep_last: int | None = 3,
        keep_every: int | None = None,
        async_save: bool = True,
        host_cache_bytes: int = _native.DEFAULT_HOST_CACHE_BYTES,
        io_threads: int = _native.DEFAULT_IO_THREADS,
        direct_io: str = "auto",
        process_group: Any = None,
        fence: bool = True,
        allow_pickle: bool = False,
        cleanup: bool = True,
        durable: str | os.PathLike | None = None,
        durable_keep_last: int | None = None,
        durable_keep_every: int | None = None,
        delete_undrained: bool = False,
        durable_read_back: bool = True,
        durable_options: dict | None = None,
        durable_resume: str = "load",
        incremental: bool = True,
        full_every: int = 10,
        durable_retry_s: float = RETRY_S,
        durable_close_timeout_s: float | None = None,
    ) -> None:
        if keep_last is not None and (not isinstance(keep_last, int) or keep_last < 1):
            raise ValueError(f"keep_last must be a positive int or None (keep all), got {keep_last!r}")
        if keep_every is not None and (not isinstance(keep_every, int) or keep_every < 1):
            raise ValueError(f"keep_every must be a positive int or None, got {keep_every!r}")
        if durable_resume not in ("load", "fetch"):
            raise ValueError(f"durable_resume must be 'load' or 'fetch', got {durable_resume!r}")
        if not isinstance(full_every, int) or isinstance(full_every, bool) or full_every < 1:
            raise ValueError(f"full_every must be a positive int, got {full_every!r}")
        refuse_url(root, "CheckpointManager", "Give it a local directory, and the object storage as its durable "
                   "tier: CheckpointManager(local_root, durable=URL) (docs/tiers.md).")
        self.root = os.path.abspath(os.fspath(root))
        self.durable_resume = durable_resume
        self.keep_last = keep_last
        self.keep_every = keep_every
        self.async_save = async_save
        self.allow_pickle = allow_pickle
        self._writer_options = dict(host_cache_bytes=host_cache_bytes, io_threads=io_threads, direct_io=direct_io)
        self._distributed = dist.is_available() and dist.is_initialized()
        if self._distributed and process_group is None and async_save:
            process_group = dist.new_group(backend="gloo")
        self._group = process_group
        self._rank = dist.get_rank(process_group) if self._distributed else 0
        self._fence = fence and async_save
        self._lock = threading.Lock()
        self._pending: list[_PendingSave] = []
        self._replaceable: set[int] = set()  # committed steps a save may overwrite (skipped as bad)
        self._closed = False
        self._lock_fd: int | None = None  # rank 0's hold on root/.manager.lock (cleanup.lock_root)
        self._fence_handle = None  # this manager's hold on the process-wide fence, from its first async save
        # What each step refers to is read whatever this manager does (a root may hold incremental
        # steps of an earlier run): retention never deletes a base a remaining step needs.
        self._increments = Increments(self.root, full_every)
        self.incremental = bool(incremental)
        # Rank 0 chooses each save's base and tells every rank, on a group of its own: the save
        # group may be carrying a background save's collectives at that moment.
        self._base_group = dist.new_group(backend="gloo") if self._distributed and self.incremental else None
        self._reserved_bases: set[str] = set()  # rank 0: bases chosen for saves not registered yet

        def start() -> tuple[bool, int, tuple]:
            os.makedirs(self.root, exist_ok=True)
            if self._take_ownership() and cleanup:
                recover_root(self.root, self.allow_pickle, _warn)
            try:
                pointer = read_pointer(self.root)  # the run's rollbacks on record
            except ValueError:  # rewritten by recover_root (owner), or by the next commit
                pointer = None
            return self._lock_fd is not None, newest_sequence(self.root), pointer.rollbacks if pointer else ()

        self.delete_undrained = delete_undrained
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
        if durable_close_timeout_s is not None and (
            isinstance(durable_close_timeout_s, bool) or not isinstance(durable_close_timeout_s, (int, float))
            or durable_close_timeout_s < 0
        ):
            raise ValueError(f"durable_close_timeout_s must be seconds >= 0 or None, got {durable_close_timeout_s!r}")
        self._close_timeout_s = durable_close_timeout_s
        # The drain thread's local retention and close() giving the root up, one at a time.
        self._root_lock = threading.Lock()
        self._root_released = False
        try:
            self.owner, newest, rollbacks = self._on_rank0(start, "opening the checkpoint root")
            # Commits are numbered from the newest one in the root (every rank gets rank 0's
            # number, so every rank hands its writer the same sequence for the same save).
            self._seq = self._pointed_seq = newest
            self._rollbacks.update(rollbacks)
            if durable is not None:
                self._open_durable_tier(
                    durable, durable_keep_last, durable_keep_every, durable_read_back, durable_options or {},
                    durable_retry_s,
                )
        except BaseException:
            # Nothing of a manager that failed to start may outlive it: a retry in this process
            # must find the root free (its lock) and no drain thread running.
            self._closed = True
            try:
                if self._tier is not None:
                    self._tier.close(0)
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
        if self._tier is not None:
            self._tier.save_started()
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
        base = self._on_rank0(
            lambda: self._choose_base(step), "choosing the base of an incremental save", self._base_group
        ) if self.incremental else None
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
                incremental_options = {}
                if self.incremental:
                    incremental_options = dict(base=base, record_digests=True, change_tracker=self._increments.tracker)
                writer = DataStatesWriter(
                    path, overwrite=replace, sequence=self._seq, **self._writer_options, **incremental_options
                )
                pending = _PendingSave(step, path, self._seq, writer, ManagedSave(step, path, writer), base)
                # Registered before the save starts: retention of an earlier save never deletes it (nor,
                # from here on, its base; until now the base was reserved by _choose_base).
                self._pending.append(pending)
            finally:
                self._reserved_bases.discard(base)  # registered, or not saving
        self._saves_changed()
        if not self.async_save:
            try:
                try:
                    dcp.save(state, storage_writer=writer, checkpoint_id=path, **self._dcp_kwargs())
                finally:
                    writer.close()
            except (Exception, CheckpointException) as exc:  # noqa: BLE001 - one error type for both modes
                self._forget(pending)
                raise _save_error(step, path, exc) from _unwrap(exc)
            self._committed(pending)
            self._after_commit(pending)
            self._drain(pending)
            pending.done.set_result(None)
            self._forget(pending)
            self._replaceable.discard(step)
            return pending.done
        if self._fence and self._fence_handle is None:
            self._fence_handle = install_global_fence()
        try:
            resp = dcp.async_save(state, storage_writer=writer, checkpoint_id=path, **self._dcp_kwargs())
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
        """Wait for the saves in flight and for every copy to the durable tier queued so far;
        raise the first error not yet raised (a failed drain: :class:`DrainError`)."""
        self.wait()
        if self._tier is not None:
            self._tier.wait(timeout)

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
        checkpoint. An explicit ``step`` is loaded or raises. Every byte
        loaded is checksum-verified; ``full_verify`` first checks every byte
        of the checkpoint (:func:`dcp_datastates.verify`).

        A load that fails part-way may have filled part of ``state``; the
        next candidate overwrites every entry, and if none loads, the error
        lists why each was refused.
        """
        step = self._load(state, step, full_verify)
        if step is not None and self.incremental:
            self._increments.loaded(step)  # every byte was checked: the next save may refer to it
        return step

    def _load(self, state: dict, step: int | None, full_verify: bool) -> int | None:
        self.wait()
        view = self._on_rank0(self._listing, "listing the checkpoints")
        order, durable = view.order, view.durable
        local = set(order.candidates) | set(order.abandoned)
        unanswered = f"the durable tier {self._tier.url} did not answer ({view.tier_error})" if view.tier_error else None
        if step is not None:
            if step not in local and step in durable:
                candidates = [step]  # fetched from the durable tier below
            elif step not in local:
                path = self.path_of(step)
                if step in view.uncommitted:
                    raise IncompleteCheckpointError(
                        f"{path}: the checkpoint of step {step} was never committed (an interrupted or failed save)"
                    )
                if unanswered:
                    raise CheckpointError(f"no checkpoint of step {step} under {self.root}, and {unanswered}")
                raise CheckpointNotFoundError(
                    f"no checkpoint of step {step} under {self.root} (committed: {sorted(order.candidates + order.abandoned)})"
                    + (f" or {self._tier.url} (durable: {durable})" if self._tier is not None else "")
                )
            else:
                candidates = [step]
        else:
            candidates = _with_durable_only(
                order.candidates, [s for s in durable if s not in local and s not in view.given_up]
            )
            for s in view.given_up:
                _warn(
                    f"skipping the durable copy of step {s} in {self._tier.url}: it belongs to a trajectory the run "
                    f"gave up (it resumed from an older step since); a new save of step {s} replaces it"
                )
            if order.pointer_error:
                _warn(f"{order.pointer_error}; resuming from the newest committed checkpoint")
            for s in view.uncommitted:
                if not candidates or s > candidates[0]:
                    _warn(f"skipping {self.path_of(s)}: it was never committed (an interrupted or failed save)")
            for s in order.abandoned:
                _warn(
                    f"skipping the checkpoint of step {s}: it was committed before {LATEST_FILE} moved to step "
                    f"{order.pointer} (a run resumed from an older step since); a new save of step {s} replaces it"
                )
            if unanswered and candidates:
                _warn(f"{unanswered}: resuming from {self.root} alone")
            if not candidates:
                if unanswered:  # a fresh start would hide the checkpoints the tier may hold
                    raise CheckpointError(f"{self.root} holds no committed checkpoint, and {unanswered}")
                return None
        known = [*order.candidates, *(s for s in durable if s not in local and s not in view.given_up)]
        refused: list[str] = []
        fetch = self.durable_resume == "fetch"
        for s in candidates:
            path = self.path_of(s)
            fetched = False
            if s not in local:  # on the durable tier only (a new node, a lost local disk)
                if fetch:
                    verdict = self._fetch_durable(s, replace_bad=False)
                    fetched = verdict is None
                else:
                    verdict = self._load_durable(state, s, full_verify)
            else:
                verdict = self._load_local(state, s, full_verify)
                if verdict is not None and verdict[1] and s in view.durable_same:
                    # The local copy is bad; a durable copy of the same save committed: load that
                    # (after replacing the local copy with it, when fetching).
                    _warn(f"the local copy of step {s} ({path}) is bad ({verdict[0]}); loading its durable copy")
                    if fetch:
                        verdict = self._fetch_durable(s, replace_bad=True)
                        fetched = verdict is None
                    else:
                        verdict = self._load_durable(state, s, full_verify)
                        self._replaceable.add(s)  # a save of this step replaces the bad local copy
            if fetched:
                verdict = self._load_local(state, s, full_verify)
            if verdict is None:
                self._replaceable.update(c for c in order.candidates if c > s)
                # The state now holds step s: older than the newest step known, the next save
                # continues a rollback, and records it in the pointer (the last load decides).
                self._rolled_back_to = (s, max(known)) if known and s < max(known) else None
                return s
            why, bad_files = verdict
            if step is not None:
                raise CorruptCheckpointError(f"cannot load step {s}: {why}")
            refused.append(f"step {s}: {why}")
            if bad_files:
                self._replaceable.add(s)
            _warn(f"skipping the checkpoint of step {s} ({path}): {why}; trying an older one")
        raise CorruptCheckpointError(
            f"no checkpoint under {self.root} could be loaded:\n  " + "\n  ".join(refused)
            + (f"\nand {unanswered}" if unanswered else "")
        )

    def _listing(self) -> _Listing:
        """Rank 0's view of the checkpoints (every rank tries the same candidates in the same
        order). Durable copies are judged by the run's pointer (the local one, or the tier's
        mirror when newer, with every rollback either records: ``given_up``); a durable copy
        that is the very save of a local step (``durable_same``) may stand in for it."""
        order = resume_order(self.root)
        local = set(order.candidates) | set(order.abandoned)
        uncommitted = sorted(set(step_dirs(self.root)) - local)
        if self._tier is None:
            return _Listing(order, uncommitted, [], [], set(), None)
        try:
            durable = sorted(self._tier.committed_steps())
            durable_only = [s for s in durable if s not in local]
            both = [s for s in order.candidates if s in set(durable)]
            there = self._tier.commit_stamps([*durable_only, *both])
            tier_pointer = self._read_tier_pointer()
        except StoreError as exc:
            if not exc.transient:  # a refusal is raised, as any error a fallback would hide
                raise
            return _Listing(order, uncommitted, [], [], set(), _describe(exc))
        try:
            local_pointer = read_pointer(self.root)
        except ValueError:
            local_pointer = None
        pointer = newest_pointer(local_pointer, tier_pointer, rollbacks=self._rollbacks)
        sequences = {**order.sequences, **{s: there[s].sequence for s in durable_only if there.get(s) is not None}}
        gave_up = [s for s in given_up(sequences, pointer) if s in durable_only]
        same = set()
        for s in both:
            mine = read_commit_stamp(os.path.join(self.path_of(s), METADATA_FILE))
            if there.get(s) is not None and (
                there[s] == mine or (mine is None and not given_up({s: there[s].sequence}, pointer))
            ):
                same.add(s)
        return _Listing(order, uncommitted, durable, gave_up, same, None)

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
                if self._tier is not None:
                    self._tier.close(self._close_timeout_s)
            finally:
                with self._root_lock:
                    self._root_released = True
                self._release()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            try:
                self.close()
            except Exception:  # noqa: BLE001 - the exception already propagating wins
                pass

    def __del__(self) -> None:
        self._release()

    # -- saving -------------------------------------------------------------------

    def _dcp_kwargs(self) -> dict:
        if not self._distributed:
            return {"no_dist": True}
        return {"process_group": self._group}

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
                self._committed(pending)
                self._after_commit(pending)
                self._drain(pending)
        except BaseException as unexpected:  # noqa: BLE001 - must reach the future, not the void
            exc = unexpected
        if exc is None:
            pending.done.set_result(None)
        else:
            pending.done.set_exception(exc)
        self._saves_changed()

    def _after_commit(self, pending: _PendingSave) -> None:
        """Rank 0: make the commit durable, move the pointer, apply retention.

        The checkpoint is committed already, so a failure here is a warning
        (the next start repairs the pointer and retention catches up), never
        a failed save: raising on rank 0 alone would also split the ranks.
        """
        if self._rank != 0:
            return
        try:
            with self._lock:
                if pending.seq > self._pointed_seq:
                    pointer = point_latest_at(self.root, pending.step, pending.seq, sorted(self._rollbacks))
                    self._pointed_seq = pending.seq
                    if self._tier is not None:  # before the step's copy: a rollback is seen there first
                        self._tier.mirror_pointer(pointer)
                self._retention_anchor = pending.step
                victims = self._local_victims(pending.step)
            for name in victims:
                delete_checkpoint_dir(os.path.join(self.root, name))
        except Exception as exc:  # noqa: BLE001
            warnings.warn(
                f"the checkpoint of step {pending.step} is committed in {pending.path}, but updating "
                f"{os.path.join(self.root, LATEST_FILE)} or applying retention failed: {exc}",
                CheckpointManagerWarning,
                stacklevel=2,
            )

    def _choose_base(self, step: int) -> str | None:
        """Rank 0: the base of the next save of ``step`` (every rank uses rank 0's choice, so that
        its retention protects what every rank refers to)."""
        with self._lock:
            in_flight = {p.step for p in self._pending if not p.done.done()}
            base = self._increments.base_for(step, self._seq + 1, in_flight)
            if base is not None:  # until the save is registered: retention must not take it meanwhile
                self._reserved_bases.add(base)
            return base

    def _committed(self, pending: _PendingSave) -> None:
        """Every rank: the save committed; with incremental saves, the next one may refer to it."""
        if self.incremental:
            self._increments.committed(pending.step, pending.seq, full=pending.base is None)

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
        dependents = self._increments.dependents_of(name, others)
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
        if self._rank == 0:
            for n in sorted(dependents):
                _warn(f"deleting {os.path.join(self.root, n)}: an abandoned checkpoint that refers to step {step}, which is being replaced")
                delete_checkpoint_dir(os.path.join(self.root, n))

    def _local_victims(self, committed_step: int) -> list[str]:
        """Local retention's deletions now that ``committed_step`` committed (under ``self._lock``):
        with a durable tier, only steps whose durable copy committed (unless ``delete_undrained``);
        never a step that a step left on disk (or a save in flight) refers to."""
        in_flight = {p.step for p in self._pending if not p.done.done()}
        order = resume_order(self.root)  # one listing of the root for the whole pass
        victims = retention_victims(self.root, committed_step, self.keep_last, self.keep_every, in_flight, order)
        if self._tier is not None and not self.delete_undrained:
            gone = set(order.abandoned)  # given up: no durable copy is wanted
            victims = [name for name in victims if step_of(name) in gone or self._settled_locally(name)]
        if victims:  # after every other rule: what stays may refer to what would go
            victims = self._without_bases(victims, committed_step)
        # Deleted newest first: a step an incremental one refers to is older than it, so a crash
        # part-way through never leaves a committed step whose base is gone.
        return sorted(victims, key=lambda n: step_of(n) or 0, reverse=True)

    def _settled_locally(self, name: str) -> bool:
        """Whether local retention may delete ``root/name`` with a durable tier: its own save is
        durable (or the tier would not keep it), checked by which save it is, not by its step
        number: a step saved again is not durable because an earlier save of it was. A failed
        save's leftovers (never committed) go as before."""
        path = os.path.join(self.root, name)
        if not is_committed(path):
            return True
        stamp = self._settled.get(step_of(name))
        return stamp is not None and stamp == read_commit_stamp(os.path.join(path, METADATA_FILE))

    def _without_bases(self, victims: list[str], committed_step: int) -> list[str]:
        """``victims`` less the bases of saves in flight (the one that just committed,
        ``committed_step``, refers to what its layout says) and every directory a remaining one
        refers to (``cleanup.spare_referred``: whatever stays on disk stays loadable)."""
        in_flight = {p.base for p in self._pending if p.base is not None and not p.done.done() and p.step != committed_step}
        protected = {step_of(os.path.basename(b)) for b in (*in_flight, *self._reserved_bases)}
        dirs = step_dirs(self.root)
        steps = {step_of(v) for v in victims} - protected
        left = spare_referred(steps, dirs, self._increments.referred_steps)
        return [v for v in victims if step_of(v) in left]

    # -- the durable tier -------------------------------------------------------------

    def _open_durable_tier(self, url, keep_last, keep_every, read_back, options, retry_s) -> None:
        """Open the store; rank 0 (the owner) surveys it (:meth:`_survey_tier`); then every rank
        drains again the committed local steps whose own save is not durable there yet.

        A store that does not answer does not stop the run: it trains and saves locally, and
        every committed local step is queued, to be copied (or found there already) once the
        store answers; only a resume that needs the tier fails."""
        self._tier = DurableTier(
            os.fspath(url), rank=self._rank, keep_last=keep_last, keep_every=keep_every, read_back=read_back,
            retry_s=retry_s, store_options=options, on_durable=_weak_call(self, "_on_durable"),
            warn=lambda m: warnings.warn(m, CheckpointManagerWarning, stacklevel=2),
        )
        if not self.owner:
            return
        survey = self._on_rank0(lambda: self._survey_tier(keep_last, keep_every), f"surveying the durable tier {self._tier.url}")
        self._settled.update(survey.settled)
        self._rollbacks.update(survey.rollbacks)
        with self._lock:
            self._seq = max(self._seq, survey.newest_sequence)
        if survey.error is not None:
            warnings.warn(
                f"the durable tier {self._tier.url} did not answer ({survey.error}): the run goes on locally; "
                f"the committed local steps {survey.undrained} are copied there once it answers "
                f"(retried for {retry_s:.0f} s at a time), and kept locally until then",
                CheckpointManagerWarning, stacklevel=3,
            )
        if self._rank == 0 and survey.mirror is not None:
            self._tier.mirror_pointer(survey.mirror)
        for s in survey.undrained:  # in commit order: an incremental step commits there after its bases
            try:
                files = DataStatesReader(self.path_of(s)).read_metadata().storage_data.own_ranks
                mine = next((f for f in files if f.rank == self._rank), None)
            except Exception as exc:  # noqa: BLE001 - this step stays local-only; said once
                warnings.warn(
                    f"step {s} is committed locally but not on {self._tier.url}, and cannot be drained: {exc}",
                    CheckpointManagerWarning, stacklevel=3,
                )
                continue
            if mine is not None:
                self._tier.enqueue(s, self.path_of(s), mine)

    def _survey_tier(self, keep_last: int | None, keep_every: int | None) -> _TierSurvey:
        """Rank 0, at start: which committed local steps the tier holds the very save of (by
        :class:`CommitStamp`, not by step number), which it would not keep anyway (its retention,
        applied as if they had been drained in order, bases spared), which the run has gone past
        there (another node went on from the tier: its pointer is newer than ours), and so which
        must be drained again; what interrupted drains left there is removed, and the run's
        pointer merged with the tier's. A store that does not answer is said in ``error`` (every
        committed local step is then queued); one that refuses (credentials, permissions, a wrong
        bucket) is raised: the tier is misconfigured, and the run must not go on without it."""
        order = resume_order(self.root)
        by_commit = sorted(order.candidates, key=lambda s: (order.sequences.get(s, 0), s))
        local_pointer = None
        try:
            local_pointer = read_pointer(self.root)
        except ValueError:
            pass  # recover_root warned and rewrote it, or the next commit does
        try:
            durable, incomplete = self._tier.steps_by_state()  # one listing of the store
            tier_pointer = self._read_tier_pointer()
            self._tier.clear_incomplete(incomplete)
            there = self._tier.commit_stamps([s for s in by_commit if s in durable])
        except StoreError as exc:
            if not exc.transient:
                raise
            return _TierSurvey(by_commit, {}, (), 0, None, _describe(exc))
        mine = {s: read_commit_stamp(os.path.join(self.path_of(s), METADATA_FILE)) for s in by_commit}
        settled = {s: st for s, st in mine.items() if st is not None and there.get(s) == st}
        # The tier's pointer newer than ours: another node resumed from the tier and went on.
        behind = tier_pointer is not None and (tier_pointer.sequence or 0) > (
            (local_pointer.sequence or 0) if local_pointer is not None else 0)
        missing = []
        for s in by_commit:
            if s in settled:
                continue
            other = there.get(s)
            if other is not None and mine[s] is not None and (behind or other.sequence > mine[s].sequence):
                settled[s] = mine[s]  # the run saved this step again since: the tier's copy is the run's
            elif not behind:  # behind: a step the run did not take from here; kept, not drained
                missing.append(s)
        if settled and missing and (keep_last is not None or keep_every is not None):
            newest = max(settled)  # the newest copy of this run's own there
            keeps = retention_keeps(sorted(set(durable) | set(missing)), newest, keep_last, keep_every)
            superseded = {s for s in missing if s < newest and s not in keeps and mine[s] is not None}
            # ... but never a base of a step that is drained: that one would never commit there
            superseded = spare_referred(superseded, [s for s in missing if s not in superseded],
                                        self._increments.referred_steps)
            settled.update({s: mine[s] for s in superseded})  # its copy there would go again at once
            missing = [s for s in missing if s not in superseded]
        sequences = [st.sequence for st in there.values() if st is not None]
        newest_sequence = max([*sequences, (tier_pointer.sequence or 0) if tier_pointer else 0])
        rollbacks = tuple(tier_pointer.rollbacks) if tier_pointer else ()
        # Ours, with the tier's rollbacks too (not behind: ours names the newest commit)
        mirror = newest_pointer(local_pointer, tier_pointer) if local_pointer is not None and not behind else None
        return _TierSurvey(missing, settled, rollbacks, newest_sequence, mirror, None)

    def _read_tier_pointer(self):
        """The run's pointer mirrored on the tier; one that cannot be read is warned about and
        passed over (copies are then judged by their sequences alone; the next mirror replaces it)."""
        try:
            return self._tier.read_pointer()
        except ValueError as exc:
            warnings.warn(f"{exc}: judging the durable copies by their commit sequences alone",
                          CheckpointManagerWarning, stacklevel=4)
            return None

    def _saves_changed(self) -> None:
        """A save started or ended: the drain pauses while any save of this manager runs (its
        snapshot copies training state, then it writes the fast tier), so that it never takes
        the cores, memory bandwidth or disk the save needs."""
        if self._tier is None:
            return
        with self._lock:  # worked out and set under the lock: the last call sets the truth
            self._tier.set_paused(any(not p.done.done() for p in self._pending))

    def _drain(self, pending: _PendingSave) -> None:
        """Every rank: queue the copy of its files of the step just committed (the save stands
        whatever happens here: a failure is a warning, and the step stays local-only)."""
        if self._tier is None:
            return
        try:
            self._tier.enqueue(pending.step, pending.path, pending.writer.last_save_stats.rank_files)
        except Exception as exc:  # noqa: BLE001
            warnings.warn(
                f"step {pending.step} is committed in {pending.path}, but its copy to {self._tier.url} could not "
                f"be queued: {exc}", CheckpointManagerWarning, stacklevel=2,
            )

    def _on_durable(self, step: int, stamp: CommitStamp | None) -> None:
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
                for name in victims:
                    delete_checkpoint_dir(os.path.join(self.root, name))
        except Exception as exc:  # noqa: BLE001
            warnings.warn(f"step {step} is durable, but local retention failed: {exc}", CheckpointManagerWarning, stacklevel=2)

    def _fetch_durable(self, step: int, replace_bad: bool):
        """Copy ``step`` from the durable tier into the local root (rank 0; then any rank that
        does not see it, such as one with a node-local root); a verdict like ``_check``'s.

        Later saves are numbered after the fetched step's commit sequence (a new node starts
        counting at 0: a restart would otherwise take the fetched step for newer than the saves
        made after it). Only the root's owner fetches: another manager (an evaluation job)
        never writes into it."""
        path = self.path_of(step)
        if not self.owner:
            return self._agree((f"only on {self._tier.url}, and this manager does not own {self.root}", False))

        def fetch():
            if replace_bad:
                delete_checkpoint_dir(path)
            try:
                self._tier.fetch(step, path)
            except StoreError as exc:  # the store did not answer: every rank raises it (below)
                return None, _describe(exc)
            return read_commit_sequence(os.path.join(path, METADATA_FILE)) or 0, None

        try:
            seq, unanswered = self._on_rank0(fetch, f"fetching step {step} from {self._tier.url}")
        except BaseException as exc:  # noqa: BLE001 - classified like a load's failure
            return self._agree((f"fetching it from {self._tier.url} failed: {_describe(exc)}", False))
        if unanswered is not None:
            # Raised, as for a load in place: falling back to an older step would hide it.
            return self._agree(_Raise(f"fetching step {step} from {self._tier.url}: {unanswered}"))
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
                verdict = _Raise(f"fetching step {step} from {self._tier.url}: {_describe(exc)}")
            else:
                verdict = (f"fetching it from {self._tier.url} failed: {_describe(exc)}", False)
        return self._agree(verdict)

    def _load_durable(self, state: dict, step: int, full_verify: bool):
        """Load the durable copy of ``step`` in place (``durable_resume="load"``); a verdict like
        ``_check``'s. Every rank reads what its shards need; nothing is written locally, so a
        manager that does not own the root may do it too. Later saves are numbered after the
        copy's commit sequence (see :meth:`_fetch_durable`)."""
        reader = self._tier.reader(step, self.allow_pickle)
        verdict = self._agree(self._check(reader, full_verify))
        if verdict is None:
            verdict = self._try_load(state, reader)
        if verdict is None:
            with self._lock:  # the sequence read with .metadata
                self._seq = max(self._seq, reader.commit_sequence or 0)
        return verdict

    def _load_local(self, state: dict, step: int, full_verify: bool):
        # One reader per candidate: its .metadata is decoded once for the check, the
        # verification and the load.
        reader = DataStatesReader(self.path_of(step), allow_pickle=self.allow_pickle)
        verdict = self._agree(self._check(reader, full_verify))
        if verdict is None:
            verdict = self._try_load(state, reader)
        return verdict

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

    # -- loading ------------------------------------------------------------------

    def _check(self, reader: DataStatesReader, full_verify: bool) -> tuple[str, bool] | None:
        """Why the reader's checkpoint cannot be loaded (and whether its files are bad), found
        without reading tensor data, or None. Each rank checks every W-th rank index; with
        ``full_verify`` rank 0 reads every byte."""
        try:
            if full_verify and self._rank == 0:
                from dcp_datastates.core.verify import verify

                report = verify(reader.path, reader=reader)
                if not report.ok:
                    return "; ".join(report.problems[:3]) or "not committed", True
            reader.load_metadata()
            world = dist.get_world_size(self._group) if self._distributed else 1
            for files in reader.layout.ranks[self._rank::world]:  # base ranks too (format 8)
                reader.rank_index(files.data_path)
        except BaseException as exc:  # noqa: BLE001 - classified; unknown errors travel to every rank
            return _classify(exc)
        return None

    def _try_load(self, state: dict, reader: DataStatesReader) -> tuple[str, bool] | None:
        try:
            dcp.load(state, storage_reader=reader, checkpoint_id=reader.path, **self._dcp_kwargs())
        except (Exception, CheckpointException) as exc:  # noqa: BLE001 - DCP fails every rank alike
            verdict = _classify(_unwrap(exc))
            if isinstance(verdict, _Raise):
                inner = _unwrap(exc)
                if inner is exc:
                    raise
                raise inner from exc
            return verdict
        return None

    def _agree(self, verdict):
        """Every rank's verdict on a checkpoint, combined: bad on one rank is bad on all,
        and an error that must be raised is raised on every rank."""
        if self._distributed:
            verdicts: list[Any] = [None] * dist.get_world_size(self._group)
            dist.all_gather_object(verdicts, verdict, group=self._group)
        else:
            verdicts = [verdict]
        for r, v in enumerate(verdicts):
            if isinstance(v, _Raise):
                raise v.error(f"rank {r}: " if self._distributed else "")
        bad = [(r, v) for r, v in enumerate(verdicts) if v is not None]
        if not bad:
            return None
        why = "; ".join(f"rank {r}: {v[0]}" if self._distributed else v[0] for r, v in bad)
        return why, any(v[1] for _r, v in bad)

    def _on_rank0(self, fn, what: str, group: Any = None):
        """Run ``fn`` on rank 0 and hand its result (or its error, raised) to every rank (over
        ``group``, by default the manager's)."""
        group = group if group is not None else self._group
        try:
            result = (True, fn()) if self._rank == 0 else None
        except Exception as exc:  # noqa: BLE001 - raised below on every rank
            if not self._distributed:
                raise
            result = (False, f"{type(exc).__name__}: {exc}")
        if self._distributed:
            box = [result]
            dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0) if group else 0, group=group)
            result = box[0]
        ok, value = result
        if not ok:
            raise CheckpointError(f"{self.root}: rank 0 failed {what}: {value}")
        return value

    # -- owning the root and the fence ---------------------------------------------

    def _take_ownership(self) -> bool:
        self._lock_fd = lock_root(self.root)
        if self._lock_fd is None:
            warnings.warn(
                f"another CheckpointManager owns {self.root} (it holds {LOCK_FILE}); this one will load but "
                "not save, clean up, move the pointer or delete checkpoints",
                CheckpointManagerWarning,
                stacklevel=4,
            )
        return self._lock_fd is not None

    def _release(self) -> None:
        """Give up the root's lock and this manager's hold on the fence (close, or garbage collection)."""
        fd, self._lock_fd = getattr(self, "_lock_fd", None), None
        if fd is not None:
            unlock_root(fd)
        handle, self._fence_handle = getattr(self, "_fence_handle", None), None
        if handle is not None:
            handle.remove()


@dataclasses.dataclass(frozen=True)
class _Raise:
    """A verdict that is not about the checkpoint's files: every rank raises it. A class, not a
    sentinel object: verdicts travel between ranks pickled, and a sentinel would not survive."""

    text: str
    unsafe: bool = False  # raised as UnsafeCheckpointError (what ``except UnsafeCheckpointError`` expects)

    def error(self, prefix: str = "") -> CheckpointError:
        return (UnsafeCheckpointError if self.unsafe else CheckpointError)(prefix + self.text)


def _classify(exc: BaseException):
    """(why, the files are bad) for errors that make resume skip a checkpoint; a :class:`_Raise` otherwise."""
    if isinstance(exc, UnsafeCheckpointError):
        return _Raise(_describe(exc), unsafe=True)
    if isinstance(exc, _BAD_FILES):
        return _describe(exc), True
    if isinstance(exc, _UNREADABLE) or (isinstance(exc, OSError) and exc.errno in _READ_ERRNOS):
        return _describe(exc), False
    return _Raise(f"{type(exc).__name__}: {_describe(exc)}")


def _weak_call(obj, name: str):
    """``obj.name`` without keeping ``obj`` alive (the drain thread must not pin the manager)."""
    ref = weakref.ref(obj)

    def call(*args):
        target = ref()
        return getattr(target, name)(*args) if target is not None else None

    return call


def _with_durable_only(local: list[int], durable_only: list[int]) -> list[int]:
    """Resume candidates: the local ones in their order, each durable-only step placed before
    the first local one with a smaller step."""
    out = list(local)
    for s in sorted(durable_only, reverse=True):
        at = next((i for i, c in enumerate(out) if c < s), len(out))
        out.insert(at, s)
    return out


def _save_error(step: int, path: str, exc: BaseException, background: bool = False) -> CheckpointError:
    inner = _unwrap(exc)
    if isinstance(inner, CheckpointError) and not background:
        return inner
    what = "the asynchronous save" if background else "the save"
    return CheckpointError(f"{what} of step {step} into {path} failed: {_describe(inner)}")


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


def _describe(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return " ".join(text.split())


def _warn(message: str) -> None:
    warnings.warn(message, SkippedCheckpointWarning, stacklevel=3)
