"""``dcp-datastates inspect``: every key of a checkpoint, its dtype, shape, chunks and rank files.

Reads ``.metadata`` and (ours) the rank indexes, never a tensor byte, from a
directory or an ``s3://`` URL alike (:class:`CheckpointView` reads through
the store). :func:`inspect_checkpoint` returns JSON-ready data; :func:`run`
prints it as a table or JSON, for one checkpoint or for each committed step
of a run root (:func:`checkpoints.checkpoints_named`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from dcp_datastates.errors import CheckpointNotFoundError
from dcp_datastates.format.file_names import DATA_FILE_RE
from dcp_datastates.storage.url import is_store_url
from dcp_datastates.tools import checkpoints
from dcp_datastates.tools.checkpoint_view import FORMAT_OURS, CheckpointView
from dcp_datastates.tools.common import dtype_name, format_table, human_bytes, print_json


def inspect_checkpoint(path: str) -> dict[str, Any]:
    """Everything about a committed checkpoint except its data, as JSON-ready values.

    Reads ``.metadata`` and (ours) the rank indexes, for the stored size of
    saved objects; never a tensor byte.
    """
    if not is_store_url(path):
        checkpoints.require_dir(path)
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
        "ranks": checkpoints.rank_count(view),
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


def rank_numbers(files: list[str]) -> str:
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
        where = rank_numbers(k["files"]) if ours else ",".join(k["files"])
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


def run(args) -> int:
    """One checkpoint (a checkpoint, or a run root with ``--latest``): its table or JSON document.
    A run root: each committed step's, in step order (JSON: ``{"root", "checkpoints": [...]}``)."""
    paths = checkpoints.checkpoints_named(args.ckpt, args.latest)
    if not paths:
        raise CheckpointNotFoundError(f"{args.ckpt}: no committed checkpoint there")
    if paths == [args.ckpt] or args.latest:
        info = inspect_checkpoint(paths[0])
        if args.json:
            print_json(info)
        else:
            print("\n".join(_inspect_lines(info, args.chunks)))
        return 0
    if args.json:
        print_json({"root": args.ckpt, "checkpoints": [inspect_checkpoint(p) for p in paths]})
        return 0
    for i, path in enumerate(paths):
        print(("\n" if i else "") + "\n".join(_inspect_lines(inspect_checkpoint(path), args.chunks)), flush=True)
    return 0
