"""The envelope of ``.metadata``: its checksum trailer, the footer of its plain record, and
its commit stamp, read without torch.

What :mod:`metadata_file` wraps around DCP's pickle (its docstring draws
the layout) is plain bytes; this module frames and checks them and nothing
else, so the tools that list and size a run (``ls``, ``du``) and the run's
own ordering by commit sequence read them without importing torch.
"""

from __future__ import annotations

import dataclasses
import struct

from dcp_datastates.errors import CorruptCheckpointError
from dcp_datastates.format.checkpoint_files import opened
from dcp_datastates.native.engine import crc32c

TRAILER_MAGIC = b"DCPDSMD4"
_TRAILER = struct.Struct("<8sQQII")  # magic, body length, commit sequence, crc32c, reserved
_SEQUENCE = struct.Struct("<Q")
FOOTER_MAGIC = b"DCPDSRC6"
_FOOTER = struct.Struct("<8sQQ")  # magic, pickle length, record length: the end of a body with a record
TRAILER_MAGIC_V3 = b"DCPDSMDC"
_TRAILER_V3 = struct.Struct("<8sQII")  # magic, pickle length, crc32c, reserved
TRAILER_BYTES = _TRAILER.size  # the tail of a .metadata that holds its commit sequence


def encode_trailer(body: bytes, sequence: int = 0) -> bytes:
    """The 32 bytes that follow ``body`` (the pickle, and the record and its footer) in
    ``.metadata`` (see the module docstring)."""
    if not isinstance(sequence, int) or not 0 <= sequence < 1 << 64:
        raise ValueError(f"a commit sequence is an integer in [0, 2**64), got {sequence!r}")
    crc = crc32c(_SEQUENCE.pack(sequence), crc32c(body))
    return _TRAILER.pack(TRAILER_MAGIC, len(body), sequence, crc, 0)


@dataclasses.dataclass(frozen=True)
class Trailer:
    """What the end of a ``.metadata`` says about it, before anything is decoded."""

    body_length: int  # bytes before the trailer: the pickle (and record and footer, version 6)
    sequence: int  # the commit sequence (0: none); always 0 for version 3 trailers
    crc: int  # crc32c of the body (and, version 4 on, the packed sequence)
    covers_sequence: bool  # version 4 on: the crc covers the sequence bytes too
    size: int  # bytes of the trailer itself


def parse_trailer(tail: bytes, file_size: int, where: str) -> Trailer | None:
    """Parse the trailer from the last bytes of a ``.metadata`` of ``file_size`` bytes.

    ``tail`` holds at least the file's last ``_TRAILER.size`` bytes (or the
    whole file when it is shorter). None when there is no trailer (a file
    written by format version 2 or earlier, or by stock DCP); a trailer whose
    fields contradict the file raises :class:`CorruptCheckpointError`.
    """
    for struct_, magic in ((_TRAILER, TRAILER_MAGIC), (_TRAILER_V3, TRAILER_MAGIC_V3)):
        if file_size < struct_.size or len(tail) < struct_.size:
            continue
        fields = struct_.unpack_from(tail, len(tail) - struct_.size)
        if fields[0] != magic:
            continue
        if struct_ is _TRAILER:
            _, length, sequence, crc, reserved = fields
        else:
            (_, length, crc, reserved), sequence = fields, 0
        if length != file_size - struct_.size or reserved != 0:
            raise CorruptCheckpointError(
                f"{where} is corrupt: its trailer (a {length}-byte body, reserved field {reserved}) "
                f"does not match the {file_size - struct_.size} bytes before it"
            )
        return Trailer(length, sequence, crc, struct_ is _TRAILER, struct_.size)
    return None


def trailer_crc(body, trailer: Trailer, crc: int = 0) -> int:
    """The crc32c a trailer's ``crc`` field must equal: over ``body`` (the bytes before the
    trailer, or the part of them after the bytes whose crc is ``crc``), then the sequence for
    version 4 on."""
    value = crc32c(body, crc)
    if trailer.covers_sequence:
        value = crc32c(_SEQUENCE.pack(trailer.sequence), value)
    return value


def split_body(body: memoryview, where: str) -> tuple[memoryview, memoryview]:
    """A verified body's pickle and record (empty without a footer: before format 6, or a
    metadata the record cannot hold)."""
    if len(body) < _FOOTER.size:
        return body, body[:0]
    magic, pickle_length, record_length = _FOOTER.unpack_from(body, len(body) - _FOOTER.size)
    if magic != FOOTER_MAGIC:
        return body, body[:0]
    if pickle_length + record_length + _FOOTER.size != len(body) or record_length == 0:
        raise CorruptCheckpointError(
            f"{where} is corrupt: its record footer (a {pickle_length}-byte pickle, a {record_length}-byte "
            f"record) does not match the {len(body) - _FOOTER.size} bytes before it"
        )
    return body[:pickle_length], body[pickle_length : pickle_length + record_length]


