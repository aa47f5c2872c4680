"""Gloo rank cases of tests/test_exchange.py and tests/test_read_once.py (the exchange: read-once
rounds, file copies between ranks, a peer dying, and read-once DCP loads), launched by
``dist_helpers.run_ranks`` with this file as the worker script.

Each case writes what the test checks beyond its own assertions (bytes read, errors) to
``<out>/rank<R>.json``.
"""

from __future__ import annotations

import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import dist_helpers as dh  # noqa: E402

CASES = dh.WorkerCases(__file__)
case = CASES.case
SEG = 4096


def _report(out: str, rank: int, **fields) -> None:
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(fields, f)


def _checks(data: bytes, offset: int, nbytes: int):
    from dcp_datastates.native.engine import crc32c

    return [(a - offset, SEG, crc32c(data[a:a + SEG])) for a in range(offset, offset + nbytes, SEG)]


@case
def read_rounds(rank, world_size, root, out):
    """Ranks with different numbers of rounds, overlapping reads (replicated, neighbouring,
    one rank reading nothing): every read bit-exact, each byte of a round read once."""
    import numpy as np
    import torch

    from dcp_datastates.exchange import Channel
    from dcp_datastates.exchange.reads import ReadSession
    from dcp_datastates.storage.local import LocalStore
    from dcp_datastates.storage.store import RangeRead

    channel = Channel.create(timeout_s=30, chunk_bytes=48 << 10, window=3)
    store = LocalStore(root)
    data = open(os.path.join(root, "f.data"), "rb").read()
    session = ReadSession(channel)
    rng = np.random.default_rng(rank)
    rounds = rank + 1
    for k in range(rounds):
        spans = [(0, len(data))] if rank == 0 and k == 0 else []  # everything, once, by rank 0
        spans += [(SEG * int(rng.integers(0, 200)), SEG * int(rng.integers(1, 40))) for _ in range(3 if rank != 2 else 0)]
        spans = [(o, min(n, len(data) - o)) for o, n in spans]
        bufs = [torch.zeros(n, dtype=torch.uint8) for _o, n in spans]
        reads = [RangeRead("f.data", o, n, b.data_ptr(), checks=_checks(data, o, n)) for (o, n), b in zip(spans, bufs)]
        failures = session.read(store, reads, last=k == rounds - 1)
        assert not failures, failures
        for (o, n), b in zip(spans, bufs):
            assert bytes(b.numpy()) == data[o:o + n], (rank, k, o, n)
    session.finish(store)
    _report(out, rank, read=session.bytes_read, received=session.bytes_received, rounds=session.rounds)


def _checkpoint_files(path: str):
    from dcp_datastates import DataStatesReader

    reader = DataStatesReader(path)
    reader.load_metadata()
    return reader.require_layout().own_ranks


