"""Where each item of a rank lands in that rank's data file: a pure function of its items.

Every rank places its own items (:func:`place_rank`) by the :class:`PlacementRule`
of the save, before any byte moves; the coordinator places every rank's plan by
the same rule only to predict the layout and serialize the metadata early
(:mod:`coordinator_layout`). No per-item offsets travel through the collectives.

Rules:
- tensors under ``SMALL_TENSOR_BYTES`` are packed back to back at 64-byte
  alignment (cache-line aligned, enough for every dtype), so thousands of
  small tensors coalesce into a few large writes;
- larger tensors start at a 4 KiB boundary (O_DIRECT alignment);
- Python objects are serialized during the write and appended after the
  last tensor, from the next 4 KiB boundary, in plan order;
- with compression, large chunks leave the raw area: their blocks take
  ordinals in the object table after the objects' (:func:`table_ordinals`);
- with stripes (format 7), the rank's data is cut at the starts of large
  tensors into up to ``max_stripes`` parts of about equal size, each written
  to its own file by its own thread (:func:`stripe_starts`); the offsets
  above do not change, objects go to the last stripe.

Asynchronous saves place their tensors when ``stage()`` captures the snapshot;
:class:`StagedRankData` carries that placement in the rank's local plan.
"""

from __future__ import annotations

import dataclasses
import math
import uuid
import weakref

from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

from dcp_datastates.errors import CheckpointError
from dcp_datastates.format.checkpoint_layout import STREAM_CODEC, ItemLocation, RankFiles, compressed_blocks, location_key
from dcp_datastates.format.file_names import data_file_name, index_file_name

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


@dataclasses.dataclass(frozen=True, eq=False)
class PlacementRule:
    """How every rank of a synchronous save places its items: ``SavePlan.storage_data`` of
    the plans the coordinator sends (its compression and striping reach every rank).

    ``save_id`` names the files. ``striping`` is ``(max_stripes, min bytes per
    stripe)`` for :func:`stripe_starts`. Compared by identity: see :func:`rule_to_place`.
    """

    save_id: str
    compression: tuple | None = None
    striping: tuple = (1, 0)


# Rules a rank of this process placed items by. DCP's save-plan caching
# (``enable_plan_caching=True``) hands a rank the final plan of an earlier save
# again, its rule included: that rule names the earlier save's files, which an
# overwrite must never write into.
_PLACED_BY: weakref.WeakSet = weakref.WeakSet()


def rule_to_place(storage_data, own: PlacementRule) -> PlacementRule:
    """The rule a rank places its final synchronous plan by: the coordinator's, sent with the
    plan in this save; or ``own`` (this rank's save id and writer settings) for a plan DCP's
    cache returned (a rule already placed by, an asynchronous snapshot's placement, or the
    storage data of another writer). The coordinator predicts the layout with the same
    rule, so a rank whose files differ only makes it rebuild the layout from the reports."""
    if storage_data is None:
        raise CheckpointError("the save plan carries no dcp_datastates placement rule; was prepare_global_plan skipped?")
    if isinstance(storage_data, PlacementRule) and storage_data not in _PLACED_BY:
        _PLACED_BY.add(storage_data)
        return storage_data
    return own


@dataclasses.dataclass(frozen=True)
class RankPlacement:
    """A rank's files and the location of each of its items (``locations``, in plan order)."""

    rank: int
    save_id: str
    data_file: str
    index_file: str
    locations: dict  # MetadataIndex -> ItemLocation (not changed once placed)
    tensor_bytes_end: int
    objects_base: int
    compression: tuple | None = None
    stripes: tuple = ()  # data offsets where stripes 1, 2, ... start (RankFiles.stripes)

    def files(self) -> RankFiles:
        return RankFiles(self.rank, self.data_file, self.index_file, "", self.stripes)

    def file_names(self) -> list[str]:
        """Every file the rank writes (removed if the save fails)."""
        return self.files().file_names()


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
    """Whether a tensor chunk of ``nbytes`` is stored as frames: with zstd, every chunk that is
    not small (small ones stay packed raw: a frame each would gain nothing); with DCP's stream
    transforms, every chunk that has a byte (a transform may be an encryption)."""
    if compression is None:
        return False
    return nbytes > 0 if compression[0] == STREAM_CODEC else nbytes >= SMALL_TENSOR_BYTES


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


def place_rank(items: list[WriteItem], rank: int, rule: PlacementRule) -> RankPlacement:
    """Fixed offsets for raw chunks; with compression, large chunks get ordinals of their
    blocks in the object table instead (after the objects', in plan order), and the rank
    is one file."""
    compression = rule.compression
    data_file = data_file_name(rank, rule.save_id)
    sized = [(item, tensor_item_nbytes(item)) for item in items if item.type != WriteItemType.BYTE_IO]
    packed = [(item, n) for item, n in sized if not is_compressible(n, compression)]
    offsets, offset = place_tensors([n for _, n in packed])
    stripes = () if compression is not None else stripe_starts([n for _, n in packed], offsets, offset, *rule.striping)
    locations: dict = {}
    for (item, nbytes), off in zip(packed, offsets):
        locations[item.index] = ItemLocation(data_file, off, nbytes, -1)
    nbytes_of = {item.index: n for item, n in sized}
    for index, ordinal in table_ordinals(items, compression, lambda item: nbytes_of[item.index]).items():
        locations[index] = ItemLocation(data_file, -1, nbytes_of.get(index, -1), ordinal)
    return RankPlacement(
        rank, rule.save_id, data_file, index_file_name(rank, rule.save_id), locations, offset,
        align_up(offset, PAGE), compression, stripes,
    )


@dataclasses.dataclass(frozen=True)
class StagedRankData:
    """``SavePlan.storage_data`` of an asynchronous save: where a rank's snapshot put its tensors.

    The snapshot fixed its own file and offsets when ``stage()`` ran, before
    any collective; each rank sends this with its local plan so that the
    coordinator can fill the metadata. ``tensors`` maps
    ``location_key(fqn, chunk offsets)`` to ``(offset, nbytes)``.
    """

    save_id: str
    data_file: str
    index_file: str
    tensors: dict
    compression: tuple | None = None  # the rank's snapshot stages raw bytes to compress later
    # An incremental snapshot: location_key -> the base's chunk (incremental.BaseChunk) it refers
    # to instead, and location_key -> content digest of its hashed tensors. With either, the
    # coordinator builds the layout from the ranks' results.
    references: dict = dataclasses.field(default_factory=dict)
    digests: dict = dataclasses.field(default_factory=dict)


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
