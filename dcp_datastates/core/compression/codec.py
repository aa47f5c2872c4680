"""The codec: a writer's compression settings, one frame made and undone (zstd natively, or
DCP's stream transforms), and the thread pool both sides run frames on."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import threading
from typing import Any, Callable, Sequence

from dcp_datastates import _dcp_compat
from dcp_datastates.errors import CorruptCheckpointError
from dcp_datastates.core.compression import transforms
from dcp_datastates.format.checkpoint_layout import BLOCK_ALIGN, COMPRESSION_CODECS, MAX_BLOCK_BYTES, STREAM_CODEC

ZSTD = "zstd"
DEFAULT_LEVEL = 3  # zstd's default, and what DCP's ZStandard() compresses with
DEFAULT_BLOCK_BYTES = 4 << 20
INSTALL_HINT = transforms.INSTALL_HINT


def zstd_module():
    """The ``zstandard`` package, or an ImportError that says how to install it."""
    try:
        import zstandard
    except ImportError as exc:
        raise ImportError(
            f"zstd compression needs the zstandard package, which is not installed: {INSTALL_HINT}"
        ) from exc
    return zstandard


def default_threads() -> int:
    """One thread per CPU this process may run on, at most 8."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return max(1, min(8, cpus))


def descriptor_of(compression: Compression | None) -> tuple | None:
    """What a layout records for these settings: ``(codec, block bytes)``, or None for raw."""
    return compression.descriptor if compression is not None else None


@dataclasses.dataclass(frozen=True)
class Compression:
    """A writer's compression settings. ``descriptor`` is what the layout records: ``(codec,
    block bytes)``, and for DCP's stream transforms (``codec == STREAM_CODEC``) their
    descriptors as DCP records them, third."""

    codec: str = ZSTD
    level: int = DEFAULT_LEVEL
    block_bytes: int = DEFAULT_BLOCK_BYTES
    extensions: tuple = ()  # STREAM_CODEC: DCP's stream transforms, in the order the writer got them

    @property
    def descriptor(self) -> tuple:
        if self.codec == STREAM_CODEC:
            return (self.codec, self.block_bytes, transforms.descriptors_of(self.extensions))
        return (self.codec, self.block_bytes)

    @property
    def transforms_objects(self) -> bool:
        """Whether saved Python objects go through the codec too (a stream transform may be an
        encryption: every stored byte goes through it; zstd leaves the small objects raw)."""
        return self.codec == STREAM_CODEC

    def frame(self, data, keep) -> bytes:
        """One stored frame of ``data`` (a buffer that ``keep`` keeps valid), on a pool thread."""
        if self.codec == STREAM_CODEC:
            return transforms.apply(self.extensions, data)
        return compress_frame(self.level, data, keep)


def resolve_compression(
    compression: str | None,
    level: int | None,
    extensions: Sequence[Any] | None,
    block_bytes: int | None = None,  # None: DEFAULT_BLOCK_BYTES (read now: tests shrink it)
) -> Compression | None:
    """The writer's settings from its arguments, or None for raw tensors.

    ``_extensions=[ZStandard()]`` alone (DCP's stream transform) means native zstd at
    DCP's level. Any other list of DCP stream transforms (an encryption, say, or
    ZStandard with another) is applied as DCP applies it, to every stored byte:
    each block of every tensor chunk and every object (``STREAM_CODEC``).
    """
    if compression not in (None, "none", ZSTD):
        raise ValueError(f"compression must be None, 'none' or {ZSTD!r}, got {compression!r}")
    codec = None if compression in (None, "none") else compression
    extensions = transforms.check_extensions(extensions or ())
    zstd_cls = _dcp_compat.zstandard_extension_class()
    if len(extensions) == 1 and zstd_cls is not None and type(extensions[0]) is zstd_cls:
        codec = ZSTD  # DCP's own ZStandard: our native zstd frames, at DCP's level
    elif extensions:
        if codec is not None or level is not None:
            raise ValueError(
                "compression/compression_level and DCP stream transforms (_extensions) were both given; "
                "to compress and transform, list ZStandard() among the _extensions"
            )
        transforms.descriptors_of(extensions)  # each extension must name itself
        return Compression(STREAM_CODEC, DEFAULT_LEVEL, _checked_block_bytes(block_bytes), extensions)
    if codec is None:
        if level is not None:
            raise ValueError("compression_level was given without compression='zstd'")
        return None
    assert codec in COMPRESSION_CODECS
    zstd = zstd_module()
    level = DEFAULT_LEVEL if level is None else level
    if not isinstance(level, int) or not -(1 << 17) <= level <= zstd.MAX_COMPRESSION_LEVEL:
        raise ValueError(f"compression_level must be an integer up to {zstd.MAX_COMPRESSION_LEVEL}, got {level!r}")
    return Compression(codec, level, _checked_block_bytes(block_bytes))


