"""What the demo prints at the end: the loss around the resume, the checkpoint costs, the summary.

Printing only: every number was measured by the runs (their logs) or
computed by the checks, and arrives in one :class:`ScenarioResults`.
"""

from __future__ import annotations

import statistics

from dcp_datastates.demo.results import ScenarioResults

RULE = "=" * 78


def print_loss_table(r: ScenarioResults) -> None:
    """The three loss curves around the resume point, then at every checkpoint after it."""
    opts = r.options
    P, M = opts.nprocs, opts.resume_procs
    ref, failed, resumed = r.reference.losses, r.failed.losses, r.resumed.losses
    diffs, rels = r.continuation.diffs, r.continuation.rels
    print(f"\nloss around the resume point (reference: {P} rank(s) uninterrupted; resumed: {M} rank(s) "
          f"from step {r.resume_step}):")
    print(f"  {'step':>6} {'reference':>12} {'failed run':>12} {'resumed':>12} {'|diff|':>10} {'rel':>9}")
    show = sorted(set(range(max(1, r.resume_step - 2), min(opts.steps, r.resume_step + 6) + 1))
                  | set(range(r.resume_step + opts.ckpt_every, opts.steps + 1, opts.ckpt_every))
                  | {opts.fail_at - 1, opts.steps})
    for s in show:
        f_ = f"{failed[s]:12.6f}" if s in failed else f"{'-':>12}"
        rr = f"{resumed[s]:12.6f}" if s in resumed else f"{'-':>12}"
        d = f"{diffs[s]:10.2e} {rels[s]:9.1e}" if s in diffs else f"{'':>10} {'':>9}"
        mark = "  <- resumed here" if s == r.resume_step + 1 else ("  <- failure" if s == opts.fail_at - 1 else "")
        print(f"  {s:>6} {ref.get(s, float('nan')):12.6f} {f_} {rr} {d}{mark}")


def _cost_columns(c: dict) -> str:
    rss = f"{c['peak_rss_mb']:.0f} ({c['rss_growth_mb']:+.0f})"
    return (f"{c['bytes'] / 1e6:6.2f} {c['blocked_s'] * 1e3:7.1f}ms {c['durable_s'] * 1e3:6.0f}ms "
            f"{c['durable_gbps']:6.3f} {rss:>15}")


def print_checkpoint_table(r: ScenarioResults) -> None:
    """Per checkpoint step, ours against DCP's; then medians over the checkpoints both wrote on P ranks."""
    P = r.options.nprocs
    print("\ncheckpoints, both through dcp.async_save: blocked = the training loop stalled (get_state_dict + the "
          "call + fence waits);\n  durable = from the call until committed; GB/s = checkpoint bytes / durable; "
          "RSS = peak host RSS of a rank during the save (max over ranks), in parentheses its growth "
          "over the RSS before the save")
    print(f"  {'step':>6} | {'ours: DataStatesWriter':^51} | {'DCP FileSystemWriter (W=' + str(P) + ')':^48}")
    print(f"  {'':>6} | {'W':>2} {'MB':>6} {'blocked':>9} {'durable':>8} {'GB/s':>6} {'RSS MB':>15} | "
          f"{'MB':>6} {'blocked':>9} {'durable':>8} {'GB/s':>6} {'RSS MB':>15}")
    ours_all = {**r.failed.ckpts, **r.resumed.ckpts}
    ref_ckpts = r.reference.ckpts
    paired_ours, paired_dcp = [], []
    for st in sorted(set(ours_all) | set(ref_ckpts)):
        o, d = ours_all.get(st), ref_ckpts.get(st)
        left = f"{o['world']:>2} {_cost_columns(o)}" if o else f"{'(not reported: the run crashed first)':>51}"
        right = _cost_columns(d) if d else f"{'-':>48}"
        print(f"  {st:>6} | {left} | {right}")
        if o and d and o["world"] == d["world"]:
            paired_ours.append(o)
            paired_dcp.append(d)
    if not all(c.get("hwm_reset", False) for c in list(ours_all.values()) + list(ref_ckpts.values())):
        print("  (peak RSS could not be reset per checkpoint here: it is the process peak so far)")
    if paired_ours:
        _print_paired_medians(paired_ours, paired_dcp, P, r.options.host_cache_mb)
        direct = all(c.get("direct_io") for c in ours_all.values())
        print(f"  ours wrote with O_DIRECT: {'yes' if direct else 'no (buffered)'}")


