"""What each rank reports to the coordinator about the files it wrote: one extra WriteResult.

The coordinator's layout is built from what the ranks wrote, and besides each
item's location (its ``WriteResult``) it needs facts of the rank as a whole:
its file names and save id, its stripes and compression, and for an
incremental save the base ranks it refers to and the content digests of its
chunks. DCP gives a rank no other channel to the coordinator after planning:
``write_data``'s results are the only thing gathered to ``finish``, and a
``WriteResult`` per item cannot carry them (a rank may have no items at all).
So each rank appends one :class:`RankReport` under a key no state dict can
hold (:data:`REPORT_INDEX`), and ``finish`` takes the reports out before
anything else reads the results (:func:`split_reports`). This module is the
only place that knows.
"""

from __future__ import annotations

import dataclasses

from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.storage import WriteResult

# The key of a rank's report among its write results: no state-dict key starts with NUL.
REPORT_INDEX = MetadataIndex("\x00dcp_datastates.rank_files")


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


def with_report(results: list[WriteResult], report: RankReport) -> list[WriteResult]:
    """A rank's write results with its report appended (what ``write_data`` returns)."""
    results.append(WriteResult(index=REPORT_INDEX, size_in_bytes=0, storage_data=report))
    return results


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
