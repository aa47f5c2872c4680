"""Real checkpoints for the command-line tests, made once per test session.

``conftest.py`` exposes each as a session fixture; every value returned is
a plain dataclass so tests compare tool output against the exact tensors
that were saved.

* :func:`make_sharded` -- 2 gloo ranks save ``dist_helpers``' DTensor state
  (Shard(0), Shard(1), Replicate, an empty shard) with ``DataStatesWriter``:
  every tensor's chunks are the shards, so tools must assemble them.
* :func:`make_dtypes` -- one process, every dtype torch has (bfloat16, the
  float8 variants, complex, bool, unsigned), 0-d, empty and non-contiguous
  tensors, nested containers and plain objects; saved ours and stock DCP.
* :func:`make_run` -- three checkpoints of one small training run (steps
  10, 20, 30) in ``step_<N>`` directories of one root, the way
  ``CheckpointManager`` lays them out.

:func:`run_cli` runs a command line in the test's process (``cli.run``), and
:func:`run_program` as the user does (``python -m dcp_datastates``, a new
interpreter): both return a ``CompletedProcess``.
"""

from __future__ import annotations

import dataclasses
import io
import os
import subprocess
import sys

import torch
import torch.distributed.checkpoint as dcp

from dcp_datastates import DataStatesWriter
from dcp_datastates.tools import cli

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)


def run_cli(*argv) -> subprocess.CompletedProcess:
    """One command line through ``cli.run`` in this process: its exit status and output."""
    out, err = io.StringIO(), io.StringIO()
    rc = cli.run([str(a) for a in argv], stdout=out, stderr=err)
    return subprocess.CompletedProcess(["dcp-datastates", *argv], rc, out.getvalue(), err.getvalue())


def run_program(*argv, timeout: float = 300) -> subprocess.CompletedProcess:
    """One ``python -m dcp_datastates ARGV`` process (the entry point with its heap settings)."""
    return subprocess.run([sys.executable, "-m", "dcp_datastates", *map(str, argv)],
                          capture_output=True, text=True, timeout=timeout)


@dataclasses.dataclass
class SavedCheckpoint:
    path: str
    tensors: dict  # flattened key ("model.w") -> the full tensor that was saved
    objects: dict  # flattened key -> the Python object that was saved


@dataclasses.dataclass
class SavedRun:
    root: str
    steps: list  # [10, 20, 30]
    checkpoints: list  # SavedCheckpoint per step, same order


def flatten(d):
    """Keys as DCP flattens them ("model.w", "optim.param_groups.0.lr")."""
    from dcp_datastates._dcp_compat import flatten_state_dict

    return flatten_state_dict(d)


def _split(flat):
    tensors = {k: v for k, v in flat.items() if isinstance(v, torch.Tensor)}
    objects = {k: v for k, v in flat.items() if not isinstance(v, torch.Tensor)}
    return tensors, objects


def make_sharded(base: str) -> SavedCheckpoint:
    """2-rank DTensor checkpoint (ours), and the full tensors it holds."""
    import dist_helpers

    path = os.path.join(base, "sharded")
    os.makedirs(base, exist_ok=True)
    dist_helpers.run_ranks(
        "save_dtensor_state", 2, os.path.join(base, "logs"),
        default_path=path, planner_path=os.path.join(base, "sharded_planner"),
    )
    tensors = {k: v.contiguous() for k, v in dist_helpers.reference_tensors().items()}
    _, objects = _split(flatten(dict(dist_helpers.OBJECTS)))
    return SavedCheckpoint(path, tensors, objects)


def dtype_state() -> dict:
    g = torch.Generator().manual_seed(1234)

    def bits(shape, dtype):
        n = max(1, int(torch.tensor(shape).prod().item()) if shape else 1)
        raw = torch.randint(0, 256, (n * dtype.itemsize,), generator=g, dtype=torch.uint8)
        return raw.view(dtype)[: (int(torch.tensor(shape).prod().item()) if shape else 1)].reshape(shape)

    floats = {
        name: torch.randn(17, 9, generator=g).to(dt)
        for name, dt in [("f64", torch.float64), ("f32", torch.float32), ("f16", torch.float16),
                         ("bf16", torch.bfloat16)]
    }
    eight = {
        name: bits((33, 5), dt)
        for name, dt in [("e4m3fn", torch.float8_e4m3fn), ("e5m2", torch.float8_e5m2),
                         ("e4m3fnuz", torch.float8_e4m3fnuz), ("e5m2fnuz", torch.float8_e5m2fnuz)]
    }
    ints = {
        "i8": torch.randint(-128, 128, (40,), generator=g, dtype=torch.int8),
        "i16": torch.randint(-(2**15), 2**15, (40,), generator=g, dtype=torch.int16),
        "i32": torch.randint(-(2**31), 2**31, (40,), generator=g, dtype=torch.int32),
        "i64": torch.randint(-(2**62), 2**62, (40,), generator=g, dtype=torch.int64),
        "u8": torch.randint(0, 256, (40,), generator=g, dtype=torch.uint8),
        "u16": bits((40,), torch.uint16),
        "u32": bits((40,), torch.uint32),
        "u64": bits((40,), torch.uint64),
        "bool": torch.randint(0, 2, (6, 7), generator=g).bool(),
    }
    cplx = {
        "c64": torch.randn(5, 3, generator=g, dtype=torch.complex64),
        "c128": torch.randn(4, generator=g, dtype=torch.complex128),
        "c32": torch.randn(6, generator=g, dtype=torch.complex64).to(torch.complex32),
    }
    wide = torch.randn(300, 2000, generator=g)  # 2.4 MB: several blocks at small block sizes
    shapes = {
        "scalar": torch.tensor(2.5),
        "empty": torch.empty(0, 4),
        "transposed": torch.randn(8, 6, generator=g).t(),  # non-contiguous
        "wide": wide,
    }
    return {
        "model": {"float": floats, "float8": eight, "int": ints, "complex": cplx, "shape": shapes},
        "step": 42,
        "meta": {"name": "dtype-run", "lr": 0.125, "tags": ["a", "b"]},
    }


def make_dtypes(base: str) -> tuple[SavedCheckpoint, SavedCheckpoint]:
    """The every-dtype state saved ours and with DCP's stock FileSystemWriter."""
    state = dtype_state()
    ours = os.path.join(base, "dtypes_ours")
    stock = os.path.join(base, "dtypes_dcp")
    dcp.save(state, storage_writer=DataStatesWriter(ours), no_dist=True)
    dcp.save(state, storage_writer=dcp.FileSystemWriter(stock), no_dist=True)
    tensors, objects = _split(flatten(state))
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    return SavedCheckpoint(ours, tensors, objects), SavedCheckpoint(stock, dict(tensors), dict(objects))


def make_run(base: str) -> SavedRun:
    """Three checkpoints of a small MLP + AdamW run, in step directories of one root."""
    root = os.path.join(base, "run")
    torch.manual_seed(7)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    from torch.distributed.checkpoint.state_dict import get_state_dict

    steps, ckpts = [10, 20, 30], []
    step = 0
    for target in steps:
        while step < target:
            x = torch.randn(8, 16)
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            step += 1
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd, "step": step}
        path = os.path.join(root, f"step_{step:08d}")
        dcp.save(state, storage_writer=DataStatesWriter(path), no_dist=True)
        tensors, objects = _split(flatten(state))
        ckpts.append(SavedCheckpoint(path, {k: v.detach().clone() for k, v in tensors.items()}, objects))
    return SavedRun(root, steps, ckpts)
