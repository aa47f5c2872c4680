"""``python -m dcp_datastates.demo``: train, checkpoint, crash, resume on another world size, check, report.

    python -m dcp_datastates.demo [--steps N] [--ckpt-every K] [--dir DIR]
                                  [--fail-at STEP] [--nprocs P] [--resume-procs M]

Three runs, each a fresh set of spawned processes running train.py:

1. ``reference``: P ranks train all N steps without failure and checkpoint
   every K steps with ``dcp.async_save`` and DCP's own ``FileSystemWriter``
   (the baseline). Its losses are the reference loss curve.
2. ``failed``: the same training on P ranks, checkpointing every K steps
   through a ``CheckpointManager``; during ``--fail-at`` every rank dies
   (``os._exit``, no cleanup), so every step after the last committed
   checkpoint is lost.
3. ``resumed``: M ranks open the same root with a ``CheckpointManager``,
   which removes what the crash left behind and loads the newest committed
   checkpoint that loads (DCP reshards from P to M ranks), and train to the
   end, still checkpointing through the manager.

Between 2 and 3 our checkpoint of the resume step is compared with DCP's.
A run that does not end as planned stops the demo with a FAIL summary;
otherwise report.py checks everything and says PASS or lists the problems.

The working directory (``--dir``, or a temporary one) holds ``reference_dcp/``
(the reference run's checkpoints), ``datastates/`` (the manager's root the
failing and resumed runs share) and ``logs/`` (one JSON-lines log per run).
At the end, without ``--keep``, only what the demo made there is removed.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import math
import os
import shutil
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dcp_datastates.demo.model import ModelConfig
from dcp_datastates.demo.report import (Run, check_and_report, compare_with_reference, latest_committed_checkpoint,
                                        print_abort)
from dcp_datastates.demo.train import SIMULATED_FAILURE_EXIT, RunSpec, run_rank

WORK_SUBDIRS = ("reference_dcp", "datastates", "logs")


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


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t_start = time.monotonic()
    device = _choose_device(args)
    if args.dir is None:
        root, made = tempfile.mkdtemp(prefix="dcp_datastates_demo_"), True
    else:
        root, made = os.path.abspath(args.dir), False
        if os.path.isdir(root) and os.listdir(root):
            raise SystemExit(f"--dir {root} is not empty; give a new or empty directory")
        os.makedirs(root, exist_ok=True)
    print(f"working directory: {root} ({'kept' if args.keep else 'removed at the end; --keep keeps it'})",
          flush=True)
    try:
        return run_demo(args, device, root, t_start)
    finally:
        if not args.keep:
            if made:
                shutil.rmtree(root, ignore_errors=True)
            else:
                for name in WORK_SUBDIRS:
                    shutil.rmtree(os.path.join(root, name), ignore_errors=True)
                try:
                    os.rmdir(root)  # only if that left it empty
                except OSError:
                    pass


def run_demo(args: argparse.Namespace, device: str, root: str, t_start: float) -> int:
    """The three runs, then the checks and the report; the exit status (0: every check passed)."""
    P, M = args.nprocs, args.resume_procs
    reference_root, ours_root, logs = (os.path.join(root, name) for name in WORK_SUBDIRS)
    os.makedirs(logs)
    # The same thread count per rank in every run: the runs then differ only in their
    # world size (a rank's kernels may reduce in another order with another thread count).
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    threads = args.threads or max(1, cpus // max(P, M))
    template = RunSpec(
        name="", world=0, device=device,
        model=ModelConfig(args.vocab, args.seq_len, args.d_model, args.layers, args.heads),
        seed=args.seed, steps=args.steps, steps_total=args.steps, ckpt_every=args.ckpt_every, ckpt_root="",
        writer="datastates", log_path="", global_batch=args.batch, data_shards=args.data_shards, lr=args.lr,
        warmup=max(1, args.steps // 10), host_cache_bytes=args.host_cache_mb << 20, io_threads=args.io_threads,
        direct_io=args.direct_io, threads=threads, progress_every=args.ckpt_every, keep_last=args.keep_last or None,
    )

    def run(name: str, world: int, **kw) -> tuple[Run, LaunchResult]:
        spec = dataclasses.replace(template, name=name, world=world, log_path=os.path.join(logs, f"{name}.jsonl"),
                                   **kw)
        result = launch(spec, args.timeout)
        return Run.read(spec.log_path, result.seconds), result

    print(f"scenario: {args.steps} steps, checkpoint every {args.ckpt_every}, failure during step "
          f"{args.fail_at}; {P} rank(s) before, {M} after; device {device} "
          f"({'NCCL' if device == 'cuda' else 'gloo'}); global batch {args.batch} in {args.data_shards} shards; "
          f"{threads} thread(s) per rank",
          flush=True)

    print(f"\n== 1/3 reference run: {P} rank(s), all {args.steps} steps, DCP FileSystemWriter ==", flush=True)
    reference, r = run("reference", P, ckpt_root=reference_root, writer="dcp")
    if not r.ok:
        return print_abort(f"reference run failed (rank {r.failed_rank}, exit {r.exit_code}):\n{r.error}")

    print(f"\n== 2/3 failing run: {P} rank(s), DataStatesWriter, failure during step {args.fail_at} ==", flush=True)
    failed, r = run("failed", P, ckpt_root=ours_root, fail_at=args.fail_at)
    if r.ok or r.exit_code != SIMULATED_FAILURE_EXIT or failed.first("crash") is None:
        return print_abort(f"the failing run did not fail as simulated (ok={r.ok}, exit {r.exit_code}):\n{r.error}")
    print(f"[failed] all ranks stopped with exit status {r.exit_code} (simulated failure)", flush=True)

    found = latest_committed_checkpoint(ours_root)
    if found is None:
        return print_abort(f"no committed checkpoint under {ours_root}")
    resume_step, resume_dir = found
    print(f"\n== 3/3 resumed run: {M} rank(s) from {resume_dir} (step {resume_step}; "
          f"{args.fail_at - 1 - resume_step} finished step(s) after it were lost) ==", flush=True)
    same_text, problems = compare_with_reference(resume_step, resume_dir, reference, reference_root)
    resumed, r = run("resumed", M, ckpt_root=ours_root, resume=True)
    loaded = resumed.first("resumed")
    if not r.ok:
        what = "training after the load" if loaded is not None else "loading the checkpoint"
        return print_abort(f"resumed run failed while {what} (rank {r.failed_rank}, exit {r.exit_code}):\n{r.error}")
    if loaded["from_step"] != resume_step:
        problems.append(f"the resumed run loaded step {loaded['from_step']}, the newest committed is {resume_step}")
    return check_and_report(args, device, ours_root, reference, failed, resumed, resume_step, same_text, problems,
                            time.monotonic() - t_start)


def _choose_device(args: argparse.Namespace) -> str:
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


@dataclasses.dataclass
class LaunchResult:
    """How a run ended: a failed run (the simulated crash included) is an outcome the demo checks, not an error."""

    ok: bool
    exit_code: int | None = None
    failed_rank: int | None = None
    error: str | None = None
    seconds: float = 0.0


def launch(spec: RunSpec, timeout_s: float) -> LaunchResult:
    """Spawn ``spec.world`` ranks and wait for them (with a timeout), never leaving one behind.

    This process holds the TCP store the ranks rendezvous on; each rank exits
    if this process dies.
    """
    store = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False,
        timeout=datetime.timedelta(seconds=spec.pg_timeout_s),
    )  # port 0: the OS picks a free port, and this process holds it while the ranks run
    spec = dataclasses.replace(spec, store_port=store.port)
    t0 = time.monotonic()
    ctx = mp.start_processes(run_rank, args=(spec, os.getpid()), nprocs=spec.world, join=False,
                             start_method="spawn")
    try:
        while not ctx.join(timeout=0.5, grace_period=10.0):
            if time.monotonic() - t0 > timeout_s:
                return LaunchResult(False, error=f"timed out after {timeout_s:.0f} s", seconds=time.monotonic() - t0)
        return LaunchResult(True, exit_code=0, seconds=time.monotonic() - t0)
    except mp.ProcessRaisedException as exc:
        return LaunchResult(False, exit_code=1, failed_rank=exc.error_index, error=str(exc),
                            seconds=time.monotonic() - t0)
    except mp.ProcessExitedException as exc:
        return LaunchResult(False, exit_code=exc.exit_code, failed_rank=exc.error_index, error=str(exc),
                            seconds=time.monotonic() - t0)
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.terminate()
        for p in ctx.processes:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join()
        del store


if __name__ == "__main__":
    sys.exit(main())
