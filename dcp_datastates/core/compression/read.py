"""The read side of compression: the frames a load needs of a compressed chunk, queued on the
reader's read batch (read and checksum-verified with every other read), then undone (zstd, or
DCP's stream transforms: the reader's ``undo_frame``) in parallel into their place."""

from __future__ import annotations

import ctypes
from typing import Callable

from dcp_datastates.errors import CorruptCheckpointError
from dcp_datastates.format.checkpoint_layout import compressed_blocks
from dcp_datastates.native.engine import bytearray_address


def block_span(lo: int, hi: int, nbytes: int, block: int) -> tuple[int, int]:
    """The bytes of the whole blocks that hold bytes ``[lo, hi)`` of a chunk of ``nbytes``."""
    return lo // block * block, min(((hi - 1) // block + 1) * block, nbytes)


def chunk_frames(objects: list, ordinal: int, nbytes: int, block: int, lo: int = 0, hi: int | None = None):
    """``(block number, frame offset, frame length, raw bytes)`` of each frame holding bytes
    ``[lo, hi)`` (all by default) of a chunk of ``nbytes`` stored from object ``ordinal`` on."""
    hi = nbytes if hi is None else hi
    for b in range(lo // block, (hi - 1) // block + 1):
        offset, length = objects[ordinal + b]
        yield b, offset, length, min(block, nbytes - b * block)


def frames_past_table(key: str, ordinal: int, nbytes: int, block: int, entries: int) -> str | None:
    """What is wrong with a compressed chunk whose frames from ``ordinal`` on would run past the
    end of an object table of ``entries`` (None: they do not)."""
    last = ordinal + compressed_blocks(nbytes, block) - 1
    if last < entries:
        return None
    return f"{key!r} is stored as blocks {ordinal}..{last} of an object table with {entries} entries"


def add_frame_reads(batch, key: str, loc, idx, block: int, lo: int, hi: int, dest, where: str) -> int:
    """Queue on ``batch`` (:meth:`ReadBatch.request`) the reads of the frames of bytes ``[lo, hi)``
    (whole blocks: :func:`block_span`) of the compressed chunk at ``loc``, and onto
    ``batch.decode`` their decompression into ``dest``, which holds those bytes. Returns the
    bytes of the frames held until then. ``where`` names the data file in errors."""
    problem = frames_past_table(key, loc.object_ordinal, loc.length, block, len(idx.objects))
    if problem:
        raise CorruptCheckpointError(f"{where}: {problem}")
    held = 0
    for b, offset, length, raw in chunk_frames(idx.objects, loc.object_ordinal, loc.length, block, lo, hi):
        buf = bytearray(length)
        batch.request(key, loc.relative_path, offset, length, bytearray_address(buf), idx)
        held += length
        what = f"{where}: block {b} of {key!r}"
        batch.decode.append(_decode_task(batch.reader.undo_frame, buf, raw, dest, b * block - lo, what))
    return held


def _decode_task(undo: Callable, buf: bytearray, raw: int, dest, pos: int, where: str) -> Callable[[], None]:
    def decode() -> None:
        out = undo(buf, raw, where)  # codec.frame_undoer: zstd, or DCP's stream transforms
        ctypes.memmove(dest.data_ptr() + pos, out, raw)  # a foreign call: the GIL is released

    return decode
