"""Lazy snapshots: what ``DataStatesWriter.stage()`` starts and returns at once.

``stage(state_dict)`` must not take time proportional to the bytes of the
state. It walks the state dict once (per-tensor work only), places every
distinct tensor in the rank's data file, creates that file and hands the
engine one region per tensor; the engine copies them into its bounded host
pool and flushes them to the file in the background (back-pressure when the
pool is full). Offsets are fixed here, before DCP plans, so a state larger
than the pool streams to disk while training continues.

What DCP later plans and saves is the *staged* state dict: the same
structure, with tensors that alias the caller's (for metadata only: their
bytes are taken from the snapshot, never read again) and deep copies of
every non-tensor value (DCP pickles those later, after training has moved
on). Tensors are matched to the snapshot by memory address, dtype, shape
and strides, so any planner that saves the staged entries as they are works.

Consistency is checked, not assumed: the version counter of every tensor is
recorded here and compared once the copies are complete; an in-place change
in between fails the save instead of committing a torn checkpoint.
"""

from __future__ import annotations

import atexit
import copy
import os
import queue
import sys
import threading
import time
from collections.abc import Mapping
from concurrent.futures import Future
from typing import Any

import torch

from dcp_datastates.native.engine import stop_write_job
from dcp_datastates.errors import CheckpointError, SnapshotMutatedError
from dcp_datastates.format.rank_index import data_file_name, index_file_name
from dcp_datastates.core.layout import PAGE, align_up, new_save_id, place_tensors
from dcp_datastates.core.providers import TensorSource, finish_regions, local_tensor, tensor_source
from dcp_datastates.core.sequencer import SEQUENCER

_IMMUTABLE = (int, float, complex, bool, str, bytes, type(None), torch.dtype, torch.device, torch.Size)


def source_key(t: torch.Tensor) -> tuple:
    """What identifies a tensor's bytes: the same key means the same bytes."""
    return (t.device, t.data_ptr(), t.dtype, tuple(t.shape), tuple(t.stride()))


class StagingFuture(Future):
    """The future ``stage()`` returns; it also remembers which thread consumed it.

    DCP's async executor calls ``result()`` on it in the thread that then
    runs the save, which is how the writer pairs a save with its snapshot.
    Our own waits (the fence) use ``concurrent.futures.wait`` instead.

    Claiming (any ``result()`` call outside the staging monitor) and giving
    the snapshot up (see ``_abandon_if_unclaimed``) exclude each other: a
    snapshot whose save has begun is never given up, and a save whose
    snapshot was given up fails instead of saving tensors that have moved on.
    """

    def __init__(self) -> None:
        super().__init__()
        self.consumer: int | None = None
        self._claim_lock = threading.Lock()
        self._claimed = False
        self._abandoned = False

    def try_abandon(self) -> bool:
        with self._claim_lock:
            if self._claimed or self.consumer is not None:
                return False
            self._abandoned = True
            return True

    def result(self, timeout=None):
        me = threading.get_ident()
        if me == _MONITOR.ident or _called_from_dcp_staging_callback():
            # The monitor, and dcp.async_save's done-callback (which only forwards
            # completion and may run in the caller's thread), do not run the save.
            return super().result(timeout)
        with self._claim_lock:
            if self._abandoned:
                raise CheckpointError(
                    f"this asynchronous snapshot was given up: its save had not begun {ABANDON_AFTER_S:g} s "
                    "after its staging completed while later saves waited, so nothing was saved (the "
                    "tensors may have changed since); save again"
                )
            self._claimed = True
        value = super().result(timeout)
        if self.consumer is None:
            self.consumer = me
        return value


def _called_from_dcp_staging_callback() -> bool:
    code = sys._getframe(2).f_code
    return code.co_name == "callback" and code.co_filename.endswith("state_dict_saver.py")


