"""The codec: a writer's compression settings, one zstd frame made and undone, the thread pool
both sides run frames on, and the stream transforms of stock DCP checkpoints we can undo."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import threading
from typing import Any, Callable, Sequence

from dcp_datastates import _dcp_compat
from dcp_datastates.errors import CorruptCheckpointError, UnsupportedFormatError
from dcp_datastates.format.checkpoint_layout import BLOCK_ALIGN, COMPRESSION_CODECS, MAX_BLOCK_BYTES

ZSTD = "zstd"
DEFAULT_LEVEL = 3  # zstd's default, and what DCP's ZStandard() compresses with
DEFAULT_BLOCK_BYTES = 4 << 20
INSTALL_HINT = 'pip install "dcp_datastates[zstd]" (or pip install zstandard)'


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
    """A writer's compression settings. ``descriptor`` is what the layout records."""

    codec: str = ZSTD
    level: int = DEFAULT_LEVEL
    block_bytes: int = DEFAULT_BLOCK_BYTES

    @property
    def descriptor(self) -> tuple:
        return (self.codec, self.block_bytes)


def resolve_compression(
    compression: str | None,
    level: int | None,
    extensions: Sequence[Any] | None,
    block_bytes: int | None = None,  # None: DEFAULT_BLOCK_BYTES (read now: tests shrink it)
) -> Compression | None:
    """The writer's settings from its arguments, or None for raw tensors.

    ``_extensions=[ZStandard()]`` (DCP's stream transform) means zstd at DCP's
    level; any other extension is refused: our format has no stream transforms,
    and silently dropping one (say, encryption) would be worse than failing.
    """
    if compression not in (None, "none", ZSTD):
        raise ValueError(f"compression must be None, 'none' or {ZSTD!r}, got {compression!r}")
    codec = None if compression in (None, "none") else compression
    zstd_cls = _dcp_compat.zstandard_extension_class()
    for ext in extensions or ():
        if zstd_cls is not None and isinstance(ext, zstd_cls) and type(ext).get_descriptor is zstd_cls.get_descriptor:
            codec = ZSTD
            continue
        name = type(ext).__name__
        try:
            desc = ext.get_descriptor()
        except Exception:  # noqa: BLE001 - only for the message
            desc = "?"
        raise ValueError(
            f"DataStatesWriter does not support the DCP extension {name} ({desc}); the only stream "
            f"transform it accepts is torch.distributed.checkpoint._extension.ZStandard (stored as "
            f"{ZSTD} compression of tensor blocks), also available as compression={ZSTD!r}"
        )
    if codec is None:
        if level is not None:
            raise ValueError("compression_level was given without compression='zstd'")
        return None
    assert codec in COMPRESSION_CODECS
    zstd = zstd_module()
    level = DEFAULT_LEVEL if level is None else level
    if not isinstance(level, int) or not -(1 << 17) <= level <= zstd.MAX_COMPRESSION_LEVEL:
        raise ValueError(f"compression_level must be an integer up to {zstd.MAX_COMPRESSION_LEVEL}, got {level!r}")
    block_bytes = DEFAULT_BLOCK_BYTES if block_bytes is None else block_bytes
    if not isinstance(block_bytes, int) or not 4096 <= block_bytes <= MAX_BLOCK_BYTES or block_bytes % BLOCK_ALIGN:
        raise ValueError(
            f"compression block size must be a multiple of {BLOCK_ALIGN} bytes from 4096 to "
            f"{MAX_BLOCK_BYTES}, got {block_bytes!r}"
        )
    return Compression(codec, level, block_bytes)


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


# -- stock DCP checkpoints --------------------------------------------------------


def check_stock_transforms(storage_data: dict, where: str) -> None:
    """A stock DCP checkpoint's stream transforms (``_StorageInfo.transform_descriptors``)
    must be ones DCP's reader can undo here: zstd needs its package, others are refused."""
    descriptors = set()
    for info in storage_data.values():
        for desc in getattr(info, "transform_descriptors", None) or ():
            descriptors.add(desc)
    for desc in sorted(descriptors):
        name, _, version = str(desc).partition("/")
        if name == "stream.zstd":
            if version.partition(".")[0] != "1":
                raise UnsupportedFormatError(f"{where}: items are compressed with {desc}, a zstd stream version this torch does not know")
            zstd_module()
            continue
        raise UnsupportedFormatError(
            f"{where}: items were written through the DCP extension {desc!r}, which dcp_datastates "
            "cannot undo (it reads stream.zstd only)"
        )
