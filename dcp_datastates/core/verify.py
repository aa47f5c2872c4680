"""``dcp_datastates.verify(path)``: check every checksum of a checkpoint, report what is wrong.

A load verifies only the bytes it reads; ``verify`` reads them all, through the
reader's store: the same checks for a directory and for a copy in object storage
(``s3://bucket/run/step_00000100``). It checks,
and reports every problem it finds rather than stopping at the first:

* the checkpoint is committed (``.metadata`` present) and its metadata is
  intact (checksum trailer, safe unpickling, a well-formed layout);
* every item the metadata lists has a stored location of the right size;
* every rank's index is intact and belongs to this checkpoint, and its data
  file exists and is long enough;
* every item's bytes are tiled by checksum segments, and every segment's
  CRC32C matches the bytes on disk (read in parallel by the engine, through
  a bounded buffer);
* every byte no segment covers (alignment padding between items, after the
  last tensor, after the objects) is zero, as the engine writes it, and the
  data file ends at the data size its index records: so a change to any
  byte of a checkpoint is reported, with the file, the offset and the key
  before it;
* unless ``allow_pickle``, every saved Python object loads as plain data
  (what a load in safe mode requires).

Files (objects) beside it that the checkpoint does not name (rank files of an
interrupted save, a leftover ``.metadata.<id>.tmp``) are listed as notes:
they are harmless to the checkpoint and safe to delete.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import math
import os
from typing import Callable

import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

from dcp_datastates.native import engine as _native
from dcp_datastates.errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError, IncompleteCheckpointError
from dcp_datastates.format.file_names import METADATA_FILE, is_metadata_temporary, layout_files, stray_files
from dcp_datastates.format.checkpoint_layout import compressed_blocks
from dcp_datastates.format.rank_index import RankIndex
from dcp_datastates.core.compression.codec import default_threads, run_parallel, zstd_module
from dcp_datastates.core.compression.read import chunk_frames, frames_past_table
from dcp_datastates.core.reader import DataStatesReader, names_under
from dcp_datastates.storage import RangeRead, StoreError, is_committed
from dcp_datastates.format.safe_objects import check_object_is_plain

VERIFY_BUFFER_BYTES = 64 << 20  # bytes read (and checked) per engine job


@dataclasses.dataclass
class VerifyReport:
    """What :func:`verify` found. ``ok`` means committed and not a single problem."""

    path: str
    committed: bool = False
    found: bool = True  # False: no checkpoint there at all (no .metadata, none of a save's files)
    problems: list[str] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)
    ranks: int = 0
    bases: list = dataclasses.field(default_factory=list)  # base checkpoints referred to (format 8)
    items: int = 0
    segments_checked: int = 0
    bytes_checked: int = 0
    padding_bytes_checked: int = 0  # bytes no segment covers, checked to be zero
    digests_checked: int = 0  # content digests recomputed (verify(digests=True), format 8)

    @property
    def ok(self) -> bool:
        return self.committed and not self.problems

    @property
    def status(self) -> str:
        """``OK``, ``NOT A CHECKPOINT``, ``NOT COMMITTED`` or ``CORRUPT``: the word its summary starts with."""
        if self.ok:
            return "OK"
        if not self.found:
            return "NOT A CHECKPOINT"
        return "NOT COMMITTED" if not self.committed else "CORRUPT"

    def raise_if_bad(self) -> None:
        """Raise the error a load would raise (incomplete, or corrupt with every problem listed)."""
        if self.ok:
            return
        if not self.found:
            raise CheckpointNotFoundError(self.problems[0] if self.problems else f"no checkpoint at {self.path}")
        if not self.committed:
            raise IncompleteCheckpointError(self.problems[0] if self.problems else f"{self.path} is not committed")
        listed = "\n  ".join(self.problems[:20])
        more = f"\n  ... and {len(self.problems) - 20} more" if len(self.problems) > 20 else ""
        raise CorruptCheckpointError(f"{self.path} failed verification ({len(self.problems)} problems):\n  {listed}{more}")

    def summary(self) -> str:
        head = self.status
        refers = f", bytes referred to in {', '.join(self.bases)}" if self.bases else ""
        hashed = f", {self.digests_checked} content digest(s) recomputed" if self.digests_checked else ""
        lines = [
            f"{head}: {self.path}: {self.ranks} rank file(s), {self.items} item(s){refers}, "
            f"{self.segments_checked} checksum segment(s) over {self.bytes_checked} bytes checked{hashed}"
        ]
        lines += [f"  problem: {p}" for p in self.problems]
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)

    __str__ = summary


def verify(
    path: str | os.PathLike,
    *,
    allow_pickle: bool = False,
    io_threads: int = _native.DEFAULT_READ_THREADS,
    progress: Callable[[int, int], None] | None = None,
    reader: DataStatesReader | None = None,
    digests: bool = False,
) -> VerifyReport:
    """Verify the checkpoint at ``path`` (a directory, or an ``s3://`` URL) and return a
    :class:`VerifyReport`.

    Never raises for a damaged checkpoint (call ``report.raise_if_bad()`` for
    that); a store that does not answer raises its :class:`StoreError`, which says
    nothing about the checkpoint. ``progress(bytes_done, bytes_total)`` is called as
    data is checked.
    ``reader``: a :class:`DataStatesReader` of ``path`` to verify through (its
    ``allow_pickle`` and threads apply), so that a load with the same reader
    afterwards does not decode ``.metadata`` again. ``digests``: also recompute the
    XXH3-128 content digest of every chunk the layout records one for (format 8), from the
    bytes its checksums just passed: a later incremental save trusts these digests to refer
    to this checkpoint's bytes instead of writing its own.
    """
    path = os.fspath(path)
    report = VerifyReport(path)
    if reader is not None and reader.path != path:
        raise ValueError(f"verify({path!r}) was given a reader of {reader.path!r}")
    try:
        if reader is None:  # a missing .metadata is found here, as by load_metadata()
            reader = DataStatesReader(path, allow_pickle=allow_pickle, io_threads=io_threads)
        allow_pickle = reader.allow_pickle
        metadata = reader.load_metadata()
    except IncompleteCheckpointError as exc:
        report.problems.append(str(exc))
        return report
    except CheckpointNotFoundError as exc:
        report.found = False
        report.problems.append(str(exc))
        return report
    except (CheckpointError, OSError, MemoryError) as exc:
        if isinstance(exc, StoreError) and exc.transient:
            raise
        report.committed = reader is not None and _has_metadata(reader)
        report.problems.append(str(exc) if isinstance(exc, CheckpointError) else f"{path}: {type(exc).__name__}: {exc}")
        return report
    report.committed = True
    layout = reader.layout
    if layout is None:  # a stock DCP checkpoint: the reader loads it, but it records no checksums
        report.problems.append(f"{path}: a stock DCP checkpoint records no checksums to verify")
        return report
    _check_items(reader, metadata, report)

    # Each rank's index, then every segment of its data file. A base checkpoint's rank (format 8)
    # is checked where this checkpoint refers to it: the segments under its references (the rest
    # of its file is the base's own, which verify of the base checks).
    indexes: dict[str, RankIndex] = {}
    base_paths = {r.data_path for r in layout.ranks if r.base}
    for files in layout.ranks:
        try:
            indexes[files.data_path] = reader.rank_index(files.data_path)
        except (CheckpointError, OSError, MemoryError) as exc:
            if isinstance(exc, StoreError) and exc.transient:
                raise
            report.problems.append(str(exc) if isinstance(exc, CheckpointError) else f"{files.index_path}: {exc}")
    report.ranks = len(layout.own_ranks)
    report.bases = layout.bases
    _check_object_entries(reader, layout, indexes, report)
    spans = _spans_by_file(layout, indexes)
    for rel, idx in indexes.items():
        _check_tiling(reader, rel, idx, spans.get(rel, []), report)
    rows = {rel: _referred_segments(idx, spans.get(rel, [])) if rel in base_paths else None for rel, idx in indexes.items()}
    total = sum(
        sum(idx.seg_lengths) if rows[rel] is None else sum(idx.seg_lengths[i] for i in rows[rel])
        for rel, idx in indexes.items()
    )
    done = 0
    for rel, idx in indexes.items():
        for stripe in range(len(idx.stripes) + 1):
            done = _check_segments(reader, rel, idx, stripe, spans.get(rel, []), report, done, total, progress, rows[rel])
            if rows[rel] is None:
                _check_padding(reader, rel, idx, stripe, spans.get(rel, []), report)
    if layout.compression is not None and not report.problems:
        _check_frames_decompress(reader, layout, indexes, report)
    if digests and layout.digests and not report.problems:
        _check_digests(reader, layout, indexes, report)
    if not allow_pickle and not report.problems:
        _check_objects_are_plain(reader, layout, indexes, report)
    _note_strays(reader, layout, report)
    return report


def _has_metadata(reader: DataStatesReader) -> bool:
    try:
        return is_committed(reader.store, reader.prefix)
    except (CheckpointError, OSError):
        return True  # there, but not a regular file


def _referred_segments(idx: RankIndex, spans) -> set[int]:
    """The segments of a base rank that overlap the spans referred to."""
    out: set[int] = set()
    for start, end, _key in spans:
        i = max(0, bisect.bisect_right(idx.seg_offsets, start) - 1)
        while i < len(idx.seg_offsets) and idx.seg_offsets[i] < end:
            if idx.seg_offsets[i] + idx.seg_lengths[i] > start:
                out.add(i)
            i += 1
    return out


def _check_digests(reader: DataStatesReader, layout, indexes: dict[str, RankIndex], report: VerifyReport) -> None:
    """Every recorded content digest is the XXH3-128 of its chunk's bytes (read in pieces of at
    most ``VERIFY_BUFFER_BYTES``, from the stripe and file that hold them)."""
    from dcp_datastates.core.incremental import load_xxhash

    xxhash = load_xxhash()
    for key, digest in layout.digests.items():
        loc = layout.location(MetadataIndex(key[0], key[1]))
        rel = loc.relative_path  # indexes are keyed by it (a base's: ../<base>/<file>)
        state = xxhash.xxh3_128()
        for start in range(loc.offset, loc.offset + loc.length, VERIFY_BUFFER_BYTES):
            n = min(VERIFY_BUFFER_BYTES, loc.offset + loc.length - start)
            stored, at = _in_stripe(reader, indexes[rel], rel, start)
            state.update(reader.store.read_range(stored, at, n))
        report.digests_checked += 1
        if state.hexdigest() != digest:
            fqn, off = key
            report.problems.append(
                f"{reader.where(METADATA_FILE)}: the content digest recorded for {fqn!r} (chunk at {off}) is "
                f"{digest}, its bytes in {reader.where(rel)} hash to {state.hexdigest()}: a later incremental "
                "save would refer to these bytes for other ones"
            )


def _check_objects_are_plain(reader: DataStatesReader, layout, indexes: dict[str, RankIndex], report: VerifyReport) -> None:
    """Safe mode: the objects a load would refuse (they need arbitrary unpickling) are problems."""
    files = layout.slot_paths()
    for fqn, _off, rank, _offset, length, ordinal in layout.entries:
        if ordinal < 0 or length >= 0:  # raw tensors, compressed tensors
            continue
        rel = files[rank]
        offset, length = indexes[rel].objects[ordinal]
        key, offset = _in_stripe(reader, indexes[rel], rel, offset)
        try:
            blob = bytes(reader.store.read_range(key, offset, length))
            if layout.objects_transformed:  # one frame of DCP's stream transforms
                blob = reader.undo_frame(blob, None, f"{reader.store.where(key)}: object {fqn!r}")
            check_object_is_plain(blob, fqn, reader.store.where(key))
        except CheckpointError as exc:
            report.problems.append(str(exc))


def _in_stripe(reader: DataStatesReader, idx: RankIndex, rel: str, offset: int) -> tuple[str, int]:
    """The store key of the file holding data offset ``offset`` of the rank whose data file is
    ``rel``, and the offset in it."""
    name, _, base, _ = reader.stored_at(idx, rel, offset)
    return reader.key(name), offset - base


def _check_frames_decompress(reader: DataStatesReader, layout, indexes: dict[str, RankIndex], report: VerifyReport) -> None:
    """Every frame of every compressed chunk decompresses to its block's raw size.

    Their checksums already passed; this catches a frame that was written wrong.
    Frames are read one batch at a time (bounded memory) and decompressed in parallel.
    """
    if not layout.objects_transformed:  # zstd frames
        try:
            zstd_module()
        except ImportError as exc:
            report.notes.append(f"compressed frames were checksummed but not decompressed: {exc}")
            return
    block = layout.compression[1]
    files = layout.slot_paths()
    frames = []  # (store key, offset, length, raw bytes, what)
    for fqn, _off, rank, _offset, length, ordinal in layout.entries:
        if ordinal < 0 or length < 0:
            continue
        rel = files[rank]
        for b, o, n, raw in chunk_frames(indexes[rel].objects, ordinal, length, block):
            key, o = _in_stripe(reader, indexes[rel], rel, o)
            frames.append((key, o, n, raw, f"{reader.store.where(key)}: block {b} of {fqn!r}"))

    def check(frame) -> None:
        key, offset, length, raw, what = frame
        try:
            reader.undo_frame(bytes(reader.store.read_range(key, offset, length)), raw, what)
        except CheckpointError as exc:
            report.problems.append(str(exc))

    threads = default_threads()
    for i in range(0, len(frames), 4 * threads):
        run_parallel([lambda f=f: check(f) for f in frames[i : i + 4 * threads]], threads)


def _check_items(reader: DataStatesReader, metadata, report: VerifyReport) -> None:
    """Every tensor chunk's stored length matches its dtype and shape.

    ``read_metadata`` already checked that every item has a stored location
    of the right kind (``CheckpointLayout.check_covers``).
    """
    layout = reader.layout
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, BytesStorageMetadata):
            report.items += 1
            continue
        for chunk in md.chunks:
            report.items += 1
            loc = layout.location(MetadataIndex(fqn, chunk.offsets))
            if loc.length != math.prod(chunk.sizes) * md.properties.dtype.itemsize:
                report.problems.append(
                    f"{reader.path}: {fqn!r} (chunk at {tuple(chunk.offsets)}) has {loc.length} stored bytes "
                    f"for a {md.properties.dtype} chunk of shape {tuple(chunk.sizes)}"
                )


def _check_object_entries(reader: DataStatesReader, layout, indexes: dict[str, RankIndex], report: VerifyReport) -> None:
    files = layout.slots()
    for fqn, _off, rank, _offset, length, ordinal in layout.entries:
        if ordinal < 0 or rank not in files:
            continue
        idx = indexes.get(files[rank].data_path)
        if length >= 0:  # a compressed chunk: its blocks are consecutive entries
            problem = idx is not None and frames_past_table(fqn, ordinal, length, layout.compression[1], len(idx.objects))
            if problem:
                report.problems.append(f"{reader.where(files[rank].index_path)}: {problem}")
            continue
        if idx is not None and ordinal >= len(idx.objects):
            report.problems.append(
                f"{reader.where(files[rank].index_path)}: object {fqn!r} refers to entry {ordinal} "
                f"of an object table with {len(idx.objects)} entries"
            )


def _spans_by_file(layout, indexes: dict[str, RankIndex]) -> dict[str, list[tuple[int, int, str]]]:
    """(start, end, key) of every stored item, per data file, sorted: maps offsets to keys."""
    files = layout.slot_paths()
    out: dict[str, list[tuple[int, int, str]]] = {}
    for fqn, _off, rank, offset, length, ordinal in layout.entries:
        rel = files.get(rank)
        if rel is None:
            continue
        if ordinal >= 0 and length >= 0:  # a compressed chunk: one span per frame
            idx = indexes.get(rel)
            n = compressed_blocks(length, layout.compression[1])
            if idx is not None and ordinal + n <= len(idx.objects):
                out.setdefault(rel, []).extend((o, o + m, fqn) for o, m in idx.objects[ordinal : ordinal + n])
            continue
        if ordinal >= 0:
            idx = indexes.get(rel)
            if idx is None or ordinal >= len(idx.objects):
                continue
            offset, length = idx.objects[ordinal]
        out.setdefault(rel, []).append((offset, offset + length, fqn))
    for spans in out.values():
        spans.sort()
    return out


def _check_tiling(reader: DataStatesReader, rel: str, idx: RankIndex, spans, report: VerifyReport) -> None:
    where = reader.where(rel)
    for start, end, key in spans:
        try:
            idx.check_tiled(start, end - start, where, key)
        except CorruptCheckpointError as exc:
            report.problems.append(str(exc))
    for ordinal, (offset, length) in enumerate(idx.objects):
        if offset + length > idx.data_size:
            report.problems.append(f"{where}: object {ordinal} lies past the end of the data")


def _key_at(spans, offset: int) -> str | None:
    i = bisect.bisect_right(spans, (offset, float("inf"), "")) - 1
    if i >= 0 and spans[i][0] <= offset < spans[i][1]:
        return spans[i][2]
    return None


def _batches(offsets, lengths, cap: int):
    """Group segments into reads: runs ``[offset, nbytes]`` of adjacent segments, at most
    ``cap`` bytes per batch."""
    batch, used, run = [], 0, None
    for o, n in zip(offsets, lengths):
        if used and used + n > cap:
            yield batch, used
            batch, used, run = [], 0, None
        if run is not None and o == run[0] + run[1]:
            run[1] += n
        else:
            run = [o, n]
            batch.append(run)
        used += n
    if batch:
        yield batch, used


def _stripe_file(reader, rel: str, idx: RankIndex, stripe: int) -> tuple[str, int, int]:
    """``(store key, start, end)``: the file of ``stripe`` of the rank whose data file is ``rel``
    and the data offsets it holds (the whole data without stripes)."""
    start, end = idx.stripe_bounds()[stripe]
    name = idx.stripe_files[stripe] if idx.stripes else rel
    return reader.key(name), start, end


def _check_segments(reader, rel, idx: RankIndex, stripe: int, spans, report, done, total, progress, only=None) -> int:
    """Read every segment of one data file (a stripe) through a bounded buffer and verify its CRC
    (``only``: just these segments, by index)."""
    key, base, _end = _stripe_file(reader, rel, idx, stripe)
    rows = [i for i in idx.stripe_segments(stripe) if only is None or i in only]
    offsets = [idx.seg_offsets[i] - base for i in rows]
    lengths = [idx.seg_lengths[i] for i in rows]
    report.segments_checked += len(rows)
    largest = max(lengths, default=0)
    buf = torch.empty(max(min(VERIFY_BUFFER_BYTES, sum(lengths)), largest), dtype=torch.uint8)
    for batch, used in _batches(offsets, lengths, buf.numel()):
        reads, pos = [], 0
        for start, n in batch:  # a run of adjacent segments, tiled by them: checked against the index
            reads.append(RangeRead(key, start, n, buf.data_ptr() + pos, index=idx, stripe=stripe, data_offset=base + start))
            pos += n
        failures = reader.store.read_batch(reads)
        _report_failures(failures, [r.offset for r in reads], spans, report, base)
        report.bytes_checked += used
        done += used
        if progress is not None:
            progress(done, total)
    return done


_ZEROS = bytes(1 << 20)


@functools.lru_cache(maxsize=256)
def _zeros_crc(nbytes: int) -> int:
    """CRC-32C of ``nbytes`` zero bytes (what every padding byte must be)."""
    crc, left = 0, nbytes
    while left:
        n = min(left, len(_ZEROS))
        crc = _native.crc32c(memoryview(_ZEROS)[:n], crc)
        left -= n
    return crc


def _padding(idx: RankIndex, stripe: int, cap: int) -> list[tuple[int, int]]:
    """``(offset in the stripe's file, nbytes)`` pieces of the stripe's data that no segment
    covers, each at most ``cap``."""
    start, end = idx.stripe_bounds()[stripe]
    out, pos = [], start
    for i in idx.stripe_segments(stripe):
        o, n = idx.seg_offsets[i], idx.seg_lengths[i]
        out += [(p - start, min(cap, o - p)) for p in range(pos, o, cap)]
        pos = o + n
    out += [(p - start, min(cap, end - p)) for p in range(pos, end, cap)]
    return out


def _check_padding(reader, rel, idx: RankIndex, stripe: int, spans, report: VerifyReport) -> None:
    """Every byte of the data file (a stripe) that no segment covers is zero; it ends where its
    data does (``data_size`` for the last stripe, the next stripe's start for the others).

    The engine zero-fills the gaps it leaves (csrc/engine.cpp stage()), so a
    non-zero byte there is a change to the checkpoint that no checksum would
    see. Only those bytes are read, through the same bounded buffer, by the
    engine, checked against the CRC of zeros; a piece that fails is read
    again here to name its first non-zero byte.
    """
    key, base, end = _stripe_file(reader, rel, idx, stripe)
    path = reader.store.where(key)
    size = reader.store.size(key) or 0
    if size > end - base:
        report.problems.append(
            f"{path}: {size - (end - base)} bytes past offset {end - base}, where its index says the "
            "data ends (bytes were appended to it)"
        )
    pieces = _padding(idx, stripe, VERIFY_BUFFER_BYTES)
    if not pieces:
        return
    buf = torch.empty(min(VERIFY_BUFFER_BYTES, sum(n for _, n in pieces)), dtype=torch.uint8)
    for batch, used in _batches(*zip(*pieces), buf.numel()):  # pieces of one gap are never merged
        reads, pos = [], 0
        for o, n in batch:
            reads.append(RangeRead(key, o, n, buf.data_ptr() + pos, checks=[(0, n, _zeros_crc(n))]))
            pos += n
        for failure in reader.store.read_batch(reads):
            o, n = batch[failure.request]
            if failure.kind == "checksum":
                report.problems.append(_nonzero_padding(reader.store, key, o, n, spans, base))
            else:
                report.problems.append(f"{failure.path}: reading the padding at offset {o} failed: {failure.message}")
        report.padding_bytes_checked += used


def _nonzero_padding(store, key: str, offset: int, nbytes: int, spans, base: int = 0) -> str:
    """The problem for a padding piece that is not all zeros: its first non-zero byte and the key before
    (``spans`` are at data offsets, the file's offsets start at data offset ``base``)."""
    found, value = offset + nbytes, None
    for pos, block in store.read_blocks(key, nbytes, len(_ZEROS), offset):
        block = bytes(block)
        zeros = len(block) - len(block.lstrip(b"\0"))
        if zeros < len(block):
            found, value = pos + zeros, block[zeros]
            break
    path = store.where(key)
    i = bisect.bisect_left(spans, (found + base,)) - 1
    where = f"after {spans[i][2]!r}" if i >= 0 else "before the first item"
    what = f"is {value:#04x}, not zero" if value is not None else "is not zero (it changed while read)"
    return (
        f"{path}: the byte at offset {found} {what}: it lies in padding {where}, which no checksum "
        "covers and the engine writes as zeros (the data file was changed)"
    )


def _report_failures(failures: list[_native.ReadFailure], starts, spans, report: VerifyReport, base: int = 0) -> None:
    """Each failure as a problem naming the key it hit (``spans`` at data offsets; the file read
    starts at data offset ``base``)."""
    for f in failures:
        key = _key_at(spans, base + (f.offset if f.offset >= 0 else starts[f.request]))
        what = f" in {key!r}" if key else ""
        if f.kind == "checksum":
            report.problems.append(f"{f.path}{what}: {f.message}")
        elif f.kind == "truncated":
            report.problems.append(f"{f.path}{what}: the data file is truncated: {f.message}")
        else:
            report.problems.append(f"{f.path}{what}: read failed: {f.message}")


def _note_strays(reader: DataStatesReader, layout, report: VerifyReport) -> None:
    """Files a save left that the checkpoint does not name are notes, not problems (format/file_names.py)."""
    for name in stray_files(names_under(reader.store, reader.prefix), layout_files(layout)):
        if is_metadata_temporary(name):
            report.notes.append(f"{name} is a leftover temporary of an interrupted commit (safe to delete)")
        else:
            report.notes.append(f"{name} is not part of this checkpoint (left by an interrupted or failed save; safe to delete)")
