"""Stock DCP checkpoints (``FileSystemWriter``'s) read by our reader, through its store.

A user switching to dcp_datastates keeps older checkpoints written by DCP's
``FileSystemWriter``: ``.metadata`` maps every item's ``MetadataIndex`` to a
``_StorageInfo`` (file, offset, length, and the descriptors of the stream
transforms the item went through), and each item's bytes are one
``torch.save`` record. :class:`DataStatesReader` loads them, resharded by
DCP's planner like ours, and the tools read them through the same reader:
this module is the one place that knows that layout. Each item's byte range
is a :class:`~dcp_datastates.storage.RangeRead` of the load's read batch (a
directory's or an object store's), undone through DCP's extension registry
as ``FileSystemReader`` does, then decoded with ``torch.load(weights_only=True)``
(tensors) or the safe-mode object check. Stock DCP records no checksums:
nothing is verified but the records' own structure.
"""

from __future__ import annotations

import io
import re
from typing import Any, Callable, Protocol

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlanner, ReadItem

from dcp_datastates import _dcp_compat
from dcp_datastates.core.compression import transforms
from dcp_datastates.errors import CorruptCheckpointError
from dcp_datastates.format.checkpoint_layout import show
from dcp_datastates.format.safe_objects import plain_object_stream

# FileSystemWriter names its files ``__<rank>_<n>.distcp``; any plain name in the checkpoint's
# own directory is accepted, none that could leave it.
_FILE_NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]*")


def stock_storage(storage_data, where: str) -> dict[MetadataIndex, Any]:
    """``storage_data`` of a stock DCP ``.metadata``, checked: every key a ``MetadataIndex``,
    every value a ``_StorageInfo`` of a plain file name in the checkpoint's directory, a range,
    and a list of transform descriptors. Anything else is a :class:`CorruptCheckpointError`
    naming ``where`` (neither our layout nor a stock checkpoint's)."""
    info_class = _dcp_compat.storage_info_class()
    if not isinstance(storage_data, dict):
        raise CorruptCheckpointError(
            f"{where}: storage data is a {type(storage_data).__name__}; neither a dcp_datastates nor a stock DCP checkpoint"
        )
    for index, info in storage_data.items():
        if type(index) is not MetadataIndex or not isinstance(index.fqn, str):
            raise CorruptCheckpointError(f"{where}: storage data key {show(index)} is not a MetadataIndex")
        if info_class is None or type(info) is not info_class:
            raise CorruptCheckpointError(f"{where}: {index.fqn!r} is stored as a {type(info).__name__}, not a _StorageInfo")
        name, offset, length = (getattr(info, f, None) for f in ("relative_path", "offset", "length"))
        if not (isinstance(name, str) and _FILE_NAME_RE.fullmatch(name) and name not in (".", "..")):
            raise CorruptCheckpointError(f"{where}: {index.fqn!r} is stored in {show(name)}, not a file of the checkpoint")
        if not all(type(x) is int and 0 <= x < 1 << 63 for x in (offset, length)):
            raise CorruptCheckpointError(f"{where}: {index.fqn!r} has the byte range {show((offset, length))}")
        descriptors = getattr(info, "transform_descriptors", None)
        if descriptors is not None and not (
            isinstance(descriptors, (list, tuple)) and all(isinstance(d, str) for d in descriptors)
        ):
            raise CorruptCheckpointError(f"{where}: {index.fqn!r} has transform descriptors {show(descriptors)}")
    return storage_data


def transform_chains(storage_data: dict, registry, where: str) -> dict[tuple, list]:
    """``{descriptors: DCP extensions that undo them}`` for every distinct chain the items name,
    through ``registry`` (DCP's ``ExtensionRegistry``); a chain it cannot build is an
    ``UnsupportedFormatError`` naming the extension."""
    chains: dict[tuple, list] = {}
    for info in storage_data.values():
        descriptors = tuple(info.transform_descriptors or ())
        if descriptors not in chains:
            chains[descriptors] = transforms.extensions_for(descriptors, registry, where)
    return chains


