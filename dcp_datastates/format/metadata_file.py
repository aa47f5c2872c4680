"""Reading and writing ``.metadata``: DCP's pickle, checksummed, unpickled safely.

``.metadata`` must stay DCP's pickled ``Metadata`` so DCP's own tools can
read it. Its ``storage_data`` is our layout as plain data (format 5,
``storage_data.py``): the pickle names DCP's and torch's classes only, so
DCP's ``pickle.load`` reads it without dcp_datastates, and none of our
modules is pinned to a path. :func:`encode_metadata` stores the plain form;
decoding (:func:`read_metadata_file`, :func:`decode_metadata`) hands back
the ``Metadata`` with a validated :class:`CheckpointLayout` in its place.
The framing below (trailer, record footer, commit stamp) lives in
:mod:`metadata_envelope`, which needs no torch; its names are re-exported here.
Two things are added around the pickle:

* after the pickle, the same metadata as a plain JSON record
  (:mod:`metadata_record`, format 6) and a 24-byte footer that finds it::

      record | b"DCPDSRC6" | pickle length (u64) | record length (u64)

  which our reader decodes instead of the pickle: safe and fast, where the
  safe unpickler is a pure-Python loop over every item. A metadata the record cannot
  hold exactly gets neither, and is read through the safe unpickler;
* a trailer after all of it (DCP's ``pickle.load`` stops at the pickle's
  end and never sees the rest)::

      body | b"DCPDSMD4" | body length (u64) | commit sequence (u64) | crc32c (u32) | 0 (u32)

  so a flipped or truncated byte is found before anything is decoded. The
  body is the pickle, and the record and its footer when there is one; the
  CRC-32C covers the body and the sequence bytes. The commit sequence is the
  number ``CheckpointManager`` gives each commit in a root (0: none); it
  sits in the trailer so that ordering a root's checkpoints reads 32 bytes
  per checkpoint, not its whole metadata (format version 4). The record
  sits inside the body so that a reader of version 5 still verifies the
  file and unpickles its pickle (the unpickler stops at the pickle's end),
  then refuses the layout's version 6 with "upgrade", not "corrupt".
  Format version 3 had a 24-byte trailer without the sequence (magic
  ``b"DCPDSMDC"``), still read; older checkpoints have no trailer;
* a restricted unpickler, used unless the caller allows arbitrary pickles:
  it admits only DCP's metadata classes, torch's dtypes, layouts and
  ``Size``, the class paths formats 1 to 4 pickled our layout under, and
  format 9's ``defaultdict`` of the stock-reader record, which it resolves
  to inert stand-ins (``storage_data.STAND_INS``, in both unpicklers).
  A hostile ``.metadata`` that names any other global
  raises :class:`UnsafeCheckpointError` instead of running code.
"""

from __future__ import annotations

import copy
import math
import pickle

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from dcp_datastates._dcp_compat import legacy_tensor_properties_class, storage_info_class
from dcp_datastates.native.gc_pause import gc_paused
from dcp_datastates.format.checkpoint_files import opened
from dcp_datastates.errors import CheckpointError, CorruptCheckpointError, UnsafeCheckpointError
from dcp_datastates.format.checkpoint_layout import CheckpointLayout, show
from dcp_datastates.format.metadata_record import NotRecordable, decode_record, encode_record
from dcp_datastates.format.metadata_envelope import (  # noqa: F401 - the envelope's names, as they always were
    _FOOTER,
    _SEQUENCE,
    _TRAILER,
    _TRAILER_V3,
    FOOTER_MAGIC,
    TRAILER_BYTES,
    TRAILER_MAGIC,
    TRAILER_MAGIC_V3,
    CommitStamp,
    Trailer,
    _checksum_error,
    encode_trailer,
    parse_trailer,
    read_commit_sequence,
    read_commit_stamp,
    read_verified_body,
    split_body,
    split_metadata,
    stamp_in_tail,
    trailer_crc,
)
from dcp_datastates.format.storage_data import LEGACY_CLASSES, STAND_INS, StockReaderRecord, layout_of, storage_data_to_pickle

# Globals a dcp_datastates .metadata may name, besides torch dtypes and layouts and
# (formats 1-4) our layout classes, which LEGACY_CLASSES maps to stand-ins.
_ALLOWED = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "StorageMeta",
        "MetadataIndex",
        "_MEM_FORMAT_ENCODING",
    },
    # Metadata written by older torch releases describes tensors with the sharded-tensor
    # TensorProperties (plain data, same fields); DCP still loads it.
    "torch.distributed._shard.sharded_tensor.metadata": {"TensorProperties", "MEM_FORMAT_ENCODING"},
    # A stock DCP checkpoint's storage data (so it is recognised and named, not refused).
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "collections": {"OrderedDict"},
    # StorageMeta.checkpoint_id may be a path object.
    "pathlib": {"Path", "PosixPath", "PurePath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
}
_TORCH_VALUE_TYPES = (torch.dtype, torch.layout, torch.memory_format)


