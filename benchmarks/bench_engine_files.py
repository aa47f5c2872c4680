#!/usr/bin/env python
"""The engine alone: one file against stripes, and each CRC-32C kernel.

    python benchmarks/bench_engine_files.py [--dir /dev/shm] [--mib 1024] [--reps 3]

Part 1 writes ``--mib`` of host memory (16 MiB regions, borrowed: checksummed
and written straight from it) through the engine with 2 I/O threads, as one
file and as 2 files of half each (one engine job per file, as a striped rank
does), alternating, and prints GB/s per repetition and the median. Buffered
writes to one file serialize on its inode lock; this shows what stripes buy
on the storage under ``--dir`` without DCP or the writer around them.

Part 2 times each CRC-32C kernel this CPU runs (``_probes.crc32c_kernels``)
over the same buffer (from memory) and over 256 KiB (in cache).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch

from dcp_datastates import _probes
from dcp_datastates.native import engine as native

REGION = 16 << 20


def write_files(eng, data: torch.Tensor, directory: str, files: int) -> float:
    """Seconds to write ``data`` as ``files`` files of equal parts (one job each), fsync included."""
    nbytes = data.numel()
    per = nbytes // files
    paths = [os.path.join(directory, f"engine_probe_{k}") for k in range(files)]
    t0 = time.perf_counter()
    jobs = []
    for k, path in enumerate(paths):
        regions = [
            native.HostRegion(address=data.data_ptr() + k * per + off, nbytes=min(REGION, per - off), file_offset=off)
            for off in range(0, per, REGION)
        ]
        jobs.append(eng.write(path, regions, [data], preallocate=per, borrow=True))
    for job in jobs:
        job.seal()
    for job in jobs:
        job.wait()
    seconds = time.perf_counter() - t0
    for path in paths:
        os.unlink(path)
    return seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default="/dev/shm", help="where the files are written (default /dev/shm)")
    ap.add_argument("--mib", type=int, default=1024, help="bytes written per repetition, in MiB (default 1024)")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()

    nbytes = args.mib << 20
    data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)  # touched: every page resident
    eng = native.get_engine(io_threads=2)
    directory = tempfile.mkdtemp(dir=args.dir)
    try:
        write_files(eng, data[: 64 << 20], directory, 2)  # warm-up: engine threads, pool
        rates: dict[int, list[float]] = {1: [], 2: []}
        for rep in range(args.reps):
            for files in ((1, 2) if rep % 2 == 0 else (2, 1)):
                rates[files].append(nbytes / write_files(eng, data, directory, files) / 1e9)
        print(f"engine, 2 I/O threads, {args.mib} MiB to {args.dir}, borrowed 16 MiB regions:")
        for files, r in rates.items():
            print(f"  {files} file(s): median {statistics.median(r):.2f} GB/s   reps {' '.join(f'{x:.2f}' for x in r)}")
    finally:
        os.rmdir(directory)

    view = memoryview(data.numpy())
    small = memoryview(data[: 256 << 10].numpy())
    print("CRC-32C kernels (one thread):")
    for kernel in _probes.crc32c_kernels():
        if kernel == "table" and nbytes > (256 << 20):
            big = memoryview(data[: 256 << 20].numpy())  # the portable kernel is slow: a quarter is enough
        else:
            big = view
        t0 = time.perf_counter()
        _probes.crc32c_with(kernel, big)
        from_memory = len(big) / (time.perf_counter() - t0) / 1e9
        t0 = time.perf_counter()
        for _ in range(200):
            _probes.crc32c_with(kernel, small)
        in_cache = 200 * len(small) / (time.perf_counter() - t0) / 1e9
        print(f"  {kernel:<15} {from_memory:6.2f} GB/s from memory, {in_cache:6.2f} GB/s in cache")


if __name__ == "__main__":
    main()
