#!/usr/bin/env python
"""Training-loop benchmark: how much asynchronous checkpointing slows down a
transformer trained with AdamW, for dcp_datastates (its writer and its
CheckpointManager) and for DCP's async_save, with no checkpoint, a checkpoint
every iteration and one every 10. On the CPU by default; with --device cuda,
a ~1B-parameter bf16 model under FSDP2 on one GPU.

    python benchmarks/bench_training_loop.py [--quick] [--dir DIR] [--iters N] [--reps N]
                                             [--json OUT] [--variants LIST] [--every LIST]
                                             [--device cpu|cuda] [--fsdp | --no-fsdp]
                                             [--dtype fp32|bf16] [--preset tiny|1b] [--budget-s S]
                                             [--every1-iters N] [--every1-variants LIST]

Model: token embedding + learned positions, --layers pre-norm
nn.TransformerEncoderLayer blocks (causal mask, no dropout), final LayerNorm and
an untied LM head; AdamW. Default dim 384, 6 layers, vocab 8192, batch 4 x 128
tokens: ~17M parameters, a ~204 MB checkpoint (parameters + both AdamW moments).
--quick: dim 256, 4 layers (~7.4M parameters, ~89 MB), 20 iterations, 1 rep.
--preset tiny: dim 128, 2 layers, vocab 1024, batch 2 x 64 (a CPU check);
--preset 1b: dim 2048, 18 layers, vocab 32000, batch 8 x 1024 (1,039,622,144
parameters: with bf16 a ~6.2 GB checkpoint). Explicit --dim, --layers, --vocab,
--batch and --seq override the preset; the exact count is printed.

Device: --device cpu (default) trains on the CPU under a 1-rank gloo group.
--device cuda trains on cuda:0 under a 1-rank NCCL group (init over
tcp://127.0.0.1); every checkpoint goes through a gloo group of its own
(dist.new_group(backend="gloo"): DCP's asynchronous saves need a CPU backend),
and the manager variants make theirs. --fsdp (default on with cuda, off on the
CPU; --no-fsdp / --fsdp override) wraps every block, then the root, with
FSDP2's fully_shard on a 1-D device mesh of the device's type; the state dict
then holds DTensors. --dtype fp32|bf16 (default bf16 on cuda, fp32 on the
CPU) is the parameters' dtype, so the AdamW moments have it too. On cuda an
iteration ends with a synchronize of the compute stream (the current stream,
not the whole device: a device-wide synchronize would also wait for the
checkpoint copies that run on side streams, which is the overlap being
measured); the compute stream is also synchronized right after
optimizer.step(), before the checkpoint call, because DCP's staging stream does
not wait for the compute stream. The peak GPU memory of every run
(torch.cuda.max_memory_allocated) is reported.

Checkpoint = {"model": ..., "optim": ...} from
torch.distributed.checkpoint.state_dict.get_state_dict(model, optimizer),
taken right after optimizer.step() of every k-th iteration, each to a fresh
directory (old ones are deleted once their upload is done; the last 2 are kept).

Variants
  dcp_default   dcp.async_save(sd, storage_writer=FileSystemWriter(p)): the copy
                happens inside the call. Before a new async_save the previous
                upload future is waited (DCP requires it); so for every dcp_*.
  dcp_stager    ... async_stager=DefaultStager(StagingOptions(False, False, True,
                False)) on the CPU (background-thread staging into a cached copy,
                the best CPU configuration); on cuda StagingOptions(True, False,
                True, True) (pinned memory, non-blocking copies). One stager per
                run, closed at its end. Fence: resp.staging_completion.result()
                before optimizer.step().
  dcp_pinned    (not in the default list) torchtitan's async_with_pinned_mem, DCP's
                best for GPUs: DefaultStager(StagingOptions(True, True, True,
                True)) with AsyncCheckpointerType.PROCESS, one stager per run,
                fence as dcp_stager. On the CPU torch ignores the pinning and
                non-blocking copies cannot work (bench_async_save.py), so
                StagingOptions(True, True, True, False) there; the output says so.
  dcp_process   (not in the default list) DCP default stager with
                AsyncCheckpointerType.PROCESS.
  ours          DataStatesWriter(p, host_cache_bytes=--cache-mib: 256 MiB on the
                CPU; on cuda the checkpoint's size, a full copy as DCP's stagers
                hold, since with a smaller pool staging, and so the fence, waits
                for the disk); fence:
                dcp_datastates.install_fence(optimizer) when the package has it
                (an optimizer step pre-hook), else resp.staging_completion.result()
                before optimizer.step(). A new save is issued while the previous
                one may still be uploading (ours orders them).
  ours_wait     (not in the default list) ours, but waiting the previous upload
                before a new save, like DCP.
  ours_manager  (not in the default list) CheckpointManager(local,
                CheckpointManagerOptions(keep_last=2, durable=<a second directory>,
                durable_keep_last=2, incremental=False, host_cache_bytes=--cache-mib));
                manager.save(step, sd); the manager installs its own fence. After
                the loop manager.wait() (local commits) is the drain and
                manager.wait_durable() the durable drain, timed apart.
  ours_incremental  (not in the default list) the same manager with
                incremental=True and no durable tier: the cost of incremental
                saves when, as in any real loop, every tensor changes every step
                (nothing is referred to; that is what is measured).

Per run: --warmup untimed iterations, then one untimed save (warms the stager
cache / pool / daemon; the first run of each variant loads it back and checks
it bit-exactly, the manager variants through manager.load), then --iters timed
iterations. An iteration is forward, backward, fence, optimizer.step(), and the
checkpoint call when due; all of it is timed. After the last iteration the
remaining uploads are drained (reported apart, "drain"). Runs are done
round-robin over --reps repetitions (the start shifts each repetition).
--every1-iters and --every1-variants give the every-iteration runs fewer
iterations or fewer variants (each of their iterations waits for a whole
checkpoint to be written, so they cost the most).

--budget-s S (counted from the process's start) bounds the whole run: no
repetition is started once the elapsed time plus the last repetition's would
pass S, and within a repetition no run is started once the elapsed time plus
an estimate of that run would: the longest run so far of the same schedule,
else the longest run so far of the same variant (else of any) plus, for each
save it makes beyond that run's, the longest wait for a first save to be
durable seen (that variant's if it had one). A run left out so is listed as
"not measured: budget" (JSON "not_run_budget"). With --json the file is
rewritten after every run with the figures so far and "complete": false, and
a last time with "complete": true, so a run killed from outside (a timeout)
still leaves every finished run's figures.

A run that may not fit on --dir's disk is not started (listed as not
measured): the manager keeps a local step until its durable copy commits and
drains only between saves, so with back-to-back saves every step stays; nor
is a dcp_pinned or dcp_process run whose shared-memory copies would not fit
in /dev/shm (a full tmpfs kills the process). A run that fails is reported
and not repeated; the other runs go on.
Reported: median and mean iteration time over all timed iterations of all
repetitions and the slowdown (%) against no checkpoint. With a checkpoint
every 10 iterations the median hides the checkpoint iterations: look at the
mean. Targets (printed PASS/FAIL, never failing the script): with a checkpoint
every 10 iterations, a mean slowdown under 3% for every ours variant; and
every ours variant below DCP's best (the smallest mean of the dcp_* rows) at
every interval. torch.set_num_threads(--threads): on the CPU checkpoint
threads compete with training for the same cores, which is what this
measures.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import shutil
import statistics
import sys
import textwrap
import time
import traceback
import warnings
from concurrent.futures import Future

_T0 = time.perf_counter()  # --budget-s counts from here: imports and process-group setup count

if __name__ == "__mp_main__":
    logging.disable(logging.INFO)  # DCP's spawned checkpoint daemon logs every request

warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
warnings.filterwarnings("ignore", message=".*assuming the intent is to (save|load) in a single process.*")
warnings.filterwarnings("ignore", message=".*Ignoring pin_memory flag.*")
warnings.filterwarnings("ignore", message=".*enable_nested_tensor.*")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter  # noqa: E402
from torch.distributed.checkpoint.state_dict import get_state_dict  # noqa: E402
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions  # noqa: E402
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

from bench_common import (  # noqa: E402
    add_common_args, dcp_staging_options, device_info, fmt, free_port, init_gloo, machine_info, make_scratch,
    median, pick_device, remove_scratch, write_json,
)

try:
    import dcp_datastates  # noqa: E402
    from dcp_datastates import DataStatesReader, DataStatesWriter  # noqa: E402
    OURS_ERROR = None
except Exception as e:  # noqa: BLE001 - the core may be mid-rewrite; DCP variants still run
    dcp_datastates = None
    OURS_ERROR = f"{type(e).__name__}: {e}"

MiB = 1 << 20
GiB = 1 << 30
GB = 1e9
VARIANTS = ["ours", "dcp_default", "dcp_stager"]
ALL_VARIANTS = ["ours", "ours_wait", "ours_manager", "ours_incremental",
                "dcp_default", "dcp_stager", "dcp_pinned", "dcp_process"]
MANAGER_VARIANTS = ("ours_manager", "ours_incremental")
ORDERED_BY_US = ("ours",) + MANAGER_VARIANTS  # may save while the previous upload runs
KEEP = 2  # checkpoints kept on disk per run
PRESETS = {
    "tiny": {"dim": 128, "layers": 2, "vocab": 1024, "batch": 2, "seq": 64},
    "1b": {"dim": 2048, "layers": 18, "vocab": 32000, "batch": 8, "seq": 1024},
}
DEFAULT_SHAPE = {"dim": 384, "layers": 6, "vocab": 8192, "batch": 4, "seq": 128}
QUICK_SHAPE = {"dim": 256, "layers": 4}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
TARGET_EVERY = 10  # the interval the slowdown target is for
TARGET_SLOWDOWN_PCT = 3.0


# ---------------------------------------------------------------- model


class TinyLM(nn.Module):
    def __init__(self, vocab: int, dim: int, layers: int, seq: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(seq, dim))
        layer = nn.TransformerEncoderLayer(dim, max(1, dim // 64), 4 * dim, dropout=0.0,
                                           batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(seq), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x) + self.pos[: x.shape[1]]
        h = self.blocks(h, mask=self.mask[: x.shape[1], : x.shape[1]], is_causal=True)
        return self.head(self.norm(h))


def shard(model: TinyLM, mesh) -> None:
    """FSDP2: every transformer block, then the root (embeddings, final norm, head)."""
    for block in model.blocks.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)


# ---------------------------------------------------------------- helpers


def tensors(tree, prefix=""):
    if isinstance(tree, torch.Tensor):
        yield prefix, tree
    elif isinstance(tree, dict):
        for k, v in tree.items():
            yield from tensors(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            yield from tensors(v, f"{prefix}.{i}")


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's data of a tensor (a DTensor's local shard)."""
    return t.to_local() if isinstance(t, DTensor) else t


