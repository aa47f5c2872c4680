"""DCP's stream transforms (``_extensions=[...]``: compression, encryption, ...), applied and
undone exactly as DCP's ``FileSystemWriter`` and ``FileSystemReader`` do, for every user of
them here: the frames and objects of our checkpoints saved with a transform other than zstd
alone, and the records of stock DCP checkpoints.

A transform is a ``StreamTransformExtension``: ``transform_to`` wraps a writable stream,
``transform_from`` a readable one. What a checkpoint records is the list of descriptors
(``"name/version"``) DCP records in ``_StorageInfo.transform_descriptors``: the extensions'
descriptors in reverse order. A reader turns them back into extensions through an
``ExtensionRegistry``, which must know each name (DCP's default knows ``stream.zstd``).
"""

from __future__ import annotations

import io
from typing import Sequence

from dcp_datastates import _dcp_compat
from dcp_datastates.errors import CorruptCheckpointError, UnsupportedFormatError

# How to get the zstandard package (the codec's zstd and DCP's ZStandard extension both need it).
INSTALL_HINT = 'pip install "dcp_datastates[zstd]" (or pip install zstandard)'


def check_extensions(extensions: Sequence) -> tuple:
    """``extensions`` as a tuple, each a DCP ``StreamTransformExtension`` (else a ValueError
    naming it: another kind of extension changes the layout, which our format fixes)."""
    stream_transform = _dcp_compat.stream_transform_extension_class()
    for ex in extensions:
        if not isinstance(ex, stream_transform):
            raise ValueError(
                f"DataStatesWriter does not support the DCP extension {type(ex).__name__}: only stream "
                "transforms (torch.distributed.checkpoint._extension.StreamTransformExtension) apply to its items"
            )
    return tuple(extensions)


def descriptors_of(extensions: Sequence) -> tuple[str, ...]:
    """What a checkpoint records for ``extensions``: their descriptors, as FileSystemWriter
    records them (the last extension's first)."""
    descriptors = []
    for ex in reversed(extensions):
        desc = ex.get_descriptor()
        if not isinstance(desc, str) or not desc:
            raise ValueError(f"the DCP extension {type(ex).__name__} describes itself as {desc!r}, not a name")
        descriptors.append(desc)
    return tuple(descriptors)


class _NoClose(io.RawIOBase):
    """The sink a transform writes into: closing the transform's stream must not close it
    (FileSystemWriter wraps its file the same way)."""

    def __init__(self, out: io.BytesIO) -> None:
        super().__init__()
        self.out = out

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        return self.out.write(b)

    def close(self) -> None:
        self.flush()


def apply(extensions: Sequence, data) -> bytes:
    """``data`` (a buffer) through ``extensions``, as FileSystemWriter transforms an item."""
    out = io.BytesIO()
    stream = _NoClose(out)
    for ex in extensions:
        stream = ex.transform_to(stream)
    stream.write(data)
    stream.close()
    return out.getvalue()


def extensions_for(descriptors: Sequence[str], registry, where: str) -> list:
    """The DCP extensions that undo ``descriptors``, built by ``registry`` (DCP's
    ``ExtensionRegistry``) as DCP's reader builds them; a descriptor it does not know (or
    refuses) is an :class:`UnsupportedFormatError` naming it and saying how to register it."""
    if not descriptors:
        return []
    try:
        return list(registry.from_descriptor_list(list(descriptors)))
    except Exception as exc:  # noqa: BLE001 - an extension's from_descriptor may raise anything
        if any(d.partition("/")[0] == "stream.zstd" for d in descriptors):
            how = f"DCP's ZStandard needs the zstandard package: {INSTALL_HINT}; other extensions: "
        else:
            how = ""
        raise UnsupportedFormatError(
            f"{where}: items were written through the DCP extension(s) {', '.join(map(repr, descriptors))}, "
            f"which this reader cannot undo ({type(exc).__name__}: {exc}); {how}register the extension's class "
            "in an ExtensionRegistry and pass it as DataStatesReader(path, _extension_registry=registry)"
        ) from exc


def default_registry():
    """DCP's default ``ExtensionRegistry`` (it knows ``stream.zstd``)."""
    return _dcp_compat.extension_registry()


def undo(extensions: Sequence, blob, where: str) -> bytes:
    """``blob`` read back through ``extensions`` (from :func:`extensions_for`, in descriptor order);
    an extension failing on it is a :class:`CorruptCheckpointError` naming ``where``.

    The descriptors list the transforms in the order the bytes went through them, so the last
    one is undone first: its reader wraps the stored bytes. (DCP's FileSystemReader wraps them
    the other way round, which is the same for one transform but fails on two that do not
    commute, ZStandard and another, say; this reads both.)"""
    stream_transform = _dcp_compat.stream_transform_extension_class()
    stream = io.BytesIO(blob)
    for ex in reversed(extensions):
        if isinstance(ex, stream_transform):
            stream = ex.transform_from(stream)
    try:
        return stream.read(-1)
    except Exception as exc:  # noqa: BLE001 - an extension may raise anything on damaged bytes
        raise CorruptCheckpointError(f"{where}: the stored bytes do not undo their stream transforms: "
                                     f"{type(exc).__name__}: {exc}") from exc
