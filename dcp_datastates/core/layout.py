"""Planning where every item of a rank lands in that rank's data file.

Offsets are fixed at planning time, before any byte moves, so that the
coordinator can build and serialize the checkpoint's metadata while the
engine is still writing tensor bytes. The layout is a pure function of a
rank's (deduplicated) write items in plan order: the coordinator computes it
for every rank to fill the metadata, and each rank recomputes its own from
the plan it receives, so no per-item offsets travel through the collectives.

Rules:
- tensors under ``SMALL_TENSOR_BYTES`` are packed back to back at 64-byte
  alignment (cache-line aligned, enough for every dtype), so thousands of
  small tensors coalesce into a few large writes;
- larger tensors start at a 4 KiB boundary (O_DIRECT alignment);
- Python objects are serialized during the write and appended after the
  last tensor, from the next 4 KiB boundary, in plan order;
- with stripes (format 7), the rank's data is cut at the starts of large
  tensors into up to ``max_stripes`` parts of about equal size, each written
  to its own file by its own thread (:func:`stripe_starts`); the offsets
  above do not change, objects go to the last stripe.
"""

from __future__ import annotations

import dataclasses
import math
import uuid

from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType

from dcp_datastates.errors import CheckpointError

from dcp_datastates.format.file_names import data_file_name, index_file_name
from dcp_datastates.format.checkpoint_layout import FORMAT_NAME, FORMAT_VERSION, CheckpointLayout, ItemLocation, RankFiles, compressed_blocks, location_key

PAGE = 4096
SMALL_ALIGN = 64
SMALL_TENSOR_BYTES = 64 * 1024
# Stripes chosen automatically (the writer's ``stripes=None``) hold at least this
# much each: below it a second file saves less time than it costs.
AUTO_STRIPE_MIN_BYTES = 32 << 20


def align_up(value: int, alignment: int) -> int:
    return (value + alignment - 1) // alignment * alignment


def new_save_id() -> str:
    return uuid.uuid4().hex[:12]


def tensor_item_nbytes(item: WriteItem) -> int:
    td = item.tensor_data
    assert td is not None
    itemsize = td.properties.dtype.itemsize
    return math.prod(td.chunk.sizes) * itemsize


@dataclasses.dataclass(frozen=True)
class RankPlanData:
    """What the coordinator tells each rank in ``SavePlan.storage_data``."""

    save_id: str
    rank: int
    tensor_bytes_end: int  # lets the rank check that its own layout matches the coordinator's
    item_count: int
    compression: tuple | None = None  # the coordinator's choice (CheckpointLayout.compression)
    stripes: tuple = ()  # the rank's stripe starts (RankFiles.stripes), checked like tensor_bytes_end
    striping: tuple = (1, 0)  # the coordinator's (max_stripes, min bytes per stripe): the rank recomputes


@dataclasses.dataclass
class RankLayout:
    rank: int
    save_id: str
    data_file: str
    index_file: str
    locations: dict  # MetadataIndex -> ItemLocation, in plan order
    tensor_bytes_end: int
    objects_base: int
    compression: tuple | None = None
    stripes: tuple = ()  # data offsets where stripes 1, 2, ... start (RankFiles.stripes)
    striping: tuple = (1, 0)  # (max_stripes, min bytes per stripe) it was placed with

    def plan_data(self) -> RankPlanData:
        return RankPlanData(
            self.save_id, self.rank, self.tensor_bytes_end, len(self.locations), self.compression, self.stripes,
            self.striping,
        )

    def files(self) -> RankFiles:
        return RankFiles(self.rank, self.data_file, self.index_file, "", self.stripes)


def place_tensors(sizes: list[int]) -> tuple[list[int], int]:
    """Offsets for tensors of ``sizes`` bytes, and the end of the last one.

    Small tensors first, packed; then large ones at page boundaries. Stable
    within each group, so the result depends only on the order given.
    """
    offsets = [0] * len(sizes)
    offset = 0
    for i, nbytes in enumerate(sizes):
        if nbytes < SMALL_TENSOR_BYTES:
            offset = align_up(offset, SMALL_ALIGN)
            offsets[i] = offset
            offset += nbytes
    for i, nbytes in enumerate(sizes):
        if nbytes >= SMALL_TENSOR_BYTES:
            offset = align_up(offset, PAGE)
            offsets[i] = offset
            offset += nbytes
    return offsets, offset


def is_compressible(nbytes: int, compression: tuple | None) -> bool:
    """Whether a tensor chunk of ``nbytes`` is stored compressed: with compression on, every
    chunk that is not small (small ones stay packed raw: a frame each would gain nothing)."""
    return compression is not None and nbytes >= SMALL_TENSOR_BYTES


