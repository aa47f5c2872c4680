"""State providers: turn each kind of saved state into byte regions for the engine.

The engine moves bytes from host pointers to file offsets and knows nothing
about torch. A provider per kind of state produces those bytes:

- host tensors (contiguous, CPU): their own memory, zero-copy; the engine's
  stager copies them into the pool;
- strided tensors (non-contiguous views, e.g. transposes or DTensor shards
  of a non-leading dim): made contiguous here, inside the pipeline;
- device tensors (CUDA and others): copied to host memory first;
- DTensor and sharded tensors: DCP's planner already resolves them to the
  local shard of the chunk being saved; a DTensor that reaches us whole is
  reduced to its local tensor;
- Python objects (BYTE_IO items): DCP's planner serializes them; their bytes
  are appended after the tensors while the engine writes.

Every provided region is checked against what the plan promised (dtype,
shape, byte count), so a state dict that changed between planning and
writing fails with the key named instead of writing the wrong bytes.
"""

from __future__ import annotations

import dataclasses
import io
from typing import Any

import torch
from torch.distributed.checkpoint.planner import WriteItem

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover - torch builds without distributed
    DTensor = None  # type: ignore[assignment]


@dataclasses.dataclass
class ProvidedBytes:
    """Host bytes ready for the engine; ``keep`` must outlive the write."""

    pointer: int
    nbytes: int
    keep: Any


def provide_tensor(item: WriteItem, value: Any, expected_nbytes: int) -> ProvidedBytes:
    key = item.index.fqn
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"state dict entry {key!r} was planned as a tensor but resolved to {type(value).__name__}")
    tensor = value
    if DTensor is not None and isinstance(tensor, DTensor):
        tensor = tensor.to_local()
    if tensor.layout != torch.strided:
        raise TypeError(f"state dict entry {key!r} has layout {tensor.layout}; only strided tensors can be saved")
    if tensor.device.type != "cpu":
        tensor = tensor.detach().to("cpu")  # device provider: a host copy the engine can read
    if not tensor.is_contiguous():
        tensor = tensor.detach().contiguous()  # strided provider
    td = item.tensor_data
    assert td is not None
    if tensor.dtype != td.properties.dtype or tensor.shape != td.chunk.sizes:
        raise ValueError(
            f"state dict entry {key!r} changed after planning: planned {td.properties.dtype} "
            f"{tuple(td.chunk.sizes)}, got {tensor.dtype} {tuple(tensor.shape)}"
        )
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes != expected_nbytes:
        raise ValueError(f"state dict entry {key!r}: {nbytes} bytes, planned {expected_nbytes}")
    return ProvidedBytes(tensor.data_ptr(), nbytes, tensor)


def provide_object(item: WriteItem, value: Any) -> bytes:
    """Bytes of a serialized object (DCP's planner hands us a BytesIO)."""
    if isinstance(value, io.BytesIO):
        return value.getvalue()
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    raise TypeError(
        f"state dict entry {item.index.fqn!r} was planned as bytes but resolved to {type(value).__name__}"
    )
