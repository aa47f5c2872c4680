"""``dcp-datastates verify``: every checksum of checkpoints, in directories or object storage alike.

Each location is verified by :func:`core.verify.verify` itself, through the
store its reader opens, with every check it makes: a checkpoint directory, a
step's URL (``s3://bucket/run/step_N``), or a run root (a CheckpointManager
root, or a tier's root URL ``s3://bucket/run``), which stands for each
committed step under it, or with ``--latest`` for the one its ``latest``
pointer names (:func:`checkpoints.checkpoints_named`). One result per
checkpoint, as text or (``--json``) one document; the exit status is 1 when
any of them fails.
"""

from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING

from dcp_datastates.storage.url import is_store_url
from dcp_datastates.tools import checkpoints
from dcp_datastates.tools.common import one_line, print_json
from dcp_datastates.tools.progress import LazyProgress

if TYPE_CHECKING:
    from dcp_datastates.core.verify import VerifyReport

NOT_FOUND, NOT_VERIFIED, FAILED = "NOT FOUND", "NOT VERIFIED", "FAILED"  # beside the report's own status


@dataclasses.dataclass
class VerifyOutcome:
    """What ``verify`` says of one location: its status (one of the names above), and
    :func:`core.verify.verify`'s report, or the reason there is none."""

    path: str
    status: str
    report: VerifyReport | None = None
    reason: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == "OK"

    @property
    def text(self) -> str:
        """The lines printed for it (the report's summary, or the status and the reason)."""
        return self.report.summary() if self.reason is None else f"{self.status}: {self.path}: {self.reason}"

    def to_json(self) -> dict:
        """The outcome as plain data: the report's fields when verification ran, else the reason."""
        doc: dict = {"path": self.path, "status": self.status, "ok": self.ok}
        if self.reason is not None:
            doc["reason"] = self.reason
        if self.report is not None:
            doc.update({k: v for k, v in dataclasses.asdict(self.report).items() if k != "path"})
        return doc


def locations(location: str, latest: bool = False) -> list[str]:
    """The checkpoints a location names: itself, or, for a run root (a directory or a tier's
    URL), its committed steps (``latest``: the one its pointer names)."""
    return checkpoints.checkpoints_named(location, latest)


def verify_one(path: str, *, allow_pickle: bool = False, quiet: bool = True, digests: bool = False) -> VerifyOutcome:
    """The :class:`VerifyOutcome` of one checkpoint (its report's status, or one of the names above):
    never raises, so one bad path does not stop the others."""
    from dcp_datastates.core.verify import verify as verify_checkpoint

    if not is_store_url(path) and not os.path.isdir(path):
        why = "not a directory" if os.path.exists(path) else "no such file or directory"
        return VerifyOutcome(path, NOT_FOUND, reason=why)
    bar = LazyProgress(os.path.basename(os.path.normpath(path)) or path, quiet)
    try:
        report = verify_checkpoint(path, allow_pickle=allow_pickle, progress=bar, digests=digests)
    except Exception as exc:  # noqa: BLE001 - a store that does not answer, a permission error listing the directory
        return VerifyOutcome(path, FAILED, reason=one_line(exc))
    finally:
        bar.close()
    if not report.ok and report.committed and checkpoints.open_checkpoint(path, allow_pickle)[0] == checkpoints.STOCK_DCP:
        why = "not a dcp_datastates checkpoint (stock DCP has no checksums to verify)"
        return VerifyOutcome(path, NOT_VERIFIED, report, why)
    return VerifyOutcome(path, report.status, report)


def verify_location(location: str, *, allow_pickle: bool = False, quiet: bool = True, digests: bool = False,
                    latest: bool = False):
    """Yield the :class:`VerifyOutcome` of each checkpoint ``location`` names, as each is verified."""
    try:
        paths = locations(location, latest)
    except Exception as exc:  # noqa: BLE001 - the store could not be reached, no pointer: this location fails
        yield VerifyOutcome(location, FAILED, reason=one_line(exc))
        return
    if not paths:
        yield VerifyOutcome(location, NOT_FOUND, reason="no committed checkpoint there")
    for path in paths:
        yield verify_one(path, allow_pickle=allow_pickle, quiet=quiet, digests=digests)


def run(args) -> int:
    outcomes = []
    for location in args.ckpts:
        for outcome in verify_location(location, allow_pickle=args.allow_pickle, quiet=args.quiet,
                                       digests=args.digests, latest=args.latest):
            outcomes.append(outcome)
            if not args.json:
                print(outcome.text, flush=True)
    failed = sum(not o.ok for o in outcomes)
    if args.json:
        print_json({"checkpoints": [o.to_json() for o in outcomes], "ok": len(outcomes) - failed, "failed": failed})
    elif len(outcomes) > 1:
        print(f"{len(outcomes)} checkpoints: {len(outcomes) - failed} OK, {failed} failed")
    return 1 if failed else 0
