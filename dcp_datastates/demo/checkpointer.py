"""Checkpointer: the training loop's checkpoints, through ours or DCP's writer, and what each cost.

Both writers go through ``dcp.async_save`` on a gloo group of their own
(training runs its FSDP collectives on the default group at the same time):

- ours: a ``CheckpointManager`` (``DataStatesWriter`` into ``step_<N>``
  directories, the ``latest`` pointer, retention). The call returns at once;
  the snapshot copies while the next forward/backward run, and the optimizer
  step pre-hook (the fence, what ``dcp_datastates.install_fence`` installs)
  waits only while it is still copying;
- the baseline: DCP's default ``FileSystemWriter``, which stages by copying
  the whole state inside the call.

The time the loop was blocked is the call (with get_state_dict) plus every
fence wait; "durable" is from the call until the upload future completed
(data fsynced, ``.metadata`` committed). A new save first waits for the
previous upload (DCP needs it; the wait counts as blocked). Each rank
measures its own save; rank 0 merges them (the slowest rank counts), logs a
``ckpt`` record and prints one line.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint import FileSystemWriter

from dcp_datastates import CheckpointManager, wait_for_snapshots
from dcp_datastates.demo.checkpoint_dirs import dir_bytes, step_dir
from dcp_datastates.demo.host_memory import peak_rss_mb, reset_peak_rss, rss_mb
from dcp_datastates.demo.run_spec import RunSpec
from dcp_datastates.demo.train_state import build_state


@dataclasses.dataclass
class _SaveTiming:
    """One rank's measurements of one checkpoint, from the call until it is durable."""

    step: int
    path: str
    writer: Any  # the writer, or the manager's future that carries its stats
    t0: float  # when the save began (after waiting for the previous one)
    previous_wait_s: float
    state_dict_s: float
    save_call_s: float
    rss_before_mb: float
    peak_rss_mb: float
    hwm_reset: bool
    fence_wait_s: float = 0.0
    durable_at: float | None = None
    final_wait_s: float = 0.0

    @property
    def blocked_s(self) -> float:
        return self.previous_wait_s + self.state_dict_s + self.save_call_s + self.fence_wait_s

    @property
    def durable_s(self) -> float:
        return self.durable_at - self.t0


class Checkpointer:
    """Checkpoints the training state every K steps with ``dcp.async_save`` and records the cost."""

    def __init__(self, spec: RunSpec, rank: int, log, optim: torch.optim.Optimizer) -> None:
        self.spec = spec
        self.rank = rank
        self.log = log
        self.group = dist.new_group(backend="gloo")
        self._pending: Any = None  # (upload future, timing, state) of the save in flight
        self._fencing: _SaveTiming | None = None  # the save whose snapshot may still be copying
        self.manager = None
        if spec.writer == "datastates":
            # fence=False: the demo installs the same fence itself (below) to time its waits.
            self.manager = CheckpointManager(
                spec.ckpt_root, keep_last=spec.keep_last, async_save=True, process_group=self.group,
                host_cache_bytes=spec.host_cache_bytes, io_threads=spec.io_threads, direct_io=spec.direct_io,
                fence=False,
            )
        optim.register_step_pre_hook(self._fence_hook)

    def _fence_hook(self, *_args) -> None:
        """Optimizer step pre-hook: wait while a snapshot still reads the parameters."""
        timing = self._fencing
        if timing is None:
            return
        t0 = time.perf_counter()
        wait_for_snapshots()
        timing.fence_wait_s += time.perf_counter() - t0
        self._fencing = None

    def save(self, step: int, model: nn.Module, optim: torch.optim.Optimizer) -> None:
        t_prev = time.perf_counter()
        self.wait()  # at most one save in flight
        path = step_dir(self.spec.ckpt_root, step)
        rss_before = rss_mb()
        hwm_reset = reset_peak_rss()
        t0 = time.perf_counter()
        state = build_state(step, model, optim, self.spec)
        t1 = time.perf_counter()
        if self.manager is not None:
            upload = writer = self.manager.save(step, state)  # its future carries the writer's stats
        else:
            upload, writer = _dcp_baseline_save(state, path, self.group)
        t2 = time.perf_counter()
        timing = _SaveTiming(
            step=step, path=path, writer=writer, t0=t0, previous_wait_s=t0 - t_prev, state_dict_s=t1 - t0,
            save_call_s=t2 - t1, rss_before_mb=rss_before, peak_rss_mb=peak_rss_mb(), hwm_reset=hwm_reset,
        )
        upload.add_done_callback(lambda _f, t=timing: setattr(t, "durable_at", time.perf_counter()))
        self._fencing = timing
        self._pending = (upload, timing, state)

    def wait(self) -> None:
        """Wait for the save in flight to be durable and report it."""
        if self._pending is None:
            return
        upload, timing, _state = self._pending
        self._pending = None
        t0 = time.perf_counter()
        upload.result()
        timing.final_wait_s = time.perf_counter() - t0
        while timing.durable_at is None:  # the done-callback runs right after result() returns
            time.sleep(0.001)
        timing.peak_rss_mb = max(timing.peak_rss_mb, peak_rss_mb())
        self._complete(timing)

    def close(self) -> None:
        """Wait for the last save, then close the manager (ours)."""
        self.wait()
        if self.manager is not None:
            self.manager.close()

    def _complete(self, timing: _SaveTiming) -> None:
        writer = timing.writer
        timing.writer = None
        if hasattr(writer, "close"):
            writer.close()
        stats = getattr(writer, "last_save_stats", None)
        ranks: list[Any] = [None] * self.spec.world
        dist.all_gather_object(ranks, _rank_cost(timing, stats))
        if self.rank != 0:
            return
        total = dir_bytes(timing.path)
        out = {"kind": "ckpt", "run": self.spec.name, "writer": self.spec.writer, "world": self.spec.world,
               "step": timing.step, **_merged_cost(ranks, total, with_stats=stats is not None)}
        self.log(out)
        print(
            f"[{self.spec.name} W={self.spec.world}] checkpoint step {timing.step}: "
            f"{total / 1e6:.1f} MB, blocked {out['blocked_s'] * 1e3:.1f} ms, "
            f"durable after {out['durable_s'] * 1e3:.0f} ms ({out['durable_gbps']:.3f} GB/s), "
            f"peak RSS {out['peak_rss_mb']:.0f} MB ({self.spec.writer})",
            flush=True,
        )


