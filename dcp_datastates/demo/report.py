"""After the runs: what their logs and checkpoints show, the checks, and what the demo prints.

The checks, each a plain result with the problems it found (empty when it passed):

- the reference run logged every step;
- the failing run, before the failure, is a replica of the reference (same
  ranks, same code: bit-exact on CPU);
- our checkpoint of the resume step holds exactly what DCP's of that step holds;
- the resumed loss curve continues the reference: exact equality when it
  runs on as many ranks as before, a relative tolerance otherwise (and
  whether it was bit-exact anyway is reported, not assumed);
- the manager's root after both runs: retention applied, ``latest`` on the
  newest checkpoint, nothing uncommitted left behind.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import warnings
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader

from dcp_datastates import DataStatesReader
from dcp_datastates._dcp_compat import load_whole_checkpoint
from dcp_datastates.manager.checkpoint_root import is_committed, read_latest, step_dir_name, step_dirs

RULE = "=" * 78


@dataclasses.dataclass
class Run:
    """One run as the parent sees it afterwards: rank 0's log records and the run's wall time."""

    records: list[dict]
    seconds: float

    @classmethod
    def read(cls, log_path: str, seconds: float) -> Run:
        records = []
        if os.path.exists(log_path):
            with open(log_path) as f:
                records = [json.loads(line) for line in f if line.strip()]
        return cls(records, seconds)

    @property
    def losses(self) -> dict[int, float]:
        return {r["step"]: r["loss"] for r in self.records if r["kind"] == "loss"}

    @property
    def ckpts(self) -> dict[int, dict]:
        return {r["step"]: r for r in self.records if r["kind"] == "ckpt"}

    def first(self, kind: str) -> dict | None:
        """The first record of ``kind`` (``crash``, ``resumed``), or None if the run never wrote one."""
        return next((r for r in self.records if r["kind"] == kind), None)


def committed_step_dirs(root: str) -> dict[int, str]:
    """``{step: path}`` of every committed ``step_*`` directory under ``root``."""
    paths = {s: os.path.join(root, n) for s, n in step_dirs(root).items()}
    return {s: path for s, path in paths.items() if is_committed(path)}


def latest_committed_checkpoint(root: str) -> tuple[int, str] | None:
    """The newest committed ``step_*`` directory under ``root`` (what a resume should load)."""
    committed = committed_step_dirs(root)
    return max(committed.items()) if committed else None


def check_reference(reference: dict[int, float], last_step: int) -> list[str]:
    """The uninterrupted run logged every step (the curve the others are checked against)."""
    if sorted(reference) != list(range(1, last_step + 1)):
        return ["the reference run did not log every step"]
    return []


@dataclasses.dataclass
class ReplicaCheck:
    """The failing run against the reference over the steps it finished before the failure."""

    steps: list[int]
    exact: bool
    max_diff: float
    problems: list[str]


def check_replica(reference: dict[int, float], failed: dict[int, float], fail_at: int, device: str) -> ReplicaCheck:
    steps = list(range(1, fail_at))
    missing = [s for s in steps if s not in failed]
    max_diff = max((abs(failed[s] - reference[s]) for s in steps if s in failed), default=0.0)
    exact = not missing and all(failed[s] == reference[s] for s in steps)
    problems = []
    if missing:
        problems.append(f"the failing run did not log steps {missing[:5]}...")
    elif not exact and device == "cpu":
        problems.append(f"the failing run diverged from the reference before the failure (max |diff| {max_diff:.3e})")
    return ReplicaCheck(steps, exact, max_diff, problems)


@dataclasses.dataclass
class ContinuationCheck:
    """The resumed run's losses against the reference's, from the first step after the resume."""

    steps: list[int]
    diffs: dict[int, float]  # |resumed - reference| per step both logged
    rels: dict[int, float]  # the same, relative to the reference
    bit_exact: bool
    continuous: bool  # within the check's tolerance
    tol_text: str
    first_bad: int | None
    problems: list[str]

    @property
    def max_abs(self) -> float:
        return max(self.diffs.values(), default=0.0)

    @property
    def max_rel(self) -> float:
        return max(self.rels.values(), default=0.0)


def check_continuation(reference: dict[int, float], resumed: dict[int, float], resume_step: int, last_step: int,
                       *, same_world: bool, rtol: float) -> ContinuationCheck:
    steps = list(range(resume_step + 1, last_step + 1))
    missing = [s for s in steps if s not in resumed]
    diffs = {s: abs(resumed[s] - reference[s]) for s in steps if s in resumed and s in reference}
    rels = {s: diffs[s] / max(abs(reference[s]), 1e-12) for s in diffs}
    bit_exact = not missing and all(resumed[s] == reference[s] for s in steps)
    if same_world:
        tol_text = "exact equality (M == P)"
        continuous = bit_exact
    else:
        tol_text = f"relative tolerance {rtol:g} (M != P)"
        continuous = not missing and all(rels[s] <= rtol for s in steps)
    first_bad = next((s for s in steps if s in diffs and not (
        diffs[s] == 0 if same_world else rels[s] <= rtol)), None)
    check = ContinuationCheck(steps, diffs, rels, bit_exact, continuous, tol_text, first_bad, [])
    if missing:
        check.problems.append(f"the resumed run did not log steps {missing[:5]}")
    if not continuous:
        check.problems.append(f"the resumed loss curve diverges from the reference (first at step {first_bad}, "
                              f"max |diff| {check.max_abs:.3e}, max rel {check.max_rel:.3e}; {tol_text})")
    return check


@dataclasses.dataclass
class RootCheck:
    """The manager's checkpoint root after both runs."""

    kept: list[int]  # committed steps
    pointer: int | None  # the step ``latest`` names
    problems: list[str]


