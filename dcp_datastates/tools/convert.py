"""``dcp-datastates convert``: a checkpoint to torch.save, safetensors, stock DCP, or ours.

Every conversion streams: tensors are read one block (or one tensor) at a
time through :class:`CheckpointView`, so memory is bounded by the largest
block or tensor, never by the checkpoint.

* ``torch``: one ``torch.save`` file holding the nested state dict as it was
  saved (rebuilt from ``metadata.planner_data``, as DCP's own
  ``dcp_to_torch_save`` does). A skeleton of fake tensors is saved without
  data, mapped back (``MAP_SHARED``) and filled block by block.
* ``safetensors``: Hugging Face's layout, ``model-0000i-of-0000N.safetensors``
  shards of at most ``max_shard_bytes`` plus ``model.safetensors.index.json``,
  written here byte by byte (the format is a JSON header and raw bytes).
* ``dcp``: DCP's stock ``FileSystemWriter`` format, and ``datastates``: ours.
  Both go through ``dcp.save`` with a skeleton of meta tensors and a planner
  that reads each tensor from the source only when the writer asks for it.

Every output is built under a temporary name beside ``out`` and renamed into
place once complete, so a failed or interrupted conversion leaves no ``out``
and an existing one (replaced only with ``overwrite``) stays intact until then.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import mmap
import os
import signal
import struct
import sys
import uuid
import warnings
from typing import Any, Callable, Iterator

import torch

from dcp_datastates.storage.url import absolute
from dcp_datastates.tools.common import PROG, format_fields, human_bytes
from dcp_datastates.core.durable import fsync_dir
from dcp_datastates.tools.progress import ByteCounter
from dcp_datastates.tools.output import move_into_place, naming_output_errors, remove_output
from dcp_datastates.tools.checkpoint_view import FORMAT_DCP, CheckpointView, _split_box, check_output_apart, read_ahead
from dcp_datastates.errors import CheckpointError, CheckpointExistsError
from dcp_datastates.format.safe_objects import load_checked

FORMATS = ("torch", "safetensors", "dcp", "datastates")
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9  # Hugging Face's default shard size ("5GB")
BLOCK_BYTES = 64 << 20  # the largest block read at once from our format
# The DataStatesWriter's host cache for --to datastates: a few engine windows
# keep the disk busy; a bigger pool would only add resident memory.
WRITER_HOST_CACHE_BYTES = 16 << 20

SAFETENSORS_INDEX = "model.safetensors.index.json"

# torch dtype -> safetensors dtype name (safetensors.torch._TYPES, reversed).
SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
    torch.float8_e4m3fnuz: "F8_E4M3FNUZ", torch.float8_e5m2fnuz: "F8_E5M2FNUZ",
    torch.complex64: "C64", torch.uint64: "U64", torch.uint32: "U32", torch.uint16: "U16",
}

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

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


# ---------------------------------------------------------------------------
# library function
# ---------------------------------------------------------------------------


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
    """Convert the checkpoint ``src`` into ``out`` in format ``to`` (one of :data:`FORMATS`).

    ``out`` is a file for ``torch`` and a directory for the others. An
    existing ``out`` is refused unless ``overwrite``; it is replaced only once
    the new output is complete. Raises (naming the file and key) on an
    unreadable or corrupt source, a dtype the format cannot hold, or an
    existing ``out``; nothing is left behind then.
    """
    if to not in FORMATS:
        raise ValueError(f"unknown output format {to!r}; choose one of {', '.join(FORMATS)}")
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    out = os.path.abspath(os.fspath(out))
    view = CheckpointView(src, allow_pickle=allow_pickle)
    check_output_apart(out, [view.path])
    _check_replaceable(out, overwrite)
    if to == "safetensors":
        _check_safetensors_dtypes(view)
    summary = ConvertSummary(absolute(view.path), view.format, out, to)
    tracker = ByteCounter(sum(view.nbytes(k) for k in view.tensors), progress)
    parent = os.path.dirname(out)
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".{os.path.basename(out)}.convert-{uuid.uuid4().hex[:12]}")
    try:
        with _quiet_torch_warnings(), naming_output_errors(tmp, out):
            _WRITERS[to](view, tmp, summary, tracker, max_shard_bytes)
        _move_into_place(tmp, out, overwrite)
    except BaseException:
        remove_output(tmp)
        raise
    return summary


@contextlib.contextmanager
def _quiet_torch_warnings():
    """Hide torch's notices that say nothing about the conversion (complex32 is
    "experimental", DCP runs without a process group) so the tool prints only its own lines."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="ComplexHalf support is experimental")
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        warnings.filterwarnings("ignore", message=".*process group.*not.*initialized", category=UserWarning)
        yield


