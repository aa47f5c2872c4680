"""Node-local roots across simulated nodes: what a node lost costs at resume, and what the
partner copies cost a training loop.

Every simulated node is its own ``torchrun --nnodes=K --node-rank=i`` launcher on 127.0.0.1
(gloo), with its own root in /dev/shm (``--dir``). The same file, run with ``--worker``, is
one rank.

1. resume: save one step (synchronous, full), wait for every copy, close; then relaunch and
   time ``mgr.load`` with (c) nothing lost, (a) the last node's root wiped and its files
   coming back from the previous node's partner copy over the exchange (torch.distributed), (b) the same
   without partner copies, its files coming back from the durable tier (a SeaweedFS server
   on the loopback: far faster than a remote object store, so (b) is a lower bound).
2. loop: a fixed CPU compute per step (one thread) with an asynchronous save every few steps,
   partner copies on and off: the time ``save()`` blocks and the whole loop's time.

The state is a DTensor sharded by rows over every rank, plus a small replicated tensor.
Each variant runs ``--reps`` times, alternating; medians are reported.

    python benchmarks/bench_nodes.py            # 2 nodes x 1 rank, 512 MiB, 3 reps
    python benchmarks/bench_nodes.py --quick    # 64 MiB, 1 rep
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
import warnings

warnings.filterwarnings("ignore")

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "tests", "support"))  # the simulated nodes and the S3 server

from bench_common import median, write_json  # noqa: E402
from node_launch import launch_nodes, register_rank, say, wipe  # noqa: E402

COLS = 1024  # float32 columns of the sharded tensor: a row is 4 KiB


# -- one rank ---------------------------------------------------------------------------


def _state(mib: int, mesh, step: int, zero: bool = False) -> dict:
    """This rank's part of the state of ``step``: cheap to build and to check (no RNG)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Shard

    world, rank = dist.get_world_size(), dist.get_rank()
    rows = max(world, mib * 2**20 // (COLS * 4)) // world * world
    per = rows // world
    if zero:
        local = torch.zeros(per, COLS)
    else:
        local = torch.arange(per * COLS, dtype=torch.float32).view(per, COLS)
        local += float(rank * per * COLS + step)
    w = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=(rows, COLS),
                           stride=(COLS, 1))
    bias = torch.zeros(4096) if zero else torch.full((4096,), float(step))
    return {"w": w, "bias": bias, "extra": {"step": -1 if zero else step}}


def _check(state: dict, mib: int, mesh, step: int) -> None:
    import torch

    want = _state(mib, mesh, step)
    assert torch.equal(state["w"].to_local(), want["w"].to_local()), "w differs after load"
    assert torch.equal(state["bias"], want["bias"]), "bias differs after load"
    assert state["extra"] == want["extra"], state["extra"]


def _count_object_store_reads() -> list:
    """Count the bytes this process reads from the durable tier (every ranged read of an object
    store goes through ``S3Store.read_range``): a box, filled as it reads."""
    from dcp_datastates.storage.s3 import S3Store

    box = [0]
    read = S3Store.read_range

    def counted(self, key, offset, length):
        box[0] += length
        return read(self, key, offset, length)

    S3Store.read_range = counted
    return box


def _emit(**fields) -> None:
    say("BENCH " + json.dumps(fields))


