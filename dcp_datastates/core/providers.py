"""State providers: turn each kind of saved state into byte regions for the engine.

The engine moves bytes from memory to file offsets and knows nothing about
torch. A provider per kind of state describes where those bytes are:

- host tensors, contiguous: their own memory, zero-copy; the engine's stager
  copies them into the host pool;
- host tensors, strided (transposes, slices, DTensor shards of a non-leading
  dim): their sizes and strides, so the engine gathers them run by run
  straight into the pool, with no contiguous copy allocated;
- CUDA tensors: a device region copied by the engine with cudaMemcpyAsync
  on a side stream, after an event recorded on the caller's current stream
  (so kernels already queued that write the tensor finish first); strided
  CUDA tensors are made contiguous on the device first, on that stream;
- tensors on other devices: copied to host memory here (not lazy);
- DTensor: the local shard (DCP's planner resolves chunks to it);
- Python objects (BYTE_IO items): DCP's planner serializes them; their bytes
  are appended after the tensors while the engine writes.
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
class TensorSource:
    """The bytes of one tensor as the engine will read them.

    ``region`` is the engine's region tuple without its CUDA event: CUDA
    sources get the event of their device when the batch is submitted (see
    :func:`finish_regions`). ``keep`` must stay alive until the write ends.
    """

    tensor: torch.Tensor
    nbytes: int
    device: int  # -1 for host memory, else the CUDA device index

    def region(self, offset: int) -> tuple:
        t = self.tensor
        if self.device >= 0:
            return (t.data_ptr(), self.nbytes, offset, self.device)
        if t.is_contiguous():
            return (t.data_ptr(), self.nbytes, offset)
        return (t.data_ptr(), self.nbytes, offset, list(t.shape), list(t.stride()), t.element_size())


def local_tensor(value: torch.Tensor) -> torch.Tensor:
    """The tensor that holds this rank's bytes (a DTensor's local shard)."""
    if DTensor is not None and isinstance(value, DTensor):
        return value._local_tensor
    return value


def tensor_source(value: Any, key: str) -> TensorSource:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"state dict entry {key!r} should be a tensor, got {type(value).__name__}")
    tensor = local_tensor(value)
    if tensor.layout != torch.strided:
        raise TypeError(f"state dict entry {key!r} has layout {tensor.layout}; only strided tensors can be saved")
    device = tensor.device
    if device.type == "meta":
        raise ValueError(f"state dict entry {key!r} is a meta tensor: it has no data to save")
    nbytes = tensor.numel() * tensor.element_size()
    if device.type == "cuda":
        if not tensor.is_contiguous():
            tensor = tensor.detach().contiguous()  # on the device, queued on the current stream
        return TensorSource(tensor, nbytes, device.index if device.index is not None else torch.cuda.current_device())
    if device.type != "cpu":
        tensor = tensor.detach().to("cpu")  # other accelerators: a synchronous host copy
    return TensorSource(tensor, nbytes, -1)


def finish_regions(sources_and_offsets: list[tuple[TensorSource, int]]) -> tuple[list[tuple], list]:
    """Engine regions for placed sources, with CUDA ready-events recorded now.

    One event per device, recorded on that device's current stream after
    every ``contiguous()`` above was queued: the engine's side stream waits
    for it, so the copies see every kernel queued before the snapshot.
    """
    regions, keep, events = [], [], {}
    for src, offset in sources_and_offsets:
        if src.nbytes == 0:
            continue
        region = src.region(offset)
        if src.device >= 0:
            ev = events.get(src.device)
            if ev is None:
                from dcp_datastates.native.engine import ensure_cuda_runtime

                ensure_cuda_runtime()
                with torch.cuda.device(src.device):
                    ev = torch.cuda.Event()
                    ev.record(torch.cuda.current_stream(src.device))
                events[src.device] = ev
                keep.append(ev)
            region = (*region, ev.cuda_event)
        regions.append(region)
        keep.append(src.tensor)
    return regions, keep


def check_planned(item: WriteItem, source: TensorSource, expected_nbytes: int) -> None:
    """Fail with the key named if the tensor no longer matches what was planned."""
    key = item.index.fqn
    td = item.tensor_data
    assert td is not None
    t = source.tensor
    if t.dtype != td.properties.dtype or t.shape != td.chunk.sizes:
        raise ValueError(
            f"state dict entry {key!r} changed after planning: planned {td.properties.dtype} "
            f"{tuple(td.chunk.sizes)}, got {t.dtype} {tuple(t.shape)}"
        )
    if source.nbytes != expected_nbytes:
        raise ValueError(f"state dict entry {key!r}: {source.nbytes} bytes, planned {expected_nbytes}")


def provide_object(item: WriteItem, value: Any) -> bytes:
    """Bytes of a serialized object (DCP's planner hands us a BytesIO)."""
    if isinstance(value, io.BytesIO):
        return value.getvalue()
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    raise TypeError(
        f"state dict entry {item.index.fqn!r} was planned as bytes but resolved to {type(value).__name__}"
    )