def check_manager_root(root: str, keep_last: int) -> RootCheck:
    """``keep_last`` 0 means keep all (no retention to check)."""
    kept = sorted(committed_step_dirs(root))
    pointer = read_latest(root)
    problems = []
    if not kept or pointer != kept[-1] or sorted(step_dirs(root)) != kept:
        problems.append(f"checkpoint root {root}: committed {kept}, directories {sorted(step_dirs(root))}, "
                        f"latest -> {pointer}")
    if keep_last and len(kept) > keep_last:
        problems.append(f"retention kept {len(kept)} checkpoints, --keep-last is {keep_last}")
    return RootCheck(kept, pointer, problems)


def compare_with_reference(step: int, ours: str, reference: Run, reference_root: str) -> tuple[str, list[str]]:
    """Our checkpoint of ``step`` against DCP's of that step: the comparison's summary and its problems."""
    if step not in reference.ckpts:
        return "skipped (no DCP checkpoint of that step)", []
    try:
        same, text = compare_checkpoints(ours, os.path.join(reference_root, step_dir_name(step)))
    except Exception as exc:  # report it, do not hide it
        same, text = False, f"comparison failed: {type(exc).__name__}: {exc}"
    return text, [f"checkpoint of step {step} differs from DCP's: {text}"] if same is False else []


def compare_checkpoints(ours: str, theirs: str) -> tuple[bool | None, str]:
    """Load both checkpoints whole in this process and compare every entry bit for bit.

    DCP reshards every saved shard into whole tensors, so the comparison does
    not depend on how many ranks wrote either, nor on either on-disk format.
    ``(True, summary)`` when identical, ``(False, the first difference)``, or
    ``(None, why)`` when this torch cannot load a whole checkpoint (skipped, not failed).
    """
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            a = load_whole_checkpoint(DataStatesReader(ours, verify=True))
            b = load_whole_checkpoint(FileSystemReader(theirs))
    except ImportError as exc:  # private DCP helper moved: skip, do not fail
        return None, f"skipped ({exc})"
    fa, fb = _flatten(a), _flatten(b)
    if fa.keys() != fb.keys():
        return False, f"different keys: {sorted(fa.keys() ^ fb.keys())[:5]}"
    n_tensors = n_bytes = 0
    for k, va in fa.items():
        vb = fb[k]
        if isinstance(va, torch.Tensor):
            if not (isinstance(vb, torch.Tensor) and va.dtype == vb.dtype and va.shape == vb.shape
                    and torch.equal(va, vb)):
                return False, f"{k!r} differs"
            n_tensors += 1
            n_bytes += va.numel() * va.element_size()
        elif va != vb:
            return False, f"{k!r} differs: {va!r} != {vb!r}"
    return True, f"{len(fa)} entries ({n_tensors} tensors, {n_bytes / 1e6:.1f} MB) identical"


def _flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    """``{"a.b.0": leaf}`` for every leaf of nested dicts, lists and tuples."""
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