def worker(argv: list[str]) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import dcp_datastates

    phase, mib, settings = argv[0], int(argv[1]), json.loads(argv[2])
    loop = json.loads(argv[3]) if len(argv) > 3 else {}
    torch.set_num_threads(1)
    t_init = time.perf_counter()
    register_rank()
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    rank, node = dist.get_rank(), int(os.environ["GROUP_RANK"])
    options = dcp_datastates.CheckpointManagerOptions(
        node_local=True, incremental=False, **settings)
    mgr = dcp_datastates.CheckpointManager(os.environ["NODE_ROOT"], options)
    init_s = time.perf_counter() - t_init
    out = {}
    if phase == "save":
        state = _state(mib, mesh, 10)
        dist.barrier()
        t0 = time.perf_counter()
        mgr.save(10, state).result()
        t1 = time.perf_counter()
        mgr.wait_durable()
        t2 = time.perf_counter()
        _emit(rank=rank, node=node, save_s=t1 - t0, copies_s=t2 - t1)
    elif phase == "resume":
        state = _state(mib, mesh, 0, zero=True)
        fetched = _count_object_store_reads()
        dist.barrier()
        t0 = time.perf_counter()
        got = mgr.load(state)
        dt = time.perf_counter() - t0
        assert got == 10, f"resumed {got}, expected 10"
        _check(state, mib, mesh, got)
        out = dict(rank=rank, node=node, load_s=dt, init_s=init_s, durable_bytes=fetched[0])
    elif phase == "loop":
        state = _state(mib, mesh, 0)
        a = torch.ones(loop["n"], loop["n"]) / loop["n"]
        b = a.clone()
        blocked, last = [], None
        dist.barrier()
        t0 = time.perf_counter()
        for step in range(1, loop["steps"] + 1):
            for _ in range(loop["matmuls"]):
                b = torch.mm(a, b)
            if step % loop["every"] == 0:
                s0 = time.perf_counter()
                last = mgr.save(step, state)
                blocked.append(time.perf_counter() - s0)
        t1 = time.perf_counter()
        if last is not None:
            last.result()
        mgr.wait_durable()
        t2 = time.perf_counter()
        _emit(rank=rank, node=node, loop_s=t1 - t0, tail_s=t2 - t1, blocked_s=blocked)
    t0 = time.perf_counter()
    mgr.close()
    if out:
        _emit(**out, close_s=time.perf_counter() - t0)
    dist.destroy_process_group()


# -- the driver -------------------------------------------------------------------------


def launch(roots: list[str], nproc: int, args: list[str], env: dict | None = None,
           timeout: float = 300) -> tuple[float, list[dict]]:
    """One torchrun per node; returns the wall time until the last exits and every BENCH line."""
    wall, codes, outs = launch_nodes(roots, nproc, [os.path.abspath(__file__), "--worker", *args], env=env,
                                     timeout=timeout)
    for i, (code, out) in enumerate(zip(codes, outs)):
        if code != 0:
            raise RuntimeError(f"node {i} exited {code} ({' '.join(args[:1])}):\n{out[-6000:]}")
    rows = [json.loads(line[6:]) for out in outs for line in out.splitlines() if line.startswith("BENCH ")]
    return wall, rows


def fresh_roots(base: str, nodes: int) -> list[str]:
    roots = [os.path.join(base, f"node{i}") for i in range(nodes)]
    for r in roots:
        shutil.rmtree(r, ignore_errors=True)
        os.makedirs(r)
    return roots


def calibrate(n: int, target_s: float) -> int:
    """Matmuls of ``n x n`` on one thread that take about ``target_s`` here, alone."""
    import torch

    torch.set_num_threads(1)
    a = torch.ones(n, n) / n
    b = a.clone()
    torch.mm(a, b)
    t0 = time.perf_counter()
    for _ in range(5):
        b = torch.mm(a, b)
    one = (time.perf_counter() - t0) / 5
    return max(1, round(target_s / one))


