"""Plans that DCP's collectives pickle cheaply: each item a row of plain values, equal values once.

DCP sends every rank's plan to the coordinator and back (a gather and a scatter of pickles)
and, after a save, broadcasts the global metadata built from the plans. Pickle writes each of
DCP's dataclasses as a call that makes an empty object and a dict of its fields to fill it,
four of them per saved item (the item, its index, its tensor data, its chunk) and two per
loaded one; DCP's planners also give every item its own ``TensorProperties`` (pickled through
Python ``__getstate__`` and ``__setstate__``) and their own ``torch.Size`` objects.

The writer and the reader hand DCP the plans as :class:`RowSavePlan` and :class:`RowLoadPlan`
(:func:`row_plan`, in their ``prepare_local_plan`` and ``prepare_global_plan``): DCP's plan classes with the same
fields and the same items, pickled differently. Pickled, an item of DCP's own classes is one
tuple of its values, with equal sizes and equal tensor properties one object each (pickle
writes an object it has written already as a reference to it, and reads it back as that one
object); unpickled, the items are DCP's classes again, built by their constructors, in a row
plan again (the coordinator's global plans are scattered as rows too). Items of a planner's own
classes are pickled as they are, in their place. Every rank runs this module, and a row plan
names the row layout it was written with: ranks of different versions fail by name.

The coordinator's plans, read from rows, share equal values, so the metadata it builds from
them inherits the sharing (its broadcast and the ``.metadata`` encoding are cheaper), and the
tensor properties there are objects the pickle made, never a caller's (a ``ShardedTensor``'s
own properties may be edited later in place). A planner that edits an item's properties in
place in ``create_global_plan`` edits every equal item's; one that replaces them, as DCP's
examples do, is unaffected.

:class:`SharedValues` is the same sharing for a planner that builds its items
(``DataStatesSavePlanner``): fewer objects made, and rows that pickle the same.
"""

from __future__ import annotations

import dataclasses

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    BytesIOWriteData,
    LoadPlan,
    ReadItem,
    SavePlan,
    TensorWriteData,
    WriteItem,
)

from dcp_datastates.errors import CheckpointError

# The layout of the rows; a rank reading another layout fails (the ranks run different versions).
ROWS_VERSION = 1


class SharedValues:
    """One object per distinct value seen: sizes and tensor properties."""

    def __init__(self) -> None:
        self._sizes: dict = {}
        self._properties: dict = {}  # by their fields
        self._seen: dict = {}  # by id: the shared one for each properties object seen
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

    def properties_for(self, dtype, layout, requires_grad, memory_format, pin_memory) -> TensorProperties:
        """The table's one ``TensorProperties`` of these fields (made by the table if it has none)."""
        key = (dtype, layout, requires_grad, memory_format, pin_memory)
        shared = self._properties.get(key)
        if shared is None:
            shared = self._properties[key] = TensorProperties(*key)
        return shared

    def properties(self, p):
        """The first ``TensorProperties`` seen equal to ``p`` (a subclass's object as it is)."""
        shared = self._seen.get(id(p))
        if shared is None:
            shared = p
            if type(p) is TensorProperties:
                key = (p.dtype, p.layout, p.requires_grad, p.memory_format, p.pin_memory)
                shared = self._properties.setdefault(key, p)
            self._seen[id(p)] = shared
        return shared


def _field_names(cls) -> tuple:
    return tuple(f.name for f in dataclasses.fields(cls))


# The fields the rows hold and the constructors rebuild, in order: DCP's public dataclasses as
# this torch defines them. Another layout (a later torch) pickles the plans as DCP's classes.
ROWS_FIT = (
    _field_names(WriteItem) == ("index", "type", "bytes_io_data", "tensor_data")
    and _field_names(TensorWriteData) == ("chunk", "properties", "size")
    and _field_names(ChunkStorageMetadata) == ("offsets", "sizes")
    and _field_names(MetadataIndex) == ("fqn", "offset", "index")
    and _field_names(ReadItem) == ("type", "dest_index", "dest_offsets", "storage_index", "storage_offsets", "lengths")
    and _field_names(TensorProperties) == ("dtype", "layout", "requires_grad", "memory_format", "pin_memory")
    and _field_names(SavePlan)[0] == "items" and _field_names(LoadPlan)[0] == "items"
    and _field_names(TensorStorageMetadata) == ("properties", "size", "chunks")
    and _field_names(Metadata)[0] == "state_dict_metadata"
)


def _other_fields(obj, rows_field: str = "items") -> dict:
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj) if f.name != rows_field}


# -- items and rows ---------------------------------------------------------------------------


def _save_row(item, size, properties):
    """A ``WriteItem`` of DCP's classes as a tuple; any other item as it is."""
    index, data, bytes_io = item.index, item.tensor_data, item.bytes_io_data
    if type(item) is not WriteItem or type(index) is not MetadataIndex:
        return item
    if data is None:
        if bytes_io is not None and type(bytes_io) is not BytesIOWriteData:
            return item
        return (index.fqn, size(index.offset), index.index, item.type, bytes_io)
    chunk = data.chunk
    if type(data) is not TensorWriteData or type(chunk) is not ChunkStorageMetadata or bytes_io is not None:
        return item
    return (index.fqn, size(index.offset), index.index, item.type, size(chunk.offsets), size(chunk.sizes),
            properties(data.properties), size(data.size))


def _save_item(row: tuple) -> WriteItem:
    if len(row) == 5:
        fqn, offset, hint, kind, bytes_io = row
        return WriteItem(MetadataIndex(fqn, offset, hint), kind, bytes_io, None)
    fqn, offset, hint, kind, offsets, sizes, properties, size = row
    return WriteItem(MetadataIndex(fqn, offset, hint), kind, None, TensorWriteData(ChunkStorageMetadata(offsets, sizes), properties, size))


