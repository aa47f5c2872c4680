"""``ls``, ``inspect``, ``verify`` and ``du``: looking at checkpoints without loading them.

Everything here reads metadata, rank indexes and directory entries only
(``verify`` alone reads data, through :func:`dcp_datastates.verify`), so it
is instant on a checkpoint of any size. Each command is a library function
returning plain data (:func:`list_checkpoints`, :func:`inspect_checkpoint`,
:func:`disk_usage`) plus a ``run_<cmd>(args) -> exit status`` that renders
it as an aligned table or as one JSON document.

States of a checkpoint directory, as ``ls`` and ``du`` report them:

* ``committed``  -- ours, ``.metadata`` present and readable;
* ``dcp``        -- a committed stock DCP (``FileSystemWriter``) checkpoint;
* ``incomplete`` -- no ``.metadata``: a save that never committed;
* ``corrupt``    -- ``.metadata`` present but unreadable (damaged, unsafe,
  or from a newer format): run ``verify`` to see why.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import stat
import sys
from typing import Any, Callable

from dcp_datastates.errors import CheckpointError, CheckpointNotFoundError
from dcp_datastates.format.file_names import is_metadata_temporary, is_save_file, layout_files, stray_files
from dcp_datastates.format.file_names import DATA_FILE_RE, METADATA_FILE
from dcp_datastates.manager.checkpoint_root import read_latest, step_of
from dcp_datastates.storage.url import is_store_url
from dcp_datastates.tools.common import PROG, dtype_name, format_table, human_bytes, one_line
from dcp_datastates.tools.progress import LazyProgress

COMMITTED, STOCK_DCP, INCOMPLETE, CORRUPT = "committed", "dcp", "incomplete", "corrupt"


# ---------------------------------------------------------------------------
# shared helpers
# ---------------------------------------------------------------------------


def _iso(mtime: float | None, sep: str = "T") -> str | None:
    if mtime is None:
        return None
    return datetime.datetime.fromtimestamp(mtime).isoformat(sep=sep, timespec="seconds")


def _dir_files(path: str) -> list[tuple[str, os.stat_result]]:
    """Every regular file under ``path`` (relative name, lstat), not following symbolic links.

    Checkpoints are flat directories, but anything a user dropped in a
    subdirectory still occupies the disk, so it is counted too.
    """
    out = []
    stack = [""]
    while stack:
        rel = stack.pop()
        with os.scandir(os.path.join(path, rel)) as it:
            for entry in it:
                name = os.path.join(rel, entry.name)
                st = entry.stat(follow_symlinks=False)
                if stat.S_ISDIR(st.st_mode):
                    stack.append(name)
                elif stat.S_ISREG(st.st_mode):
                    out.append((name, st))
    return sorted(out)


def looks_like_checkpoint(path: str) -> bool:
    """Whether directory ``path`` holds a checkpoint, ours or stock DCP, committed or not
    (by its file names only: ``format/file_names.py``)."""
    try:
        return any(is_save_file(n, stock_dcp=True) for n in os.listdir(path))
    except (NotADirectoryError, FileNotFoundError):
        return False


def _require_dir(path: str) -> None:
    if not os.path.exists(path):
        raise CheckpointNotFoundError(f"{path}: no such file or directory")
    if not os.path.isdir(path):
        raise CheckpointNotFoundError(f"{path}: not a directory")


def find_checkpoints(path: str) -> list[tuple[int | None, str]]:
    """``(step or None, directory)`` of the checkpoint ``path`` is, or of those directly under it.

    Under a run root that is every ``step_<N>`` directory (committed or not,
    even empty: a step directory is a checkpoint in the making) and every
    other subdirectory holding checkpoint files. Sorted by step, then name.
    """
    _require_dir(path)
    if looks_like_checkpoint(path):
        return [(step_of(os.path.basename(os.path.normpath(path))), path)]
    found = []
    for name in os.listdir(path):
        sub = os.path.join(path, name)
        if not os.path.isdir(sub):  # a symlinked checkpoint is listed too (du counts it once)
            continue
        step = step_of(name)
        if step is not None or looks_like_checkpoint(sub):
            found.append((step, sub))
    found.sort(key=lambda sp: (sp[0] is None, sp[0] or 0, os.path.basename(sp[1])))
    return found


def open_checkpoint(path: str, allow_pickle: bool = False):
    """``(state, CheckpointView or None, error message or None)`` of a checkpoint directory.

    Reads ``.metadata`` only (CheckpointView parses it and validates our
    layout); any failure to read it makes the state ``corrupt``, with why.
    """
    from dcp_datastates.tools.checkpoint_view import FORMAT_OURS, CheckpointView

    if not os.path.lexists(os.path.join(path, METADATA_FILE)):
        return INCOMPLETE, None, f"{path} has no {METADATA_FILE}: the save never committed"
    try:
        view = CheckpointView(path, allow_pickle=allow_pickle)
    except Exception as exc:  # noqa: BLE001 - whatever makes it unreadable is reported, not raised
        return CORRUPT, None, one_line(exc)
    return (COMMITTED if view.format == FORMAT_OURS else STOCK_DCP), view, None


def _rank_count(view) -> int:
    """Rank files the metadata names (ours: one data file per rank; stock DCP: its ``.distcp`` files)."""
    return len(view.files()) - 1 if view.format == "dcp" else len(view.reader.layout.own_ranks)


# ---------------------------------------------------------------------------
# ls
# ---------------------------------------------------------------------------


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
    files = _dir_files(path)
    size = sum(st.st_size for _, st in files)
    state, view, error = open_checkpoint(path)
    ranks = keys = None
    if view is not None:
        ranks, keys = _rank_count(view), len(view.metadata.state_dict_metadata)
    md = next((st for name, st in files if name == METADATA_FILE), None)
    if md is not None:
        mtime = md.st_mtime
    elif files:
        mtime = max(st.st_mtime for _, st in files)
    else:
        mtime = os.lstat(path).st_mtime
    return CheckpointEntry(
        step, os.path.basename(os.path.normpath(path)), path, state, size, ranks, keys,
        _iso(mtime), None if state == INCOMPLETE else error,
    )


def list_checkpoints(root: str) -> Listing:
    """Every checkpoint directory under ``root`` (or ``root`` itself), and the ``latest`` pointer.

    A malformed pointer, or one naming a step that is missing or not
    committed, is a warning: the listing is still what the user needs.
    """
    entries = [describe_checkpoint(p, step) for step, p in find_checkpoints(root)]
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


def run_ls(args) -> int:
    if is_store_url(args.root):
        return _ls_durable(args.root, args.json)
    listing = list_checkpoints(args.root)
    tiers = _tier_states(args.durable) if getattr(args, "durable", None) else None
    for w in listing.warnings:
        print(f"{PROG} ls: warning: {w}", file=sys.stderr)
    if args.json:
        doc = {
            "root": listing.root,
            "latest": listing.latest,
            "checkpoints": [
                {**{k: getattr(e, k) for k in ("step", "name", "path", "state", "bytes", "ranks", "keys",
                                               "modified", "latest", "error")},
                 **({"durable": tiers.get(e.step, "-")} if tiers is not None else {})}
                for e in listing.checkpoints
            ],
        }
        if tiers is not None:
            doc["durable_only"] = sorted(s for s in tiers if s not in {e.step for e in listing.checkpoints})
        print(json.dumps(doc, indent=2))
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
        local_steps = {e.step for e in listing.checkpoints}
        rows += [["", str(s), "-", "durable only", "-", "-", "-", "-", st] for s, st in sorted(tiers.items()) if s not in local_steps]
    for line in format_table(headers, rows, {1, 4, 5, 6}):
        print(line)
    for e in listing.checkpoints:
        if e.error:
            print(f"  {e.name}: {e.error}")
    print(_ls_footer(listing))
    return 0


def _tier_states(url: str) -> dict[int, str]:
    """``{step: state on the durable tier at url}`` (committed, draining, incomplete)."""
    from dcp_datastates.storage import open_store
    from dcp_datastates.tools import durable_view

    return {s.step: s.state for s in durable_view.list_durable(open_store(url))}


def _ls_durable(url: str, as_json: bool) -> int:
    from dcp_datastates.storage import open_store
    from dcp_datastates.tools import durable_view

    steps = durable_view.list_durable(open_store(url))
    if as_json:
        print(json.dumps({"root": url, "checkpoints": [dataclasses.asdict(s) for s in steps]}, indent=2))
        return 0
    if not steps:
        print(f"no checkpoints under {url}")
        return 0
    rows = [[str(s.step), s.name, s.state, str(s.objects), human_bytes(s.bytes)] for s in steps]
    for line in format_table(["STEP", "NAME", "STATE", "OBJECTS", "SIZE"], rows, {0, 3, 4}):
        print(line)
    committed = sum(s.state == durable_view.COMMITTED for s in steps)
    print(f"{len(steps)} step{'s' if len(steps) != 1 else ''} on {url} ({committed} committed), "
          f"{human_bytes(sum(s.bytes for s in steps))}")
    return 0


def _ls_footer(listing: Listing) -> str:
    counts: dict[str, int] = {}
    for e in listing.checkpoints:
        counts[e.state] = counts.get(e.state, 0) + 1
    n = len(listing.checkpoints)
    states = ", ".join(f"{c} {s}" for s, c in counts.items())
    text = f"{n} checkpoint{'s' if n != 1 else ''} ({states}), {human_bytes(sum(e.bytes for e in listing.checkpoints))}"
    if listing.latest is not None:
        text += f"; * = latest (step {listing.latest})"
    return text


# ---------------------------------------------------------------------------
# inspect
# ---------------------------------------------------------------------------


def inspect_checkpoint(path: str) -> dict[str, Any]:
    """Everything about a committed checkpoint except its data, as JSON-ready values.

    Reads ``.metadata`` and (ours) the rank indexes, for the stored size of
    saved objects; never a tensor byte.
    """
    from dcp_datastates.tools.checkpoint_view import FORMAT_OURS, CheckpointView

    if not is_store_url(path):
        _require_dir(path)
    view = CheckpointView(path)
    md = view.metadata
    ours = view.format == FORMAT_OURS
    files = [{"name": name, "bytes": view.file_size(name)} for name in view.files()]
    keys = []
    for fqn, item in md.state_dict_metadata.items():
        nested = (md.planner_data or {}).get(fqn)
        entry: dict[str, Any] = {"key": fqn}
        if fqn in view.tensors:
            chunks = view.stored_chunks(fqn)
            entry.update(
                kind="tensor", dtype=dtype_name(item.properties.dtype), shape=list(item.size),
                bytes=view.nbytes(fqn),
                chunks=[dataclasses.asdict(c) | {"offsets": list(c.offsets), "sizes": list(c.sizes)} for c in chunks],
                files=sorted({c.file for c in chunks}),
            )
        else:
            file, length = view.object_location(fqn)
            entry.update(kind="object", bytes=length, files=[file])
        if nested is not None:
            entry["nested"] = list(nested)
        keys.append(entry)
    if ours:
        layout = view.reader.layout
        fmt, version, save_id = layout.format, layout.version, layout.save_id
    else:
        fmt, version = "dcp", getattr(md, "version", None)
        save_id = getattr(md.storage_meta, "save_id", None) if md.storage_meta is not None else None
    referred: dict[str, int] = {}  # base checkpoint -> bytes of its chunks this one refers to
    for k in keys:
        for c in (k.get("chunks") or []):
            base = _base_of(c["file"])
            if base is not None:
                referred[base] = referred.get(base, 0) + c["length"]
    return {
        "path": path,
        "format": fmt,
        "version": version,
        "save_id": save_id,
        "ranks": _rank_count(view),
        "bases": [{"base": b, "bytes": n} for b, n in sorted(referred.items())],
        "files": files,
        "tensors": len(view.tensors),
        "objects": len(view.objects),
        "tensor_bytes": sum(view.nbytes(k) for k in view.tensors),
        "keys": keys,
    }


def _base_of(name: str) -> str | None:
    """The base checkpoint a data file of an incremental checkpoint belongs to (``../<base>/...``)."""
    parts = name.split("/")
    return parts[1] if len(parts) == 3 and parts[0] == ".." else None


def _rank_numbers(files: list[str]) -> str:
    """``rank00000-...data, rank00001-...data, rank00003-...data`` -> ``0-1,3`` (other names as they are);
    a base checkpoint's file (``../step_10/rank00000-...data``) -> ``step_10:0``."""
    found, others = set(), []
    for name in files:
        base = _base_of(name)
        m = DATA_FILE_RE.match(name.rsplit("/", 1)[-1] if base is not None else name)
        if m and base is not None:
            others.append(f"{base}:{int(m.group(1))}")
            continue
        (found.add(int(m.group(1))) if m else others.append(name))
    ranks = sorted(found)  # a rank striped over several data files is one rank
    runs: list[str] = []
    i = 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        runs.append(str(ranks[i]) if i == j else f"{ranks[i]}-{ranks[j]}")
        i = j + 1
    return ",".join(runs + others)


