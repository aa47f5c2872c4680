#!/usr/bin/env python
"""Content hashes for incremental checkpoints (issue 17): what proving "these bytes did not
change" costs per byte, on one thread and on two.

    python benchmarks/bench_hashes.py [--mib N] [--reps N] [--json OUT]

An unchanged tensor chunk may be saved as a reference to the base checkpoint's copy only when
a 128-bit hash confirms what the CRC-32C suggests. This times, over one host buffer of random
bytes: the engine's CRC-32C (dcp_datastates.native), XXH3-128 (the ``xxhash`` wheel), BLAKE3
(the ``blake3`` wheel; one thread and its own threads) and hashlib's BLAKE2b and MD5 (in the
standard library: the floor of what needs no new dependency). A hash whose package is not
installed is reported as missing. "2 threads" hashes the two halves on two Python threads at
once: it only scales if the binding releases the interpreter lock.
"""

from __future__ import annotations

import argparse
import hashlib
import threading
import time

import torch

from bench_common import add_common_args, machine_info, write_json
from dcp_datastates.native.engine import crc32c


def _optional(name: str):
    try:
        return __import__(name)
    except ImportError:
        return None


def candidates() -> dict:
    """name -> a function hashing a memoryview (None: its package is not installed)."""
    xxhash, blake3 = _optional("xxhash"), _optional("blake3")
    return {
        "crc32c (engine)": lambda m: crc32c(m),
        "xxh3_128": (lambda m: xxhash.xxh3_128(m).digest()) if xxhash else None,
        "blake3": (lambda m: blake3.blake3(m).digest()) if blake3 else None,
        "blake3 (its threads)": (lambda m: blake3.blake3(m, max_threads=blake3.blake3.AUTO).digest()) if blake3 else None,
        "blake2b": lambda m: hashlib.blake2b(m).digest(),
        "md5": lambda m: hashlib.md5(m).digest(),
    }


def best_seconds(fn, reps: int) -> float:
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def on_two_threads(fn, view: memoryview) -> None:
    half = len(view) // 2
    threads = [threading.Thread(target=fn, args=(part,)) for part in (view[:half], view[half:])]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(ap, "64 MiB, 1 rep")
    ap.add_argument("--mib", type=int, default=None, help="buffer size in MiB (default 256, --quick 64)")
    args = ap.parse_args()
    mib = args.mib or (64 if args.quick else 256)
    reps = args.reps or (1 if args.quick else 3)
    view = memoryview(torch.randint(0, 256, (mib << 20,), dtype=torch.uint8).numpy())
    print(f"hashes of a {mib} MiB host buffer, best of {reps}")
    print(f"{'hash':<22}{'1 thread GB/s':>14}{'2 threads GB/s':>16}")
    results = {}
    for name, fn in candidates().items():
        if fn is None:
            print(f"{name:<22}{'(not installed)':>14}")
            continue
        one = len(view) / best_seconds(lambda: fn(view), reps) / 1e9
        two = len(view) / best_seconds(lambda: on_two_threads(fn, view), reps) / 1e9
        results[name] = {"one_thread_gbps": one, "two_threads_gbps": two}
        print(f"{name:<22}{one:14.2f}{two:16.2f}")
    if args.json:
        write_json(args.json, {"args": vars(args), "machine": machine_info("/dev/shm"), "results": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