def table_ordinals(items: list[WriteItem], compression: tuple | None, nbytes_of) -> dict:
    """``{MetadataIndex: ordinal}`` of a rank's entries in its index's object table.

    Objects come first, in plan order; then, with ``compression``, each large
    tensor chunk (``nbytes_of(item)`` bytes) takes the ordinals of its blocks,
    in plan order. The synchronous and the asynchronous layouts both number
    them here: the coordinator and every rank must agree.
    """
    out: dict = {}
    ordinal = 0
    for item in items:
        if item.type == WriteItemType.BYTE_IO:
            out[item.index] = ordinal
            ordinal += 1
    if compression is not None:
        for item in items:
            if item.type != WriteItemType.BYTE_IO and is_compressible(nbytes := nbytes_of(item), compression):
                out[item.index] = ordinal
                ordinal += compressed_blocks(nbytes, compression[1])
    return out


def stripe_starts(sizes: list[int], offsets: list[int], end: int, max_stripes: int, min_bytes: int) -> tuple:
    """Where a rank's data is cut into stripes: starts of large tensors (4 KiB-aligned), so
    that stripes hold about ``end / count`` bytes each (``sizes``/``offsets`` of the placed
    tensors, ``end`` the end of the last). ``count`` is at most ``max_stripes``, the number
    of large tensors, and ``end // min_bytes`` when ``min_bytes``. Cut ``k`` is the large
    tensor start nearest to ``k * end / count`` after cut ``k - 1`` (leaving a start for
    each later cut). A pure function of its arguments: the coordinator and the rank
    compute the same starts."""
    large = sorted(off for n, off in zip(sizes, offsets) if n >= SMALL_TENSOR_BYTES)
    count = min(max_stripes, len(large))  # every stripe holds a large tensor (the first also the small ones)
    large = [off for off in large if off > 0]  # a cut at 0 would leave stripe 0 empty
    if min_bytes > 0:
        count = min(count, end // min_bytes)
    starts: list[int] = []
    lo = 0  # the first candidate after the previous cut
    for k in range(1, count):
        hi = len(large) - (count - 1 - k)  # leave one candidate for each later cut
        target = k * end / count
        best = min(range(lo, hi), key=lambda i: (abs(large[i] - target), i))
        starts.append(large[best])
        lo = best + 1
    return tuple(starts)


def plan_rank_layout(
    items: list[WriteItem], rank: int, save_id: str, compression: tuple | None = None, striping: tuple = (1, 0)
) -> RankLayout:
    """Fixed offsets for raw chunks; with ``compression``, large chunks get ordinals of
    their blocks in the object table instead (after the objects', in plan order).
    ``striping``: ``(max_stripes, min bytes per stripe)`` (see :func:`stripe_starts`);
    a compressed rank is one file."""
    data_file = data_file_name(rank, save_id)
    sized = [(item, tensor_item_nbytes(item)) for item in items if item.type != WriteItemType.BYTE_IO]
    packed = [(item, n) for item, n in sized if not is_compressible(n, compression)]
    offsets, offset = place_tensors([n for _, n in packed])
    stripes = () if compression is not None else stripe_starts([n for _, n in packed], offsets, offset, *striping)
    locations: dict = {}
    for (item, nbytes), off in zip(packed, offsets):
        locations[item.index] = ItemLocation(data_file, off, nbytes, -1)
    nbytes_of = {item.index: n for item, n in sized}
    for index, ordinal in table_ordinals(items, compression, lambda item: nbytes_of[item.index]).items():
        locations[index] = ItemLocation(data_file, -1, nbytes_of.get(index, -1), ordinal)
    return RankLayout(
        rank=rank,
        save_id=save_id,
        data_file=data_file,
        index_file=index_file_name(rank, save_id),
        locations=locations,
        tensor_bytes_end=offset,
        objects_base=align_up(offset, PAGE),
        compression=compression,
        stripes=stripes,
        striping=tuple(striping),
    )


def rank_layout_of(plan: SavePlan, info: RankPlanData, known: tuple | None) -> RankLayout:
    """A rank's placement of its final synchronous plan.

    ``known`` is ``(RankLayout, item indices)`` when this process computed the
    rank's placement already (the coordinator, in ``prepare_global_plan``): it
    is used when it is for the same save and the same items. Otherwise the
    plan is placed by the same rule, and checked against the size and count
    the coordinator sent in ``info``.
    """
    if known is not None and known[0].save_id == info.save_id and known[1] == [i.index for i in plan.items]:
        return known[0]
    layout = plan_rank_layout(
        plan.items, info.rank, info.save_id, getattr(info, "compression", None), getattr(info, "striping", (1, 0))
    )
    if (
        layout.tensor_bytes_end != info.tensor_bytes_end
        or len(layout.locations) != info.item_count
        or layout.stripes != getattr(info, "stripes", ())
    ):
        raise CheckpointError(
            f"rank {info.rank}: local layout disagrees with the coordinator's "
            "(the planner reordered items after global planning)"
        )
    return layout


def assign_checkpoint_layout(
    plans: list[SavePlan], save_id: str, compression: tuple | None = None, striping: tuple = (1, 0),
    placed: dict | None = None,
) -> tuple[list[SavePlan], CheckpointLayout, list[RankLayout]]:
    """Give every rank its files and offsets.

    Returns the plans (carrying :class:`RankPlanData`), the metadata's
    storage data and the per-rank layouts. Runs on the coordinator after
    deduplication, so replicated items take space in exactly one rank's file.
    ``compression`` and ``striping`` (the coordinator's) reach every rank in its plan.
    ``placed`` maps ranks to layouts already made of the same plans by this rule (in this
    save's files), which are used as they are.
    """
    out_plans, ranks, entries, layouts = [], [], [], []
    for rank, plan in enumerate(plans):
        layout = (placed or {}).get(rank)
        if layout is None or layout.save_id != save_id:
            layout = plan_rank_layout(plan.items, rank, save_id, compression, striping)
        out_plans.append(dataclasses.replace(plan, storage_data=layout.plan_data()))
        ranks.append(layout.files())
        for index, loc in layout.locations.items():
            entries.append((*location_key(index.fqn, index.offset), rank, loc.offset, loc.length, loc.object_ordinal))
        layouts.append(layout)
    layout = CheckpointLayout(FORMAT_NAME, FORMAT_VERSION, save_id, ranks, entries, compression)
    return out_plans, layout, layouts


@dataclasses.dataclass(frozen=True)
class StagedRankData:
    """``SavePlan.storage_data`` of an asynchronous save: where a rank's snapshot put its tensors.

    The snapshot fixed its own file and offsets when ``stage()`` ran, before
    any collective; each rank sends this with its local plan so that the
    coordinator can fill the metadata. ``tensors`` maps
    ``location_key(fqn, chunk offsets)`` to ``(offset, nbytes)``.
    """

    rank: int
    save_id: str
    data_file: str
    index_file: str
    tensor_bytes_end: int
    tensors: dict
    compression: tuple | None = None  # the rank's snapshot stages raw bytes to compress later
    # An incremental snapshot: location_key -> the base's chunk (incremental.BaseChunk) it refers
    # to instead, and location_key -> content digest of its hashed tensors. With either, the
    # coordinator builds the layout from the ranks' results.
    references: dict = dataclasses.field(default_factory=dict)
    digests: dict = dataclasses.field(default_factory=dict)


def has_staged_layout(plans: list[SavePlan]) -> bool:
    return bool(plans) and all(isinstance(p.storage_data, StagedRankData) for p in plans)


def staged_locations(items: list[WriteItem], tensors: dict, compression: tuple | None, rank: int) -> dict:
    """``location_key -> (offset, length, ordinal)`` of a rank's final plan after a snapshot.

    Objects get ordinals in plan order. Without compression a tensor stays where
    the snapshot put it. With compression, small tensors keep their offsets (the
    save copies the snapshot's packed small tensors as they are) and large ones
    get block ordinals after the objects', in plan order. The coordinator (for
    the metadata) and the rank (for its results) both compute it from the plan.
    """
    placed: dict = {}  # MetadataIndex -> (offset, nbytes) where the snapshot put it
    for item in items:
        if item.type != WriteItemType.BYTE_IO:
            where = tensors.get(location_key(item.index.fqn, item.index.offset))
            if where is None:
                raise CheckpointError(f"rank {rank} planned {item.index.fqn!r} but its snapshot does not hold it")
            placed[item.index] = where
    ordinals = table_ordinals(items, compression, lambda item: placed[item.index][1])
    out: dict = {}
    for item in sorted(items, key=lambda item: item.type != WriteItemType.BYTE_IO):  # objects first, as before
        key = location_key(item.index.fqn, item.index.offset)
        ordinal = ordinals.get(item.index, -1)
        if item.type == WriteItemType.BYTE_IO:
            out[key] = (-1, -1, ordinal)
        elif ordinal >= 0:  # compressed: its blocks in the object table
            out[key] = (-1, placed[item.index][1], ordinal)
        else:
            out[key] = (*placed[item.index], -1)
    return out


def assign_staged_layout(plans: list[SavePlan], save_id: str) -> CheckpointLayout:
    """The metadata's storage data for plans whose ranks already placed their tensors.

    Runs on the coordinator after deduplication: an item kept in rank r's
    plan is read from rank r's snapshot. Objects get ordinals in plan order,
    as ``write_data`` appends them.
    """
    compressions = {getattr(p.storage_data, "compression", None) for p in plans}
    if len(compressions) > 1:
        raise CheckpointError(
            f"ranks staged with different compression settings ({sorted(map(str, compressions))}); "
            "every rank's DataStatesWriter must use the same compression"
        )
    compression = compressions.pop() if compressions else None
    ranks, entries = [], []
    for rank, plan in enumerate(plans):
        staged: StagedRankData = plan.storage_data
        ranks.append(RankFiles(rank, staged.data_file, staged.index_file, staged.save_id))
        for key, (offset, length, ordinal) in staged_locations(plan.items, staged.tensors, compression, rank).items():
            entries.append((*key, rank, offset, length, ordinal))
    return CheckpointLayout(FORMAT_NAME, FORMAT_VERSION, save_id, ranks, entries, compression)
