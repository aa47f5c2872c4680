"""``dcp-datastates export``: checkpoints of a run into one HDF5 file or zarr store.

Analysis tools (numpy, xarray, dask, plain h5py) want one array per tensor
with its full shape, not DCP's shards spread over rank files. Each tensor
key becomes one dataset of shape ``(S, *global_shape)``, where ``S`` is the
number of checkpoints exported, so the evolution of a weight over training
is a slice along the leading step axis. Datasets are filled block by block
from the saved shards (:meth:`CheckpointView.blocks`), so memory is bounded
by ``block_bytes`` and the output's chunk cache, never by a tensor or the
checkpoint.

Conventions (the same for HDF5 and zarr, documented in docs/cli.md):

* dtypes numpy has are stored as themselves; the others (bfloat16, the
  float8 and float4 variants, complex32) are stored as their raw bits in the
  unsigned integer of the same width (uint16, uint8, uint32). The ``dtype``
  attribute keeps torch's name, ``stored_as`` the numpy dtype written, so
  ``torch.from_numpy(a).view(torch.bfloat16)`` restores the values bit-exactly.
* dataset names are the keys, with ``%`` -> ``%25``, ``/`` -> ``%2F`` and a
  leading ``.`` -> ``%2E``; the attribute ``key`` holds the key unchanged.
* the output is written under a hidden temporary name beside ``OUT``
  (``.OUT.export-<id>``, :func:`output.temporary_path`) and renamed to ``OUT``
  only once complete, so an interrupted export never leaves an ``OUT`` that
  looks finished.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import os
import sys
from typing import Callable, Iterable, Sequence

import torch

from dcp_datastates.storage.fsync_files import fsync_dir
from dcp_datastates.errors import UnsafeCheckpointError
from dcp_datastates.manager.checkpoint_root import is_committed, step_dirs
from dcp_datastates.native.memory import release_freed_memory
from dcp_datastates.storage.url import absolute
from dcp_datastates.tools import formats
from dcp_datastates.tools.checkpoint_view import DEFAULT_BLOCK_BYTES, CheckpointView, read_ahead
from dcp_datastates.tools.common import dtype_name, format_fields, human_bytes, key_selected, quiet_torch_warnings
from dcp_datastates.tools.output import (
    check_output_apart,
    move_into_place,
    naming_output_errors,
    remove_output,
    signals_interrupt,
    temporary_path,
)
from dcp_datastates.tools.progress import ByteCounter, LazyProgress

FORMAT_NAME = "dcp_datastates export"
FORMAT_VERSION = 1
CHUNK_TARGET_BYTES = 4 << 20  # chunks of at most 4 MiB (1-4 MiB for tensors that large)


# torch dtypes numpy stores natively; every other dtype is stored as raw bits.
_NATIVE = {
    torch.float16: "float16", torch.float32: "float32", torch.float64: "float64",
    torch.int8: "int8", torch.int16: "int16", torch.int32: "int32", torch.int64: "int64",
    torch.uint8: "uint8", torch.uint16: "uint16", torch.uint32: "uint32", torch.uint64: "uint64",
    torch.bool: "bool", torch.complex64: "complex64", torch.complex128: "complex128",
}
_RAW_BITS = {1: torch.uint8, 2: torch.uint16, 4: torch.uint32, 8: torch.uint64}


@dataclasses.dataclass
class ExportSummary:
    """What :func:`export_checkpoints` wrote."""

    out: str
    format: str
    checkpoints: list[str]
    steps: list[int]
    keys: list[str]  # tensor keys exported, one dataset each
    objects: int  # plain objects recorded in the ``objects`` attribute (all checkpoints)
    objects_omitted: list[str]  # object keys not JSON plain data (or unsafe to unpickle)
    bytes: int  # tensor bytes written (all steps)
    skipped: list[str] = dataclasses.field(default_factory=list)  # uncommitted step dirs of a run root


@dataclasses.dataclass(frozen=True)
class _Dataset:
    """One output dataset: a tensor key, its shape and how its dtype is stored."""

    key: str
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    stored_as: str  # numpy dtype name
    chunks: tuple[int, ...]  # chunk shape including the step axis


def export_checkpoints(
    paths: Sequence[str | os.PathLike],
    out: str | os.PathLike,
    fmt: str,
    keys: Iterable[str] | None = None,
    block_bytes: int = DEFAULT_BLOCK_BYTES,
    overwrite: bool = False,
    progress: Callable[[int, int], None] | None = None,
    allow_pickle: bool = False,
) -> ExportSummary:
    """Export checkpoints (in step order) into one HDF5 file or zarr v2 store at ``out``.

    Args:
        paths: checkpoint directories (ours or stock DCP), or a run root whose
            committed ``step_<N>`` directories are taken in step order.
        out: the ``.h5`` file or zarr directory to create.
        fmt: ``"hdf5"`` or ``"zarr"``.
        keys: globs (``fnmatch``) selecting the keys to export; all when None.
        block_bytes: the largest block of a tensor read at once.
        overwrite: replace an existing ``out`` (only once the new one is complete).
        progress: called as ``progress(bytes_done, bytes_total)`` after each block.
        allow_pickle: unpickle saved objects without restriction (trusted checkpoints only).

    Raises ValueError naming the key and both checkpoints when a key is missing
    from a checkpoint or its shape or dtype differs between checkpoints.
    """
    if fmt not in formats.EXPORT:
        raise ValueError(f"unknown export format {fmt!r}; choose one of {', '.join(formats.EXPORT)}")
    backend = _load_backend(fmt)
    out = os.path.abspath(os.fspath(out))
    paths, skipped = _expand_run_roots([os.fspath(p) for p in paths])
    if not paths:
        raise ValueError("no checkpoints to export")
    _check_out(out, paths, overwrite)
    views = [CheckpointView(p, allow_pickle=allow_pickle) for p in paths]
    globs = list(keys) if keys else None
    datasets = _plan_datasets(views, globs)
    steps = [i if (step := v.training_step()) is None else step for i, v in enumerate(views)]
    objects, omitted = _collect_objects(views, globs)
    root_attrs = {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "steps": steps,
        "checkpoints": [absolute(p) for p in paths],
        "objects": objects,
    }
    total = len(views) * sum(views[0].nbytes(d.key) for d in datasets)
    tmp = temporary_path(out, "export")
    try:
        with quiet_torch_warnings(), naming_output_errors(tmp, out):
            backend.write(tmp, datasets, len(views), root_attrs, {d.name: _dataset_attrs(d, steps) for d in datasets},
                          _blocks(views, datasets, block_bytes, ByteCounter(total, progress)))
            _fsync_tree(tmp)
        move_into_place(tmp, out, overwrite)
    except BaseException:
        remove_output(tmp)
        raise
    return ExportSummary(
        out=out, format=fmt, checkpoints=[absolute(p) for p in paths], steps=steps,
        keys=[d.key for d in datasets], objects=sum(len(o) for o in objects),
        objects_omitted=omitted, bytes=total, skipped=skipped,
    )


def _expand_run_roots(paths: list[str]) -> tuple[list[str], list[str]]:
    """A run root (no ``.metadata``, but ``step_<N>`` dirs) stands for its committed checkpoints.

    Uncommitted step directories (a save in progress or one that crashed)
    are left out and returned separately so the caller can say so.
    """
    out, skipped = [], []
    for p in paths:
        dirs = step_dirs(p) if os.path.isdir(p) and not is_committed(p) else {}
        if not dirs:
            out.append(p)
            continue
        for step in sorted(dirs):
            d = os.path.join(p, dirs[step])
            (out if is_committed(d) else skipped).append(d)
    return out, skipped


def _plan_datasets(views: list[CheckpointView], globs: list[str] | None) -> list[_Dataset]:
    """One dataset per selected tensor key; every checkpoint must have it with one shape and dtype."""
    first = views[0]
    order: dict[str, CheckpointView] = {}
    for v in views:
        for key in v.tensors:
            if key_selected(key, globs):
                order.setdefault(key, v)
    if not order:
        what = f"match --keys {' '.join(globs)}" if globs else "are in the checkpoint"
        raise ValueError(f"{first.path}: no tensor keys {what}; nothing to export")
    out = []
    for key, owner in order.items():
        ref = owner.tensors[key]
        for v in views:
            md = v.tensors.get(key)
            if md is None:
                what = "an object" if key in v.objects else "missing"
                raise ValueError(
                    f"key {key!r} is a tensor in {owner.path} but {what} in {v.path}; "
                    "choose the keys to export with --keys"
                )
            if tuple(md.size) != tuple(ref.size) or md.properties.dtype != ref.properties.dtype:
                raise ValueError(
                    f"key {key!r} is {_describe(ref)} in {owner.path} but {_describe(md)} in {v.path}; "
                    "checkpoints exported together must agree (choose keys with --keys)"
                )
        dtype, shape = ref.properties.dtype, tuple(ref.size)
        stored = stored_dtype(dtype, key)
        out.append(_Dataset(
            key=key, name=dataset_name(key), shape=shape, dtype=dtype, stored_as=stored,
            chunks=(1,) + chunk_shape(shape, dtype.itemsize),
        ))
    return out


def _describe(md) -> str:
    return f"{dtype_name(md.properties.dtype)}{list(md.size)}"


def stored_dtype(dtype: torch.dtype, key: str = "") -> str:
    """The numpy dtype a torch dtype is stored as: itself, or raw bits of the same width."""
    if dtype in _NATIVE:
        return _NATIVE[dtype]
    raw = _RAW_BITS.get(dtype.itemsize)
    if raw is None:
        raise ValueError(f"key {key!r}: dtype {dtype_name(dtype)} cannot be exported (itemsize {dtype.itemsize})")
    return _NATIVE[raw]


def as_stored(block: torch.Tensor):
    """A block as the numpy array that is written: raw bits for dtypes numpy lacks."""
    if block.dtype not in _NATIVE:
        block = block.view(_RAW_BITS[block.dtype.itemsize])
    return block.contiguous().numpy()


def dataset_name(key: str) -> str:
    """The dataset (HDF5) or array directory (zarr) name of a key; reversible.

    ``%`` and ``/`` are percent-encoded (``/`` would make HDF5 groups), and
    so is a leading ``.`` (``.``, ``..`` and zarr's ``.zattrs`` are not
    usable names).
    """
    if key == "":
        raise ValueError("the empty key '' cannot be exported as a dataset name")
    name = key.replace("%", "%25").replace("/", "%2F")
    return "%2E" + name[1:] if name.startswith(".") else name


def chunk_shape(shape: tuple[int, ...], itemsize: int, target: int = CHUNK_TARGET_BYTES) -> tuple[int, ...]:
    """The per-step part of the chunk shape: whole trailing dims, rows of dim 0 up to ``target`` bytes.

    When one row along a dim is larger than ``target`` that dim gets 1 and
    the next dim is split, down to the last. Every chunk dim is >= 1 (empty
    dims included), as both formats require. A 0-d tensor gives ``()``.
    """
    out = []
    for d, n in enumerate(shape):
        inner = math.prod(shape[d + 1:]) * itemsize
        if inner <= target:
            out.append(max(1, min(n, target // max(inner, 1))))
            out.extend(max(1, m) for m in shape[d + 1:])
            break
        out.append(1)
    return tuple(out)


def _collect_objects(views: list[CheckpointView], globs: list[str] | None) -> tuple[list[dict], list[str]]:
    """Per checkpoint, ``{key: value}`` of its selected objects that are plain JSON data.

    Objects that are not (a custom class, bytes, NaN), or that need
    unrestricted unpickling, are left out; their keys are returned.
    """
    per_step, omitted = [], []
    for v in views:
        values = {}
        for key in v.objects:
            if not key_selected(key, globs):
                continue
            try:
                value = v.read_object(key)
            except UnsafeCheckpointError:
                value = _NOT_PLAIN
            if _is_plain_json(value):
                values[key] = value
            elif key not in omitted:
                omitted.append(key)
        per_step.append(values)
    return per_step, omitted


_NOT_PLAIN = object()


def _is_plain_json(value) -> bool:
    """Whether ``json.dumps`` keeps ``value`` as it is (tuples become lists; no NaN, no odd keys)."""
    if value is None or isinstance(value, (bool, int, str)):
        return True
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, (list, tuple)):
        return all(_is_plain_json(x) for x in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _is_plain_json(x) for k, x in value.items())
    return False


def _load_backend(fmt: str):
    """The writer for ``fmt``, failing with one line when its library is not installed."""
    library = "h5py" if fmt == "hdf5" else "tensorstore"
    for module in (library, "numpy"):
        try:
            importlib.import_module(module)
        except ImportError:
            raise ImportError(f"export --format {fmt} needs {module}: pip install 'dcp_datastates[export]'") from None
    return formats.module(formats.EXPORT[fmt])


def _check_out(out: str, paths: list[str], overwrite: bool) -> None:
    """Refuse an existing ``out`` without ``overwrite``, and anything ``overwrite`` must never delete."""
    check_output_apart(out, paths)
    if not os.path.lexists(out):
        return
    if not overwrite:
        raise FileExistsError(f"{out} exists; pass --overwrite to replace it")
    if os.path.isdir(out) and not os.path.islink(out) and not _is_zarr_store(out):
        raise FileExistsError(f"{out} is a directory that is not a zarr store; not replacing it")


def _is_zarr_store(path: str) -> bool:
    return any(os.path.isfile(os.path.join(path, f)) for f in (".zgroup", ".zarray"))


def _block_index(step: int, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> tuple:
    """The output index of a block: its step, then its box in the tensor."""
    return (step,) + tuple(slice(o, o + n) for o, n in zip(offsets, sizes))


def _blocks(views, datasets, block_bytes, progress):
    """``(dataset, index, array)`` of every block of every dataset of every checkpoint; the next
    block is read while the caller writes this one."""
    def every_block():
        for i, view in enumerate(views):
            for ds in datasets:
                for offsets, block in view.blocks(ds.key, block_bytes):
                    yield i, ds, offsets, block

    for i, ds, offsets, block in read_ahead(every_block()):
        nbytes = block.numel() * ds.dtype.itemsize
        if nbytes:
            yield ds, _block_index(i, offsets, tuple(block.shape)), as_stored(block)
        del block
        progress.add(nbytes)
        if nbytes >= _TRIM_AFTER_BYTES:
            release_freed_memory()  # give the freed block back to the OS (see native.memory)


_TRIM_AFTER_BYTES = 1 << 20


def _dataset_attrs(ds: _Dataset, steps: list[int]) -> dict:
    return {"key": ds.key, "dtype": dtype_name(ds.dtype), "stored_as": ds.stored_as, "steps": list(steps)}


def _fsync_tree(path: str) -> None:
    """Make the finished output durable before its final name can appear."""
    if os.path.isfile(path):
        with open(path, "rb") as f:
            os.fsync(f.fileno())
        return
    for top, _dirs, files in os.walk(path, topdown=False):
        for name in files:
            with open(os.path.join(top, name), "rb") as f:
                os.fsync(f.fileno())
        fsync_dir(top)


def run(args) -> int:
    """``dcp-datastates export``: export, then print what was written (a short aligned table)."""
    with LazyProgress("export", quiet=args.quiet) as progress, signals_interrupt():
        summary = export_checkpoints(
            args.ckpts, args.out, args.format, keys=args.keys, block_bytes=args.block_bytes,
            overwrite=args.overwrite, progress=progress,
        )
    for path in summary.skipped:
        print(f"note: skipped {path}: not committed", file=sys.stderr)
    rows = [
        ("out", summary.out),
        ("format", summary.format),
        ("steps", " ".join(map(str, summary.steps))),
        ("datasets", f"{len(summary.keys)} (step axis of {len(summary.steps)} + tensor shape)"),
        ("objects", f"{summary.objects} plain values in the 'objects' attribute (all steps)"
         + (f", {len(summary.objects_omitted)} not plain data: {', '.join(summary.objects_omitted)}"
            if summary.objects_omitted else "")),
        ("written", human_bytes(summary.bytes)),
    ]
    print("\n".join(format_fields(rows)))
    return 0
