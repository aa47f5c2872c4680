"""End-to-end demo: train, checkpoint, crash, resume on another world size, compare.

    python -m dcp_datastates.demo [--steps N] [--ckpt-every K] [--dir DIR]
                                  [--fail-at STEP] [--nprocs P] [--resume-procs M]

What it runs (each "run" is a fresh set of spawned processes):

1. ``reference``: P ranks train a small GPT-like model (FSDP2 ``fully_shard`` on
   every block and the root, AdamW) for all N steps without failure, and
   checkpoint every K steps with ``dcp.async_save`` and DCP's own
   ``FileSystemWriter`` (the baseline). Its losses are the reference loss curve.
2. ``failed``: the same training on P ranks, checkpointing every K steps
   through a ``CheckpointManager`` (``dcp.async_save`` with
   ``DataStatesWriter`` into ``step_<N>`` directories, an atomic ``latest``
   pointer, ``--keep-last`` retention; the optimizer step waits in a pre-hook
   only while a snapshot is still copying); at ``--fail-at`` every rank dies
   (``os._exit``, no cleanup), so every step after the last committed
   checkpoint is lost.
3. ``resumed``: M ranks (a different world size by default) open the same
   root with a ``CheckpointManager``, which removes what the crash left
   behind and loads the newest committed checkpoint that loads
   (``DataStatesReader``; DCP reshards from P to M ranks), and train to the
   end, still checkpointing through the manager.

Then the parent compares the resumed loss curve with the reference (exact
equality is required when M == P, a tight relative tolerance otherwise, and
the summary says whether it was bit-exact), checks that the failed run was a
bit-exact replica of the reference before the failure, checks that our
checkpoint at the resume step holds exactly the same tensors as DCP's
checkpoint of the same step, prints per checkpoint ours vs DCP (time the
training loop was blocked, bytes, GB/s, peak host RSS) and exits non-zero if
anything failed.

Determinism: the global batch of a step is generated from (seed, step) alone
and cut into S fixed micro-shards (S = lcm(P, M) by default); a rank of a
world of W processes its S/W shards with gradient accumulation, each loss
scaled by W/S. Every world size therefore runs the same kernels on the same
shapes, and the logged loss is summed over shards in a fixed order, which is
what lets a resumed run on another world size match the reference closely
(often bit-exactly, but that is reported, not assumed).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import shutil
import sys
import tempfile
import time
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

from dcp_datastates.manager.checkpoint_root import is_committed, step_dir_name, step_dirs

SIMULATED_FAILURE_EXIT = 75  # exit status of a rank that "crashed" on purpose


# ---------------------------------------------------------------------------
# configuration
# ---------------------------------------------------------------------------


@dataclasses.dataclass
class ModelConfig:
    vocab: int = 512
    seq_len: int = 64
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4


@dataclasses.dataclass
class RunSpec:
    """Everything a worker needs for one run (pickled to the spawned ranks)."""

    name: str
    world: int
    device: str  # "cpu" or "cuda"
    model: ModelConfig
    seed: int
    steps: int  # last step to train (inclusive)
    steps_total: int  # horizon of the learning-rate schedule (the same in every run)
    ckpt_every: int
    ckpt_root: str  # step_<N> directories go here
    writer: str  # "datastates" or "dcp"
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


# ---------------------------------------------------------------------------
# model and data
# ---------------------------------------------------------------------------


class Block(nn.Module):
    def __init__(self, d: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_heads, c // self.n_heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class TinyGPT(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg.d_model, cfg.n_heads) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def global_batch(seed: int, step: int, batch: int, seq_len: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole global batch of ``step``, a function of (seed, step) only.

    Each row is an arithmetic progression modulo ``vocab`` (random start and
    stride) with 10% of the tokens replaced by noise: learnable, so the loss
    curve goes down, and cheap to regenerate on any number of processes.
    """
    g = torch.Generator().manual_seed((seed * 1_000_003 + step * 7_919) % (1 << 62))
    start = torch.randint(0, vocab, (batch, 1), generator=g)
    stride = torch.randint(1, 8, (batch, 1), generator=g)
    seq = (start + stride * torch.arange(seq_len + 1)) % vocab
    noise = torch.rand(batch, seq_len + 1, generator=g) < 0.1
    seq = torch.where(noise, torch.randint(0, vocab, (batch, seq_len + 1), generator=g), seq)
    return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


def lr_at(step: int, spec: RunSpec) -> float:
    """Warmup then cosine decay; a pure function of the step, so no scheduler state."""
    if step <= spec.warmup:
        return spec.lr * step / spec.warmup
    frac = (step - spec.warmup) / max(1, spec.steps_total - spec.warmup)
    return spec.lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, frac))))


# ---------------------------------------------------------------------------
# memory probes
# ---------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------
# checkpointing
# ---------------------------------------------------------------------------


def step_dir(root: str, step: int) -> str:
    return os.path.join(root, step_dir_name(step))


def latest_committed_checkpoint(root: str) -> tuple[int, str] | None:
    """The newest committed ``step_*`` directory under ``root`` (what the parent expects a resume to load)."""
    committed = [(s, os.path.join(root, n)) for s, n in step_dirs(root).items() if is_committed(os.path.join(root, n))]
    return max(committed) if committed else None


