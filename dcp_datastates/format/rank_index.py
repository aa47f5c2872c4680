"""The on-disk format of a dcp_datastates checkpoint.

A checkpoint is one directory::

    .metadata                      DCP Metadata (pickle + checksum trailer), written last, atomically
    rank00000-<sid>.data           raw bytes of rank 0's items at planned offsets
    rank00000-<sid>.index          rank 0's checksums and object table (binary)
    ...                            one .data/.index pair per rank

``<sid>`` is the save id, 12 hex digits, new for every save: files of a new
save never overwrite those of the committed one it replaces, so an
interrupted overwrite leaves the old checkpoint loadable.

``Metadata.storage_data`` holds a :class:`CheckpointLayout`: the format
version, the save id, the files, and for every saved item (a tensor chunk or
a pickled object) an :class:`ItemLocation`. On disk it is plain data since
format 5 (``storage_data.py``); in memory it is always a validated
:class:`CheckpointLayout`. Tensor bytes are raw, row-major, in the dtype
recorded in the metadata, at offsets fixed when the save was planned.
Python objects are placed after the tensors when they are serialized, so
their offsets live in the rank's index, found by ordinal.

The rank index is a fixed little-endian layout (no pickle)::

    0   8  magic b"DCPDSIDX"
    8   4  format version (u32)
    12  4  rank (u32)
    16 16  save id (ASCII hex, zero-padded)
    32  8  size of the data file in bytes (u64)
    40  8  number of checksum segments S (u64)
    48  8  number of objects M (u64)
    56     S x (offset u64, length u64, crc32c u32, reserved u32 = 0)
           M x (offset u64, length u64)
    end 4  crc32c of every preceding byte (u32)

Segments cover every stored byte: each item is split at the engine's write
windows. A read is widened to whole segments and must be tiled by them
exactly, so every byte handed to the caller has been verified.
"""

from __future__ import annotations

import dataclasses
import re
import struct
from bisect import bisect_left, bisect_right
from typing import NamedTuple, Sequence

from torch.distributed.checkpoint.metadata import MetadataIndex

from dcp_datastates.native.engine import crc32c
from dcp_datastates.errors import CorruptCheckpointError, UnsupportedFormatError

FORMAT_NAME = "dcp_datastates"
# 2: RankFiles may carry their own save id (files named by an asynchronous snapshot).
# 3: .metadata ends with a checksum trailer (see metadata_file.py).
# 4: the trailer carries the commit sequence (CheckpointManager's order of commits).
# 5: storage_data is plain data, no class of ours (storage_data.py); the index is unchanged.
FORMAT_VERSION = 5
METADATA_FILE = ".metadata"

INDEX_MAGIC = b"DCPDSIDX"
_HEADER = struct.Struct("<8sII16sQQQ")
_SEGMENT = struct.Struct("<QQII")
_OBJECT = struct.Struct("<QQ")
_TRAILER = struct.Struct("<I")
INDEX_HEADER, INDEX_TRAILER = _HEADER, _TRAILER
SEGMENT_ALIGN = 64  # every checksum segment starts at a multiple of this (see max_segments)

_SID_RE = re.compile(r"^[0-9a-f]{12}$")
DATA_FILE_RE = re.compile(r"^rank(\d{5,})-([0-9a-f]{12})\.(data|index)$")


def data_file_name(rank: int, save_id: str) -> str:
    return f"rank{rank:05d}-{save_id}.data"


def index_file_name(rank: int, save_id: str) -> str:
    return f"rank{rank:05d}-{save_id}.index"


def metadata_tmp_name(save_id: str) -> str:
    return f"{METADATA_FILE}.{save_id}.tmp"


def show(value, limit: int = 100) -> str:
    """``repr`` for error messages about untrusted values (a damaged object's repr may itself fail)."""
    try:
        text = repr(value)
    except Exception:  # noqa: BLE001
        return f"<a damaged {type(value).__name__}>"
    return text if len(text) <= limit else text[:limit] + "..."


