#!/usr/bin/env python
"""What a checkpoint costs the trainer's CPUs: CPU-seconds per GB saved and loaded, ours against
DCP and against the raw write / read of the same bytes, from one rank to many, in one run.

    python benchmarks/bench_cpu_cost.py [--quick] [--dir DIR] [--reps N] [--ranks 1,2,4,8,16]
                                        [--cases big,small,fsdp] [--json OUT]

On a GPU node the host cores feed the GPUs; every CPU-second a checkpoint spends is taken from
training. Wall time on a loaded machine hides that cost, so every figure here comes twice: wall
seconds (the slowest rank's call) and CPU-seconds (user + system of every thread of every rank,
``resource.getrusage(RUSAGE_SELF)`` around the call: threads that exited during it, as DCP's
writer threads do, included; an asynchronous save is measured from the call until its checkpoint
is committed, background threads included).

Cases (every rank is a process of a W-rank gloo group, W = 1 included, spawned per case):
  big    W = 1: ~2 GiB of float32/bf16 tensors of 1-32 MiB, saved as {"model": state}
         (--quick: 256 MiB)
  small  W = 1: 20,000 tensors of 256-4,096 elements, mixed dtypes (--quick: 2,000)
  fsdp   W in --ranks: each rank's Shard(0) DTensors of a transformer's parameters and two Adam
         moments (benchmarks/bench_scaling.py's state, --global-mib of it in all, default 192;
         --quick 64), replicated step tensors and a few Python values
Variants (save; each into a fresh directory under --dir, default /dev/shm):
  raw            every rank pwritev()s its tensors' own bytes (no copy: the tensors' memory) with
                 2 threads, each into its own file, then fsyncs them: the limit, no format at all
  dcp_t1/dcp_t2  dcp.save with FileSystemWriter(thread_count=1 / 2)
  dcp_async      dcp.async_save with FileSystemWriter() (DCP's default stager), until done
  ours           dcp.save with DataStatesWriter(path) and DCP's default planner (the one-argument
                 switch)
  ours_planner   (small) the same with DataStatesSavePlanner()
  ours_async     dcp.async_save with DataStatesWriter(path), until committed
Loads (each variant's checkpoint, into preallocated zeroed tensors; bit-exact, checked once):
  raw            every rank preadv()s its files back into its tensors' memory, 2 threads
  dcp            dcp.load with FileSystemReader (the checkpoint of dcp_t2)
  ours           dcp.load with DataStatesReader (the checkpoint of ours)
Where our CPU time goes: the engine's threads are named (dcpds-stage: the copies into the host
pool; dcpds-d2h: waiting for CUDA copies, counted with the staging copies; dcpds-io: checksums,
writes, reads and load-time checksum checks), and each thread's CPU
time is read from /proc/self/task/*/schedstat around the call; the rest is the Python side
(planning, metadata, commit, DCP's own work). The checksum's share is estimated as the bytes
checksummed divided by the CRC-32C rate of one core, measured in the same run.
Within each repetition the variants run round-robin, starting one later in every repetition;
figures are medians over --reps. GB means 1e9 bytes of tensor payload.
"""

from __future__ import annotations

import argparse
import gc
import glob
import json
import os
import resource
import shutil
import statistics
import sys
import tempfile
import threading
import time
import warnings

warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")

import torch  # noqa: E402

from bench_common import fmt, free_port, machine_info, write_json  # noqa: E402

MiB = 1 << 20
SAVES = {"big": ["raw", "dcp_t1", "dcp_t2", "dcp_async", "ours", "ours_async"],
         "small": ["raw", "dcp_t1", "dcp_t2", "ours", "ours_planner", "ours_async"],
         "fsdp": ["raw", "dcp_t1", "dcp_t2", "dcp_async", "ours", "ours_async"]}
LOADS = {"raw": "raw", "dcp_t2": "dcp", "ours": "ours"}  # the save whose checkpoint each load reads
RAW_THREADS = 2
ENGINE_THREADS = ("dcpds-stage", "dcpds-d2h", "dcpds-io")