def dir_bytes(path: str) -> int:
    total = 0
    for entry in os.scandir(path):
        if entry.is_file(follow_symlinks=False):
            total += entry.stat(follow_symlinks=False).st_size
    return total


class Checkpointer:
    """Checkpoints the training state every K steps with ``dcp.async_save`` and records the cost.

    Both writers go through ``dcp.async_save`` on a gloo group of their own
    (training runs its FSDP collectives on the default group at the same
    time). Ours (``DataStatesWriter``) returns at once: the snapshot copies
    while the next forward/backward run, and the optimizer step pre-hook (the
    fence, what ``dcp_datastates.install_fence`` installs) waits only while
    it is still copying. DCP's default ``FileSystemWriter`` stages by copying
    the whole state inside the call. The time the loop was blocked is the
    call (with get_state_dict) plus every fence wait; "durable" is from the
    call until the upload future completed (data fsynced, ``.metadata``
    committed). A new save first waits for the previous upload (DCP needs
    it; the wait counts as blocked).
    """

    def __init__(self, spec: RunSpec, rank: int, log, optim: torch.optim.Optimizer) -> None:
        self.spec = spec
        self.rank = rank
        self.log = log
        self.group = dist.new_group(backend="gloo")
        self._pending: Any = None  # (upload future, record) of the save in flight
        self._fencing: dict | None = None  # the record whose snapshot may still be copying
        self.manager = None
        if spec.writer == "datastates":
            from dcp_datastates import CheckpointManager

            # fence=False: the demo installs the same fence itself (below) to time its waits.
            self.manager = CheckpointManager(
                spec.ckpt_root, keep_last=spec.keep_last, async_save=True, process_group=self.group,
                host_cache_bytes=spec.host_cache_bytes, io_threads=spec.io_threads, direct_io=spec.direct_io,
                fence=False,
            )
        optim.register_step_pre_hook(self._fence_hook)

    def _fence_hook(self, *_args) -> None:
        """Optimizer step pre-hook: wait while a snapshot still reads the parameters."""
        record = self._fencing
        if record is None:
            return
        from dcp_datastates import wait_for_snapshots

        t0 = time.perf_counter()
        wait_for_snapshots()
        record["fence_wait_s"] += time.perf_counter() - t0
        self._fencing = None

    def save(self, step: int, model: nn.Module, optim: torch.optim.Optimizer) -> None:
        import torch.distributed.checkpoint as dcp

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
            from torch.distributed.checkpoint import FileSystemWriter

            writer = FileSystemWriter(path)
            resp = dcp.async_save(state, storage_writer=writer, process_group=self.group)
            upload = getattr(resp, "upload_completion", resp)
        t2 = time.perf_counter()
        record = {
            "step": step,
            "path": path,
            "state_dict_s": t1 - t0,
            "save_call_s": t2 - t1,
            "previous_wait_s": t0 - t_prev,
            "fence_wait_s": 0.0,
            "rss_before_mb": rss_before,
            "peak_rss_mb": peak_rss_mb(),
            "hwm_reset": hwm_reset,
            "writer": writer,
            "t0": t0,
            "durable_at": None,
        }
        upload.add_done_callback(lambda _f, r=record: r.__setitem__("durable_at", time.perf_counter()))
        self._fencing = record
        self._pending = (upload, record, state)

    def wait(self) -> None:
        """Wait for the save in flight to be durable and report it."""
        if self._pending is None:
            return
        upload, record, _state = self._pending
        self._pending = None
        t0 = time.perf_counter()
        upload.result()
        record["final_wait_s"] = time.perf_counter() - t0
        while record["durable_at"] is None:  # the done-callback runs right after result() returns
            time.sleep(0.001)
        record["peak_rss_mb"] = max(record["peak_rss_mb"], peak_rss_mb())
        record["blocked_s"] = (
            record["previous_wait_s"] + record["state_dict_s"] + record["save_call_s"] + record["fence_wait_s"]
        )
        record["durable_s"] = record["durable_at"] - record["t0"]
        self._complete(record)

    def _complete(self, record: dict) -> None:
        writer = record.pop("writer")
        if hasattr(writer, "close"):
            writer.close()
        mine = {
            "blocked_s": record["blocked_s"],
            "durable_s": record["durable_s"],
            "fence_wait_s": record["fence_wait_s"],
            "state_dict_s": record["state_dict_s"],
            "save_call_s": record["save_call_s"],
            "peak_rss_mb": record["peak_rss_mb"],
            "rss_before_mb": record["rss_before_mb"],
            "hwm_reset": record["hwm_reset"],
        }
        stats = getattr(writer, "last_save_stats", None)
        if stats is not None:
            mine["writer_bytes"] = stats.bytes_written
            mine["data_write_s"] = stats.data_write_s
            mine["commit_s"] = stats.commit_s
            mine["direct_io"] = stats.direct_io
        ranks: list[Any] = [None] * self.spec.world
        dist.all_gather_object(ranks, mine)
        if self.rank != 0:
            return
        total = dir_bytes(record["path"])
        blocked = max(r["blocked_s"] for r in ranks)
        durable = max(r["durable_s"] for r in ranks)
        out = {
            "durable_s": durable,
            "fence_wait_s": max(r["fence_wait_s"] for r in ranks),
            "durable_gbps": total / durable / 1e9 if durable > 0 else float("nan"),
            "kind": "ckpt",
            "run": self.spec.name,
            "writer": self.spec.writer,
            "world": self.spec.world,
            "step": record["step"],
            "bytes": total,
            "blocked_s": blocked,
            "state_dict_s": max(r["state_dict_s"] for r in ranks),
            "gbps": total / blocked / 1e9 if blocked > 0 else float("nan"),
            "peak_rss_mb": max(r["peak_rss_mb"] for r in ranks),
            "rss_before_mb": max(r["rss_before_mb"] for r in ranks),
            "rss_growth_mb": max(r["peak_rss_mb"] - r["rss_before_mb"] for r in ranks),
            "hwm_reset": all(r["hwm_reset"] for r in ranks),
        }
        if stats is not None:
            out["writer_bytes"] = sum(r["writer_bytes"] for r in ranks)
            out["direct_io"] = all(r["direct_io"] for r in ranks)
        self.log(out)
        print(
            f"[{self.spec.name} W={self.spec.world}] checkpoint step {record['step']}: "
            f"{total / 1e6:.1f} MB, blocked {blocked * 1e3:.1f} ms, durable after {durable * 1e3:.0f} ms "
            f"({out['durable_gbps']:.3f} GB/s), "
            f"peak RSS {out['peak_rss_mb']:.0f} MB ({self.spec.writer})",
            flush=True,
        )


