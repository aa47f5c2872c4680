"""``dcp-datastates convert``: a checkpoint to torch.save, safetensors, stock DCP, Hugging Face,
or ours (:mod:`tools.conversion` converts; this prints what it wrote)."""

from __future__ import annotations

import dataclasses
import sys

from dcp_datastates.tools.common import PROG, format_fields, human_bytes, print_json
from dcp_datastates.tools.conversion import convert_checkpoint
from dcp_datastates.tools.output import signals_interrupt
from dcp_datastates.tools.progress import LazyProgress


def run(args) -> int:
    """``dcp-datastates convert``: convert, print a summary table (``--json``: the
    :class:`ConvertSummary` as one document); exit status 0."""
    with LazyProgress(f"convert to {args.to}", quiet=args.quiet) as progress, signals_interrupt():
        summary = convert_checkpoint(
            args.ckpt, args.out, args.to, max_shard_bytes=args.max_shard_size, overwrite=args.overwrite,
            allow_pickle=args.allow_pickle, progress=progress, prefix=args.prefix, config_dir=args.config,
            dtype=args.dtype,
        )
    if summary.to == "huggingface" and "config.json" not in summary.files:
        print(f"{PROG} convert: note: no --config given: weights only, no config.json; tied weights are written "
              "as saved and nothing was checked against a model", file=sys.stderr)
    if summary.skipped:
        shown = ", ".join(summary.skipped[:8]) + (", ..." if len(summary.skipped) > 8 else "")
        print(
            f"{PROG} convert: note: skipped {len(summary.skipped)} non-tensor "
            f"entr{'y' if len(summary.skipped) == 1 else 'ies'} (safetensors holds tensors only): {shown}",
            file=sys.stderr,
        )
    if args.json:
        print_json(dataclasses.asdict(summary))
        return 0
    rows = [
        ("source", f"{summary.source} ({summary.source_format})"),
        ("output", f"{summary.out} ({summary.to})"),
        ("tensors", f"{summary.tensors} ({human_bytes(summary.bytes)})"),
        ("objects", str(summary.objects)),
    ]
    if summary.to in ("safetensors", "huggingface"):
        rows[-1] = ("objects", f"{summary.objects} written, {len(summary.skipped)} skipped (safetensors holds tensors only)")
    files = summary.files
    rows.append(("files", ", ".join(files) if len(files) <= 4 else f"{len(files)}: {files[0]} ... {files[-1]}"))
    print("\n".join(format_fields(rows)))
    return 0
