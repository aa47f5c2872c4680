"""``python -m dcp_datastates.demo``: the options, their checks, the device, and ``main()``.

    python -m dcp_datastates.demo [--steps N] [--ckpt-every K] [--dir DIR]
                                  [--fail-at STEP] [--nprocs P] [--resume-procs M]

``main()`` owns the working directory (made or checked here, removed at the
end unless ``--keep``) and hands the rest to the scenario (scenario.py).
"""

from __future__ import annotations

import argparse
import math
import time

import torch

from dcp_datastates.demo.scenario import run_scenario
from dcp_datastates.demo.workdir import open_workdir


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The options, checked against each other (a bad combination exits with status 2)."""
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
    """``"cuda"`` (one GPU per rank, NCCL) or ``"cpu"`` (gloo), as ``--device`` asks and the GPUs allow."""
    need = max(args.nprocs, args.resume_procs)
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if args.device == "cuda":
        if have < need:
            raise SystemExit(f"--device cuda needs {need} GPUs (one per rank), found {have}")
        return "cuda"
    if args.device == "auto" and have >= need:
        return "cuda"
    return "cpu"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t_start = time.monotonic()
    device = choose_device(args)
    workdir = open_workdir(args.dir)
    print(f"working directory: {workdir.root} ({'kept' if args.keep else 'removed at the end; --keep keeps it'})",
          flush=True)
    try:
        return run_scenario(args, device, workdir, t_start)
    finally:
        if not args.keep:
            workdir.remove()
