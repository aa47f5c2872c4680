"""The manager's durable tier: background drains, their status, retention there, and fetches.

Each committed step is handed to a :class:`DurableTier`, whose one background
thread per rank copies the rank's files to the tier (:func:`tiers.drain.drain_rank`)
and then does the rank's part of the commit, its :class:`tiers.commit_rules.CommitRule`
(:func:`commit_rule_for`: rank 0 commits the copy there once every rank confirmed, then
applies the tier's retention, :mod:`manager.retention`): :func:`run_drain_job`. Its queue
is a :class:`tiers.copy_queue.CopyQueue`. The
thread stays in the training process (a child process blocked ``save()`` no
less and costs a second interpreter with torch; docs/benchmarks.md), works in
small blocks, runs at the lowest priority and keeps out of saves' way
(:mod:`tiers.drain_pacing`). A drain the store does not answer is retried
with capped backoff for ``retry_s``; one that still fails is retried with the
next step and reported by :meth:`DurableTier.wait`; the local copy of a step
not durable yet is kept. Rank 0 mirrors the run's pointer to the tier before
each copy, so that a new node sees a rollback before any copy after it.
Docs/tiers.md tells the whole story and its failure rules.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import threading
import time
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from dcp_datastates.core.reader import DataStatesReader
from dcp_datastates.errors import CheckpointError
from dcp_datastates.format.checkpoint_layout import RankFiles
from dcp_datastates.format.metadata_file import CommitStamp
from dcp_datastates.manager.checkpoint_root import LATEST_FILE, POINTER_LIMIT, Pointer, step_dir_name, step_of
from dcp_datastates.manager.retention import RetentionPolicy
from dcp_datastates.tiers.commit_rules import AwaitCommit, CommitRule, CommitWhenAllConfirmed, LeaveCommit, Outcome
from dcp_datastates.tiers.copy_queue import DELETED, DRAINING, DURABLE, FAILED, QUEUED, CopyQueue, DrainJob, DrainStatus, lower_priority
from dcp_datastates.tiers.drain_pacing import DrainPacer
from dcp_datastates.storage import StoreError, open_store
from dcp_datastates.storage.local import LocalStore, is_committed_directory
from dcp_datastates.tiers.drain import (
    DrainError,
    clear_incomplete_step,
    drain_rank,
    durable_commit_stamp,
    durable_steps,
    failure_key,
    fetch_step,
    step_bases,
)

_log = logging.getLogger(__name__)
RETRY_S = 1800.0  # how long a drain is retried while the store does not answer (an outage)
RETRY_FIRST_S, RETRY_MAX_S = 1.0, 60.0  # the backoff between those tries: doubling, capped


@dataclasses.dataclass
class DrainConfig:
    """What every job of a tier does besides the copy."""

    rank: int
    commit: CommitRule  # this rank's part once its files are there (commit_rule_for)
    read_back: bool = True
    commit_timeout_s: float = 3600.0
    retry_s: float = RETRY_S


def run_drain_job(store, job: DrainJob, config: DrainConfig, progress, pace, stop=None) -> Outcome:
    """Copy this rank's files of ``job``'s step to ``store``, then do this rank's part of the
    commit (its :class:`CommitRule`). Returns the stamp of the save committed there (None where
    this rank does not learn it), a warning (retention failed after the commit, which stands)
    and the steps retention deleted; raises if the copy is not durable."""
    step_dir = step_dir_name(job.step)
    local = LocalStore(job.local_dir)
    drain_rank(local, step_dir, job.files, store, read_back=config.read_back, progress=progress, pace=pace)
    return config.commit.after_copy(store, local, job.step, step_dir, config.commit_timeout_s, stop)


def commit_rule_for(rank: int, learns_commit: bool, retention: RetentionPolicy) -> CommitRule:
    """Rank 0 commits every copy to the durable tier once every rank confirmed, then applies
    the tier's ``retention``; a rank that must learn of the commit (``learns_commit``: another
    node's leader) waits for it; any other rank's part ends with its files."""
    if rank == 0:
        return CommitWhenAllConfirmed(lambda store, step: apply_durable_retention(store, step, retention))
    return AwaitCommit() if learns_commit else LeaveCommit()


def is_outage(exc: BaseException) -> bool:
    """Whether a drain failed because the store did not answer (retried in the background),
    not because of what it was asked (a damaged local copy, a base missing there)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, StoreError):
            return exc.transient
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return False


def read_tier_pointer(store) -> Pointer | None:
    """The run's pointer mirrored on the tier (None: none there, as on tiers written before
    the mirror existed); raises :class:`StoreError` if the store does not answer."""
    size = store.size(LATEST_FILE)
    if size is None:
        return None
    if size > POINTER_LIMIT:
        raise ValueError(f"{store.where(LATEST_FILE)} is not a checkpoint pointer ({size} bytes)")
    return Pointer.decode(bytes(store.read_range(LATEST_FILE, 0, size)), store.where(LATEST_FILE))