def zeros_tree(tree):
    if isinstance(tree, torch.Tensor):
        return torch.zeros_like(tree)  # a DTensor stays a DTensor with the same placement
    if isinstance(tree, dict):
        return {k: zeros_tree(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [zeros_tree(v) for v in tree]
    return tree


def check_equal(variant: str, want_tree, got_tree) -> None:
    """Bit-exact comparison of two state trees (dtype, shape and bytes of every local tensor)."""
    want, got = dict(tensors(want_tree)), dict(tensors(got_tree))
    if set(want) != set(got):
        raise AssertionError(f"{variant}: keys differ after the round trip")
    for k, v in want.items():
        a, b = local(v), local(got[k])
        if b.dtype != a.dtype or b.shape != a.shape or not torch.equal(b, a):
            raise AssertionError(f"{variant}: tensor {k!r} differs after the round trip")


def mean(xs):
    xs = [x for x in xs if x is not None]
    return statistics.fmean(xs) if xs else None


def ms(x):
    return None if x is None else x * 1e3


def describe_options(o: StagingOptions) -> str:
    return (f"StagingOptions(use_pinned_memory={o.use_pinned_memory}, use_shared_memory={o.use_shared_memory}, "
            f"use_async_staging={o.use_async_staging}, use_non_blocking_copy={o.use_non_blocking_copy})")


# ---------------------------------------------------------------- runner


class Bench:
    def __init__(self, args, root: str, device: torch.device, ckpt_group) -> None:
        self.args = args
        self.root = root
        self.device = device
        self.cuda = device.type == "cuda"
        self.dtype = DTYPES[args.dtype]
        self.ckpt_group = ckpt_group  # the gloo group raw DCP saves and loads use (None: the default group)
        self.mesh = init_device_mesh(device.type, (dist.get_world_size(),)) if args.fsdp else None
        self.counter = 0
        gen = torch.Generator().manual_seed(1234)
        # fixed batches, reused cyclically by every run
        self.batches = [torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=gen).to(device)
                        for _ in range(8)]
        self.verified: set[str] = set()
        self.failed: dict[str, str] = {}  # "variant/every" -> error (that run is not repeated)
        self.no_room: dict[str, str] = {}  # "variant/every" -> why it was not run (disk space)
        self.no_budget: dict[str, str] = {}  # "variant/every" -> why it was not run (--budget-s)
        self.walls: list[dict] = []  # every finished run: name, variant, every, saves, wall_s (for estimates)
        self.upload_s: dict[str, float] = {}  # variant -> its longest first save, call return to durable
        self.ckpt_bytes = 0  # set once the model is described
        self.fence_kind: dict[str, str] = {}

    def fresh(self, tag: str) -> str:
        self.counter += 1
        return os.path.join(self.root, f"{tag}-{self.counter:04d}")

    def iters_for(self, every: int) -> int:
        """Timed iterations of a run with this schedule (--every1-iters for a checkpoint every iteration)."""
        return self.args.every1_iters if every == 1 else self.args.iters

    def estimate(self, variant: str | None, every: int) -> tuple[float, str] | None:
        """(seconds the run may take, how that was found) from the runs so far; None before the first.
        The longest run of the same schedule; else the longest of the same variant (else of any) plus,
        for every save beyond that run's, the longest first save seen (of this variant if it had one)."""
        if not self.walls:
            return None
        same = [w for w in self.walls if w["every"] == every]
        if same:
            ref = max(same, key=lambda w: w["wall_s"])
            return ref["wall_s"], f"the longest run of this schedule so far, {ref['name']}"
        ref = max([w for w in self.walls if w["variant"] == variant] or self.walls, key=lambda w: w["wall_s"])
        saves = self.iters_for(every) // every if variant is not None else 0
        extra = max(0, saves - ref["saves"])
        per = self.upload_s.get(variant, max(self.upload_s.values(), default=0.0))
        return (ref["wall_s"] + extra * per,
                f"{ref['name']} took {ref['wall_s']:.0f}s, + {extra} more save(s) x {per:.1f}s")

    def build(self):
        a = self.args
        torch.manual_seed(0)
        with torch.device(self.device):  # initialized where it trains (a 1B model in seconds on a GPU)
            model = TinyLM(a.vocab, a.dim, a.layers, a.seq)
        model.to(device=self.device, dtype=self.dtype)
        if self.mesh is not None:
            shard(model, self.mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
        return model, opt

    def sync(self) -> None:
        """Wait for the compute stream (cuda only); see the module docs for why not the device."""
        if self.cuda:
            torch.cuda.current_stream(self.device).synchronize()

    def step_fwd_bwd(self, model, opt, i: int) -> None:
        x = self.batches[i % len(self.batches)]
        out = model(x[:, :-1])
        loss = nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), x[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()

    def dcp_kwargs(self) -> dict:
        return {} if self.ckpt_group is None else {"process_group": self.ckpt_group}

    # -- one checkpoint ------------------------------------------------------

    def save(self, variant: str, ctx: dict, model, opt, step: int) -> dict:
        """Issue one async checkpoint; returns its timings."""
        rec = {"prev_wait_s": 0.0}
        pending = ctx["pending"]
        if pending and variant not in ORDERED_BY_US:  # DCP (and ours_wait): previous upload must be done
            t = time.perf_counter()
            pending[-1]["upload"].result()
            rec["prev_wait_s"] = time.perf_counter() - t
        t = time.perf_counter()
        msd, osd = get_state_dict(model, opt)
        sd = {"model": msd, "optim": osd}
        if variant in MANAGER_VARIANTS:
            upload = ctx["manager"].save(step, sd)
            entry = {"path": ctx["manager"].path_of(step), "writer": None, "upload": upload, "staging": None}
        else:
            entry = self.dcp_save(variant, ctx, sd)
        rec["call_s"] = time.perf_counter() - t
        entry["sd"] = sd
        ctx["inflight_staging"] = entry["staging"]
        if variant in MANAGER_VARIANTS:
            ctx["first"] = ctx["first"] or entry  # the manager keeps its own retention
        else:
            pending.append(entry)
            self.reap(ctx)
        return rec

    def dcp_save(self, variant: str, ctx: dict, sd: dict) -> dict:
        path = self.fresh(variant)
        kwargs = self.dcp_kwargs()
        if variant in ("ours", "ours_wait"):
            writer = DataStatesWriter(path, host_cache_bytes=self.args.cache_mib * MiB)
        else:
            writer = FileSystemWriter(path)
            if ctx["stager"] is not None:
                kwargs["async_stager"] = ctx["stager"]
            if variant in ("dcp_process", "dcp_pinned"):
                kwargs["async_checkpointer_type"] = AsyncCheckpointerType.PROCESS
        resp = dcp.async_save(sd, storage_writer=writer, **kwargs)
        if isinstance(resp, Future):
            staging, upload = None, resp
        else:
            staging, upload = resp.staging_completion, resp.upload_completion
        return {"path": path, "writer": writer, "upload": upload, "staging": staging}

    @staticmethod
    def finish(entry: dict) -> None:
        entry["upload"].result()
        close = getattr(entry["writer"], "close", None)
        if callable(close):
            close()

    def reap(self, ctx: dict, keep: int = KEEP) -> None:
        """Delete checkpoints older than the last `keep` whose upload is done."""
        pending = ctx["pending"]
        while len(pending) > keep and pending[0]["upload"].done():
            entry = pending.pop(0)
            self.finish(entry)
            shutil.rmtree(entry["path"], ignore_errors=True)

    def verify(self, variant: str, ctx: dict, entry: dict, step: int) -> None:
        dst = zeros_tree(entry["sd"])
        if variant in MANAGER_VARIANTS:
            loaded = ctx["manager"].load(dst, step=step)
            if loaded != step:
                raise AssertionError(f"{variant}: manager.load returned step {loaded}, not {step}")
        else:
            path = entry["path"]
            reader = DataStatesReader(path) if variant.startswith("ours") else FileSystemReader(path)
            dcp.load(dst, storage_reader=reader, **self.dcp_kwargs())
        check_equal(variant, entry["sd"], dst)

    # -- one run -------------------------------------------------------------

    def open_run(self, variant: str | None, opt) -> dict:
        """A run's checkpoint machinery: its stager, manager or fence hook."""
        a = self.args
        ctx = {"pending": [], "inflight_staging": None, "stager": None, "manager": None, "hook": None,
               "first": None, "dirs": [], "durable": False, "manual_fence": variant is not None}
        options = dcp_staging_options(variant or "", self.cuda)
        if options is not None:
            ctx["stager"] = DefaultStager(options)
        if variant in MANAGER_VARIANTS:
            local_dir = self.fresh(variant)
            kw = {"keep_last": KEEP, "host_cache_bytes": a.cache_mib * MiB}
            if variant == "ours_manager":
                durable = self.fresh(variant + "-durable")
                ctx["dirs"].append(durable)
                ctx["durable"] = True
                kw.update(durable=durable, durable_keep_last=KEEP, incremental=False)
            else:
                kw.update(incremental=True)
            ctx["dirs"].append(local_dir)
            ctx["manager"] = dcp_datastates.CheckpointManager(local_dir, dcp_datastates.CheckpointManagerOptions(**kw))
            ctx["manual_fence"] = False
            self.fence_kind[variant] = "CheckpointManager's process-wide optimizer step pre-hook"
        elif variant in ("ours", "ours_wait") and hasattr(dcp_datastates, "install_fence"):
            ctx["hook"] = dcp_datastates.install_fence(opt)
            ctx["manual_fence"] = False
            self.fence_kind[variant] = "dcp_datastates.install_fence(optimizer)"
        elif variant in ("ours", "ours_wait"):
            self.fence_kind[variant] = "resp.staging_completion.result() before optimizer.step()"
        return ctx

    def first_save(self, variant: str, ctx: dict, model, opt) -> None:
        """Untimed: stager cache, pool, daemon, imports; the first run of a variant verifies it."""
        self.save(variant, ctx, model, opt, 0)
        t = time.perf_counter()
        if ctx["manager"] is not None:
            first = ctx["first"]
            ctx["manager"].wait_durable()  # its durable copy is not billed to the timed loop
        else:
            first = ctx["pending"][-1]
            self.finish(first)
        self.upload_s[variant] = max(self.upload_s.get(variant, 0.0), time.perf_counter() - t)
        if variant not in self.verified:
            self.verify(variant, ctx, first, 0)
            self.verified.add(variant)
        ctx["inflight_staging"] = None

    def drain(self, ctx: dict) -> tuple[float, float | None]:
        """Wait for the remaining uploads: (drain s, durable drain s or None)."""
        t = time.perf_counter()
        for entry in ctx["pending"]:
            self.finish(entry)
        if ctx["manager"] is not None:
            ctx["manager"].wait()
        drain = time.perf_counter() - t
        if not ctx["durable"]:
            return drain, None
        t = time.perf_counter()
        ctx["manager"].wait_durable()
        return drain, time.perf_counter() - t

    def close_run(self, ctx: dict) -> None:
        """Release everything open_run made, even after a failure (a left-over fence would slow later runs)."""
        try:
            for entry in ctx["pending"]:
                try:
                    self.finish(entry)
                except Exception:  # noqa: BLE001 - the run's error is already reported
                    pass
            if ctx["manager"] is not None:
                ctx["manager"].close()
        finally:
            if ctx["hook"] is not None and hasattr(ctx["hook"], "remove"):
                ctx["hook"].remove()
            if ctx["stager"] is not None:
                ctx["stager"].close()
            for path in [e["path"] for e in ctx["pending"]] + ctx["dirs"]:
                shutil.rmtree(path, ignore_errors=True)
            ctx["pending"].clear()

    def run(self, variant: str | None, every: int) -> dict:
        a = self.args
        model, opt = self.build()
        for i in range(a.warmup):
            self.step_fwd_bwd(model, opt, i)
            opt.step()
        self.sync()
        ctx = self.open_run(variant, opt)
        try:
            if variant is not None:
                self.first_save(variant, ctx, model, opt)
            r = self.timed_loop(variant, every, ctx, model, opt)
        finally:
            self.close_run(ctx)
            del model, opt, ctx
            gc.collect()
            if self.cuda:
                torch.cuda.empty_cache()
            os.sync()  # the deleted checkpoints' discards are not billed to the next run
        return r

    def timed_loop(self, variant: str | None, every: int, ctx: dict, model, opt) -> dict:
        gc.collect()
        if self.cuda:  # the peak of the timed loop (not of the first save's load-back)
            torch.cuda.reset_peak_memory_stats(self.device)
        iters, calls, fences, prev = [], [], [], []
        saves = 0
        t_run = time.perf_counter()
        for i in range(self.iters_for(every)):
            t0 = time.perf_counter()
            self.step_fwd_bwd(model, opt, i)
            if ctx["manual_fence"] and ctx["inflight_staging"] is not None:
                t = time.perf_counter()
                ctx["inflight_staging"].result()
                fences.append(time.perf_counter() - t)
                ctx["inflight_staging"] = None
            opt.step()
            self.sync()  # cuda: the step is done before anything copies the state
            if variant is not None and (i + 1) % every == 0:
                rec = self.save(variant, ctx, model, opt, i + 1)
                calls.append(rec["call_s"])
                prev.append(rec["prev_wait_s"])
                saves += 1
                self.sync()  # cuda: whatever the call queued on the compute stream
            iters.append(time.perf_counter() - t0)
        drain, durable = self.drain(ctx)
        total = time.perf_counter() - t_run
        peak = torch.cuda.max_memory_allocated(self.device) if self.cuda else None
        return {"iters_s": iters, "call_s": calls, "fence_s": fences, "prev_wait_s": prev,
                "saves": saves, "drain_s": drain, "durable_drain_s": durable, "total_s": total,
                "gpu_peak_bytes": peak}


# ---------------------------------------------------------------- setup


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(ap, "dim 256, 4 layers, 20 iterations, 1 rep", reps_help="repetitions of every run (default 2, --quick 1)")
    ap.add_argument("--iters", type=int, default=None, help="timed iterations per run (default 40, --quick 20)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed iterations at the start of every run")
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help=f"comma-separated subset of {','.join(ALL_VARIANTS)} (default {','.join(VARIANTS)})")
    ap.add_argument("--every", default="1,10", help="checkpoint intervals in iterations (default 1,10)")
    ap.add_argument("--cache-mib", type=int, default=None,
                    help="ours: host_cache_bytes in MiB (default 256 on cpu; on cuda the checkpoint's size "
                         "rounded up to 256 MiB: a full copy, as DCP's stagers hold)")
    ap.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (default 2)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the model trains (default cpu)")
    ap.add_argument("--fsdp", action=argparse.BooleanOptionalAction, default=None,
                    help="FSDP2 fully_shard on every block and the root (default: on with cuda, off on cpu)")
    ap.add_argument("--dtype", choices=tuple(DTYPES), default=None,
                    help="parameter (and AdamW state) dtype (default bf16 on cuda, fp32 on cpu)")
    ap.add_argument("--preset", choices=tuple(PRESETS), default=None,
                    help="model and batch shape: tiny (dim 128, 2 layers, vocab 1024, batch 2x64) or 1b "
                         "(dim 2048, 18 layers, vocab 32000, batch 8x1024); explicit options override it")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="start no repetition, and no run, that would (by an estimate from the runs so far) end "
                         "past this many seconds since the process started; those left out are listed")
    ap.add_argument("--every1-iters", type=int, default=None,
                    help="timed iterations of the runs with a checkpoint every iteration (default --iters)")
    ap.add_argument("--every1-variants", default=None,
                    help="variants run with a checkpoint every iteration (default --variants)")
    ap.add_argument("--dim", type=int, default=None, help="model width (default 384, --quick 256)")
    ap.add_argument("--layers", type=int, default=None, help="transformer blocks (default 6, --quick 4)")
    ap.add_argument("--vocab", type=int, default=None, help="vocabulary (default 8192)")
    ap.add_argument("--batch", type=int, default=None, help="sequences per batch (default 4)")
    ap.add_argument("--seq", type=int, default=None, help="tokens per sequence (default 128)")
    args = ap.parse_args()
    args.iters = args.iters or (20 if args.quick else 40)
    args.every1_iters = args.every1_iters or args.iters
    args.reps = args.reps or (1 if args.quick else 2)
    preset = PRESETS.get(args.preset, {})
    quick = QUICK_SHAPE if args.quick else {}
    for k, default in DEFAULT_SHAPE.items():
        if getattr(args, k) is None:
            setattr(args, k, preset.get(k, quick.get(k, default)))
    pick_device(args.device)  # cuda without a GPU exits here, before anything is set up
    cuda = args.device == "cuda"
    args.fsdp = cuda if args.fsdp is None else args.fsdp
    args.dtype = args.dtype or ("bf16" if cuda else "fp32")
    return args


