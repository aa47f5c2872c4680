"""Writing one rank's data file and index: the body of ``DataStatesWriter.write_data``.

A rank's file is written in one pass, whichever way its tensors got placed:

1. tensors: a synchronous save hands the engine one region per planned
   tensor now (:func:`write_planned`); an asynchronous save's snapshot has
   been streaming them since ``stage()`` (:func:`write_snapshot`). With
   compression, large chunks become zstd frames appended after the raw
   tensors (a synchronous save compresses the caller's tensors; an
   asynchronous one its raw staging file);
2. Python objects are serialized and appended after the tensors while the
   engine still writes (:func:`finish`), and the coordinator serializes the
   checkpoint's metadata meanwhile (the ``while_writing`` callback);
3. the rank waits for its data (one fsync), then writes its index
   (checksums and object table) durably.

Every engine error is re-raised naming the key stored at the failing offset.
"""

from __future__ import annotations

import bisect
import dataclasses
import time
from typing import Any, Callable

from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from dcp_datastates.core import incremental, plan_cache
from dcp_datastates.core.compression import Compression, descriptor_of
from dcp_datastates.core.layout import PAGE, SMALL_ALIGN, RankLayout, align_up, staged_locations
from dcp_datastates.core.providers import check_planned, finish_regions, provide_object, tensor_source
from dcp_datastates.core.save_state import RankSave
from dcp_datastates.core.stripes import StripedWrite
from dcp_datastates.errors import CheckpointError
from dcp_datastates.format.checkpoint_layout import ItemLocation, location_key, stripe_span
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
        return Compression(codec=descriptor[0], block_bytes=descriptor[1])


@dataclasses.dataclass
class RankFile:
    """A rank's data file whose tensors are placed (and being written): what finishing it needs."""

    job: StripedWrite  # the engine's jobs of the rank's data files, not sealed yet
    rank: int
    save_id: str  # the id in the file names and the index
    data_file: str
    index_file: str
    objects_base: int
    tensor_end: int
    tensor_spans: Callable[[], list]  # (offset, end, fqn) of every tensor, built only for an error message
    blocks: list = dataclasses.field(default_factory=list)  # (offset, length, fqn) of compressed frames


# -- synchronous saves: the plan's tensors, placed by the coordinator ----------------------


def write_planned(
    save: RankSave, plan: SavePlan, planner: SavePlanner, layout: RankLayout, settings: WriteSettings,
    while_writing: Callable[[], None],
) -> list[WriteResult]:
    """Copy and write the plan's items at the offsets of ``layout`` (this rank's placement)."""
    stats = save.stats
    stats.items = len(plan.items)
    files = layout.files()
    data_names = files.data_files()
    save.written_files = [*data_names, layout.index_file]
    save.report = plan_cache.RankReport(
        layout.data_file, layout.index_file, layout.save_id, layout.compression, layout.stripes
    )
    bases = [0, *layout.stripes]
    t0 = time.perf_counter()
    if getattr(planner, "resolve_creates_tensors", False):
        job, results = _submit_in_batches(save, plan, planner, layout, data_names, bases, settings)
    else:
        placed, results = [], []
        for item in plan.items:
            loc = layout.locations[item.index]
            if loc.object_ordinal >= 0:  # objects, and compressed chunks (below)
                continue
            source = tensor_source(planner.resolve_data(item), item.index.fqn)
            check_planned(item, source, loc.length)
            placed.append((source, loc.offset))
            results.append(WriteResult(index=item.index, size_in_bytes=loc.length, storage_data=loc))
        # borrow: the caller's tensors stay as they are until write_data's future completes
        # (dcp.save waits for it), so the engine may write them without a staging copy.
        job = save.job = StripedWrite.start(
            settings.engine, save.dest, data_names, bases, layout.tensor_bytes_end, placed, finish_regions,
            direct_io=settings.direct_io, borrow=True,
        )
        del placed
    blocks, objects_base = [], layout.objects_base
    if layout.compression is not None:
        blocks, objects_base = _write_compressed(plan, planner, layout, job.tail, results, settings)
    stats.submit_s = time.perf_counter() - t0
    rank_file = RankFile(
        job, layout.rank, layout.save_id, layout.data_file, layout.index_file, objects_base, layout.tensor_bytes_end,
        lambda: [(loc.offset, loc.offset + loc.length, idx.fqn) for idx, loc in layout.locations.items() if loc.object_ordinal < 0],
        blocks,
    )
    finish(save, plan, planner, rank_file, results, t0, while_writing)
    return results


