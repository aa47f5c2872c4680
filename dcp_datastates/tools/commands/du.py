"""``dcp-datastates du``: the bytes of checkpoints, and the stray files safe to delete.

One rule for a directory and a durable tier: the files a committed
checkpoint's metadata names are its bytes; what a save left behind that no
checkpoint needs is stray (all of an uncommitted checkpoint); anything else
is other. A directory is scanned (allocated blocks too); a store is listed.
A directory of checkpoints may also hold the hidden partial outputs of
``convert`` and ``export`` (being written, or left by a killed tool): each is
a row of its own, state ``partial``, its bytes other (in use while a tool
still writes it; delete it once none does).
"""

from __future__ import annotations

import dataclasses
import os
import sys
from typing import Callable

from dcp_datastates.format.file_names import is_metadata_temporary, stray_files
from dcp_datastates.storage.url import is_store_url
from dcp_datastates.tools import checkpoints
from dcp_datastates.tools.checkpoints import COMMITTED, CORRUPT, DRAINING, INCOMPLETE
from dcp_datastates.tools.common import PROG, format_table, human_bytes, print_json


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


PARTIAL = "partial"  # the state of a tool's partial output (not a checkpoint)
_SUMMED = ("files", "apparent_bytes", "allocated_bytes", "checkpoint_bytes", "stray_bytes", "other_bytes")


def usage(path: str, step: int | None, state: str, files: list[tuple[str, int, int]], named_files) -> Usage:
    """Usage of one checkpoint from its files ``(name, bytes, allocated bytes)`` and the files its
    metadata names (None when it has no readable metadata)."""
    named = set(named_files or ())
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
    if state == PARTIAL:  # a tool may still be writing it: nothing is sure
        return set()
    if state == CORRUPT:  # its metadata cannot say which rank files it needs: only temporaries are sure
        return {name for name in names if is_metadata_temporary(name)}
    return {*stray_files(names, named, stock_dcp=True), *(n for n in names if n.startswith(CONFIRM_DIR + "/"))}


def checkpoint_usage(path: str, step: int | None = None) -> Usage:
    """Usage of one checkpoint directory (every regular file in it, allocated blocks too)."""
    state, summary, _ = checkpoints.summarize_checkpoint(path)
    files = [(name, st.st_size, st.st_blocks * 512) for name, st in checkpoints.dir_files(path)]
    return usage(path, step, state, files, summary.files if summary is not None else None)


def partial_usage(path: str) -> Usage:
    """Usage of a tool's partial output (a file or a directory tree; state ``partial``)."""
    if os.path.isdir(path) and not os.path.islink(path):
        files = [(name, st.st_size, st.st_blocks * 512) for name, st in checkpoints.dir_files(path)]
    else:
        st = os.lstat(path)
        files = [(os.path.basename(path), st.st_size, st.st_blocks * 512)]
    return usage(path, None, PARTIAL, files, None)


def disk_usage(paths: list[str], warn: Callable[[str], None] = lambda _msg: None) -> list[Usage]:
    """Usage of every checkpoint that ``paths`` (directories, or a durable tier's URLs) are or
    hold, each counted once, and of the partial outputs of the tools in those directories."""
    seen, out = set(), []
    for path in paths:
        if is_store_url(path):
            out += _store_usage(path)
            continue
        found = checkpoints.find_checkpoints(path)
        partial = checkpoints.partial_outputs(path)
        if not found and not partial:
            warn(f"no checkpoints under {path}")
        for step, ckpt in found:
            if _first_time(seen, ckpt):
                out.append(checkpoint_usage(ckpt, step))
        out += [partial_usage(p) for p in partial if _first_time(seen, p)]
    return out


def _first_time(seen: set[str], path: str) -> bool:
    """Whether ``path`` (resolved: a linked checkpoint counts once) is new to ``seen``; adds it."""
    real = os.path.realpath(path)
    if real in seen:
        return False
    seen.add(real)
    return True


def _store_usage(url: str) -> list[Usage]:
    """Usage of the steps on a durable tier (``s3://bucket/run``), or of one (``.../step_N``)."""
    from dcp_datastates.storage import open_store

    root, only = checkpoints.split_step_url(url)
    store = open_store(root)
    out = []
    for s in checkpoints.stored_steps(store):
        if only is not None and s.name != only:
            continue
        state, summary = s.state, None
        if state == COMMITTED:
            state, summary, _ = checkpoints.summarize_checkpoint(f"{root}/{s.name}")
        files = [(name, size, size) for name, size in sorted(s.sizes.items())]
        out.append(usage(store.where(s.name), s.step, state, files, summary.files if summary is not None else None))
    return out


def run(args) -> int:
    usages = disk_usage(args.paths, warn=lambda m: print(f"{PROG} du: warning: {m}", file=sys.stderr))
    total = {k: sum(getattr(u, k) for u in usages) for k in _SUMMED}
    partial = [u for u in usages if u.state == PARTIAL]
    if args.json:
        print_json({"checkpoints": [dataclasses.asdict(u) for u in usages if u.state != PARTIAL],
                    "partial_outputs": [dataclasses.asdict(u) for u in partial], "total": total})
        return 0
    if not usages:
        return 0
    rows = [
        [u.path, u.state, str(u.files)] + [human_bytes(getattr(u, k)) for k in _SUMMED[1:]]
        for u in usages
    ]
    n = len(usages) - len(partial)
    label = f"{n} checkpoint{'s' if n != 1 else ''}" + (f", {len(partial)} partial" if partial else "")
    rows.append([f"TOTAL ({label})", "", str(total["files"])] + [human_bytes(total[k]) for k in _SUMMED[1:]])
    headers = ["CHECKPOINT", "STATE", "FILES", "APPARENT", "ALLOCATED", "NAMED", "STRAY", "OTHER"]
    for line in format_table(headers, rows, {2, 3, 4, 5, 6, 7}):
        print(line)
    if total["stray_bytes"]:
        print(f"{human_bytes(total['stray_bytes'])} reclaimable: stray files no checkpoint needs "
              "(interrupted saves, leftover temporaries)")
    if partial:
        print(f"{human_bytes(sum(u.apparent_bytes for u in partial))} in {len(partial)} partial output"
              f"{'s' if len(partial) != 1 else ''} of convert or export: being written now, or left by a tool "
              "that was killed; delete once no conversion runs")
    return 0
