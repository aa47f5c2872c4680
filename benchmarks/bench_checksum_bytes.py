#!/usr/bin/env python
"""What DataStatesWriter(checksum_bytes=...) costs and buys: save and load time, index size,
and the read amplification of a column-slice load, per checksum segment size.

    python benchmarks/bench_checksum_bytes.py --dir /dev/shm/cb_bench [--reps 3]
        [--big-mib 512] [--small-count 10000] [--sizes none,1048576,65536,16384,4096]

States: ``big`` (``--big-mib`` in 32 MiB float32 tensors) and ``small``
(``--small-count`` tensors of 256-4096 float32 elements). Every save is a
durable ``dcp.save`` (no process group) into a fresh directory, then a load
into preallocated tensors, checked bit-exact once; the sizes run round-robin,
starting one later every repetition, and figures are the fastest of the
repetitions (least disturbed by other work on a shared machine) and medians. The slice load
saves one 4096 x 4096 float32 tensor as one chunk and loads its left half
(row runs of 8 KiB in rows of 16 KiB, as a Shard(1) load of a Shard(0) save
reads) and a 2 x 2 block: amplification is ``bytes_read / bytes_needed``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import time
import warnings

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from dcp_datastates import DataStatesReader, DataStatesWriter

warnings.filterwarnings("ignore", message="torch.distributed is disabled")
MiB = 1 << 20


class _BoxPlanner(DefaultLoadPlanner):
    def __init__(self, fqn, offsets, sizes):
        super().__init__()
        self.box = (fqn, offsets, sizes)

    def create_local_plan(self):
        fqn, offsets, sizes = self.box
        md = self.metadata.state_dict_metadata[fqn]
        return LoadPlan(create_read_items_for_chunk_list(fqn, md, [ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes))]))

    def lookup_tensor(self, index):
        return self.state_dict[index.fqn]


def _index_bytes(path):
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".index"))


def _save_load(root, size, state, dst, check):
    d = os.path.join(root, f"s{size or 0}")
    shutil.rmtree(d, ignore_errors=True)
    t, c = time.perf_counter(), time.process_time()
    dcp.save(state, storage_writer=DataStatesWriter(d, checksum_bytes=size), no_dist=True)
    save_s, save_cpu = time.perf_counter() - t, time.process_time() - c
    index = _index_bytes(d)
    for v in dst.values():
        v.zero_()
    t, c = time.perf_counter(), time.process_time()
    dcp.load(dst, storage_reader=DataStatesReader(d), no_dist=True)
    load_s, load_cpu = time.perf_counter() - t, time.process_time() - c
    if check:
        assert all(torch.equal(dst[k], state[k]) for k in state), f"checksum_bytes={size}: not bit-exact"
    shutil.rmtree(d)
    return save_s, load_s, index, save_cpu, load_cpu


def _amplification(root, size):
    d = os.path.join(root, f"slice{size or 0}")
    shutil.rmtree(d, ignore_errors=True)
    full = torch.randn(4096, 4096, generator=torch.Generator().manual_seed(3))
    dcp.save({"w": full}, storage_writer=DataStatesWriter(d, checksum_bytes=size), no_dist=True)
    out = []
    for offsets, sizes in (((0, 0), (4096, 2048)), ((2048, 2048), (2048, 2048))):
        dest = torch.zeros(sizes)
        reader = DataStatesReader(d)
        dcp.load({"w": dest}, storage_reader=reader, planner=_BoxPlanner("w", offsets, sizes), no_dist=True)
        assert torch.equal(dest, full[offsets[0]:offsets[0] + sizes[0], offsets[1]:offsets[1] + sizes[1]])
        out.append(reader.bytes_read / reader.bytes_needed)
    shutil.rmtree(d)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", required=True)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--big-mib", type=int, default=512)
    ap.add_argument("--small-count", type=int, default=10000)
    ap.add_argument("--sizes", default="none,1048576,65536,16384,4096")
    args = ap.parse_args()
    torch.set_num_threads(2)
    sizes = [None if s == "none" else int(s) for s in args.sizes.split(",")]
    root = os.path.join(args.dir, f"cb-{os.getpid()}")
    os.makedirs(root)
    g = torch.Generator().manual_seed(1)
    states = {
        "big": {f"b{i}": torch.randn(8 * MiB, generator=g) for i in range(args.big_mib // 32)},
        "small": {f"s{i}": torch.randn(256 + (i * 37) % 3841, generator=g) for i in range(args.small_count)},
    }
    dsts = {n: {k: torch.zeros_like(v) for k, v in s.items()} for n, s in states.items()}
    try:
        for size in sizes:  # untimed warm-up: engines, pools
            _save_load(root, size, {"w": torch.randn(1024)}, {"w": torch.zeros(1024)}, True)
        res = {(n, s): [] for n in states for s in sizes}
        for rep in range(args.reps):
            order = sizes[rep % len(sizes):] + sizes[:rep % len(sizes)]
            for name in states:
                for size in order:
                    res[(name, size)].append(_save_load(root, size, states[name], dsts[name], rep == 0))
            print(f"rep {rep + 1}/{args.reps} done", flush=True)
        print("wall seconds min/median and CPU seconds (all threads) median over the repetitions; index in "
              "bytes; amp = bytes read / bytes needed")
        print(f"{'checksum_bytes':>14} | {'big save s':>11} {'cpu':>5} {'big load s':>11} {'cpu':>5} {'big index':>9} | "
              f"{'small save s':>11} {'cpu':>5} {'small load s':>11} {'cpu':>5} {'index':>7} | {'cols amp':>8} {'block amp':>9}")
        for size in sizes:
            b, s = res[("big", size)], res[("small", size)]
            amp = _amplification(root, size)
            def fig(rows, i):
                wall = f"{min(r[i] for r in rows):.3f}/{statistics.median(r[i] for r in rows):.3f}"
                return f"{wall:>11} {statistics.median(r[i + 3] for r in rows):5.3f}"

            print(f"{str(size):>14} | {fig(b, 0)} {fig(b, 1)} {b[0][2]:9d} | "
                  f"{fig(s, 0)} {fig(s, 1)} {s[0][2]:7d} | {amp[0]:8.3f} {amp[1]:9.3f}", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
