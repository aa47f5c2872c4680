"""The exchange: read-once loads against every rank reading (ours) and DCP's FileSystemReader,
and the exchange's bandwidth between two simulated nodes against the loopback's.

1. ``reads``: 8 gloo ranks on this machine load a DDP-replicated state (every rank holds all
   of it; DCP saves each item once) and an HSDP state (2 shards x 4 replicas): the bytes each
   variant reads from storage (ours: the reader's counters; DCP: a counting wrapper around its
   file system's streams), against the bytes stored, and the load's wall time (slowest rank).
   Variants: ours read once (the default), ours with ``read_once=False``, DCP's
   ``FileSystemReader`` on a checkpoint of ``FileSystemWriter``; on a directory (``--dir``,
   default /dev/shm) and, with ``--s3``, on SeaweedFS on the loopback (ours only), where the
   raw limit is every stored byte fetched once (each rank a share of the files).
2. ``bandwidth``: 2 ranks, one per simulated node (``torchrun --nnodes=2`` on 127.0.0.1): a
   file copied by the exchange from one node's tmpfs root to the other's (checked on both
   ends, fsynced, renamed: :func:`exchange.files.copy_files`), against the raw gloo transfer
   of the same bytes (``isend``/``irecv`` of 8 MiB messages, nothing else) and a plain socket
   on the loopback (the limit).

Variants alternate within each repetition; medians are reported.

    python benchmarks/bench_exchange.py                  # both parts, 256 MiB states, 3 reps
    python benchmarks/bench_exchange.py --quick --s3     # 32 MiB, 1 rep, and the S3 case
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import warnings

warnings.filterwarnings("ignore")

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "tests", "support"))

from bench_common import free_port, median, write_json  # noqa: E402


# -- the ranks ---------------------------------------------------------------------------


def _ddp_state(mib: int, zero: bool = False):
    import torch

    g = torch.Generator().manual_seed(1)
    cols = 1024
    out = {}
    for i in range(32):  # 32 tensors of mib/32 each
        rows = max(1, mib * 2**20 // 32 // (cols * 4))
        t = torch.randn(rows, cols, generator=g)
        out[f"layer{i:02d}.w"] = torch.zeros_like(t) if zero else t
    return out


def _hsdp_state(mib: int, mesh, zero: bool = False):
    import torch
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    g = torch.Generator().manual_seed(2)
    cols = 1024
    out = {}
    for i in range(16):
        rows = max(2, mib * 2**20 // 16 // (cols * 4)) // 2 * 2
        t = torch.randn(rows, cols, generator=g)
        out[f"h{i:02d}"] = distribute_tensor(torch.zeros_like(t) if zero else t, mesh, [Replicate(), Shard(0)])
    return out


class _Counted:
    """A stream that counts the bytes read through it (DCP's reads)."""

    def __init__(self, stream, box) -> None:
        self._s, self._box = stream, box

    def read(self, *a):
        data = self._s.read(*a)
        self._box[0] += len(data)
        return data

    def readinto(self, b):
        n = self._s.readinto(b)
        self._box[0] += n or 0
        return n

    def __getattr__(self, name):
        return getattr(self._s, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._s.close()


def _dcp_reader(path, box):
    import contextlib

    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.filesystem import FileSystem

    class CountingFileSystem(FileSystem):
        @contextlib.contextmanager
        def create_stream(self, p, mode):
            with super().create_stream(p, mode) as s:
                yield _Counted(s, box)

    reader = FileSystemReader(path)
    reader.fs = CountingFileSystem()
    return reader


def _emit(**fields) -> None:
    """A rank's figures, into a file of its own (ranks' output lines interleave under torchrun)."""
    import torch.distributed as dist

    with open(os.path.join(os.environ["BENCH_OUT"], f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump(fields, f)


def worker_reads(argv: list[str]) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    from dcp_datastates import DataStatesReader, DataStatesWriter

    kind, variant, path, mib = argv[0], argv[1], argv[2], int(argv[3])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world // 2, 2)) if kind == "hsdp" else None

    def state(zero=False):
        return _ddp_state(mib, zero) if kind == "ddp" else _hsdp_state(mib, mesh, zero)

    if variant == "save-ours":
        dcp.save(state(), storage_writer=DataStatesWriter(path))
    elif variant == "save-dcp":
        from torch.distributed.checkpoint import FileSystemWriter

        dcp.save(state(), storage_writer=FileSystemWriter(path))
    elif variant == "raw":  # every stored byte fetched once: each rank a share of the files, ranged reads
        from dcp_datastates.storage import open_store

        store = open_store(path)
        names = sorted(k for k in store.list() if k.endswith(".data"))
        dist.barrier()
        t0 = time.perf_counter()
        got = 0
        for name in names[rank::world]:
            size = store.size(name)
            buf = bytearray(size)
            for at in range(0, size, 8 << 20):
                store.read_into(name, at, memoryview(buf)[at:at + (8 << 20)])
            got += size
        dist.barrier()
        _emit(rank=rank, seconds=time.perf_counter() - t0, read=got, received=0)
    else:
        target = state(zero=True)
        box = [0]
        reader = (_dcp_reader(path, box) if variant == "dcp"
                  else DataStatesReader(path, read_once=variant == "once"))
        dist.barrier()
        t0 = time.perf_counter()
        dcp.load(target, storage_reader=reader)
        dist.barrier()
        seconds = time.perf_counter() - t0
        want = state()
        for k, v in want.items():
            a, b = (target[k].to_local(), v.to_local()) if kind == "hsdp" else (target[k], v)
            assert torch.equal(a, b), f"{k} differs after the load ({variant})"
        read = box[0] if variant == "dcp" else reader.bytes_read
        _emit(rank=rank, seconds=seconds, read=read, received=getattr(reader, "bytes_received", 0))
    dist.destroy_process_group()


def _launch(nproc: int, args: list[str], env=None, nnodes: int = 1, timeout: float = 900) -> list[dict]:
    port = free_port()
    procs = []
    out_dir = tempfile.mkdtemp(prefix="bench-exchange-out-")
    env = dict(env or {}, BENCH_OUT=out_dir)
    for node in range(nnodes):
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}", f"--node-rank={node}",
               f"--nproc-per-node={nproc}", "--master-addr=127.0.0.1", f"--master-port={port}",
               os.path.abspath(__file__), "--worker", *args]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                      env=dict(os.environ, OMP_NUM_THREADS="1", **env)))
    try:
        outs = [p.communicate(timeout=timeout)[0] for p in procs]
        for p, out in zip(procs, outs):
            if p.returncode != 0:
                raise RuntimeError(f"{' '.join(args[:2])} failed:\n{out[-5000:]}")
        return [json.load(open(os.path.join(out_dir, f))) for f in sorted(os.listdir(out_dir))]
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)


