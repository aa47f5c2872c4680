"""Plans whose equal values are one object each, so that DCP's collectives pickle them cheaply.

DCP sends every rank's plan to the coordinator and back (a gather and a scatter of pickles)
and, after a save, broadcasts the global metadata built from the plans. DCP's planners give
every item its own ``TensorProperties`` and its own ``torch.Size`` objects, so pickle writes
each one in full (the properties through their Python ``__getstate__``, and ``__setstate__``
when read). Pickle writes an object it has already written as a reference to it, and reads it
back as one object again, so a plan whose equal properties and sizes are shared pickles in a
fraction of the time, and the metadata the coordinator builds from the plans inherits the
sharing (the metadata's broadcast and its ``.metadata`` file are cheaper too).

The writer and the reader share a plan's values in their ``prepare_local_plan``, after the
planner (and any subclass editing its items) made it; the plan keeps its items' values and
order. A ``TensorProperties`` is mutable: the shared ones are objects of our own, made for
the save (by this pass, or by ``DataStatesSavePlanner`` through the same table), never one of
the caller's (a ``ShardedTensor``'s own properties may be edited later in place). A planner
that edits an item's properties in place after its local plan (in ``create_global_plan``)
edits every equal item's; one that replaces them, as DCP's examples do, is unaffected.
A ``torch.Size`` or a ``MetadataIndex`` cannot change, so the first one seen stands for its
equals.
"""

from __future__ import annotations

import dataclasses
import weakref

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorProperties
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem, SavePlan, TensorWriteData, WriteItem


# Every TensorProperties a table made, by id: one of these may stand for its equals in another
# table (the planner's plan keeps its items when the writer shares its values).
_MADE: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


class SharedValues:
    """One object per distinct value seen: sizes and tensor properties."""

    def __init__(self) -> None:
        self._sizes: dict = {}
        self._properties: dict = {}
        self._zeros: dict = {}

    def size(self, size):
        """The first ``torch.Size`` seen equal to ``size`` (anything else as it is: a tuple
        equal to a size is not one)."""
        if type(size) is not torch.Size:
            return size
        return self._sizes.setdefault(size, size)

    def zeros(self, dims: int) -> torch.Size:
        """The offsets of a whole tensor of ``dims`` dimensions."""
        zeros = self._zeros.get(dims)
        if zeros is None:
            zeros = self._zeros[dims] = self.size(torch.Size([0] * dims))
        return zeros

    def properties(self, properties: TensorProperties) -> TensorProperties:
        """The table's one ``TensorProperties`` equal to ``properties``."""
        p = properties
        return self.properties_for(p.dtype, p.layout, p.requires_grad, p.memory_format, p.pin_memory, p)

    def properties_for(self, dtype, layout, requires_grad, memory_format, pin_memory, seen=None) -> TensorProperties:
        """The table's one ``TensorProperties`` of these fields: ``seen`` if it is the first
        of them and a table made it, else a new one (never a caller's object)."""
        key = (dtype, layout, requires_grad, memory_format, pin_memory)
        shared = self._properties.get(key)
        if shared is None:
            if seen is None or _MADE.get(id(seen)) is not seen:
                seen = TensorProperties(*key)
                _MADE[id(seen)] = seen
            shared = self._properties[key] = seen
        return shared


def shared_save_plan(plan: SavePlan) -> SavePlan:
    """``plan`` with its tensor items' properties and sizes shared (the same items otherwise;
    an item whose values are shared already is kept as it is)."""
    values = SharedValues()
    items = []
    for item in plan.items:
        data = item.tensor_data
        if data is not None:
            chunk = data.chunk
            offsets, sizes = values.size(chunk.offsets), values.size(chunk.sizes)
            properties, size = values.properties(data.properties), values.size(data.size)
            if offsets is not chunk.offsets or sizes is not chunk.sizes:
                chunk = ChunkStorageMetadata(offsets=offsets, sizes=sizes)
            if chunk is not data.chunk or properties is not data.properties or size is not data.size:
                if type(data) is TensorWriteData and type(item) is WriteItem:  # the cheap constructors
                    data = TensorWriteData(chunk=chunk, properties=properties, size=size)
                    item = WriteItem(index=item.index, type=item.type, bytes_io_data=item.bytes_io_data, tensor_data=data)
                else:  # a planner's own subclasses keep their class and fields
                    data = dataclasses.replace(data, chunk=chunk, properties=properties, size=size)
                    item = dataclasses.replace(item, tensor_data=data)
        items.append(item)
    return dataclasses.replace(plan, items=items)


def shared_load_plan(plan: LoadPlan) -> LoadPlan:
    """``plan`` with its items' offsets and lengths shared, and a storage index equal to the
    item's destination index (its hint included) the same object (the same items otherwise)."""
    values = SharedValues()
    items = []
    for item in plan.items:
        dest, storage = item.dest_index, item.storage_index
        if storage == dest and storage.index == dest.index:
            storage = dest
        dest_offsets, storage_offsets, lengths = (
            values.size(item.dest_offsets), values.size(item.storage_offsets), values.size(item.lengths)
        )
        if (storage is not item.storage_index or dest_offsets is not item.dest_offsets
                or storage_offsets is not item.storage_offsets or lengths is not item.lengths):
            fields = dict(
                dest_index=dest, dest_offsets=dest_offsets, storage_index=storage, storage_offsets=storage_offsets, lengths=lengths,
            )
            # The cheap constructor; a planner's own subclass keeps its class and fields.
            item = ReadItem(type=item.type, **fields) if type(item) is ReadItem else dataclasses.replace(item, **fields)
        items.append(item)
    return dataclasses.replace(plan, items=items)
