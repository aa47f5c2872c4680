"""Type stub of dcp_datastates._engine, the native data-movement engine (csrc/bindings.cpp).

The engine never sees torch objects: callers pass addresses and keep the
memory alive (``keep``) until the engine is done with it. Everything that
crosses the boundary is a typed, immutable record, validated when it is made
(a bad field raises TypeError or ValueError naming ``Class.field``).
tests/test_engine.py checks that this stub and the module name the same things.
"""

from typing import Iterable, Literal, Sequence, final

from . import faults as faults

ALIGNMENT: int
"""O_DIRECT alignment (4096) of buffers, offsets and lengths."""
FUSED_BLOCK_BYTES: int
"""Bytes a buffered write or a read moves at a time, each block checksummed while cached."""

class ForkedEngineError(RuntimeError):
    """An engine (or one of its jobs) used in a process forked from the one that made it."""

# -- records ----------------------------------------------------------------------------

class Region:
    """Bytes the engine writes at ``file_offset``: a HostRegion, StridedRegion or DeviceRegion."""

    @property
    def address(self) -> int: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def file_offset(self) -> int: ...

@final
class HostRegion(Region):
    """Contiguous host memory: ``nbytes`` from ``address``."""

    def __init__(self, *, address: int, nbytes: int, file_offset: int) -> None: ...

@final
class StridedRegion(Region):
    """Host memory with gaps, gathered by the engine in row-major order (no contiguous copy).

    ``strides`` are in elements of ``itemsize`` bytes; ``nbytes`` must equal
    ``prod(sizes) * itemsize``; negative strides are refused.
    """

    def __init__(
        self,
        *,
        address: int,
        nbytes: int,
        file_offset: int,
        sizes: Sequence[int],
        strides: Sequence[int],
        itemsize: int,
    ) -> None: ...
    @property
    def sizes(self) -> tuple[int, ...]: ...
    @property
    def strides(self) -> tuple[int, ...]: ...
    @property
    def itemsize(self) -> int: ...

@final
class DeviceRegion(Region):
    """Contiguous CUDA memory on ``device``, copied after ``ready_event`` (a cudaEvent_t; None: no wait)."""

    def __init__(
        self, *, address: int, nbytes: int, file_offset: int, device: int, ready_event: int | None = None
    ) -> None: ...
    @property
    def device(self) -> int: ...
    @property
    def ready_event(self) -> int | None: ...

@final
class SegmentCheck:
    """``nbytes`` from ``offset_in_request`` (relative to the request) must have CRC-32C ``crc32c``."""

    def __init__(self, *, offset_in_request: int, nbytes: int, crc32c: int) -> None: ...
    @property
    def offset_in_request(self) -> int: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def crc32c(self) -> int: ...
    def __eq__(self, other: object) -> bool: ...
    def __hash__(self) -> int: ...

@final
class SegmentTable:
    """A file's checksum segments (a rank index's): sorted by offset, disjoint."""

    def __init__(self, *, offsets: Sequence[int], lengths: Sequence[int], crc32cs: Sequence[int]) -> None: ...
    def __len__(self) -> int: ...
    def first_gap(self, offset: int, nbytes: int) -> tuple[int, int] | None:
        """The first bytes ``[start, end)`` of the range its segments inside it do not tile, or None."""

@final
class ReadRequest:
    """Read ``nbytes`` at ``offset`` of ``paths[file_index]`` into ``address``, verifying ``checks``.

    ``checks`` must be sorted, non-overlapping and inside the request. With ``verify_with``
    the checks are that table's segments inside the range, which must tile it (ValueError).
    """

    def __init__(
        self,
        *,
        file_index: int,
        offset: int,
        nbytes: int,
        address: int,
        checks: Iterable[SegmentCheck] = (),
        verify_with: SegmentTable | None = None,
    ) -> None: ...
    @property
    def file_index(self) -> int: ...
    @property
    def offset(self) -> int: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def address(self) -> int: ...
    @property
    def checks(self) -> tuple[SegmentCheck, ...]: ...

@final
class Segment:
    """A piece of a finished write: ``nbytes`` at file ``offset`` with CRC-32C ``crc32c``."""

    def __init__(self, *, offset: int, nbytes: int, crc32c: int) -> None: ...
    @property
    def offset(self) -> int: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def crc32c(self) -> int: ...
    def __eq__(self, other: object) -> bool: ...
    def __hash__(self) -> int: ...

