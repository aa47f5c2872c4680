"""Gloo rank cases of tests/test_stock_dcp.py, launched by ``dist_helpers.run_ranks``: the mixed
DTensor state of ``dist_helpers`` saved by DCP's stock ``FileSystemWriter`` (optionally through
stream transforms), for our reader to load on other world sizes with ``dist_helpers``' cases."""

from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import dist_helpers as dh  # noqa: E402

CASES = dh.WorkerCases(__file__, dh.CASES)  # the load cases (load_resharded, ...) with ours
case = CASES.case


@case
def save_dtensor_state_stock(rank, world_size, path, transforms=()):
    """DCP's FileSystemWriter, the state of dist_helpers.dtensor_state; ``transforms``: names of
    the stream transforms (``"zstd"``, ``"rot13"``), applied in that order."""
    import torch.distributed.checkpoint as dcp
    from stream_transforms import Rot13Bytes

    from dcp_datastates._dcp_compat import zstandard_extension_class

    make = {"zstd": lambda: zstandard_extension_class()(), "rot13": Rot13Bytes}
    extensions = [make[name]() for name in transforms]
    state = dh.dtensor_state(dh._mesh(world_size), zeros=False)
    dcp.save(state, storage_writer=dcp.FileSystemWriter(path, _extensions=extensions or None))


@case
def save_dtensor_state_transformed(rank, world_size, path):
    """Ours, every rank through the same DCP stream transform (format 9), loaded back at once."""
    import torch.distributed.checkpoint as dcp
    from stream_transforms import Rot13Bytes, registry

    from dcp_datastates import DataStatesReader, DataStatesWriter

    mesh = dh._mesh(world_size)
    dcp.save(dh.dtensor_state(mesh, zeros=False), storage_writer=DataStatesWriter(path, _extensions=[Rot13Bytes()]))
    state = dh.dtensor_state(mesh, zeros=True)
    dcp.load(state, storage_reader=DataStatesReader(path, _extension_registry=registry()))
    dh.assert_equal_exact(state, dh.reference_state())


run_ranks = CASES.run_ranks


if __name__ == "__main__":
    CASES.main()
