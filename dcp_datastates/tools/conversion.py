"""Converting a checkpoint to torch.save, safetensors, stock DCP, Hugging Face, or ours: the
library under ``dcp-datastates convert`` (:mod:`tools.commands.convert`) and the Hugging Face
API (:mod:`integrations.huggingface`).

Every conversion streams: tensors are read one block (or one tensor) at a
time through :class:`CheckpointView`, from a directory or an ``s3://`` URL,
so memory is bounded by the largest block or tensor, never by the
checkpoint. Each format is one module of :mod:`tools.formats`.

Every output is built under a temporary name beside ``out`` and renamed into
place once complete, so a failed or interrupted conversion leaves no ``out``
and an existing one (replaced only with ``overwrite``) stays intact until then.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Callable

from dcp_datastates.errors import CheckpointExistsError
from dcp_datastates.storage.url import absolute, refuse_url
from dcp_datastates.tools import formats
from dcp_datastates.tools.checkpoint_view import CheckpointView
from dcp_datastates.tools.common import quiet_torch_warnings
from dcp_datastates.tools.formats.safetensors import INDEX as SAFETENSORS_INDEX
from dcp_datastates.tools.formats.safetensors import SINGLE_FILE as SAFETENSORS_SINGLE
from dcp_datastates.tools.safetensors_view import FORMAT_HUGGINGFACE
from dcp_datastates.tools.output import (
    check_output_apart,
    move_into_place,
    naming_output_errors,
    remove_output,
    temporary_path,
)
from dcp_datastates.tools.progress import ByteCounter

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
    prefix: str | None = None,
    config_dir: str | os.PathLike | None = None,
    dtype: str | None = None,
) -> ConvertSummary:
    """Convert the checkpoint ``src`` into ``out`` in format ``to`` (one of :data:`formats.CONVERT`).

    ``src`` is a checkpoint of ours, a stock DCP one, or a Hugging Face
    safetensors directory (its tensors put under ``prefix``, default
    ``model``). ``to="huggingface"`` writes what ``from_pretrained`` loads:
    the tensors under ``prefix`` (default ``model``) with it stripped,
    cast to ``dtype``, with ``config_dir``'s config and tokenizer files
    (see :mod:`tools.formats.huggingface`).
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
    view = open_source(src, allow_pickle=allow_pickle, prefix=prefix)
    if prefix is not None and to != "huggingface" and view.format != FORMAT_HUGGINGFACE:
        raise ValueError("prefix applies to conversions to huggingface or from a Hugging Face directory only")
    if to == "huggingface":
        from dcp_datastates.tools.formats.huggingface import HuggingFaceExport

        export = HuggingFaceExport.plan(view, config_dir=config_dir, prefix=prefix, dtype=dtype)
        return write_output(export.view, out, to, export.write_with(max_shard_bytes), overwrite=overwrite,
                            progress=progress)
    if config_dir is not None or dtype is not None:
        raise ValueError("config_dir and dtype apply to conversions to huggingface only")
    writer = formats.module(formats.CONVERT[to])
    if to == "safetensors":
        writer.check_dtypes(view)

    def write(tmp: str, summary: ConvertSummary, tracker: ByteCounter) -> None:
        writer.write(view, tmp, summary, tracker, max_shard_bytes)

    return write_output(view, out, to, write, overwrite=overwrite, progress=progress)


def open_source(src: str | os.PathLike, *, allow_pickle: bool = False, prefix: str | None = None):
    """The checkpoint ``src`` opened for reading key by key: ours or stock DCP
    (:class:`CheckpointView`), or a Hugging Face safetensors directory
    (:class:`SafetensorsDirView`, its keys put under ``prefix``, default ``model``, and the
    tied weights its ``config.json`` describes added, as the model's ``state_dict()`` holds them)."""
    from dcp_datastates.tools.safetensors_view import SafetensorsDirView, is_safetensors_dir

    if is_safetensors_dir(src):
        from dcp_datastates.format.huggingface_model import tied_aliases
        from dcp_datastates.tools.formats.huggingface import DEFAULT_PREFIX

        prefix = DEFAULT_PREFIX if prefix is None else prefix
        return SafetensorsDirView(src, prefix=prefix, aliases=tied_aliases(src))
    return CheckpointView(src, allow_pickle=allow_pickle)


def write_output(
    view,
    out: str | os.PathLike,
    to: str,
    write: Callable[[str, ConvertSummary, ByteCounter], None],
    *,
    overwrite: bool = False,
    progress: Progress | None = None,
) -> ConvertSummary:
    """Build ``out`` with ``write(tmp, summary, tracker)`` under a temporary name beside it, then
    rename it into place: the one way every conversion's output appears, whole or not at all."""
    refuse_url(out, f"the output of convert --to {to}", "Convert into a local directory and copy that to object "
               "storage, or save there directly with DataStatesWriter('s3://...').")
    out = os.path.abspath(os.fspath(out))
    check_output_apart(out, [view.path])
    _check_replaceable(out, overwrite)
    summary = ConvertSummary(absolute(view.path), view.format, out, to)
    tracker = ByteCounter(sum(view.nbytes(k) for k in view.tensors), progress)
    parent = os.path.dirname(out)
    os.makedirs(parent, exist_ok=True)
    tmp = temporary_path(out, "convert")
    try:
        with quiet_torch_warnings(), naming_output_errors(tmp, out):
            write(tmp, summary, tracker)
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
    return not names or ".metadata" in names or SAFETENSORS_INDEX in names or SAFETENSORS_SINGLE in names


def _check_replaceable(out: str, overwrite: bool) -> None:
    if not os.path.lexists(out):
        return
    if not overwrite:
        raise CheckpointExistsError(f"{out} already exists; pass --overwrite (or overwrite=True) to replace it")
    if os.path.isdir(out) and not os.path.islink(out) and not _looks_replaceable(out):
        raise CheckpointExistsError(
            f"{out} is a directory that holds neither a checkpoint (.metadata) nor a safetensors output "
            f"({SAFETENSORS_INDEX} or {SAFETENSORS_SINGLE}); refusing to replace it even with --overwrite"
        )
