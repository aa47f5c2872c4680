"""``dcp-datastates du``: the bytes of checkpoints, and the stray files safe to delete.

One rule for a directory and a durable tier: the files a committed
checkpoint's metadata names are its bytes; what a save left behind that no
checkpoint needs is stray (all of an uncommitted checkpoint); anything else
is other. A directory is scanned (allocated blocks too); a store is listed.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from typing import Callable

from dcp_datastates.format.file_names import is_metadata_temporary, stray_files
from dcp_datastates.storage.url import is_store_url
from dcp_datastates.tools import checkpoints
from dcp_datastates.tools.checkpoints import COMMITTED, CORRUPT, DRAINING, INCOMPLETE
from dcp_datastates.tools.common import PROG, format_table, human_bytes


@dataclasses.dataclass
class Usage:
    """Disk usage of one checkpoint.

    ``checkpoint_bytes`` are in files the checkpoint names; ``stray_bytes``
    in files a save left behind that no checkpoint needs (rank files of an
    interrupted save, ``.metadata`` temporaries, a drain's confirmations; all
    of an uncommitted checkpoint): safe to delete. ``other_bytes``: anything
    else (files that are not a checkpoint's, or those of a corrupt checkpoint,
    whose metadata cannot say which files it needs).
    """

    path: str
    step: int | None
    state: str
    files: int
    apparent_bytes: int
    allocated_bytes: int
    checkpoint_bytes: int
    stray_bytes: int
    other_bytes: int
    stray_files: list[str]


_SUMMED = ("files", "apparent_bytes", "allocated_bytes", "checkpoint_bytes", "stray_bytes", "other_bytes")


def usage(path: str, step: int | None, state: str, files: list[tuple[str, int, int]], view) -> Usage:
    """Usage of one checkpoint from its files ``(name, bytes, allocated bytes)`` and its
    :class:`CheckpointView` (None when it has no readable metadata)."""
    named = set(view.files()) if view is not None else set()
    strays = _strays(state, [name for name, _, _ in files], named)
    used = stray = other = 0
    for name, size, _ in files:
        if name in named:
            used += size
        elif name in strays:
            stray += size
        else:
            other += size
    return Usage(
        path, step, state, len(files), sum(f[1] for f in files), sum(f[2] for f in files),
        used, stray, other, [name for name, _, _ in files if name in strays and name not in named],
    )


def _strays(state: str, names: list[str], named: set[str]) -> set[str]:
    """The files of a checkpoint in ``state`` that no checkpoint needs."""
    from dcp_datastates.tiers.drain import CONFIRM_DIR

    if state in (INCOMPLETE, DRAINING):
        return set(names)  # nothing ever committed them
    if state == CORRUPT:  # its metadata cannot say which rank files it needs: only temporaries are sure
        return {name for name in names if is_metadata_temporary(name)}
    return {*stray_files(names, named, stock_dcp=True), *(n for n in names if n.startswith(CONFIRM_DIR + "/"))}


def checkpoint_usage(path: str, step: int | None = None) -> Usage:
    """Usage of one checkpoint directory (every regular file in it, allocated blocks too)."""
    state, view, _ = checkpoints.open_checkpoint(path)
    files = [(name, st.st_size, st.st_blocks * 512) for name, st in checkpoints.dir_files(path)]
    return usage(path, step, state, files, view)


def disk_usage(paths: list[str], warn: Callable[[str], None] = lambda _msg: None) -> list[Usage]:
    """Usage of every checkpoint that ``paths`` (directories, or a durable tier's URLs) are or
    hold, each counted once."""
    seen, out = set(), []
    for path in paths:
        if is_store_url(path):
            out += _store_usage(path)
            continue
        found = checkpoints.find_checkpoints(path)
        if not found:
            warn(f"no checkpoints under {path}")
        for step, ckpt in found:
            real = os.path.realpath(ckpt)
            if real not in seen:
                seen.add(real)
                out.append(checkpoint_usage(ckpt, step))
    return out


def _store_usage(url: str) -> list[Usage]:
    """Usage of the steps on a durable tier (``s3://bucket/run``), or of one (``.../step_N``)."""
    from dcp_datastates.storage import open_store

    root, only = checkpoints.split_step_url(url)
    store = open_store(root)
    out = []
    for s in checkpoints.stored_steps(store):
        if only is not None and s.name != only:
            continue
        state, view = s.state, None
        if state == COMMITTED:
            state, view, _ = checkpoints.open_checkpoint(f"{root}/{s.name}")
        files = [(name, size, size) for name, size in sorted(s.sizes.items())]
        out.append(usage(store.where(s.name), s.step, state, files, view))
    return out


def run(args) -> int:
    usages = disk_usage(args.paths, warn=lambda m: print(f"{PROG} du: warning: {m}", file=sys.stderr))
    total = {k: sum(getattr(u, k) for u in usages) for k in _SUMMED}
    if args.json:
        print(json.dumps({"checkpoints": [dataclasses.asdict(u) for u in usages], "total": total}, indent=2))
        return 0
    if not usages:
        return 0
    rows = [
        [u.path, u.state, str(u.files)] + [human_bytes(getattr(u, k)) for k in _SUMMED[1:]]
        for u in usages
    ]
    rows.append([f"TOTAL ({len(usages)} checkpoint{'s' if len(usages) != 1 else ''})", "", str(total["files"])]
                + [human_bytes(total[k]) for k in _SUMMED[1:]])
    headers = ["CHECKPOINT", "STATE", "FILES", "APPARENT", "ALLOCATED", "NAMED", "STRAY", "OTHER"]
    for line in format_table(headers, rows, {2, 3, 4, 5, 6, 7}):
        print(line)
    if total["stray_bytes"]:
        print(f"{human_bytes(total['stray_bytes'])} reclaimable: stray files no checkpoint needs "
              "(interrupted saves, leftover temporaries)")
    return 0
