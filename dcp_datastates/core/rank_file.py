"""Writing one rank's data files and index: the body of ``DataStatesWriter.write_data``.

A rank's files are written in one pass, whichever way its tensors got placed:

1. tensors: a synchronous save hands the engine one region per placed tensor
   now (:func:`start_planned`); an asynchronous save's snapshot has been
   streaming them since ``stage()`` (:func:`start_snapshot`). With
   compression, large chunks become zstd frames appended after the raw
   tensors (a synchronous save compresses the caller's tensors; an
   asynchronous one its raw staging file);
2. Python objects are serialized and appended after the tensors while the
   engine still writes, and the start functions return a sealed
   :class:`RankWrite`: the coordinator serializes the checkpoint's metadata
   meanwhile;
3. :meth:`RankWrite.complete` waits for the data (one fsync), then writes the
   index (checksums and object table) durably.

These functions keep no state of the save: they take the rank's placement and
return what they started; one that fails stops the engine jobs it started.
Every engine error is re-raised naming the key stored at the failing offset.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable

from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType

from dcp_datastates.core import incremental
from dcp_datastates.core.compression.codec import Compression, descriptor_of
from dcp_datastates.core.placement import PAGE, SMALL_ALIGN, RankPlacement, StagedRankData, align_up, staged_locations
from dcp_datastates.core.providers import check_planned, finish_regions, provide_object, tensor_source
from dcp_datastates.core.rank_reports import RankReport, item_entry
from dcp_datastates.core.stripes import StripedWrite, with_key_context
from dcp_datastates.errors import CheckpointError
from dcp_datastates.format.checkpoint_layout import STREAM_CODEC, ItemLocation, location_key, stripe_span
from dcp_datastates.format.rank_index import encode_index
from dcp_datastates.native import engine as _native
from dcp_datastates.storage import StoreError

# The largest batch a ``resolve_creates_tensors`` planner's tensors are resolved in.
BATCH_BYTES_MAX = 256 << 20


@dataclasses.dataclass(frozen=True)
class WriteSettings:
    """What the writer's options decide about writing a rank file."""

    engine: Any  # the engine of this process for the writer's settings
    direct_io: str
    compression: Compression | None  # the writer's own codec settings (its level)

    def compression_for(self, descriptor: tuple) -> Compression:
        """These settings for the codec the coordinator chose (this writer's level; defaults else)."""
        mine = self.compression
        if mine is not None and mine.descriptor == tuple(descriptor):
            return mine
        if descriptor[0] == STREAM_CODEC:  # extensions are objects: only this rank's writer holds them
            raise CheckpointError(
                f"the save transforms its items through the DCP extensions {', '.join(descriptor[2])}, "
                "which this rank's DataStatesWriter was not given (give every rank the same _extensions)"
            )
        return Compression(codec=descriptor[0], block_bytes=descriptor[1])


@dataclasses.dataclass
class RankWrite:
    """A rank's data files being written, every byte submitted and the jobs sealed."""

    job: StripedWrite  # the engine's jobs of the rank's data files
    report: RankReport  # the files (their save id is the index's), for the coordinator
    rank: int
    data_size: int
    object_table: list  # (offset, length) of each object, then of each compressed frame
    entries: list  # where the rank put each item (rank_reports.item_entry)
    spans: Callable[[], list]  # (offset, end, fqn) of every item, built only for an error message
    t0: float  # when the rank's data began to be submitted

    def complete(self, dest, stats, snapshot=None) -> list:
        """Wait for the data, write the index; the rank's item entries."""
        stats.metadata_done_before_data = stats.metadata_serialize_s > 0 and not self.job.done
        if snapshot is not None and snapshot.staging_error is not None:
            raise snapshot.staging_error
        try:
            checksums = self.job.wait()
        except StoreError:
            raise  # the upload failed: it names the object already, and no byte offset applies
        except OSError as exc:
            raise with_key_context(exc, self.spans()) from exc
        t3 = time.perf_counter()
        stats.data_write_s = t3 - self.t0
        stats.direct_io = self.job.direct
        stats.windows_from_source = self.job.windows_from_source
        index = encode_index(self.rank, self.report.save_id, self.data_size, checksums, self.object_table)
        dest.write_index(self.report.index_file, index)
        stats.index_s = time.perf_counter() - t3
        stats.bytes_written = self.data_size
        if snapshot is not None and snapshot.staging_file is not None:
            dest.remove([snapshot.staging_file])  # compressed into the data file, which is durable now
        return self.entries


# -- synchronous saves: the plan's tensors, placed by the rank ------------------------------


