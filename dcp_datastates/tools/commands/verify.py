"""``dcp-datastates verify``: every checksum of checkpoints, in directories or object storage alike.

Each location is verified by :func:`core.verify.verify` itself, through the
store its reader opens, with every check it makes: a directory, a step's URL
(``s3://bucket/run/step_N``), or a tier's root URL (``s3://bucket/run``),
which stands for each committed step under it. The exit status is 1 when any
of them fails.
"""

from __future__ import annotations

import os

from dcp_datastates.storage.url import is_store_url
from dcp_datastates.tools import checkpoints
from dcp_datastates.tools.common import one_line
from dcp_datastates.tools.progress import LazyProgress


def locations(location: str) -> list[str]:
    """The checkpoints a location names: itself, or, for a tier's root URL, its committed steps."""
    if not is_store_url(location):
        return [location]
    root, step_dir = checkpoints.split_step_url(location)
    if step_dir is not None:
        return [location]
    from dcp_datastates.storage import open_store

    store = open_store(root)
    try:
        return [f"{root}/{s.name}" for s in checkpoints.stored_steps(store) if s.state == checkpoints.COMMITTED]
    finally:
        store.close()


def verify_one(path: str, *, allow_pickle: bool = False, quiet: bool = True, digests: bool = False) -> tuple[bool, str]:
    """``(ok, report text)`` for one checkpoint: never raises, so one bad path does not stop the others."""
    from dcp_datastates.core.verify import verify as verify_checkpoint

    if not is_store_url(path) and not os.path.isdir(path):
        why = "not a directory" if os.path.exists(path) else "no such file or directory"
        return False, f"NOT FOUND: {path}: {why}"
    bar = LazyProgress(os.path.basename(os.path.normpath(path)) or path, quiet)
    try:
        report = verify_checkpoint(path, allow_pickle=allow_pickle, progress=bar, digests=digests)
    except Exception as exc:  # noqa: BLE001 - a store that does not answer, a permission error listing the directory
        return False, f"FAILED: {path}: {one_line(exc)}"
    finally:
        bar.close()
    if not report.ok and report.committed and checkpoints.open_checkpoint(path, allow_pickle)[0] == checkpoints.STOCK_DCP:
        return False, f"NOT VERIFIED: {path}: not a dcp_datastates checkpoint (stock DCP has no checksums to verify)"
    return report.ok, report.summary()


def verify_location(location: str, *, allow_pickle: bool = False, quiet: bool = True, digests: bool = False):
    """Yield ``(ok, report text)`` of each checkpoint ``location`` names, as each is verified."""
    try:
        paths = locations(location)
    except Exception as exc:  # noqa: BLE001 - the store could not be reached: this location fails
        yield False, f"FAILED: {location}: {one_line(exc)}"
        return
    if not paths:
        yield False, f"NOT FOUND: {location}: no committed checkpoint there"
    for path in paths:
        yield verify_one(path, allow_pickle=allow_pickle, quiet=quiet, digests=digests)


def run(args) -> int:
    failed = n = 0
    for location in args.ckpts:
        for ok, text in verify_location(location, allow_pickle=args.allow_pickle, quiet=args.quiet, digests=args.digests):
            print(text, flush=True)
            failed += not ok
            n += 1
    if n > 1:
        print(f"{n} checkpoints: {n - failed} OK, {failed} failed")
    return 1 if failed else 0