def build_state(step: int, model: nn.Module, optim: torch.optim.Optimizer, spec: RunSpec) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optim)
    rng = {"torch": torch.get_rng_state()}
    return {
        "model": model_sd,
        "optim": optim_sd,
        "step": step,
        "data": {
            "seed": spec.seed,
            "next_step": step + 1,
            "global_batch": spec.global_batch,
            "samples_seen": step * spec.global_batch,
        },
        "rng": rng,
    }


def load_checkpoint(manager, model: nn.Module, optim: torch.optim.Optimizer, spec: RunSpec) -> int:
    """Resume: the manager loads the newest committed checkpoint that loads (every byte verified)."""
    from torch.distributed.checkpoint.state_dict import set_state_dict

    state = build_state(-1, model, optim, spec)  # template: shapes and shardings of this world
    state["data"] = {"seed": -1, "next_step": -1, "global_batch": -1, "samples_seen": -1}
    found = manager.load(state)
    path = manager.root
    if found is None:
        raise RuntimeError(f"no committed checkpoint under {path} to resume from")
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    torch.set_rng_state(state["rng"]["torch"])
    step = int(state["step"])
    data = state["data"]
    if found != step:
        raise RuntimeError(f"{manager.path_of(found)} holds step {step}, its directory name says {found}")
    if data["seed"] != spec.seed or data["global_batch"] != spec.global_batch or data["next_step"] != step + 1:
        raise RuntimeError(f"{path}: data position {data} does not match this run (seed {spec.seed})")
    return step


# ---------------------------------------------------------------------------
# the worker
# ---------------------------------------------------------------------------