# ---------------------------------------------------------------------------
# reading the source
# ---------------------------------------------------------------------------


def _block_bytes(view: CheckpointView) -> int:
    """Block size for reads: stock DCP stores each chunk as one torch.save record that is
    read whole whatever box is asked for, so blocks there are whole chunks (splitting
    them would read each chunk once per block)."""
    return sys.maxsize if view.format == FORMAT_DCP else BLOCK_BYTES


def _row_major_blocks(view: CheckpointView, fqn: str) -> Iterator[torch.Tensor]:
    """Blocks of ``fqn`` whose bytes follow one another in the tensor's row-major order.

    ``view.blocks`` follows the saved chunks, which for a tensor sharded along
    an inner dimension are not contiguous in the unsharded tensor; here boxes
    are slabs of the global shape instead, assembled from whatever chunks
    they cross.
    """
    md = view.tensors[fqn]
    shape = tuple(md.size)
    if math.prod(shape) == 0:
        return
    if not shape:
        yield view.read_block(fqn, (), ())
        return
    itemsize = md.properties.dtype.itemsize
    for offsets, sizes in _split_box((0,) * len(shape), shape, itemsize, _block_bytes(view)):
        yield view.read_block(fqn, offsets, sizes)


def _with_empty(view: CheckpointView, keys: list[str]) -> Iterator[tuple[str, torch.Tensor | None]]:
    """``(key, block)`` for every block of every key, in order; ``(key, None)`` for an empty tensor."""
    for fqn in keys:
        yielded = False
        for block in _row_major_blocks(view, fqn):
            yielded = True
            yield fqn, block
        if not yielded:
            yield fqn, None


def _raw_bytes(block: torch.Tensor) -> memoryview:
    """The little-endian bytes of a contiguous CPU tensor, without a copy."""
    return memoryview(block.reshape(-1).view(torch.uint8).numpy())


# ---------------------------------------------------------------------------
# --to torch
# ---------------------------------------------------------------------------


def _write_torch(view: CheckpointView, tmp: str, summary: ConvertSummary, tracker: ByteCounter, _shard: int) -> None:
    """One torch.save file: a data-less skeleton saved, mapped back shared, filled block by block.

    Only one block is in anonymous memory at a time; the file's pages go
    through the page cache (the mapping), which the kernel writes back and
    reclaims, and are flushed with an fsync before the rename.
    """
    from dcp_datastates._dcp_compat import fake_tensor_mode

    flat: dict[str, Any] = {}
    with fake_tensor_mode():
        for fqn, md in view.tensors.items():
            flat[fqn] = torch.empty(tuple(md.size), dtype=md.properties.dtype)
    for fqn in view.objects:
        flat[fqn] = view.read_object(fqn)
    paths = _nested_paths(view)
    skeleton = _unflatten({k: flat[k] for k in view.keys() if k in flat}, paths)
    with torch.serialization.skip_data(materialize_fake_tensors=True):
        torch.save(skeleton, tmp)
    del skeleton, flat
    # The data regions are holes until the mapping fills them; a full disk would then
    # kill the process with SIGBUS. Reserving the blocks first turns that into ENOSPC.
    fd = os.open(tmp, os.O_RDWR | os.O_CLOEXEC)
    try:
        os.posix_fallocate(fd, 0, os.fstat(fd).st_size)
    finally:
        os.close(fd)
    with torch.serialization.set_default_mmap_options(mmap.MAP_SHARED):
        if view.allow_pickle:
            mapped = torch.load(tmp, mmap=True, weights_only=False)
        else:  # its objects are safe mode's plain data (set, datetime, numpy): load it the same way
            mapped = load_checked(tmp, "the converted state", tmp, mmap=True, map_location="cpu")
    try:
        for fqn in view.tensors:
            target = _get_path(mapped, paths[fqn])
            for offsets, block in view.blocks(fqn, _block_bytes(view)):
                box = target
                for d, (o, n) in enumerate(zip(offsets, block.shape)):
                    box = box.narrow(d, o, n)
                box.copy_(block)
                tracker.add(block.numel() * block.element_size())
                del block, box  # before the next block is read, not after
            summary.tensors += 1
            summary.bytes += view.nbytes(fqn)
    finally:
        del mapped  # unmaps the file: the pages written are in the page cache
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    summary.objects = len(view.objects)
    summary.files = [os.path.basename(summary.out)]