# ---------------------------------------------------------------- CPU clocks


def cpu_seconds() -> float:
    """User + system seconds of every thread of this process, those that exited included."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def thread_ns() -> dict[int, tuple[str, int]]:
    """Each live thread's name and CPU nanoseconds (schedstat: time on a CPU)."""
    out = {}
    for task in glob.glob("/proc/self/task/*"):
        try:
            with open(task + "/comm") as f:
                name = f.read().strip()
            with open(task + "/schedstat") as f:
                ns = int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            continue  # a thread that ended between the listing and the read
        out[int(os.path.basename(task))] = (name, ns)
    return out


def engine_split(before: dict, after: dict) -> dict[str, float]:
    """CPU seconds the engine's threads spent between the two readings, by thread name."""
    split = dict.fromkeys(ENGINE_THREADS, 0.0)
    for tid, (name, ns) in after.items():
        if name in split:
            split[name] += (ns - before.get(tid, (name, 0))[1]) / 1e9
    return split


def measured(fn):
    """Run ``fn``; its wall seconds, CPU seconds, engine split and result."""
    gc.collect()
    threads, cpu, t = thread_ns(), cpu_seconds(), time.perf_counter()
    out = fn()
    wall, cpu = time.perf_counter() - t, cpu_seconds() - cpu
    return wall, cpu, engine_split(threads, thread_ns()), out


# ---------------------------------------------------------------- states


def tensors_of(state) -> list[torch.Tensor]:
    """Every local tensor of a state dict (a DTensor's local shard), in a fixed order."""
    from torch.distributed.tensor import DTensor

    if isinstance(state, dict):
        return [t for k in sorted(state, key=str) for t in tensors_of(state[k])]
    if isinstance(state, (list, tuple)):
        return [t for v in state for t in tensors_of(v)]
    if isinstance(state, DTensor):
        return [state.to_local()]
    if isinstance(state, torch.Tensor):
        return [state]
    return []


def make_state(case: str, cfg: dict, rank: int, zero: bool):
    if case == "fsdp":
        from torch.distributed.device_mesh import DeviceMesh

        from bench_scaling import rank_state

        return rank_state(DeviceMesh("cpu", list(range(cfg["world"]))), cfg["global_mib"], rank, zero=zero)
    from bench_save_load import make_big_state, make_small_state

    state = make_big_state(cfg["big_bytes"]) if case == "big" else make_small_state(cfg["small_count"])
    if zero:
        state = {k: torch.zeros_like(v) for k, v in state.items()}
    return {"model": state}


def same(a, b) -> bool:
    from bench_scaling import same_state

    return same_state(a, b)