def start_planned(
    dest, plan: SavePlan, planner: SavePlanner, placement: RankPlacement, settings: WriteSettings, stats,
) -> RankWrite:
    """Copy and write the plan's items at their offsets in ``placement`` (this rank's)."""
    stats.items = len(plan.items)
    bases = [0, *placement.stripes]
    t0 = time.perf_counter()
    started: list = []
    try:
        if getattr(planner, "resolve_creates_tensors", False):
            job, entries = _submit_in_batches(dest, plan, planner, placement, bases, settings, started)
        else:
            placed, entries = [], []
            for item in plan.items:
                loc = placement.locations[item.index]
                if loc.object_ordinal >= 0:  # objects, and compressed chunks (below)
                    continue
                source = tensor_source(planner.resolve_data(item), item.index.fqn)
                check_planned(item, source, loc.length)
                placed.append((source, loc.offset))
                entries.append(item_entry(item.index, loc))
            # borrow: the caller's tensors stay as they are until write_data's future completes
            # (dcp.save waits for it), so the engine may write them without a staging copy.
            job = StripedWrite.start(
                settings.engine, dest, placement.files().data_files(), bases, placement.tensor_bytes_end, placed,
                finish_regions, keys=lambda: _tensor_keys(plan, placement), direct_io=settings.direct_io, borrow=True,
            )
            started.append(job)
            del placed
        blocks, objects_base = [], placement.objects_base
        if placement.compression is not None:
            blocks, objects_base = _write_compressed(plan, planner, placement, job.tail, entries, settings)
        stats.submit_s = time.perf_counter() - t0
        locations = placement.locations
        report = RankReport(
            placement.data_file, placement.index_file, placement.save_id, placement.compression, placement.stripes
        )
        codec = settings.compression_for(placement.compression) if placement.compression is not None else None
        return _append_objects(
            job, report, plan, planner, placement.rank, objects_base, placement.tensor_bytes_end, blocks, entries, t0, stats,
            lambda: [(loc.offset, loc.offset + loc.length, idx.fqn) for idx, loc in locations.items() if loc.object_ordinal < 0],
            codec,
        )
    except BaseException:
        for job in started:
            _native.stop_write_job(job, "save failed")
        raise


def _tensor_keys(plan: SavePlan, placement: RankPlacement) -> list[str]:
    """The keys of the plan's raw tensor chunks, in file order (a failed reservation names them)."""
    items = [item for item in plan.items if placement.locations[item.index].object_ordinal < 0]
    return [item.index.fqn for item in sorted(items, key=lambda item: placement.locations[item.index].offset)]


def _write_compressed(plan: SavePlan, planner: SavePlanner, placement: RankPlacement, job, entries: list, settings: WriteSettings):
    """Compress the plan's compressed chunks into frames appended to ``job`` after the raw tensors.

    Returns ``(frames, end)``: ``(offset, length, fqn)`` per frame in ordinal
    order, and the aligned offset where the objects go.
    """
    from dcp_datastates.core.compression.write import BlockAppender, submit_tensor

    n_objects = sum(1 for item in plan.items if item.type == WriteItemType.BYTE_IO)
    appender = BlockAppender(
        job, settings.compression_for(placement.compression), placement.objects_base, n_objects,
        _native.ALIGNMENT, settings.engine.window_bytes,
    )
    try:
        for item in plan.items:
            loc = placement.locations[item.index]
            if not loc.is_compressed:
                continue
            appender.check_ordinal(item.index.fqn, loc.object_ordinal)
            source = tensor_source(planner.resolve_data(item), item.index.fqn)
            check_planned(item, source, loc.length)
            entries.append(item_entry(item.index, loc))
            submit_tensor(appender, item.index.fqn, source.tensor, loc.length)
            del source
        return appender.finish()
    except BaseException:
        appender.abandon()
        raise