def apply_durable_retention(store, committed_step: int, policy: RetentionPolicy) -> list[int]:
    """Delete the durable copies ``policy`` gives up now that ``committed_step`` committed there
    (:mod:`manager.retention`: never one a remaining copy refers to; newest first); returns
    their steps."""
    if policy.keep_last is None and policy.keep_every is None:
        return []
    listing = durable_steps(store)
    committed = sorted(s for s, (_name, done) in listing.items() if done)
    read: dict[int, set[int] | None] = {}  # each remaining copy's .metadata is read once

    def bases_of(s: int) -> set[int] | None:
        if s not in read:
            names = step_bases(store, step_dir_name(s))
            read[s] = None if names is None else {step_of(n) for n in names}
        return read[s]

    victims = policy.victims(committed_step, committed, bases_of)
    for s in victims:
        store.delete_checkpoint(step_dir_name(s))
    return victims


class DurableTier(CopyQueue):
    def __init__(
        self,
        url: str,
        *,
        rank: int,
        commit: CommitRule,
        read_back: bool = True,
        commit_timeout_s: float = 3600.0,
        retry_s: float = RETRY_S,
        store_options: dict | None = None,
        on_durable: Callable[[int, CommitStamp | None], None] | None = None,
        warn: Callable[[str], None] = lambda m: warnings.warn(m, stacklevel=3),
        store=None,
    ) -> None:
        super().__init__()
        self.url = url
        self.store = store if store is not None else open_store(url, **(store_options or {}))
        self.rank = rank
        self.config = DrainConfig(rank, commit, read_back, commit_timeout_s, float(retry_s))
        self._on_durable = on_durable
        self._pacer = DrainPacer()  # when the drain may start a block (tiers.drain_pacing: why)
        self._warn = warn
        self._jobs: queue.Queue[DrainJob | None] = queue.Queue()
        self._failed: dict[int, DrainJob] = {}
        self._closing = False
        self._stopping = False  # close() ended its wait: the thread ends at its next wait
        # Small objects to write before the next copy, {key: (bytes, replace)}: rank 0's mirror of
        # the pointer, and a failure note a rank could not write while the store was down (rank 0
        # waits for it, or for a confirmation). Retried while the store does not answer.
        self._small: dict[str, tuple[bytes, bool]] = {}
        self._outage_since: float | None = None  # the store stopped answering then (None: it answers)
        self._thread: threading.Thread | None = None

    # -- what is there ---------------------------------------------------------------

    def committed_steps(self) -> set[int]:
        """Steps committed on the durable tier (a listing of the store)."""
        return self.steps_by_state()[0]

    def steps_by_state(self) -> tuple[set[int], set[int]]:
        """Steps committed on the durable tier, and steps there without a commit (one listing)."""
        listing = durable_steps(self.store)
        return {s for s, (_n, c) in listing.items() if c}, {s for s, (_n, c) in listing.items() if not c}

    def commit_stamps(self, steps) -> dict[int, CommitStamp | None]:
        """Which save each durable copy of ``steps`` holds (a ranged read of its ``.metadata``'s
        tail each, 8 in flight: an object store answers each in tens of milliseconds)."""
        steps = list(steps)
        with ThreadPoolExecutor(min(8, max(1, len(steps)))) as pool:
            found = pool.map(lambda s: durable_commit_stamp(self.store, step_dir_name(s)), steps)
            return dict(zip(steps, found))

    def read_pointer(self) -> Pointer | None:
        """The run's pointer mirrored on the tier (:func:`read_tier_pointer`)."""
        return read_tier_pointer(self.store)

    def mirror_pointer(self, pointer: Pointer) -> None:
        """Rank 0: write ``pointer`` to the tier before the next copy starts (the newest one
        given wins; retried while the store does not answer, as a copy is)."""
        self._put_small(LATEST_FILE, pointer.encode(), replace=True)

    def _put_small(self, key: str, data: bytes, replace: bool) -> None:
        with self._lock:
            if self._closing:
                return
            self._small[key] = (data, replace)
            self._start_thread()
            self._idle.notify_all()

    def set_paused(self, paused: bool) -> None:
        """Hold the drain before its next block of I/O while ``paused`` (the manager: while one
        of its saves runs); a block under way finishes."""
        self._pacer.set_saving(paused)

    def save_started(self) -> None:
        """A ``save()`` began: the drain keeps a quiet guard before the next one it expects."""
        self._pacer.save_started()

    # -- draining --------------------------------------------------------------------

    def enqueue(self, step: int, local_dir: str, files: RankFiles) -> None:
        """Copy this rank's files of the committed step in ``local_dir`` in the background
        (after the steps queued before it, and after retrying those that failed)."""
        if not isinstance(files, RankFiles):
            raise CheckpointError(f"step {step}: the writer reported no files of this rank to drain")
        with self._lock:
            if self._closing:
                raise CheckpointError("the durable tier is closed")
            self._failed.pop(step, None)  # this save of the step supersedes an earlier one's failed copy
            retry = [self._failed.pop(s) for s in sorted(self._failed)]
            for job in [*retry, DrainJob(step, local_dir, files)]:
                self._queued(job.step)
                self._jobs.put(job)
            self._start_thread()
            self._idle.notify_all()  # the thread waits on this condition for work

    def _start_thread(self) -> None:
        """Under ``self._lock``: the drain thread, started once."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="dcp_datastates-drain", daemon=True)
            self._thread.start()

    def failed_steps(self) -> list[int]:
        """Steps whose drain failed and has not succeeded since (their local copies are kept)."""
        with self._lock:
            return sorted(self._failed)

    def close(self, timeout: float | None = None) -> None:
        """Wait for the drains in flight (up to ``timeout`` seconds; None: until each ended,
        its retries included) and stop the thread; raise the first unreported failure, or a
        :class:`DrainError` naming the steps that are still not durable. After a timeout the
        thread is told to stop; a copy under way may still commit on the tier (it is a whole,
        verified copy), and the join waits up to ``timeout`` again for it."""
        try:
            try:
                self.wait(timeout)
            except TimeoutError:
                with self._lock:
                    left = sorted(s for s, st in self._status.items() if st.state in (QUEUED, DRAINING))
                raise DrainError(
                    f"steps {left} are committed locally but not durable on {self.url}: their drains were still "
                    f"running (or retrying) when close() stopped waiting after {timeout} s; their local copies were kept"
                ) from None
            failed = self.failed_steps()
            if failed:
                raise DrainError(
                    f"steps {failed} are committed locally but not on the durable tier {self.url} "
                    "(their drains failed; see the warnings); their local copies were kept"
                )
        finally:
            with self._lock:
                self._closing = self._stopping = True
                thread, self._thread = self._thread, None
                self._idle.notify_all()
            if thread is not None:
                thread.join(timeout)
            if thread is None or not thread.is_alive():  # a copy still under way keeps its store
                try:  # what the thread had no time or no answer for (the last commit's pointer, normally written)
                    self._write_small()
                except Exception as exc:  # noqa: BLE001 - the copies stand; the next start mirrors the pointer
                    self._warn(f"writing the run's pointer to {self.url} failed: {exc}; the next start does it")
                self.store.close()

    def _run(self) -> None:
        lower_priority()
        while True:
            job = self._next_job()
            if job is None:
                return
            st = self._status[job.step]
            st.state = DRAINING
            t0 = time.perf_counter()
            try:
                self._drain_with_retries(job, st)
                st.state, st.error = DURABLE, None
                with self._lock:
                    self._failed.pop(job.step, None)
            except Exception as exc:  # noqa: BLE001 - reported, and retried with the next step
                st.state, st.error = FAILED, f"{type(exc).__name__}: {exc}"
                err = DrainError(f"step {job.step}: copying to the durable tier {self.url} failed: {st.error}")
                err.__cause__ = exc
                with self._lock:
                    self._failed[job.step] = job
                    self._unreported.append(err)
                # Tell rank 0, which waits for this rank's confirmation, not to wait any longer (now,
                # or once the store answers again).
                self._put_small(failure_key(step_dir_name(job.step), self.rank), st.error.encode()[:4096], replace=False)
                self._warn(f"{err}; the local copy is kept and the drain is retried after the next save")
            finally:
                st.seconds = time.perf_counter() - t0
                self._ended()

    def _next_job(self) -> DrainJob | None:
        """The next copy (None: stop), the small objects waiting written first."""
        backoff = RETRY_FIRST_S
        while True:
            with self._lock:
                while self._jobs.empty() and not self._small and not self._stopping:
                    self._idle.wait()
                if self._stopping:
                    return None
            if self._jobs.empty():
                try:
                    self._write_small()
                except Exception:  # noqa: BLE001 - tried again, with backoff, unless a copy comes first
                    self._sleep(backoff, until_job=True)
                    backoff = min(backoff * 2, RETRY_MAX_S)
                continue
            return self._jobs.get()

    def _write_small(self) -> None:
        """Write the small objects waiting; raise on the first one the store did not take (a
        failure note it refused, such as one already there, is dropped)."""
        with self._lock:
            items = list(self._small.items())
        for key, (data, replace) in items:
            try:
                (self.store.replace_bytes if replace else self.store.put_bytes)(key, data)
            except StoreError as exc:
                if replace or exc.transient:
                    raise
            with self._lock:
                if self._small.get(key) == (data, replace):  # a newer one may have come meanwhile
                    del self._small[key]
        self._answered()

    def _answered(self) -> None:
        with self._lock:
            self._outage_since = None

    def _sleep(self, seconds: float, until_job: bool = False) -> bool:
        """Wait ``seconds``, or until a copy is queued (``until_job``); False: close() ended its
        wait meanwhile, stop."""
        deadline = time.monotonic() + seconds
        with self._lock:
            while not self._stopping and (left := deadline - time.monotonic()) > 0:
                if until_job and not self._jobs.empty():
                    break
                self._idle.wait(left)
            return not self._stopping

    def _drain_with_retries(self, job: DrainJob, st: DrainStatus) -> None:
        """One copy; while the store does not answer, tried again with capped backoff until the
        outage has lasted the configured window (one window per outage, whatever the number of
        copies waiting; the small objects written first each time). Raises the last failure."""
        try:
            st.bytes_total = sum(os.path.getsize(os.path.join(job.local_dir, n)) for n in job.files.file_names())
        except OSError:
            st.bytes_total = 0
        backoff = RETRY_FIRST_S

        def progress(n: int) -> None:
            st.bytes_done += n

        while True:
            st.bytes_done, t0 = 0, time.monotonic()
            try:
                self._write_small()  # before the copy: a new node must see a rollback first
                self._drain(job, progress)
                _log.info("step %d: rank %d copied %d bytes to %s in %.3f s%s", job.step, self.rank, st.bytes_done,
                          self.url, time.monotonic() - t0, self.config.commit.done_note)
                return
            except Exception as exc:  # noqa: BLE001 - retried below, or raised
                if not is_outage(exc) or self._stopping:
                    raise
                now = time.monotonic()
                with self._lock:
                    since = self._outage_since = now if self._outage_since is None else self._outage_since
                if now - since + backoff > self.config.retry_s:
                    raise
                st.error = f"{type(exc).__name__}: {exc} (retrying until the store has not answered for {self.config.retry_s:.0f} s)"
                if not self._sleep(backoff):
                    raise
                backoff = min(backoff * 2, RETRY_MAX_S)

    def _drain(self, job: DrainJob, progress) -> None:
        stamp, warning, deleted = run_drain_job(self.store, job, self.config, progress, self._pacer.wait_for_gap,
                                                stop=lambda: self._stopping)
        self._answered()
        for s in deleted:
            _log.info("durable retention: deleted step %d from %s", s, self.url)
        with self._lock:
            for s in deleted:
                if s in self._status and self._status[s].state == DURABLE:
                    self._status[s].state = DELETED
        if warning is not None:
            self._warn(warning)
        if self.config.commit.settles and self._on_durable is not None and not self._stopping:
            self._pacer.wait_for_gap()  # it deletes local copies: freeing their pages takes a core too
            self._on_durable(job.step, stamp)

    # -- recovery and resume ------------------------------------------------------------

    def clear_incomplete(self, incomplete: set[int] | None = None) -> list[int]:
        """Rank 0, before any drain: remove what interrupted drains left of steps (their
        objects, never a committed step: each is checked again); returns the steps cleared.
        ``incomplete``: the uncommitted steps of a listing just made (None: list the store)."""
        cleared = []
        sweep = getattr(self.store, "sweep_partials", None)
        if sweep is not None:  # a file system's temporaries of copies a crash interrupted
            sweep()
        if incomplete is None:
            incomplete = self.steps_by_state()[1]
        for s in sorted(incomplete):
            if clear_incomplete_step(self.store, step_dir_name(s)):
                cleared.append(s)
        return cleared

    def reader(self, step: int, allow_pickle: bool = False, **options):
        """A reader that loads the durable copy of ``step`` in place (no local copy), through the
        tier's store (a directory's reads are the engine's, an object store's ranged reads);
        ``options``: the reader's others (how it reads once)."""
        return DataStatesReader(step_dir_name(step), store=self.store, allow_pickle=allow_pickle, **options)

    def fetch(self, step: int, local_dir: str) -> int:
        """Copy the committed durable copy of ``step`` into ``local_dir`` (``.metadata`` last),
        after the base checkpoints it refers to that the local root lacks (each with its own
        bases first, so every directory fetched is a loadable checkpoint)."""
        return self._fetch_with_bases(step_dir_name(step), local_dir, set())

    def _fetch_with_bases(self, step_dir: str, local_dir: str, seen: set[str]) -> int:
        seen.add(step_dir)
        total = 0
        for base in sorted(step_bases(self.store, step_dir) or ()):
            base_dir = os.path.join(os.path.dirname(local_dir), base)
            if base not in seen and not is_committed_directory(base_dir):
                total += self._fetch_with_bases(base, base_dir, seen)
        return total + fetch_step(self.store, step_dir, LocalStore(local_dir))
