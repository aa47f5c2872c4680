"""Saving with DCP's save-plan caching (``DefaultSavePlanner(enable_plan_caching=True)``).

With plan caching, a rank whose local plan has not changed since the save
that filled DCP's cache sends an empty, unusable plan, and the coordinator
answers with an unusable plan; the rank then writes the final plan DCP cached
in that earlier save. That plan's storage data names the earlier save: its
save id, hence its file names. Offsets are a function of the plan's items
(:mod:`layout`), so they stay right; only the files must be new for every
save (an overwrite must never write into the files of the checkpoint it
replaces). So, in a save where some plan came from the cache:

* a rank places its items again, in files named by its own new save id
  (:func:`is_stale` tells such a plan from a fresh one);
* every rank reports the files it wrote in its write results
  (:func:`report_result`), which reach the coordinator's ``finish``;
* the coordinator places every rank's cached global plan again by the same rule
  while the data is written (its planner keeps them), serializes the metadata
  early as usual, and checks in ``finish`` that every rank wrote what it placed;
  where it cannot (no global plans at hand, asynchronous snapshots), it builds
  the checkpoint's layout from those results (:func:`layout_from_results`)
  and serializes the metadata then.

Saves without cached plans keep the coordinator's layout and the early
metadata; their reports only confirm it (:func:`reports_match`).
"""

from __future__ import annotations

import dataclasses

from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.storage import WriteResult

from dcp_datastates.errors import CheckpointError
from dcp_datastates.format.checkpoint_layout import FORMAT_NAME, FORMAT_VERSION, CheckpointLayout, ItemLocation, RankFiles, location_key
from dcp_datastates.core.layout import RankLayout, RankPlanData, StagedRankData, plan_rank_layout

# The key of a rank's report among its write results: no state-dict key starts with NUL.
REPORT_INDEX = MetadataIndex("\x00dcp_datastates.rank_files")

_WRITTEN_MARK = "_dcp_datastates_written"  # set on plan storage data a rank has written


@dataclasses.dataclass(frozen=True)
class RankReport:
    """The files a rank wrote in this save (``WriteResult.storage_data`` of :data:`REPORT_INDEX`)."""

    data_file: str
    index_file: str
    save_id: str
    compression: tuple | None = None
    stripes: tuple = ()  # RankFiles.stripes
    # An incremental save (format 8): the base ranks its results refer to (RankFiles with
    # ``base`` set) and the content digests of its large chunks, ``(fqn, chunk offsets, digest)``.
    bases: tuple = ()
    digests: tuple = ()


def has_increments(reports: list) -> bool:
    """Whether a rank's results refer to a base or carry digests: the layout is built from them."""
    return any(r is not None and (getattr(r, "bases", ()) or getattr(r, "digests", ())) for r in reports)


def is_stale(info) -> bool:
    """Whether a synchronous rank's plan storage data is from DCP's cache (an earlier save):
    a layout this process already wrote, an asynchronous snapshot's placement, or the
    storage data of another writer (a FileSystemWriter save that filled DCP's cache)."""
    if info is None:
        return False  # no storage data at all: the caller reports a skipped prepare_global_plan
    if not isinstance(info, RankPlanData):
        return True
    return getattr(info, _WRITTEN_MARK, False)


def place_cached_plan(
    plan, stale, rank: int, save_id: str, compression: tuple | None, striping: tuple = (1, 0)
) -> RankLayout:
    """A final plan DCP's cache returned (its storage data ``stale`` names an earlier save),
    placed again in files named by ``save_id``, with this writer's ``compression``.

    The cached placement can be checked against the new one only when it was
    made with the same compression (compressed chunks leave the raw tensor
    area, so its end moves).
    """
    rank = stale.rank if isinstance(getattr(stale, "rank", None), int) else rank
    layout = plan_rank_layout(plan.items, rank, save_id, compression, striping)
    if (
        isinstance(stale, RankPlanData)
        and getattr(stale, "compression", None) == compression
        and (layout.tensor_bytes_end != stale.tensor_bytes_end or len(layout.locations) != stale.item_count)
    ):
        raise CheckpointError(f"rank {rank}: the cached plan no longer matches its own layout")
    return layout