def _submit_in_batches(
    dest, plan: SavePlan, planner: SavePlanner, placement: RankPlacement, bases: list[int], settings: WriteSettings,
    started: list,
):
    """Resolve, submit and release the tensors a batch at a time (``resolve_creates_tensors``).

    The normal path resolves every item before submitting, which is free
    when ``resolve_data`` returns the caller's own tensors but would hold a
    whole checkpoint when each call materialises a new tensor (the
    converter reads each one from another checkpoint). Here a batch of at
    most the pool's bytes (at least one item) is submitted, and once the
    engine has staged it (copied it into the pool, or written it from the
    tensors themselves: it never reads those buffers again) the job and this
    function drop their references before
    the next batch is resolved. Batches split only at offsets the engine
    accepts for an append (at or after the previous batch's aligned end),
    so small tensors packed into one page stay in one batch, and at every
    stripe's start (a batch goes to one stripe's job). The job, once
    started, is appended to ``started``.
    """
    engine = settings.engine
    limit = min(engine.pool_bytes, BATCH_BYTES_MAX)
    tensor_items = [item for item in plan.items if placement.locations[item.index].object_ordinal < 0]  # raw chunks
    tensor_items.sort(key=lambda item: placement.locations[item.index].offset)
    job, entries, batch, batch_bytes, batch_end = None, [], [], 0, 0
    stripe = 0

    def submit() -> bool:
        nonlocal job, batch_bytes
        if job is None:
            # Every stripe's job starts with the first batch (only stripe 0's sources in it).
            job = StripedWrite.start(
                engine, dest, placement.files().data_files(), bases, placement.tensor_bytes_end, batch, finish_regions,
                keys=lambda: [item.index.fqn for item in tensor_items],
                direct_io=settings.direct_io, borrow=True,  # a borrowed window is staged once written
            )
            started.append(job)
        else:
            regions, keep = finish_regions([(src, off - bases[stripe]) for src, off in batch])
            job.append(stripe, regions, keep)
            del keep, regions
        batch.clear()
        batch_bytes = 0
        return job.release_staged()  # False: the job failed; job.wait() raises its error

    for item in tensor_items:
        loc = placement.locations[item.index]
        item_stripe = stripe_span(placement.stripes, loc.offset)[0]
        splittable = loc.offset >= align_up(batch_end, _native.ALIGNMENT)
        if batch and ((splittable and batch_bytes + loc.length > limit) or item_stripe != stripe):
            if not submit():
                break
        stripe = item_stripe
        source = tensor_source(planner.resolve_data(item), item.index.fqn)
        check_planned(item, source, loc.length)
        batch.append((source, loc.offset))
        del source
        batch_bytes += loc.length
        batch_end = loc.offset + loc.length
        entries.append(item_entry(item.index, loc))
    else:
        if batch or job is None:
            submit()
    batch.clear()
    return job, entries


# -- asynchronous saves: the tensors a snapshot placed and is writing ------------------------


def staged_placement(snap, items) -> StagedRankData:
    """Where the snapshot ``snap`` put the tensors of ``items`` (and, for an incremental snapshot,
    the base's chunks it refers to and the digests it recorded): what the rank sends with its
    local plan, and writes by."""
    tensors = snap.locations_for(items)
    return StagedRankData(
        snap.save_id, snap.data_file, snap.index_file, tensors,
        descriptor_of(snap.compression), dict(snap.item_references), dict(snap.item_digests),
    )


def start_snapshot(
    snap, staged: StagedRankData, plan: SavePlan, planner: SavePlanner, settings: WriteSettings, stats,
) -> RankWrite:
    """Finish the rank file of the snapshot ``snap``: its tensors are placed (``staged``) and
    streaming; append the objects."""
    stats.items = len(plan.items)
    report = RankReport(snap.data_file, snap.index_file, snap.save_id, descriptor_of(snap.compression))
    if staged.references or staged.digests:
        # Only this rank's items of the final plan: DCP's deduplication gave replicated ones to
        # one rank, whose digests (of the bytes it wrote or refers to) are the ones recorded.
        mine = {location_key(item.index.fqn, item.index.offset) for item in plan.items}
        references = {k: c for k, c in staged.references.items() if k in mine}
        digests = {k: d for k, d in staged.digests.items() if k in mine}
        report = incremental.report_increments(report, references.values(), digests)
        stats.referenced_bytes = sum(c.length for c in references.values())
        stats.hashed_bytes = stats.referenced_bytes + sum(
            staged.tensors.get(k, (0, 0))[1] for k in digests if k not in references
        )
    t0 = time.perf_counter()
    if snap.compression is not None:
        return _start_snapshot_compressed(snap, staged, report, plan, planner, settings, t0, stats)
    entries = []
    for item in plan.items:
        if item.type == WriteItemType.BYTE_IO:
            continue
        key = location_key(item.index.fqn, item.index.offset)
        placed = staged.tensors.get(key)
        chunk = staged.references.get(key)
        if placed is None and chunk is not None:  # incremental: the base's identical chunk
            entries.append(item_entry(item.index, chunk.location()))
            continue
        if placed is None:
            raise CheckpointError(f"{item.index.fqn!r} is in the final plan but was not in the local plan")
        loc = ItemLocation(snap.data_file, placed[0], placed[1], -1)
        entries.append(item_entry(item.index, loc))
    tensors = staged.tensors
    return _append_objects(
        StripedWrite.of_job(snap.job), report, plan, planner, snap.rank, snap.objects_base, snap.tensor_bytes_end, [],
        entries, t0, stats,
        lambda: [(off, off + n, fqn) for (fqn, _), (off, n) in tensors.items()],
    )