@case
def copy_files(rank, world_size, root, out, mode="ok"):
    """Each rank's files of a checkpoint to the next rank, ``.metadata`` held: bit-exact, or
    (``damage``) a damaged source refused by name, or (``flip``) bytes damaged in flight refused
    on arrival; nothing refused is published."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from dcp_datastates import DataStatesWriter
    from dcp_datastates.exchange import Channel, faults
    from dcp_datastates.exchange.files import FileCopy, copy_files
    from dcp_datastates.storage.local import LocalStore

    channel = Channel.create(timeout_s=30, chunk_bytes=256 << 10)
    step = os.path.join(root, "src", "step_1")
    dcp.save({f"t{rank}": torch.randn(100000), "x": torch.randn(10)}, storage_writer=DataStatesWriter(step))
    ranks = _checkpoint_files(step)
    copies = [FileCopy(f.rank, (f.rank + 1) % world_size, n, os.path.getsize(os.path.join(step, n)), f)
              for f in ranks for n in f.file_names()]
    copies.append(FileCopy(0, 1, ".metadata", os.path.getsize(os.path.join(step, ".metadata")), None, hold=True))
    src, dst = LocalStore(os.path.join(root, "src")), LocalStore(os.path.join(root, f"dst{rank}"))
    if mode == "flip" and rank == 2:
        faults.corrupt_sends(1)
    if mode == "damage" and rank == 3:
        p = os.path.join(step, ranks[3].data_file)
        b = bytearray(open(p, "rb").read())
        b[100] ^= 1
        open(p, "wb").write(b)
    dist.barrier()
    outcomes = copy_files(channel, copies, source=lambda c: (src, "step_1/" + c.name),
                          dest=lambda c: (dst, "step_1/" + c.name))
    for c, o in zip(copies, outcomes):
        landed = os.path.join(root, f"dst{c.dst}", "step_1", c.name)
        if c.dst == rank and o.ok and not c.hold:
            assert open(landed, "rb").read() == open(os.path.join(step, c.name), "rb").read(), c.name
        if c.dst == rank and (not o.ok or c.hold):
            assert not os.path.exists(landed), f"{landed} was published"
        if c.dst == rank and c.hold and o.ok:
            assert o.data == open(os.path.join(step, ".metadata"), "rb").read()
    _report(out, rank, outcomes=[[c.src, c.dst, c.name, o.error] for c, o in zip(copies, outcomes)])


@case
def peer_dies(rank, world_size, root, out, timeout_s=5.0):
    """Rank 1 dies after the first message of a file it receives: rank 0's copy fails with an
    ExchangeError within the timeout, and nothing was published on rank 1's side."""
    import torch.distributed as dist

    from dcp_datastates.exchange import Channel, ExchangeError
    from dcp_datastates.exchange.files import FileCopy, copy_files
    from dcp_datastates.storage.local import LocalStore

    channel = Channel.create(timeout_s=timeout_s, chunk_bytes=64 << 10, window=2)
    size = 8 << 20
    if rank == 0:
        with open(os.path.join(root, "big"), "wb") as f:
            f.write(os.urandom(size))
    dist.barrier()
    src, dst = LocalStore(root), LocalStore(os.path.join(root, "dst"))
    staged = dst.open_staged

    def dying(key):
        handle = staged(key)
        write = handle.write

        def once(data):
            write(data)
            os._exit(0)  # as a SIGKILLed node: no goodbye to the peers

        handle.write = once
        return handle

    dst.open_staged = dying
    t0 = time.monotonic()
    try:
        copy_files(channel, [FileCopy(0, 1, "big", size)], source=lambda c: (src, c.name), dest=lambda c: (dst, c.name))
    except ExchangeError as exc:
        _report(out, rank, seconds=time.monotonic() - t0, error=str(exc), broken=channel.broken)
        sys.stdout.flush()
        os._exit(0)  # the group is gone with its peer: no barrier to wait in
    raise AssertionError("the copy to a dead peer did not fail")


# -- read-once DCP loads ---------------------------------------------------------------


def _replicated(step: int = 0):
    import torch

    g = torch.Generator().manual_seed(7 + step)
    state = {f"layer{i}.w": torch.randn(512, 96 + i, generator=g) for i in range(12)}
    state["embed"] = torch.randn(4096, 256, generator=g)  # 4 MiB: split between readers
    state["tiny"] = torch.randn(3, generator=g)
    state["epoch"] = 3
    return state


def _zeros(state):
    import torch

    return {k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0) for k, v in state.items()}


def _hsdp(mesh, zeros=False):
    import torch
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    g = torch.Generator().manual_seed(11)
    out = {}
    for i in range(6):
        full = torch.randn(1024, 160 + i, generator=g)
        out[f"h{i}"] = distribute_tensor(torch.zeros_like(full) if zeros else full, mesh, [Replicate(), Shard(0)])
    return out


