"""Type stub of dcp_datastates._probes: raw disk and memory probes for the benchmarks only (csrc/probes_bindings.cpp)."""

def probe_sequential_write(path: str, total: int, block: int = 8388608, direct: bool = True) -> float:
    """Seconds to write ``total`` bytes to a new ``path`` in ``block``-byte writes, fsync included."""

def probe_sequential_read(path: str, block: int = 8388608) -> tuple[int, float]:
    """(bytes read, seconds) for a buffered sequential read of all of ``path``."""

def probe_memcpy(total: int, block: int = 8388608, reps: int = 3) -> float:
    """Seconds of the fastest of ``reps`` single-thread copies of ``total`` prefaulted bytes."""

def crc32c_kernels() -> list[str]:
    """The CRC-32C implementations this CPU can run ("table" always)."""

def crc32c_with(kernel: str, data: bytes | bytearray | memoryview, crc: int = 0) -> int:
    """CRC-32C of ``data`` extending ``crc`` by the named kernel; ValueError if this CPU lacks it."""

def drop_page_cache(path: str) -> None: ...