def byte_view(t: torch.Tensor) -> memoryview:
    """The tensor's own memory as bytes (no copy)."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


# ---------------------------------------------------------------- the raw limit


def raw_files(path: str, tensors: list[torch.Tensor]) -> list[tuple[str, list[torch.Tensor]]]:
    """The tensors split into RAW_THREADS groups of about equal bytes, a file each."""
    groups: list[list[torch.Tensor]] = [[] for _ in range(RAW_THREADS)]
    sizes = [0] * RAW_THREADS
    for t in sorted(tensors, key=lambda t: -t.nbytes):
        i = sizes.index(min(sizes))
        groups[i].append(t)
        sizes[i] += t.nbytes
    return [(os.path.join(path, f"raw{i}"), g) for i, g in enumerate(groups)]


def raw_io(path: str, tensors: list[torch.Tensor], write: bool) -> None:
    """pwritev (then fsync) or preadv of each group's tensors, 1,024 buffers a call, a thread per file."""
    errors = []

    def one(name: str, group: list[torch.Tensor]) -> None:
        try:
            fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC if write else os.O_RDONLY, 0o644)
            try:
                off = 0
                for i in range(0, len(group), 1024):
                    bufs = [byte_view(t) for t in group[i:i + 1024] if t.nbytes]
                    want = sum(len(b) for b in bufs)
                    got = os.pwritev(fd, bufs, off) if write else os.preadv(fd, bufs, off)
                    if got != want:
                        raise OSError(f"{name}: {got} of {want} bytes at offset {off}")
                    off += want
                if write:
                    os.fsync(fd)
            finally:
                os.close(fd)
        except Exception as exc:  # noqa: BLE001 - raised by the caller
            errors.append(exc)

    os.makedirs(path, exist_ok=True)
    threads = [threading.Thread(target=one, args=g) for g in raw_files(path, tensors)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if write:
        fd = os.open(path, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
    if errors:
        raise errors[0]


# ---------------------------------------------------------------- the variants


def save_call(variant: str, state, path: str):
    """What one save variant runs; returns the writer (ours: for its stats)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    from dcp_datastates import DataStatesSavePlanner, DataStatesWriter

    if variant == "raw":
        raw_io(path, tensors_of(state), write=True)
        return None
    if variant.startswith("dcp"):
        writer = FileSystemWriter(path, thread_count=2 if variant == "dcp_t2" else 1)
    else:
        writer = DataStatesWriter(path)
    planner = DataStatesSavePlanner() if variant == "ours_planner" else None
    if variant.endswith("_async"):
        resp = dcp.async_save(state, storage_writer=writer, planner=planner)
        (resp.upload_completion if hasattr(resp, "upload_completion") else resp).result()
    else:
        dcp.save(state, storage_writer=writer, planner=planner)
    return writer


def load_call(variant: str, dest, path: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    from dcp_datastates import DataStatesReader

    if variant == "raw":
        raw_io(path, tensors_of(dest), write=False)
    else:
        dcp.load(dest, storage_reader=(DataStatesReader if variant == "ours" else FileSystemReader)(path))


def our_stats(writer) -> dict:
    st = getattr(writer, "last_save_stats", None)
    if st is None:
        return {}
    return {k: getattr(st, k) for k in ("submit_s", "data_write_s", "index_s", "commit_s", "metadata_serialize_s",
                                        "bytes_written") if hasattr(st, k)}


def rank_worker(rank: int, world: int, port: int, case: str, cfg: dict, out_path: str) -> None:
    """One rank of a case: every save variant, then the loads, round-robin, ``reps`` times."""
    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        cfg = dict(cfg, world=world)
        state = make_state(case, cfg, rank, zero=False)
        dest = make_state(case, cfg, rank, zero=True)
        nbytes = sum(t.nbytes for t in tensors_of(state))
        saves = SAVES[case]
        rows, checked = [], set()
        for rep in range(cfg["reps"] + 1):  # repetition 0: an untimed warm-up of each
            k = rep % len(saves)
            order = saves[k:] + saves[:k]
            paths = {v: os.path.join(cfg["root"], f"{case}-w{world}-{v}-{rep}") for v in order}
            for v in order:
                if v == "raw":  # every rank its own folder; the others' writers make theirs
                    paths[v] = os.path.join(paths[v], f"rank{rank}")
                dist.barrier()
                wall, cpu, split, writer = measured(lambda: save_call(v, state, paths[v]))
                rows.append({"rep": rep, "op": "save", "variant": v, "wall": wall, "cpu": cpu, "split": split,
                             "stats": our_stats(writer) if v.startswith("ours") else {}})
            for v in [s for s in order if s in LOADS]:
                dist.barrier()
                wall, cpu, split, _ = measured(lambda: load_call(LOADS[v], dest, paths[v]))
                rows.append({"rep": rep, "op": "load", "variant": LOADS[v], "wall": wall, "cpu": cpu, "split": split})
                if v not in checked:
                    exact = (all(torch.equal(a, b) for a, b in zip(tensors_of(state), tensors_of(dest)))
                             if v == "raw" else same(state, dest))  # raw: tensors only
                    if not exact:
                        raise AssertionError(f"{case}, {world} ranks: the {LOADS[v]} load is not bit-exact")
                    checked.add(v)
                for t in tensors_of(dest):
                    t.zero_()
            dist.barrier()
            if rank == 0:
                for p in paths.values():
                    shutil.rmtree(p if not p.endswith(f"rank{rank}") else os.path.dirname(p), ignore_errors=True)
            dist.barrier()
        every = [None] * world
        dist.all_gather_object(every, {"bytes": nbytes, "rows": [r for r in rows if r["rep"] > 0]})
        if rank == 0:
            with open(out_path, "w") as f:
                json.dump(every, f)
    finally:
        dist.destroy_process_group()
    # Leave without finalizing the interpreter: a gloo thread still freeing a finished collective
    # at finalization aborts the rank (torch's race, seen here as "terminate called without an
    # active exception"); the figures are written by now.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_case(case: str, world: int, cfg: dict) -> dict:
    """Spawn ``world`` ranks; per variant and operation: wall (max over ranks) and CPU (sum over
    ranks), medians over the repetitions, with the engine's split and ours' stage times."""
    import torch.multiprocessing as mp

    out_path = os.path.join(cfg["root"], f"{case}-w{world}.json")
    mp.start_processes(rank_worker, args=(world, free_port(), case, cfg, out_path), nprocs=world, join=True,
                       start_method="spawn")
    with open(out_path) as f:
        every = json.load(f)
    os.remove(out_path)
    nbytes = sum(r["bytes"] for r in every)
    out = {"case": case, "ranks": world, "bytes": nbytes, "figures": {}}
    keys = sorted({(r["op"], r["variant"]) for r in every[0]["rows"]})
    for op, v in keys:
        per_rep: dict[int, list[dict]] = {}
        for rank_rows in every:
            for r in rank_rows["rows"]:
                if (r["op"], r["variant"]) == (op, v):
                    per_rep.setdefault(r["rep"], []).append(r)
        walls = [max(r["wall"] for r in rows) for rows in per_rep.values()]
        cpus = [sum(r["cpu"] for r in rows) for rows in per_rep.values()]
        fig = {"wall": statistics.median(walls), "cpu": statistics.median(cpus), "walls": walls, "cpus": cpus,
               "split": {n: statistics.median([sum(r["split"][n] for r in rows) for rows in per_rep.values()])
                         for n in ENGINE_THREADS}}
        stats = [r.get("stats") for rows in per_rep.values() for r in rows if r.get("stats")]
        if stats:
            fig["stats"] = {k: statistics.median([s[k] for s in stats]) for k in stats[0]}
        out["figures"][f"{op}:{v}"] = fig
    return out


# ---------------------------------------------------------------- the report


def crc_rate() -> float:
    """Bytes per second one core checksums (CRC-32C, the engine's kernel), on 64 MiB."""
    from dcp_datastates import _engine, _probes

    buf = bytearray(os.urandom(1 << 20) * 64)
    kernel = _engine.crc32c_backend()
    best = min(_timed(lambda: _probes.crc32c_with(kernel, buf)) for _ in range(5))
    return len(buf) / best


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def print_case(row: dict, crc_bps: float) -> None:
    gb = row["bytes"] / 1e9
    figs = row["figures"]
    print(f"\n{row['case']}, {row['ranks']} rank(s), {row['bytes'] / MiB:.0f} MiB of tensors: wall s (slowest rank), "
          f"CPU-s (all ranks, all threads), CPU-s/GB; engine threads' CPU-s (stage + d2h | io)")
    for op in ("save", "load"):
        raw, ours = figs.get(f"{op}:raw"), figs.get(f"{op}:ours")
        dcps = {k: v for k, v in figs.items() if k.startswith(f"{op}:dcp")}
        best_dcp = min(dcps.values(), key=lambda f: f["wall"]) if dcps else None
        cheap_dcp = min(dcps.values(), key=lambda f: f["cpu"]) if dcps else None
        for key, f in sorted(figs.items()):
            if not key.startswith(op + ":"):
                continue
            s = f["split"]
            print(f"  {key:18} {fmt(f['wall'], '.3f')} s {fmt(f['cpu'], '.3f')} CPU-s {fmt(f['cpu'] / gb, '.2f')} CPU-s/GB"
                  f"   engine {s['dcpds-stage'] + s['dcpds-d2h']:.3f} | {s['dcpds-io']:.3f}")
        for key, f in sorted(figs.items()):
            if key.startswith(op + ":ours"):
                parts = [f"vs best DCP: {best_dcp['wall'] / f['wall']:.2f}x faster, "
                         f"{f['cpu'] / cheap_dcp['cpu']:.2f}x the CPU of DCP's cheapest" if best_dcp else ""]
                if raw:
                    parts.append(f"vs raw: {raw['wall'] / f['wall']:.2f}x the speed, {f['cpu'] / raw['cpu']:.2f}x the CPU")
                print(f"  {key:18} {'; '.join(p for p in parts if p)}")
        if ours and ours.get("stats"):
            st = ours["stats"]
            crc = st.get("bytes_written", row["bytes"]) / crc_bps
            python = ours["cpu"] - sum(ours["split"].values())
            staging = ours['split']['dcpds-stage'] + ours['split']['dcpds-d2h']
            print(f"  {op}:ours where: Python side {python:.3f} CPU-s, staging copies {staging:.3f}, "
                  f"checksums + I/O {ours['split']['dcpds-io']:.3f} (of it checksums ~{crc:.3f}, estimated); "
                  f"stages (rank 0, wall): " + ", ".join(f"{k} {v:.3f}" for k, v in st.items() if k.endswith("_s")))
        elif op == "load" and ours:
            crc = row["bytes"] / crc_bps
            python = ours["cpu"] - sum(ours["split"].values())
            print(f"  load:ours where: Python side {python:.3f} CPU-s, reads + checks {ours['split']['dcpds-io']:.3f} "
                  f"(of it checksums ~{crc:.3f}, estimated)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="smaller states, 1 repetition, ranks 1,2,4")
    ap.add_argument("--dir", default="/dev/shm", help="where the checkpoints go (a temporary folder, removed)")
    ap.add_argument("--reps", type=int, default=None, help="repetitions (default 3, --quick 1)")
    ap.add_argument("--ranks", default=None, help="world sizes of the fsdp case (default 1,2,4,8,16)")
    ap.add_argument("--cases", default="big,small,fsdp", help="which cases (big, small, fsdp)")
    ap.add_argument("--global-mib", type=int, default=None, help="the fsdp state in all (default 192, --quick 64)")
    ap.add_argument("--json", default=None, help="write every figure to this JSON file")
    args = ap.parse_args()

    root = tempfile.mkdtemp(prefix="bench_cpu_cost-", dir=args.dir)
    cfg = {"root": root, "reps": args.reps or (1 if args.quick else 3),
           "big_bytes": (256 if args.quick else 2048) * MiB, "small_count": 2000 if args.quick else 20000,
           "global_mib": args.global_mib or (64 if args.quick else 192)}
    worlds = [int(w) for w in (args.ranks or ("1,2,4" if args.quick else "1,2,4,8,16")).split(",")]
    crc_bps = crc_rate()
    print(f"bench_cpu_cost: {os.cpu_count()} CPUs, torch {torch.__version__}, --dir {args.dir}, reps {cfg['reps']}, "
          f"CRC-32C {crc_bps / 1e9:.1f} GB/s a core")
    report = {"machine": machine_info(args.dir), "args": vars(args), "crc32c_bytes_per_s": crc_bps, "cases": []}
    try:
        for case in args.cases.split(","):
            for w in (worlds if case == "fsdp" else [1]):
                t = time.perf_counter()
                row = run_case(case, w, cfg)
                report["cases"].append(row)
                print_case(row, crc_bps)
                print(f"  ({time.perf_counter() - t:.0f} s)", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if args.json:
        write_json(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