def _nested_paths(view: CheckpointView) -> dict[str, tuple]:
    """Each key's path in the nested state dict (``planner_data``), or the key itself."""
    mappings = view.metadata.planner_data if isinstance(view.metadata.planner_data, dict) else {}
    return {fqn: tuple(mappings.get(fqn) or (fqn,)) for fqn in view.keys()}


def _unflatten(flat: dict[str, Any], paths: dict[str, tuple]) -> dict:
    """The nested state dict: like DCP's unflattening, an int path element means a list index."""
    root: dict = {}
    for fqn, value in flat.items():
        path = paths[fqn]
        cur: Any = root
        for key, following in zip(path, path[1:]):
            cur = _child(cur, key, [] if isinstance(following, int) else {}, fqn)
        _put(cur, path[-1], value, fqn)
    return root


def _child(container: Any, key: Any, default: Any, fqn: str) -> Any:
    if isinstance(container, dict):
        value = container.setdefault(key, default)
    else:
        _put(container, key, None, fqn, keep=True)
        if container[key] is None:
            container[key] = default
        value = container[key]
    if not isinstance(value, (dict, list)):
        raise CheckpointError(f"key {fqn!r}: its path {key!r} is also a value of another key (planner_data is inconsistent)")
    return value


def _put(container: Any, key: Any, value: Any, fqn: str, keep: bool = False) -> None:
    if isinstance(container, dict):
        container[key] = value
        return
    if not isinstance(key, int) or key < 0:
        raise CheckpointError(f"key {fqn!r}: path element {key!r} indexes a list")
    container.extend([None] * (key + 1 - len(container)))
    if not keep:
        container[key] = value


def _get_path(root: Any, path: tuple) -> Any:
    for key in path:
        root = root[key]
    return root


# ---------------------------------------------------------------------------
# --to safetensors
# ---------------------------------------------------------------------------


def _check_safetensors_dtypes(view: CheckpointView) -> None:
    """Refuse, before anything is written, tensors whose dtype safetensors has no name for."""
    bad = [(fqn, md.properties.dtype) for fqn, md in view.tensors.items() if md.properties.dtype not in SAFETENSORS_DTYPES]
    if bad:
        listed = ", ".join(f"{fqn!r} ({str(dtype).replace('torch.', '')})" for fqn, dtype in bad)
        raise ValueError(
            f"{view.path}: safetensors cannot hold dtype {str(bad[0][1]).replace('torch.', '')} "
            f"of key {bad[0][0]!r}; keys it cannot store: {listed} (convert --to torch, dcp or datastates instead)"
        )


def plan_shards(sizes: list[tuple[str, int]], max_shard_bytes: int) -> list[list[str]]:
    """Group keys, in order, into shards of at most ``max_shard_bytes`` (a larger tensor alone)."""
    shards: list[list[str]] = []
    used = 0
    for key, nbytes in sizes:
        if not shards or (shards[-1] and used + nbytes > max_shard_bytes):
            shards.append([])
            used = 0
        shards[-1].append(key)
        used += nbytes
    return shards or [[]]