def _worker(rank: int, spec: RunSpec) -> None:
    torch.set_num_threads(spec.threads)
    if spec.device == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
        backend = "nccl"
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    else:
        device = torch.device("cpu")
        backend = "gloo"
    timeout = datetime.timedelta(seconds=spec.pg_timeout_s)
    store = dist.TCPStore("127.0.0.1", spec.store_port, is_master=False, timeout=timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=spec.world, timeout=timeout)
    log_file = open(spec.log_path, "a") if rank == 0 else None
    try:
        def log(record: dict) -> None:
            if log_file is not None:
                log_file.write(json.dumps(record) + "\n")
                log_file.flush()

        _train(rank, spec, device, log)
    finally:
        if log_file is not None:
            log_file.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def _train(rank: int, spec: RunSpec, device: torch.device, log) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    world = spec.world
    torch.manual_seed(spec.seed)  # identical init on every rank (and in every run)
    model = TinyGPT(spec.model).to(device)
    mesh = init_device_mesh(device.type, (world,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=spec.lr, betas=(0.9, 0.95), weight_decay=0.1)
    n_params = sum(p.numel() for p in model.parameters())

    ckpt = Checkpointer(spec, rank, log, optim)
    start = 1
    if spec.resume:
        t0 = time.perf_counter()
        loaded = load_checkpoint(ckpt.manager, model, optim, spec)
        load_s = time.perf_counter() - t0
        start = loaded + 1
        path = ckpt.manager.path_of(loaded)
        log({"kind": "resumed", "from_step": loaded, "path": path, "load_s": load_s, "world": world})
        if rank == 0:
            print(f"[{spec.name} W={world}] loaded step {loaded} from {path} in {load_s:.2f} s", flush=True)
    elif rank == 0:
        print(f"[{spec.name} W={world}] model: {n_params / 1e6:.2f} M parameters, device {device}", flush=True)

    per_rank = spec.data_shards // world
    rows = spec.global_batch // spec.data_shards
    my_shards = range(rank * per_rank, (rank + 1) * per_rank)
    t_last = time.perf_counter()
    for step in range(start, spec.steps + 1):
        for group in optim.param_groups:
            group["lr"] = lr_at(step, spec)
        x, y = global_batch(spec.seed, step, spec.global_batch, spec.model.seq_len, spec.model.vocab)
        shard_losses = torch.zeros(spec.data_shards, dtype=torch.float32, device=device)
        for i, j in enumerate(my_shards):
            xs = x[j * rows:(j + 1) * rows].to(device)
            ys = y[j * rows:(j + 1) * rows].to(device)
            model.set_requires_gradient_sync(i == per_rank - 1)
            loss = model(xs, ys)
            (loss * (world / spec.data_shards)).backward()
            shard_losses[j] = loss.detach()
        if spec.fail_at is not None and step == spec.fail_at:
            _simulated_crash(rank, spec, step, log)
        optim.step()
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
    ckpt.wait()
    if ckpt.manager is not None:
        ckpt.manager.close()
    log({"kind": "done", "step": spec.steps, "lifetime_peak_rss_mb": peak_rss_mb()})


def _simulated_crash(rank: int, spec: RunSpec, step: int, log) -> None:
    """Every rank dies here, mid-step, without cleanup: whatever was not checkpointed is lost."""
    dist.barrier()  # all ranks reach the crash point (and rank 0 has logged every finished step)
    log({"kind": "crash", "step": step})
    if rank == 0:
        print(f"[{spec.name} W={spec.world}] simulated failure during step {step}: all ranks exit now", flush=True)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(SIMULATED_FAILURE_EXIT)


def _worker_entry(rank: int, spec: RunSpec, parent_pid: int) -> None:
    warnings.filterwarnings("ignore", category=UserWarning, module=r"torch\.distributed")
    warnings.filterwarnings("ignore", category=FutureWarning)
    _exit_with_parent(parent_pid)
    try:
        _worker(rank, spec)  # an exception propagates: torch.multiprocessing reports it to the parent
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
    import threading

    def watch() -> None:
        while True:
            if os.getppid() != parent_pid:
                os._exit(70)
            time.sleep(1.0)

    threading.Thread(target=watch, name="demo-parent-watch", daemon=True).start()


# ---------------------------------------------------------------------------
# the launcher
# ---------------------------------------------------------------------------


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
    ctx = mp.start_processes(_worker_entry, args=(spec, os.getpid()), nprocs=spec.world, join=False, start_method="spawn")
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


def read_log(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


# ---------------------------------------------------------------------------
# checks
# ---------------------------------------------------------------------------


def compare_checkpoints(ours: str, theirs: str) -> tuple[bool | None, str]:
    """Load both checkpoints whole in this process and compare every entry bit for bit."""
    try:
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

        from dcp_datastates import DataStatesReader
    except ImportError as exc:  # private DCP helper moved: skip, do not fail
        return None, f"skipped ({exc})"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        a = _load_state_dict_from_keys(storage_reader=DataStatesReader(ours, verify=True))
        b = _load_state_dict_from_keys(storage_reader=FileSystemReader(theirs))
    fa, fb = _flatten(a), _flatten(b)
    if fa.keys() != fb.keys():
        return False, f"different keys: {sorted(fa.keys() ^ fb.keys())[:5]}"
    n_tensors = n_bytes = 0
    for k, va in fa.items():
        vb = fb[k]
        if isinstance(va, torch.Tensor):
            if not (isinstance(vb, torch.Tensor) and va.dtype == vb.dtype and va.shape == vb.shape
                    and torch.equal(va.view(torch.uint8) if va.dtype == torch.uint8 else va, vb)):
                return False, f"{k!r} differs"
            n_tensors += 1
            n_bytes += va.numel() * va.element_size()
        elif va != vb:
            return False, f"{k!r} differs: {va!r} != {vb!r}"
    return True, f"{len(fa)} entries ({n_tensors} tensors, {n_bytes / 1e6:.1f} MB) identical"


def _flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    if isinstance(d, dict):
        for k, v in d.items():
            out.update(_flatten(v, f"{prefix}{k}."))
    elif isinstance(d, (list, tuple)):
        for i, v in enumerate(d):
            out.update(_flatten(v, f"{prefix}{i}."))
    else:
        out[prefix[:-1]] = d
    return out


def losses_of(records: list[dict]) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in records if r["kind"] == "loss"}


def ckpts_of(records: list[dict]) -> dict[int, dict]:
    return {r["step"]: r for r in records if r["kind"] == "ckpt"}


# ---------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m dcp_datastates.demo",
        description="Train with FSDP2, checkpoint with DataStatesWriter, crash, resume on another world size, "
                    "and compare with an uninterrupted run checkpointed by DCP's FileSystemWriter.",
    )
    p.add_argument("--steps", type=int, default=200, help="training steps (default 200)")
    p.add_argument("--ckpt-every", type=int, default=25, help="checkpoint every K steps (default 25)")
    p.add_argument("--fail-at", type=int, default=130, help="step during which the ranks die (default 130)")
    p.add_argument("--nprocs", type=int, default=2, help="ranks before the failure, P (default 2)")
    p.add_argument("--resume-procs", type=int, default=1, help="ranks after the failure, M (default 1)")
    p.add_argument("--dir", default=None,
                   help="working directory for checkpoints and logs (default: a fresh temporary directory)")
    p.add_argument("--keep", action="store_true", help="keep the working directory at the end")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="auto: one GPU per rank (NCCL) when enough GPUs exist for every run, else CPU (gloo)")
    g = p.add_argument_group("model and data")
    g.add_argument("--vocab", type=int, default=512)
    g.add_argument("--seq-len", type=int, default=64)
    g.add_argument("--d-model", type=int, default=128)
    g.add_argument("--layers", type=int, default=4)
    g.add_argument("--heads", type=int, default=4)
    g.add_argument("--batch", type=int, default=16, help="global batch (sequences per step)")
    g.add_argument("--data-shards", type=int, default=None,
                   help="fixed micro-shards of the global batch (default lcm(P, M); must be a multiple of both)")
    g.add_argument("--lr", type=float, default=3e-3)
    g.add_argument("--threads", type=int, default=0,
                   help="intra-op threads per rank, the same in every run (default: cores // max(P, M))")
    g = p.add_argument_group("checkpoint I/O")
    g.add_argument("--host-cache-mb", type=int, default=32, help="DataStatesWriter host pool (default 32 MiB)")
    g.add_argument("--io-threads", type=int, default=2)
    g.add_argument("--direct-io", choices=("auto", "on", "off"), default="auto")
    g.add_argument("--keep-last", type=int, default=3,
                   help="CheckpointManager retention: the newest K checkpoints of ours are kept (0: all; default 3)")
    g = p.add_argument_group("checks")
    g.add_argument("--rtol", type=float, default=1e-5,
                   help="relative tolerance on every resumed loss when M != P (default 1e-5); M == P must be exact")
    g.add_argument("--timeout", type=float, default=600.0, help="seconds allowed per run (default 600)")
    args = p.parse_args(argv)

    if args.steps < 1 or args.ckpt_every < 1:
        p.error("--steps and --ckpt-every must be positive")
    if not args.ckpt_every < args.fail_at <= args.steps:
        p.error("--fail-at must be after the first checkpoint (> --ckpt-every) and <= --steps")
    if args.nprocs < 1 or args.resume_procs < 1:
        p.error("--nprocs and --resume-procs must be positive")
    if args.data_shards is None:
        args.data_shards = math.lcm(args.nprocs, args.resume_procs)
    if args.data_shards % args.nprocs or args.data_shards % args.resume_procs:
        p.error(f"--data-shards {args.data_shards} must be a multiple of --nprocs and --resume-procs")
    if args.batch % args.data_shards:
        p.error(f"--batch {args.batch} must be a multiple of the {args.data_shards} data shards")
    if args.d_model % args.heads:
        p.error("--d-model must be a multiple of --heads")
    return args