class _MetadataUnpickler(pickle._Unpickler):
    """Unpickles only what a checkpoint's metadata is made of.

    The pure-Python unpickler, on purpose: it lets BUILD be restricted (the C
    one would apply a pickle's BUILD to any object on its stack: an allowed
    class, a function, an enum member, changing them for the whole process),
    and its memo is a dict (the C one sizes its memo table from an index in
    the pickle, so 33 bytes can make it allocate gigabytes).
    """

    dispatch = dict(pickle._Unpickler.dispatch)

    def __init__(self, file, where: str) -> None:
        super().__init__(file)
        self.where = where

    def refuse(self, what: str) -> UnsafeCheckpointError:
        return UnsafeCheckpointError(
            f"{self.where} {what}, which a checkpoint's metadata never needs; it was not "
            "unpickled (it could run code). If you trust this checkpoint, load it with "
            "DataStatesReader(path, allow_pickle=True)"
        )

    def find_class(self, module: str, name: str):
        stand_in = STAND_INS.get((module, name))
        if stand_in is not None:
            return stand_in
        if name in _ALLOWED.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), _TORCH_VALUE_TYPES):
            return getattr(torch, name)
        raise self.refuse(f"names {module}.{name}")

    def load_build(self):
        state = self.stack[-1]
        inst = self.stack[-2]
        if type(inst) not in _BUILDABLE:
            raise self.refuse(f"sets the state of a {type(inst).__name__} object")
        if isinstance(state, tuple) and len(state) == 2 and type(inst) is not TensorProperties:
            if state[1] is not None:  # slot state: setattr of arbitrary names
                raise self.refuse(f"sets attributes of a {type(inst).__name__} object directly")
        super().load_build()

    dispatch[pickle.BUILD[0]] = load_build


class _TrustingUnpickler(pickle.Unpickler):
    """``allow_pickle=True``: any global, except that the class paths formats 1-4 pickled our
    layout under resolve to the same stand-ins as in safe mode (no module of ours is pinned)."""

    def find_class(self, module: str, name: str):
        return STAND_INS.get((module, name)) or super().find_class(module, name)


def _buildable() -> frozenset:
    """The classes whose instances may receive a state (the dataclasses of the metadata)."""
    from torch.distributed.checkpoint import metadata as md

    stock = {storage_info_class(), legacy_tensor_properties_class()} - {None}
    return frozenset(
        {
            md.Metadata, md.TensorStorageMetadata, md.BytesStorageMetadata, md.ChunkStorageMetadata,
            md.TensorProperties, md.StorageMeta, md.MetadataIndex,
        }
        | set(LEGACY_CLASSES.values())
        | {StockReaderRecord}
        | stock
    )


_LEGACY_TENSOR_PROPERTIES = tuple({legacy_tensor_properties_class()} - {None})
_BUILDABLE = _buildable()


def encode_metadata(metadata: Metadata, sequence: int = 0) -> bytes:
    """The bytes of ``.metadata``: the pickle, the plain record and its footer, and the
    trailer carrying ``sequence``.

    A :class:`CheckpointLayout` in ``storage_data`` is pickled as its plain form (format 5),
    in a shallow copy of ``metadata``: the caller's object keeps its layout. Any other
    ``storage_data`` is pickled as it is, and gets no record (only our layout is recorded).
    """
    try:
        record = encode_record(metadata)
    except NotRecordable:
        record = None  # read through the safe unpickler, as format 5 was
    if isinstance(metadata.storage_data, CheckpointLayout):
        metadata = copy.copy(metadata)
        metadata.storage_data = storage_data_to_pickle(metadata.storage_data)
    body = pickle.dumps(metadata, protocol=pickle.HIGHEST_PROTOCOL)
    if record is not None:
        body += record + _FOOTER.pack(FOOTER_MAGIC, len(body), len(record))
    return body + encode_trailer(body, sequence)


_PROTO = pickle.PROTO[0]  # the first byte of every pickle of protocol 2 or later
_STOP = pickle.STOP[0]  # the last byte of every pickle


