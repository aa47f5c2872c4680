"""Starting a run: spawn its ranks, wait for them with a timeout, and never leave one behind.

The parent holds the TCP store the ranks rendezvous on and reports how the
run ended as a :class:`LaunchResult` instead of raising, because a failed
run (the simulated crash included) is an outcome the scenario checks. Each
rank watches its parent and exits if the parent dies, and a rank that
finished leaves without interpreter finalization (see :func:`_rank_entry`).
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import sys
import threading
import time
import warnings

import torch.distributed as dist
import torch.multiprocessing as mp

from dcp_datastates.demo.run_spec import RunSpec
from dcp_datastates.demo.training import run_rank

PARENT_DIED_EXIT = 70  # exit status of a rank whose launcher is gone


@dataclasses.dataclass
class LaunchResult:
    ok: bool
    exit_code: int | None = None
    failed_rank: int | None = None
    error: str | None = None
    seconds: float = 0.0


def launch(spec: RunSpec, timeout_s: float) -> LaunchResult:
    """Spawn ``spec.world`` ranks and wait for them (with a timeout); never raises for worker errors."""
    store = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False,
        timeout=datetime.timedelta(seconds=spec.pg_timeout_s),
    )  # port 0: the OS picks a free port, and this process holds it while the ranks run
    spec = dataclasses.replace(spec, store_port=store.port)
    t0 = time.monotonic()
    ctx = mp.start_processes(_rank_entry, args=(spec, os.getpid()), nprocs=spec.world, join=False,
                             start_method="spawn")
    try:
        while not ctx.join(timeout=0.5, grace_period=10.0):
            if time.monotonic() - t0 > timeout_s:
                _kill(ctx)
                return LaunchResult(False, error=f"timed out after {timeout_s:.0f} s", seconds=time.monotonic() - t0)
        return LaunchResult(True, exit_code=0, seconds=time.monotonic() - t0)
    except mp.ProcessRaisedException as exc:
        return LaunchResult(False, exit_code=1, failed_rank=exc.error_index, error=str(exc),
                            seconds=time.monotonic() - t0)
    except mp.ProcessExitedException as exc:
        return LaunchResult(False, exit_code=exc.exit_code, failed_rank=exc.error_index, error=str(exc),
                            seconds=time.monotonic() - t0)
    finally:
        _kill(ctx)
        del store


def _kill(ctx) -> None:
    for p in ctx.processes:
        if p.is_alive():
            p.terminate()
    for p in ctx.processes:
        p.join(5)
        if p.is_alive():
            p.kill()
            p.join()


def _rank_entry(rank: int, spec: RunSpec, parent_pid: int) -> None:
    """What a spawned process runs: :func:`run_rank`, with its errors made reportable and a clean exit."""
    warnings.filterwarnings("ignore", category=UserWarning, module=r"torch\.distributed")
    warnings.filterwarnings("ignore", category=FutureWarning)
    _exit_with_parent(parent_pid)
    try:
        run_rank(rank, spec)  # an exception propagates: torch.multiprocessing reports it to the parent
    except Exception:
        raise
    except BaseException as exc:
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        # DCP's CheckpointException is a BaseException, which torch.multiprocessing does not
        # report (the parent would only see "exit code 1"): re-raise it as an Exception.
        raise RuntimeError(f"rank {rank}: {type(exc).__name__}: {exc}") from exc
    # Success: the process group is destroyed, the log closed and every checkpoint committed.
    # Leave without interpreter finalization: gloo's worker threads outlive
    # destroy_process_group (FSDP and DTensor objects still reference the group) and one
    # that drops its last collective while Python finalizes aborts the process
    # ("terminate called without an active exception", SIGABRT: the worker thread
    # destroys the finished work, whose tensors need the GIL, while the interpreter is
    # finalizing; torch 2.13, about 1 exit in 10 on a loaded 2-core machine).
    # os._exit skips that race.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _exit_with_parent(parent_pid: int) -> None:
    """A rank whose launcher died exits instead of waiting for its peers until the timeouts."""

    def watch() -> None:
        while True:
            if os.getppid() != parent_pid:
                os._exit(PARENT_DIED_EXIT)
            time.sleep(1.0)

    threading.Thread(target=watch, name="demo-parent-watch", daemon=True).start()
