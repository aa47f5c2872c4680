"""The manager's durable tier: background drains, their status, retention there, and fetches.

``CheckpointManager(root, durable=URL)`` keeps committing every save in
``root`` (the fast tier, as before) and hands each committed step to a
:class:`DurableTier`, whose one background thread per rank copies the
rank's files to ``URL`` (:func:`tiers.drain.drain_rank`) and, on rank 0,
commits the copy there once every rank confirmed (:func:`commit_durable`).
The training loop never waits for it: a save returns as before, and a
drain that fails is retried with the next step's and reported by
:meth:`DurableTier.wait` (and so by ``CheckpointManager.wait_durable`` and
``close``); the local copy of a step that is not durable yet is kept.

Retention on the durable tier (``keep_last``, ``keep_every``) runs on rank 0
after each durable commit, newest commits kept, ``.metadata`` deleted first.
"""

from __future__ import annotations

import dataclasses
import os
import queue
import threading
import time
import warnings
from collections.abc import Callable

from dcp_datastates.core.fence import snapshots_in_flight
from dcp_datastates.errors import CheckpointError
from dcp_datastates.format.checkpoint_layout import RankFiles
from dcp_datastates.manager.checkpoint_root import step_dir_name, step_of
from dcp_datastates.manager.cleanup import retention_keeps
from dcp_datastates.tiers import open_store
from dcp_datastates.tiers.drain import (
    DrainError,
    clear_incomplete_step,
    commit_durable,
    delete_durable_step,
    drain_rank,
    durable_steps,
    failure_key,
    fetch_step,
)

QUEUED, DRAINING, DURABLE, FAILED = "queued", "draining", "durable", "failed"


@dataclasses.dataclass
class DrainStatus:
    """Where one step's copy to the durable tier stands, on this rank."""

    step: int
    state: str = QUEUED  # queued, draining, durable (rank 0: committed there; others: confirmed), failed
    bytes_done: int = 0
    bytes_total: int = 0
    seconds: float = 0.0
    error: str | None = None


@dataclasses.dataclass
class _Job:
    step: int
    local_dir: str
    files: RankFiles


def _yield_to(busy: Callable[[], bool] | None) -> Callable[[], None]:
    """What the drain runs before each block: wait while a snapshot copies training state (the
    optimizer's fence may be waiting for it) or ``busy()`` says a save is still writing the
    fast tier (its copies free the host cache the next snapshot needs): the drain must not
    take the cores, memory bandwidth or disk those need."""

    def pace() -> None:
        while snapshots_in_flight() or (busy is not None and busy()):
            time.sleep(0.002)

    return pace