def _load_row(item, size, properties):
    """A ``ReadItem`` of DCP's classes as a tuple (its storage index left out where it equals
    its destination index, hint included); any other item as it is."""
    dest, storage = item.dest_index, item.storage_index
    if type(item) is not ReadItem or type(dest) is not MetadataIndex or type(storage) is not MetadataIndex:
        return item
    row = (item.type, dest.fqn, size(dest.offset), dest.index, size(item.dest_offsets), size(item.storage_offsets),
           size(item.lengths))
    if storage is not dest and (storage.fqn != dest.fqn or storage.offset != dest.offset or storage.index != dest.index):
        row += (storage.fqn, size(storage.offset), storage.index)
    return row


def _load_item(row: tuple) -> ReadItem:
    kind, fqn, offset, hint, dest_offsets, storage_offsets, lengths = row[:7]
    dest = MetadataIndex(fqn, offset, hint)
    storage = dest if len(row) == 7 else MetadataIndex(row[7], row[8], row[9])
    return ReadItem(kind, dest, dest_offsets, storage, storage_offsets, lengths)


# -- the plans -------------------------------------------------------------------------------


class _PickledAsRows:
    """What makes a plan class of DCP's pickle its items as rows: its ``_row`` (an item to a
    row, given the sharing table's ``size`` and ``properties``) and ``_item`` (a row back)."""

    def __reduce__(self):
        values = SharedValues()
        row, size, properties = type(self)._row, values.size, values.properties
        rows = [row(item, size, properties) for item in self.items]
        return (_rebuild_plan, (ROWS_VERSION, type(self).__name__, rows, _other_fields(self)))


class RowSavePlan(_PickledAsRows, SavePlan):
    """A ``SavePlan`` that pickles its items as rows (see the module)."""

    _row, _item = staticmethod(_save_row), staticmethod(_save_item)


class RowLoadPlan(_PickledAsRows, LoadPlan):
    """A ``LoadPlan`` that pickles its items as rows (see the module)."""

    _row, _item = staticmethod(_load_row), staticmethod(_load_item)


_ROW_CLASSES = {SavePlan: RowSavePlan, LoadPlan: RowLoadPlan}
_BY_NAME = {cls.__name__: cls for cls in _ROW_CLASSES.values()}


def _check_version(version) -> None:
    if version != ROWS_VERSION:
        raise CheckpointError(
            f"a rank sent a plan in row layout {version!r}, this rank reads layout {ROWS_VERSION}: "
            "every rank must run the same version of dcp_datastates"
        )


def _rebuild_plan(version, name: str, rows: list, fields: dict):
    _check_version(version)
    cls = _BY_NAME[name]
    item = cls._item
    return cls(items=[item(row) if type(row) is tuple else row for row in rows], **fields)


def row_plan(plan):
    """``plan`` (a ``SavePlan`` or ``LoadPlan``: its fields, its items) as the row plan of its
    class; a plan of another class (a planner's own, or a row plan already) as it is."""
    cls = _ROW_CLASSES.get(type(plan)) if ROWS_FIT else None
    return plan if cls is None else cls(items=plan.items, **_other_fields(plan))


# -- the global metadata ---------------------------------------------------------------------


class RowMetadata(Metadata):
    """A ``Metadata`` whose broadcast pickles its ``state_dict_metadata`` as rows: the one a
    planner of ours builds (``DataStatesSavePlanner``), which DCP broadcasts after the save.
    A tensor's entry is ``(fqn, properties, size, chunk offsets and sizes)``, an object's
    ``(fqn,)``, any other entry ``(fqn, entry)``. Written into ``.metadata`` as DCP's own
    ``Metadata`` (:func:`plain_metadata`), for DCP's tools."""

    def __reduce__(self):
        values = SharedValues()
        size, properties = values.size, values.properties
        rows = []
        for fqn, entry in self.state_dict_metadata.items():
            kind = type(entry)
            if kind is BytesStorageMetadata:
                rows.append((fqn,))
            elif kind is TensorStorageMetadata and all(type(c) is ChunkStorageMetadata for c in entry.chunks):
                chunks = tuple(v for c in entry.chunks for v in (size(c.offsets), size(c.sizes)))
                rows.append((fqn, properties(entry.properties), size(entry.size), chunks))
            else:
                rows.append((fqn, entry))
        fields = _other_fields(self, "state_dict_metadata")
        return (_rebuild_metadata, (ROWS_VERSION, rows, fields))


def _rebuild_metadata(version, rows: list, fields: dict) -> RowMetadata:
    _check_version(version)
    described = {}
    for row in rows:
        if len(row) == 1:
            described[row[0]] = BytesStorageMetadata()
        elif len(row) == 2:
            described[row[0]] = row[1]
        else:
            fqn, properties, size, chunks = row
            described[fqn] = TensorStorageMetadata(
                properties, size, [ChunkStorageMetadata(chunks[i], chunks[i + 1]) for i in range(0, len(chunks), 2)]
            )
    return RowMetadata(described, **fields)


def row_metadata(state_dict_metadata: dict) -> Metadata:
    """The global metadata of these entries, broadcast as rows where this torch's classes fit."""
    return RowMetadata(state_dict_metadata) if ROWS_FIT else Metadata(state_dict_metadata)


def plain_metadata(metadata: Metadata) -> Metadata:
    """``metadata`` as DCP's own class (a shallow copy of a :class:`RowMetadata`), as
    ``.metadata`` holds it: DCP's tools unpickle it without this package."""
    if type(metadata) is not RowMetadata:
        return metadata
    return Metadata(metadata.state_dict_metadata, **_other_fields(metadata, "state_dict_metadata"))
