"""The rank index: one rank's checksums and object table, a fixed little-endian layout (no pickle)::

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

Offsets are the rank's data offsets: with stripes (format 7,
``RankFiles.stripes``) the bytes from a stripe's start live at the start of
that stripe's file, and no segment or object crosses a stripe's start
(:meth:`RankIndex.apply_stripes`). Segments cover every stored byte: each item is split at the engine's write
windows. A read is widened to whole segments and must be tiled by them
exactly, so every byte handed to the caller has been verified. Objects (and
the frames of compressed chunks) are found by ordinal in the object table:
their offsets are known only once they are serialized.
"""

from __future__ import annotations

import dataclasses
import functools
import struct
from bisect import bisect_left, bisect_right
from typing import TYPE_CHECKING, NamedTuple, Sequence

if TYPE_CHECKING:
    import numpy as np

from dcp_datastates.errors import CorruptCheckpointError, UnsupportedFormatError
from dcp_datastates.format.checkpoint_layout import FORMAT_VERSION, stripe_span
from dcp_datastates.native.engine import SegmentTable, crc32c

INDEX_MAGIC = b"DCPDSIDX"
_HEADER = struct.Struct("<8sII16sQQQ")
_SEGMENT = struct.Struct("<QQII")


@functools.cache
def segment_record() -> np.dtype:
    """A segment record as numpy sees it (offset, nbytes, crc32c, reserved): what the engine's
    WriteJob.wait_records() hands over and encode_index writes as it is. numpy is imported at
    the first use, not with the format: the listing tools read no rank index."""
    import numpy as np

    dtype = np.dtype([("o", "<u8"), ("n", "<u8"), ("c", "<u4"), ("r", "<u4")])
    assert dtype.itemsize == _SEGMENT.size
    return dtype


_OBJECT = struct.Struct("<QQ")
_TRAILER = struct.Struct("<I")
INDEX_HEADER, INDEX_TRAILER = _HEADER, _TRAILER
SEGMENT_ALIGN = 64  # every checksum segment starts at a multiple of this (see max_segments)


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
    # The rank's data files (stripe by stripe) and where stripes 1, 2, ... start: set by
    # apply_stripes from the layout's RankFiles; one file (the data file) before.
    stripe_files: list[str] = dataclasses.field(default_factory=list)
    stripes: tuple = ()
    _tables: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)

    def apply_stripes(self, data_files: list[str], stripes: tuple, path: str) -> None:
        """Take the rank's stripes (its ``RankFiles``, validated) after checking that this index
        fits them: its data ends after the last stripe's start, and no segment or object
        crosses a stripe's start (each is read from one file)."""
        if stripes and self.data_size <= stripes[-1]:
            raise CorruptCheckpointError(
                f"rank index {path} is corrupt: its data ends at {self.data_size}, before its last stripe starts ({stripes[-1]})"
            )
        for start in stripes:
            i = bisect_left(self.seg_offsets, start)
            if i and self.seg_offsets[i - 1] + self.seg_lengths[i - 1] > start:
                raise CorruptCheckpointError(
                    f"rank index {path} is corrupt: the segment at offset {self.seg_offsets[i - 1]} crosses the start of a stripe at {start}"
                )
            for o, n in self.objects:
                if o < start < o + n:
                    raise CorruptCheckpointError(
                        f"rank index {path} is corrupt: the object at offset {o} crosses the start of a stripe at {start}"
                    )
        self.stripe_files, self.stripes = list(data_files), tuple(stripes)
        self._tables = {}

    def stripe_bounds(self) -> list[tuple[int, int]]:
        """``(start, end)`` of each stripe's data (one stripe: ``(0, data_size)``)."""
        starts = [0, *self.stripes]
        return list(zip(starts, starts[1:] + [self.data_size]))

    def stripe_of(self, offset: int) -> tuple[int, int, int]:
        """``(stripe, start, end)`` of the stripe holding data offset ``offset``."""
        return stripe_span(self.stripes, offset, self.data_size)

    def stripe_segments(self, stripe: int) -> range:
        """The indices of the segments in ``stripe``."""
        start, end = self.stripe_bounds()[stripe]
        return range(bisect_left(self.seg_offsets, start), bisect_left(self.seg_offsets, end))

    def segment_table(self, stripe: int = 0) -> SegmentTable:
        """The segments as the engine's table (made once): a read given it as ``verify_with``
        takes its checks from it natively, and fails if they do not tile its range. With
        stripes, the table of ``stripe``'s segments, at offsets in its file."""
        table = self._tables.get(stripe)
        if table is None:
            if not self.stripes:
                table = SegmentTable(offsets=self.seg_offsets, lengths=self.seg_lengths, crc32cs=self.seg_crcs)
            else:
                rows = self.stripe_segments(stripe)
                base = self.stripe_bounds()[stripe][0]
                table = SegmentTable(
                    offsets=[self.seg_offsets[i] - base for i in rows],
                    lengths=self.seg_lengths[rows.start : rows.stop],
                    crc32cs=self.seg_crcs[rows.start : rows.stop],
                )
            self._tables[stripe] = table
        return table

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

    def _whole_table(self) -> SegmentTable:
        """Every segment at its data offset (the same as ``segment_table(0)`` without stripes)."""
        if not self.stripes:
            return self.segment_table(0)
        table = self._tables.get("all")
        if table is None:
            table = self._tables["all"] = SegmentTable(
                offsets=self.seg_offsets, lengths=self.seg_lengths, crc32cs=self.seg_crcs
            )
        return table

    def check_tiled(self, start: int, length: int, path: str, key: str) -> None:
        """Refuse ``[start, start+length)`` unless the segments inside it tile it exactly.

        Every stored byte is covered by a segment, so a gap means the index
        (or the metadata's offsets) was damaged or edited: without this check
        such bytes would reach the caller unverified. The engine applies the
        same rule to a read made with ``verify_with=self.segment_table()``.
        """
        gap = self._whole_table().first_gap(start, length)
        if gap is not None:
            raise CorruptCheckpointError(
                f"{path}: bytes {gap[0]}..{gap[1]} of {key!r} are not covered by the "
                "rank index's checksums (the index or the metadata is damaged)"
            )


