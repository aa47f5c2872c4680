"""Access to the native engine and the process-wide engine instances.

An engine owns a pre-faulted host pool and its threads. Creating one costs
time and memory, so writers and readers with the same settings share one per
process: every later save reuses the pool that the first save mapped. A
long-lived process that is done checkpointing gives the pools back with
:func:`release_engines`; the next save or load makes a fresh engine.

What crosses into the engine is typed: the records re-exported here
(``HostRegion``, ``StridedRegion``, ``DeviceRegion``, ``ReadRequest``,
``SegmentCheck``; jobs answer with ``Segment`` and ``ReadFailure``) are
described, with every engine call, in ``dcp_datastates/_engine/__init__.pyi``.

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

_NOT_BUILT = (
    "dcp_datastates' native engine (dcp_datastates._engine) is not built. Install the "
    "package with `pip install .` (or `pip install -e .` for development); if you run "
    "from the source checkout, run from another directory so the installed package is "
    "imported rather than the sources."
)
try:
    import dcp_datastates._engine as _engine
except ImportError as exc:  # pragma: no cover - depends on how the package was installed
    raise ImportError(_NOT_BUILT) from exc
if not hasattr(_engine, "Engine"):  # pragma: no cover - the stub directory _engine/, imported as a namespace
    raise ImportError(_NOT_BUILT)

MiB = 1 << 20
DEFAULT_WINDOW_BYTES = 8 * MiB
# None: one checksum segment per window piece (see check_checksum_bytes).
DEFAULT_CHECKSUM_BYTES: int | None = None
MIN_CHECKSUM_BYTES = 4096
DEFAULT_IO_THREADS = 2
# Reads never use the host pool and verify each block right after its pread,
# so more threads keep more reads in flight while others checksum.
DEFAULT_READ_THREADS = 4
DEFAULT_HOST_CACHE_BYTES = 256 * MiB
ALIGNMENT = _engine.ALIGNMENT
DIRECT_IO_MODES = ("auto", "on", "off")

ForkedEngineError = _engine.ForkedEngineError

# The records of the engine's boundary (validated when made; read-only).
Region = _engine.Region
HostRegion = _engine.HostRegion
StridedRegion = _engine.StridedRegion
DeviceRegion = _engine.DeviceRegion
ReadRequest = _engine.ReadRequest
SegmentCheck = _engine.SegmentCheck
SegmentTable = _engine.SegmentTable
Segment = _engine.Segment
ReadFailure = _engine.ReadFailure


class EngineBusyError(RuntimeError):
    """:func:`release_engines` was called while an engine still had jobs in flight."""


_lock = threading.Lock()
_engines: dict[tuple[int, int, int, int], _engine.Engine] = {}
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


def check_checksum_bytes(checksum_bytes: int | None, window_bytes: int) -> int:
    """The engine's ``checksum_bytes`` for the option (0 for None: a segment per window piece).

    A power of two, so segments start at its multiples in the file whatever
    the windows; at least a page, so an index stays far smaller than its data.
    """
    if checksum_bytes is None:
        return 0
    if (
        not isinstance(checksum_bytes, int) or isinstance(checksum_bytes, bool)
        or checksum_bytes < MIN_CHECKSUM_BYTES or checksum_bytes & (checksum_bytes - 1)
        or checksum_bytes > window_bytes
    ):
        raise ValueError(
            f"checksum_bytes must be None or a power of two from {MIN_CHECKSUM_BYTES} to window_bytes "
            f"({window_bytes}), got {checksum_bytes!r}"
        )
    return checksum_bytes


def _check_settings(host_cache_bytes: int, io_threads: int, window_bytes: int, checksum_bytes: int = 0) -> None:
    if window_bytes <= 0 or window_bytes % ALIGNMENT:
        raise ValueError(f"window_bytes must be a positive multiple of {ALIGNMENT}, got {window_bytes}")
    if host_cache_bytes < 2 * window_bytes:
        raise ValueError(
            f"host_cache_bytes={host_cache_bytes} must hold at least two windows of "
            f"{window_bytes} bytes"
        )
    if not 1 <= io_threads <= 256:
        raise ValueError(f"io_threads must be between 1 and 256, got {io_threads}")
    check_checksum_bytes(checksum_bytes or None, window_bytes)


def get_engine(
    host_cache_bytes: int = DEFAULT_HOST_CACHE_BYTES,
    io_threads: int = DEFAULT_IO_THREADS,
    window_bytes: int = DEFAULT_WINDOW_BYTES,
    checksum_bytes: int | None = DEFAULT_CHECKSUM_BYTES,
) -> _engine.Engine:
    """Return the process-wide engine for these settings, creating it on first use."""
    key = (int(host_cache_bytes), int(io_threads), int(window_bytes), checksum_bytes or 0)
    if _engines_pid != os.getpid():  # forked without os.fork's hooks (a fork() from C)
        _forget_inherited_engines()
    eng = _engines.get(key)  # the common case: no lock (a dict lookup is atomic)
    if eng is not None:
        return eng
    _check_settings(*key)
    with _lock:
        eng = _engines.get(key)
        if eng is None:
            eng = _engine.Engine(io_threads=key[1], pool_bytes=key[0], window_bytes=key[2], checksum_bytes=key[3])
            _engines[key] = eng
        return eng


def release_engines() -> int:
    """Drop this process's engines so their host pools go back to the OS; returns how many.

    Engines are cached per settings for the life of the process, so a
    process that saved once keeps ``host_cache_bytes`` of pre-faulted (and,
    with CUDA, pinned) memory. Call this when it is done checkpointing for a
    while; the next save or load creates a fresh engine, and writers and
    readers made before the release work on unchanged (they look their
    engine up on every use).

    Refuses with :class:`EngineBusyError`, releasing nothing, while any
    engine has a job in flight: a save being written, a snapshot whose save
    has not ended, a load. Waiting instead could wait forever (an async
    snapshot's job stays open until its save appends the objects, which
    may be on this very thread), and dropping a busy engine would leave its
    pool mapped until the job ends while the next save maps another. Finish
    first (``writer.close()``, or wait for the upload future), then release.

    An engine is destroyed (threads joined, pool unregistered and unmapped)
    when its last reference goes: the cache's is dropped here, and a finished
    job holds none once its ``wait()`` returned. One still referenced by the
    caller (``get_engine()``'s result kept in a variable) lives until that
    reference goes.
    """
    if _engines_pid != os.getpid():
        _forget_inherited_engines()
    with _lock:
        busy = {key: eng.jobs_in_flight for key, eng in _engines.items() if eng.jobs_in_flight}
        if busy:
            which = "; ".join(
                f"host_cache_bytes={c}, io_threads={t}, window_bytes={w}"
                + (f", checksum_bytes={s}" if s else "") + f": {n} job(s)"
                for (c, t, w, s), n in busy.items()
            )
            raise EngineBusyError(
                f"release_engines(): engines still have jobs in flight ({which}); nothing was "
                "released. Close the writers (writer.close()) or wait for their saves and loads "
                "to finish, then call it again"
            )
        released = list(_engines.values())
        _engines.clear()
    count = len(released)
    del released  # outside the lock: destroying an engine joins its threads
    return count


class ProcessEngine:
    """The engine for fixed settings, in whichever process asks, whenever it asks.

    Writers and readers hold one instead of an engine. It keeps no engine
    itself: each ``get()`` looks the process-wide one up, so a writer made
    before a fork hands the child the child's own engine (the parent's has no
    threads there and would never finish a job), and one made before
    :func:`release_engines` gets a fresh engine instead of keeping the
    released one (and its host pool) alive.
    """

    __slots__ = ("settings",)

    def __init__(
        self, host_cache_bytes: int, io_threads: int, window_bytes: int,
        checksum_bytes: int | None = DEFAULT_CHECKSUM_BYTES,
    ) -> None:
        self.settings = (host_cache_bytes, io_threads, window_bytes, checksum_bytes)
        get_engine(*self.settings)  # bad settings fail here, where the writer or reader is made

    def get(self) -> _engine.Engine:
        return get_engine(*self.settings)


def segment_checks(triples) -> list[SegmentCheck]:
    """A rank index's ``(offset_in_request, nbytes, crc32c)`` checks as the engine's records."""
    return [SegmentCheck(offset_in_request=o, nbytes=n, crc32c=c) for o, n, c in triples]


def bytes_address(blob: bytes) -> int:
    """The address of an immutable ``bytes`` object's buffer (the engine only reads it)."""
    return ctypes.cast(ctypes.c_char_p(blob), ctypes.c_void_p).value


def bytearray_address(buf: bytearray) -> int:
    """The address of a ``bytearray``'s buffer (the engine reads into it)."""
    return ctypes.addressof((ctypes.c_char * len(buf)).from_buffer(buf))


crc32c = _engine.crc32c
crc32c_combine = _engine.crc32c_combine


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


def new_cuda_stream() -> int:
    """A CUDA stream of the engine's own (its handle), created outside torch's pool of streams
    (which NCCL's and FSDP's streams are taken from too); the CUDA runtime is found first."""
    ensure_cuda_runtime()
    return _engine.create_cuda_stream()


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
