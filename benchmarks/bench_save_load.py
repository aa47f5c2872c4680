#!/usr/bin/env python
"""Durable save / cold load benchmark: torch.save, DCP FileSystemWriter/Reader,
dcp_datastates, and the raw disk, measured in one run on the same state.

    python benchmarks/bench_save_load.py [--quick] [--dir DIR] [--reps N] [--json OUT]

States
  big    ~2 GiB in a few hundred float32/bf16 tensors of 1-32 MiB (--quick: ~256 MiB)
  small  20,000 tensors of 256-4096 elements, mixed dtypes (--quick: 2,000)

Variants (every save is durable: its data is fsynced before the clock stops)
  raw_direct    probe_sequential_write(direct=True): one thread, 8 MiB O_DIRECT
                pwrites of the same byte count + fsync; its "load" is a cold
                sequential buffered read of that file (drop_page_cache first)
  raw_buffered  the same write through the page cache + fsync (save only)
  raw_read_2t   (load only, for context) a file of the same size written with
                O_DIRECT, then read cold by 2 Python threads with os.preadv
                into 8 MiB buffers (interleaved blocks), like the engine's 2
                I/O threads; the target compares against raw_direct's read
  torch         torch.save(state, file) + fsync(file) + fsync(dir);
                load: torch.load(file, mmap=False, weights_only=True)
  memcpy        (save only, the limit on fast storage) one thread memcpy of the
                same byte count between two prefaulted buffers (_probes.probe_memcpy,
                fastest of 3): no save that moves each byte once can beat it
  dcp_t1        dcp.save with FileSystemWriter(thread_count=1) (DCP's default);
                load: dcp.load with FileSystemReader into preallocated tensors
  dcp_t2        the same with FileSystemWriter(thread_count=2)
  ours          dcp.save with DataStatesWriter(path) (default settings, safe mode);
                load: dcp.load with DataStatesReader into preallocated tensors
  dcp_t1_repeat (small state) a repeated save of the same structure with DCP's plan
                caching (DefaultSavePlanner(enable_plan_caching=True), cache filled
                by an untimed save first), FileSystemWriter(thread_count=1)
  ours_repeat   (small state) the same with DataStatesWriter
  ours_planner  (small state) dcp.save with DataStatesWriter and DataStatesSavePlanner()
                (DCP's planning in one pass per item; the same plans and metadata)
  ours_planner_repeat  (small state) a repeated save with
                DataStatesSavePlanner(enable_plan_caching=True) and DataStatesWriter

Shape (--shape): every dcp variant saves {"model": state} (nested, the default:
what dcp.save gets from {"model": model.state_dict()} or torchtitan's Stateful
wrappers) or the state itself (flat: one top-level key per tensor). dcp.save
wraps each top-level key's Stateful check in DCP's method logger (about 50 us
a key, the same for every writer), so the flat shape adds about 1 s to every
dcp variant of the small state.

Targets depend on the storage under --dir (issue 15):
  tmpfs (no disk: software cost)  big: save >= 1.3x the best DCP (t=1, t=2) and
                                  >= 0.5x memcpy; load >= 2x DCP
  a disk                          big: save >= 0.9x raw O_DIRECT and >= 1.0x the best
                                  DCP; load >= 0.9x the raw cold read
  both                            small: save >= 6x and load >= 4x DCP t=1, first
                                  and repeated saves

Every load is cold: drop_page_cache() runs on every file of the checkpoint
first. Destination tensors are allocated and touched (zeroed) before the
clock starts, as a model's parameters would be. Within each repetition the
variants run round-robin, starting one variant later in every repetition;
every save goes to a fresh directory that is deleted (and os.sync()ed, so
that ext4's online discard is not billed to the next variant) right after
its load. Bit-exactness is checked once per variant and state (torch.equal),
outside the timed region. Figures are medians over --reps. A tiny untimed
warm-up runs every variant first (imports, engine creation, pool faults).

GB/s means 1e9 bytes per second of tensor payload (the sum of the state's
tensor nbytes; the raw probes use their own byte count, rounded up to 8 MiB).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import random
import sys
import threading
import time
import warnings

warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
warnings.filterwarnings("ignore", message=".*assuming the intent is to (save|load) in a single process.*")

import torch  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter  # noqa: E402
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner  # noqa: E402

from bench_common import add_common_args, drop_tree, filesystem_type, fmt, make_scratch, median, remove, remove_scratch, write_json  # noqa: E402
from bench_common import machine_info as common_machine_info  # noqa: E402
from dcp_datastates import DataStatesReader, DataStatesSavePlanner, DataStatesWriter  # noqa: E402
from dcp_datastates import _engine, _probes  # noqa: E402
from dcp_datastates.storage.fsync_files import fsync_dir  # noqa: E402

MiB = 1 << 20
GiB = 1 << 30
GB = 1e9
BLOCK = 8 * MiB

SAVE_VARIANTS = ["raw_direct", "raw_buffered", "raw_read_2t", "memcpy", "torch", "dcp_t1", "dcp_t2", "ours"]
REPEAT_VARIANTS = ["dcp_t1_repeat", "ours_repeat", "ours_planner_repeat"]  # the small state only
SMALL_ONLY_VARIANTS = REPEAT_VARIANTS + ["ours_planner"]
LABELS = {
    "raw_direct": "raw O_DIRECT write / cold read",
    "raw_read_2t": "raw cold read, 2 threads",
    "raw_buffered": "raw buffered write+fsync",
    "memcpy": "memcpy, 1 thread (limit)",
    "torch": "torch.save / torch.load",
    "dcp_t1": "DCP FileSystem t=1 (default)",
    "dcp_t2": "DCP FileSystem t=2",
    "ours": "ours DataStates",
    "dcp_t1_repeat": "DCP t=1, repeated (plan cache)",
    "ours_repeat": "ours, repeated (plan cache)",
    "ours_planner": "ours + DataStatesSavePlanner",
    "ours_planner_repeat": "ours + planner, repeated",
}
TARGETS = {
    "tmpfs": {"save_vs_best_dcp_big": 1.3, "save_vs_memcpy_big": 0.5, "load_vs_dcp_big": 2.0},
    "disk": {"save_vs_raw_direct_big": 0.9, "save_vs_best_dcp_big": 1.0, "load_vs_raw_read_big": 0.9},
    "both": {"save_vs_dcp_t1_small": 6.0, "save_repeat_vs_dcp_t1_repeat_small": 6.0, "load_vs_dcp_t1_small": 4.0},
}


class OursCachedPlanner(DefaultSavePlanner):
    """DCP's planner with plan caching, for our repeated saves. DCP keys its plan cache by
    the planner's class name: one class per writer keeps the two caches apart."""

    def __init__(self) -> None:
        super().__init__(enable_plan_caching=True)


