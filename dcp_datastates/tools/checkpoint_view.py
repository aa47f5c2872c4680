"""Key-by-key, read-only access to a committed checkpoint, for offline tools.

The command-line tool (inspect, convert, export, diff) works on one tensor,
or one block of a tensor, at a time, so its memory is bounded by the largest
block and not by the checkpoint. :class:`CheckpointView` opens a checkpoint
written by dcp_datastates or by DCP's stock ``FileSystemWriter`` and reads any
box of any tensor's global (unsharded) shape through the same
``DataStatesReader.read_data`` that ``dcp.load`` uses (for both formats), with
a one-key load planner. For our format every byte read is checksum-verified; in both
formats ``.metadata`` is unpickled by the restricted unpickler and saved
Python objects must be plain data unless ``allow_pickle`` is given.
"""

from __future__ import annotations

import atexit
import dataclasses
import io
import math
import os
import queue
import re
import threading
import warnings
from typing import Any, Iterable, Iterator, TypeVar

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    MetadataIndex,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from dcp_datastates.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    UnsafeCheckpointError,
)
from dcp_datastates.format.file_names import METADATA_FILE, layout_files
from dcp_datastates.core.reader import DataStatesReader
from dcp_datastates.storage.url import is_store_url

T = TypeVar("T")

DEFAULT_BLOCK_BYTES = 256 << 20  # the largest block tools read at once
_STEP_NAME_RE = re.compile(r"step_(\d+)")

FORMAT_OURS = "dcp_datastates"
FORMAT_DCP = "dcp"