def bench_resume(base, nodes, nproc, mib, reps, s3_url, s3_env) -> dict:
    res = {k: {"load_s": [], "wall_s": []} for k in ("local", "partner", "durable")}
    saves = {"partner": [], "durable": []}
    part = {"partner": True, "keep_last": 2, "partner_keep_last": 2}
    for rep in range(reps):
        order = ["partner", "durable"] if rep % 2 == 0 else ["durable", "partner"]
        for kind in order:
            roots = fresh_roots(base, nodes)
            if kind == "partner":
                settings, env = part, None
            else:
                settings, env = {"keep_last": 2, "durable": f"{s3_url}/resume-{rep}"}, s3_env
            _, rows = launch(roots, nproc, ["save", str(mib), json.dumps(settings)], env)
            saves[kind].append({"save_s": max(r["save_s"] for r in rows),
                                "copies_s": max(r["copies_s"] for r in rows)})
            variants = [("local", False), (kind, True)] if kind == "partner" else [(kind, True)]
            if rep % 2 == 1:
                variants.reverse()
            for name, lose in variants:
                if lose:
                    wipe(roots[-1])
                wall, rows = launch(roots, nproc, ["resume", str(mib), json.dumps(settings)], env)
                load = max(r["load_s"] for r in rows)
                res[name]["load_s"].append(load)
                res[name].setdefault("durable_bytes", []).append(sum(r.get("durable_bytes", 0) for r in rows))
                res[name]["wall_s"].append(wall)
                res[name].setdefault("init_s", []).append(max(r["init_s"] for r in rows))
                res[name].setdefault("close_s", []).append(max(r["close_s"] for r in rows))
                print(f"  rep {rep + 1} resume {name:8s}: load {load:6.2f} s (max over ranks), relaunch {wall:6.2f} s "
                      f"(pg+manager init {res[name]['init_s'][-1]:.2f} s, close {res[name]['close_s'][-1]:.2f} s), "
                      f"{res[name]['durable_bytes'][-1]} bytes from the durable tier", flush=True)
            shutil.rmtree(base, ignore_errors=True)
    res["saves"] = saves
    return res


def bench_loop(base, nodes, nproc, mib, reps, loop) -> dict:
    res = {k: [] for k in ("partner", "no_partner")}
    for rep in range(reps):
        order = ["partner", "no_partner"] if rep % 2 == 0 else ["no_partner", "partner"]
        for kind in order:
            roots = fresh_roots(base, nodes)
            # keep every step: with keep_last below the number of saves, a step whose partner copy
            # is still queued is deleted under it (a DrainError, see the report)
            settings = {"keep_last": loop["steps"] // loop["every"], "partner": kind == "partner",
                        "partner_keep_last": 2}
            wall, rows = launch(roots, nproc, ["loop", str(mib), json.dumps(settings), json.dumps(loop)])
            r = {"loop_s": max(x["loop_s"] for x in rows), "tail_s": max(x["tail_s"] for x in rows),
                 "blocked_mean_s": sum(sum(x["blocked_s"]) for x in rows) / sum(len(x["blocked_s"]) for x in rows),
                 "wall_s": wall}
            res[kind].append(r)
            print(f"  rep {rep + 1} loop {kind:10s}: loop {r['loop_s']:6.2f} s, save() blocked mean "
                  f"{r['blocked_mean_s'] * 1e3:7.1f} ms, tail (wait copies) {r['tail_s']:5.2f} s", flush=True)
            shutil.rmtree(base, ignore_errors=True)
    return res


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        return worker(sys.argv[2:])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="64 MiB, 1 rep, a short loop")
    ap.add_argument("--dir", default="/dev/shm", help="where the nodes' roots go (a temporary subdirectory)")
    ap.add_argument("--reps", type=int, default=None, help="repetitions (default 3, --quick 1)")
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--nproc", type=int, default=1, help="ranks per node")
    ap.add_argument("--mib", type=int, default=None, help="global state in MiB (default 512, --quick 64)")
    ap.add_argument("--steps", type=int, default=None, help="loop steps (default 20, --quick 10)")
    ap.add_argument("--every", type=int, default=5, help="an async save every this many steps")
    ap.add_argument("--compute-ms", type=float, default=300.0, help="compute per step, one thread, alone")
    ap.add_argument("--s3-port", type=int, default=None, help="the S3 server's port (default: a free one)")
    ap.add_argument("--skip", choices=["resume", "loop"], default=None, help="leave one part out")
    ap.add_argument("--json", default=None, help="write every figure to this JSON file")
    args = ap.parse_args()
    reps = args.reps or (1 if args.quick else 3)
    mib = args.mib or (64 if args.quick else 512)
    steps = args.steps or (10 if args.quick else 20)
    n = 512
    loop = {"n": n, "matmuls": calibrate(n, args.compute_ms / 1e3), "steps": steps, "every": args.every}
    base = tempfile.mkdtemp(prefix="bench-nodes-", dir=args.dir)
    roots_base = os.path.join(base, "roots")
    report = {"nodes": args.nodes, "nproc": args.nproc, "mib": mib, "reps": reps, "loop": loop,
              "cpus": os.cpu_count()}
    print(f"nodes benchmark: {args.nodes} nodes x {args.nproc} ranks on 127.0.0.1, {mib} MiB global, roots in "
          f"{base}, reps {reps}, {os.cpu_count()} CPUs; loop {steps} steps of {loop['matmuls']} "
          f"{n}x{n} matmuls (~{args.compute_ms:.0f} ms alone), async save every {args.every}", flush=True)
    server = None
    try:
        if args.skip != "resume":
            from s3_server import WeedServer

            server = WeedServer(bucket="bench-nodes", port=args.s3_port)
            s3_env = server.env()
            os.environ.update(s3_env)  # the server's readiness check is a client too
            server.start()
            report["resume"] = bench_resume(roots_base, args.nodes, args.nproc, mib, reps,
                                            f"s3://{server.bucket}/r{os.getpid()}", s3_env)
            server.stop()
            server = None
        if args.skip != "loop":
            report["loop_results"] = bench_loop(roots_base, args.nodes, args.nproc, mib, reps, loop)
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(base, ignore_errors=True)
    print_table(report)
    if args.json:
        write_json(args.json, report)