class DcpCachedPlanner(DefaultSavePlanner):
    """The same for FileSystemWriter's repeated saves."""

    def __init__(self) -> None:
        super().__init__(enable_plan_caching=True)


class OursPlannerCached(DataStatesSavePlanner):
    """DataStatesSavePlanner with DCP's plan caching (a third cache key)."""

    def __init__(self) -> None:
        super().__init__(enable_plan_caching=True)


def cached_planner(variant: str) -> DefaultSavePlanner:
    return {"ours_repeat": OursCachedPlanner, "ours_planner_repeat": OursPlannerCached,
            "dcp_t1_repeat": DcpCachedPlanner}[variant]()


def variants_for(state_name: str) -> list[str]:
    return SAVE_VARIANTS + (SMALL_ONLY_VARIANTS if state_name == "small" else [])


# ---------------------------------------------------------------- states


def make_big_state(target_bytes: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Tensors of 1-32 MiB, float32 or bf16, 2-D with assorted row widths."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    sizes_mib = [1, 2, 3, 4, 6, 8, 12, 16, 24, 32]
    state, total, i = {}, 0, 0
    while total < target_bytes:
        dtype = rng.choice([torch.float32, torch.bfloat16])
        cols = rng.choice([1000, 1024, 3072, 4096, 5120])
        want = min(rng.choice(sizes_mib) * MiB, max(target_bytes - total, MiB))
        rows = max(1, want // (cols * dtype.itemsize))
        t = torch.empty(rows, cols, dtype=torch.float32).normal_(generator=gen).to(dtype)
        state[f"layers.{i // 4}.w{i % 4}"] = t
        total += t.nbytes
        i += 1
    return state


def make_small_state(count: int, seed: int = 1) -> dict[str, torch.Tensor]:
    """`count` tensors of 256-4096 elements: float32, bf16, float16, int64, int32."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    dtypes = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32]
    state = {}
    for i in range(count):
        dtype = rng.choice(dtypes)
        numel = rng.randint(256, 4096)
        shape = (numel // 16, 16) if numel % 16 == 0 else (numel,)
        if dtype.is_floating_point:
            t = torch.empty(shape, dtype=torch.float32).normal_(generator=gen).to(dtype)
        else:
            t = torch.randint(-(1 << 30), 1 << 30, shape, dtype=dtype, generator=gen)
        state[f"blocks.{i // 8}.p{i % 8}"] = t
    return state


def state_bytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.nbytes for t in state.values())


# ---------------------------------------------------------------- helpers


def check_equal(expected: dict, got: dict, what: str) -> None:
    if set(expected) != set(got):
        raise AssertionError(f"{what}: keys differ ({len(expected)} expected, {len(got)} loaded)")
    for k, v in expected.items():
        g = got[k]
        if g.dtype != v.dtype or g.shape != v.shape or not torch.equal(g, v):
            raise AssertionError(f"{what}: tensor {k!r} differs after the round trip")


def parallel_read(path: str, threads: int) -> tuple[float, int]:
    """Read `path` with `threads` threads, 8 MiB preadv calls on interleaved blocks."""
    size = os.path.getsize(path)
    done = [0] * threads

    def worker(i: int) -> None:
        buf = bytearray(BLOCK)
        off, got = i * BLOCK, 0
        while off < size:
            got += os.preadv(fd, [buf], off)
            off += threads * BLOCK
        done[i] = got

    t0 = time.perf_counter()
    fd = os.open(path, os.O_RDONLY)
    try:
        ts = [threading.Thread(target=worker, args=(i,)) for i in range(threads)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
    finally:
        os.close(fd)
    return time.perf_counter() - t0, sum(done)


def timed(fn):
    gc.collect()
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


class Runner:
    def __init__(self, root: str, nested: bool = True) -> None:
        self.root = root
        self.nested = nested  # dcp variants save {"model": state}
        self.counter = 0
        self.verified: set[tuple[str, str]] = set()

    def fresh(self, tag: str) -> str:
        self.counter += 1
        return os.path.join(self.root, f"{tag}-{self.counter:04d}")

    def run(self, variant: str, state_name: str, state: dict, dst: dict, nbytes: int) -> dict:
        verify = (state_name, variant) not in self.verified
        rec = getattr(self, "_" + variant)(state, dst, nbytes, verify, f"{variant} on {state_name}")
        if verify and rec.get("verified"):
            self.verified.add((state_name, variant))
        return rec

    # -- raw disk ------------------------------------------------------------

    def _raw_direct(self, state, dst, nbytes, verify, what) -> dict:
        path = self.fresh("raw_direct") + ".bin"
        save_s = _probes.probe_sequential_write(path, nbytes, BLOCK, True)
        written = os.path.getsize(path)
        drop_tree(path)
        n, load_s = _probes.probe_sequential_read(path, BLOCK)
        remove(path)
        return {"save_s": save_s, "load_s": load_s, "save_bytes": written, "load_bytes": n}

    def _raw_buffered(self, state, dst, nbytes, verify, what) -> dict:
        path = self.fresh("raw_buffered") + ".bin"
        save_s = _probes.probe_sequential_write(path, nbytes, BLOCK, False)
        written = os.path.getsize(path)
        remove(path)
        return {"save_s": save_s, "load_s": None, "save_bytes": written}

    def _memcpy(self, state, dst, nbytes, verify, what) -> dict:
        return {"save_s": _probes.probe_memcpy(nbytes, BLOCK, 3), "load_s": None, "save_bytes": nbytes}

    def _raw_read_2t(self, state, dst, nbytes, verify, what) -> dict:
        path = self.fresh("raw_read_2t") + ".bin"
        _probes.probe_sequential_write(path, nbytes, BLOCK, True)
        drop_tree(path)
        load_s, n = parallel_read(path, 2)
        remove(path)
        return {"save_s": None, "load_s": load_s, "load_bytes": n}

    # -- torch.save ----------------------------------------------------------

    def _torch(self, state, dst, nbytes, verify, what) -> dict:
        d = self.fresh("torch")
        os.makedirs(d)
        f = os.path.join(d, "state.pt")

        def save():
            torch.save(state, f)
            fd = os.open(f, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            fsync_dir(d)

        save_s, _ = timed(save)
        drop_tree(d)
        load_s, out = timed(lambda: torch.load(f, mmap=False, weights_only=True))
        rec = {"save_s": save_s, "load_s": load_s, "file_bytes": os.path.getsize(f)}
        if verify:
            check_equal(state, out, what)
            rec["verified"] = True
        del out
        remove(d)
        return rec

    # -- DCP ---------------------------------------------------------------

    def _dcp(self, state, dst, verify, what, writer_factory, reader_factory, tag, planner=None) -> dict:
        d = self.fresh(tag)
        writer = writer_factory(d)
        saved = {"model": state} if self.nested else state
        save_s, _ = timed(lambda: dcp.save(saved, storage_writer=writer, no_dist=True, planner=planner))
        rec = {"save_s": save_s, "file_bytes": sum(
            os.path.getsize(os.path.join(d, n)) for n in os.listdir(d)), "files": len(os.listdir(d))}
        if isinstance(writer, DataStatesWriter):
            rec["stats"] = dataclasses.asdict(writer.last_save_stats)
        for t in dst.values():
            t.zero_()
        drop_tree(d)
        reader = reader_factory(d)
        loaded = {"model": dst} if self.nested else dst
        load_s, _ = timed(lambda: dcp.load(loaded, storage_reader=reader, no_dist=True))
        rec["load_s"] = load_s
        if verify:
            check_equal(state, dst, what)
            rec["verified"] = True
        remove(d)
        return rec

    def _dcp_t1(self, state, dst, nbytes, verify, what) -> dict:
        return self._dcp(state, dst, verify, what, lambda d: FileSystemWriter(d, thread_count=1),
                         FileSystemReader, "dcp_t1")

    def _dcp_t2(self, state, dst, nbytes, verify, what) -> dict:
        return self._dcp(state, dst, verify, what, lambda d: FileSystemWriter(d, thread_count=2),
                         FileSystemReader, "dcp_t2")

    def _ours(self, state, dst, nbytes, verify, what) -> dict:
        return self._dcp(state, dst, verify, what, DataStatesWriter, DataStatesReader, "ours")

    def _dcp_t1_repeat(self, state, dst, nbytes, verify, what) -> dict:
        return self._dcp(state, dst, verify, what, lambda d: FileSystemWriter(d, thread_count=1),
                         FileSystemReader, "dcp_t1_repeat", DcpCachedPlanner())

    def _ours_planner(self, state, dst, nbytes, verify, what) -> dict:
        return self._dcp(state, dst, verify, what, DataStatesWriter, DataStatesReader, "ours_planner",
                         DataStatesSavePlanner())

    def _ours_repeat(self, state, dst, nbytes, verify, what, variant="ours_repeat") -> dict:
        rec = self._dcp(state, dst, verify, what, DataStatesWriter, DataStatesReader, variant,
                        cached_planner(variant))
        if not rec["stats"]["plan_from_cache"]:
            raise AssertionError(f"{what}: the repeated save did not use DCP's cached plan")
        return rec

    def _ours_planner_repeat(self, state, dst, nbytes, verify, what) -> dict:
        return self._ours_repeat(state, dst, nbytes, verify, what, "ours_planner_repeat")


# ---------------------------------------------------------------- reporting


def machine_info(root: str) -> dict:
    info = common_machine_info(root)
    info["crc32c_backend"] = _engine.crc32c_backend()
    return info


def summarize(reps: list[dict], nbytes: int, variants: list[str]) -> dict:
    out = {}
    for v in variants:
        recs = [r[v] for r in reps]
        save_s = median([r["save_s"] for r in recs])
        load_s = median([r.get("load_s") for r in recs])
        sb = recs[0].get("save_bytes", nbytes)
        lb = recs[0].get("load_bytes", nbytes)
        out[v] = {
            "save_s": save_s,
            "load_s": load_s,
            "save_gbps": sb / save_s / GB if save_s else None,
            "load_gbps": lb / load_s / GB if load_s else None,
            "save_gbps_reps": [sb / r["save_s"] / GB for r in recs if r.get("save_s")],
            "load_gbps_reps": [lb / r["load_s"] / GB for r in recs if r.get("load_s")],
        }
    return out


def ratios(summary: dict, state_name: str, storage: str) -> list[dict]:
    """The ratios of this state's medians, with the targets of ``storage`` (tmpfs or disk)."""
    ours = summary["ours"]
    gbps = {v: r["save_gbps"] for v, r in summary.items()}
    best_dcp = max(x for x in (gbps["dcp_t1"], gbps["dcp_t2"]) if x) if (gbps["dcp_t1"] or gbps["dcp_t2"]) else None
    targets = {**TARGETS[storage], **TARGETS["both"]}

    def target(name: str):
        return targets.get(f"{name}_{state_name}")

    rows = [
        ("ours save / raw O_DIRECT write", ours["save_gbps"], gbps["raw_direct"], target("save_vs_raw_direct")),
        ("ours save / raw buffered write+fsync", ours["save_gbps"], gbps["raw_buffered"], None),
        ("ours save / memcpy limit", ours["save_gbps"], gbps["memcpy"], target("save_vs_memcpy")),
        ("ours save / best DCP (t=1, t=2)", ours["save_gbps"], best_dcp, target("save_vs_best_dcp")),
        ("ours save / DCP t=1 (default)", ours["save_gbps"], gbps["dcp_t1"], target("save_vs_dcp_t1")),
        ("ours save / DCP t=2", ours["save_gbps"], gbps["dcp_t2"], None),
        ("ours save / torch.save", ours["save_gbps"], gbps["torch"], None),
    ]
    if "ours_repeat" in summary:
        rows += [
            ("ours repeated save / DCP t=1 repeated", summary["ours_repeat"]["save_gbps"],
             gbps["dcp_t1_repeat"], target("save_repeat_vs_dcp_t1_repeat")),
            ("ours repeated save / ours first save", summary["ours_repeat"]["save_gbps"], ours["save_gbps"], None),
        ]
    if "ours_planner" in summary:
        rows += [
            ("ours + planner save / DCP t=1 (default)", summary["ours_planner"]["save_gbps"], gbps["dcp_t1"],
             target("save_vs_dcp_t1")),
        ]
    if "ours_planner_repeat" in summary:
        rows += [
            ("ours + planner repeated / DCP t=1 repeated", summary["ours_planner_repeat"]["save_gbps"],
             gbps["dcp_t1_repeat"], target("save_repeat_vs_dcp_t1_repeat")),
        ]
    rows += [
        ("ours load / raw cold read", ours["load_gbps"], summary["raw_direct"]["load_gbps"], target("load_vs_raw_read")),
        ("ours load / raw cold read, 2 threads", ours["load_gbps"], summary["raw_read_2t"]["load_gbps"], None),
        ("ours load / DCP FileSystemReader", ours["load_gbps"], summary["dcp_t1"]["load_gbps"],
         target("load_vs_dcp") or target("load_vs_dcp_t1")),
        ("ours load / torch.load", ours["load_gbps"], summary["torch"]["load_gbps"], None),
    ]
    out = []
    for name, a, b, tgt in rows:
        r = a / b if a and b else None
        out.append({"name": name, "ratio": r, "target": tgt,
                    "pass": (r >= tgt) if (tgt is not None and r is not None) else None})
    return out


def print_state(name: str, meta: dict, summary: dict, rat: list[dict], ours_stats: list[dict], reps: int) -> None:
    variants = list(summary)
    print()
    print(f"=== state {name}: {meta['tensors']} tensors, {meta['bytes'] / GiB:.3f} GiB "
          f"({meta['bytes'] / GB:.3f} GB), median of {reps} rep(s) ===")
    print(f"{'variant':<32}{'save s':>8}{'save GB/s':>11}{'load s':>8}{'load GB/s':>11}"
          f"   per rep GB/s: save | load")
    for v in variants:
        s = summary[v]
        per_s = " ".join(f"{x:.2f}" for x in s["save_gbps_reps"]) or "-"
        per_l = " ".join(f"{x:.2f}" for x in s["load_gbps_reps"]) or "-"
        print(f"{LABELS[v]:<32}{fmt(s['save_s'], '.3f')}{fmt(s['save_gbps'], '.3f', 11)}"
              f"{fmt(s['load_s'], '.3f')}{fmt(s['load_gbps'], '.3f', 11)}   {per_s} | {per_l}")
    print("ratios (of median GB/s):")
    for r in rat:
        verdict = "" if r["target"] is None else (
            f"target >= {r['target']:.1f}x  {'PASS' if r['pass'] else 'FAIL'}")
        print(f"  {r['name']:<42}{fmt(r['ratio'], '.2f', 6)}x   {verdict}")
    keys = ["data_write_s", "submit_s", "objects_s", "metadata_serialize_s", "index_s", "commit_s",
            "dcp_other_s", "windows_from_source"]
    med = {k: median([s[k] for s in ours_stats]) for k in keys}
    before = [s["metadata_done_before_data"] for s in ours_stats]
    print("ours last_save_stats (median s): " + ", ".join(f"{k}={med[k]:.4f}" for k in keys[:-1])
          + f"; windows written without a staging copy: {med['windows_from_source']:.0f}")
    print(f"  metadata_serialize_s {med['metadata_serialize_s']:.4f} vs data_write_s "
          f"{med['data_write_s']:.4f}; metadata_done_before_data per rep: {before}; "
          f"direct_io={ours_stats[0]['direct_io']}, bytes_written={ours_stats[0]['bytes_written']}")


# ---------------------------------------------------------------- main


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(ap, "~256 MiB big state, 2,000 small tensors, 1 rep")
    ap.add_argument("--big-mib", type=int, default=None, help="override the big state's size in MiB")
    ap.add_argument("--small-count", type=int, default=None, help="override the small state's tensor count")
    ap.add_argument("--states", default="big,small", help="comma-separated subset of big,small")
    ap.add_argument("--shape", choices=["nested", "flat"], default="nested",
                    help='what dcp.save gets: {"model": state} (nested) or one top-level key per tensor (flat)')
    args = ap.parse_args()

    torch.set_num_threads(2)
    reps = args.reps if args.reps is not None else (1 if args.quick else 3)
    big_bytes = (args.big_mib if args.big_mib else (256 if args.quick else 2048)) * MiB
    small_count = args.small_count if args.small_count else (2000 if args.quick else 20000)
    state_names = [s for s in args.states.split(",") if s]
    base, root, created_base = make_scratch(args.dir, "run-")
    info = machine_info(base)
    fstype = filesystem_type(root)
    storage = "tmpfs" if fstype == "tmpfs" else "disk"
    info["storage"] = storage
    t_start = time.perf_counter()
    print(f"dcp_datastates save/load benchmark: dir={root} ({fstype}: {storage} targets) reps={reps} "
          f"quick={args.quick} shape={args.shape}")
    print(f"nproc={info['nproc']} cpu={info.get('cpu', '?')} RAM={info.get('mem_total_kib', 0) / 2**20:.1f} GiB "
          f"torch={info['torch']} threads={info['torch_threads']} "
          f"crc32c={info['crc32c_backend']} mount: {info.get('mount', '?')}")

    try:
        states, dsts, metas = {}, {}, {}
        t = time.perf_counter()
        for name in state_names:
            if name == "big":
                states[name] = make_big_state(big_bytes)
            elif name == "small":
                states[name] = make_small_state(small_count)
            else:
                raise SystemExit(f"unknown state {name!r}")
            dsts[name] = {k: torch.zeros_like(v) for k, v in states[name].items()}
            metas[name] = {"tensors": len(states[name]), "bytes": state_bytes(states[name])}
        print(f"states built in {time.perf_counter() - t:.1f}s: " + ", ".join(
            f"{n}={m['tensors']} tensors/{m['bytes'] / MiB:.0f} MiB" for n, m in metas.items()))

        runner = Runner(root, nested=args.shape == "nested")
        # Untimed warm-up of every variant on a tiny state.
        tiny = {f"w{i}": torch.randn(1024 + i) for i in range(4)}
        tiny_dst = {k: torch.zeros_like(v) for k, v in tiny.items()}
        for v in SAVE_VARIANTS:
            runner.run(v, "warmup", tiny, tiny_dst, state_bytes(tiny))
        # The repeated-save variants: one untimed save of the real structure fills DCP's plan cache.
        for name in state_names:
            for v in variants_for(name):
                if v in REPEAT_VARIANTS:
                    d = runner.fresh("fill")
                    writer = FileSystemWriter(d, thread_count=1) if v == "dcp_t1_repeat" else DataStatesWriter(d)
                    saved = {"model": states[name]} if runner.nested else states[name]
                    dcp.save(saved, storage_writer=writer, no_dist=True, planner=cached_planner(v))
                    remove(d)

        results = {n: [] for n in state_names}
        for rep in range(reps):
            for name in state_names:
                names = variants_for(name)
                order = names[rep % len(names):] + names[:rep % len(names)]
                recs = {}
                for v in order:
                    recs[v] = runner.run(v, name, states[name], dsts[name], metas[name]["bytes"])
                for v in ("ours", "ours_repeat", "ours_planner", "ours_planner_repeat"):
                    if v in recs:
                        st = recs[v]["stats"]
                        st["dcp_other_s"] = recs[v]["save_s"] - st["data_write_s"] - st["index_s"] - st["commit_s"]
                results[name].append(recs)
                line = " ".join(f"{v}={recs[v]['save_s'] or 0:.2f}/{recs[v]['load_s'] or 0:.2f}" for v in names)
                print(f"rep {rep + 1}/{reps} {name} (save/load s, order {','.join(order)}): {line}", flush=True)

        report = {"config": {"reps": reps, "quick": args.quick, "dir": root, "big_bytes": big_bytes,
                             "small_count": small_count, "block": BLOCK, "shape": args.shape,
                             "argv": sys.argv},
                  "machine": info, "targets": {**TARGETS[storage], **TARGETS["both"]}, "states": {}}
        for name in state_names:
            summary = summarize(results[name], metas[name]["bytes"], variants_for(name))
            rat = ratios(summary, name, storage)
            ours_stats = [r["ours"]["stats"] for r in results[name]]
            print_state(name, metas[name], summary, rat, ours_stats, reps)
            repeat_stats = [r["ours_repeat"]["stats"] for r in results[name] if "ours_repeat" in r]
            if repeat_stats:
                keys = ["data_write_s", "submit_s", "metadata_serialize_s", "commit_s", "dcp_other_s"]
                print("ours_repeat last_save_stats (median s): " + ", ".join(
                    f"{k}={median([st[k] for st in repeat_stats]):.4f}" for k in keys))
            report["states"][name] = {**metas[name], "median": summary, "ratios": rat,
                                      "reps": results[name]}
        verified = sorted(f"{s}/{v}" for s, v in runner.verified if s != "warmup")
        print(f"\nbit-exact round trips verified: {', '.join(verified)}")
        report["verified"] = verified
        report["wall_s"] = time.perf_counter() - t_start
        print(f"total wall time {report['wall_s']:.0f}s")
        if args.json:
            write_json(args.json, report)
    finally:
        remove_scratch(base, root, created_base)
    return 0


if __name__ == "__main__":
    sys.exit(main())