def safetensors_header(view: CheckpointView, keys: list[str]) -> bytes:
    """A shard's header: 8-byte little-endian length, then JSON padded with spaces to 8 bytes."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for fqn in keys:
        md = view.tensors[fqn]
        end = offset + view.nbytes(fqn)
        header[fqn] = {
            "dtype": SAFETENSORS_DTYPES[md.properties.dtype],
            "shape": list(md.size),
            "data_offsets": [offset, end],
        }
        offset = end
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def _write_safetensors(view: CheckpointView, tmp: str, summary: ConvertSummary, tracker: ByteCounter, max_shard_bytes: int) -> None:
    """HF-style shards plus ``model.safetensors.index.json``; objects are skipped (listed)."""
    if sys.byteorder != "little":  # pragma: no cover - safetensors stores little-endian bytes
        raise CheckpointError("converting to safetensors needs a little-endian machine")
    keys = list(view.tensors)
    shards = plan_shards([(k, view.nbytes(k)) for k in keys], max_shard_bytes)
    os.mkdir(tmp)
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map: dict[str, str] = {}
    for name, shard in zip(names, shards):
        path = os.path.join(tmp, name)
        with open(path, "xb") as f:
            f.write(safetensors_header(view, shard))
            done = set()
            for fqn, block in read_ahead(_with_empty(view, shard)):  # the next block is read meanwhile
                if block is not None:
                    f.write(_raw_bytes(block))
                    tracker.add(block.numel() * block.element_size())
                    del block
                if fqn not in done:
                    done.add(fqn)
                    weight_map[fqn] = name
                    summary.tensors += 1
                    summary.bytes += view.nbytes(fqn)
            f.flush()
            os.fsync(f.fileno())
    index = {"metadata": {"total_size": summary.bytes}, "weight_map": weight_map}
    with open(os.path.join(tmp, SAFETENSORS_INDEX), "x") as f:
        json.dump(index, f, indent=2)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    fsync_dir(tmp)
    summary.skipped = list(view.objects)
    summary.files = names + [SAFETENSORS_INDEX]


# ---------------------------------------------------------------------------
# --to dcp / --to datastates
# ---------------------------------------------------------------------------


class _Placeholder:
    """Stands for a saved object in the skeleton; the planner reads the real one when asked."""

    def __repr__(self) -> str:
        return "<object read at write time>"


def _lazy_planner_class():
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.metadata import MetadataIndex

    class LazySavePlanner(DefaultSavePlanner):
        """DCP's default planner over a skeleton; each value is read from the source on demand.

        The skeleton is the flat state (the source's keys) of meta tensors,
        which plan like real ones (``TensorProperties.create_from_tensor``
        only reads dtype, layout and ``is_pinned()``, False on meta), and of
        placeholders for objects. ``lookup_object`` reads the real tensor or
        object when the storage writer resolves that item, so the writer
        pulls one tensor at a time. The source's ``planner_data`` is kept as
        it was, so the output unflattens to the same nested structure.

        ``resolve_creates_tensors`` tells DataStatesWriter to resolve and
        release in batches. ``release_previous`` (stock FileSystemWriter
        only) frees each tensor's memory when the next one is resolved:
        FileSystemWriter keeps every tensor of a file in a dict until the file
        is closed (for its safetensors mode), but with one thread and no
        copy-ahead it writes each tensor before resolving the next.
        """

        resolve_creates_tensors = True

        def __init__(self, view: CheckpointView, tracker: ByteCounter, release_previous: bool) -> None:
            super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
            self.view = view
            self.tracker = tracker
            self.release_previous = release_previous
            self.previous: torch.Tensor | None = None
            self.tensors_read = 0
            self.objects_read = 0

        def set_up_planner(self, state_dict, storage_meta=None, is_coordinator=False) -> None:
            super().set_up_planner(state_dict, storage_meta, is_coordinator)
            mappings = self.view.metadata.planner_data
            if isinstance(mappings, dict) and mappings:
                self.mappings = dict(mappings)
                self.flatten_state_dict = True  # create_*_plan now carry planner_data into the metadata

        def lookup_object(self, index: MetadataIndex) -> Any:
            fqn = index.fqn
            if fqn not in self.view.tensors:
                self.objects_read += 1
                return self.view.read_object(fqn)
            self.release()
            tensor = self.view.read_tensor(fqn)  # the whole (unsharded) tensor: one chunk
            nbytes = tensor.numel() * tensor.element_size()
            self.tracker.add(nbytes)
            self.tensors_read += 1
            if self.release_previous:
                self.previous = tensor
            return tensor

        def release(self) -> None:
            if self.previous is not None:
                self.previous.untyped_storage().resize_(0)
                self.previous = None

    return LazySavePlanner


def _skeleton(view: CheckpointView) -> dict[str, Any]:
    """The flat state to plan with: meta tensors of each key's global shape, placeholders for objects."""
    flat: dict[str, Any] = {}
    for fqn in view.keys():
        md = view.tensors.get(fqn)
        if md is not None:
            flat[fqn] = torch.empty(tuple(md.size), dtype=md.properties.dtype, device="meta")
        elif fqn in view.objects:
            flat[fqn] = _Placeholder()
    return flat


def _dcp_save(view: CheckpointView, writer, tracker: ByteCounter, summary: ConvertSummary, release_previous: bool) -> None:
    import torch.distributed.checkpoint as dcp

    planner = _lazy_planner_class()(view, tracker, release_previous)
    with _dcp_errors():
        try:
            dcp.save(_skeleton(view), storage_writer=writer, planner=planner, no_dist=True)
        finally:
            planner.release()
    summary.tensors = planner.tensors_read
    summary.objects = planner.objects_read
    summary.bytes = sum(view.nbytes(k) for k in view.tensors)


def _write_dcp(view: CheckpointView, tmp: str, summary: ConvertSummary, tracker: ByteCounter, _shard: int) -> None:
    """DCP's stock FileSystemWriter format (one ``__0_0.distcp`` file plus ``.metadata``)."""
    from torch.distributed.checkpoint import FileSystemWriter

    os.mkdir(tmp)
    # One thread and no copy-ahead: the serial loader resolves a tensor only
    # after the previous one was written (what release_previous relies on).
    writer = FileSystemWriter(tmp, single_file_per_rank=True, thread_count=1, per_thread_copy_ahead=0, overwrite=False)
    _dcp_save(view, writer, tracker, summary, release_previous=True)
    _check_dcp_output(view, tmp)
    fsync_dir(tmp)
    summary.files = sorted(os.listdir(tmp))


def _check_dcp_output(view: CheckpointView, tmp: str) -> None:
    """Each tensor's record must hold at least its bytes: a guard for release_previous, which
    would otherwise turn a change in FileSystemWriter's loading order into silently empty records."""
    written = CheckpointView(tmp, allow_pickle=view.allow_pickle)
    for fqn in view.tensors:
        stored = written.stored_chunks(fqn)
        if sum(c.length for c in stored) < view.nbytes(fqn):
            raise CheckpointError(
                f"{tmp}: the record of {fqn!r} is shorter than its {view.nbytes(fqn)} bytes; this torch's "
                "FileSystemWriter resolves tensors ahead of writing them, which the converter does not support"
            )


def _write_datastates(view: CheckpointView, tmp: str, summary: ConvertSummary, tracker: ByteCounter, _shard: int) -> None:
    """Our format, through DataStatesWriter (which commits with its own fsyncs)."""
    from dcp_datastates.core.writer import DataStatesWriter

    with DataStatesWriter(tmp, host_cache_bytes=WRITER_HOST_CACHE_BYTES) as writer:
        _dcp_save(view, writer, tracker, summary, release_previous=False)
    summary.files = sorted(os.listdir(tmp))


@contextlib.contextmanager
def _dcp_errors():
    """DCP wraps a rank's error in CheckpointException (a BaseException): raise the rank's own."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except CheckpointException as exc:
        failures = list(exc.failures.values())
        if failures:
            inner = failures[0]
            inner = inner[0] if isinstance(inner, tuple) else inner
            if isinstance(inner, BaseException):
                raise inner from None
        raise CheckpointError(str(exc)) from None


_WRITERS = {
    "torch": _write_torch,
    "safetensors": _write_safetensors,
    "dcp": _write_dcp,
    "datastates": _write_datastates,
}


# ---------------------------------------------------------------------------
# putting the output in place
# ---------------------------------------------------------------------------


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


def _move_into_place(tmp: str, out: str, overwrite: bool) -> None:
    _check_replaceable(out, overwrite)  # again: something may have appeared meanwhile
    move_into_place(tmp, out, overwrite)


# ---------------------------------------------------------------------------
# command line
# ---------------------------------------------------------------------------


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


def run_cli(args) -> int:
    """``dcp-datastates convert``: convert, print a summary table; exit status 0."""
    from dcp_datastates.tools.progress import LazyProgress

    progress = LazyProgress(f"convert to {args.to}", quiet=args.quiet)

    try:
        with _sigterm_as_interrupt():
            summary = convert_checkpoint(
                args.ckpt, args.out, args.to, max_shard_bytes=args.max_shard_size, overwrite=args.overwrite,
                allow_pickle=args.allow_pickle, progress=progress,
            )
    finally:
        progress.close()
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