_HEADER_FILES = 8  # files listed one per line in the header; more are summarized


def _inspect_lines(info: dict[str, Any], chunks: bool) -> list[str]:
    ours = info["format"] != "dcp"
    fmt = f"dcp_datastates version {info['version']}" if ours else "stock DCP (FileSystemWriter)"
    sizes = [f["bytes"] for f in info["files"] if f["bytes"] is not None]
    missing = [f["name"] for f in info["files"] if f["bytes"] is None]
    lines = [
        f"checkpoint    {info['path']}",
        f"format        {fmt}",
        f"save id       {info['save_id'] or '-'}",
        f"ranks         {info['ranks']}",
        *[f"refers to     {b['base']}: {human_bytes(b['bytes'])} of its chunks (incremental)" for b in info.get("bases", [])],
        f"files         {len(info['files'])}, {human_bytes(sum(sizes))}"
        + (f" ({len(missing)} MISSING: {', '.join(missing)})" if missing else ""),
    ]
    for f in info["files"][:_HEADER_FILES]:
        lines.append(f"  {f['name']:<32} {'MISSING' if f['bytes'] is None else human_bytes(f['bytes'])}")
    if len(info["files"]) > _HEADER_FILES:
        lines.append(f"  ... and {len(info['files']) - _HEADER_FILES} more (--json lists them all)")
    lines += [
        f"tensors       {info['tensors']}, {human_bytes(info['tensor_bytes'])}",
        f"objects       {info['objects']}",
        "",
    ]
    rows, extra = [], []
    for k in info["keys"]:
        where = _rank_numbers(k["files"]) if ours else ",".join(k["files"])
        if k["kind"] == "tensor":
            rows.append([k["key"], "tensor", k["dtype"], str(k["shape"]), str(len(k["chunks"])),
                         human_bytes(k["bytes"]), where])
            extra.append([
                f"    offsets {c['offsets']} sizes {c['sizes']}  {c['file']}  offset {c['offset']}  length {c['length']}"
                for c in k["chunks"]
            ])
        else:
            rows.append([k["key"], "object", "-", "-", "-", human_bytes(k["bytes"]), where])
            extra.append([])
    table = format_table(["KEY", "KIND", "DTYPE", "SHAPE", "CHUNKS", "BYTES", "RANKS" if ours else "FILES"],
                         rows, {4, 5})
    lines.append(table[0])
    for row_line, chunk_lines in zip(table[1:], extra):
        lines.append(row_line)
        if chunks:
            lines.extend(chunk_lines)
    return lines


