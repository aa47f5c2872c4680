"""Gloo rank cases of tests/test_strided_reads.py: a DTensor saved as Shard(0) on two ranks
(with 4 KiB segments), loaded as Shard(1): each rank's box is a column slice of both chunks."""

from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import dist_helpers as dh  # noqa: E402

CASES = dh.WorkerCases(__file__)
case = CASES.case
SHAPE = (96, 2048)


def _full():
    import torch

    g = torch.Generator().manual_seed(11)
    return {"f32": torch.randn(SHAPE, generator=g), "bf16": torch.randn(SHAPE, generator=g).to(torch.bfloat16)}


def _state(mesh, placement, zeros):
    import torch
    from torch.distributed.tensor import distribute_tensor

    return {k: distribute_tensor(torch.zeros_like(v) if zeros else v, mesh, [placement]) for k, v in _full().items()}


@case
def save_shard0(rank, world_size, path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import Shard

    from dcp_datastates import DataStatesWriter

    state = _state(dh._mesh(world_size), Shard(0), zeros=False)
    dcp.save(state, storage_writer=DataStatesWriter(path, window_bytes=4096, host_cache_bytes=4 << 20))


@case
def load_shard1(rank, world_size, path):
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import Shard

    from dcp_datastates import DataStatesReader

    import torch.distributed as dist

    f32, bf16 = (v.numel() * v.itemsize for v in _full().values())
    cols = SHAPE[1] // world_size
    for read_once in (False, True):
        state = _state(dh._mesh(world_size), Shard(1), zeros=True)
        reader = DataStatesReader(path, read_once=read_once, read_once_min_bytes=0)  # small: shared anyway
        dcp.load(state, storage_reader=reader)
        for k, v in _full().items():
            local = state[k].to_local()
            assert torch.equal(local.view(torch.uint8), v[:, rank * cols : (rank + 1) * cols].contiguous().view(torch.uint8)), k
        assert reader.bytes_needed == (f32 + bf16) // world_size, reader.bytes_needed
        if not read_once:
            # half of every row of both saved chunks: an f32 half row is one 4 KiB segment, read alone;
            # a bf16 half row (2 KiB) shares its segment with the other half, read too to verify it
            assert reader.bytes_read == f32 // world_size + bf16, reader.bytes_read
        else:  # read once: the bf16 segments both ranks need are read by one of them and sent
            total = torch.tensor([reader.bytes_read])
            dist.all_reduce(total)
            assert total.item() == f32 + bf16, total.item()
            assert reader.bytes_received > 0

if __name__ == "__main__":
    CASES.main()