def _write_compressed(plan: SavePlan, planner: SavePlanner, layout: RankLayout, job, results: list, settings: WriteSettings):
    """Compress the plan's compressed chunks into frames appended to ``job`` after the raw tensors.

    Returns ``(frames, end)``: ``(offset, length, fqn)`` per frame in ordinal
    order, and the aligned offset where the objects go.
    """
    from dcp_datastates.core.compression import BlockAppender, submit_tensor

    n_objects = sum(1 for item in plan.items if item.type == WriteItemType.BYTE_IO)
    appender = BlockAppender(
        job, settings.compression_for(layout.compression), layout.objects_base, n_objects,
        _native.ALIGNMENT, settings.engine.window_bytes,
    )
    try:
        for item in plan.items:
            loc = layout.locations[item.index]
            if not loc.is_compressed:
                continue
            appender.check_ordinal(item.index.fqn, loc.object_ordinal)
            source = tensor_source(planner.resolve_data(item), item.index.fqn)
            check_planned(item, source, loc.length)
            results.append(WriteResult(index=item.index, size_in_bytes=loc.length, storage_data=loc))
            submit_tensor(appender, item.index.fqn, source.tensor, loc.length)
            del source
        return appender.finish()
    except BaseException:
        appender.abandon()
        raise


def _submit_in_batches(
    save: RankSave, plan: SavePlan, planner: SavePlanner, layout: RankLayout, data_names: list[str], bases: list[int],
    settings: WriteSettings,
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
    stripe's start (a batch goes to one stripe's job).
    """
    engine = settings.engine
    limit = min(engine.pool_bytes, BATCH_BYTES_MAX)
    tensor_items = [item for item in plan.items if layout.locations[item.index].object_ordinal < 0]  # raw chunks
    tensor_items.sort(key=lambda item: layout.locations[item.index].offset)
    job, results, batch, batch_bytes, batch_end = None, [], [], 0, 0
    stripe = 0

    def submit() -> bool:
        nonlocal job, batch_bytes
        if job is None:
            # Every stripe's job starts with the first batch (only stripe 0's sources in it).
            job = save.job = StripedWrite.start(
                engine, save.dest, data_names, bases, layout.tensor_bytes_end, batch, finish_regions,
                direct_io=settings.direct_io, borrow=True,  # a borrowed window is staged once written
            )
        else:
            regions, keep = finish_regions([(src, off - bases[stripe]) for src, off in batch])
            job.append(stripe, regions, keep)
            del keep, regions
        batch.clear()
        batch_bytes = 0
        return job.release_staged()  # False: the job failed; job.wait() raises its error

    for item in tensor_items:
        loc = layout.locations[item.index]
        item_stripe = stripe_span(layout.stripes, loc.offset)[0]
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
        results.append(WriteResult(index=item.index, size_in_bytes=loc.length, storage_data=loc))
    else:
        if batch or job is None:
            submit()
    batch.clear()
    return job, results


# -- asynchronous saves: the tensors a snapshot placed and is writing ------------------------


def write_snapshot(
    save: RankSave, plan: SavePlan, planner: SavePlanner, settings: WriteSettings, while_writing: Callable[[], None]
) -> list[WriteResult]:
    """Finish the rank file of the save's snapshot: its tensors are placed (``save.tensor_locations``)
    and streaming; append the objects, wait, write the index."""
    snap = save.snapshot
    assert snap is not None and save.tensor_locations is not None
    stats = save.stats
    stats.items = len(plan.items)
    save.report = plan_cache.RankReport(snap.data_file, snap.index_file, snap.save_id, descriptor_of(snap.compression))
    if snap.item_references or snap.item_digests:
        # Only this rank's items of the final plan: DCP's deduplication gave replicated ones to
        # one rank, whose digests (of the bytes it wrote or refers to) are the ones recorded.
        mine = {location_key(item.index.fqn, item.index.offset) for item in plan.items}
        references = {k: c for k, c in snap.item_references.items() if k in mine}
        digests = {k: d for k, d in snap.item_digests.items() if k in mine}
        save.report = incremental.report_increments(save.report, references.values(), digests)
        stats.referenced_bytes = sum(c.length for c in references.values())
        stats.hashed_bytes = stats.referenced_bytes + sum(
            save.tensor_locations.get(k, (0, 0))[1] for k in digests if k not in references
        )
    t0 = time.perf_counter()
    if snap.compression is not None:
        return _write_snapshot_compressed(save, plan, planner, settings, t0, while_writing)
    results = []
    for item in plan.items:
        if item.type == WriteItemType.BYTE_IO:
            continue
        key = location_key(item.index.fqn, item.index.offset)
        placed = save.tensor_locations.get(key)
        chunk = snap.item_references.get(key)
        if placed is None and chunk is not None:  # incremental: the base's identical chunk
            results.append(WriteResult(index=item.index, size_in_bytes=chunk.length, storage_data=chunk.location()))
            continue
        if placed is None:
            raise CheckpointError(f"{item.index.fqn!r} is in the final plan but was not in the local plan")
        loc = ItemLocation(snap.data_file, placed[0], placed[1], -1)
        results.append(WriteResult(index=item.index, size_in_bytes=placed[1], storage_data=loc))
    locations = save.tensor_locations
    rank_file = RankFile(
        StripedWrite.of_job(snap.job), save.rank, snap.save_id, snap.data_file, snap.index_file, snap.objects_base,
        snap.tensor_bytes_end,
        lambda: [(off, off + n, fqn) for (fqn, _), (off, n) in locations.items()],
    )
    finish(save, plan, planner, rank_file, results, t0, while_writing)
    return results


def _write_snapshot_compressed(
    save: RankSave, plan: SavePlan, planner: SavePlanner, settings: WriteSettings, t0: float,
    while_writing: Callable[[], None],
) -> list[WriteResult]:
    """Compress the snapshot's staging file into the data file.

    The snapshot staged raw bytes (bounded by the host cache) into its staging
    file; here, in DCP's background thread, its small tensors are copied as
    they are, its large ones compressed block by block (read back with their
    checksums verified), and the staging file is removed once the data file
    and its index are durable.
    """
    from dcp_datastates.core.compression import compress_staged

    snap = save.snapshot
    finals = staged_locations(plan.items, save.tensor_locations, snap.compression.descriptor, save.rank)
    results = []
    for item in plan.items:
        if item.type == WriteItemType.BYTE_IO:
            continue
        offset, length, ordinal = finals[location_key(item.index.fqn, item.index.offset)]
        loc = ItemLocation(snap.data_file, offset, length, ordinal)
        results.append(WriteResult(index=item.index, size_in_bytes=length, storage_data=loc))
    snap.job.seal()
    try:
        staged_segments = snap.job.wait()  # the staging file is complete (and the snapshot's memory free)
    except OSError as exc:
        locations = save.tensor_locations
        raise with_key_context(exc, [(off, off + n, fqn) for (fqn, _), (off, n) in locations.items()]) from exc
    if snap.staging_error is not None:
        raise snap.staging_error
    n_objects = sum(1 for item in plan.items if item.type == WriteItemType.BYTE_IO)
    job, small_end, blocks, end = compress_staged(
        settings.engine, snap, staged_segments, plan, finals, n_objects, settings.direct_io, save
    )
    rank_file = RankFile(
        StripedWrite.of_job(job), save.rank, snap.save_id, snap.data_file, snap.index_file, end, small_end,
        lambda: [(off, off + n, fqn) for (fqn, _), (off, n, o) in finals.items() if o < 0 and n >= 0],
        blocks,
    )
    finish(save, plan, planner, rank_file, results, t0, while_writing)
    save.dest.remove([snap.staging_file])
    return results


# -- every rank file: objects, the wait, the index ---------------------------------------------


def finish(
    save: RankSave, plan: SavePlan, planner: SavePlanner, rank_file: RankFile, results: list, t0: float,
    while_writing: Callable[[], None],
) -> None:
    """Append the objects, run ``while_writing`` (the coordinator's metadata), wait for the
    data, write the index."""
    stats = save.stats
    job = rank_file.job
    t1 = time.perf_counter()
    objects, object_table, object_keys = [], [], []
    offset = rank_file.objects_base
    for item in plan.items:
        if item.type != WriteItemType.BYTE_IO:
            continue
        blob = provide_object(item, planner.resolve_data(item))
        offset = align_up(offset, SMALL_ALIGN)
        results.append(
            WriteResult(
                index=item.index, size_in_bytes=len(blob),
                storage_data=ItemLocation(rank_file.data_file, -1, -1, len(object_table)),
            )
        )
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
    t2 = time.perf_counter()
    stats.objects_s = t2 - t1
    while_writing()
    stats.metadata_done_before_data = stats.metadata_serialize_s > 0 and not job.done
    if save.snapshot is not None and save.snapshot.staging_error is not None:
        raise save.snapshot.staging_error
    try:
        checksums = job.wait()
    except StoreError:
        raise  # the upload failed: it names the object already, and no byte offset applies
    except OSError as exc:
        spans = rank_file.tensor_spans() + [(o, o + n, k) for (o, n), k in zip(object_table, object_keys)]
        spans += [(o, o + n, k) for o, n, k in rank_file.blocks]
        raise with_key_context(exc, spans) from exc
    t3 = time.perf_counter()
    stats.data_write_s = t3 - t0
    stats.direct_io = job.direct
    stats.windows_from_source = job.windows_from_source
    tensor_end = rank_file.tensor_end
    data_size = align_up(max(offset, tensor_end), PAGE) if (tensor_end or objects or rank_file.blocks) else 0
    object_table += [(o, n) for o, n, _ in rank_file.blocks]  # compressed frames: ordinals after the objects'
    save.dest.write_index(
        rank_file.index_file, encode_index(rank_file.rank, rank_file.save_id, data_size, checksums, object_table)
    )
    stats.index_s = time.perf_counter() - t3
    stats.bytes_written = data_size


def with_key_context(exc: OSError, spans: list[tuple[int, int, str]]) -> OSError:
    """An engine error again, with the key stored at the failing offset in its message."""
    offset = getattr(exc, "offset", -1)
    key = None
    if offset is not None and offset >= 0:
        spans = sorted(spans)
        i = bisect.bisect_right([s[0] for s in spans], offset) - 1
        if i >= 0 and spans[i][0] <= offset < max(spans[i][1], spans[i][0] + 1):
            key = spans[i][2]
    what = f"writing {key!r}" if key else "writing checkpoint data"
    err = OSError(exc.errno, f"{what} failed: {exc.strerror}", exc.filename)
    err.offset = offset
    return err
