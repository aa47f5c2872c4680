"""``dcp-datastates convert``: a checkpoint to torch.save, safetensors, stock DCP, or ours.

Every conversion streams: tensors are read one block (or one tensor) at a
time through :class:`CheckpointView`, from a directory or an ``s3://`` URL,
so memory is bounded by the largest block or tensor, never by the
checkpoint. Each format is one module of :mod:`tools.formats`.

Every output is built under a temporary name beside ``out`` and renamed into
place once complete, so a failed or interrupted conversion leaves no ``out``
and an existing one (replaced only with ``overwrite``) stays intact until then.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import sys
import uuid
from typing import Callable

from dcp_datastates.errors import CheckpointExistsError
from dcp_datastates.storage.url import absolute
from dcp_datastates.tools import formats
from dcp_datastates.tools.checkpoint_view import CheckpointView
from dcp_datastates.tools.common import PROG, format_fields, human_bytes, quiet_torch_warnings
from dcp_datastates.tools.formats.safetensors import INDEX as SAFETENSORS_INDEX
from dcp_datastates.tools.output import check_output_apart, move_into_place, naming_output_errors, remove_output
from dcp_datastates.tools.progress import ByteCounter, LazyProgress

DEFAULT_MAX_SHARD_BYTES = 5 * 10**9  # Hugging Face's default shard size ("5GB")

Progress = Callable[[int, int], None]  # (bytes done, bytes in all)


@dataclasses.dataclass
class ConvertSummary:
    """What a conversion wrote."""

    source: str
    source_format: str  # "dcp_datastates" or "dcp"
    out: str
    to: str
    tensors: int = 0  # tensors written
    objects: int = 0  # non-tensor entries written
    bytes: int = 0  # tensor bytes written
    skipped: list[str] = dataclasses.field(default_factory=list)  # keys left out (safetensors: objects)
    files: list[str] = dataclasses.field(default_factory=list)  # relative to out (or out itself, torch)


def convert_checkpoint(
    src: str | os.PathLike,
    out: str | os.PathLike,
    to: str,
    *,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    overwrite: bool = False,
    allow_pickle: bool = False,
    progress: Progress | None = None,
) -> ConvertSummary:
    """Convert the checkpoint ``src`` into ``out`` in format ``to`` (one of :data:`formats.CONVERT`).

    ``out`` is a file for ``torch`` and a directory for the others. An
    existing ``out`` is refused unless ``overwrite``; it is replaced only once
    the new output is complete. Raises (naming the file and key) on an
    unreadable or corrupt source, a dtype the format cannot hold, or an
    existing ``out``; nothing is left behind then.
    """
    if to not in formats.CONVERT:
        raise ValueError(f"unknown output format {to!r}; choose one of {', '.join(formats.CONVERT)}")
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    out = os.path.abspath(os.fspath(out))
    view = CheckpointView(src, allow_pickle=allow_pickle)
    check_output_apart(out, [view.path])
    _check_replaceable(out, overwrite)
    writer = formats.module(formats.CONVERT[to])
    if to == "safetensors":
        writer.check_dtypes(view)
    summary = ConvertSummary(absolute(view.path), view.format, out, to)
    tracker = ByteCounter(sum(view.nbytes(k) for k in view.tensors), progress)
    parent = os.path.dirname(out)
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".{os.path.basename(out)}.convert-{uuid.uuid4().hex[:12]}")
    try:
        with quiet_torch_warnings(), naming_output_errors(tmp, out):
            writer.write(view, tmp, summary, tracker, max_shard_bytes)
        _check_replaceable(out, overwrite)  # again: something may have appeared meanwhile
        move_into_place(tmp, out, overwrite)
    except BaseException:
        remove_output(tmp)
        raise
    return summary


def _looks_replaceable(path: str) -> bool:
    """A directory --overwrite may replace: empty, a checkpoint, or a safetensors output.

    Anything else (a home directory given as OUT by mistake) is never removed.
    """
    try:
        names = os.listdir(path)
    except OSError:
        return False
    return not names or ".metadata" in names or SAFETENSORS_INDEX in names


def _check_replaceable(out: str, overwrite: bool) -> None:
    if not os.path.lexists(out):
        return
    if not overwrite:
        raise CheckpointExistsError(f"{out} already exists; pass --overwrite (or overwrite=True) to replace it")
    if os.path.isdir(out) and not os.path.islink(out) and not _looks_replaceable(out):
        raise CheckpointExistsError(
            f"{out} is a directory that holds neither a checkpoint (.metadata) nor a safetensors output "
            f"({SAFETENSORS_INDEX}); refusing to replace it even with --overwrite"
        )


@contextlib.contextmanager
def _sigterm_as_interrupt():
    """SIGTERM (a scheduler's kill) unwinds like Ctrl-C, so the temporary output is removed."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def run(args) -> int:
    """``dcp-datastates convert``: convert, print a summary table; exit status 0."""
    with LazyProgress(f"convert to {args.to}", quiet=args.quiet) as progress, _sigterm_as_interrupt():
        summary = convert_checkpoint(
            args.ckpt, args.out, args.to, max_shard_bytes=args.max_shard_size, overwrite=args.overwrite,
            allow_pickle=args.allow_pickle, progress=progress,
        )
    if summary.skipped:
        shown = ", ".join(summary.skipped[:8]) + (", ..." if len(summary.skipped) > 8 else "")
        print(
            f"{PROG} convert: note: skipped {len(summary.skipped)} non-tensor "
            f"entr{'y' if len(summary.skipped) == 1 else 'ies'} (safetensors holds tensors only): {shown}",
            file=sys.stderr,
        )
    rows = [
        ("source", f"{summary.source} ({summary.source_format})"),
        ("output", f"{summary.out} ({summary.to})"),
        ("tensors", f"{summary.tensors} ({human_bytes(summary.bytes)})"),
        ("objects", str(summary.objects)),
    ]
    if summary.to == "safetensors":
        rows[-1] = ("objects", f"{summary.objects} written, {len(summary.skipped)} skipped (safetensors holds tensors only)")
    files = summary.files
    rows.append(("files", ", ".join(files) if len(files) <= 4 else f"{len(files)}: {files[0]} ... {files[-1]}"))
    print("\n".join(format_fields(rows)))
    return 0