def mark_written(info: RankPlanData) -> None:
    """Remember plan storage data a rank is writing (DCP may hand it back from its cache)."""
    object.__setattr__(info, _WRITTEN_MARK, True)  # a frozen dataclass: a marker, not a field


def report_result(report: RankReport) -> WriteResult:
    return WriteResult(index=REPORT_INDEX, size_in_bytes=0, storage_data=report)


def split_reports(results: list[list[WriteResult]]) -> tuple[list[list[WriteResult]], list[RankReport | None]]:
    """Each rank's item results without its report, and the reports (None where a rank sent none)."""
    items, reports = [], []
    for rank_results in results:
        report = None
        kept = []
        for wr in rank_results:
            if wr.index == REPORT_INDEX and isinstance(wr.storage_data, RankReport):
                report = wr.storage_data
            else:
                kept.append(wr)
        items.append(kept)
        reports.append(report)
    return items, reports


def reports_match(layout: CheckpointLayout, reports: list[RankReport | None]) -> bool:
    """Whether every rank wrote the files ``layout`` names for it."""
    named = {r.rank: r for r in layout.ranks}
    for rank, report in enumerate(reports):
        files = named.get(rank)
        if report is None:
            continue
        if files is None or (files.data_file, files.index_file, files.stripes) != (
            report.data_file, report.index_file, getattr(report, "stripes", ())
        ):
            return False
    return True


def layout_from_results(
    results: list[list[WriteResult]], reports: list[RankReport | None], save_id: str, metadata: Metadata, where: str
) -> CheckpointLayout:
    """The checkpoint's layout from what the ranks wrote: their files and every item's location
    (with references to base ranks, slots after the own ranks, for an incremental save)."""
    ranks, entries, compressions, digests = [], [], set(), {}
    base_slots: dict = {}  # a base rank's data path -> its slot
    bases: list = []
    for report in reports:
        for files in getattr(report, "bases", ()) if report is not None else ():
            if files.data_path not in base_slots:
                base_slots[files.data_path] = len(results) + len(bases)
                bases.append(files)
    for rank, (rank_results, report) in enumerate(zip(results, reports)):
        if report is None:
            raise CheckpointError(f"rank {rank} did not report its files (is every rank's writer a DataStatesWriter?)")
        ranks.append(RankFiles(rank, report.data_file, report.index_file, report.save_id, getattr(report, "stripes", ())))
        compressions.add(report.compression)
        for fqn, off, digest in getattr(report, "digests", ()):
            digests[(fqn, off)] = digest
        for wr in rank_results:
            loc = wr.storage_data
            path = getattr(loc, "relative_path", loc)
            slot = rank if path == report.data_file else base_slots.get(path)
            if not isinstance(loc, ItemLocation) or slot is None:
                raise CheckpointError(
                    f"rank {rank}'s write result for {wr.index.fqn!r} names {path!r}, "
                    f"not the data file it reported ({report.data_file}) nor a base it refers to"
                )
            entries.append((*location_key(wr.index.fqn, wr.index.offset), slot, loc.offset, loc.length, loc.object_ordinal))
    ranks += bases
    if len(compressions) > 1:
        raise CheckpointError(
            f"ranks wrote with different compression settings ({sorted(map(str, compressions))}); "
            "every rank's DataStatesWriter must use the same compression"
        )
    compression = compressions.pop() if compressions else None
    layout = CheckpointLayout(FORMAT_NAME, FORMAT_VERSION, save_id, ranks, entries, compression, digests)
    layout.validate(where)
    layout.check_covers(metadata, where)
    return layout