def run_inspect(args) -> int:
    info = inspect_checkpoint(args.ckpt)
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        print("\n".join(_inspect_lines(info, args.chunks)))
    return 0


# ---------------------------------------------------------------------------
# verify
# ---------------------------------------------------------------------------


def verify_one(path: str, *, allow_pickle: bool = False, quiet: bool = True, digests: bool = False) -> tuple[bool, str]:
    """``(ok, report text)`` for one path: never raises, so one bad path does not stop the others."""
    from dcp_datastates.core.verify import verify as verify_checkpoint

    if not os.path.exists(path):
        return False, f"NOT FOUND: {path}: no such file or directory"
    if not os.path.isdir(path):
        return False, f"NOT FOUND: {path}: not a directory"
    bar = LazyProgress(os.path.basename(os.path.normpath(path)) or path, quiet)
    try:
        report = verify_checkpoint(path, allow_pickle=allow_pickle, progress=bar, digests=digests)
    except Exception as exc:  # noqa: BLE001 - e.g. a permission error listing the directory
        return False, f"FAILED: {path}: {one_line(exc)}"
    finally:
        bar.close()
    if not report.ok and report.committed and open_checkpoint(path, allow_pickle)[0] == STOCK_DCP:
        return False, (
            f"NOT VERIFIED: {path}: not a dcp_datastates checkpoint "
            "(stock DCP has no checksums to verify)"
        )
    return report.ok, report.summary()


