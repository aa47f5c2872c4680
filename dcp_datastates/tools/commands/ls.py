"""``dcp-datastates ls``: the checkpoints under a directory or on a durable tier, with their state.

Reads directory entries and ``.metadata`` only, so it is instant on a
checkpoint of any size. :func:`list_checkpoints` is the library function
(plain data); :func:`run` renders it as an aligned table or one JSON document.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import sys

from dcp_datastates.manager.checkpoint_root import read_latest
from dcp_datastates.format.file_names import METADATA_FILE
from dcp_datastates.storage.url import is_store_url
from dcp_datastates.tools import checkpoints
from dcp_datastates.tools.checkpoints import COMMITTED, INCOMPLETE, STOCK_DCP
from dcp_datastates.tools.common import PROG, format_table, human_bytes, one_line, print_json


@dataclasses.dataclass
class CheckpointEntry:
    """One row of ``ls``."""

    step: int | None
    name: str
    path: str
    state: str
    bytes: int
    ranks: int | None
    keys: int | None
    modified: str | None  # ISO local time of .metadata (of the newest file, when uncommitted)
    error: str | None = None
    latest: bool = False


@dataclasses.dataclass
class Listing:
    root: str
    latest: int | None
    checkpoints: list[CheckpointEntry]
    warnings: list[str]


def describe_checkpoint(path: str, step: int | None = None) -> CheckpointEntry:
    """The ``ls`` row of one checkpoint directory: reads its ``.metadata`` and directory entries only."""
    files = checkpoints.dir_files(path)
    state, summary, error = checkpoints.summarize_checkpoint(path)
    ranks = keys = None
    if summary is not None:
        ranks, keys = summary.ranks, summary.keys
    md = next((st for name, st in files if name == METADATA_FILE), None)
    if md is not None:
        mtime = md.st_mtime
    elif files:
        mtime = max(st.st_mtime for _, st in files)
    else:
        mtime = os.lstat(path).st_mtime
    return CheckpointEntry(
        step, os.path.basename(os.path.normpath(path)), path, state, sum(st.st_size for _, st in files),
        ranks, keys, datetime.datetime.fromtimestamp(mtime).isoformat(timespec="seconds"),
        None if state == INCOMPLETE else error,
    )


def list_checkpoints(root: str) -> Listing:
    """Every checkpoint directory under ``root`` (or ``root`` itself), and the ``latest`` pointer.

    A malformed pointer, or one naming a step that is missing or not
    committed, is a warning: the listing is still what the user needs.
    """
    entries = [describe_checkpoint(p, step) for step, p in checkpoints.find_checkpoints(root)]
    warnings = []
    latest = None
    try:
        latest = read_latest(root)
    except (ValueError, OSError) as exc:
        warnings.append(one_line(exc))
    if latest is not None:
        marked = [e for e in entries if e.step == latest]
        for e in marked:
            e.latest = True
        if not marked:
            warnings.append(f"{os.path.join(root, 'latest')} names step {latest}, which has no directory")
        elif not any(e.state in (COMMITTED, STOCK_DCP) for e in marked):
            warnings.append(f"{os.path.join(root, 'latest')} names step {latest}, which is {marked[0].state}")
    return Listing(root, latest, entries, warnings)


def run(args) -> int:
    if is_store_url(args.root):
        return _run_store(args.root, args.json)
    listing = list_checkpoints(args.root)
    tiers = _tier_states(args.durable) if args.durable else None
    for w in listing.warnings:
        print(f"{PROG} ls: warning: {w}", file=sys.stderr)
    local_steps = {e.step for e in listing.checkpoints}
    if args.json:
        fields = ("step", "name", "path", "state", "bytes", "ranks", "keys", "modified", "latest", "error")
        doc = {"root": listing.root, "latest": listing.latest, "checkpoints": [
            {**{k: getattr(e, k) for k in fields}, **({"durable": tiers.get(e.step, "-")} if tiers is not None else {})}
            for e in listing.checkpoints
        ]}
        if tiers is not None:
            doc["durable_only"] = sorted(s for s in tiers if s not in local_steps)
        print_json(doc)
        return 0
    if not listing.checkpoints:
        print(f"no checkpoints under {listing.root}")
        return 0
    rows = [
        ["*" if e.latest else "", "-" if e.step is None else str(e.step), e.name, e.state, human_bytes(e.bytes),
         "-" if e.ranks is None else str(e.ranks), "-" if e.keys is None else str(e.keys),
         (e.modified or "-").replace("T", " ")] + ([tiers.get(e.step, "-")] if tiers is not None else [])
        for e in listing.checkpoints
    ]
    headers = ["", "STEP", "NAME", "STATE", "SIZE", "RANKS", "KEYS", "MODIFIED"] + (["DURABLE"] if tiers is not None else [])
    if tiers is not None:  # steps only the durable tier holds
        rows += [["", str(s), "-", "durable only", "-", "-", "-", "-", st] for s, st in sorted(tiers.items()) if s not in local_steps]
    for line in format_table(headers, rows, {1, 4, 5, 6}):
        print(line)
    for e in listing.checkpoints:
        if e.error:
            print(f"  {e.name}: {e.error}")
    print(_footer(listing))
    return 0


def _tier_states(url: str) -> dict[int, str]:
    """``{step: state on the durable tier at url}`` (committed, draining, incomplete)."""
    from dcp_datastates.storage import open_store

    return {s.step: s.state for s in checkpoints.stored_steps(open_store(url))}


def _run_store(url: str, as_json: bool) -> int:
    """``ls`` of a durable tier: its steps, their state, objects and bytes."""
    from dcp_datastates.storage import open_store

    rows = [(s.step, s.name, s.state, len(s.sizes), sum(s.sizes.values())) for s in checkpoints.stored_steps(open_store(url))]
    if as_json:
        keys = ("step", "name", "state", "objects", "bytes")
        print_json({"root": url, "checkpoints": [dict(zip(keys, r)) for r in rows]})
        return 0
    if not rows:
        print(f"no checkpoints under {url}")
        return 0
    table = [[str(step), name, state, str(n), human_bytes(size)] for step, name, state, n, size in rows]
    for line in format_table(["STEP", "NAME", "STATE", "OBJECTS", "SIZE"], table, {0, 3, 4}):
        print(line)
    committed = sum(r[2] == COMMITTED for r in rows)
    print(f"{len(rows)} step{'s' if len(rows) != 1 else ''} on {url} ({committed} committed), "
          f"{human_bytes(sum(r[4] for r in rows))}")
    return 0


def _footer(listing: Listing) -> str:
    counts: dict[str, int] = {}
    for e in listing.checkpoints:
        counts[e.state] = counts.get(e.state, 0) + 1
    n = len(listing.checkpoints)
    states = ", ".join(f"{c} {s}" for s, c in counts.items())
    text = f"{n} checkpoint{'s' if n != 1 else ''} ({states}), {human_bytes(sum(e.bytes for e in listing.checkpoints))}"
    if listing.latest is not None:
        text += f"; * = latest (step {listing.latest})"
    return text