@dataclasses.dataclass(frozen=True)
class StoredChunk:
    """One saved chunk of a tensor: its box in the global shape and where its bytes live."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str  # relative to the checkpoint directory
    offset: int  # byte offset in ``file`` (-1 where the format does not say)
    length: int  # stored bytes (for stock DCP: the serialized size)


class CheckpointView:
    """A committed checkpoint, opened for reading key by key.

    Args:
        path: the checkpoint directory (holding ``.metadata``), or its URL in object storage
            (``s3://bucket/run/step_...``; read with ranged reads).
        allow_pickle: unpickle saved objects (and stock DCP metadata) without
            restriction. Only for checkpoints you trust.
        extension_registry: DCP's ``ExtensionRegistry`` that undoes the stream transforms the
            checkpoint's items went through (default: DCP's, which knows ZStandard).
    """

    def __init__(self, path: str | os.PathLike, *, allow_pickle: bool = False, extension_registry=None) -> None:
        self.path = os.fspath(path)
        self.allow_pickle = allow_pickle
        remote = is_store_url(self.path)
        if not remote and not os.path.isdir(self.path):
            raise CheckpointNotFoundError(f"no checkpoint at {self.path}: the directory does not exist")
        # One reader for both formats: ours, and stock DCP's records (core/stock_dcp.py).
        self.reader = DataStatesReader(self.path, allow_pickle=allow_pickle, _extension_registry=extension_registry)
        self.metadata = self.reader.load_metadata()  # bounded by its structure, not its size; checked
        self.format = FORMAT_OURS if self.reader.layout is not None else FORMAT_DCP
        self.reader.use_metadata(self.metadata)
        self.tensors: dict[str, TensorStorageMetadata] = {}
        self.objects: list[str] = []
        for fqn, md in self.metadata.state_dict_metadata.items():
            if isinstance(md, TensorStorageMetadata):
                self.tensors[fqn] = md
            elif isinstance(md, BytesStorageMetadata):
                self.objects.append(fqn)

    # -- structure ---------------------------------------------------------------

    def keys(self) -> list[str]:
        return list(self.metadata.state_dict_metadata)

    def nbytes(self, fqn: str) -> int:
        md = self._tensor_md(fqn)
        return math.prod(md.size) * md.properties.dtype.itemsize

    def stored_chunks(self, fqn: str) -> list[StoredChunk]:
        """Every saved chunk of tensor ``fqn``, in metadata order."""
        md = self._tensor_md(fqn)
        out = []
        for chunk in md.chunks:
            file, offset, length = self._location(MetadataIndex(fqn, chunk.offsets))
            out.append(StoredChunk(tuple(chunk.offsets), tuple(chunk.sizes), file, offset, length))
        return out

    def object_location(self, fqn: str) -> tuple[str, int]:
        """(file, stored bytes) of the saved object ``fqn``."""
        file, _offset, length = self._location(MetadataIndex(fqn))
        if self.format == FORMAT_OURS:
            loc = self.reader.layout.location(MetadataIndex(fqn))
            idx = self.reader.rank_index(loc.relative_path)
            length = idx.objects[loc.object_ordinal][1] if 0 <= loc.object_ordinal < len(idx.objects) else -1
        return file, length

    def files(self) -> list[str]:
        """The files the checkpoint consists of, relative to its directory (``.metadata`` first)."""
        if self.format == FORMAT_OURS:
            return [METADATA_FILE] + layout_files(self.reader.layout)
        names = sorted({info.relative_path for info in self.metadata.storage_data.values()})
        return [METADATA_FILE] + names

    def file_size(self, name: str) -> int | None:
        """The size of the checkpoint's file ``name`` (one of :meth:`files`), None if missing."""
        return self.reader.store.size(self.reader.key(name))

    def training_step(self) -> int | None:
        """The checkpoint's training step: its int ``step`` entry (an object, or an integer
        scalar tensor), else ``step_<N>`` in its directory name, else None."""
        try:
            if "step" in self.objects:
                value = self.read_object("step")
                if isinstance(value, int) and not isinstance(value, bool):
                    return value
            elif "step" in self.tensors and self.tensors["step"].size.numel() == 1:
                t = self.read_tensor("step")
                if not t.is_floating_point() and not t.is_complex() and t.dtype != torch.bool:
                    return int(t.reshape(()).item())
        except UnsafeCheckpointError:
            pass  # not plain data: fall back to the directory name
        m = _STEP_NAME_RE.search(os.path.basename(os.path.normpath(self.path)))
        return int(m.group(1)) if m else None

    def _tensor_md(self, fqn: str) -> TensorStorageMetadata:
        md = self.tensors.get(fqn)
        if md is None:
            what = "an object, not a tensor" if fqn in self.objects else "not in the checkpoint"
            raise KeyError(f"{self.path}: {fqn!r} is {what}")
        return md

    def _location(self, index: MetadataIndex) -> tuple[str, int, int]:
        if self.format == FORMAT_OURS:
            loc = self.reader.layout.location(index)
            if loc is None:
                raise CorruptCheckpointError(f"{self.path}: no stored location for {index.fqn!r}")
            if loc.is_compressed:  # stored bytes: the sum of its frames (offset -1: several places)
                from dcp_datastates.format.checkpoint_layout import compressed_blocks

                frames = self.reader.rank_index(loc.relative_path).objects
                n = compressed_blocks(loc.length, self.reader.layout.compression[1])
                return loc.relative_path, -1, sum(m for _, m in frames[loc.object_ordinal : loc.object_ordinal + n])
            files = self.reader.layout.files_of(loc.relative_path)
            if files is not None and files.stripes:  # the stripe's own file, and the offset in it
                if loc.offset < 0:  # an object: after the tensors, in the last stripe
                    return files.data_paths()[-1], loc.offset, loc.length
                stripe, base, _ = files.stripe_of(loc.offset)
                return files.data_paths()[stripe], loc.offset - base, loc.length
            return loc.relative_path, loc.offset, loc.length
        info = self.metadata.storage_data.get(index)
        if info is None:
            raise CorruptCheckpointError(f"{self.path}: no stored location for {index.fqn!r}")
        return info.relative_path, info.offset, info.length

    # -- reading -----------------------------------------------------------------

    def read_block(self, fqn: str, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> torch.Tensor:
        """The box ``[offsets, offsets + sizes)`` of tensor ``fqn``'s global shape, as a new CPU tensor."""
        md = self._tensor_md(fqn)
        offsets, sizes = tuple(offsets), tuple(sizes)
        if len(offsets) != len(md.size) or len(sizes) != len(md.size) or any(
            o < 0 or n < 0 or o + n > s for o, n, s in zip(offsets, sizes, md.size)
        ):
            raise ValueError(f"{fqn!r}: box {offsets}+{sizes} is outside its shape {tuple(md.size)}")
        with warnings.catch_warnings():  # complex32: "ComplexHalf support is experimental", once per process
            warnings.simplefilter("ignore", UserWarning)
            dest = torch.empty(sizes, dtype=md.properties.dtype)
        if dest.numel() == 0:
            return dest
        items = create_read_items_for_chunk_list(fqn, md, [ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes))])
        self._read(items, _BlockPlanner(dest, self))
        return dest

    def read_tensor(self, fqn: str) -> torch.Tensor:
        md = self._tensor_md(fqn)
        return self.read_block(fqn, (0,) * len(md.size), tuple(md.size))

    def read_object(self, fqn: str) -> Any:
        if fqn not in self.objects:
            what = "a tensor, not an object" if fqn in self.tensors else "not in the checkpoint"
            raise KeyError(f"{self.path}: {fqn!r} is {what}")
        planner = _BlockPlanner(None, self)
        item = ReadItem(
            type=LoadItemType.BYTE_IO,
            dest_index=MetadataIndex(fqn),
            dest_offsets=torch.Size([0]),
            storage_index=MetadataIndex(fqn),
            storage_offsets=torch.Size([0]),
            lengths=torch.Size([0]),
        )
        self._read([item], planner)
        return planner.value

    def blocks(self, fqn: str, max_bytes: int = DEFAULT_BLOCK_BYTES) -> Iterator[tuple[tuple[int, ...], torch.Tensor]]:
        """Yield ``(offsets, block)`` pairs that tile tensor ``fqn`` exactly.

        Blocks follow the saved chunks (so each read touches one stored
        chunk), split along the leading dimensions so that a block holds at
        most ``max_bytes`` (or one innermost row, when a row is larger).
        """
        for offsets, sizes in self.block_boxes(fqn, max_bytes):
            yield offsets, self.read_block(fqn, offsets, sizes)

    def block_boxes(self, fqn: str, max_bytes: int = DEFAULT_BLOCK_BYTES) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
        md = self._tensor_md(fqn)
        itemsize = md.properties.dtype.itemsize
        out: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
        if len(md.size) == 0:
            return [((), ())]
        for chunk in md.chunks:
            out.extend(split_box(tuple(chunk.offsets), tuple(chunk.sizes), itemsize, max_bytes))
        return out

    def _read(self, items: list[ReadItem], planner: "_BlockPlanner") -> None:
        if not items:
            return
        plan = LoadPlan(items)
        try:
            self.reader.read_data(plan, planner).wait()
        except CheckpointError:
            raise
        except (OSError, RuntimeError, ValueError, EOFError) as exc:
            keys = sorted({i.storage_index.fqn for i in items})
            raise CorruptCheckpointError(f"{self.path}: reading {', '.join(map(repr, keys))} failed: {exc}") from exc


