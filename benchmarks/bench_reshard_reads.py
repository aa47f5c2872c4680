"""Read amplification of resharded loads: bytes read / bytes needed, ours against DCP's.

A state of ``--tensors`` square fp32 tensors (``--mib`` each) is saved as
Shard(0) DTensors by ``--save-ranks`` gloo ranks (torch.multiprocessing), with
dcp_datastates (once per ``--windows`` write window: a window is the largest
checksum segment) and with DCP's FileSystemWriter. Each is then loaded the way
other layouts would load it: Shard(1) column slices over ``--load-ranks``
ranks, and the 2 x 2 blocks of a 2-D mesh. The load ranks are simulated one
after another in this process, each a ``dcp.load`` (no process group) with
DCP's own planner computing which saved chunks overlap its boxes, so each
rank reads exactly what it would read in a real job; every box is checked
bit-exact against the saved values.

Bytes read: ours from ``DataStatesReader.bytes_read`` (the bytes asked of the
store: widened to checksum segments, merged gaps included); DCP's by a
``FileSystemReader`` whose file system opens every file through a counting
raw file under the usual buffered reader, so the count is what the OS handed
over (read-ahead included). Time: the sum of the simulated ranks' load times.
"""

from __future__ import annotations

import argparse
import io
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common as bc  # noqa: E402

SEED = 4242


def full_tensor(i: int, n: int):
    import torch

    return torch.randn((n, n), generator=torch.Generator().manual_seed(SEED + i))


def _save_rank(rank, world, port, root, tensors, n, windows):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from dcp_datastates import DataStatesWriter

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        rows = n // world
        state = {f"w{i}": DTensor.from_local(full_tensor(i, n)[rank * rows : (rank + 1) * rows].clone(), mesh, [Shard(0)])
                 for i in range(tensors)}
        for w in windows:
            dcp.save(state, storage_writer=DataStatesWriter(os.path.join(root, f"ours_{w}"), window_bytes=w,
                                                            host_cache_bytes=max(64 << 20, 4 * w)))
        dcp.save(state, storage_writer=dcp.FileSystemWriter(os.path.join(root, "dcp")))
    finally:
        dist.destroy_process_group()


def counting_reader(path):
    """DCP's FileSystemReader, counting the bytes its files hand over (``.bytes_read``)."""
    from contextlib import contextmanager

    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.filesystem import FileSystem

    class CountingRaw(io.RawIOBase):
        def __init__(self, path, counter):
            self.f, self.counter = open(path, "rb", buffering=0), counter

        def readable(self):
            return True

        def seekable(self):
            return True

        def seek(self, pos, whence=0):
            return self.f.seek(pos, whence)

        def tell(self):
            return self.f.tell()

        def readinto(self, b):
            n = self.f.readinto(b)
            self.counter[0] += n or 0
            return n

        def close(self):
            self.f.close()
            super().close()

    class CountingFS(FileSystem):
        def __init__(self):
            self.counter = [0]

        @contextmanager
        def create_stream(self, path, mode):
            assert mode == "rb"
            with io.BufferedReader(CountingRaw(path, self.counter)) as stream:
                yield stream

    class CountingReader(FileSystemReader):
        def __init__(self, path):
            super().__init__(path)
            self.fs = CountingFS()

        @property
        def bytes_read(self):
            return self.fs.counter[0]

    return CountingReader(path)


def box_planner(boxes):
    """DCP's planner, loading box ``(offsets, sizes)`` of each saved tensor into a tensor of that shape."""
    import torch
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
    from torch.distributed.checkpoint.planner import LoadPlan
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

    class BoxPlanner(DefaultLoadPlanner):
        def create_local_plan(self):
            items = []
            for fqn, (offsets, sizes) in boxes.items():
                md = self.metadata.state_dict_metadata[fqn]
                items += create_read_items_for_chunk_list(
                    fqn, md, [ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes))])
            return LoadPlan(items)

        def lookup_tensor(self, index):
            return self.state_dict[index.fqn]

    return BoxPlanner()


def layouts(n: int, load_ranks: int) -> dict:
    """Per layout, each simulated rank's box ``(offsets, sizes)`` of every tensor."""
    cols = n // load_ranks
    half = n // 2
    return {
        f"Shard(1) x{load_ranks}": [((0, r * cols), (n, cols)) for r in range(load_ranks)],
        "2-D blocks 2x2": [((i * half, j * half), (half, half)) for i in range(2) for j in range(2)],
    }


