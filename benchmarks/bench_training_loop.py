#!/usr/bin/env python
"""Training-loop benchmark: how much asynchronous checkpointing slows down a
small CPU transformer trained with AdamW, for dcp_datastates and for DCP's
async_save, with no checkpoint, a checkpoint every iteration and one every 10.

    python benchmarks/bench_training_loop.py [--quick] [--dir DIR] [--iters N] [--reps N]
                                             [--json OUT] [--variants LIST] [--every LIST]

Model: token embedding + learned positions, --layers pre-norm
nn.TransformerEncoderLayer blocks (causal mask, no dropout), final LayerNorm and
an untied LM head; AdamW. Default dim 384, 6 layers, vocab 8192, batch 4 x 128
tokens: ~17M parameters, a ~204 MB checkpoint (parameters + both AdamW moments).
--quick: dim 256, 4 layers (~7.4M parameters, ~89 MB), 20 iterations, 1 rep.

Checkpoint = {"model": ..., "optim": ...} from
torch.distributed.checkpoint.state_dict.get_state_dict(model, optimizer),
taken right after optimizer.step() of every k-th iteration, each to a fresh
directory (old ones are deleted once their upload is done; the last 2 are kept).

Variants
  dcp_default   dcp.async_save(sd, storage_writer=FileSystemWriter(p)): the copy
                happens inside the call. Before a new async_save the previous
                upload future is waited (DCP requires it).
  dcp_stager    ... async_stager=DefaultStager(StagingOptions(False, False, True,
                False)) (background-thread staging into a cached copy, the best
                CPU configuration), one stager per run, closed at its end. Fence:
                resp.staging_completion.result() before optimizer.step();
                previous upload waited before a new save.
  dcp_process   (not in the default list) DCP default stager with
                AsyncCheckpointerType.PROCESS.
  ours          DataStatesWriter(p, host_cache_bytes=--cache-mib); fence:
                dcp_datastates.install_fence(optimizer) when the package has it
                (an optimizer step pre-hook), else resp.staging_completion.result()
                before optimizer.step(). A new save is issued while the previous
                one may still be uploading (ours orders them).
  ours_wait     (not in the default list) ours, but waiting the previous upload
                before a new save, like DCP.

Per run: --warmup untimed iterations, then one untimed save (warms the stager
cache / pool / daemon; the first run of each variant loads it back and checks
it bit-exactly), then --iters timed iterations. An iteration is forward,
backward, fence, optimizer.step(), and the checkpoint call when due; all of it
is timed. After the last iteration the remaining uploads are drained (reported
apart, "drain"). Runs are done round-robin over --reps repetitions (the start
shifts each repetition). Reported: median and mean iteration time over all
timed iterations of all repetitions and the slowdown (%) against no
checkpoint. With a checkpoint every 10 iterations the median hides the
checkpoint iterations: look at the mean. torch.set_num_threads(--threads):
checkpoint threads compete with training for the same cores, which is what
this measures.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import shutil
import statistics
import sys
import time
import warnings
from concurrent.futures import Future

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

from bench_common import (  # noqa: E402
    add_common_args, fmt, init_gloo, machine_info, make_scratch, median, remove_scratch, write_json,
)

try:
    import dcp_datastates  # noqa: E402
    from dcp_datastates import DataStatesReader, DataStatesWriter  # noqa: E402
    OURS_ERROR = None
except Exception as e:  # noqa: BLE001 - the core may be mid-rewrite; DCP variants still run
    dcp_datastates = None
    OURS_ERROR = f"{type(e).__name__}: {e}"

MiB = 1 << 20
GB = 1e9
VARIANTS = ["ours", "dcp_default", "dcp_stager"]
ALL_VARIANTS = ["ours", "ours_wait", "dcp_default", "dcp_stager", "dcp_process"]
KEEP = 2  # checkpoints kept on disk per run


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


def zeros_tree(tree):
    if isinstance(tree, torch.Tensor):
        return torch.zeros_like(tree)
    if isinstance(tree, dict):
        return {k: zeros_tree(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [zeros_tree(v) for v in tree]
    return tree


def mean(xs):
    xs = [x for x in xs if x is not None]
    return statistics.fmean(xs) if xs else None


def ms(x):
    return None if x is None else x * 1e3


# ---------------------------------------------------------------- runner


class Bench:
    def __init__(self, args, root: str) -> None:
        self.args = args
        self.root = root
        self.counter = 0
        gen = torch.Generator().manual_seed(1234)
        # fixed batches, reused cyclically by every run
        self.batches = [torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=gen)
                        for _ in range(8)]
        self.verified: set[str] = set()
        self.failed: dict[str, str] = {}
        self.fence_kind = None

    def fresh(self, tag: str) -> str:
        self.counter += 1
        return os.path.join(self.root, f"{tag}-{self.counter:04d}")

    def build(self):
        a = self.args
        torch.manual_seed(0)
        model = TinyLM(a.vocab, a.dim, a.layers, a.seq)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
        return model, opt

    def step_fwd_bwd(self, model, opt, i: int) -> None:
        x = self.batches[i % len(self.batches)]
        out = model(x[:, :-1])
        loss = nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), x[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()

    # -- one checkpoint ------------------------------------------------------

    def save(self, variant: str, ctx: dict, model, opt) -> dict:
        """Issue one async checkpoint; returns its pending record and timings."""
        rec = {"prev_wait_s": 0.0}
        pending = ctx["pending"]
        if pending and variant != "ours":  # DCP (and ours_wait): previous upload must be done
            t = time.perf_counter()
            pending[-1]["upload"].result()
            rec["prev_wait_s"] = time.perf_counter() - t
        path = self.fresh(variant)
        t = time.perf_counter()
        msd, osd = get_state_dict(model, opt)
        sd = {"model": msd, "optim": osd}
        kwargs = {}
        if variant in ("ours", "ours_wait"):
            writer = DataStatesWriter(path, host_cache_bytes=self.args.cache_mib * MiB)
        else:
            writer = FileSystemWriter(path)
            if variant == "dcp_stager":
                kwargs["async_stager"] = ctx["stager"]
            elif variant == "dcp_process":
                kwargs["async_checkpointer_type"] = AsyncCheckpointerType.PROCESS
        resp = dcp.async_save(sd, storage_writer=writer, **kwargs)
        rec["call_s"] = time.perf_counter() - t
        if isinstance(resp, Future):
            staging, upload = None, resp
        else:
            staging, upload = resp.staging_completion, resp.upload_completion
        pending.append({"path": path, "writer": writer, "upload": upload, "staging": staging, "sd": sd})
        ctx["inflight_staging"] = staging
        self.reap(ctx)
        return rec

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

    def verify(self, variant: str, entry: dict) -> None:
        dst = zeros_tree(entry["sd"])
        reader = DataStatesReader(entry["path"]) if variant.startswith("ours") else FileSystemReader(entry["path"])
        dcp.load(dst, storage_reader=reader)
        want = dict(tensors(entry["sd"]))
        got = dict(tensors(dst))
        if set(want) != set(got):
            raise AssertionError(f"{variant}: keys differ after the round trip")
        for k, v in want.items():
            if got[k].dtype != v.dtype or got[k].shape != v.shape or not torch.equal(got[k], v):
                raise AssertionError(f"{variant}: tensor {k!r} differs after the round trip")

    # -- one run -------------------------------------------------------------

    def run(self, variant: str | None, every: int) -> dict:
        a = self.args
        model, opt = self.build()
        for i in range(a.warmup):
            self.step_fwd_bwd(model, opt, i)
            opt.step()
        ctx = {"pending": [], "inflight_staging": None, "stager": None}
        hook = None
        manual_fence = variant is not None
        if variant == "dcp_stager":
            ctx["stager"] = DefaultStager(StagingOptions(
                use_pinned_memory=False, use_shared_memory=False,
                use_async_staging=True, use_non_blocking_copy=False))
        if variant in ("ours", "ours_wait") and hasattr(dcp_datastates, "install_fence"):
            hook = dcp_datastates.install_fence(opt)
            manual_fence = False
            self.fence_kind = "dcp_datastates.install_fence(optimizer)"
        elif variant in ("ours", "ours_wait"):
            self.fence_kind = "resp.staging_completion.result() before optimizer.step()"
        if variant is not None:  # untimed first save: stager cache, pool, daemon, imports
            self.save(variant, ctx, model, opt)
            first = ctx["pending"][-1]
            self.finish(first)
            if variant not in self.verified:
                self.verify(variant, first)
                self.verified.add(variant)
            ctx["inflight_staging"] = None
        gc.collect()
        iters, calls, fences, prev = [], [], [], []
        saves = 0
        t_run = time.perf_counter()
        for i in range(a.iters):
            t0 = time.perf_counter()
            self.step_fwd_bwd(model, opt, i)
            if manual_fence and ctx["inflight_staging"] is not None:
                t = time.perf_counter()
                ctx["inflight_staging"].result()
                fences.append(time.perf_counter() - t)
                ctx["inflight_staging"] = None
            opt.step()
            if variant is not None and (i + 1) % every == 0:
                rec = self.save(variant, ctx, model, opt)
                calls.append(rec["call_s"])
                prev.append(rec["prev_wait_s"])
                saves += 1
            iters.append(time.perf_counter() - t0)
        t = time.perf_counter()
        for entry in ctx["pending"]:
            self.finish(entry)
        drain = time.perf_counter() - t
        total = time.perf_counter() - t_run
        for entry in ctx["pending"]:
            shutil.rmtree(entry["path"], ignore_errors=True)
        ctx["pending"].clear()
        if hook is not None and hasattr(hook, "remove"):
            hook.remove()
        if ctx["stager"] is not None:
            ctx["stager"].close()
        del model, opt, ctx
        gc.collect()
        os.sync()  # the deleted checkpoints' discards are not billed to the next run
        return {"iters_s": iters, "call_s": calls, "fence_s": fences, "prev_wait_s": prev,
                "saves": saves, "drain_s": drain, "total_s": total}


# ---------------------------------------------------------------- main


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(ap, "dim 256, 4 layers, 20 iterations, 1 rep", reps_help="repetitions of every run (default 2, --quick 1)")
    ap.add_argument("--iters", type=int, default=None, help="timed iterations per run (default 40, --quick 20)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed iterations at the start of every run")
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help=f"comma-separated subset of {','.join(ALL_VARIANTS)} (default {','.join(VARIANTS)})")
    ap.add_argument("--every", default="1,10", help="checkpoint intervals in iterations (default 1,10)")
    ap.add_argument("--cache-mib", type=int, default=256, help="ours: host_cache_bytes in MiB (default 256)")
    ap.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (default 2)")
    ap.add_argument("--dim", type=int, default=None, help="model width (default 384, --quick 256)")
    ap.add_argument("--layers", type=int, default=None, help="transformer blocks (default 6, --quick 4)")
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    args = ap.parse_args()
    args.iters = args.iters or (20 if args.quick else 40)
    args.reps = args.reps or (1 if args.quick else 2)
    args.dim = args.dim or (256 if args.quick else 384)
    args.layers = args.layers or (4 if args.quick else 6)
    everies = [int(x) for x in args.every.split(",") if x]
    variants = [v for v in args.variants.split(",") if v]
    for v in variants:
        if v not in ALL_VARIANTS:
            raise SystemExit(f"unknown variant {v!r}")
    skipped = {}
    if OURS_ERROR is not None:
        for v in [v for v in variants if v.startswith("ours")]:
            skipped[v] = f"import dcp_datastates failed: {OURS_ERROR}"
            variants.remove(v)

    torch.set_num_threads(args.threads)
    init_gloo()
    base, root, created_base = make_scratch(args.dir, "train-")
    info = machine_info()
    t_start = time.perf_counter()
    bench = Bench(args, root)
    model, opt = bench.build()
    nparams = sum(p.numel() for p in model.parameters())
    bench.step_fwd_bwd(model, opt, 0)
    opt.step()
    msd, osd = get_state_dict(model, opt)
    ckpt_bytes = sum(t.nbytes for _, t in tensors({"model": msd, "optim": osd}))
    ntensors = len(list(tensors({"model": msd, "optim": osd})))
    del model, opt, msd, osd
    print(f"dcp_datastates training-loop benchmark: dir={root} iters={args.iters} reps={args.reps} "
          f"quick={args.quick} threads={args.threads} cache={args.cache_mib} MiB")
    print(f"nproc={info['nproc']} cpu={info.get('cpu', '?')} torch={info['torch']} "
          f"loadavg={' '.join(info.get('loadavg_start', []))}")
    print(f"model: dim {args.dim}, {args.layers} layers, vocab {args.vocab}, batch {args.batch}x{args.seq}: "
          f"{nparams / 1e6:.2f}M params, AdamW; checkpoint {ntensors} tensors, {ckpt_bytes / GB:.3f} GB")
    for v, why in skipped.items():
        print(f"skipped {v}: {why}")

    runs = [(None, 0)] + [(v, k) for k in everies for v in variants]
    results = {r: [] for r in runs}
    try:
        for rep in range(args.reps):
            order = runs[rep % len(runs):] + runs[:rep % len(runs)]
            for variant, every in order:
                name = f"{variant or 'none'}/{every or '-'}"
                if variant in bench.failed:
                    continue
                try:
                    r = bench.run(variant, every)
                except Exception as e:  # noqa: BLE001 - report, keep the other variants
                    bench.failed[variant] = f"{type(e).__name__}: {e}"
                    print(f"  {name}: FAILED: {bench.failed[variant]}", flush=True)
                    continue
                results[(variant, every)].append(r)
                print(f"rep {rep + 1}/{args.reps} {name:<18} median {median(r['iters_s']):.3f}s "
                      f"mean {mean(r['iters_s']):.3f}s saves {r['saves']} drain {r['drain_s']:.2f}s", flush=True)

        base_runs = results[(None, 0)]
        base_med = median([x for r in base_runs for x in r["iters_s"]])
        base_mean = mean([x for r in base_runs for x in r["iters_s"]])
        rows = []
        for variant, every in runs:
            rs = results[(variant, every)]
            if not rs:
                continue
            its = [x for r in rs for x in r["iters_s"]]
            row = {
                "variant": variant or "-", "every": every or None,
                "median_s": median(its), "mean_s": mean(its), "max_s": max(its),
                "slowdown_median_pct": (median(its) / base_med - 1) * 100,
                "slowdown_mean_pct": (mean(its) / base_mean - 1) * 100,
                "saves": sum(r["saves"] for r in rs) / len(rs),
                "call_ms": ms(median([x for r in rs for x in r["call_s"]])),
                "fence_ms": ms(median([x for r in rs for x in r["fence_s"]])),  # None: no explicit fence
                "prev_wait_ms": ms(median([x for r in rs for x in r["prev_wait_s"]])),
                "drain_s": median([r["drain_s"] for r in rs]),
            }
            rows.append(row)

        print()
        print(f"=== {args.iters} iterations x {args.reps} rep(s), {nparams / 1e6:.2f}M params, checkpoint "
              f"{ckpt_bytes / GB:.3f} GB; iteration times in s; slowdown vs no checkpoint ===")
        print(f"{'schedule':<18}{'variant':<13}{'median':>8}{'mean':>8}{'max':>8}{'slow med':>10}{'slow mean':>10}"
              f"{'saves':>7}{'call ms':>9}{'fence ms':>9}{'prev ms':>9}{'drain s':>8}")
        for row in rows:
            sched = "no checkpoint" if row["every"] is None else (
                "every iteration" if row["every"] == 1 else f"every {row['every']} iters")
            print(f"{sched:<18}{row['variant']:<13}{fmt(row['median_s'], '.3f')}{fmt(row['mean_s'], '.3f')}"
                  f"{fmt(row['max_s'], '.3f')}{fmt(row['slowdown_median_pct'], '+.1f', 9)}%"
                  f"{fmt(row['slowdown_mean_pct'], '+.1f', 9)}%{fmt(row['saves'], '.0f', 7)}"
                  f"{fmt(row['call_ms'], '.1f', 9)}{fmt(row['fence_ms'], '.1f', 9)}"
                  f"{fmt(row['prev_wait_ms'], '.1f', 9)}{fmt(row['drain_s'] if row['every'] else None, '.2f')}")
        print("call = the checkpoint call (get_state_dict + dcp.async_save); fence = explicit wait for "
              "staging before optimizer.step(); prev = wait for the previous upload before a new save")
        if any(v.startswith("ours") for v in variants):
            print(f"ours fence: {bench.fence_kind}")
        for v, why in {**skipped, **bench.failed}.items():
            print(f"not measured: {v}: {why}")
        print(f"bit-exact round trips verified: {', '.join(sorted(bench.verified)) or '-'}")
        wall = time.perf_counter() - t_start
        print(f"total wall time {wall:.0f}s")
        if args.json:
            report = {"config": {**vars(args), "argv": sys.argv, "dir": root}, "machine": info,
                      "model": {"params": nparams, "ckpt_bytes": ckpt_bytes, "ckpt_tensors": ntensors},
                      "rows": rows, "fence": bench.fence_kind, "verified": sorted(bench.verified),
                      "failed": bench.failed, "skipped": skipped, "wall_s": wall,
                      "runs": {f"{v or 'none'}/{k}": rs for (v, k), rs in results.items()}}
            write_json(args.json, report)
    finally:
        remove_scratch(base, root, created_base)
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