def _load_and_report(state, make_target, path, out, rank, check):
    """Load three times: reading once whatever the bytes shared ("once": these states are far
    below the default threshold), with every rank reading what it needs ("every"), and with the
    defaults ("default"); report each."""
    import torch.distributed.checkpoint as dcp

    from dcp_datastates import DataStatesReader

    got = {}
    for variant, options in (("once", dict(read_once_min_bytes=0)), ("every", dict(read_once=False)), ("default", {})):
        reader = DataStatesReader(path, **options)
        target = make_target()
        t0 = time.perf_counter()
        dcp.load(target, storage_reader=reader)
        seconds = time.perf_counter() - t0
        check(target, state)
        got[variant] = dict(read=reader.bytes_read, received=reader.bytes_received, needed=reader.bytes_needed,
                            seconds=seconds)
    _report(out, rank, **got)


def _same(target, state):
    import torch
    from torch.distributed.tensor import DTensor

    for k, v in state.items():
        got = target[k]
        if isinstance(v, DTensor):
            assert torch.equal(got.to_local(), v.to_local()), k
        elif isinstance(v, torch.Tensor):
            assert torch.equal(got, v), k
        else:
            assert got == v, (k, got, v)


@case
def ddp_save(rank, world_size, path):
    """Every rank holds the same state (DDP): DCP saves each item once, spread over the ranks."""
    import torch.distributed.checkpoint as dcp

    from dcp_datastates import DataStatesWriter

    dcp.save(_replicated(), storage_writer=DataStatesWriter(path))


@case
def ddp_load(rank, world_size, path, out):
    state = _replicated()
    _load_and_report(state, lambda: _zeros(state), path, out, rank, _same)


@case
def hsdp_save_load(rank, world_size, path, out):
    """2 shards x 4 replicas on 8 ranks: each saved shard wanted by its 4 replicas."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    from dcp_datastates import DataStatesWriter

    mesh = init_device_mesh("cpu", (world_size // 2, 2), mesh_dim_names=("replicate", "shard"))
    dcp.save(_hsdp(mesh), storage_writer=DataStatesWriter(path))
    dist.barrier()
    _load_and_report(_hsdp(mesh), lambda: _hsdp(mesh, zeros=True), path, out, rank, _same)


@case
def reshard_load(rank, world_size, path, out):
    """dist_helpers' DTensor state saved on 2 ranks, loaded here as Shard(1) (every tensor that
    has a second dimension), reading once and not."""
    mesh = dh._mesh(world_size)
    codes = {k: f"S{min(1, t.dim() - 1)}" for k, t in dh.reference_tensors().items() if t.dim() >= 1}
    _load_and_report(dh.reference_state(), lambda: dh.dtensor_state(mesh, zeros=True, placements=codes), path, out,
                     rank, dh.assert_equal_exact)


@case
def ddp_load_fails(rank, world_size, path, out, flip_rank=2, damage=""):
    """Two loads whose bytes are damaged: ``flip_rank``'s sends on the way, then (rank 0 flips
    a byte of it) the file ``damage``. Every rank raises each time; what each said is reported."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from dcp_datastates import DataStatesReader
    from dcp_datastates.exchange import faults

    state = _replicated()
    said = {}
    for where in ("in flight", "source"):
        if where == "source" and rank == 0:
            blob = bytearray(open(damage, "rb").read())
            blob[len(blob) // 3] ^= 0x10
            open(damage, "wb").write(blob)
        dist.barrier()
        if where == "in flight" and rank == flip_rank:
            faults.corrupt_sends(1000)
        try:
            dcp.load(_zeros(state), storage_reader=DataStatesReader(path, read_once_min_bytes=0))
            said[where] = None
        except BaseException as exc:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
            inner = dh.unwrap_checkpoint_exception(exc)
            said[where] = f"{type(inner).__name__}: {inner}"
        finally:
            faults.corrupt_sends(0)
    _report(out, rank, **said)


if __name__ == "__main__":
    CASES.main()