def _print_paired_medians(ours: list[dict], dcp: list[dict], P: int, host_cache_mb: int) -> None:
    def med(key: str, records: list[dict]) -> float:
        return statistics.median(c[key] for c in records)

    ob, db = med("blocked_s", ours), med("blocked_s", dcp)
    og, dg = med("durable_gbps", ours), med("durable_gbps", dcp)
    od, dd = med("durable_s", ours), med("durable_s", dcp)
    orss, drss = max(c["peak_rss_mb"] for c in ours), max(c["peak_rss_mb"] for c in dcp)
    first_grow = ours[0]["rss_growth_mb"]
    later_grow = max((c["rss_growth_mb"] for c in ours[1:]), default=float("nan"))
    dgrow = max(c["rss_growth_mb"] for c in dcp)
    print(f"  median over the {len(ours)} checkpoint(s) both wrote on {P} rank(s): ours blocked "
          f"{ob * 1e3:.1f} ms, durable after {od * 1e3:.0f} ms ({og:.3f} GB/s); DCP async_save blocked "
          f"{db * 1e3:.1f} ms, durable after {dd * 1e3:.0f} ms ({dg:.3f} GB/s): ours blocked "
          f"{db / ob if ob > 0 else float('nan'):.1f}x less")
    print(f"  peak RSS: ours {orss:.0f} MB, DCP {drss:.0f} MB; growth during a save: ours {first_grow:+.1f} MB "
          f"on the first (it maps the {host_cache_mb} MiB pre-faulted host pool, kept for later saves), "
          f"at most {later_grow:+.1f} MB after; DCP at most {dgrow:+.1f} MB")


def print_summary(r: ScenarioResults, total_s: float) -> int:
    """The verdict of every check, then RESULT: PASS or FAIL with the problems; the exit status."""
    opts = r.options
    P, M = opts.nprocs, opts.resume_procs
    cont, replica = r.continuation, r.replica
    ref, resumed = r.reference.losses, r.resumed.losses
    print("\n" + RULE)
    print("SUMMARY")
    print(f"  runs: reference {r.reference.seconds:.1f} s ({P} rank(s)), failing {r.failed.seconds:.1f} s "
          f"({P} rank(s)), resumed {r.resumed.seconds:.1f} s ({M} rank(s)); total {total_s:.1f} s")
    print(f"  failure during step {opts.fail_at}; last committed checkpoint: step {r.resume_step} "
          f"({r.lost_steps} finished step(s) lost and recomputed)")
    print(f"  resume: loaded {P}-rank checkpoint on {M} rank(s) in {r.load_s:.2f} s "
          f"(DataStatesReader, verify=True)")
    print(f"  before the failure the failing run matched the reference: "
          f"{'bit-exact' if replica.exact else f'NOT bit-exact (max |diff| {replica.max_diff:.3e})'} "
          f"over {len(replica.steps)} steps")
    print(f"  checkpoint of step {r.resume_step}, ours vs DCP's: {r.same_ckpt_text}")
    print(f"  ours on disk (CheckpointManager, keep_last={opts.keep_last or 'all'}): steps {r.root.kept}, "
          f"latest -> {r.root.pointer}")
    print(f"  resumed loss vs reference over steps {r.resume_step + 1}..{opts.steps}: max |diff| "
          f"{cont.max_abs:.3e}, max rel {cont.max_rel:.3e}; bit-exact: {'yes' if cont.bit_exact else 'no'}; "
          f"checked with {cont.tol_text}")
    if M != P and cont.bit_exact:
        print(f"  (bit-exact across world sizes because every world size runs the same "
              f"{opts.data_shards} micro-shards with the same shapes; this is measured, not guaranteed)")
    first = r.resume_step + 1
    verdict = (f"all {len(cont.steps)} resumed steps within tolerance" if cont.continuous
               else f"first divergence at step {cont.first_bad}" if cont.first_bad is not None else "steps missing")
    print(f"  loss curve: {'CONTINUOUS' if cont.continuous else 'DIVERGED'} (step {first}, the first after the "
          f"resume: reference {ref.get(first, float('nan')):.6f}, resumed {resumed.get(first, float('nan')):.6f}; "
          f"{verdict})")
    if r.problems:
        print("  RESULT: FAIL")
        for prob in r.problems:
            print(f"   - {prob}")
    else:
        print("  RESULT: PASS")
    print(RULE, flush=True)
    return 1 if r.problems else 0


def print_abort(message: str) -> int:
    """The summary of a scenario that could not go on; the exit status (1)."""
    print("\n" + RULE)
    print("SUMMARY")
    print(f"  RESULT: FAIL: {message}")
    print(RULE, flush=True)
    return 1