def check_and_report(opts: argparse.Namespace, device: str, ours_root: str, reference: Run, failed: Run,
                     resumed: Run, resume_step: int, same_ckpt_text: str, problems: list[str],
                     total_s: float) -> int:
    """Run the checks, print the loss table, the checkpoint table and the summary; the exit status."""
    print("\n== results ==")
    problems = problems + check_reference(reference.losses, opts.steps)
    replica = check_replica(reference.losses, failed.losses, opts.fail_at, device)
    cont = check_continuation(reference.losses, resumed.losses, resume_step, opts.steps,
                              same_world=opts.resume_procs == opts.nprocs, rtol=opts.rtol)
    root = check_manager_root(ours_root, opts.keep_last)
    problems += replica.problems + cont.problems + root.problems
    _print_loss_table(opts, reference, failed, resumed, resume_step, cont)
    _print_checkpoint_table(opts, reference, failed, resumed)

    P, M = opts.nprocs, opts.resume_procs
    ref, res = reference.losses, resumed.losses
    print("\n" + RULE)
    print("SUMMARY")
    print(f"  runs: reference {reference.seconds:.1f} s ({P} rank(s)), failing {failed.seconds:.1f} s "
          f"({P} rank(s)), resumed {resumed.seconds:.1f} s ({M} rank(s)); total {total_s:.1f} s")
    print(f"  failure during step {opts.fail_at}; last committed checkpoint: step {resume_step} "
          f"({opts.fail_at - 1 - resume_step} finished step(s) lost and recomputed)")
    print(f"  resume: loaded {P}-rank checkpoint on {M} rank(s) in {resumed.first('resumed')['load_s']:.2f} s "
          f"(DataStatesReader, verify=True)")
    print(f"  before the failure the failing run matched the reference: "
          f"{'bit-exact' if replica.exact else f'NOT bit-exact (max |diff| {replica.max_diff:.3e})'} "
          f"over {len(replica.steps)} steps")
    print(f"  checkpoint of step {resume_step}, ours vs DCP's: {same_ckpt_text}")
    print(f"  ours on disk (CheckpointManager, keep_last={opts.keep_last or 'all'}): steps {root.kept}, "
          f"latest -> {root.pointer}")
    print(f"  resumed loss vs reference over steps {resume_step + 1}..{opts.steps}: max |diff| "
          f"{cont.max_abs:.3e}, max rel {cont.max_rel:.3e}; bit-exact: {'yes' if cont.bit_exact else 'no'}; "
          f"checked with {cont.tol_text}")
    if M != P and cont.bit_exact:
        print(f"  (bit-exact across world sizes because every world size runs the same "
              f"{opts.data_shards} micro-shards with the same shapes; this is measured, not guaranteed)")
    first = resume_step + 1
    verdict = (f"all {len(cont.steps)} resumed steps within tolerance" if cont.continuous
               else f"first divergence at step {cont.first_bad}" if cont.first_bad is not None else "steps missing")
    print(f"  loss curve: {'CONTINUOUS' if cont.continuous else 'DIVERGED'} (step {first}, the first after the "
          f"resume: reference {ref.get(first, float('nan')):.6f}, resumed {res.get(first, float('nan')):.6f}; "
          f"{verdict})")
    if problems:
        print("  RESULT: FAIL")
        for prob in problems:
            print(f"   - {prob}")
    else:
        print("  RESULT: PASS")
    print(RULE, flush=True)
    return 1 if problems else 0


def print_abort(message: str) -> int:
    """The summary of a scenario that could not go on; the exit status (1)."""
    print("\n" + RULE)
    print("SUMMARY")
    print(f"  RESULT: FAIL: {message}")
    print(RULE, flush=True)
    return 1


def _print_loss_table(opts: argparse.Namespace, reference: Run, failed: Run, resumed: Run, resume_step: int,
                      cont: ContinuationCheck) -> None:
    """The three loss curves around the resume point, then at every checkpoint after it."""
    ref, fail, res = reference.losses, failed.losses, resumed.losses
    print(f"\nloss around the resume point (reference: {opts.nprocs} rank(s) uninterrupted; resumed: "
          f"{opts.resume_procs} rank(s) from step {resume_step}):")
    print(f"  {'step':>6} {'reference':>12} {'failed run':>12} {'resumed':>12} {'|diff|':>10} {'rel':>9}")
    show = sorted(set(range(max(1, resume_step - 2), min(opts.steps, resume_step + 6) + 1))
                  | set(range(resume_step + opts.ckpt_every, opts.steps + 1, opts.ckpt_every))
                  | {opts.fail_at - 1, opts.steps})
    for s in show:
        f_ = f"{fail[s]:12.6f}" if s in fail else f"{'-':>12}"
        rr = f"{res[s]:12.6f}" if s in res else f"{'-':>12}"
        d = f"{cont.diffs[s]:10.2e} {cont.rels[s]:9.1e}" if s in cont.diffs else f"{'':>10} {'':>9}"
        mark = "  <- resumed here" if s == resume_step + 1 else ("  <- failure" if s == opts.fail_at - 1 else "")
        print(f"  {s:>6} {ref.get(s, float('nan')):12.6f} {f_} {rr} {d}{mark}")