def _stored(path: str, store=None) -> int:
    if store is not None:
        return sum(store.size(k) for k in store.list() if k.endswith((".data", ".distcp")))
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith((".data", ".distcp")))


def bench_reads(base: str, mib: int, reps: int, s3: dict | None) -> dict:
    res: dict = {}
    places = [("dir", base, None)]
    if s3 is not None:
        places.append(("s3", s3["url"], s3["env"]))
    for where, root, env in places:
        for kind in ("ddp", "hsdp"):
            ours = f"{root}/{kind}-ours" if where == "s3" else os.path.join(root, f"{kind}-ours")
            _launch(8, ["reads", kind, "save-ours", ours, str(mib)], env)
            variants = ["once", "every"]
            dcp_path = None
            if where == "dir":
                dcp_path = os.path.join(root, f"{kind}-dcp")
                _launch(8, ["reads", kind, "save-dcp", dcp_path, str(mib)], env)
                variants.append("dcp")
            else:
                variants.append("raw")
            if where == "s3":
                from dcp_datastates.storage import open_store

                os.environ.update(env)
                stored = {"ours": _stored(ours, open_store(ours))}
            else:
                stored = {"ours": _stored(ours), "dcp": _stored(dcp_path)}
            row = res.setdefault(f"{where}/{kind}", {"stored": stored, **{v: [] for v in variants}})
            for rep in range(reps):
                order = variants[rep % len(variants):] + variants[:rep % len(variants)]
                for v in order:
                    path = dcp_path if v == "dcp" else ours
                    rows = _launch(8, ["reads", kind, v, path, str(mib)], env)
                    got = {"seconds": max(r["seconds"] for r in rows), "read": sum(r["read"] for r in rows),
                           "received": sum(r["received"] for r in rows)}
                    row[v].append(got)
                    ref = stored["dcp" if v == "dcp" else "ours"]
                    print(f"  {where:3s} {kind:4s} {v:5s} rep {rep + 1}: load {got['seconds']:6.2f} s, read "
                          f"{got['read'] / ref:5.2f}x stored, received {got['received'] / ref:5.2f}x", flush=True)
    return res