def _dcp_baseline_save(state: dict, path: str, group) -> tuple[Any, FileSystemWriter]:
    """DCP's default asynchronous save with ``FileSystemWriter``: (its upload future, the writer)."""
    writer = FileSystemWriter(path)
    resp = dcp.async_save(state, storage_writer=writer, process_group=group)
    return getattr(resp, "upload_completion", resp), writer


def _rank_cost(timing: _SaveTiming, stats) -> dict:
    """What this rank sends rank 0 about one checkpoint (plain values: it is pickled)."""
    mine = {
        "blocked_s": timing.blocked_s,
        "durable_s": timing.durable_s,
        "fence_wait_s": timing.fence_wait_s,
        "state_dict_s": timing.state_dict_s,
        "save_call_s": timing.save_call_s,
        "peak_rss_mb": timing.peak_rss_mb,
        "rss_before_mb": timing.rss_before_mb,
        "hwm_reset": timing.hwm_reset,
    }
    if stats is not None:
        mine["writer_bytes"] = stats.bytes_written
        mine["data_write_s"] = stats.data_write_s
        mine["commit_s"] = stats.commit_s
        mine["direct_io"] = stats.direct_io
    return mine


def _merged_cost(ranks: list[dict], total: int, *, with_stats: bool) -> dict:
    """One checkpoint's cost over all ranks: the slowest rank's times, the largest memory, ``total`` bytes."""
    blocked = max(r["blocked_s"] for r in ranks)
    durable = max(r["durable_s"] for r in ranks)
    out = {
        "durable_s": durable,
        "fence_wait_s": max(r["fence_wait_s"] for r in ranks),
        "durable_gbps": total / durable / 1e9 if durable > 0 else float("nan"),
        "bytes": total,
        "blocked_s": blocked,
        "state_dict_s": max(r["state_dict_s"] for r in ranks),
        "gbps": total / blocked / 1e9 if blocked > 0 else float("nan"),
        "peak_rss_mb": max(r["peak_rss_mb"] for r in ranks),
        "rss_before_mb": max(r["rss_before_mb"] for r in ranks),
        "rss_growth_mb": max(r["peak_rss_mb"] - r["rss_before_mb"] for r in ranks),
        "hwm_reset": all(r["hwm_reset"] for r in ranks),
    }
    if with_stats:
        out["writer_bytes"] = sum(r["writer_bytes"] for r in ranks)
        out["direct_io"] = all(r["direct_io"] for r in ranks)
    return out