def _checked_block_bytes(block_bytes: int | None) -> int:
    block_bytes = DEFAULT_BLOCK_BYTES if block_bytes is None else block_bytes
    if not isinstance(block_bytes, int) or not 4096 <= block_bytes <= MAX_BLOCK_BYTES or block_bytes % BLOCK_ALIGN:
        raise ValueError(
            f"compression block size must be a multiple of {BLOCK_ALIGN} bytes from 4096 to "
            f"{MAX_BLOCK_BYTES}, got {block_bytes!r}"
        )
    return block_bytes


# -- one frame ------------------------------------------------------------------

_local = threading.local()  # each pool thread's compressors and decompressor


def compress_frame(level: int, data, keep) -> bytes:
    """One zstd frame (runs on a pool thread; zstandard releases the GIL). ``keep``
    holds the memory ``data`` points into until the frame is made."""
    cache = getattr(_local, "compressors", None)
    if cache is None:
        cache = _local.compressors = {}
    cctx = cache.get(level)
    if cctx is None:
        cctx = cache[level] = zstd_module().ZstdCompressor(level=level, write_content_size=True)
    return cctx.compress(data)


def frame_undoer(descriptor: tuple, registry, where: str) -> Callable[[Any, int | None, str], bytes]:
    """``undo(frame, raw bytes expected, what)`` for the frames of a layout whose compression is
    ``descriptor``: zstd's :func:`decompress_block`, or DCP's stream transforms built through
    ``registry`` (an ``UnsupportedFormatError`` naming an extension it lacks, here, before any
    read). ``expected`` None: an object's frame, whose raw size is not recorded."""
    if descriptor[0] != STREAM_CODEC:
        return decompress_block
    chain = transforms.extensions_for(descriptor[2], registry, where)

    def undo(blob, expected: int | None, what: str) -> bytes:
        out = transforms.undo(chain, blob, what)
        if expected is not None and len(out) != expected:
            raise CorruptCheckpointError(f"{what}: the frame undoes to {len(out)} bytes, {expected} expected")
        return out

    return undo


def decompress_block(blob, expected: int, where: str) -> bytes:
    """Decompress one frame of ``expected`` raw bytes; anything else is a corrupt checkpoint."""
    zstd = zstd_module()
    try:
        size = zstd.frame_content_size(blob)
    except zstd.ZstdError as exc:
        raise CorruptCheckpointError(f"{where}: not a zstd frame: {exc}") from None
    if size != expected:  # checked before decompressing: never allocate what a header claims
        raise CorruptCheckpointError(f"{where}: the frame holds {size} bytes, {expected} expected")
    dctx = getattr(_local, "decompressor", None)
    if dctx is None:
        dctx = _local.decompressor = zstd.ZstdDecompressor()
    try:
        out = dctx.decompress(blob, max_output_size=expected)
    except zstd.ZstdError as exc:
        raise CorruptCheckpointError(f"{where}: the frame does not decompress: {exc}") from None
    if len(out) != expected:
        raise CorruptCheckpointError(f"{where}: the frame decompressed to {len(out)} bytes, {expected} expected")
    return out


# -- the thread pool ------------------------------------------------------------

_pools: dict[int, concurrent.futures.ThreadPoolExecutor] = {}
_pools_lock = threading.Lock()


def _forget_pools_after_fork() -> None:
    """A fork child has none of the parent's pool threads: a task submitted to an
    inherited pool would never run. The child makes its own pools on first use
    (the inherited executors are dropped, never shut down: that would wait for
    threads that do not exist here)."""
    global _pools_lock
    _pools_lock = threading.Lock()
    _pools.clear()


os.register_at_fork(after_in_child=_forget_pools_after_fork)


def frame_pool(threads: int) -> concurrent.futures.ThreadPoolExecutor:
    """The process's pool of ``threads`` threads that make and undo frames."""
    with _pools_lock:
        pool = _pools.get(threads)
        if pool is None:
            pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="dcp_datastates-zstd")
            _pools[threads] = pool
        return pool


def run_parallel(tasks: list[Callable[[], None]], threads: int) -> None:
    """Run ``tasks`` on the pool (their C work releases the GIL); raise the first error."""
    if not tasks:
        return
    if len(tasks) == 1 or threads <= 1:
        for task in tasks:
            task()
        return
    futures = [frame_pool(threads).submit(task) for task in tasks]
    concurrent.futures.wait(futures)
    for f in futures:
        f.result()