def print_table(report: dict) -> None:
    print(f"\n{report['nodes']} nodes x {report['nproc']} ranks, {report['mib']} MiB global, medians of "
          f"{report['reps']}, {report['cpus']} CPUs")
    res = report.get("resume")
    if res:
        print(f"{'resume (step 10)':34s} {'load s':>8s} {'relaunch s':>11s} {'durable MiB':>12s}")
        labels = {"local": "(c) nothing lost, local", "partner": "(a) node wiped, partner copy",
                  "durable": "(b) node wiped, durable (S3 lo)"}
        for k in ("local", "partner", "durable"):
            print(f"{labels[k]:34s} {median(res[k]['load_s']):8.2f} {median(res[k]['wall_s']):11.2f} "
                  f"{median(res[k]['durable_bytes']) / 2**20:12.1f}")
        p, d = median(res["partner"]["load_s"]), median(res["durable"]["load_s"])
        pw, dw = median(res["partner"]["wall_s"]), median(res["durable"]["wall_s"])
        print(f"{'durable / partner':34s} {d / p:7.2f}x {dw / pw:10.2f}x")
        for k, v in res["saves"].items():
            print(f"save step 10 ({k}): sync save {median([x['save_s'] for x in v]):.2f} s, "
                  f"then wait_durable {median([x['copies_s'] for x in v]):.2f} s")
    loop = report.get("loop_results")
    if loop:
        print(f"\n{'loop':12s} {'loop s':>8s} {'blocked ms':>11s} {'tail s':>8s}")
        for k in ("no_partner", "partner"):
            rs = loop[k]
            print(f"{k:12s} {median([r['loop_s'] for r in rs]):8.2f} "
                  f"{median([r['blocked_mean_s'] for r in rs]) * 1e3:11.1f} {median([r['tail_s'] for r in rs]):8.2f}")
        a = median([r["loop_s"] for r in loop["partner"]])
        b = median([r["loop_s"] for r in loop["no_partner"]])
        print(f"partner / no_partner loop time: {a / b:.3f} ({(a / b - 1) * 100:+.1f}%)")


if __name__ == "__main__":
    main()
