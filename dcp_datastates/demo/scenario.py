"""The scenario: train, checkpoint, crash, resume on another world size, then check and report.

Each run is a fresh set of spawned processes:

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

Between 2 and 3 the parent checks that our checkpoint of the resume step
holds exactly what DCP's of the same step holds. A run that does not end
as planned stops the scenario with a FAIL summary; otherwise every check
runs and the report says PASS or lists the problems.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time

from dcp_datastates.demo.checkpoint_compare import compare_checkpoints
from dcp_datastates.demo.checkpoint_dirs import latest_committed_checkpoint, step_dir
from dcp_datastates.demo.checks import check_continuation, check_manager_root, check_reference, check_replica
from dcp_datastates.demo.launcher import launch
from dcp_datastates.demo.model import ModelConfig
from dcp_datastates.demo.report import print_abort, print_checkpoint_table, print_loss_table, print_summary
from dcp_datastates.demo.results import RunOutcome, ScenarioResults
from dcp_datastates.demo.run_log import first_of, read_log
from dcp_datastates.demo.run_spec import RunSpec
from dcp_datastates.demo.training import SIMULATED_FAILURE_EXIT
from dcp_datastates.demo.workdir import WorkDir


def run_scenario(args: argparse.Namespace, device: str, workdir: WorkDir, t_start: float) -> int:
    """Run the three runs, check, report; the exit status (0: every check passed)."""
    P, M = args.nprocs, args.resume_procs
    os.makedirs(workdir.logs)
    # The same thread count per rank in every run: the runs then differ only in their
    # world size (a rank's kernels may reduce in another order with another thread count).
    threads = args.threads or max(1, _cpus() // max(P, M))
    template = _spec_template(args, device, threads)

    def spec(name: str, world: int, **kw) -> RunSpec:
        log_path = os.path.join(workdir.logs, f"{name}.jsonl")
        return dataclasses.replace(template, name=name, world=world, log_path=log_path, **kw)

    problems: list[str] = []
    print(f"scenario: {args.steps} steps, checkpoint every {args.ckpt_every}, failure during step "
          f"{args.fail_at}; {P} rank(s) before, {M} after; device {device} "
          f"({'NCCL' if device == 'cuda' else 'gloo'}); global batch {args.batch} in {args.data_shards} shards; "
          f"{threads} thread(s) per rank",
          flush=True)

    # 1. reference: uninterrupted, checkpointed by DCP's FileSystemWriter
    print(f"\n== 1/3 reference run: {P} rank(s), all {args.steps} steps, DCP FileSystemWriter ==", flush=True)
    ref_spec = spec("reference", P, ckpt_root=workdir.reference, writer="dcp")
    r = launch(ref_spec, args.timeout)
    if not r.ok:
        return print_abort(f"reference run failed (rank {r.failed_rank}, exit {r.exit_code}):\n{r.error}")
    reference = RunOutcome(read_log(ref_spec.log_path), r.seconds)

    # 2. failed: DataStatesWriter, crashes during --fail-at
    print(f"\n== 2/3 failing run: {P} rank(s), DataStatesWriter, failure during step {args.fail_at} ==", flush=True)
    fail_spec = spec("failed", P, ckpt_root=workdir.ours, writer="datastates", fail_at=args.fail_at)
    r = launch(fail_spec, args.timeout)
    failed = RunOutcome(read_log(fail_spec.log_path), r.seconds)
    if r.ok or r.exit_code != SIMULATED_FAILURE_EXIT or first_of(failed.records, "crash") is None:
        return print_abort(f"the failing run did not fail as simulated (ok={r.ok}, exit {r.exit_code}):\n{r.error}")
    print(f"[failed] all ranks stopped with exit status {r.exit_code} (simulated failure)", flush=True)

    # 3. resume from the newest committed checkpoint on M ranks
    found = latest_committed_checkpoint(workdir.ours)
    if found is None:
        return print_abort(f"no committed checkpoint under {workdir.ours}")
    resume_step, resume_dir = found
    lost = (args.fail_at - 1) - resume_step
    print(f"\n== 3/3 resumed run: {M} rank(s) from {resume_dir} (step {resume_step}; "
          f"{lost} finished step(s) after it were lost) ==", flush=True)
    same_text, compare_problems = _compare_with_reference(resume_step, resume_dir, reference, workdir.reference)
    problems += compare_problems

    res_spec = spec("resumed", M, ckpt_root=workdir.ours, writer="datastates", resume=True)
    r = launch(res_spec, args.timeout)
    resumed = RunOutcome(read_log(res_spec.log_path), r.seconds)
    resumed_rec = first_of(resumed.records, "resumed")
    if not r.ok:
        what = "training after the load" if resumed_rec is not None else "loading the checkpoint"
        return print_abort(f"resumed run failed while {what} (rank {r.failed_rank}, exit {r.exit_code}):\n{r.error}")
    if resumed_rec["from_step"] != resume_step:
        problems.append(f"the resumed run loaded step {resumed_rec['from_step']}, "
                        f"the newest committed is {resume_step}")

    print("\n== results ==")
    problems += check_reference(reference.losses, args.steps)
    replica = check_replica(reference.losses, failed.losses, args.fail_at, device)
    continuation = check_continuation(reference.losses, resumed.losses, resume_step, args.steps,
                                      same_world=M == P, rtol=args.rtol)
    root = check_manager_root(workdir.ours, args.keep_last)
    problems += replica.problems + continuation.problems + root.problems

    results = ScenarioResults(
        options=args, reference=reference, failed=failed, resumed=resumed, resume_step=resume_step,
        load_s=resumed_rec["load_s"], same_ckpt_text=same_text, replica=replica, continuation=continuation,
        root=root, lost_steps=lost, problems=problems,
    )
    print_loss_table(results)
    print_checkpoint_table(results)
    return print_summary(results, time.monotonic() - t_start)


def _spec_template(args: argparse.Namespace, device: str, threads: int) -> RunSpec:
    """What every run shares; each run then sets its name, world size, log and writer."""
    return RunSpec(
        name="", world=0, device=device,
        model=ModelConfig(args.vocab, args.seq_len, args.d_model, args.layers, args.heads),
        seed=args.seed, steps=args.steps, steps_total=args.steps, ckpt_every=args.ckpt_every, ckpt_root="",
        writer="datastates", log_path="", global_batch=args.batch, data_shards=args.data_shards, lr=args.lr,
        warmup=max(1, args.steps // 10), host_cache_bytes=args.host_cache_mb << 20, io_threads=args.io_threads,
        direct_io=args.direct_io, threads=threads, progress_every=args.ckpt_every, keep_last=args.keep_last or None,
    )


def _compare_with_reference(step: int, ours: str, reference: RunOutcome, reference_root: str
                            ) -> tuple[str, list[str]]:
    """Our checkpoint of ``step`` against DCP's of that step: the comparison's summary and its problems."""
    if step not in reference.ckpts:
        return "skipped (no DCP checkpoint of that step)", []
    try:
        same, text = compare_checkpoints(ours, step_dir(reference_root, step))
    except Exception as exc:  # report it, do not hide it
        same, text = False, f"comparison failed: {type(exc).__name__}: {exc}"
    return text, [f"checkpoint of step {step} differs from DCP's: {text}"] if same is False else []


def _cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover
        return os.cpu_count() or 1