def _cost_columns(c: dict) -> str:
    rss = f"{c['peak_rss_mb']:.0f} ({c['rss_growth_mb']:+.0f})"
    return (f"{c['bytes'] / 1e6:6.2f} {c['blocked_s'] * 1e3:7.1f}ms {c['durable_s'] * 1e3:6.0f}ms "
            f"{c['durable_gbps']:6.3f} {rss:>15}")


def _print_checkpoint_table(opts: argparse.Namespace, reference: Run, failed: Run, resumed: Run) -> None:
    """Per checkpoint step, ours against DCP's; then medians over the checkpoints both wrote on P ranks."""
    P = opts.nprocs
    print("\ncheckpoints, both through dcp.async_save: blocked = the training loop stalled (get_state_dict + the "
          "call + fence waits);\n  durable = from the call until committed; GB/s = checkpoint bytes / durable; "
          "RSS = peak host RSS of a rank during the save (max over ranks), in parentheses its growth "
          "over the RSS before the save")
    print(f"  {'step':>6} | {'ours: DataStatesWriter':^51} | {'DCP FileSystemWriter (W=' + str(P) + ')':^48}")
    print(f"  {'':>6} | {'W':>2} {'MB':>6} {'blocked':>9} {'durable':>8} {'GB/s':>6} {'RSS MB':>15} | "
          f"{'MB':>6} {'blocked':>9} {'durable':>8} {'GB/s':>6} {'RSS MB':>15}")
    ours_all, dcp_all = {**failed.ckpts, **resumed.ckpts}, reference.ckpts
    ours, dcp = [], []  # the checkpoints of one step both wrote on the same number of ranks
    for st in sorted(set(ours_all) | set(dcp_all)):
        o, d = ours_all.get(st), dcp_all.get(st)
        left = f"{o['world']:>2} {_cost_columns(o)}" if o else f"{'(not reported: the run crashed first)':>51}"
        right = _cost_columns(d) if d else f"{'-':>48}"
        print(f"  {st:>6} | {left} | {right}")
        if o and d and o["world"] == d["world"]:
            ours.append(o)
            dcp.append(d)
    if not all(c.get("hwm_reset", False) for c in list(ours_all.values()) + list(dcp_all.values())):
        print("  (peak RSS could not be reset per checkpoint here: it is the process peak so far)")
    if not ours:
        return

    def med(key: str, records: list[dict]) -> float:
        return statistics.median(c[key] for c in records)

    ob, db = med("blocked_s", ours), med("blocked_s", dcp)
    print(f"  median over the {len(ours)} checkpoint(s) both wrote on {P} rank(s): ours blocked "
          f"{ob * 1e3:.1f} ms, durable after {med('durable_s', ours) * 1e3:.0f} ms "
          f"({med('durable_gbps', ours):.3f} GB/s); DCP async_save blocked {db * 1e3:.1f} ms, durable after "
          f"{med('durable_s', dcp) * 1e3:.0f} ms ({med('durable_gbps', dcp):.3f} GB/s): ours blocked "
          f"{db / ob if ob > 0 else float('nan'):.1f}x less")
    later = f", at most {max(c['rss_growth_mb'] for c in ours[1:]):+.1f} MB after" if len(ours) > 1 else ""
    print(f"  peak RSS: ours {max(c['peak_rss_mb'] for c in ours):.0f} MB, DCP "
          f"{max(c['peak_rss_mb'] for c in dcp):.0f} MB; growth during a save: ours "
          f"{ours[0]['rss_growth_mb']:+.1f} MB on the first (it maps the {opts.host_cache_mb} MiB pre-faulted "
          f"host pool, kept for later saves){later}; DCP at most {max(c['rss_growth_mb'] for c in dcp):+.1f} MB")
    direct = all(c.get("direct_io") for c in ours_all.values())
    print(f"  ours wrote with O_DIRECT: {'yes' if direct else 'no (buffered)'}")