def _lower_priority() -> None:
    """The drain thread runs at the lowest CPU priority (nice 19; Linux applies it to this
    thread only): the training loop and the save's own threads come first."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (OSError, AttributeError):  # not permitted, or not Linux: the drain still pauses for snapshots
        pass


class DurableTier:
    def __init__(
        self,
        url: str,
        *,
        rank: int,
        keep_last: int | None = None,
        keep_every: int | None = None,
        read_back: bool = True,
        commit_timeout_s: float = 3600.0,
        store_options: dict | None = None,
        on_durable: Callable[[int], None] | None = None,
        busy: Callable[[], bool] | None = None,
        warn: Callable[[str], None] = lambda m: warnings.warn(m, stacklevel=3),
    ) -> None:
        for name, value in (("durable_keep_last", keep_last), ("durable_keep_every", keep_every)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"{name} must be a positive int or None, got {value!r}")
        self.url = url
        self.store = open_store(url, **(store_options or {}))
        self.rank = rank
        self.keep_last = keep_last
        self.keep_every = keep_every
        self.read_back = read_back
        self.commit_timeout_s = commit_timeout_s
        self._on_durable = on_durable
        self._pace = _yield_to(busy)
        self._warn = warn
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._jobs: queue.Queue[_Job | None] = queue.Queue()
        self._pending = 0
        self._status: dict[int, DrainStatus] = {}
        self._failed: dict[int, _Job] = {}
        self._unreported: list[DrainError] = []
        self._closing = False
        self._thread: threading.Thread | None = None

    # -- what is there ---------------------------------------------------------------

    def committed_steps(self) -> set[int]:
        """Steps committed on the durable tier (a listing of the store)."""
        return {s for s, (_name, committed) in durable_steps(self.store, step_of).items() if committed}

    def incomplete_steps(self) -> set[int]:
        return {s for s, (_name, committed) in durable_steps(self.store, step_of).items() if not committed}

    def status(self) -> dict[int, DrainStatus]:
        with self._lock:
            return {s: dataclasses.replace(st) for s, st in self._status.items()}

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
            for job in [*retry, _Job(step, local_dir, files)]:
                self._status[job.step] = DrainStatus(job.step)
                self._pending += 1
                self._jobs.put(job)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="dcp_datastates-drain", daemon=True)
                self._thread.start()

    def wait(self, timeout: float | None = None) -> None:
        """Wait until every queued drain ended; raise (once) the first failure not yet raised."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while self._pending:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(f"drains to {self.url} still running after {timeout} s")
                self._idle.wait(left)
        self.raise_errors()

    def raise_errors(self) -> None:
        with self._lock:
            errors, self._unreported = self._unreported, []
        if errors:
            raise errors[0]

    def failed_steps(self) -> list[int]:
        """Steps whose drain failed and has not succeeded since (their local copies are kept)."""
        with self._lock:
            return sorted(self._failed)

    def close(self) -> None:
        """Wait for the drains in flight and stop the thread; raise the first unreported failure,
        or a :class:`DrainError` naming the steps that are still not durable."""
        try:
            self.wait()
            failed = self.failed_steps()
            if failed:
                raise DrainError(
                    f"steps {failed} are committed locally but not on the durable tier {self.url} "
                    "(their drains failed; see the warnings); their local copies were kept"
                )
        finally:
            with self._lock:
                self._closing = True
                thread, self._thread = self._thread, None
            if thread is not None:
                self._jobs.put(None)
                thread.join()
            self.store.close()

    def _run(self) -> None:
        _lower_priority()
        while True:
            job = self._jobs.get()
            if job is None:
                return
            st = self._status[job.step]
            st.state = DRAINING
            try:
                st.bytes_total = sum(os.path.getsize(os.path.join(job.local_dir, n)) for n in (*job.files.data_files(), job.files.index_file))
            except OSError:
                st.bytes_total = 0
            t0 = time.perf_counter()

            def progress(n: int, st=st) -> None:
                st.bytes_done += n

            try:
                self._drain(job, progress)
                st.state = DURABLE
                with self._lock:
                    self._failed.pop(job.step, None)
            except Exception as exc:  # noqa: BLE001 - reported, and retried with the next step
                st.state, st.error = FAILED, f"{type(exc).__name__}: {exc}"
                err = DrainError(f"step {job.step}: copying to the durable tier {self.url} failed: {st.error}")
                err.__cause__ = exc
                with self._lock:
                    self._failed[job.step] = job
                    self._unreported.append(err)
                try:  # tell rank 0, which waits for this rank's confirmation, not to wait any longer
                    self.store.put_bytes(failure_key(step_dir_name(job.step), self.rank), st.error.encode()[:4096])
                except Exception:  # noqa: BLE001 - rank 0 then waits until its timeout
                    pass
                self._warn(f"{err}; the local copy is kept and the drain is retried after the next save")
            finally:
                st.seconds = time.perf_counter() - t0
                with self._lock:
                    self._pending -= 1
                    self._idle.notify_all()

    def _drain(self, job: _Job, progress) -> None:
        step_dir = step_dir_name(job.step)
        drain_rank(job.local_dir, step_dir, job.files, self.store, read_back=self.read_back, progress=progress,
                   pace=self._pace)
        if self.rank != 0:
            return
        commit_durable(job.local_dir, step_dir, self.store, timeout_s=self.commit_timeout_s)
        try:
            self._apply_retention(job.step)
        except Exception as exc:  # noqa: BLE001 - the commit stands; retention catches up next time
            self._warn(f"step {job.step} is durable in {self.url}, but retention there failed: {exc}")
        if self._on_durable is not None:
            self._on_durable(job.step)

    def _apply_retention(self, committed_step: int) -> None:
        if self.keep_last is None and self.keep_every is None:
            return
        committed = sorted(self.committed_steps())
        keep = retention_keeps(committed, committed_step, self.keep_last, self.keep_every)
        for s in committed:
            if s < committed_step and s not in keep:
                delete_durable_step(self.store, step_dir_name(s))

    # -- recovery and resume ------------------------------------------------------------

    def clear_incomplete(self, keep: set[int] = frozenset()) -> list[int]:
        """Rank 0, before any drain: remove what interrupted drains left of steps (their
        objects, never a committed step); returns the steps cleared."""
        cleared = []
        sweep = getattr(self.store, "sweep_partials", None)
        if sweep is not None:  # a file system's temporaries of copies a crash interrupted
            sweep()
        for s in sorted(self.incomplete_steps()):
            if clear_incomplete_step(self.store, step_dir_name(s)):
                cleared.append(s)
        return cleared

    def fetch(self, step: int, local_dir: str) -> int:
        """Copy the committed durable copy of ``step`` into ``local_dir`` (``.metadata`` last)."""
        return fetch_step(self.store, step_dir_name(step), local_dir)