class Snapshot:
    """One rank's lazy copy of a state dict, on its way into one data file."""

    def __init__(self, directory: str, rank: int, compression=None) -> None:
        self.directory = directory
        self.rank = rank
        self.save_id = new_save_id()
        self.data_file = data_file_name(rank, self.save_id)
        self.index_file = index_file_name(rank, self.save_id)
        # Compressed saves stage raw bytes into a file of their own (a rank file name with
        # another save id, so a crash leaves a recognisable stray); the save compresses it
        # into ``data_file`` and removes it (see compression.py).
        self.compression = compression
        self.staging_file = data_file_name(rank, new_save_id()) if compression is not None else None
        self.staged_dict: Any = None
        self.placed: dict[tuple, tuple[int, int]] = {}  # source_key -> (offset, nbytes)
        self.tensor_bytes_end = 0
        self.job = None
        self.future = StagingFuture()
        self.ticket = -1
        self.thread: threading.Thread | None = None  # the thread running DCP's save of it
        self.abandoned = False  # staged, but DCP never ran its save (see _StagingMonitor)
        self.ended = False  # its save committed or failed: see release()
        self.resolved_at: float | None = None
        self.staging_error: BaseException | None = None
        self.stage_call_s = 0.0  # seconds the caller spent in stage()
        self.staged_s = 0.0  # seconds from capture to every byte out of the caller's tensors
        self._versions: list[tuple[str, torch.Tensor, int]] = []

    @property
    def data_path(self) -> str:
        return os.path.join(self.directory, self.data_file)

    @property
    def index_path(self) -> str:
        return os.path.join(self.directory, self.index_file)

    @property
    def staging_path(self) -> str:
        """The file the engine writes the snapshot's raw tensors to."""
        return os.path.join(self.directory, self.staging_file or self.data_file)

    # -- capture (caller's thread) ----------------------------------------------

    def capture(self, state_dict: Any, engine, direct_io: str) -> None:
        self._t_capture = time.perf_counter()
        sources: list[TensorSource] = []
        index: dict[tuple, int] = {}

        def on_tensor(value: torch.Tensor, name: str) -> torch.Tensor:
            local = local_tensor(value)
            try:
                key = source_key(local)
            except RuntimeError as exc:  # tensor subclasses without storage
                raise TypeError(f"state dict entry {name!r} ({type(value).__name__}) has no plain storage to save") from exc
            if key not in index:
                index[key] = len(sources)
                sources.append(tensor_source(value, name))
                self._versions.append((name, local, local._version))
            # Staged entries alias the caller's memory (metadata only). A plain
            # tensor is detached so that reassigning ``param.data`` later does
            # not change what the staged entry points at.
            return value if local is not value else value.detach()

        self.staged_dict = _copy_structure(state_dict, on_tensor, "")
        offsets, self.tensor_bytes_end = place_tensors([s.nbytes for s in sources])
        self.placed = {k: (offsets[i], sources[i].nbytes) for k, i in index.items()}
        regions, keep = finish_regions(list(zip(sources, offsets)))
        staging_only = self.compression is not None  # a scratch file, compressed into the data file and removed
        self.job = engine.write(
            self.staging_path, regions, keep, preallocate=self.tensor_bytes_end,
            # Buffered and never fsynced: read back at once (from the page cache) and removed.
            direct_io="off" if staging_only else direct_io, durable=not staging_only,
        )

    @property
    def objects_base(self) -> int:
        return align_up(self.tensor_bytes_end, PAGE)

    def location_of(self, value: torch.Tensor) -> tuple[int, int] | None:
        try:
            return self.placed.get(source_key(local_tensor(value)))
        except RuntimeError:
            return None

    # -- completion (monitor thread) --------------------------------------------

    def await_staged(self) -> None:
        """Wait until every byte left the caller's tensors; record why not, if so."""
        ok = self.job.wait_staged()
        self.staged_s = time.perf_counter() - self._t_capture
        if not ok:
            return  # the job's own error (file, offset, errno) is raised by write_data
        changed = [name for name, t, v in self._versions if t._version != v]
        self._versions = []
        if changed:
            shown = ", ".join(repr(n) for n in changed[:5]) + (f" and {len(changed) - 5} more" if len(changed) > 5 else "")
            self.staging_error = SnapshotMutatedError(
                f"{len(changed)} tensor(s) were modified in place while the snapshot for {self.directory} "
                f"was still copying them ({shown}); the save is failed rather than committing a torn "
                "checkpoint. Wait for the staging future, or use dcp_datastates.install_fence(optimizer), "
                "before the optimizer step."
            )

    def release(self) -> None:
        """The save of this snapshot ended: drop what it held (aliases of the caller's
        tensors, the engine job), so a writer used for thousands of saves holds nothing."""
        self.ended = True
        self.staged_dict = None
        self.future._result = None  # the future's result is the staged dict too
        self.placed = {}
        self._versions = []
        self.job = None

    def cancel(self, why: str) -> None:
        """Stop the engine job and remove this snapshot's files (the save failed)."""
        from dcp_datastates.core.commit import remove_if_present

        stop_write_job(self.job, why)
        remove_if_present([self.data_path, self.index_path, self.staging_path])


def _copy_structure(obj: Any, on_tensor, name: str) -> Any:
    """The state dict's structure with tensors passed to ``on_tensor`` and other values copied."""
    if isinstance(obj, torch.Tensor):
        return on_tensor(obj, name)
    if isinstance(obj, Mapping):
        items = [(k, _copy_structure(v, on_tensor, f"{name}.{k}" if name else str(k))) for k, v in obj.items()]
        if type(obj) is dict:
            return dict(items)
        out = copy.copy(obj)
        for k, v in items:
            out[k] = v
        return out
    if isinstance(obj, list):
        return [_copy_structure(v, on_tensor, f"{name}.{i}") for i, v in enumerate(obj)]
    if isinstance(obj, tuple):
        values = [_copy_structure(v, on_tensor, f"{name}.{i}") for i, v in enumerate(obj)]
        return type(obj)(*values) if hasattr(obj, "_fields") else type(obj)(values)
    if isinstance(obj, _IMMUTABLE):
        return obj
    try:
        return copy.deepcopy(obj)
    except Exception as exc:
        raise TypeError(
            f"state dict entry {name!r} ({type(obj).__name__}) cannot be copied for an asynchronous "
            f"snapshot: {exc}"
        ) from exc