class StockBatch(Protocol):
    """What a stock record's reads need of the load's batch (:class:`read_batch.ReadBatch`)."""

    reader: Any  # its read_batch.ReadContext: ``stock``, ``stock_chains``, ``location``, ``where``, ``allow_pickle``
    shared: dict  # the stock records it reads, by (file, offset): each read once

    def request_unverified(self, key: str, name: str, offset: int, buf: bytearray) -> None: ...

    def then(self, step: Callable[[], None]) -> None: ...


def add_stock_item(batch: StockBatch, item: ReadItem, planner: LoadPlanner) -> None:
    """Queue on ``batch`` the read of the stock record ``item`` needs (once per record and batch),
    and after it the item's decoding, narrowing and commit."""
    reader = batch.reader
    index = item.storage_index
    info = reader.stock.get(index)
    if info is None:
        raise CorruptCheckpointError(f"{reader.location}: metadata has no stored location for {index.fqn!r}")
    record = batch.shared.get((info.relative_path, info.offset))
    if record is None:
        buf = bytearray(info.length)
        batch.request_unverified(index.fqn, info.relative_path, info.offset, buf)
        record = batch.shared[(info.relative_path, info.offset)] = _Record(buf, info, reader.where(info.relative_path))
    chain = reader.stock_chains[tuple(info.transform_descriptors or ())]
    if item.type == LoadItemType.BYTE_IO:
        allow = reader.allow_pickle

        def load_object() -> None:
            blob = record.raw(chain)
            stream = io.BytesIO(blob) if allow else plain_object_stream(blob, index.fqn, record.where, map_location=None)
            planner.load_bytes(item, stream)

        batch.then(load_object)
        return

    def load_tensor() -> None:
        tensor = record.tensor(chain, index.fqn)
        for dim, (start, length) in enumerate(zip(item.storage_offsets, item.lengths)):
            if dim >= tensor.dim() or start + length > tensor.shape[dim]:
                raise CorruptCheckpointError(
                    f"{record.where}: {index.fqn!r} is stored with shape {tuple(tensor.shape)}, which has no box "
                    f"{tuple(item.storage_offsets)}+{tuple(item.lengths)}"
                )
            tensor = tensor.narrow(dim, start, length)
        target = planner.resolve_tensor(item).detach()
        if target.shape != tensor.shape:
            raise CorruptCheckpointError(
                f"{index.fqn!r}: destination shape {tuple(target.shape)} does not match the stored box {tuple(tensor.shape)}"
            )
        target.copy_(tensor)
        planner.commit_tensor(item, target)

    batch.then(load_tensor)


class _Record:
    """One stored ``torch.save`` record of a stock checkpoint, read once per batch and decoded
    once however many items of the load need part of it."""

    def __init__(self, buf: bytearray, info, where: str) -> None:
        self.buf, self.info, self.where = buf, info, where
        self._tensor: torch.Tensor | None = None

    def raw(self, chain: list) -> bytes | bytearray:
        """The record's bytes with its stream transforms undone."""
        if not chain:
            return self.buf
        span = f"{self.where} (bytes {self.info.offset}..{self.info.offset + self.info.length})"
        return transforms.undo(chain, self.buf, span)

    def tensor(self, chain: list, fqn: str) -> torch.Tensor:
        if self._tensor is None:
            try:
                value = torch.load(io.BytesIO(self.raw(chain)), map_location="cpu", weights_only=True)
            except CorruptCheckpointError:
                raise
            except Exception as exc:  # noqa: BLE001 - torch.load raises many kinds; one error names the record
                raise CorruptCheckpointError(f"{self.where}: the record of {fqn!r} is not a saved tensor: {exc}") from exc
            if not isinstance(value, torch.Tensor):
                raise CorruptCheckpointError(f"{self.where}: the record of {fqn!r} holds a {type(value).__name__}, not a tensor")
            self._tensor = value
        return self._tensor