def run_verify(args) -> int:
    from dcp_datastates.tools import durable_view

    failed = n = 0
    for path in args.ckpts:
        if is_store_url(path):
            try:
                results = durable_view.verify_url(path, allow_pickle=args.allow_pickle, digests=args.digests)
            except Exception as exc:  # noqa: BLE001 - the store could not be reached: this path fails
                results = [(False, f"FAILED: {path}: {one_line(exc)}")]
        else:
            results = [verify_one(path, allow_pickle=args.allow_pickle, quiet=args.quiet, digests=args.digests)]
        for ok, text in results:
            print(text, flush=True)
            failed += not ok
            n += 1
    if n > 1:
        print(f"{n} checkpoints: {n - failed} OK, {failed} failed")
    return 1 if failed else 0


# ---------------------------------------------------------------------------
# du
# ---------------------------------------------------------------------------


@dataclasses.dataclass
class Usage:
    """Disk usage of one checkpoint directory.

    ``checkpoint_bytes`` are in files the checkpoint names; ``stray_bytes``
    in files a save left behind that no checkpoint needs (rank files of an
    interrupted save, ``.metadata`` temporaries; all of an uncommitted
    directory): safe to delete. ``other_bytes``: anything else (files that
    are not a checkpoint's, or those of a corrupt checkpoint, whose metadata
    cannot say which files it needs).
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


def checkpoint_usage(path: str, step: int | None = None) -> Usage:
    files = _dir_files(path)
    state, view, _ = open_checkpoint(path)
    named = set(view.files()) if view is not None else set()
    strays = _strays(state, [name for name, _ in files], named)
    used = stray = other = 0
    stray_names = []
    for name, st in files:
        if name in named:
            used += st.st_size
        elif name in strays:
            stray += st.st_size
            stray_names.append(name)
        else:
            other += st.st_size
    return Usage(
        path, step, state, len(files),
        sum(st.st_size for _, st in files), sum(st.st_blocks * 512 for _, st in files),
        used, stray, other, stray_names,
    )


def _strays(state: str, names: list[str], named: set[str]) -> set[str]:
    """The files of a checkpoint directory in ``state`` that no checkpoint needs."""
    if state == INCOMPLETE:
        return set(names)  # nothing ever committed them
    if state == CORRUPT:  # its metadata cannot say which rank files it needs: only temporaries are sure
        return {name for name in names if is_metadata_temporary(name)}
    return set(stray_files(names, named, stock_dcp=True))


def disk_usage(paths: list[str], warn: Callable[[str], None] = lambda _msg: None) -> list[Usage]:
    """Usage of every checkpoint that ``paths`` are or hold, each counted once."""
    seen, out = set(), []
    for path in paths:
        found = find_checkpoints(path)
        if not found:
            warn(f"no checkpoints under {path}")
        for step, ckpt in found:
            real = os.path.realpath(ckpt)
            if real not in seen:
                seen.add(real)
                out.append(checkpoint_usage(ckpt, step))
    return out


_SUMMED = ("files", "apparent_bytes", "allocated_bytes", "checkpoint_bytes", "stray_bytes", "other_bytes")


def durable_usage(url: str) -> list[Usage]:
    """``du`` of the steps on a durable tier: objects a committed step's layout names, and the
    rest (incomplete and draining copies, leftovers: safe to delete)."""
    from dcp_datastates.format.metadata_file import read_metadata_file
    from dcp_datastates.storage import open_store
    from dcp_datastates.tiers.drain import step_prefix
    from dcp_datastates.tools import durable_view

    root, only = durable_view.split_step_url(url)
    store = open_store(root)
    out = []
    for s in durable_view.list_durable(store):
        if only is not None and s.name != only:
            continue
        keys = store.list(step_prefix(s.name))
        sizes = {k[len(step_prefix(s.name)):]: store.size(k) or 0 for k in keys}
        named: set[str] = set()
        state = s.state
        if s.state == durable_view.COMMITTED:
            try:
                with store.open_file(f"{s.name}/{METADATA_FILE}") as f:  # bounded by its structure, not its size
                    md, _ = read_metadata_file(f)
                named = {METADATA_FILE, *layout_files(md.storage_data)} if hasattr(md.storage_data, "ranks") else set(sizes)
            except (CheckpointError, FileNotFoundError):  # it cannot say which objects it needs: none counted as stray
                state, named = CORRUPT, set(sizes)
        strays = sorted(n for n in sizes if n not in named)
        total = sum(sizes.values())
        stray = sum(sizes[n] for n in strays)
        out.append(Usage(store.where(s.name), s.step, state, len(sizes), total, total, total - stray, stray, 0, strays))
    return out


def run_du(args) -> int:
    local = [p for p in args.paths if not is_store_url(p)]
    usages = disk_usage(local, warn=lambda m: print(f"{PROG} du: warning: {m}", file=sys.stderr)) if local else []
    for url in (p for p in args.paths if is_store_url(p)):
        usages += durable_usage(url)
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
