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

from dcp_datastates import _dcp_compat
from dcp_datastates.native.engine import DeviceRegion, HostRegion, Region, StridedRegion, ensure_cuda_runtime


@dataclasses.dataclass
class TensorSource:
    """The bytes of one tensor as the engine will read them.

    ``tensor`` must stay alive until the engine has staged its region (it is
    handed to the engine's ``keep``).
    """

    tensor: torch.Tensor
    nbytes: int
    device: int  # -1 for host memory, else the CUDA device index

    def region(self, offset: int, ready_event: int | None = None) -> Region:
        """The engine's record for these bytes at file ``offset``. CUDA sources need the
        ``cudaEvent_t`` of their device, recorded when the batch is submitted (see
        :func:`finish_regions`): the engine's copy waits for it."""
        t = self.tensor
        if self.device >= 0:
            return DeviceRegion(
                address=t.data_ptr(), nbytes=self.nbytes, file_offset=offset, device=self.device,
                ready_event=ready_event,
            )
        if t.is_contiguous():
            return HostRegion(address=t.data_ptr(), nbytes=self.nbytes, file_offset=offset)
        return StridedRegion(
            address=t.data_ptr(), nbytes=self.nbytes, file_offset=offset, sizes=t.shape, strides=t.stride(),
            itemsize=t.element_size(),
        )


def tensor_source(value: Any, key: str) -> TensorSource:
    if type(value) is torch.Tensor and value.is_cpu and value.layout is torch.strided:
        return TensorSource(value, value.nbytes, -1)  # the commonest case, without the checks below
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"state dict entry {key!r} should be a tensor, got {type(value).__name__}")
    tensor = _dcp_compat.local_shard(value)
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


def finish_regions(sources_and_offsets: list[tuple[TensorSource, int]], events: dict | None = None) -> tuple[list[Region], list]:
    """Engine regions for placed sources, with CUDA ready-events recorded now.

    One event per device, recorded on that device's current stream after
    every ``contiguous()`` above was queued: the engine's side stream waits
    for it, so the copies see every kernel queued before the snapshot.
    ``events`` (device -> event): events recorded earlier, on another thread's
    streams (an incremental snapshot's hashing thread places tensors the
    caller's stream wrote), used instead of recording new ones.
    """
    regions, keep = [], []
    events = dict(events or {})
    for src, offset in sources_and_offsets:
        if src.nbytes == 0:
            continue
        if src.device < 0:
            region = src.region(offset)
        else:
            ev = events.get(src.device)
            if ev is None:
                ensure_cuda_runtime()
                ev = events[src.device] = ready_event(src.device)
                keep.append(ev)
            region = src.region(offset, _dcp_compat.cuda_event_handle(ev))
        regions.append(region)
        keep.append(src.tensor)
    return regions, keep


def ready_event(device: int) -> torch.cuda.Event:
    """An event recorded now on ``device``'s current stream: work that waits for it sees every
    kernel queued there before (the engine's copies, an incremental save's hashing)."""
    with torch.cuda.device(device):
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(device))
    return ev


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