def encode_index(
    rank: int,
    save_id: str,
    data_size: int,
    segments: Sequence[tuple[int, int, int]] | np.ndarray,
    objects: Sequence[tuple[int, int]],
) -> bytes:
    """``segments``: ``(offset, nbytes, crc32c)`` tuples (a list), or an array of :func:`segment_record`."""
    parts = [
        _HEADER.pack(
            INDEX_MAGIC, FORMAT_VERSION, rank, save_id.encode("ascii").ljust(16, b"\0"),
            data_size, len(segments), len(objects),
        )
    ]
    if hasattr(segments, "dtype"):  # an array of segment_record()
        import numpy as np

        parts.append(np.ascontiguousarray(segments, dtype=segment_record()).tobytes())
    else:
        parts.extend(_SEGMENT.pack(o, n, c, 0) for o, n, c in segments)
    parts.extend(_OBJECT.pack(o, n) for o, n in objects)
    body = b"".join(parts)
    return body + _TRAILER.pack(crc32c(body))


class IndexLimits(NamedTuple):
    """What a rank's index can claim, known before it is read (its header is checked against it).

    ``data_file_size``: the size of the rank's data file, its last stripe's
    with stripes, which holds data offsets from ``data_start`` on (``data_size``
    cannot exceed their sum); ``objects``: the entries of the rank's object
    table that ``.metadata`` refers to (its objects and the blocks of its
    compressed chunks).
    """

    data_path: str
    data_file_size: int
    objects: int
    data_start: int = 0


def max_segments(data_size: int) -> int:
    """The most checksum segments ``data_size`` bytes of a data file can have.

    Segments are non-empty and do not overlap, and each starts at a multiple
    of ``SEGMENT_ALIGN``: the engine cuts each stored region at its write
    windows and at multiples of the writer's ``checksum_bytes`` (csrc/engine.cpp,
    4 KiB or more), a region starts at a 64-byte boundary (small
    tensors, objects and compressed frames are packed at 64 bytes, larger
    tensors start at 4 KiB), and a window at a 4 KiB one. (The count of
    tensors in ``.metadata`` does not bound it: an asynchronous save's data
    file also holds replicated tensors the metadata takes from another rank.)
    """
    return -(-data_size // SEGMENT_ALIGN)


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
    if data_size > limits.data_start + limits.data_file_size:
        held = f" from data offset {limits.data_start} on" if limits.data_start else ""
        raise CorruptCheckpointError(
            f"data file {limits.data_path} is truncated: it holds {limits.data_file_size} bytes{held}, its index "
            f"{path} says the data ends at {data_size}"
        )
    if nobj > limits.objects:
        raise bad(f"it lists {nobj} objects; the metadata refers to {limits.objects} in this rank")




def _decode_segments(blob: bytes, pos: int, nseg: int, data_size: int, bad) -> tuple[list, list, list]:
    """The segment records at ``pos``, checked in one vectorized pass (small segments make
    hundreds of thousands per rank): non-empty, in order without overlap, inside the data."""
    import numpy as np

    rows = np.frombuffer(blob, dtype=segment_record(), count=nseg, offset=pos)
    o, n = rows["o"], rows["n"]
    size = np.uint64(data_size)
    # o > size first: size - o would wrap there (a segment flagged anyway, so never the
    # wrapped sum of one before it decides).
    wrong = (n == 0) | (o > size) | (n > size - np.minimum(o, size))
    wrong[1:] |= o[1:] < o[:-1] + n[:-1]
    if wrong.any():
        i = int(np.argmax(wrong))
        raise bad(
            f"segment at offset {int(o[i])} (+{int(n[i])}) is empty, overlaps its predecessor or lies past the "
            f"data size {data_size}"
        )
    return o.tolist(), n.tolist(), rows["c"].tolist()


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
    pos = _HEADER.size
    seg_off, seg_len, seg_crc = _decode_segments(blob, pos, nseg, data_size, bad)
    pos += nseg * _SEGMENT.size
    objects = []
    for o, n in _OBJECT.iter_unpack(blob[pos : pos + nobj * _OBJECT.size]):
        if o + n > data_size:
            raise bad(f"object at offset {o} (+{n}) lies past the data size {data_size}")
        objects.append((o, n))
    return RankIndex(rank, save_id, data_size, seg_off, seg_len, seg_crc, objects)
