"""One rank of a run: join the process group, train with FSDP2, checkpoint, and crash on purpose.

Determinism: the global batch of a step is generated from (seed, step) alone
and cut into S fixed micro-shards; a rank of a world of W processes its S/W
shards with gradient accumulation, each loss scaled by W/S. Every world size
therefore runs the same kernels on the same shapes, and the logged loss is
summed over shards in a fixed order, which is what lets a resumed run on
another world size match the reference closely.
"""

from __future__ import annotations

import datetime
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from dcp_datastates.demo.checkpointer import Checkpointer
from dcp_datastates.demo.host_memory import peak_rss_mb
from dcp_datastates.demo.model import TinyGPT, global_batch, lr_at
from dcp_datastates.demo.run_log import RunLog
from dcp_datastates.demo.run_spec import RunSpec
from dcp_datastates.demo.train_state import load_checkpoint

SIMULATED_FAILURE_EXIT = 75  # exit status of a rank that "crashed" on purpose


def run_rank(rank: int, spec: RunSpec) -> None:
    """Train ``spec`` as ``rank``: the process group, rank 0's log, training, and their cleanup."""
    torch.set_num_threads(spec.threads)
    device, backend = _select_device(rank, spec)
    timeout = datetime.timedelta(seconds=spec.pg_timeout_s)
    store = dist.TCPStore("127.0.0.1", spec.store_port, is_master=False, timeout=timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=spec.world, timeout=timeout)
    log = RunLog(spec.log_path if rank == 0 else None)
    try:
        _train(rank, spec, device, log)
    finally:
        log.close()
        if dist.is_initialized():
            dist.destroy_process_group()


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


def _sharded_model(spec: RunSpec, device: torch.device) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The model, sharded with FSDP2 over every rank (each block, then the root), and its AdamW."""
    torch.manual_seed(spec.seed)  # identical init on every rank (and in every run)
    model = TinyGPT(spec.model).to(device)
    mesh = init_device_mesh(device.type, (spec.world,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=spec.lr, betas=(0.9, 0.95), weight_decay=0.1)
    return model, optim


def _my_rows(rank: int, spec: RunSpec) -> dict[int, slice]:
    """``{micro-shard: its rows of the global batch}`` for the shards this rank processes."""
    per_rank = spec.data_shards // spec.world
    rows = spec.global_batch // spec.data_shards
    return {j: slice(j * rows, (j + 1) * rows) for j in range(rank * per_rank, (rank + 1) * per_rank)}


def _forward_backward(step: int, model: nn.Module, my_rows: dict[int, slice], spec: RunSpec,
                      device: torch.device) -> torch.Tensor:
    """Accumulate this rank's gradients of ``step``; the loss of each of its shards (0 for the others')."""
    x, y = global_batch(spec.seed, step, spec.global_batch, spec.model.seq_len, spec.model.vocab)
    shard_losses = torch.zeros(spec.data_shards, dtype=torch.float32, device=device)
    for i, (j, rows) in enumerate(my_rows.items()):
        model.set_requires_gradient_sync(i == len(my_rows) - 1)
        loss = model(x[rows].to(device), y[rows].to(device))
        (loss * (spec.world / spec.data_shards)).backward()
        shard_losses[j] = loss.detach()
    return shard_losses


def _train(rank: int, spec: RunSpec, device: torch.device, log: RunLog) -> None:
    world = spec.world
    model, optim = _sharded_model(spec, device)
    ckpt = Checkpointer(spec, rank, log, optim)
    start = 1
    if spec.resume:
        start = _resume(rank, spec, ckpt, model, optim, log) + 1
    elif rank == 0:
        n_params = sum(p.numel() for p in model.parameters())
        print(f"[{spec.name} W={world}] model: {n_params / 1e6:.2f} M parameters, device {device}", flush=True)

    my_rows = _my_rows(rank, spec)
    t_last = time.perf_counter()
    for step in range(start, spec.steps + 1):
        for group in optim.param_groups:
            group["lr"] = lr_at(step, spec.lr, spec.warmup, spec.steps_total)
        shard_losses = _forward_backward(step, model, my_rows, spec, device)
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
    ckpt.close()
    log({"kind": "done", "step": spec.steps, "lifetime_peak_rss_mb": peak_rss_mb()})


def _resume(rank: int, spec: RunSpec, ckpt: Checkpointer, model: nn.Module, optim: torch.optim.Optimizer,
            log: RunLog) -> int:
    """Load the newest good checkpoint through the manager; the step it holds."""
    t0 = time.perf_counter()
    loaded = load_checkpoint(ckpt.manager, model, optim, spec)
    load_s = time.perf_counter() - t0
    path = ckpt.manager.path_of(loaded)
    log({"kind": "resumed", "from_step": loaded, "path": path, "load_s": load_s, "world": spec.world})
    if rank == 0:
        print(f"[{spec.name} W={spec.world}] loaded step {loaded} from {path} in {load_s:.2f} s", flush=True)
    return loaded


def _simulated_crash(rank: int, spec: RunSpec, step: int, log: RunLog) -> None:
    """Every rank dies here, mid-step, without cleanup: whatever was not checkpointed is lost."""
    dist.barrier()  # all ranks reach the crash point (and rank 0 has logged every finished step)
    log({"kind": "crash", "step": step})
    if rank == 0:
        print(f"[{spec.name} W={spec.world}] simulated failure during step {step}: all ranks exit now", flush=True)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(SIMULATED_FAILURE_EXIT)