def choose_device(args: argparse.Namespace) -> str:
    need = max(args.nprocs, args.resume_procs)
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if args.device == "cuda":
        if have < need:
            raise SystemExit(f"--device cuda needs {need} GPUs (one per rank), found {have}")
        return "cuda"
    if args.device == "auto" and have >= need:
        return "cuda"
    return "cpu"


def _cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover
        return os.cpu_count() or 1


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t_start = time.monotonic()
    device = choose_device(args)

    created = args.dir is None
    if created:
        root = tempfile.mkdtemp(prefix="dcp_datastates_demo_")
    else:
        root = os.path.abspath(args.dir)
        if os.path.isdir(root) and os.listdir(root):
            raise SystemExit(f"--dir {root} is not empty; give a new or empty directory")
        os.makedirs(root, exist_ok=True)
    print(f"working directory: {root} ({'kept' if args.keep else 'removed at the end; --keep keeps it'})", flush=True)

    try:
        return _scenario(args, device, root, t_start)
    finally:
        if not args.keep:
            if created:
                shutil.rmtree(root, ignore_errors=True)
            else:
                for name in ("reference_dcp", "datastates", "logs"):
                    shutil.rmtree(os.path.join(root, name), ignore_errors=True)
                try:
                    os.rmdir(root)
                except OSError:
                    pass