def split_metadata(blob: bytes, where: str) -> tuple[memoryview, memoryview, bool]:
    """The pickle and record parts of ``blob`` (the record empty before format 6) and whether
    a (verified) trailer was present. Without a trailer there is no record."""
    view = memoryview(blob)
    trailer = parse_trailer(blob[-_TRAILER.size :], len(blob), where)
    if trailer is None:
        return view, view[:0], False
    body = view[: trailer.body_length]
    actual = trailer_crc(body, trailer)
    if actual != trailer.crc:
        raise _checksum_error(where, actual, trailer.crc)
    pickled, record = split_body(body, where)
    return pickled, record, True


@dataclasses.dataclass(frozen=True)
class CommitStamp:
    """Which save a committed ``.metadata`` is, told by its last bytes alone: the commit
    sequence and the CRC-32C its trailer records (over the whole body, which holds the save
    id), and the file's size. A local checkpoint and its copy on a durable tier have equal
    stamps; two saves of one step have different ones (their save ids differ)."""

    sequence: int  # 0: none recorded (a format 3 trailer, or a save outside a manager)
    crc: int
    size: int


def is_same_save(a: CommitStamp | None, b: CommitStamp | None) -> bool:
    """Whether two copies of a step hold the very same save (the one rule: equal stamps; a copy
    whose stamp cannot be told is never the same as anything)."""
    return a is not None and a == b


def is_newer_save(a: CommitStamp | None, than: CommitStamp | None) -> bool:
    """Whether the copy stamped ``a`` holds a save committed after the one stamped ``than``
    (both known): the run went on from it elsewhere."""
    return a is not None and than is not None and a.sequence > than.sequence


def read_commit_stamp(path) -> CommitStamp | None:
    """The :class:`CommitStamp` of the ``.metadata`` at ``path`` (a local path, or an opened file
    of any store: ``storage.Store.open_file``; unverified), or None: missing, or no trailer to
    tell (format 2 and older, stock DCP), or a damaged trailer.

    Reads only the file's last 32 bytes: ordering the checkpoints of a root
    must not read every checkpoint's metadata. The stamp is covered by the
    metadata's checksum, so a damaged one is caught when that checkpoint is
    loaded.
    """
    try:
        with opened(path) as f:
            if f.size < _TRAILER_V3.size:
                return None
            return stamp_in_tail(f.pread(min(f.size, _TRAILER.size), max(0, f.size - _TRAILER.size)), f.size, f.path)
    except (FileNotFoundError, NotADirectoryError, CorruptCheckpointError):  # missing, a link, not a file
        return None


def stamp_in_tail(tail: bytes, file_size: int, where: str) -> CommitStamp | None:
    """The :class:`CommitStamp` in the last ``TRAILER_BYTES`` of a ``.metadata`` of ``file_size``
    bytes (unverified; None: no trailer, or a damaged one)."""
    try:
        trailer = parse_trailer(tail, file_size, where)
    except CorruptCheckpointError:
        return None
    return None if trailer is None else CommitStamp(trailer.sequence, trailer.crc, file_size)


def read_commit_sequence(path: str) -> int | None:
    """The commit sequence in the trailer of the ``.metadata`` at ``path`` (unverified), or None
    when the file is missing, has no trailer of version 4 or later, or carries sequence 0."""
    stamp = read_commit_stamp(path)
    return stamp.sequence or None if stamp is not None else None


def read_verified_body(f, trailer: Trailer) -> bytes:
    """The body of the opened ``.metadata`` ``f`` (``checkpoint_files.opened``) that ``trailer``
    ends: its CRC-32C streamed and checked before the body is held in memory, then read once
    and checked again (the bytes returned are the bytes verified)."""
    actual = trailer_crc(b"", trailer, f.crc32c(0, trailer.body_length))
    if actual != trailer.crc:
        raise _checksum_error(f.path, actual, trailer.crc)
    body = f.read(trailer.body_length)
    actual = trailer_crc(body, trailer)
    if actual != trailer.crc:  # it changed since it was checked
        raise _checksum_error(f.path, actual, trailer.crc)
    return body


def read_record(path) -> memoryview | None:
    """The plain record (format 6 on) of the ``.metadata`` at ``path`` (a local path, or an
    opened file of any store), its checksum verified; None when the file has none (no trailer:
    stock DCP, formats 1 and 2; or a metadata the record could not hold). Corruption raises
    :class:`CorruptCheckpointError` naming the file."""
    with opened(path) as f:
        tail = f.pread(min(f.size, _TRAILER.size), f.size - min(f.size, _TRAILER.size))
        trailer = parse_trailer(tail, f.size, f.path)
        if trailer is None:
            return None
        record = split_body(memoryview(read_verified_body(f, trailer)), f.path)[1]
    return record if len(record) else None


def _checksum_error(where: str, actual: int, stored: int) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"{where} is corrupt: checksum {actual:08x} does not match the stored {stored:08x}")