@final
class ReadFailure:
    """Why request ``request`` of a read job failed; ``offset`` is -1 when not tied to one."""

    def __init__(
        self,
        *,
        request: int,
        kind: Literal["io", "truncated", "checksum"],
        errno: int,
        path: str,
        offset: int,
        message: str,
    ) -> None: ...
    @property
    def request(self) -> int: ...
    @property
    def kind(self) -> Literal["io", "truncated", "checksum"]: ...
    @property
    def errno(self) -> int: ...
    @property
    def path(self) -> str: ...
    @property
    def offset(self) -> int: ...
    @property
    def message(self) -> str: ...
    def __eq__(self, other: object) -> bool: ...
    def __hash__(self) -> int: ...

# -- jobs and the engine ----------------------------------------------------------------

@final
class WriteJob:
    """A file being written; raises OSError (``filename`` and ``offset`` set) when it fails."""

    def append(self, regions: Iterable[Region], keep: Iterable[object] = []) -> None: ...
    def seal(self) -> None: ...
    def wait_staged(self) -> bool: ...
    def release_staged(self) -> bool: ...
    def wait(self) -> list[Segment]: ...
    def wait_records(self) -> bytes: ...
    def cancel(self, why: str) -> None: ...
    def next_chunk(self) -> tuple[int, memoryview] | None:
        """A streamed job's next window in file order: ``(offset, read-only view)``, valid until the
        next call (which gives its pool slot back); None once all were handed out."""
    @property
    def done(self) -> bool: ...
    @property
    def direct(self) -> bool: ...
    @property
    def borrows(self) -> bool: ...
    @property
    def streams(self) -> bool: ...
    @property
    def windows_from_source(self) -> int:
        """Windows written straight from the caller's memory so far (``borrow=True``)."""
    @property
    def path(self) -> str: ...

@final
class ReadJob:
    """Reads running in the engine; ``wait()`` returns the failures (empty: all read and verified)."""

    def wait(self) -> list[ReadFailure]: ...
    @property
    def done(self) -> bool: ...

@final
class Engine:
    """A host pool of ``pool_bytes`` in windows of ``window_bytes``, a stager and ``io_threads`` I/O threads."""

    def __init__(self, *, io_threads: int, pool_bytes: int, window_bytes: int, checksum_bytes: int = 0) -> None: ...
    def write(
        self,
        path: str,
        regions: Iterable[Region],
        keep: Iterable[object] = [],
        *,
        direct_io: Literal["auto", "on", "off"] = "auto",
        preallocate: int = 0,
        durable: bool = True,
        borrow: bool = False,
        stream: bool = False,
    ) -> WriteJob:
        """``borrow=True``: the caller leaves every region's host memory unchanged until the job is
        done, so windows of contiguous host memory are written from it without a copy where the
        file allows (buffered, or page-aligned for O_DIRECT). ``stream=True``: no file; the windows
        are taken in file order with :meth:`WriteJob.next_chunk`."""
    def read(self, paths: Sequence[str], requests: Iterable[ReadRequest], keep: Iterable[object] = []) -> ReadJob: ...
    def pin_pool(self) -> None:
        """cudaHostRegister the pool now; RuntimeError naming the failed call (copies still work unpinned)."""
    @property
    def owner_pid(self) -> int: ...
    @property
    def pool_pinned(self) -> bool: ...
    @property
    def pin_error(self) -> str: ...
    @property
    def jobs_in_flight(self) -> int: ...
    @property
    def io_threads(self) -> int: ...
    @property
    def window_bytes(self) -> int: ...
    @property
    def checksum_bytes(self) -> int: ...
    @property
    def pool_bytes(self) -> int: ...
    @property
    def pool_address(self) -> int: ...
    @property
    def free_windows(self) -> int: ...

# -- functions ----------------------------------------------------------------------------

def crc32c(data: bytes | bytearray | memoryview, crc: int = 0) -> int:
    """CRC-32C of a contiguous buffer, extending ``crc``."""

def crc32c_combine(crc_a: int, crc_b: int, len_b: int) -> int:
    """CRC-32C of A followed by B from ``crc32c(A)``, ``crc32c(B)`` and ``len(B)``."""

def crc32c_backend() -> Literal["sse4.2+pclmul", "sse4.2", "armv8-crc", "table"]:
    """The CRC-32C kernel the engine uses (of two hardware kernels, the faster on this CPU, timed once)."""
def load_cuda_runtime(path: str = "") -> str:
    """dlopen the CUDA runtime (``''``: one already loaded); returns ``''`` or why not. First success wins."""

def cuda_runtime_path() -> str | None: ...
def create_cuda_stream() -> int:
    """A new non-blocking stream on the current device (a handle for ``torch.cuda.ExternalStream``);
    never destroyed. RuntimeError without a runtime or when the runtime refuses."""