class _StagingMonitor:
    """One daemon thread that completes snapshots' staging futures, in order.

    A future completes when its snapshot's bytes have left the caller's
    tensors and every earlier save has begun (so DCP runs saves in the order
    they were staged, the same on every rank). A failed snapshot still
    completes its future successfully: the caller may mutate its tensors,
    and the failure is raised by the save (``write_data``) on this rank,
    which DCP turns into a failed checkpoint on every rank instead of
    leaving the other ranks waiting in a collective.
    """

    def __init__(self) -> None:
        self._q: queue.Queue[Snapshot] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self.ident: int | None = None
        self.in_hand: Snapshot | None = None  # the snapshot whose staging it is waiting for

    def submit(self, snap: Snapshot) -> None:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="dcp_datastates-staging", daemon=True)
                self._thread.start()
        self._q.put(snap)

    def _run(self) -> None:
        self.ident = threading.get_ident()
        unbegun: list[Snapshot] = []  # resolved, their save not begun yet
        while True:
            snap = self._q.get()
            self.in_hand = snap
            try:
                snap.await_staged()
            except BaseException as exc:  # noqa: BLE001 - delivered through the save
                snap.staging_error = exc
            self.in_hand = None
            while not SEQUENCER.wait_turn(snap.ticket, timeout=0.5):
                unbegun = [s for s in unbegun if s.thread is None and not s.abandoned]
                for s in unbegun:
                    _abandon_if_unclaimed(s)
            snap.resolved_at = time.monotonic()
            unbegun = [s for s in unbegun if s.thread is None and not s.abandoned]
            unbegun.append(snap)
            snap.future.set_result(snap.staged_dict)
            del snap  # an idle monitor holds no snapshot (and no alias of the caller's tensors)

    def cancel_unbegun_at_exit(self, timeout: float = 10.0) -> None:
        """At interpreter exit: stop the snapshots still staging or queued, and wait until
        this (daemon) thread has left the engine's wait.

        Python's exit has joined every non-daemon thread by then (DCP's
        executor too), so no save can begin any more; a snapshot staged with
        ``stage()`` and never saved is all that can remain. Were this thread
        still blocked in the engine when the interpreter finalizes, it would
        be unwound through C++ frames and the process aborted (SIGABRT).
        """
        queued = []
        while True:
            try:
                queued.append(self._q.get_nowait())
            except queue.Empty:
                break
        current = self.in_hand
        for snap in ([current] if current is not None else []) + queued:
            if snap.thread is None and snap.job is not None:
                snap.cancel("the interpreter exited before this snapshot's save began")
        deadline = time.monotonic() + timeout
        while self.in_hand is not None and time.monotonic() < deadline:
            time.sleep(0.005)


def _cancel_unbegun_at_exit() -> None:
    _MONITOR.cancel_unbegun_at_exit()


# A resolved staging future is consumed by DCP's executor thread within
# milliseconds; one nobody consumed for this long belongs to a dcp.async_save
# that raised after stage() (for example a refused executor type). Its save
# will never begin, so it must not hold later saves back.
ABANDON_AFTER_S = 10.0


def _abandon_if_unclaimed(snap: Snapshot) -> None:
    if snap.future.consumer is not None or snap.resolved_at is None:
        return
    if time.monotonic() - snap.resolved_at < ABANDON_AFTER_S:
        return
    if _submitted_to_dcp(snap.future) or not snap.future.try_abandon():
        return  # its save will run: a starved executor thread, not a dropped save
    snap.abandoned = True
    snap.cancel("dcp.async_save never ran the save of this snapshot")
    SEQUENCER.abandon(snap.ticket)


def _submitted_to_dcp(future: StagingFuture) -> bool:
    """Whether DCP's thread executor holds ``future`` for a save it has not started yet.

    Its work item keeps the keyword arguments of ``save_wrapper``; a
    dcp.async_save that raised after ``stage()`` never got that far.
    """
    import gc

    return any(
        isinstance(r, dict) and r.get("staging_future_or_state_dict") is future for r in gc.get_referrers(future)
    )


_MONITOR = _StagingMonitor()
atexit.register(_cancel_unbegun_at_exit)


def submit(snap: Snapshot) -> None:
    _MONITOR.submit(snap)


def _new_monitor_after_fork() -> None:
    """In a fork child: the parent's monitor thread, its queued snapshots (whose
    engine jobs run in the parent) and its locks stay behind; start empty, and
    forget the parent monitor's thread id, which a new thread here may reuse."""
    global _MONITOR
    _MONITOR = _StagingMonitor()


os.register_at_fork(after_in_child=_new_monitor_after_fork)
