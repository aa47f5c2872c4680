"""Gloo rank cases of tests/test_compression.py, launched by ``dist_helpers.run_ranks``
with this file as the worker script.

The ranks save ``dist_helpers``' DTensor state (Shard(0), Shard(1), Replicate,
empty shards) compressed, with 4 KiB blocks so that every large shard is
several frames and resharded loads read slices that start and end inside
frames.
"""

from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import dist_helpers as dh  # noqa: E402

CASES = dh.WorkerCases(__file__)
case = CASES.case


def small_blocks() -> None:
    from dcp_datastates.core.compression import codec

    codec.DEFAULT_BLOCK_BYTES = 4096


@case
def save_compressed(rank, world_size, path, asynchronous=False, level=3):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from dcp_datastates import DataStatesWriter

    small_blocks()
    mesh = dh._mesh(world_size)
    state = dh.dtensor_state(mesh, zeros=False)
    writer = DataStatesWriter(path, compression="zstd", compression_level=level)
    if asynchronous:
        group = dist.new_group(backend="gloo")
        resp = dcp.async_save(state, storage_writer=writer, process_group=group)
        resp.staging_completion.result()
        resp.upload_completion.result()
        writer.close()
    else:
        dcp.save(state, storage_writer=writer)
    dh.assert_equal_exact(state, dh.reference_state())


@case
def load_compressed_resharded(rank, world_size, path):
    small_blocks()
    dh.load_resharded(rank, world_size, path)
    dh.load_dtensor_state(rank, world_size, path)


if __name__ == "__main__":
    CASES.main()
