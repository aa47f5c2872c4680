"""Reading and writing ``.metadata``: DCP's pickle, checksummed, unpickled safely.

``.metadata`` must stay DCP's pickled ``Metadata`` so DCP's own tools can
read it. Two things are added around the pickle:

* a trailer after it (DCP's ``pickle.load`` stops at the pickle's end and
  never sees it)::

      pickle bytes | b"DCPDSMDC" | length of the pickle (u64) | crc32c (u32) | 0 (u32)

  so a flipped or truncated byte is found before anything is unpickled
  (format version 3; older checkpoints have no trailer);
* a restricted unpickler, used unless the caller allows arbitrary pickles:
  it admits only DCP's metadata classes, our layout classes and torch's
  dtypes, layouts and ``Size``. A hostile ``.metadata`` that names any other
  global raises :class:`UnsafeCheckpointError` instead of running code.
"""

from __future__ import annotations

import io
import pickle
import struct

import torch
from torch.distributed.checkpoint.metadata import Metadata

from ._native import crc32c, gc_paused
from .errors import CorruptCheckpointError, UnsafeCheckpointError

TRAILER_MAGIC = b"DCPDSMDC"
_TRAILER = struct.Struct("<8sQII")

# Globals a dcp_datastates .metadata may name, besides torch dtypes and layouts.
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
    # A stock DCP checkpoint's storage data (so it is recognised and named, not refused).
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "dcp_datastates.format": {"CheckpointLayout", "RankFiles"},
    "collections": {"OrderedDict"},
    # StorageMeta.checkpoint_id may be a path object.
    "pathlib": {"Path", "PosixPath", "PurePath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
}
_TORCH_VALUE_TYPES = (torch.dtype, torch.layout, torch.memory_format)


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file, where: str) -> None:
        super().__init__(file)
        self.where = where

    def find_class(self, module: str, name: str):
        if name in _ALLOWED.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), _TORCH_VALUE_TYPES):
            return getattr(torch, name)
        raise UnsafeCheckpointError(
            f"{self.where} names {module}.{name}, which a checkpoint's metadata never needs; it was "
            "not unpickled (it could run code). If you trust this checkpoint, load it with "
            "DataStatesReader(path, allow_pickle=True)"
        )


def encode_metadata(metadata: Metadata) -> bytes:
    """The bytes of ``.metadata``: the pickle and its checksum trailer."""
    blob = pickle.dumps(metadata, protocol=pickle.HIGHEST_PROTOCOL)
    return blob + _TRAILER.pack(TRAILER_MAGIC, len(blob), crc32c(blob), 0)


def split_trailer(blob: bytes, where: str) -> tuple[memoryview, bool]:
    """The pickle part of ``blob`` and whether a (verified) trailer was present."""
    view = memoryview(blob)
    if len(blob) >= _TRAILER.size:
        magic, length, crc, _ = _TRAILER.unpack_from(blob, len(blob) - _TRAILER.size)
        if magic == TRAILER_MAGIC:
            if length != len(blob) - _TRAILER.size:
                raise CorruptCheckpointError(
                    f"{where} is corrupt: its trailer records a {length}-byte pickle, the file holds "
                    f"{len(blob) - _TRAILER.size} bytes before the trailer"
                )
            body = view[:length]
            actual = crc32c(body)
            if actual != crc:
                raise CorruptCheckpointError(
                    f"{where} is corrupt: checksum {actual:08x} does not match the stored {crc:08x}"
                )
            return body, True
    return view, False


def decode_metadata(blob: bytes, where: str, allow_pickle: bool = False) -> tuple[Metadata, bool]:
    """Verify and unpickle ``.metadata``; returns (metadata, had a checksum trailer).

    Every failure is a :class:`CheckpointError` naming ``where``: a corrupt or
    truncated file, a pickle that is not DCP ``Metadata``, or (unless
    ``allow_pickle``) a pickle that names a global outside the allowed set.
    """
    body, checked = split_trailer(blob, where)
    try:
        with gc_paused():
            if allow_pickle:
                metadata = pickle.loads(body)
            else:
                metadata = _MetadataUnpickler(io.BytesIO(body), where).load()
    except UnsafeCheckpointError:
        raise
    except RecursionError as exc:
        raise CorruptCheckpointError(f"{where} cannot be decoded: nested too deeply") from exc
    except MemoryError as exc:
        raise CorruptCheckpointError(f"{where} cannot be decoded: it asks for too much memory") from exc
    except Exception as exc:  # noqa: BLE001 - any decoding failure means a damaged file
        raise CorruptCheckpointError(f"{where} cannot be decoded: {type(exc).__name__}: {exc}") from exc
    if not isinstance(metadata, Metadata):
        raise CorruptCheckpointError(f"{where} holds a {type(metadata).__name__}, not DCP Metadata")
    return metadata, checked