def _scenario(args: argparse.Namespace, device: str, root: str, t_start: float) -> int:
    P, M = args.nprocs, args.resume_procs
    logs = os.path.join(root, "logs")
    os.makedirs(logs)
    cfg = ModelConfig(args.vocab, args.seq_len, args.d_model, args.layers, args.heads)
    # The same thread count per rank in every run: the runs then differ only in their
    # world size (a rank's kernels may reduce in another order with another thread count).
    threads = args.threads or max(1, _cpus() // max(P, M))

    def spec(name: str, world: int, **kw) -> RunSpec:
        s = RunSpec(
            name=name, world=world, device=device, model=cfg, seed=args.seed, steps=args.steps,
            steps_total=args.steps,
            ckpt_every=args.ckpt_every, ckpt_root="", writer="datastates",
            log_path=os.path.join(logs, f"{name}.jsonl"), global_batch=args.batch,
            data_shards=args.data_shards, lr=args.lr, warmup=max(1, args.steps // 10),
            host_cache_bytes=args.host_cache_mb << 20, io_threads=args.io_threads, direct_io=args.direct_io,
            threads=threads, progress_every=args.ckpt_every, keep_last=args.keep_last or None,
        )
        return dataclasses.replace(s, **kw) if kw else s

    ref_root = os.path.join(root, "reference_dcp")
    ours_root = os.path.join(root, "datastates")
    problems: list[str] = []
    print(f"scenario: {args.steps} steps, checkpoint every {args.ckpt_every}, failure during step "
          f"{args.fail_at}; {P} rank(s) before, {M} after; device {device} "
          f"({'NCCL' if device == 'cuda' else 'gloo'}); global batch {args.batch} in {args.data_shards} shards; "
          f"{threads} thread(s) per rank",
          flush=True)

    # 1. reference: uninterrupted, checkpointed by DCP's FileSystemWriter
    print(f"\n== 1/3 reference run: {P} rank(s), all {args.steps} steps, DCP FileSystemWriter ==", flush=True)
    ref_spec = spec("reference", P, ckpt_root=ref_root, writer="dcp")
    r = launch(ref_spec, args.timeout)
    if not r.ok:
        return _abort(f"reference run failed (rank {r.failed_rank}, exit {r.exit_code}):\n{r.error}")
    ref_log = read_log(ref_spec.log_path)
    ref_losses = losses_of(ref_log)
    ref_ckpts = ckpts_of(ref_log)
    ref_s = r.seconds

    # 2. failed: DataStatesWriter, crashes during --fail-at
    print(f"\n== 2/3 failing run: {P} rank(s), DataStatesWriter, failure during step {args.fail_at} ==", flush=True)
    fail_spec = spec("failed", P, ckpt_root=ours_root, writer="datastates", fail_at=args.fail_at)
    r = launch(fail_spec, args.timeout)
    fail_log = read_log(fail_spec.log_path)
    crash = [rec for rec in fail_log if rec["kind"] == "crash"]
    if r.ok or r.exit_code != SIMULATED_FAILURE_EXIT or not crash:
        return _abort(f"the failing run did not fail as simulated (ok={r.ok}, exit {r.exit_code}):\n{r.error}")
    print(f"[failed] all ranks stopped with exit status {r.exit_code} (simulated failure)", flush=True)
    fail_losses = losses_of(fail_log)
    fail_ckpts = ckpts_of(fail_log)
    fail_s = r.seconds

    # 3. resume from the newest committed checkpoint on M ranks
    found = latest_committed_checkpoint(ours_root)
    if found is None:
        return _abort(f"no committed checkpoint under {ours_root}")
    resume_step, resume_dir = found
    lost = (args.fail_at - 1) - resume_step
    print(f"\n== 3/3 resumed run: {M} rank(s) from {resume_dir} (step {resume_step}; "
          f"{lost} finished step(s) after it were lost) ==", flush=True)
    # our checkpoint of the resume step holds exactly what DCP's checkpoint of that step holds
    same_ckpt, same_text = (None, "skipped (no DCP checkpoint of that step)")
    if resume_step in ref_ckpts:
        try:
            same_ckpt, same_text = compare_checkpoints(resume_dir, step_dir(ref_root, resume_step))
        except Exception as exc:  # report it, do not hide it
            same_ckpt, same_text = False, f"comparison failed: {type(exc).__name__}: {exc}"
        if same_ckpt is False:
            problems.append(f"checkpoint of step {resume_step} differs from DCP's: {same_text}")

    res_spec = spec("resumed", M, ckpt_root=ours_root, writer="datastates", resume=True)
    r = launch(res_spec, args.timeout)
    res_log = read_log(res_spec.log_path)
    if not r.ok:
        loaded = any(rec["kind"] == "resumed" for rec in res_log)
        what = "training after the load" if loaded else "loading the checkpoint"
        return _abort(f"resumed run failed while {what} (rank {r.failed_rank}, exit {r.exit_code}):\n{r.error}")
    res_losses = losses_of(res_log)
    res_ckpts = ckpts_of(res_log)
    resumed_rec = next(rec for rec in res_log if rec["kind"] == "resumed")
    res_s = r.seconds
    if resumed_rec["from_step"] != resume_step:
        problems.append(f"the resumed run loaded step {resumed_rec['from_step']}, the newest committed is {resume_step}")

    # -- checks -----------------------------------------------------------------
    print("\n== results ==")
    expected = list(range(1, args.steps + 1))
    if sorted(ref_losses) != expected:
        problems.append("the reference run did not log every step")

    # a) before the failure, the failing run must replicate the reference (same P, same code)
    pre = list(range(1, args.fail_at))
    pre_missing = [s for s in pre if s not in fail_losses]
    pre_diff = max((abs(fail_losses[s] - ref_losses[s]) for s in pre if s in fail_losses), default=0.0)
    pre_exact = not pre_missing and all(fail_losses[s] == ref_losses[s] for s in pre)
    if pre_missing:
        problems.append(f"the failing run did not log steps {pre_missing[:5]}...")
    elif not pre_exact and device == "cpu":
        problems.append(f"the failing run diverged from the reference before the failure (max |diff| {pre_diff:.3e})")

    # b) the resumed curve against the reference
    post = list(range(resume_step + 1, args.steps + 1))
    missing = [s for s in post if s not in res_losses]
    if missing:
        problems.append(f"the resumed run did not log steps {missing[:5]}")
    diffs = {s: abs(res_losses[s] - ref_losses[s]) for s in post if s in res_losses and s in ref_losses}
    rels = {s: diffs[s] / max(abs(ref_losses[s]), 1e-12) for s in diffs}
    bit_exact = not missing and all(res_losses[s] == ref_losses[s] for s in post)
    max_abs = max(diffs.values(), default=0.0)
    max_rel = max(rels.values(), default=0.0)
    if M == P:
        tol_text = "exact equality (M == P)"
        continuous = bit_exact
    else:
        tol_text = f"relative tolerance {args.rtol:g} (M != P)"
        continuous = not missing and all(rels[s] <= args.rtol for s in post)
    first_bad = next((s for s in post if s in diffs and not (
        diffs[s] == 0 if M == P else rels[s] <= args.rtol)), None)
    if not continuous:
        problems.append(f"the resumed loss curve diverges from the reference (first at step {first_bad}, "
                        f"max |diff| {max_abs:.3e}, max rel {max_rel:.3e}; {tol_text})")

    # the manager's root after both runs: retention applied, the pointer on the newest
    from dcp_datastates.manager.checkpoint_root import read_latest

    kept = sorted(s for s, n in step_dirs(ours_root).items() if is_committed(os.path.join(ours_root, n)))
    pointer = read_latest(ours_root)
    if not kept or pointer != kept[-1] or sorted(step_dirs(ours_root)) != kept:
        problems.append(f"checkpoint root {ours_root}: committed {kept}, directories {sorted(step_dirs(ours_root))}, "
                        f"latest -> {pointer}")
    if args.keep_last and len(kept) > args.keep_last:
        problems.append(f"retention kept {len(kept)} checkpoints, --keep-last is {args.keep_last}")

    # -- report -----------------------------------------------------------------
    print(f"\nloss around the resume point (reference: {P} rank(s) uninterrupted; resumed: {M} rank(s) "
          f"from step {resume_step}):")
    print(f"  {'step':>6} {'reference':>12} {'failed run':>12} {'resumed':>12} {'|diff|':>10} {'rel':>9}")
    show = sorted(set(range(max(1, resume_step - 2), min(args.steps, resume_step + 6) + 1))
                  | set(range(resume_step + args.ckpt_every, args.steps + 1, args.ckpt_every))
                  | {args.fail_at - 1, args.steps})
    for s in show:
        f_ = f"{fail_losses[s]:12.6f}" if s in fail_losses else f"{'-':>12}"
        rr = f"{res_losses[s]:12.6f}" if s in res_losses else f"{'-':>12}"
        d = f"{diffs[s]:10.2e} {rels[s]:9.1e}" if s in diffs else f"{'':>10} {'':>9}"
        mark = "  <- resumed here" if s == resume_step + 1 else ("  <- failure" if s == args.fail_at - 1 else "")
        print(f"  {s:>6} {ref_losses.get(s, float('nan')):12.6f} {f_} {rr} {d}{mark}")

    print("\ncheckpoints, both through dcp.async_save: blocked = the training loop stalled (get_state_dict + the "
          "call + fence waits);\n  durable = from the call until committed; GB/s = checkpoint bytes / durable; "
          "RSS = peak host RSS of a rank during the save (max over ranks), in parentheses its growth "
          "over the RSS before the save")
    print(f"  {'step':>6} | {'ours: DataStatesWriter':^51} | {'DCP FileSystemWriter (W=' + str(P) + ')':^48}")
    print(f"  {'':>6} | {'W':>2} {'MB':>6} {'blocked':>9} {'durable':>8} {'GB/s':>6} {'RSS MB':>15} | "
          f"{'MB':>6} {'blocked':>9} {'durable':>8} {'GB/s':>6} {'RSS MB':>15}")
    ours_all = {**fail_ckpts, **res_ckpts}
    paired_ours, paired_dcp = [], []

    def cols(c: dict) -> str:
        rss = f"{c['peak_rss_mb']:.0f} ({c['rss_growth_mb']:+.0f})"
        return (f"{c['bytes'] / 1e6:6.2f} {c['blocked_s'] * 1e3:7.1f}ms {c['durable_s'] * 1e3:6.0f}ms "
                f"{c['durable_gbps']:6.3f} {rss:>15}")

    for st in sorted(set(ours_all) | set(ref_ckpts)):
        o, d = ours_all.get(st), ref_ckpts.get(st)
        left = f"{o['world']:>2} {cols(o)}" if o else f"{'(not reported: the run crashed first)':>51}"
        right = cols(d) if d else f"{'-':>48}"
        print(f"  {st:>6} | {left} | {right}")
        if o and d and o["world"] == d["world"]:
            paired_ours.append(o)
            paired_dcp.append(d)
    if not all(c.get("hwm_reset", False) for c in list(ours_all.values()) + list(ref_ckpts.values())):
        print("  (peak RSS could not be reset per checkpoint here: it is the process peak so far)")
    if paired_ours:
        def med(xs):
            xs = sorted(xs)
            return xs[len(xs) // 2] if len(xs) % 2 else 0.5 * (xs[len(xs) // 2 - 1] + xs[len(xs) // 2])

        ob, db = med([c["blocked_s"] for c in paired_ours]), med([c["blocked_s"] for c in paired_dcp])
        og, dg = med([c["durable_gbps"] for c in paired_ours]), med([c["durable_gbps"] for c in paired_dcp])
        od, dd = med([c["durable_s"] for c in paired_ours]), med([c["durable_s"] for c in paired_dcp])
        orss, drss = max(c["peak_rss_mb"] for c in paired_ours), max(c["peak_rss_mb"] for c in paired_dcp)
        first_grow = paired_ours[0]["rss_growth_mb"]
        later_grow = max((c["rss_growth_mb"] for c in paired_ours[1:]), default=float("nan"))
        dgrow = max(c["rss_growth_mb"] for c in paired_dcp)
        print(f"  median over the {len(paired_ours)} checkpoint(s) both wrote on {P} rank(s): ours blocked "
              f"{ob * 1e3:.1f} ms, durable after {od * 1e3:.0f} ms ({og:.3f} GB/s); DCP async_save blocked "
              f"{db * 1e3:.1f} ms, durable after {dd * 1e3:.0f} ms ({dg:.3f} GB/s): ours blocked "
              f"{db / ob if ob > 0 else float('nan'):.1f}x less")
        print(f"  peak RSS: ours {orss:.0f} MB, DCP {drss:.0f} MB; growth during a save: ours {first_grow:+.1f} MB "
              f"on the first (it maps the {args.host_cache_mb} MiB pre-faulted host pool, kept for later saves), "
              f"at most {later_grow:+.1f} MB after; DCP at most {dgrow:+.1f} MB")
        direct = all(c.get("direct_io") for c in ours_all.values())
        print(f"  ours wrote with O_DIRECT: {'yes' if direct else 'no (buffered)'}")

    total_s = time.monotonic() - t_start
    ok = not problems
    print("\n" + "=" * 78)
    print("SUMMARY")
    print(f"  runs: reference {ref_s:.1f} s ({P} rank(s)), failing {fail_s:.1f} s ({P} rank(s)), "
          f"resumed {res_s:.1f} s ({M} rank(s)); total {total_s:.1f} s")
    print(f"  failure during step {args.fail_at}; last committed checkpoint: step {resume_step} "
          f"({lost} finished step(s) lost and recomputed)")
    print(f"  resume: loaded {P}-rank checkpoint on {M} rank(s) in {resumed_rec['load_s']:.2f} s "
          f"(DataStatesReader, verify=True)")
    print(f"  before the failure the failing run matched the reference: "
          f"{'bit-exact' if pre_exact else f'NOT bit-exact (max |diff| {pre_diff:.3e})'} over {len(pre)} steps")
    print(f"  checkpoint of step {resume_step}, ours vs DCP's: {same_text}")
    print(f"  ours on disk (CheckpointManager, keep_last={args.keep_last or 'all'}): steps {kept}, "
          f"latest -> {pointer}")
    print(f"  resumed loss vs reference over steps {resume_step + 1}..{args.steps}: max |diff| {max_abs:.3e}, "
          f"max rel {max_rel:.3e}; bit-exact: {'yes' if bit_exact else 'no'}; checked with {tol_text}")
    if M != P and bit_exact:
        print(f"  (bit-exact across world sizes because every world size runs the same "
              f"{args.data_shards} micro-shards with the same shapes; this is measured, not guaranteed)")
    first = resume_step + 1
    verdict = (f"all {len(post)} resumed steps within tolerance" if continuous
               else f"first divergence at step {first_bad}" if first_bad is not None else "steps missing")
    print(f"  loss curve: {'CONTINUOUS' if continuous else 'DIVERGED'} (step {first}, the first after the resume: "
          f"reference {ref_losses.get(first, float('nan')):.6f}, resumed {res_losses.get(first, float('nan')):.6f}; "
          f"{verdict})")
    if ok:
        print("  RESULT: PASS")
    else:
        print("  RESULT: FAIL")
        for prob in problems:
            print(f"   - {prob}")
    print("=" * 78, flush=True)
    return 0 if ok else 1


def _abort(message: str) -> int:
    print("\n" + "=" * 78)
    print("SUMMARY")
    print(f"  RESULT: FAIL: {message}")
    print("=" * 78, flush=True)
    return 1


if __name__ == "__main__":
    sys.exit(main())
