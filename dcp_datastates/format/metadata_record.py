"""The plain record of a checkpoint's ``Metadata``: what loading needs, read without pickle.

``.metadata`` stays DCP's pickle, for DCP's own tools. Decoding that pickle
safely takes a pure-Python unpickler (see :mod:`metadata_file`), which costs
more than reading the tensors' bytes of many small tensors (docs/benchmarks.md).
From format 6 on, the writer also stores the same ``Metadata``
as a plain JSON record after the pickle (inside the checksummed region),
and our reader builds the ``Metadata`` from it: ``json`` is a C parser with
no way to run code or name a class, and every value is checked while the
objects are built. The pickle is then never unpickled by us.

A ``Metadata`` is recorded only when every part of it is plain enough to
come back identical: DCP's metadata classes with torch dtypes, layouts and
memory formats, ``planner_data`` that maps keys to paths of strings and
integers (DCP's planners), ``storage_data`` that is our layout, and a
``StorageMeta`` whose ``checkpoint_id`` is a string or a ``pathlib`` path.
Anything else (a custom planner's ``planner_data``, a field a newer torch
adds) means no record (and no footer): the reader decodes the pickle with
the safe unpickler, as for format 5. The record::

    {"record": 1,
     "properties": [[dtype, layout, requires_grad, memory_format, pin_memory], ...],
     "items": [[fqn, "bytes"] | [fqn, property index, size, [[offsets, sizes], ...]], ...],
     "planner_data": null | {fqn: [path element, ...]},
     "storage_meta": null | [checkpoint_id kind ("str", "path" or null), checkpoint_id,
                              save_id, load_id, [module, ...]],
     "version": null | str,
     "storage_data": the layout's plain form (storage_data.py), tuples as lists}

dtypes, layouts and memory formats are stored by their torch attribute name
(``"float32"``, ``"strided"``, ``"contiguous_format"``).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import TYPE_CHECKING

from dcp_datastates.errors import CorruptCheckpointError
from dcp_datastates.format.checkpoint_layout import CheckpointLayout, show
from dcp_datastates.format.storage_data import layout_of, layout_to_plain

if TYPE_CHECKING:  # torch is imported where the Metadata is built: summarize_record needs none
    from torch.distributed.checkpoint.metadata import Metadata

RECORD_VERSION = 1
_METADATA_FIELDS = ("state_dict_metadata", "planner_data", "storage_data", "storage_meta", "version")
_STORAGE_META_FIELDS = ("checkpoint_id", "save_id", "load_id", "modules")
_PROPERTY_FIELDS = ("dtype", "layout", "requires_grad", "memory_format", "pin_memory")


class NotRecordable(Exception):
    """This ``Metadata`` has a part the record cannot hold exactly (it is written without one)."""


def _torch_name(value, kind: type) -> str:
    import torch

    name = str(value).removeprefix("torch.")
    if getattr(torch, name, None) is not value or not isinstance(value, kind):
        raise NotRecordable(f"{value!r} is not a torch.{name}")
    return name


def _is_path(value) -> bool:
    return isinstance(value, tuple) and all(type(p) in (str, int) for p in value)


def encode_record(metadata: Metadata) -> bytes:
    """The record of ``metadata`` (JSON, UTF-8), or :class:`NotRecordable`."""
    import torch
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        Metadata,
        StorageMeta,
        TensorProperties,
        TensorStorageMetadata,
    )

    if type(metadata) is not Metadata or [f.name for f in dataclasses.fields(Metadata)] != list(_METADATA_FIELDS):
        raise NotRecordable("Metadata has fields this record does not know")
    layout = metadata.storage_data
    if not isinstance(layout, CheckpointLayout):
        raise NotRecordable("the storage data is not our layout")
    planner_data = metadata.planner_data
    if planner_data is not None:
        if type(planner_data) is not dict or not all(
            type(k) is str and _is_path(v) for k, v in planner_data.items()
        ):
            raise NotRecordable("the planner data is not DCP's map of keys to paths")
    meta = metadata.storage_meta
    storage_meta = None
    if meta is not None:
        if type(meta) is not StorageMeta or [f.name for f in dataclasses.fields(StorageMeta)] != list(_STORAGE_META_FIELDS):
            raise NotRecordable("StorageMeta has fields this record does not know")
        cid = meta.checkpoint_id
        if cid is None or type(cid) is str:
            kind = None if cid is None else "str"
        elif type(cid) in (pathlib.PosixPath, pathlib.PurePosixPath, pathlib.Path):
            kind, cid = "path", str(cid)
        else:
            raise NotRecordable(f"checkpoint_id {cid!r} is neither a string nor a path")
        if not all(v is None or type(v) is str for v in (meta.save_id, meta.load_id)):
            raise NotRecordable("save_id or load_id is not a string")
        if type(meta.modules) is not list or not all(type(m) is str for m in meta.modules):
            raise NotRecordable("modules is not a list of strings")
        storage_meta = [kind, cid, meta.save_id, meta.load_id, meta.modules]
    if not (metadata.version is None or type(metadata.version) is str):
        raise NotRecordable("version is not a string")

    properties: dict[tuple, int] = {}  # (dtype, layout, requires_grad, memory_format, pin_memory) -> ordinal
    names: list[list] = []
    items = []
    for fqn, item in metadata.state_dict_metadata.items():
        if type(fqn) is not str:
            raise NotRecordable(f"key {fqn!r} is not a string")
        kind = type(item)
        if kind is BytesStorageMetadata:
            items.append([fqn, "bytes"])
            continue
        p = item.properties
        if kind is not TensorStorageMetadata or type(p) is not TensorProperties:
            raise NotRecordable(f"{fqn!r} is described by a {kind.__name__}")
        key = (p.dtype, p.layout, p.requires_grad, p.memory_format, p.pin_memory)
        ordinal = properties.get(key)
        if ordinal is None:  # checked and named once per distinct kind of tensor
            if type(key[2]) is not bool or type(key[4]) is not bool:
                raise NotRecordable(f"{fqn!r} has non-boolean tensor properties")
            names.append([
                _torch_name(key[0], torch.dtype), _torch_name(key[1], torch.layout), key[2],
                _torch_name(key[3], torch.memory_format), key[4],
            ])
            ordinal = properties[key] = len(properties)
        chunks = [[list(c.offsets), list(c.sizes)] for c in item.chunks]
        items.append([fqn, ordinal, list(item.size), chunks])
    record = {
        "record": RECORD_VERSION,
        "properties": names,
        "items": items,
        "planner_data": None if planner_data is None else {k: list(v) for k, v in planner_data.items()},
        "storage_meta": storage_meta,
        "version": metadata.version,
        "storage_data": layout_to_plain(layout),
    }
    return json.dumps(record, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


# -- decoding: every value checked as the objects are built ------------------------------------


class _Bad(Exception):
    pass


def _check(ok: bool, why: str) -> None:
    if not ok:
        raise _Bad(why)


def _ints(value, what: str) -> list:
    _check(type(value) is list and all(type(v) is int and v >= 0 for v in value), f"{what} is not a list of counts")
    return value


def _torch_value(name, kind: type, what: str):
    import torch

    value = getattr(torch, name, None) if type(name) is str else None
    _check(isinstance(value, kind), f"{what} {show(name)} is not a torch {kind.__name__}")
    return value


def _layout_plain(data) -> dict:
    """The stored layout with its lists turned back into the tuples storage_data.py expects."""
    _check(type(data) is dict, "its storage data is not a dict")
    out = dict(data)
    if type(out.get("ranks")) is list:
        # a rank's stripe starts (its fifth element, format 7) are a list in JSON too
        out["ranks"] = [
            tuple(tuple(x) if i == 4 and type(x) is list else x for i, x in enumerate(r)) if type(r) is list else r
            for r in out["ranks"]
        ]
    if type(out.get("entries")) is list:
        entries = []
        for e in out["entries"]:
            if type(e) is not list or len(e) != 6:
                raise _Bad(f"layout entry {show(e)} is not a list of 6")
            entries.append((e[0], tuple(e[1]) if type(e[1]) is list else e[1], e[2], e[3], e[4], e[5]))
        out["entries"] = entries
    if type(out.get("compression")) is list:  # format 9: a stream codec's descriptors are a list too
        out["compression"] = tuple(tuple(x) if type(x) is list else x for x in out["compression"])
    if type(out.get("digests")) is list:  # format 8: (fqn, chunk offsets, digest)
        out["digests"] = [
            (d[0], tuple(d[1]) if type(d[1]) is list else d[1], *d[2:]) if type(d) is list and len(d) >= 2 else d
            for d in out["digests"]
        ]
    return out


def decode_record(blob, where: str) -> Metadata:
    """The ``Metadata`` a record stores, its storage data still the plain layout (the caller
    decodes and validates it with :func:`storage_data.layout_of`). A record that is not
    what :func:`encode_record` writes is a :class:`CorruptCheckpointError` naming ``where``."""
    import torch
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        StorageMeta,
        TensorProperties,
        TensorStorageMetadata,
    )

    try:
        record = _parse(blob)
        properties = []
        _check(type(record["properties"]) is list, "its tensor properties are not a list")
        for p in record["properties"]:
            _check(type(p) is list and len(p) == 5, f"tensor properties {show(p)} are not a list of 5")
            _check(type(p[2]) is bool and type(p[4]) is bool, f"tensor properties {show(p)} have non-booleans")
            properties.append(TensorProperties(
                dtype=_torch_value(p[0], torch.dtype, "dtype"), layout=_torch_value(p[1], torch.layout, "layout"),
                requires_grad=p[2], memory_format=_torch_value(p[3], torch.memory_format, "memory format"),
                pin_memory=p[4],
            ))
        table = {}
        _check(type(record["items"]) is list, "its items are not a list")
        sizes_cache: dict[tuple, torch.Size] = {}

        # Messages are formatted only on failure: these run once or twice per chunk.
        def size_of(value, what: str, fqn: str) -> torch.Size:
            if type(value) is not list:
                raise _Bad(f"{what} {fqn!r} is not a list")
            key = tuple(value)
            s = sizes_cache.get(key)
            if s is None:  # checked once per distinct shape
                s = sizes_cache[key] = torch.Size(_ints(value, f"{what} {fqn!r}"))
            return s

        bytes_item = BytesStorageMetadata()
        for entry in record["items"]:
            _check(type(entry) is list and entry and type(entry[0]) is str, f"item {show(entry)} has no key")
            fqn = entry[0]
            _check(fqn not in table, f"key {fqn!r} is recorded twice")
            if len(entry) == 2 and entry[1] == "bytes":
                table[fqn] = bytes_item
                continue
            _check(len(entry) == 4 and type(entry[1]) is int and 0 <= entry[1] < len(properties),
                   f"item {fqn!r} is not [key, properties, size, chunks]")
            size = size_of(entry[2], "the size of", fqn)
            _check(type(entry[3]) is list, f"the chunks of {fqn!r} are not a list")
            chunks = []
            for c in entry[3]:
                if type(c) is not list or len(c) != 2:
                    raise _Bad(f"a chunk of {fqn!r} is not [offsets, sizes]")
                chunks.append(ChunkStorageMetadata(
                    offsets=size_of(c[0], "a chunk offset of", fqn), sizes=size_of(c[1], "a chunk size of", fqn)
                ))
            table[fqn] = TensorStorageMetadata(properties=properties[entry[1]], size=size, chunks=chunks)
        planner_data = record["planner_data"]
        if planner_data is not None:
            _check(type(planner_data) is dict, "its planner data is not a dict")
            for k, v in planner_data.items():
                _check(type(v) is list and all(type(p) in (str, int) for p in v), f"the path of {k!r} is not a list")
            planner_data = {k: tuple(v) for k, v in planner_data.items()}
        storage_meta = record["storage_meta"]
        if storage_meta is not None:
            _check(type(storage_meta) is list and len(storage_meta) == 5, "its storage meta is not a list of 5")
            kind, cid, save_id, load_id, modules = storage_meta
            _check(kind in (None, "str", "path") and (cid is None) == (kind is None) and (cid is None or type(cid) is str),
                   f"its checkpoint id {show(cid)} ({show(kind)}) is malformed")
            _check(all(v is None or type(v) is str for v in (save_id, load_id)), "its save or load id is not a string")
            _check(type(modules) is list and all(type(m) is str for m in modules), "its modules are not strings")
            storage_meta = StorageMeta(
                checkpoint_id=pathlib.Path(cid) if kind == "path" else cid, save_id=save_id, load_id=load_id, modules=modules
            )
        version = record["version"]
        _check(version is None or type(version) is str, "its version is not a string")
        return Metadata(
            state_dict_metadata=table, planner_data=planner_data, storage_data=_layout_plain(record["storage_data"]),
            storage_meta=storage_meta, version=version,
        )
    except _Bad as exc:
        raise CorruptCheckpointError(f"{where} is corrupt: its metadata record is malformed: {exc}") from None


def _parse(blob) -> dict:
    """The record's JSON object, its keys and record version checked (raises :class:`_Bad`)."""
    try:
        record = json.loads(bytes(blob))
    except (ValueError, RecursionError) as exc:
        raise _Bad(f"it is not JSON ({exc})") from None
    _check(type(record) is dict, "it is not a JSON object")
    keys = {"record", "properties", "items", "planner_data", "storage_meta", "version", "storage_data"}
    _check(set(record) == keys, f"it has keys {sorted(record)!r}")
    _check(record["record"] == RECORD_VERSION and type(record["record"]) is int,
           f"record version {show(record['record'])} is not {RECORD_VERSION}")
    return record


@dataclasses.dataclass(frozen=True)
class RecordSummary:
    """What a listing shows of a checkpoint, read from its record without torch: how many keys
    it saved, and its layout (validated: its ranks and the files they name)."""

    keys: int
    layout: CheckpointLayout


def summarize_record(blob, where: str) -> RecordSummary:
    """The :class:`RecordSummary` of a record. The layout is decoded and validated as
    :func:`decode_record`'s caller does; the items are counted, not built into DCP's
    classes (which needs torch): a load and ``verify`` check each of them."""
    try:
        record = _parse(blob)
        _check(type(record["items"]) is list, "its items are not a list")
        plain = _layout_plain(record["storage_data"])
    except _Bad as exc:
        raise CorruptCheckpointError(f"{where} is corrupt: its metadata record is malformed: {exc}") from None
    layout = layout_of(plain, where)
    if layout is None:
        raise CorruptCheckpointError(f"{where} is corrupt: its metadata record holds no dcp_datastates layout")
    return RecordSummary(len(record["items"]), layout)