def check_format_version(format_name, version, where: str) -> None:
    """Ours (``format``), and a version this code reads: else :class:`UnsupportedFormatError`."""
    if format_name != FORMAT_NAME:
        raise UnsupportedFormatError(f"{where}: storage format {show(format_name)} is not {FORMAT_NAME!r}")
    if not isinstance(version, int) or isinstance(version, bool) or not 1 <= version <= FORMAT_VERSION:
        raise UnsupportedFormatError(
            f"{where}: written with format version {show(version)}; this dcp_datastates "
            f"reads versions 1 to {FORMAT_VERSION}. Upgrade dcp_datastates to load it."
        )


def check_save_id(save_id: str, where: str) -> str:
    if not isinstance(save_id, str) or not _SID_RE.match(save_id):
        raise UnsupportedFormatError(f"{where}: malformed save id {show(save_id)} in checkpoint metadata")
    return save_id


class ItemLocation(NamedTuple):
    """Where one saved item lives: ``WriteResult.storage_data`` and per-key storage data.

    Tensor chunks: ``length`` raw bytes at ``offset`` of ``relative_path``.
    Objects: ``offset == length == -1`` and ``object_ordinal`` indexes the
    object table of the rank's index. Compressed tensor chunks (see
    :mod:`compression`): ``offset == -1``, ``length`` raw bytes, and
    ``object_ordinal`` is the first of their consecutive blocks in the object
    table. A NamedTuple: built and compared for every item of every save, so
    it must be cheap.
    """

    relative_path: str
    offset: int
    length: int
    object_ordinal: int = -1

    @property
    def is_object(self) -> bool:
        return self.object_ordinal >= 0 and self.length < 0

    @property
    def is_compressed(self) -> bool:
        return self.object_ordinal >= 0 and self.length >= 0


@dataclasses.dataclass
class RankFiles:
    """A rank's two files. ``save_id`` is the id in their names and index when it is not
    the checkpoint's own (asynchronous saves name their files before the coordinator
    picks the checkpoint's id); empty otherwise."""

    rank: int
    data_file: str
    index_file: str
    save_id: str = ""

    def __setstate__(self, state):  # in-process copies only: on disk a rank is a plain tuple
        _set_fields_strictly(self, state, RANK_FILES_FIELDS)

    def files_save_id(self, checkpoint_save_id: str) -> str:
        return getattr(self, "save_id", "") or checkpoint_save_id


RANK_FILES_FIELDS = {"rank": int, "data_file": str, "index_file": str, "save_id": str}
LAYOUT_FIELDS = {
    "format": str, "version": int, "save_id": str, "ranks": list, "entries": list, "compression": (tuple, type(None)),
}


def strict_fields(name: str, state, kinds: dict, defaults: dict) -> dict:
    """The fields of a ``name`` object from its pickled ``state``: exactly ``kinds``' names.

    A state from a damaged or hostile ``.metadata`` fails here with a
    :class:`CorruptCheckpointError` (the metadata reader adds the file's
    name): not a dict, a name that is not a field (``_table``, ``validate``:
    attributes that would shadow ours), a field not of its kind (bools are
    no ints), or a field without a default missing. A field with a default
    that the state lacks was added by a later format version and gets its
    default.
    """

    def bad(why: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"the storage layout is corrupt: a {name} {why}")

    if not isinstance(state, dict):
        raise bad(f"has a {type(state).__name__} state, not a dict of its fields")
    unknown = [k for k in state if k not in kinds]
    if unknown:
        raise bad(f"has fields {show(unknown)}, which it does not have")
    values = {}
    for field_name, kind in kinds.items():
        if field_name in state:
            value = state[field_name]
            if not isinstance(value, kind) or isinstance(value, bool):
                raise bad(f"has a {type(value).__name__} as its {field_name}")
        elif field_name in defaults:
            value = defaults[field_name]
        else:
            raise bad(f"lacks its {field_name}")
        values[field_name] = value
    return values