# -- bandwidth between two simulated nodes ------------------------------------------------


def worker_bandwidth(argv: list[str]) -> None:
    import torch
    import torch.distributed as dist

    from dcp_datastates.exchange import Channel
    from dcp_datastates.exchange.files import FileCopy, copy_files
    from dcp_datastates.storage.local import LocalStore

    base, mib = argv[0], int(argv[1])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    size = mib << 20
    channel = Channel.create(timeout_s=300)
    root = os.path.join(base, f"node{rank}")
    os.makedirs(root, exist_ok=True)
    if rank == 0:
        with open(os.path.join(root, "f"), "wb") as f:
            f.write(os.urandom(size))
    store = LocalStore(root)
    out = {}
    for variant in ("exchange", "gloo"):
        dist.barrier()
        t0 = time.perf_counter()
        if variant == "exchange":
            copy_files(channel, [FileCopy(0, 1, "f", size)], source=lambda c: (store, c.name),
                       dest=lambda c: (store, "g"))
        else:
            buf = torch.empty(8 << 20, dtype=torch.uint8)
            works = []
            for _ in range(size // len(buf)):
                works.append(dist.isend(buf, 1, group=channel.group) if rank == 0 else
                             dist.irecv(buf, 0, group=channel.group))
                if len(works) >= 4:
                    works.pop(0).wait()
            for w in works:
                w.wait()
        dist.barrier()
        out[variant] = size / (time.perf_counter() - t0) / 1e9
        if rank == 1 and variant == "exchange":
            os.unlink(os.path.join(root, "g"))
    if rank == 1:
        _emit(**out)
    dist.destroy_process_group()


def _socket_gbps(size: int) -> float:
    """A plain socket on the loopback between two processes, 8 MiB sends: the transport's limit."""
    srv = socket.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]
    code = ("import socket,sys\nc=socket.create_connection(('127.0.0.1',%d))\nb=bytes(8<<20)\n"
            "for _ in range(%d): c.sendall(b)\nc.recv(1)\n") % (port, size // (8 << 20))
    child = subprocess.Popen([sys.executable, "-c", code])
    conn, _ = srv.accept()
    buf = memoryview(bytearray(8 << 20))
    got = 0
    t0 = time.perf_counter()
    while got < size:
        got += conn.recv_into(buf)
    seconds = time.perf_counter() - t0
    conn.sendall(b"k")
    child.wait()
    conn.close()
    srv.close()
    return size / seconds / 1e9


def bench_bandwidth(base: str, mib: int, reps: int) -> dict:
    res = {"exchange": [], "gloo": [], "socket": []}
    for rep in range(reps):
        root = os.path.join(base, "bw")
        shutil.rmtree(root, ignore_errors=True)
        os.makedirs(root)
        (row,) = _launch(1, ["bandwidth", root, str(mib)], nnodes=2)
        res["exchange"].append(row["exchange"])
        res["gloo"].append(row["gloo"])
        res["socket"].append(_socket_gbps(mib << 20))
        print(f"  bandwidth rep {rep + 1}: exchange {row['exchange']:.2f} GB/s, raw gloo {row['gloo']:.2f} GB/s, "
              f"socket {res['socket'][-1]:.2f} GB/s", flush=True)
        shutil.rmtree(root, ignore_errors=True)
    return res


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        return {"reads": worker_reads, "bandwidth": worker_bandwidth}[sys.argv[2]](sys.argv[3:])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="32 MiB states, 1 rep")
    ap.add_argument("--dir", default="/dev/shm", help="where the checkpoints go (a temporary subdirectory)")
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--mib", type=int, default=None, help="each state's size (default 256, --quick 32)")
    ap.add_argument("--bandwidth-mib", type=int, default=None, help="the file of part 2 (default 1024, --quick 256)")
    ap.add_argument("--s3", action="store_true", help="also load from SeaweedFS on the loopback")
    ap.add_argument("--skip", choices=["reads", "bandwidth"], default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    reps = args.reps or (1 if args.quick else 3)
    mib = args.mib or (32 if args.quick else 256)
    bw_mib = args.bandwidth_mib or (256 if args.quick else 1024)
    base = tempfile.mkdtemp(prefix="bench-exchange-", dir=args.dir)
    report = {"mib": mib, "reps": reps, "cpus": os.cpu_count()}
    print(f"exchange benchmark: 8 gloo ranks, {mib} MiB states, {reps} reps, {os.cpu_count()} CPUs, in {base}", flush=True)
    server = None
    try:
        if args.skip != "bandwidth":
            report["bandwidth"] = bench_bandwidth(base, bw_mib, reps)
        if args.skip != "reads":
            s3 = None
            if args.s3:
                from s3_server import WeedServer

                server = WeedServer(bucket="bench-exchange", port=free_port())
                os.environ.update(server.env())
                server.start()
                s3 = {"url": f"s3://{server.bucket}/x{os.getpid()}", "env": server.env()}
            report["reads"] = bench_reads(base, mib, reps, s3)
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(base, ignore_errors=True)
    print_table(report)
    if args.json:
        write_json(args.json, report)


def print_table(report: dict) -> None:
    bw = report.get("bandwidth")
    if bw:
        e, g, s = (median(bw[k]) for k in ("exchange", "gloo", "socket"))
        print(f"\nbetween two simulated nodes (medians of {len(bw['exchange'])}): exchange copy {e:.2f} GB/s, "
              f"raw gloo {g:.2f} GB/s ({e / g:.2f}x of it), loopback socket {s:.2f} GB/s ({e / s:.2f}x of it)")
    reads = report.get("reads")
    if reads:
        print(f"\n8 ranks, {report['mib']} MiB per state, medians of {report['reps']}")
        print(f"{'state':10s} {'variant':6s} {'load s':>7s} {'read/stored':>12s} {'received/stored':>16s}")
        for name, row in reads.items():
            for v in ("once", "every", "dcp", "raw"):
                if v not in row:
                    continue
                ref = row["stored"]["dcp" if v == "dcp" else "ours"]
                runs = row[v]
                print(f"{name:10s} {v:6s} {median([r['seconds'] for r in runs]):7.2f} "
                      f"{median([r['read'] for r in runs]) / ref:11.2f}x {median([r['received'] for r in runs]) / ref:15.2f}x")
            once = median([r["seconds"] for r in row["once"]])
            every = median([r["seconds"] for r in row["every"]])
            extra = f", DCP / once {median([r['seconds'] for r in row['dcp']]) / once:.2f}x" if "dcp" in row else ""
            raw = f", once / raw {once / median([r['seconds'] for r in row['raw']]):.2f}x" if "raw" in row else ""
            print(f"{name:10s} every / once: {every / once:.2f}x{extra}{raw}")


if __name__ == "__main__":
    main()