def init_dist(args) -> tuple[torch.device, object]:
    """The training device and process group; returns (device, the gloo group raw DCP saves use or None)."""
    # DCP's PROCESS daemon joins a store at MASTER_ADDR, else at this host's FQDN (which a box without
    # outside DNS may not resolve); this run is on one host
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if args.device == "cuda":
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
        return device, dist.new_group(backend="gloo")  # async_save refuses a group without a CPU backend
    init_gloo()
    # FSDP's collectives use the default group: checkpoints get their own, as a trainer would do
    return torch.device("cpu"), (dist.new_group(backend="gloo") if args.fsdp else None)


def describe_model(bench: Bench) -> dict:
    """Parameter count and checkpoint size, from a model trained --warmup steps (warms the process up)."""
    model, opt = bench.build()
    nparams = sum(p.numel() for p in model.parameters())
    for i in range(max(1, bench.args.warmup)):  # the process's first iterations: lazy inits, kernel choices
        bench.step_fwd_bwd(model, opt, i)
        opt.step()
    bench.sync()
    msd, osd = get_state_dict(model, opt)
    ts = [local(t) for _, t in tensors({"model": msd, "optim": osd})]
    out = {"params": nparams, "ckpt_bytes": sum(t.nbytes for t in ts), "ckpt_tensors": len(ts)}
    del model, opt, msd, osd, ts
    gc.collect()
    if bench.cuda:
        torch.cuda.empty_cache()
    return out