def _set_fields_strictly(obj, state, kinds: dict) -> None:
    """``__setstate__`` of our dataclasses (in-process copies): :func:`strict_fields` of their
    fields (``kinds`` names every one), with the dataclass's defaults."""
    defaults = {f.name: f.default for f in dataclasses.fields(obj) if f.default is not dataclasses.MISSING}
    obj.__dict__.update(strict_fields(type(obj).__name__, state, kinds, defaults))


COMPRESSION_CODECS = ("zstd",)


def check_compression(compression, where: str) -> None:
    """A layout's ``compression``: None, or ``(codec, block_bytes)`` with a codec we can decode."""
    if compression is None:
        return
    if not (isinstance(compression, tuple) and len(compression) == 2 and isinstance(compression[1], int)):
        raise CorruptCheckpointError(f"{where}: the storage layout is corrupt: compression {show(compression)}")
    codec, block_bytes = compression
    if codec not in COMPRESSION_CODECS:
        raise UnsupportedFormatError(
            f"{where}: tensors are compressed with {show(codec)}; this dcp_datastates decodes "
            f"{', '.join(COMPRESSION_CODECS)}. Upgrade dcp_datastates to load it."
        )
    # Blocks split chunks of any dtype (itemsize up to 16) and are read into buffers of their size.
    if not 0 < block_bytes <= MAX_BLOCK_BYTES or block_bytes % BLOCK_ALIGN:
        raise CorruptCheckpointError(f"{where}: the storage layout is corrupt: compression block size {block_bytes}")


BLOCK_ALIGN = 64  # a compression block size is a multiple of every dtype's itemsize
MAX_BLOCK_BYTES = 1 << 30


