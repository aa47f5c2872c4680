"""The training script: one rank of a run, FSDP2 training that checkpoints through ``CheckpointManager``.

Every run is a fresh set of processes, each running :func:`run_rank` with a
:class:`RunSpec`. A rank joins the process group, shards the model with
FSDP2, resumes from the newest good checkpoint if asked to, trains, and
checkpoints every K steps with ``dcp.async_save``, either through a
``CheckpointManager`` (ours) or with DCP's default ``FileSystemWriter`` (the
reference run, for comparison). Rank 0 appends what happened to a JSON-lines
log, which is how results reach the parent (``__main__.py``), even across
the simulated crash.

Determinism: the global batch of a step is generated from (seed, step) alone
and cut into S fixed micro-shards; a rank of a world of W processes its S/W
shards with gradient accumulation, each loss scaled by W/S. Every world size
therefore runs the same kernels on the same shapes, and the logged loss is
summed over shards in a fixed order, which is what lets a resumed run on
another world size match the reference closely.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import sys
import threading
import time
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from dcp_datastates import CheckpointManager, CheckpointManagerOptions, wait_for_snapshots
from dcp_datastates.demo.model import ModelConfig, TinyGPT, global_batch, lr_at
from dcp_datastates.manager.checkpoint_root import step_dir_name

SIMULATED_FAILURE_EXIT = 75  # exit status of a rank that "crashed" on purpose
PARENT_DIED_EXIT = 70  # exit status of a rank whose launcher is gone


@dataclasses.dataclass
class RunSpec:
    """Everything a rank needs for one run (pickled to the spawned ranks, so plain values only)."""

    name: str
    world: int
    device: str  # "cpu" or "cuda"
    model: ModelConfig
    seed: int
    steps: int  # last step to train (inclusive)
    steps_total: int  # horizon of the learning-rate schedule (the same in every run)
    ckpt_every: int
    ckpt_root: str  # step_<N> directories go here
    writer: str  # "datastates" (a CheckpointManager) or "dcp" (FileSystemWriter)
    log_path: str  # rank 0 appends JSON lines (survives the simulated crash)
    global_batch: int
    data_shards: int
    lr: float
    warmup: int
    fail_at: int | None = None
    resume: bool = False  # start from the newest good checkpoint under ckpt_root
    keep_last: int | None = None  # CheckpointManager retention (ours)
    store_port: int = 0
    pg_timeout_s: float = 120.0
    host_cache_bytes: int = 32 << 20
    io_threads: int = 2
    direct_io: str = "auto"
    threads: int = 1
    progress_every: int = 25


def run_rank(rank: int, spec: RunSpec, parent_pid: int) -> None:
    """What a spawned process runs: join the process group, train, leave.

    An exception propagates (torch.multiprocessing reports it to the parent).
    A rank that finished leaves with ``os._exit``: gloo's worker threads
    outlive ``destroy_process_group`` (FSDP and DTensor objects still
    reference the group), and one that drops its last collective while
    Python finalizes aborts the process.
    """
    warnings.filterwarnings("ignore", category=UserWarning, module=r"torch\.distributed")
    warnings.filterwarnings("ignore", category=FutureWarning)
    _exit_with_parent(parent_pid)
    torch.set_num_threads(spec.threads)
    device, backend = _select_device(rank, spec)
    timeout = datetime.timedelta(seconds=spec.pg_timeout_s)
    store = dist.TCPStore("127.0.0.1", spec.store_port, is_master=False, timeout=timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=spec.world, timeout=timeout)
    log = RunLog(spec.log_path if rank == 0 else None)
    try:
        train(rank, spec, device, log)
    except Exception:
        raise
    except BaseException as exc:
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        # DCP's CheckpointException is a BaseException, which torch.multiprocessing does not
        # report (the parent would only see "exit code 1"): re-raise it as an Exception.
        raise RuntimeError(f"rank {rank}: {type(exc).__name__}: {exc}") from exc
    finally:
        log.close()
        if dist.is_initialized():
            dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def train(rank: int, spec: RunSpec, device: torch.device, log: RunLog) -> None:
    """The training loop: resume if asked, then forward/backward, optimizer step, a checkpoint every K steps."""
    world = spec.world
    torch.manual_seed(spec.seed)  # identical init on every rank (and in every run)
    model = TinyGPT(spec.model).to(device)
    mesh = init_device_mesh(device.type, (world,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=spec.lr, betas=(0.9, 0.95), weight_decay=0.1)
    ckpt = Checkpointer(spec, rank, log, optim)

    start = 1
    if spec.resume:
        start = ckpt.resume(model, optim) + 1
    elif rank == 0:
        n_params = sum(p.numel() for p in model.parameters())
        print(f"[{spec.name} W={world}] model: {n_params / 1e6:.2f} M parameters, device {device}", flush=True)

    per_rank, rows = spec.data_shards // world, spec.global_batch // spec.data_shards
    my_rows = {j: slice(j * rows, (j + 1) * rows) for j in range(rank * per_rank, (rank + 1) * per_rank)}
    t_last = time.perf_counter()
    for step in range(start, spec.steps + 1):
        for group in optim.param_groups:
            group["lr"] = lr_at(step, spec.lr, spec.warmup, spec.steps_total)
        x, y = global_batch(spec.seed, step, spec.global_batch, spec.model.seq_len, spec.model.vocab)
        shard_losses = torch.zeros(spec.data_shards, dtype=torch.float32, device=device)
        for i, (j, r) in enumerate(my_rows.items()):
            model.set_requires_gradient_sync(i == len(my_rows) - 1)
            loss = model(x[r].to(device), y[r].to(device))
            (loss * (world / spec.data_shards)).backward()
            shard_losses[j] = loss.detach()
        if step == spec.fail_at:
            _simulated_crash(rank, spec, step, log)
        optim.step()  # its pre-hook waits while a snapshot still reads the parameters
        optim.zero_grad(set_to_none=True)
        dist.all_reduce(shard_losses)  # each entry has one contributor: exact on any world size
        step_loss = float(shard_losses.sum().item()) / spec.data_shards  # fixed summation order
        log({"kind": "loss", "step": step, "loss": step_loss, "world": world})
        if rank == 0 and (step % spec.progress_every == 0 or step == start):
            dt = time.perf_counter() - t_last
            print(f"[{spec.name} W={world}] step {step}/{spec.steps} loss {step_loss:.4f} "
                  f"({dt:.1f} s since last report)", flush=True)
            t_last = time.perf_counter()
        if step % spec.ckpt_every == 0:
            ckpt.save(step, model, optim)
    ckpt.close()
    log({"kind": "done", "step": spec.steps, "lifetime_peak_rss_mb": peak_rss_mb()})


def training_state(step: int, model: nn.Module, optim: torch.optim.Optimizer, spec: RunSpec) -> dict:
    """What a checkpoint holds: the FSDP2 model and optimizer state dicts (DTensors sharded over
    this run's ranks), the step, the data position and the RNG. The same for both writers, so
    ours and DCP's checkpoint of a step can be compared entry by entry."""
    model_sd, optim_sd = get_state_dict(model, optim)
    data = {"seed": spec.seed, "next_step": step + 1, "global_batch": spec.global_batch,
            "samples_seen": step * spec.global_batch}
    return {"model": model_sd, "optim": optim_sd, "step": step, "data": data, "rng": {"torch": torch.get_rng_state()}}


@dataclasses.dataclass
class _SaveTiming:
    """One rank's measurements of one checkpoint, from the call until it is durable."""

    step: int
    path: str
    writer: Any  # FileSystemWriter, or the manager's future that carries its stats
    t0: float  # when the save began (after waiting for the previous one)
    previous_wait_s: float
    state_dict_s: float
    save_call_s: float
    rss_before_mb: float
    peak_rss_mb: float
    hwm_reset: bool
    fence_wait_s: float = 0.0
    durable_at: float | None = None

    def cost(self) -> dict:
        """What this rank sends rank 0 (plain values: it is pickled)."""
        stats = getattr(self.writer, "last_save_stats", None)
        mine = {
            "blocked_s": self.previous_wait_s + self.state_dict_s + self.save_call_s + self.fence_wait_s,
            "durable_s": self.durable_at - self.t0,
            "fence_wait_s": self.fence_wait_s,
            "state_dict_s": self.state_dict_s,
            "save_call_s": self.save_call_s,
            "peak_rss_mb": self.peak_rss_mb,
            "rss_before_mb": self.rss_before_mb,
            "hwm_reset": self.hwm_reset,
        }
        if stats is not None:
            mine.update(writer_bytes=stats.bytes_written, data_write_s=stats.data_write_s, commit_s=stats.commit_s,
                        direct_io=stats.direct_io)
        return mine


class Checkpointer:
    """Checkpoints the training state every K steps with ``dcp.async_save`` and records what each cost.

    Both writers use a gloo group of their own (training runs its FSDP
    collectives on the default group at the same time):

    - ours: a ``CheckpointManager`` (``DataStatesWriter`` into ``step_<N>``
      directories, the ``latest`` pointer, retention). The call returns at
      once; the snapshot copies while the next forward/backward run, and the
      optimizer step pre-hook (the fence) waits only while it is still copying;
    - the baseline: DCP's default ``FileSystemWriter``, which stages by
      copying the whole state inside the call.

    "Blocked" is the call (with get_state_dict) plus every fence wait;
    "durable" is from the call until the upload future completed (data
    fsynced, ``.metadata`` committed). A new save first waits for the
    previous upload (DCP needs it; the wait counts as blocked). Each rank
    measures its own save; rank 0 merges them (the slowest rank counts),
    logs a ``ckpt`` record and prints one line.
    """

    def __init__(self, spec: RunSpec, rank: int, log: RunLog, optim: torch.optim.Optimizer) -> None:
        self.spec = spec
        self.rank = rank
        self.log = log
        self.group = dist.new_group(backend="gloo")
        self._pending: Any = None  # (upload future, timing, state) of the save in flight
        self._fencing: _SaveTiming | None = None  # the save whose snapshot may still be copying
        self.manager = None
        if spec.writer == "datastates":
            # fence=False: the fence is installed below, the same as the manager's, to time its waits.
            options = CheckpointManagerOptions(
                keep_last=spec.keep_last, async_save=True, host_cache_bytes=spec.host_cache_bytes,
                io_threads=spec.io_threads, direct_io=spec.direct_io, fence=False,
            )
            self.manager = CheckpointManager(spec.ckpt_root, options, process_group=self.group)
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

    def resume(self, model: nn.Module, optim: torch.optim.Optimizer) -> int:
        """Load the newest committed checkpoint that loads (every byte verified) into the model and
        optimizer of this run's world size (DCP reshards the saved shards); the step it holds."""
        spec, manager = self.spec, self.manager
        t0 = time.perf_counter()
        state = training_state(-1, model, optim, spec)  # template: shapes and shardings of this world
        state["data"] = {"seed": -1, "next_step": -1, "global_batch": -1, "samples_seen": -1}
        found = manager.load(state)
        if found is None:
            raise RuntimeError(f"no committed checkpoint under {manager.root} to resume from")
        set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
        torch.set_rng_state(state["rng"]["torch"])
        step, data, path = int(state["step"]), state["data"], manager.path_of(found)
        if found != step:
            raise RuntimeError(f"{path} holds step {step}, its directory name says {found}")
        if data["seed"] != spec.seed or data["global_batch"] != spec.global_batch or data["next_step"] != step + 1:
            raise RuntimeError(f"{path}: data position {data} does not match this run (seed {spec.seed})")
        load_s = time.perf_counter() - t0
        self.log({"kind": "resumed", "from_step": step, "path": path, "load_s": load_s, "world": spec.world})
        if self.rank == 0:
            print(f"[{spec.name} W={spec.world}] loaded step {step} from {path} in {load_s:.2f} s", flush=True)
        return step

    def save(self, step: int, model: nn.Module, optim: torch.optim.Optimizer) -> None:
        t_prev = time.perf_counter()
        self.wait()  # at most one save in flight
        path = os.path.join(self.spec.ckpt_root, step_dir_name(step))
        rss_before = rss_mb()
        hwm_reset = reset_peak_rss()
        t0 = time.perf_counter()
        state = training_state(step, model, optim, self.spec)
        t1 = time.perf_counter()
        if self.manager is not None:
            upload = writer = self.manager.save(step, state)  # its future carries the writer's stats
        else:
            writer = FileSystemWriter(path)
            resp = dcp.async_save(state, storage_writer=writer, process_group=self.group)
            upload = getattr(resp, "upload_completion", resp)
        t2 = time.perf_counter()
        timing = _SaveTiming(
            step=step, path=path, writer=writer, t0=t0, previous_wait_s=t0 - t_prev, state_dict_s=t1 - t0,
            save_call_s=t2 - t1, rss_before_mb=rss_before, peak_rss_mb=peak_rss_mb(), hwm_reset=hwm_reset,
        )
        upload.add_done_callback(lambda _f, t=timing: setattr(t, "durable_at", time.perf_counter()))
        self._fencing = timing
        self._pending = (upload, timing, state)

    def wait(self) -> None:
        """Wait for the save in flight to be durable, then log and print what it cost."""
        if self._pending is None:
            return
        upload, timing, _state = self._pending
        self._pending = None
        upload.result()
        while timing.durable_at is None:  # the done-callback runs right after result() returns
            time.sleep(0.001)
        timing.peak_rss_mb = max(timing.peak_rss_mb, peak_rss_mb())
        if hasattr(timing.writer, "close"):
            timing.writer.close()
        ranks: list[Any] = [None] * self.spec.world
        dist.all_gather_object(ranks, timing.cost())
        if self.rank == 0:
            self._report(timing.step, ranks, _dir_bytes(timing.path))

    def close(self) -> None:
        """Wait for the last save, then close the manager (ours)."""
        self.wait()
        if self.manager is not None:
            self.manager.close()

    def _report(self, step: int, ranks: list[dict], total: int) -> None:
        """One checkpoint's cost over all ranks (the slowest rank's times, the largest memory) to the log."""
        spec = self.spec
        worst = {k: max(r[k] for r in ranks)
                 for k in ("blocked_s", "durable_s", "fence_wait_s", "state_dict_s", "peak_rss_mb", "rss_before_mb")}
        out = {"kind": "ckpt", "run": spec.name, "writer": spec.writer, "world": spec.world, "step": step, **worst,
               "bytes": total,
               "durable_gbps": total / worst["durable_s"] / 1e9 if worst["durable_s"] > 0 else float("nan"),
               "gbps": total / worst["blocked_s"] / 1e9 if worst["blocked_s"] > 0 else float("nan"),
               "rss_growth_mb": max(r["peak_rss_mb"] - r["rss_before_mb"] for r in ranks),
               "hwm_reset": all(r["hwm_reset"] for r in ranks)}
        if "writer_bytes" in ranks[0]:
            out["writer_bytes"] = sum(r["writer_bytes"] for r in ranks)
            out["direct_io"] = all(r["direct_io"] for r in ranks)
        self.log(out)
        print(f"[{spec.name} W={spec.world}] checkpoint step {step}: {total / 1e6:.1f} MB, "
              f"blocked {out['blocked_s'] * 1e3:.1f} ms, durable after {out['durable_s'] * 1e3:.0f} ms "
              f"({out['durable_gbps']:.3f} GB/s), peak RSS {out['peak_rss_mb']:.0f} MB ({spec.writer})", flush=True)


class RunLog:
    """Rank 0's log: JSON lines, each written and flushed as it happens (it must survive the crash).

    Records carry a ``kind``: ``loss`` (one per finished step), ``ckpt``
    (one per checkpoint, its cost merged over the ranks), ``resumed``,
    ``crash`` (just before the simulated failure) and ``done``. Other ranks'
    logs have no path and drop their records.
    """

    def __init__(self, path: str | None) -> None:
        self._file = open(path, "a") if path is not None else None

    def __call__(self, record: dict) -> None:
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


def _select_device(rank: int, spec: RunSpec) -> tuple[torch.device, str]:
    """This rank's device and the process group backend for it; deterministic kernels on CUDA."""
    if spec.device != "cuda":
        return torch.device("cpu"), "gloo"
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.cuda.set_device(rank)
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    return torch.device("cuda", rank), "nccl"


def _simulated_crash(rank: int, spec: RunSpec, step: int, log: RunLog) -> None:
    """Every rank dies here, mid-step, without cleanup: whatever was not checkpointed is lost."""
    dist.barrier()  # all ranks reach the crash point (and rank 0 has logged every finished step)
    log({"kind": "crash", "step": step})
    if rank == 0:
        print(f"[{spec.name} W={spec.world}] simulated failure during step {step}: all ranks exit now", flush=True)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(SIMULATED_FAILURE_EXIT)


def _exit_with_parent(parent_pid: int) -> None:
    """A rank whose launcher died exits instead of waiting for its peers until the timeouts."""

    def watch() -> None:
        while True:
            if os.getppid() != parent_pid:
                os._exit(PARENT_DIED_EXIT)
            time.sleep(1.0)

    threading.Thread(target=watch, name="demo-parent-watch", daemon=True).start()


def _dir_bytes(path: str) -> int:
    """The bytes of the regular files directly in ``path``: a checkpoint's size on disk."""
    return sum(e.stat(follow_symlinks=False).st_size for e in os.scandir(path) if e.is_file(follow_symlinks=False))


# Host memory: each checkpoint reports its peak RSS, so the peak is reset before each save
# (Linux's clear_refs); where that is impossible the report says it is the process peak so far.

def _status_kb(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def rss_mb() -> float:
    kb = _status_kb("VmRSS")
    return kb / 1024 if kb is not None else float("nan")


def peak_rss_mb() -> float:
    kb = _status_kb("VmHWM")
    if kb is None:  # not Linux: getrusage reports the lifetime peak (KiB on Linux, bytes on macOS)
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak / (1024 * 1024) if sys.platform == "darwin" else peak / 1024
    return kb / 1024


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0) so a peak can be taken per checkpoint."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False
