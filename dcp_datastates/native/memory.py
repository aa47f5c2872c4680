"""Keeping a streaming tool's memory bounded by its block, not by what it streamed.

The command-line tools allocate and free buffers of one block (MiBs) over and
over. glibc serves large allocations with mmap, but after the first such
buffer is freed it raises its mmap threshold to that size (the "dynamic"
threshold), and from then on serves them from the heap, whose free space is
fragmented by the small allocations in between and is not returned to the
OS: measured, RSS grew with the bytes streamed, by a large part of the
checkpoint. Fixing the threshold keeps every large buffer an mmap that is
unmapped when freed. Both calls are no-ops where glibc is not the allocator.
"""

from __future__ import annotations

import ctypes

_M_MMAP_THRESHOLD = -3  # mallopt parameter (malloc.h)
_MMAP_THRESHOLD_BYTES = 1 << 20
_libc = None


def _glibc():
    global _libc
    if _libc is None:
        try:
            lib = ctypes.CDLL("libc.so.6")
            _libc = lib if hasattr(lib, "mallopt") and hasattr(lib, "malloc_trim") else False
        except OSError:
            _libc = False
    return _libc


def bound_heap() -> None:
    """Serve allocations of 1 MiB and more with mmap for the rest of the process (fixed threshold)."""
    libc = _glibc()
    if libc:
        libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_BYTES)


def release_freed_memory() -> None:
    """Return the heap's free pages to the OS (``malloc_trim(0)``)."""
    libc = _glibc()
    if libc:
        libc.malloc_trim(0)
