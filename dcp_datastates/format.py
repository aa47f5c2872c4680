"""The on-disk format of a dcp_datastates checkpoint.

A checkpoint is one directory::

    .metadata                      DCP Metadata (pickle + checksum trailer), written last, atomically
    rank00000-<sid>.data           raw bytes of rank 0's items at planned offsets
    rank00000-<sid>.index          rank 0's checksums and object table (binary)
    ...                            one .data/.index pair per rank

``<sid>`` is the save id, 12 hex digits, new for every save: files of a new
save never overwrite those of the committed one it replaces, so an
interrupted overwrite leaves the old checkpoint loadable.

``Metadata.storage_data`` is a :class:`CheckpointLayout`: the format version,
the save id, the files, and for every saved item (a tensor chunk or a pickled
object) an :class:`ItemLocation`. Tensor bytes are raw, row-major, in the
dtype recorded in the metadata, at offsets fixed when the save was planned.
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

from ._native import crc32c
from .errors import CorruptCheckpointError, UnsupportedFormatError

FORMAT_NAME = "dcp_datastates"
# 2: RankFiles may carry their own save id (files named by an asynchronous snapshot).
# 3: .metadata ends with a checksum trailer (see metadata_file.py).
# 4: the trailer carries the commit sequence (CheckpointManager's order of commits).
FORMAT_VERSION = 4
METADATA_FILE = ".metadata"

INDEX_MAGIC = b"DCPDSIDX"
_HEADER = struct.Struct("<8sII16sQQQ")
_SEGMENT = struct.Struct("<QQII")
_OBJECT = struct.Struct("<QQ")
_TRAILER = struct.Struct("<I")

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


def check_save_id(save_id: str) -> str:
    if not isinstance(save_id, str) or not _SID_RE.match(save_id):
        raise UnsupportedFormatError(f"malformed save id {show(save_id)} in checkpoint metadata")
    return save_id


class ItemLocation(NamedTuple):
    """Where one saved item lives: ``WriteResult.storage_data`` and per-key storage data.

    Tensor chunks: ``length`` raw bytes at ``offset`` of ``relative_path``.
    Objects: ``offset == length == -1`` and ``object_ordinal`` indexes the
    object table of the rank's index. A NamedTuple: built and compared for
    every item of every save, so it must be cheap.
    """

    relative_path: str
    offset: int
    length: int
    object_ordinal: int = -1

    @property
    def is_object(self) -> bool:
        return self.object_ordinal >= 0


@dataclasses.dataclass
class RankFiles:
    """A rank's two files. ``save_id`` is the id in their names and index when it is not
    the checkpoint's own (asynchronous saves name their files before the coordinator
    picks the checkpoint's id); empty otherwise."""

    rank: int
    data_file: str
    index_file: str
    save_id: str = ""

    def files_save_id(self, checkpoint_save_id: str) -> str:
        return getattr(self, "save_id", "") or checkpoint_save_id


def location_key(fqn: str, offset) -> tuple:
    """``(fqn, chunk offsets as a tuple or None)``: how ``CheckpointLayout.entries`` name an item."""
    return (fqn, tuple(offset) if offset is not None else None)


@dataclasses.dataclass
class CheckpointLayout:
    """``Metadata.storage_data`` of a dcp_datastates checkpoint.

    ``entries`` holds one plain tuple per saved item,
    ``(fqn, chunk_offsets or None, rank, offset, length, object_ordinal)``:
    plain tuples pickle several times faster than one object per item,
    which matters for states of tens of thousands of tensors. Lookups by
    ``MetadataIndex`` go through a dict built on first use.
    """

    format: str
    version: int
    save_id: str
    ranks: list[RankFiles]
    entries: list[tuple]

    def __getstate__(self):
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def __setstate__(self, state):
        self.__dict__.update(state)

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
        if self.format != FORMAT_NAME:
            raise UnsupportedFormatError(f"{where}: storage format {show(self.format)} is not {FORMAT_NAME!r}")
        if not isinstance(self.version, int) or self.version > FORMAT_VERSION or self.version < 1:
            raise UnsupportedFormatError(
                f"{where}: written with format version {show(self.version)}; this dcp_datastates "
                f"reads versions 1 to {FORMAT_VERSION}. Upgrade dcp_datastates to load it."
            )
        check_save_id(self.save_id)
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
            if not isinstance(r, RankFiles) or not isinstance(rank, int) or rank < 0:
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
            if rank not in ranks:
                raise bad(f"{fqn!r} is placed in rank {rank}, which has no files")
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


def decode_index(blob: bytes, path: str) -> RankIndex:
    """Parse and strictly validate an index; every inconsistency names ``path``."""

    def bad(why: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"rank index {path} is corrupt: {why}")

    if len(blob) < _HEADER.size + _TRAILER.size:
        raise bad(f"{len(blob)} bytes is shorter than the header")
    magic, version, rank, sid, data_size, nseg, nobj = _HEADER.unpack_from(blob, 0)
    if magic != INDEX_MAGIC:
        raise bad(f"bad magic {magic!r}")
    if version > FORMAT_VERSION or version < 1:
        raise UnsupportedFormatError(
            f"rank index {path} has format version {version}; this dcp_datastates reads "
            f"versions 1 to {FORMAT_VERSION}"
        )
    expected = _HEADER.size + nseg * _SEGMENT.size + nobj * _OBJECT.size + _TRAILER.size
    if len(blob) != expected:
        raise bad(f"size {len(blob)} does not match {nseg} segments and {nobj} objects ({expected} bytes)")
    (stored_crc,) = _TRAILER.unpack_from(blob, len(blob) - _TRAILER.size)
    actual_crc = crc32c(memoryview(blob)[: len(blob) - _TRAILER.size])
    if stored_crc != actual_crc:
        raise bad(f"index checksum {actual_crc:08x} does not match stored {stored_crc:08x}")
    save_id = sid.rstrip(b"\0").decode("ascii", "replace")
    seg_off, seg_len, seg_crc = [], [], []
    pos = _HEADER.size
    prev_end = 0
    for o, n, c, _ in _SEGMENT.iter_unpack(blob[pos : pos + nseg * _SEGMENT.size]):
        if o < prev_end or o + n > data_size:
            raise bad(f"segment at offset {o} (+{n}) overlaps its predecessor or lies past the data size {data_size}")
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