def run_layout(make_reader, boxes, tensors, fulls):
    import torch
    import torch.distributed.checkpoint as dcp

    needed = read = 0
    seconds = 0.0
    for offsets, sizes in boxes:
        state = {f"w{i}": torch.empty(sizes) for i in range(tensors)}
        reader = make_reader()
        t0 = time.perf_counter()
        dcp.load(state, storage_reader=reader, planner=box_planner({k: (offsets, sizes) for k in state}), no_dist=True)
        seconds += time.perf_counter() - t0
        for i in range(tensors):
            want = fulls[i][offsets[0] : offsets[0] + sizes[0], offsets[1] : offsets[1] + sizes[1]]
            assert torch.equal(state[f"w{i}"], want), f"w{i} differs in box {offsets}+{sizes}"
        needed += sum(v.numel() * v.element_size() for v in state.values())
        read += reader.bytes_read
    return needed, read, seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    bc.add_common_args(ap, "2 tensors of 16 MiB", "load repetitions, best kept (default 3, --quick 1)")
    ap.add_argument("--mib", type=int, default=64, help="MiB per square fp32 tensor (default 64: 4096 x 4096)")
    ap.add_argument("--tensors", type=int, default=8)
    ap.add_argument("--save-ranks", type=int, default=2)
    ap.add_argument("--load-ranks", type=int, default=2)
    ap.add_argument("--windows", default="8388608,4096",
                    help="write windows (checksum segment sizes) to save ours with, comma-separated bytes")
    args = ap.parse_args()
    if args.quick:
        args.mib, args.tensors = 16, 2
    reps = args.reps or (1 if args.quick else 3)
    n = int((args.mib << 20) // 4) ** 0.5
    n = int(n) // 64 * 64
    windows = [int(w) for w in args.windows.split(",")]

    import torch.multiprocessing as mp

    from dcp_datastates import DataStatesReader

    base, root, created = bc.make_scratch(args.dir, "reshard_reads_")
    report = {"machine": bc.machine_info(root), "n": n, "tensors": args.tensors, "save_ranks": args.save_ranks,
              "load_ranks": args.load_ranks, "rows": []}
    try:
        t0 = time.perf_counter()
        mp.start_processes(_save_rank, args=(args.save_ranks, bc.free_port(), root, args.tensors, n, windows),
                           nprocs=args.save_ranks, start_method="spawn")
        print(f"saved {args.tensors} x {n}x{n} fp32 as Shard(0) on {args.save_ranks} ranks in {root} "
              f"({bc.filesystem_type(root)}) in {time.perf_counter() - t0:.1f} s")
        fulls = [full_tensor(i, n) for i in range(args.tensors)]
        readers = {}
        for w in windows:
            p = os.path.join(root, f"ours_{w}")
            readers[f"ours, {w >> 10} KiB segments"] = (lambda p=p: DataStatesReader(p))
        readers["ours, verify=False"] = lambda p=os.path.join(root, f"ours_{windows[0]}"): DataStatesReader(p, verify=False)
        readers["DCP FileSystemReader"] = lambda p=os.path.join(root, "dcp"): counting_reader(p)
        print(f"{'layout':<16} {'reader':<28} {'needed MiB':>10} {'read MiB':>10} {'ampl.':>6} {'seconds':>8}")
        for layout, boxes in layouts(n, args.load_ranks).items():
            for name, make in readers.items():
                best = None
                for _ in range(reps):
                    needed, read, seconds = run_layout(make, boxes, args.tensors, fulls)
                    best = seconds if best is None else min(best, seconds)
                row = {"layout": layout, "reader": name, "needed": needed, "read": read,
                       "amplification": read / needed, "seconds": best}
                report["rows"].append(row)
                print(f"{layout:<16} {name:<28} {needed / 2**20:>10.1f} {read / 2**20:>10.1f} "
                      f"{read / needed:>6.2f} {best:>8.3f}", flush=True)
    finally:
        bc.remove_scratch(base, root, created)
    if args.json:
        bc.write_json(args.json, report)


if __name__ == "__main__":
    main()