_unclosed_read_aheads: set = set()  # (stop, slots, worker) of every read-ahead not closed yet


@atexit.register
def _stop_unclosed_read_aheads() -> None:
    """At exit, stop the read-aheads an interrupt left running (raised while one started its
    producer, or while its generator, never closed, was still held by a frame) and wait for the
    read in flight: a producer left inside the engine while the interpreter finalizes would
    abort the process."""
    for stop, slots, worker in list(_unclosed_read_aheads):
        stop.set()
        slots.release()
        if worker.ident is not None:  # started (an interrupt may even have come before start())
            worker.join()


def read_ahead(blocks: Iterable[T], depth: int = 1) -> Iterator[T]:
    """Yield from ``blocks`` while a thread produces the next ``depth`` items.

    Reads run in the engine with the GIL released, so reading the next block
    overlaps the caller's work on this one (writing it out). At most
    ``depth + 1`` items exist at once (the producer takes a slot before it
    reads, and the caller gives it back by asking for the next item, so it
    must drop its reference to an item before that); an error of the
    producer is raised here, at the item where it happened.
    """
    q: queue.Queue = queue.Queue()
    slots = threading.Semaphore(depth + 1)
    end = object()
    stop = threading.Event()

    def produce() -> None:
        try:
            it = iter(blocks)
            while True:
                slots.acquire()
                if stop.is_set():
                    return
                item = next(it, end)
                q.put((item, None))
                if item is end:
                    return
                del item
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer
            q.put((end, exc))

    worker = threading.Thread(target=produce, name="dcp_datastates-read-ahead", daemon=True)
    handle = (stop, slots, worker)
    _unclosed_read_aheads.add(handle)  # first: an interrupt inside start() leaves it to the exit hook
    worker.start()
    try:
        while True:
            item, exc = q.get()
            if item is end:
                if exc is not None:
                    raise exc
                return
            yield item
            del item
            slots.release()
    finally:
        stop.set()
        slots.release()  # a producer waiting for a slot sees ``stop``
        worker.join()
        _unclosed_read_aheads.discard(handle)


def split_box(offsets, sizes, itemsize: int, max_bytes: int):
    """Split a box along its leading dimensions into boxes of at most ``max_bytes`` (down to single rows):
    the blocks every tool reads, so that its memory is bounded by a block."""
    nbytes = math.prod(sizes) * itemsize
    if nbytes <= max_bytes or len(sizes) == 0 or nbytes == 0:
        return [(offsets, sizes)]
    inner = math.prod(sizes[1:]) * itemsize
    if inner > max_bytes and len(sizes) > 1:
        out = []
        for i in range(sizes[0]):
            for o, s in split_box(offsets[1:], sizes[1:], itemsize, max_bytes):
                out.append(((offsets[0] + i,) + o, (1,) + s))
        return out
    rows = max(1, max_bytes // max(inner, 1))
    return [
        ((offsets[0] + r,) + offsets[1:], (min(rows, sizes[0] - r),) + sizes[1:])
        for r in range(0, sizes[0], rows)
    ]


class _BlockPlanner(LoadPlanner):
    """A load planner for one destination block (or one object), handed to ``read_data``."""

    def __init__(self, dest: torch.Tensor | None, view: CheckpointView) -> None:
        self.dest = dest
        self.view = view
        self.value: Any = None

    def set_up_planner(self, *args, **kwargs) -> None:  # pragma: no cover - not used
        pass

    def create_local_plan(self) -> LoadPlan:  # pragma: no cover - not used
        raise NotImplementedError

    def create_global_plan(self, global_plan):  # pragma: no cover - not used
        return global_plan

    def finish_plan(self, central_plan):  # pragma: no cover - not used
        return central_plan

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        t = self.dest
        for d, (o, n) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            t = t.narrow(d, o, n)
        return t

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        pass  # read straight into (a view of) ``dest``

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.storage_index.fqn
        try:  # trusted, or our reader's own pickle of the values it checked
            self.value = torch.load(value, map_location="cpu", weights_only=False)
        except Exception as exc:  # noqa: BLE001 - torch.load raises many kinds; report them as one
            raise CorruptCheckpointError(f"{self.view.path}: {fqn!r} could not be unpickled: {exc}") from exc
