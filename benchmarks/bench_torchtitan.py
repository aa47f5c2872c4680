#!/usr/bin/env python
"""torchtitan's asynchronous checkpoint: how long the trainer is held, stock manager against ours.

    python benchmarks/bench_torchtitan.py [--quick] [--dir DIR] [--reps N] [--json OUT]
                                          [--mode async|async_with_pinned_mem] [--width N] [--layers N]
                                          [--cache-mib N] [--compute-s S]

Each variant runs in a process of its own (one gloo rank), builds torchtitan's
optimizers container and lr schedulers around ``--layers`` bias-free Linear
layers of ``--width`` (AdamW: the saved state is three floats per parameter),
and goes through the trainer's loop: ``save(step)``, ``--compute-s`` of matrix
products standing for forward and backward, ``maybe_wait_for_staging()`` and
``optimizers.step()`` (where our fence waits, if the snapshot still copies),
then ``maybe_wait_for_saving()``. A process's first save is a warm-up (pool
mapping, first allocations) and the next three are timed; each variant runs in
``--reps`` processes, and the medians over them are reported.

Variants (run round-robin, each repetition a fresh process per variant):
  none        the same loop without checkpointing: the optimizer step alone
  torchtitan  torchtitan's CheckpointManager (DCP's FileSystemWriter; in async
              mode a blocking full copy of the state inside save())
  datastates  DataStatesCheckpointManager (our lazy snapshot through
              --cache-mib of reused host memory)

Figures: ``save_s`` (the save() call), ``staging_wait_s`` (the wait before the
step: torchtitan's ``maybe_wait_for_staging`` and our fence's), ``held_s`` (their
sum: how long checkpointing holds the trainer), ``step_s`` (the optimizer step;
against the baseline's, the cost of a background writer competing for the
CPUs), ``committed_s`` (save() to the save's end) and ``max_rss_gib`` of the
process. On a CPU-only host torchtitan's
async_with_pinned_mem cannot run (its stager needs an accelerator).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common as bc  # noqa: E402

VARIANTS = ("none", "torchtitan", "datastates")


def run_one(variant: str, args, root: str) -> dict:
    """One variant's loop in this process; returns its medians."""
    import resource

    import torch
    from torch import nn

    bc.init_gloo()
    from torchtitan.components.checkpointer import CheckpointManager
    from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer, ParamGroupConfig

    from dcp_datastates import wait_for_snapshots
    from dcp_datastates.integrations.torchtitan import DataStatesCheckpointManager

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(args.width, args.width, bias=False) for _ in range(args.layers)])
    optimizers = OptimizersContainer.Config(
        param_groups=[ParamGroupConfig(pattern=".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 1e-4})],
        implementation="foreach",
    ).build(model_parts=[model])
    lr_schedulers = LRSchedulersContainer.Config(warmup_steps=1).build(optimizers=optimizers, training_steps=1000)
    settings = dict(enable=variant != "none", folder="ck", interval=1, async_mode=args.mode, keep_latest_k=2)
    if variant == "datastates":
        config = DataStatesCheckpointManager.Config(host_cache_bytes=args.cache_mib << 20, **settings)
    else:
        config = CheckpointManager.Config(**settings)
    mgr = config.build(dataloader=None, model_parts=[model], optimizers=optimizers, lr_schedulers=lr_schedulers,
                       states={}, sd_adapter=None, base_folder=root)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizers.step()  # the optimizer state exists before the first save
    work = torch.randn(1024, 1024)
    rows = []
    for step in range(1, args.reps + 2):
        t0 = time.perf_counter()
        mgr.save(step)
        t1 = time.perf_counter()
        while time.perf_counter() - t1 < args.compute_s:
            work @ work
        t2 = time.perf_counter()
        mgr.maybe_wait_for_staging()
        wait_for_snapshots()  # the fence's wait, made explicit to be timed apart from the step
        t3 = time.perf_counter()
        optimizers.step()
        t4 = time.perf_counter()
        mgr.maybe_wait_for_saving()
        t5 = time.perf_counter()
        if step > 1:
            rows.append({"save_s": t1 - t0, "staging_wait_s": t3 - t2, "step_s": t4 - t3, "committed_s": t5 - t0})
    mgr.close()
    out = {k: bc.median([r[k] for r in rows]) for k in rows[0]}
    out["max_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    out["state_gib"] = 3 * args.layers * args.width**2 * 4 / 2**30
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    bc.add_common_args(ap, "width 1024, 1 repetition (~30 s)")
    ap.add_argument("--mode", default="async", choices=("async", "async_with_pinned_mem"))
    ap.add_argument("--width", type=int, default=None, help="layer width (default 4096: 768 MiB of state)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--cache-mib", type=int, default=512, help="our host pool (default 512)")
    ap.add_argument("--compute-s", type=float, default=0.5, help="forward and backward stand-in per step")
    ap.add_argument("--one", choices=VARIANTS, help=argparse.SUPPRESS)  # a child's variant
    ap.add_argument("--root", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.width = args.width or (1024 if args.quick else 4096)
    args.reps = args.reps or (1 if args.quick else 3)
    if args.one:
        print(json.dumps(run_one(args.one, args, args.root)))
        return

    base, root, created = bc.make_scratch(args.dir, "torchtitan-")
    fs_type = bc.filesystem_type(root)
    report = {"machine": bc.machine_info(root), "args": vars(args), "runs": {v: [] for v in VARIANTS}}
    try:
        for rep in range(args.reps):
            for variant in VARIANTS[rep % 3:] + VARIANTS[: rep % 3]:
                if variant == "torchtitan" and args.mode == "async_with_pinned_mem":
                    import torch

                    if not torch.cuda.is_available():
                        continue
                run_root = os.path.join(root, f"{variant}-{rep}")
                child = [sys.executable, os.path.abspath(__file__), "--one", variant, "--root", run_root,
                         "--mode", args.mode, "--width", str(args.width), "--layers", str(args.layers),
                         "--cache-mib", str(args.cache_mib), "--compute-s", str(args.compute_s), "--reps", "3"]
                done = subprocess.run(child, capture_output=True, text=True)
                if done.returncode != 0:
                    raise SystemExit(f"{variant} failed:\n{done.stderr[-3000:]}")
                report["runs"][variant].append(json.loads(done.stdout.strip().splitlines()[-1]))
                bc.remove(run_root)
    finally:
        bc.remove_scratch(base, root, created)
    print(f"mode {args.mode}, state {3 * args.layers * args.width**2 * 4 / 2**30:.2f} GiB, "
          f"{fs_type} under {base}, medians of {args.reps} process(es) x 3 saves")
    print(f"{'variant':<11} {'save_s':>8} {'wait_s':>8} {'held_s':>8} {'step_s':>8} {'committed_s':>12} {'max_rss_gib':>12}")
    summary = {}
    for variant, runs in report["runs"].items():
        if not runs:
            print(f"{variant:<11} (not run: torchtitan's pinned stager needs an accelerator)")
            continue
        m = {k: bc.median([r[k] for r in runs]) for k in runs[0]}
        m["held_s"] = bc.median([r["save_s"] + r["staging_wait_s"] for r in runs])
        summary[variant] = m
        print(f"{variant:<11} {bc.fmt(m['save_s'], '.3f')} {bc.fmt(m['staging_wait_s'], '.3f')} {bc.fmt(m['held_s'], '.3f')} "
              f"{bc.fmt(m['step_s'], '.3f')} {bc.fmt(m['committed_s'], '.3f', 12)} {bc.fmt(m['max_rss_gib'], '.2f', 12)}")
    report["summary"] = summary
    if args.json:
        bc.write_json(args.json, report)


if __name__ == "__main__":
    main()