def _check_pickle_shape(first: bytes, last: int | None, where: str) -> None:
    """The bytes before a trailer must look like a pickle: PROTO and a protocol number first
    (DCP and we write protocol 2 or later), and, without a trailer, STOP last."""

    def bad(why: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{where} is corrupt: it is not a pickle of DCP metadata: {why}")

    if not first:
        raise CorruptCheckpointError(f"{where} is corrupt: it is empty")
    if len(first) < 2 or first[0] != _PROTO or not 2 <= first[1] <= pickle.HIGHEST_PROTOCOL:
        raise bad(f"it starts with {bytes(first[:8])!r}")
    if last is not None and last != _STOP:
        raise bad(f"it ends with byte {last:#04x} and has no checksum trailer")


def read_metadata_file(path, allow_pickle: bool = False) -> tuple[Metadata, bool]:
    """Read, verify and unpickle the ``.metadata`` at ``path`` (a local path, or an opened file of
    any store: ``storage.Store.open_file``): :func:`decode_metadata` for a file, in memory bounded
    by its structure, not its size.

    Before the file is held in memory: its first bytes must be a pickle's
    header (a file of zeros or of anything else is refused after reading 2
    bytes); a checksum trailer (format 3 and later) must match the size, and
    its CRC-32C is streamed over the pickle through a 1 MiB buffer. Only then
    is the pickle read, once, into one buffer of its size, checked against
    the trailer again (the bytes unpickled are the bytes verified), and
    unpickled from that buffer without a copy. A file without a trailer
    (stock DCP, format 1 and 2) can be bounded only by its shape (it must
    also end with a pickle's STOP byte): such a file costs its size in
    memory once before the unpickler judges it.
    FileNotFoundError when it does not exist.
    """
    with opened(path) as f:
        path = f.path
        first = f.pread(min(f.size, 2), 0)
        _check_pickle_shape(first, None, path)
        tail = f.pread(min(f.size, _TRAILER.size), f.size - min(f.size, _TRAILER.size))
        trailer = parse_trailer(tail, f.size, path)
        if trailer is None:
            _check_pickle_shape(first, tail[-1], path)
            body = f.read(f.size)
        else:
            body = read_verified_body(f, trailer)
    view = memoryview(body)
    if trailer is None:
        return _unpickle_metadata(view, path, allow_pickle, False), False
    pickled, record = split_body(view, path)
    if len(record):
        return _metadata_from_record(record, path), True
    return _unpickle_metadata(pickled, path, allow_pickle, True), True


class _BufferReader:
    """``read``/``readline`` over a buffer for the pure-Python unpickler (``io.BytesIO`` would
    copy a buffer that is not ``bytes``: the whole pickle a second time)."""

    def __init__(self, view: memoryview) -> None:
        self.view, self.pos = view, 0

    def read(self, n: int = -1) -> bytes:
        end = len(self.view) if n is None or n < 0 else min(self.pos + n, len(self.view))
        out = bytes(self.view[self.pos : end])
        self.pos = end
        return out

    def readline(self) -> bytes:
        end, size = self.pos, len(self.view)
        while end < size:
            chunk = self.view[end : end + 4096].tobytes()
            i = chunk.find(b"\n")
            if i >= 0:
                end += i + 1
                break
            end += len(chunk)
        return self.read(end - self.pos)


def decode_metadata(blob: bytes, where: str, allow_pickle: bool = False) -> tuple[Metadata, bool]:
    """Verify and unpickle ``.metadata``; returns (metadata, had a checksum trailer).

    Every failure is a :class:`CheckpointError` naming ``where``: a corrupt or
    truncated file, a pickle that is not DCP ``Metadata``, (unless
    ``allow_pickle``) a pickle that names a global outside the allowed set,
    or a layout of ours that does not validate. Our layout comes back as a
    validated :class:`CheckpointLayout` in ``storage_data``; any other
    storage data (a stock DCP checkpoint's) as it was pickled. For a file,
    :func:`read_metadata_file` does the same in bounded memory.
    """
    body, record, checked = split_metadata(blob, where)
    _check_pickle_shape(body[:2], None if checked or not len(body) else body[-1], where)
    if len(record):
        return _metadata_from_record(record, where), checked
    return _unpickle_metadata(body, where, allow_pickle, checked), checked


def _metadata_from_record(record: memoryview, where: str) -> Metadata:
    """The ``Metadata`` of a format 6 file from its plain record (never from the pickle)."""
    with gc_paused():  # hundreds of thousands of objects, no cycles: decoded and checked
        metadata = decode_record(record, where)
        metadata = _checked(metadata, where, checksummed=True)
    if not isinstance(metadata.storage_data, CheckpointLayout):
        raise CorruptCheckpointError(f"{where} is corrupt: its metadata record holds no dcp_datastates layout")
    return metadata


def _unpickle_metadata(body: memoryview, where: str, allow_pickle: bool, checksummed: bool) -> Metadata:
    """The one place a ``.metadata`` pickle is decoded (unpickled, then checked), for files and
    buffers alike: the Metadata, with our layout decoded and validated in its storage data."""
    try:
        with gc_paused():
            if allow_pickle:
                metadata = _TrustingUnpickler(_BufferReader(body)).load()
            else:
                metadata = _MetadataUnpickler(_BufferReader(body), where).load()
    except UnsafeCheckpointError:
        raise
    except CheckpointError as exc:  # a stand-in refusing its pickled state
        raise CorruptCheckpointError(f"{where}: {exc}") from exc
    except RecursionError as exc:
        raise CorruptCheckpointError(f"{where} cannot be decoded: nested too deeply") from exc
    except MemoryError as exc:
        raise CorruptCheckpointError(f"{where} cannot be decoded: it asks for too much memory") from exc
    except Exception as exc:  # noqa: BLE001 - any decoding failure means a damaged file
        raise CorruptCheckpointError(f"{where} cannot be decoded: {type(exc).__name__}: {exc}") from exc
    if not isinstance(metadata, Metadata):
        raise CorruptCheckpointError(f"{where} holds a {type(metadata).__name__}, not DCP Metadata")
    return _checked(metadata, where, checksummed)


def _checked(metadata: Metadata, where: str, checksummed: bool) -> Metadata:
    """``metadata`` checked (:func:`check_metadata`), with our layout decoded and validated."""
    check_metadata(metadata, where)
    layout = layout_of(metadata.storage_data, where)
    if layout is not None:
        layout.check_covers(metadata, where)
        if layout.version >= 3 and not checksummed:
            raise CorruptCheckpointError(
                f"{where} is corrupt: format version {layout.version} ends with a checksum trailer, "
                "and this file has none (truncated or edited?)"
            )
        metadata.storage_data = layout
    return metadata


_INT64_MAX = (1 << 63) - 1  # torch's sizes, element counts and byte counts are int64


def check_metadata(metadata: Metadata, where: str) -> None:
    """The shape DCP's load planner relies on: a damaged file fails here, with its name,
    rather than deep inside DCP with an AttributeError."""

    def bad(why: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{where} is corrupt: {why}")

    table = getattr(metadata, "state_dict_metadata", None)
    if not isinstance(table, dict):
        raise bad("it has no table of saved items")
    if not isinstance(getattr(metadata, "planner_data", None), (dict, type(None))):
        raise bad("its planner data is not a dict")
    if not isinstance(getattr(metadata, "storage_meta", None), (StorageMeta, type(None))):
        raise bad("its storage meta is not a StorageMeta")  # readers stamp their load_id into it
    for fqn, item in table.items():
        if not isinstance(fqn, str):
            raise bad(f"item key {show(fqn)} is not a string")
        if isinstance(item, BytesStorageMetadata):
            continue
        if not isinstance(item, TensorStorageMetadata):
            raise bad(f"{fqn!r} is described by a {type(item).__name__}")
        props, size, chunks = (getattr(item, n, None) for n in ("properties", "size", "chunks"))
        if not isinstance(props, (TensorProperties, *_LEGACY_TENSOR_PROPERTIES)) or not isinstance(
            getattr(props, "dtype", None), torch.dtype
        ):
            raise bad(f"{fqn!r} has no valid dtype")
        if not isinstance(size, torch.Size) or not isinstance(chunks, list):
            raise bad(f"{fqn!r} has no valid size or chunk list")
        if any(d < 0 or d > _INT64_MAX for d in size) or math.prod(size) * props.dtype.itemsize > _INT64_MAX:
            # DCP would fail later with a bare overflow from torch, or a size mismatch
            raise bad(f"{fqn!r} has size {tuple(size)}, which no {props.dtype} tensor can have")
        covered = 0
        for chunk in chunks:
            offsets, sizes = getattr(chunk, "offsets", None), getattr(chunk, "sizes", None)
            if (
                not isinstance(chunk, ChunkStorageMetadata)
                or not isinstance(offsets, torch.Size)
                or not isinstance(sizes, torch.Size)
                or not len(offsets) == len(sizes) == len(size)
                or any(o < 0 or n < 0 or o + n > d for o, n, d in zip(offsets, sizes, size))
            ):
                raise bad(f"{fqn!r} has a chunk {show(chunk)} that does not fit its size {tuple(size)}")
            covered += math.prod(sizes)
        if covered != math.prod(size):
            # Chunks never overlap, so they must add up to the tensor: a load would
            # otherwise leave part of the destination silently unwritten.
            raise bad(f"the chunks of {fqn!r} hold {covered} elements of its {math.prod(size)}")