def compressed_blocks(length: int, block_bytes: int) -> int:
    """How many blocks a compressed chunk of ``length`` raw bytes is stored as."""
    return -(-length // block_bytes)


def location_key(fqn: str, offset) -> tuple:
    """``(fqn, chunk offsets as a tuple or None)``: how ``CheckpointLayout.entries`` name an item."""
    return (fqn, tuple(offset) if offset is not None else None)


@dataclasses.dataclass
class CheckpointLayout:
    """``Metadata.storage_data`` of a dcp_datastates checkpoint, in memory.

    ``entries`` holds one plain tuple per saved item,
    ``(fqn, chunk_offsets or None, rank, offset, length, object_ordinal)``:
    plain tuples pickle several times faster than one object per item,
    which matters for states of tens of thousands of tensors. Lookups by
    ``MetadataIndex`` go through a dict built on first use.

    It is never pickled into ``.metadata``: ``encode_metadata`` stores its
    plain form and decoding rebuilds it (``storage_data.py``), so this class
    may move or change without breaking a checkpoint. Its pickling methods
    serve in-process copies only.
    """

    format: str
    version: int
    save_id: str
    ranks: list[RankFiles]
    entries: list[tuple]
    # None, or (codec, block_bytes) when large tensor chunks are stored compressed
    # (see compression.py); layouts pickled by versions 1-3 get None.
    compression: tuple | None = None

    def __getstate__(self):
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def __setstate__(self, state):
        # Strict: a hostile pickle could otherwise set any attribute (a cached ``_table``,
        # a method). Fields added later (with a default, e.g. compression) get the default.
        _set_fields_strictly(self, state, LAYOUT_FIELDS)

    def _lookup(self) -> dict:
        table = self.__dict__.get("_table")
        if table is None:
            files = {r.rank: r.data_file for r in self.ranks}
            table = {}
            for fqn, off, rank, offset, length, ordinal in self.entries:
                if rank not in files:
                    raise CorruptCheckpointError(f"metadata places {fqn!r} in rank {rank}, which has no files")
                table[(fqn, off)] = ItemLocation(files[rank], offset, length, ordinal)
            self.__dict__["_table"] = table
        return table

    def check_covers(self, metadata, where: str) -> None:
        """Every item the metadata lists has a stored location (of the right kind)."""
        table = self._lookup()
        for fqn, md in metadata.state_dict_metadata.items():
            chunks = getattr(md, "chunks", None)
            keys = [(fqn, None)] if chunks is None else [(fqn, tuple(c.offsets)) for c in chunks]
            for key in keys:
                loc = table.get(key)
                if loc is None or loc.is_object != (chunks is None):
                    raise CorruptCheckpointError(
                        f"{where}: the storage layout is corrupt: {fqn!r} (at {key[1]}) has no stored location"
                    )

    def location(self, index: MetadataIndex) -> ItemLocation | None:
        return self._lookup().get(location_key(index.fqn, index.offset))

    @property
    def locations(self) -> dict[MetadataIndex, ItemLocation]:
        """Every item's location keyed by ``MetadataIndex`` (for tools; builds a new dict)."""
        return {MetadataIndex(fqn, off): loc for (fqn, off), loc in self._lookup().items()}

    def validate(self, where: str) -> None:
        missing = [f.name for f in dataclasses.fields(self) if f.name not in self.__dict__]
        if missing:
            raise CorruptCheckpointError(f"{where}: the storage layout is corrupt: it lacks {', '.join(missing)}")
        check_format_version(self.format, self.version, where)
        check_save_id(self.save_id, where)
        check_compression(self.compression, where)
        self._validate_structure(where)

    def _validate_structure(self, where: str) -> None:
        """Types and names a well-formed layout has: nothing later trips on a hostile edit.

        File names must be our plain rank-file names (no directories: a
        checkpoint never makes the reader open a file outside itself).
        """

        def bad(why: str) -> CorruptCheckpointError:
            return CorruptCheckpointError(f"{where}: the storage layout is corrupt: {why}")

        if not isinstance(self.ranks, list) or not isinstance(self.entries, list):
            raise bad("its rank list or item list is not a list")
        ranks = set()
        for r in self.ranks:
            rank = getattr(r, "rank", None)
            if not isinstance(r, RankFiles) or not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
                raise bad(f"rank entry {show(r)}")
            sid = getattr(r, "save_id", "")
            if sid and not (isinstance(sid, str) and _SID_RE.match(sid)):
                raise bad(f"rank {rank}'s save id {show(sid)}")
            for name, kind in ((getattr(r, "data_file", None), "data"), (getattr(r, "index_file", None), "index")):
                m = DATA_FILE_RE.match(name) if isinstance(name, str) else None
                if m is None or m.group(3) != kind or int(m.group(1)) != rank:
                    raise bad(f"rank {rank}'s {kind} file name {show(name)} is not a rank file name")
            if rank in ranks:
                raise bad(f"rank {rank} is listed twice")
            ranks.add(rank)
        for e in self.entries:
            if not (isinstance(e, tuple) and len(e) == 6 and isinstance(e[0], str)):
                raise bad(f"item entry {show(e)}")
            fqn, off, rank, offset, length, ordinal = e
            if off is not None and not (isinstance(off, tuple) and all(isinstance(x, int) for x in off)):
                raise bad(f"{fqn!r} has chunk offsets {show(off)}")
            if not all(isinstance(x, int) for x in (rank, offset, length, ordinal)):
                raise bad(f"{fqn!r} has a non-integer location")
            if not all(-1 <= x < 1 << 63 for x in (rank, offset, length, ordinal)):
                raise bad(f"{fqn!r} has a location out of range: {show(e[2:])}")
            if rank not in ranks:
                raise bad(f"{fqn!r} is placed in rank {rank}, which has no files")
            if ordinal >= 0 and length >= 0:  # a compressed tensor chunk: its blocks start at ordinal
                if self.compression is None or off is None or offset != -1:
                    raise bad(f"{fqn!r} is stored as compressed blocks, but the layout records no compression")
                continue
            if ordinal >= 0:
                continue
            if offset < 0 or length < 0:
                raise bad(f"{fqn!r} is stored at offset {offset} with length {length}")


@dataclasses.dataclass
class RankIndex:
    """Decoded per-rank index: checksums and object table."""

    rank: int
    save_id: str
    data_size: int
    seg_offsets: list[int]
    seg_lengths: list[int]
    seg_crcs: list[int]
    objects: list[tuple[int, int]]

    def covering_range(self, start: int, length: int) -> tuple[int, int]:
        """The byte range of the segments that overlap ``[start, start+length)``.

        Reading that range lets every byte of the request be verified, even
        when the request is a slice that cuts through segments (resharding).
        """
        offs, lens = self.seg_offsets, self.seg_lengths
        end = start + length
        i = bisect_right(offs, start) - 1
        lo = offs[i] if i >= 0 and offs[i] + lens[i] > start else start
        j = bisect_left(offs, end) - 1
        hi = offs[j] + lens[j] if j >= 0 and offs[j] < end and offs[j] + lens[j] > end else end
        return lo, hi

    def checks_within(self, start: int, length: int) -> list[tuple[int, int, int]]:
        """Checksum segments lying wholly inside ``[start, start+length)``, relative to start."""
        end = start + length
        out = []
        i = bisect_left(self.seg_offsets, start)
        offs, lens, crcs = self.seg_offsets, self.seg_lengths, self.seg_crcs
        while i < len(offs) and offs[i] + lens[i] <= end:
            out.append((offs[i] - start, lens[i], crcs[i]))
            i += 1
        return out

    def checks_tiling(self, start: int, length: int, path: str, key: str) -> list[tuple[int, int, int]]:
        """The segments of ``[start, start+length)``, which must tile it exactly.

        Every stored byte is covered by a segment, so a gap means the index
        (or the metadata's offsets) was damaged or edited: without this check
        such bytes would reach the caller unverified.
        """
        checks = self.checks_within(start, length)
        pos = 0
        for rel, n, _ in checks:
            if rel != pos:
                break
            pos += n
        if pos != length:
            raise CorruptCheckpointError(
                f"{path}: bytes {start + pos}..{start + length} of {key!r} are not covered by the "
                "rank index's checksums (the index or the metadata is damaged)"
            )
        return checks


def encode_index(
    rank: int,
    save_id: str,
    data_size: int,
    segments: Sequence[tuple[int, int, int]],
    objects: Sequence[tuple[int, int]],
) -> bytes:
    parts = [
        _HEADER.pack(
            INDEX_MAGIC, FORMAT_VERSION, rank, save_id.encode("ascii").ljust(16, b"\0"),
            data_size, len(segments), len(objects),
        )
    ]
    parts.extend(_SEGMENT.pack(o, n, c, 0) for o, n, c in segments)
    parts.extend(_OBJECT.pack(o, n) for o, n in objects)
    body = b"".join(parts)
    return body + _TRAILER.pack(crc32c(body))


class IndexLimits(NamedTuple):
    """What a rank's index can claim, known before it is read (its header is checked against it).

    ``data_file_size``: the size of the rank's data file (``data_size`` cannot
    exceed it); ``objects``: the entries of the rank's object table that
    ``.metadata`` refers to (its objects and the blocks of its compressed chunks).
    """

    data_path: str
    data_file_size: int
    objects: int


def max_segments(data_size: int) -> int:
    """The most checksum segments ``data_size`` bytes of a data file can have.

    Segments are non-empty and do not overlap, and each starts at a multiple
    of ``SEGMENT_ALIGN``: the engine cuts each stored region at its write
    windows (csrc/engine.cpp), a region starts at a 64-byte boundary (small
    tensors, objects and compressed frames are packed at 64 bytes, larger
    tensors start at 4 KiB), and a window at a 4 KiB one. (The count of
    tensors in ``.metadata`` does not bound it: an asynchronous save's data
    file also holds replicated tensors the metadata takes from another rank.)
    """
    return -(-data_size // SEGMENT_ALIGN)


def object_entries(layout: CheckpointLayout) -> dict[int, int]:
    """``{rank: object-table entries the validated layout refers to}`` (for :class:`IndexLimits`)."""
    objects = {r.rank: 0 for r in layout.ranks}
    block = layout.compression[1] if layout.compression is not None else 0
    for _fqn, _off, rank, _offset, length, ordinal in layout.entries:
        if ordinal >= 0:
            span = compressed_blocks(length, block) if length >= 0 and block else 1
            objects[rank] = max(objects.get(rank, 0), ordinal + span)
    return objects


def check_index_header(header: tuple, file_size: int, path: str, limits: IndexLimits | None) -> None:
    """Refuse an index by its header alone: before it is read, so a huge one costs nothing.

    The header's counts must describe exactly ``file_size`` bytes, and stay
    within what the checkpoint can hold: segments at most
    :func:`max_segments` of ``data_size``; with ``limits``, ``data_size`` at
    most the data file's size and objects at most the entries the layout
    refers to.
    """

    def bad(why: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"rank index {path} is corrupt: {why}")

    magic, version, _rank, _sid, data_size, nseg, nobj = header
    if magic != INDEX_MAGIC:
        raise bad(f"bad magic {magic!r}")
    if version > FORMAT_VERSION or version < 1:
        raise UnsupportedFormatError(
            f"rank index {path} has format version {version}; this dcp_datastates reads "
            f"versions 1 to {FORMAT_VERSION}"
        )
    expected = _HEADER.size + nseg * _SEGMENT.size + nobj * _OBJECT.size + _TRAILER.size
    if file_size != expected:
        raise bad(f"size {file_size} does not match {nseg} segments and {nobj} objects ({expected} bytes)")
    if nseg > max_segments(data_size):
        raise bad(f"it lists {nseg} checksum segments; {data_size} bytes hold at most {max_segments(data_size)}")
    if limits is None:
        return
    if data_size > limits.data_file_size:
        raise CorruptCheckpointError(
            f"data file {limits.data_path} is truncated: {limits.data_file_size} bytes, its index "
            f"{path} says {data_size}"
        )
    if nobj > limits.objects:
        raise bad(f"it lists {nobj} objects; the metadata refers to {limits.objects} in this rank")


def decode_index(blob: bytes, path: str, limits: IndexLimits | None = None) -> RankIndex:
    """Parse and strictly validate an index; every inconsistency names ``path``.

    ``limits`` (what the layout and the data file allow) bounds its counts; a
    file is read by :func:`checkpoint_files.read_rank_index`, which checks
    the header and the checksum before it reads the file whole.
    """

    def bad(why: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"rank index {path} is corrupt: {why}")

    if len(blob) < _HEADER.size + _TRAILER.size:
        raise bad(f"{len(blob)} bytes is shorter than the header")
    magic, version, rank, sid, data_size, nseg, nobj = header = _HEADER.unpack_from(blob, 0)
    check_index_header(header, len(blob), path, limits)
    (stored_crc,) = _TRAILER.unpack_from(blob, len(blob) - _TRAILER.size)
    actual_crc = crc32c(memoryview(blob)[: len(blob) - _TRAILER.size])
    if stored_crc != actual_crc:
        raise bad(f"index checksum {actual_crc:08x} does not match stored {stored_crc:08x}")
    save_id = sid.rstrip(b"\0").decode("ascii", "replace")
    seg_off, seg_len, seg_crc = [], [], []
    pos = _HEADER.size
    prev_end = 0
    for o, n, c, _ in _SEGMENT.iter_unpack(blob[pos : pos + nseg * _SEGMENT.size]):
        if n == 0 or o < prev_end or o + n > data_size:
            raise bad(f"segment at offset {o} (+{n}) is empty, overlaps its predecessor or lies past the data size {data_size}")
        prev_end = o + n
        seg_off.append(o)
        seg_len.append(n)
        seg_crc.append(c)
    pos += nseg * _SEGMENT.size
    objects = []
    for o, n in _OBJECT.iter_unpack(blob[pos : pos + nobj * _OBJECT.size]):
        if o + n > data_size:
            raise bad(f"object at offset {o} (+{n}) lies past the data size {data_size}")
        objects.append((o, n))
    return RankIndex(rank, save_id, data_size, seg_off, seg_len, seg_crc, objects)
