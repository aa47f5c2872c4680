"""The checkpoint's layout (``Metadata.storage_data``) on the coordinator: predicted, then checked.

Each rank places its own items (:mod:`placement`) and reports what it wrote
(:mod:`rank_reports`); the checkpoint's layout is what the ranks report
(:func:`layout_from_reports`). So that the metadata can be serialized while
the data is still being written, the coordinator first predicts the layout:
it places every rank's final plan by the save's rule (:func:`predict_layout`),
or, in an asynchronous save, takes the placements the snapshots sent with
their plans (:func:`predict_staged_layout`). ``finish`` keeps the prediction,
and the metadata serialized with it, only where the reports confirm it
(:meth:`LayoutPrediction.holds`). It does not hold where a rank wrote a plan
from DCP's cache (files named by its own save id), where a save refers to a
base checkpoint or records digests, or where a planner changed its items
after global planning; the layout is then built from the reports.
"""

from __future__ import annotations

import dataclasses

from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan

from dcp_datastates.core.placement import PlacementRule, RankPlacement, StagedRankData, place_rank, staged_locations
from dcp_datastates.core.rank_reports import RankReport
from dcp_datastates.errors import CheckpointError
from dcp_datastates.format.checkpoint_layout import FORMAT_NAME, FORMAT_VERSION, CheckpointLayout, RankFiles


@dataclasses.dataclass(frozen=True)
class LayoutPrediction:
    """The layout the coordinator expects the ranks to report."""

    layout: CheckpointLayout
    # Per rank, {(fqn, chunk offsets): (offset, length, object ordinal)} of every item placed.
    expected: tuple

    def holds(self, items: list[tuple], reports: list[RankReport | None]) -> bool:
        """Whether every rank reported the files and compression the prediction names for it,
        without references or digests, and wrote every item where it says (``items``: each
        rank's entries)."""
        ranks = self.layout.ranks
        if len(items) != len(ranks) or len(reports) != len(ranks):
            return False
        for entries, report, files, expected in zip(items, reports, ranks, self.expected):
            if report is None or report.bases or report.digests:
                return False
            if (files.data_file, files.index_file, files.stripes) != (report.data_file, report.index_file, report.stripes):
                return False
            if report.compression != self.layout.compression:
                return False
            if len(entries) != len(expected):
                return False
            data_file = files.data_file
            written = {}
            for fqn, off, path, offset, length, ordinal in entries:
                if path != data_file:
                    return False
                written[(fqn, off)] = (offset, length, ordinal)
            if written != expected:
                return False
        return True


def predict_layout(plans: list[SavePlan], rule: PlacementRule, own: RankPlacement | None = None) -> LayoutPrediction:
    """Every rank's final synchronous plan placed by ``rule`` (``own``: the coordinator's own
    placement by it, used as it is)."""
    ranks, entries, expected = [], [], []
    # One string object per key, the first plan's (the metadata's key): the pickle of
    # ``.metadata`` then refers back to it instead of repeating the key in every rank's entry.
    keys: dict = {}
    for rank, plan in enumerate(plans):
        placement = own if own is not None and own.rank == rank and own.save_id == rule.save_id else None
        if placement is None:
            placement = place_rank(plan.items, rank, rule)
        ranks.append(placement.files())
        placed = {}
        for index, loc in placement.locations.items():
            fqn, off = index.fqn, index.offset
            key = (keys.setdefault(fqn, fqn), None if off is None else tuple(off))
            where = placed[key] = (loc.offset, loc.length, loc.object_ordinal)
            entries.append((*key, rank, *where))
        expected.append(placed)
    layout = CheckpointLayout(FORMAT_NAME, FORMAT_VERSION, rule.save_id, ranks, entries, rule.compression)
    return LayoutPrediction(layout, tuple(expected))


def predict_staged_layout(plans: list[SavePlan], save_id: str) -> LayoutPrediction | None:
    """The layout of an asynchronous save whose ranks' snapshots placed their tensors (each
    plan's :class:`StagedRankData`); None for an incremental one (references and digests are
    reported with the data). An item kept in rank r's plan after deduplication is read from
    rank r's snapshot; objects get ordinals in plan order, as the rank appends them."""
    staged: list[StagedRankData] = [p.storage_data for p in plans]
    if any(s.references or s.digests for s in staged):
        return None
    compression = _one_compression({s.compression for s in staged}, "staged")
    ranks, entries, expected = [], [], []
    for rank, (plan, s) in enumerate(zip(plans, staged)):
        ranks.append(RankFiles(rank, s.data_file, s.index_file, s.save_id))
        placed = staged_locations(plan.items, s.tensors, compression, rank)
        for key, (offset, length, ordinal) in placed.items():
            entries.append((*key, rank, offset, length, ordinal))
        expected.append(placed)
    layout = CheckpointLayout(FORMAT_NAME, FORMAT_VERSION, save_id, ranks, entries, compression)
    return LayoutPrediction(layout, tuple(expected))


def layout_from_reports(
    items: list[tuple], reports: list[RankReport | None], save_id: str, metadata: Metadata, where: str
) -> CheckpointLayout:
    """The checkpoint's layout from what the ranks wrote: their files and every item's location
    (``items``: each rank's entries; with references to base ranks, slots after the own ranks,
    for an incremental save)."""
    ranks, entries, compressions, digests = [], [], set(), {}
    base_slots: dict = {}  # a base rank's data path -> its slot
    bases: list = []
    for report in reports:
        for files in report.bases if report is not None else ():
            if files.data_path not in base_slots:
                base_slots[files.data_path] = len(items) + len(bases)
                bases.append(files)
    for rank, (rank_items, report) in enumerate(zip(items, reports)):
        if report is None:
            raise CheckpointError(f"rank {rank} did not report its files (is every rank's writer a DataStatesWriter?)")
        ranks.append(RankFiles(rank, report.data_file, report.index_file, report.save_id, report.stripes))
        compressions.add(report.compression)
        for fqn, off, digest in report.digests:
            digests[(fqn, off)] = digest
        for fqn, off, path, offset, length, ordinal in rank_items:
            slot = rank if path == report.data_file else base_slots.get(path)
            if slot is None:
                raise CheckpointError(
                    f"rank {rank}'s write result for {fqn!r} names {path!r}, "
                    f"not the data file it reported ({report.data_file}) nor a base it refers to"
                )
            entries.append((fqn, off, slot, offset, length, ordinal))
    ranks += bases
    compression = _one_compression(compressions, "wrote")
    layout = CheckpointLayout(FORMAT_NAME, FORMAT_VERSION, save_id, ranks, entries, compression, digests)
    layout.validate(where)
    layout.check_covers(metadata, where)
    return layout


def _one_compression(compressions: set, did: str):
    """The one compression every rank used (None: raw); ranks that disagree are an error."""
    if len(compressions) > 1:
        raise CheckpointError(
            f"ranks {did} with different compression settings ({sorted(map(str, compressions))}); "
            "every rank's DataStatesWriter must use the same compression"
        )
    return compressions.pop() if compressions else None