def default_cache_mib(device: torch.device, ckpt_bytes: int) -> int:
    """256 MiB on the CPU. On cuda the whole checkpoint: with a smaller pool, staging (and so the
    fence before optimizer.step()) waits for the disk, while DCP's stagers keep a full host copy."""
    if device.type != "cuda":
        return 256
    return max(256, -(-ckpt_bytes // (256 * MiB)) * 256)


def select_variants(spec: str) -> tuple[list[str], dict]:
    variants = [v for v in spec.split(",") if v]
    for v in variants:
        if v not in ALL_VARIANTS:
            raise SystemExit(f"unknown variant {v!r}")
    skipped = {}
    if OURS_ERROR is not None:
        for v in [v for v in variants if v.startswith("ours")]:
            skipped[v] = f"import dcp_datastates failed: {OURS_ERROR}"
            variants.remove(v)
    return variants, skipped


def print_header(args, root, info, dev, model, variants, skipped) -> None:
    print(f"dcp_datastates training-loop benchmark: dir={root} ({info['disk_free_bytes'] / GB:.0f} GB free) "
          f"iters={args.iters} reps={args.reps} quick={args.quick} threads={args.threads} "
          f"cache={args.cache_mib} MiB"
          + (f" budget={args.budget_s:.0f}s" if args.budget_s else ""))
    print(f"nproc={info['nproc']} cpu={info.get('cpu', '?')} torch={info['torch']} "
          f"loadavg={' '.join(info.get('loadavg_start', []))}"
          + (f" /dev/shm={dev['dev_shm_bytes'] / GiB:.1f} GiB" if "dev_shm_bytes" in dev else ""))
    if dev["type"] == "cuda":
        print(f"device: cuda:0 {dev['name']} ({dev['total_memory'] / GiB:.1f} GiB, sm {dev['capability']}), "
              f"CUDA {dev['cuda']}; NCCL group for training, gloo groups for checkpoints")
    else:
        print("device: cpu; gloo group" + (" (a second one for checkpoints)" if args.fsdp else ""))
    print(f"model: dim {args.dim}, {args.layers} layers, vocab {args.vocab}, batch {args.batch}x{args.seq}"
          f"{f' (preset {args.preset})' if args.preset else ''}, {args.dtype}, "
          f"{'FSDP2 (fully_shard per block + root)' if args.fsdp else 'no FSDP'}: "
          f"{model['params']:,} params ({model['params'] / 1e6:.2f}M), AdamW; "
          f"checkpoint {model['ckpt_tensors']} tensors, {model['ckpt_bytes'] / GB:.3f} GB")
    for v in variants:
        options = dcp_staging_options(v, dev["type"] == "cuda")
        if options is not None:
            note = "" if dev["type"] == "cuda" or v != "dcp_pinned" else (
                " (on the CPU torch ignores the pinning, and non-blocking copies need CUDA: off)")
            print(f"{v}: DefaultStager({describe_options(options)})"
                  f"{' + AsyncCheckpointerType.PROCESS' if v == 'dcp_pinned' else ''}{note}")
    for v, why in skipped.items():
        print(f"skipped {v}: {why}")


# ---------------------------------------------------------------- runs and report


def run_all(bench: Bench, runs: list, args, progress) -> tuple[dict, int, str | None]:
    """Round-robin repetitions within --budget-s; returns (results, repetitions done, why stopped).
    progress(results, repetitions done) is called after every run (it writes the partial JSON)."""
    results = {r: [] for r in runs}
    last_rep_s = 0.0
    stopped = None
    done = 0
    for rep in range(args.reps):
        elapsed = time.perf_counter() - _T0
        if args.budget_s and rep > 0 and elapsed + last_rep_s > args.budget_s:
            stopped = (f"budget {args.budget_s:.0f}s: stopped after {done}/{args.reps} repetitions "
                       f"(elapsed {elapsed:.0f}s + last repetition {last_rep_s:.0f}s)")
            print(stopped, flush=True)
            break
        t_rep = time.perf_counter()
        order = runs[rep % len(runs):] + runs[:rep % len(runs)]
        for variant, every in order:
            run_one(bench, results, rep, args.reps, variant, every)
            progress(results, done)
        last_rep_s = time.perf_counter() - t_rep
        done += 1
    return results, done, stopped


def run_one(bench: Bench, results: dict, rep: int, reps: int, variant: str | None, every: int) -> None:
    name = f"{variant or 'none'}/{every or '-'}"
    if name in bench.failed or name in bench.no_room or name in bench.no_budget:
        return
    short = disk_shortfall(bench, variant, every)
    if short:
        bench.no_room[name] = short
        print(f"  {name}: not run: {short}", flush=True)
        return
    budget = bench.args.budget_s
    est = bench.estimate(variant, every) if budget else None
    elapsed = time.perf_counter() - _T0
    if est is not None and elapsed + est[0] > budget:
        bench.no_budget[name] = (f"budget {budget:.0f}s: {elapsed:.0f}s elapsed + ~{est[0]:.0f}s for this run "
                                 f"({est[1]})")
        print(f"  {name}: not measured: {bench.no_budget[name]}", flush=True)
        return
    t = time.perf_counter()
    try:
        r = bench.run(variant, every)
    except Exception as e:  # noqa: BLE001 - report, keep the other runs
        bench.failed[name] = f"{type(e).__name__}: {e}"
        print(f"  {name}: FAILED: {bench.failed[name]}", flush=True)
        print(textwrap.indent(traceback.format_exc(limit=-8), "    "), flush=True)  # where it failed
        return
    bench.walls.append({"name": name, "variant": variant, "every": every, "saves": r["saves"],
                        "wall_s": time.perf_counter() - t})
    results[(variant, every)].append(r)
    extra = "" if r["durable_drain_s"] is None else f" durable drain {r['durable_drain_s']:.2f}s"
    gpu = "" if r["gpu_peak_bytes"] is None else f" GPU peak {r['gpu_peak_bytes'] / GiB:.1f} GiB"
    print(f"rep {rep + 1}/{reps} {name:<22} median {median(r['iters_s']):.3f}s "
          f"mean {mean(r['iters_s']):.3f}s saves {r['saves']} drain {r['drain_s']:.2f}s{extra}{gpu} "
          f"(run {bench.walls[-1]['wall_s']:.0f}s, {time.perf_counter() - _T0:.0f}s since start)", flush=True)


def disk_need(variant: str | None, every: int, iters: int, ckpt_bytes: int) -> int:
    """Bytes a run may hold on disk at once. The manager keeps a local step until its durable copy
    commits, and its drain waits while a save runs, so with back-to-back saves every step stays."""
    if variant is None:
        return 0
    if variant == "ours_manager":
        return (iters // every + 1 + KEEP + 1) * ckpt_bytes
    return (KEEP + 2) * ckpt_bytes  # the kept ones, one uploading, one staged


def disk_shortfall(bench: Bench, variant: str | None, every: int) -> str | None:
    """Why a run would not fit (None: it fits): on --dir's disk, or in /dev/shm for the variants
    whose staged copies live in shared memory (a tmpfs that runs full kills the process: SIGBUS)."""
    need = disk_need(variant, every, bench.iters_for(every), bench.ckpt_bytes)
    free = shutil.disk_usage(bench.root).free
    if need > 0.95 * free:
        return (f"may need {need / GB:.1f} GB on {bench.root}'s disk, {free / GB:.1f} GB free "
                f"(a larger --every, fewer --iters or another --dir)")
    if variant in ("dcp_pinned", "dcp_process") and os.path.isdir("/dev/shm"):
        shm = shutil.disk_usage("/dev/shm").free  # the parent's staged copy and the daemon's last one
        if 2 * bench.ckpt_bytes > 0.95 * shm:
            return f"needs {2 * bench.ckpt_bytes / GB:.1f} GB of /dev/shm, {shm / GB:.1f} GB free"
    return None


def make_rows(runs: list, results: dict) -> list[dict]:
    base_runs = results[(None, 0)]
    base_med = median([x for r in base_runs for x in r["iters_s"]])
    base_mean = mean([x for r in base_runs for x in r["iters_s"]])
    rows = []
    for variant, every in runs:
        rs = results[(variant, every)]
        if not rs:
            continue
        its = [x for r in rs for x in r["iters_s"]]
        peaks = [r["gpu_peak_bytes"] for r in rs if r["gpu_peak_bytes"] is not None]
        rows.append({
            "variant": variant or "-", "every": every or None, "iters": len(rs[0]["iters_s"]),
            "median_s": median(its), "mean_s": mean(its), "max_s": max(its),
            "slowdown_median_pct": (median(its) / base_med - 1) * 100 if base_med else None,
            "slowdown_mean_pct": (mean(its) / base_mean - 1) * 100 if base_mean else None,
            "saves": sum(r["saves"] for r in rs) / len(rs),
            "call_ms": ms(median([x for r in rs for x in r["call_s"]])),
            "fence_ms": ms(median([x for r in rs for x in r["fence_s"]])),  # None: no explicit fence
            "prev_wait_ms": ms(median([x for r in rs for x in r["prev_wait_s"]])),
            "drain_s": median([r["drain_s"] for r in rs]),
            "durable_drain_s": median([r["durable_drain_s"] for r in rs]),
            "gpu_peak_gib": max(peaks) / GiB if peaks else None,
        })
    return rows


def print_table(rows: list[dict], args, model: dict, reps_done: int, cuda: bool) -> None:
    print()
    short = any(r["every"] == 1 for r in rows) and args.every1_iters != args.iters
    print(f"=== {args.iters} iterations{f' ({args.every1_iters} every iteration)' if short else ''} x {reps_done} "
          f"rep(s), {model['params'] / 1e6:.2f}M params, checkpoint "
          f"{model['ckpt_bytes'] / GB:.3f} GB; iteration times in s; slowdown vs no checkpoint ===")
    print(f"{'schedule':<18}{'variant':<17}{'median':>8}{'mean':>8}{'max':>8}{'slow med':>10}{'slow mean':>10}"
          f"{'saves':>7}{'call ms':>9}{'fence ms':>9}{'prev ms':>9}{'drain s':>8}{'dur s':>8}"
          + (f"{'GPU GiB':>8}" if cuda else ""))
    for row in rows:
        sched = "no checkpoint" if row["every"] is None else (
            "every iteration" if row["every"] == 1 else f"every {row['every']} iters")
        print(f"{sched:<18}{row['variant']:<17}{fmt(row['median_s'], '.3f')}{fmt(row['mean_s'], '.3f')}"
              f"{fmt(row['max_s'], '.3f')}{fmt(row['slowdown_median_pct'], '+.1f', 9)}%"
              f"{fmt(row['slowdown_mean_pct'], '+.1f', 9)}%{fmt(row['saves'], '.0f', 7)}"
              f"{fmt(row['call_ms'], '.1f', 9)}{fmt(row['fence_ms'], '.1f', 9)}"
              f"{fmt(row['prev_wait_ms'], '.1f', 9)}{fmt(row['drain_s'] if row['every'] else None, '.2f')}"
              f"{fmt(row['durable_drain_s'], '.2f')}" + (fmt(row["gpu_peak_gib"], ".1f") if cuda else ""))
    print("call = the checkpoint call (get_state_dict + dcp.async_save or manager.save); fence = explicit wait "
          "for staging before optimizer.step(); prev = wait for the previous upload before a new save; "
          "drain = the remaining uploads (manager: wait()); dur s = manager.wait_durable() after that")


def check_targets(rows: list[dict]) -> list[dict]:
    """The targets: every ours variant under TARGET_SLOWDOWN_PCT at TARGET_EVERY, and below DCP's best
    (the smallest mean of the dcp_* rows) at every interval."""
    out = []
    ours = [r for r in rows if r["variant"].startswith("ours")]
    for r in ours:
        if r["every"] == TARGET_EVERY and r["slowdown_mean_pct"] is not None:
            out.append({"target": f"{r['variant']} every {TARGET_EVERY}: mean slowdown < {TARGET_SLOWDOWN_PCT:g}%",
                        "value": r["slowdown_mean_pct"], "pass": r["slowdown_mean_pct"] < TARGET_SLOWDOWN_PCT})
    for every in sorted({r["every"] for r in ours}):
        dcp_rows = [r for r in rows if r["variant"].startswith("dcp_") and r["every"] == every]
        if not dcp_rows:
            continue
        best = min(dcp_rows, key=lambda r: r["mean_s"])
        for r in (r for r in ours if r["every"] == every):
            out.append({"target": f"{r['variant']} every {every}: mean below DCP's best ({best['variant']})",
                        "value": r["slowdown_mean_pct"], "reference": best["slowdown_mean_pct"],
                        "pass": r["mean_s"] < best["mean_s"]})
    return out


def print_targets(targets: list[dict], rows: list[dict]) -> None:
    if not any(r["every"] == TARGET_EVERY for r in rows if r["variant"].startswith("ours")):
        print(f"target: no ours row with a checkpoint every {TARGET_EVERY} iterations (add {TARGET_EVERY} to --every)")
    for t in targets:  # the slowdowns are None without a no-checkpoint row
        ref = "" if "reference" not in t else f" vs {fmt(t['reference'], '+.1f', 0)}%"
        print(f"target {'PASS' if t['pass'] else 'FAIL'}: {t['target']} ({fmt(t['value'], '+.1f', 0)}%{ref})")


# ---------------------------------------------------------------- main


def main() -> int:
    args = parse_args()
    everies = [int(x) for x in args.every.split(",") if x]
    variants, skipped = select_variants(args.variants)
    every1_variants, skipped1 = select_variants(args.every1_variants or args.variants)
    skipped.update(skipped1)
    torch.set_num_threads(args.threads)
    device, ckpt_group = init_dist(args)
    base, root, created_base = make_scratch(args.dir, "train-")
    info = machine_info()
    info["disk_free_bytes"] = shutil.disk_usage(root).free
    dev = device_info(device)
    t_start = time.perf_counter()
    try:
        bench = Bench(args, root, device, ckpt_group)
        model = describe_model(bench)
        bench.ckpt_bytes = model["ckpt_bytes"]
        if args.cache_mib is None:
            args.cache_mib = default_cache_mib(device, model["ckpt_bytes"])
        used = [v for v in ALL_VARIANTS if v in variants or (1 in everies and v in every1_variants)]
        print_header(args, root, info, dev, model, used, skipped)
        runs = [(None, 0)] + [(v, k) for k in everies for v in (every1_variants if k == 1 else variants)]

        def report(results: dict, reps_done: int, stopped: str | None, complete: bool) -> dict:
            rows = make_rows(runs, results)
            return {"complete": complete, "config": {**vars(args), "argv": sys.argv, "dir": root}, "machine": info,
                    "device": dev, "model": model, "rows": rows, "targets": check_targets(rows),
                    "fence": bench.fence_kind,
                    "staging_options": {v: describe_options(o) for v in used
                                        if (o := dcp_staging_options(v, device.type == "cuda")) is not None},
                    "verified": sorted(bench.verified), "failed": bench.failed, "skipped": skipped,
                    "not_run_disk": bench.no_room, "not_run_budget": bench.no_budget,
                    "budget": {"budget_s": args.budget_s, "reps_done": reps_done, "stopped": stopped},
                    "wall_s": time.perf_counter() - t_start, "process_wall_s": time.perf_counter() - _T0,
                    "run_walls": bench.walls,
                    "runs": {f"{v or 'none'}/{k}": rs for (v, k), rs in results.items()}}

        def progress(results: dict, reps_done: int) -> None:
            if args.json:  # the figures so far, in case the process is killed before the end
                write_json(args.json, report(results, reps_done, None, False))

        results, reps_done, stopped = run_all(bench, runs, args, progress)
        rows = make_rows(runs, results)
        print_table(rows, args, model, reps_done, device.type == "cuda")
        for v, kind in sorted(bench.fence_kind.items()):
            print(f"{v} fence: {kind}")
        for v, why in {**skipped, **bench.no_room, **bench.failed}.items():
            print(f"not measured: {v}: {why}")
        for v, why in bench.no_budget.items():
            print(f"not measured: budget: {v}: {why}")
        print(f"bit-exact round trips verified: {', '.join(sorted(bench.verified)) or '-'}")
        print_targets(check_targets(rows), rows)
        if stopped:
            print(stopped)
        print(f"total wall time {time.perf_counter() - t_start:.0f}s ({time.perf_counter() - _T0:.0f}s since start)")
        if args.json:
            write_json(args.json, report(results, reps_done, stopped, True))
            print(f"wrote {args.json}")
    finally:
        remove_scratch(base, root, created_base)
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
