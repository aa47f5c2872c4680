"""What each rank reports to the coordinator about what it wrote: one WriteResult in all.

The coordinator's layout is built from what the ranks wrote: every item's location, and facts
of the rank as a whole: its file names and save id, its stripes and compression, and for an
incremental save the base ranks it refers to and the content digests of its chunks. DCP gives
a rank no other channel to the coordinator after planning: ``write_data``'s results are the
only thing gathered to ``finish``, in one pickle. DCP's writers return a ``WriteResult`` per
item, each with its ``MetadataIndex`` (a ``torch.Size`` inside) and location: pickling and
unpickling them was a large part of a save of many small tensors. So each rank returns one
``WriteResult``, under a key no state dict can hold (:data:`REPORT_INDEX`), whose
:class:`RankReport` carries the rank's files and every item's location as a plain tuple
(:func:`item_entry`: strings and integers, which pickle writes without a Python call), and
``finish`` takes the reports out (:func:`split_reports`). This module is the only place that
knows.
"""

from __future__ import annotations

import dataclasses

from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.storage import WriteResult

from dcp_datastates.format.checkpoint_layout import ItemLocation, location_key

# The key of a rank's report among its write results: no state-dict key starts with NUL.
REPORT_INDEX = MetadataIndex("\x00dcp_datastates.rank_files")


@dataclasses.dataclass(frozen=True)
class RankReport:
    """What a rank wrote in this save (``WriteResult.storage_data`` of :data:`REPORT_INDEX`)."""

    data_file: str
    index_file: str
    save_id: str
    compression: tuple | None = None
    stripes: tuple = ()  # RankFiles.stripes
    # An incremental save (format 8): the base ranks its items refer to (RankFiles with
    # ``base`` set) and the content digests of its large chunks, ``(fqn, chunk offsets, digest)``.
    bases: tuple = ()
    digests: tuple = ()
    # Every item the rank wrote or refers to, as :func:`item_entry` makes it.
    items: tuple = ()


def item_entry(index: MetadataIndex, location: ItemLocation) -> tuple:
    """``(fqn, chunk offsets as a tuple or None, relative path, offset, length, object ordinal)``:
    where a rank put the item ``index`` (the path is a base's data file for a reference)."""
    return (*location_key(index.fqn, index.offset), *location)


def rank_results(report: RankReport, items: list) -> list[WriteResult]:
    """What a rank's ``write_data`` returns: its report, with the entries of its ``items``."""
    report = dataclasses.replace(report, items=tuple(items))
    return [WriteResult(index=REPORT_INDEX, size_in_bytes=0, storage_data=report)]


def split_reports(results: list[list[WriteResult]]) -> tuple[list[tuple], list[RankReport | None]]:
    """Each rank's item entries and its report (no entries and None where a rank sent none)."""
    items, reports = [], []
    for sent in results:
        report = None
        for wr in sent:
            if wr.index == REPORT_INDEX and isinstance(wr.storage_data, RankReport):
                report = wr.storage_data
        items.append(report.items if report is not None else ())
        reports.append(report)
    return items, reports
