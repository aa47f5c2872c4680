"""Access to the native engine and the process-wide engine instances.

An engine owns a pre-faulted host pool and its threads. Creating one costs
time and memory, so writers and readers with the same settings share one per
process: every later save reuses the pool that the first save mapped.

A forked process (DataLoader workers, ``multiprocessing`` with fork) inherits
the engines but not their threads: there they would never finish a job, and
destroying one would join threads that do not exist. The child therefore
starts with an empty cache and creates its own engines on first use; the
inherited ones stay referenced forever so they are never destroyed there
(the native side refuses to wait for them, and leaks rather than deletes them,
in any process but the one that created them).
"""

from __future__ import annotations

import ctypes
import os
import threading

try:
    from dcp_datastates import _engine
except ImportError as exc:  # pragma: no cover - depends on how the package was installed
    raise ImportError(
        "dcp_datastates' native engine (dcp_datastates._engine) is not built. Install the "
        "package with `pip install .` (or `pip install -e .` for development); if you run "
        "from the source checkout, run from another directory so the installed package is "
        "imported rather than the sources."
    ) from exc

MiB = 1 << 20
DEFAULT_WINDOW_BYTES = 8 * MiB
DEFAULT_IO_THREADS = 2
# Reads never use the host pool and verify each piece right after its pread,
# so more threads keep more reads in flight while others checksum.
DEFAULT_READ_THREADS = 4
DEFAULT_HOST_CACHE_BYTES = 256 * MiB
ALIGNMENT = _engine.ALIGNMENT
DIRECT_IO_MODES = ("auto", "on", "off")

ForkedEngineError = _engine.ForkedEngineError

_lock = threading.Lock()
_engines: dict[tuple[int, int, int], _engine.Engine] = {}
_engines_pid = os.getpid()  # the process the cached engines belong to
_inherited: list[_engine.Engine] = []  # engines of a parent process: kept, never destroyed here


def _forget_inherited_engines() -> None:
    """In a fork child: leave the parent's engines unused (and alive), start a new cache."""
    global _lock, _engines, _engines_pid
    _lock = threading.Lock()  # another thread may have held it at the fork
    _inherited.extend(_engines.values())
    _engines = {}
    _engines_pid = os.getpid()


os.register_at_fork(after_in_child=_forget_inherited_engines)


def get_engine(
    host_cache_bytes: int = DEFAULT_HOST_CACHE_BYTES,
    io_threads: int = DEFAULT_IO_THREADS,
    window_bytes: int = DEFAULT_WINDOW_BYTES,
) -> _engine.Engine:
    """Return the process-wide engine for these settings, creating it on first use."""
    if window_bytes <= 0 or window_bytes % ALIGNMENT:
        raise ValueError(f"window_bytes must be a positive multiple of {ALIGNMENT}, got {window_bytes}")
    if host_cache_bytes < 2 * window_bytes:
        raise ValueError(
            f"host_cache_bytes={host_cache_bytes} must hold at least two windows of "
            f"{window_bytes} bytes"
        )
    if not 1 <= io_threads <= 256:
        raise ValueError(f"io_threads must be between 1 and 256, got {io_threads}")
    key = (int(host_cache_bytes), int(io_threads), int(window_bytes))
    if _engines_pid != os.getpid():  # forked without os.fork's hooks (a fork() from C)
        _forget_inherited_engines()
    with _lock:
        eng = _engines.get(key)
        if eng is None:
            eng = _engine.Engine(io_threads=key[1], pool_bytes=key[0], window_bytes=key[2])
            _engines[key] = eng
        return eng


class ProcessEngine:
    """The engine for fixed settings, in whichever process asks.

    Writers and readers hold one: made before a fork, it hands the child the
    child's own engine (the parent's has no threads there and would never
    finish a job), and the parent keeps its own.
    """

    __slots__ = ("settings", "_pid", "_engine")

    def __init__(self, host_cache_bytes: int, io_threads: int, window_bytes: int) -> None:
        self.settings = (host_cache_bytes, io_threads, window_bytes)
        self._pid = os.getpid()
        self._engine = get_engine(*self.settings)

    def get(self) -> _engine.Engine:
        if self._pid != os.getpid():
            self._engine = get_engine(*self.settings)
            self._pid = os.getpid()
        return self._engine


def bytes_address(blob: bytes) -> int:
    """The address of an immutable ``bytes`` object's buffer (the engine only reads it)."""
    return ctypes.cast(ctypes.c_char_p(blob), ctypes.c_void_p).value


def bytearray_address(buf: bytearray) -> int:
    """The address of a ``bytearray``'s buffer (the engine reads into it)."""
    return ctypes.addressof((ctypes.c_char * len(buf)).from_buffer(buf))


crc32c = _engine.crc32c


def stop_write_job(job, why: str) -> None:
    """Cancel an unfinished write job and wait until the engine has let go of it.

    Its descriptors and reserved blocks are given back now, not when the
    last reference to the job (in a traceback, say) goes away.
    """
    if job is None or job.done:
        return
    job.cancel(why)
    job.seal()
    try:
        job.wait()
    except OSError:  # the cancellation itself, or the write error that failed the save
        pass


class gc_paused:
    """Pause Python's cyclic garbage collector for a block, restoring its state after.

    Saving or loading tens of thousands of tensors allocates hundreds of
    thousands of small objects (plans, results, views) that form no cycles;
    the collections they trigger cost about a second per 20,000 tensors
    (measured in benchmarks/bench_save_load.py) and free nothing.
    """

    def __enter__(self):
        import gc

        self._was_enabled = gc.isenabled()
        gc.disable()
        return self

    def __exit__(self, *exc):
        import gc

        if self._was_enabled:
            gc.enable()
        return False


def _loaded_cuda_runtimes() -> list[str]:
    """Paths of CUDA runtime libraries mapped into this process (torch's)."""
    found = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.rsplit(None, 1)[-1] if "/" in line else ""
                name = os.path.basename(path)
                if name.startswith("libcudart.so") and path not in found:
                    found.append(path)
    except OSError:
        pass
    return found


def ensure_cuda_runtime() -> None:
    """Give the engine the CUDA runtime torch uses, before the first CUDA copy.

    The engine is built without CUDA, so it resolves the runtime library at
    run time: the one torch loaded (found in /proc/self/maps), else one the
    process already has under a standard soname. Raises if there is none.
    """
    if _engine.cuda_runtime_path() is not None:
        return
    import torch

    torch.cuda.init()  # loads the runtime if torch has not touched CUDA yet
    reasons = []
    for path in _loaded_cuda_runtimes() + [""]:
        why = _engine.load_cuda_runtime(path)
        if not why:
            return
        reasons.append(why)
    raise RuntimeError(
        "dcp_datastates could not resolve the CUDA runtime that torch uses, so it cannot copy "
        "CUDA tensors: " + "; ".join(reasons)
    )
