"""Checking bytes against a rank index's checksum segments as they arrive, in order: a file
streamed to a store by the drain, a range an object store returned. The one check besides the
engine's own (which verifies the ranges it reads natively)."""

from __future__ import annotations

from dcp_datastates.errors import CorruptCheckpointError
from dcp_datastates.format.checkpoint_files import read_rank_index
from dcp_datastates.format.checkpoint_layout import RankFiles
from dcp_datastates.format.rank_index import IndexLimits, RankIndex, decode_index
from dcp_datastates.native.engine import crc32c


def rank_index_of(source, files: RankFiles, data_sizes: list[int] | None, where: str) -> RankIndex:
    """The index of the rank whose files are ``files``, checked against its data files' sizes
    (``data_sizes``, stripe by stripe; None: not known) and with its stripes applied, so that its segments check
    each data file as it is streamed (:meth:`SegmentChecker.of_stripe`). ``source``: the index
    file (a path, or an opened file of a store), or its bytes (received from another rank);
    ``where`` names it."""
    names = files.data_files()
    limits = None if data_sizes is None else IndexLimits(
        f"{where.rsplit('/', 1)[0]}/{names[-1]}", data_sizes[-1], 1 << 62, files.stripes[-1] if files.stripes else 0)
    if isinstance(source, (bytes, bytearray, memoryview)):
        index = decode_index(bytes(source), where, limits)
    else:
        index = read_rank_index(source, limits)
    index.apply_stripes(names, files.stripes, where)
    return index


class SegmentMismatch(CorruptCheckpointError):
    """A segment whose bytes do not have its CRC-32C; ``detail`` says which, without the path."""

    def __init__(self, message: str, detail: str, offset: int) -> None:
        super().__init__(message)
        self.detail, self.offset = detail, offset


class SegmentChecker:
    """Checks bytes fed in order (``feed(view, at)``, ``at`` the offset of ``view``) against the
    segments at ``offsets``, ``lengths`` and ``crcs`` (sorted, at the same offsets); every
    segment must be seen whole (``finish``) and match. ``consequence``: what a mismatch means,
    for its message."""

    def __init__(self, offsets, lengths, crcs, path: str, consequence: str) -> None:
        self.offsets, self.lengths, self.crcs = offsets, lengths, crcs
        self.path = path
        self.consequence = consequence
        self.next = 0
        self.partial: int | None = None  # the running CRC of a segment cut by a block's end

    @classmethod
    def of_stripe(cls, index: RankIndex, stripe: int, path: str,
                  consequence: str = "the local copy is damaged and is not drained") -> SegmentChecker:
        """The segments of a data file (``stripe`` of the rank), at offsets in that file."""
        rows = index.stripe_segments(stripe)
        base = index.stripe_bounds()[stripe][0]
        return cls([index.seg_offsets[i] - base for i in rows], index.seg_lengths[rows.start : rows.stop],
                   index.seg_crcs[rows.start : rows.stop], path, consequence)

    def feed(self, view: memoryview, at: int) -> None:
        end = at + len(view)
        offs, lens = self.offsets, self.lengths
        while self.next < len(offs) and offs[self.next] < end:
            i = self.next
            seg_end = offs[i] + lens[i]
            lo = max(offs[i], at)
            hi = min(seg_end, end)
            seed = self.partial if offs[i] < at and self.partial is not None else 0
            crc = crc32c(view[lo - at : hi - at], seed)
            if hi < seg_end:
                self.partial = crc
                return
            self.partial = None
            if crc != self.crcs[i]:
                detail = (f"checksum mismatch for {lens[i]} bytes at offset {offs[i]}: stored crc32c "
                          f"{self.crcs[i]:08x}, data has {crc:08x}")
                raise SegmentMismatch(f"{self.path}: {detail}; {self.consequence}", detail, offs[i])
            self.next += 1

    def finish(self, size: int) -> None:
        if self.next < len(self.offsets):
            i = self.next
            raise CorruptCheckpointError(
                f"{self.path}: the file ends at {size}, before the segment at offset {self.offsets[i]} ({self.lengths[i]} bytes)"
            )