def _start_snapshot_compressed(
    snap, staged: StagedRankData, report: RankReport, plan: SavePlan, planner: SavePlanner, settings: WriteSettings, t0: float, stats,
) -> RankWrite:
    """Compress the snapshot's staging file into the data file.

    The snapshot staged raw bytes (bounded by the host cache) into its staging
    file; here, in DCP's background thread, its small tensors are copied as
    they are, its large ones compressed block by block (read back with their
    checksums verified). :meth:`RankWrite.complete` removes the staging file once
    the data file and its index are durable.
    """
    from dcp_datastates.core.compression.write import compress_staged

    finals = staged_locations(plan.items, staged.tensors, snap.compression.descriptor, snap.rank)
    entries = []
    for item in plan.items:
        if item.type == WriteItemType.BYTE_IO:
            continue
        offset, length, ordinal = finals[location_key(item.index.fqn, item.index.offset)]
        loc = ItemLocation(snap.data_file, offset, length, ordinal)
        entries.append(item_entry(item.index, loc))
    snap.job.seal()
    tensors = staged.tensors
    try:
        staged_segments = snap.job.wait()  # the staging file is complete (and the snapshot's memory free)
    except OSError as exc:
        raise with_key_context(exc, [(off, off + n, fqn) for (fqn, _), (off, n) in tensors.items()]) from exc
    if snap.staging_error is not None:
        raise snap.staging_error
    n_objects = sum(1 for item in plan.items if item.type == WriteItemType.BYTE_IO)
    job, small_end, blocks, end = compress_staged(
        settings.engine, snap, staged_segments, plan, finals, n_objects, settings.direct_io, tensors
    )
    try:
        return _append_objects(
            StripedWrite.of_job(job), report, plan, planner, snap.rank, end, small_end, blocks, entries, t0, stats,
            lambda: [(off, off + n, fqn) for (fqn, _), (off, n, o) in finals.items() if o < 0 and n >= 0],
            snap.compression,
        )
    except BaseException:
        _native.stop_write_job(job, "save failed")
        raise


# -- every rank file: objects, then the index ---------------------------------------------------


def _append_objects(
    job: StripedWrite, report: RankReport, plan: SavePlan, planner: SavePlanner, rank: int, objects_base: int,
    tensor_end: int, blocks: list, entries: list, t0: float, stats, tensor_spans: Callable,
    codec: Compression | None = None,
) -> RankWrite:
    """Serialize the plan's objects and append them after the tensors (``blocks``: the
    compressed frames, ``(offset, length, fqn)``), seal the jobs. A ``codec`` that
    transforms objects (DCP's stream transforms) stores each object as one frame of it."""
    t1 = time.perf_counter()
    objects, object_table, object_keys = [], [], []
    offset = objects_base
    for item in plan.items:
        if item.type != WriteItemType.BYTE_IO:
            continue
        blob = provide_object(item, planner.resolve_data(item))
        if codec is not None and codec.transforms_objects:
            blob = codec.frame(blob, blob)
        offset = align_up(offset, SMALL_ALIGN)
        entries.append(item_entry(item.index, ItemLocation(report.data_file, -1, -1, len(object_table))))
        object_table.append((offset, len(blob)))
        object_keys.append(item.index.fqn)
        objects.append(blob)
        offset += len(blob)
    if objects:
        base = job.tail_base  # objects follow the tensors: in the last stripe
        regions = [
            _native.HostRegion(address=_native.bytes_address(b), nbytes=len(b), file_offset=o - base)
            for b, (o, _) in zip(objects, object_table) if len(b)
        ]
        job.tail.append(regions, objects)
    job.seal()
    stats.objects_s = time.perf_counter() - t1
    data_size = align_up(max(offset, tensor_end), PAGE) if (tensor_end or objects or blocks) else 0

    def spans() -> list:
        return (tensor_spans() + [(o, o + n, k) for (o, n), k in zip(object_table, object_keys)]
                + [(o, o + n, k) for o, n, k in blocks])

    object_table += [(o, n) for o, n, _ in blocks]  # compressed frames: ordinals after the objects'
    return RankWrite(job, report, rank, data_size, object_table, entries, spans, t0)
