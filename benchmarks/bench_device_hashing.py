#!/usr/bin/env python
"""Where incremental saves should hash GPU tensors: on the host, as built, or on the device.

    python benchmarks/bench_device_hashing.py [--device cuda|cpu] [--tensors N] [--mib N]
                                              [--threads 1,2,4] [--reps N] [--json OUT]

An incremental save proves a chunk unchanged by its XXH3-128 digest, which the
base recorded. For a device tensor the digest is taken on the host, from
64 MiB pieces copied into pinned memory on a stream of their own
(``incremental._cuda_digest``). This measures, over ``--tensors`` tensors of
``--mib`` MiB each on ``--device``:

- the host path as built (``incremental.hash_all`` on 1, 2, 4 threads);
- the copy alone: every tensor into pinned host memory on one stream, the
  device-to-host ceiling (a full save moves these bytes once anyway);
- XXH3-128 of the same bytes already in host memory, on the same threads;
- one read of every byte on the device (a sum): the floor under any
  hash computed there, which would move nothing over the bus;
- the host path while the caller's stream runs a long kernel: hashing must not
  wait for it (the copies are on their own stream).

On ``--device cpu`` the "copy" is a host memcpy and the floor a host sum: that
checks the script without a GPU; the decision needs ``--device cuda``.

``--json`` is written however the run ends: ``"complete": false`` and the
``"error"`` when a measurement fails (a digest mismatch, say), with the figures
taken before it.
"""

from __future__ import annotations

import argparse
import time

import torch

from bench_common import machine_info, pick_device, write_json
from dcp_datastates import _dcp_compat
from dcp_datastates.core import incremental


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def best_seconds(fn, reps: int, device: torch.device) -> float:
    best = float("inf")
    for _ in range(reps):
        synchronize(device)
        t = time.perf_counter()
        fn()
        synchronize(device)
        best = min(best, time.perf_counter() - t)
    return best


def hash_on_host(tensors: list, threads: int) -> list:
    return incremental.hash_all(tensors, threads, ready=incremental.ready_events(tensors))


def copy_to_host(tensors: list, hosts: list) -> None:
    for t, h in zip(tensors, hosts):
        h.copy_(t, non_blocking=True)


def read_on_device(tensors: list) -> None:
    for t in tensors:
        t.sum()


def busy_caller_kernel(device: torch.device, cycles: int) -> float:
    """Seconds a ``cuda_sleep(cycles)`` kernel runs on the caller's stream of ``device``."""
    with torch.cuda.device(device):
        synchronize(device)
        t = time.perf_counter()
        _dcp_compat.cuda_sleep(cycles)
        synchronize(device)
        return time.perf_counter() - t


def hash_while_caller_busy(tensors: list, threads: int, cycles: int, expected: list) -> tuple[float, bool]:
    """(seconds to hash, whether the caller's kernel was still running when the digests were
    in): the kernel is queued after the save's ready event, so the copies must not wait for it."""
    device = tensors[0].device
    with torch.cuda.device(device):
        ready = incremental.ready_events(tensors)
        _dcp_compat.cuda_sleep(cycles)
        t = time.perf_counter()
        digests = incremental.hash_all(tensors, threads, ready=ready)
        hashed = time.perf_counter() - t
        still_running = not torch.cuda.current_stream(device).query()
        torch.cuda.synchronize(device)
    assert digests == expected, "the digests taken while the caller's stream was busy differ"
    return hashed, still_running


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tensors", type=int, default=8, help="tensors (default 8)")
    ap.add_argument("--mib", type=int, default=256, help="MiB per tensor (default 256)")
    ap.add_argument("--threads", default="1,2,4", help="hashing threads to try (default 1,2,4)")
    ap.add_argument("--reps", type=int, default=3, help="best of (default 3)")
    ap.add_argument("--busy-cycles", type=int, default=2_000_000_000,
                    help="length of the caller's kernel in the busy-stream case (CUDA only)")
    ap.add_argument("--json", default=None, help="write every figure to this JSON file")
    args = ap.parse_args()
    device = pick_device(args.device)
    threads = [int(x) for x in args.threads.split(",")]
    results: dict = {}
    # written however the measurements end: an assertion in the last case keeps the figures before it
    report = {"args": vars(args), "machine": machine_info(), "results": results, "complete": False}
    try:
        measure(args, device, threads, results)
        report["complete"] = True
    except Exception as e:
        report["error"] = f"{type(e).__name__}: {e}"
        raise
    finally:
        if args.json:
            write_json(args.json, report)
    return 0


def measure(args, device: torch.device, threads: list[int], results: dict) -> None:
    """Every measurement of main(), its figures into ``results`` as they come."""
    n = (args.mib << 20) // 4
    tensors = [torch.randn(n, device=device) for _ in range(args.tensors)]
    nbytes = sum(t.nbytes for t in tensors)
    pinned = device.type == "cuda"
    hosts = [torch.empty(t.shape, dtype=t.dtype, pin_memory=pinned) for t in tensors]
    results["bytes"] = nbytes

    def rate(seconds: float) -> float:
        return nbytes / seconds / 1e9

    print(f"{args.tensors} tensors x {args.mib} MiB on {device}, best of {args.reps}, GB/s")
    copy_s = best_seconds(lambda: copy_to_host(tensors, hosts), args.reps, device)
    floor_s = best_seconds(lambda: read_on_device(tensors), args.reps, device)
    results["copy_to_host_gbps"] = rate(copy_s)
    results["device_read_floor_gbps"] = rate(floor_s)
    print(f"{'copy to host' + (' (pinned, one stream)' if pinned else ''):<40}{rate(copy_s):10.2f}")
    print(f"{'one read on the device (floor)':<40}{rate(floor_s):10.2f}")
    expected = incremental.hash_all(hosts, max(threads))
    for k in threads:
        host_s = best_seconds(lambda: hash_on_host(tensors, k), args.reps, device)
        xxh_s = best_seconds(lambda: incremental.hash_all(hosts, k), args.reps, device)
        assert hash_on_host(tensors, k) == expected, "the host path's digests differ from the host copies'"
        results[f"host_path_{k}_threads_gbps"] = rate(host_s)
        results[f"xxh3_in_host_memory_{k}_threads_gbps"] = rate(xxh_s)
        print(f"{f'host path as built, {k} thread' + 's' * (k > 1):<40}{rate(host_s):10.2f}"
              f"   (copy ceiling x{host_s / copy_s:.2f} the time, device floor x{host_s / floor_s:.1f})")
        print(f"{f'XXH3-128 of host bytes, {k} thread' + 's' * (k > 1):<40}{rate(xxh_s):10.2f}")
    if device.type == "cuda":
        kernel_s = busy_caller_kernel(device, args.busy_cycles)
        hashed_s, still_running = hash_while_caller_busy(tensors, max(threads), args.busy_cycles, expected)
        results.update(busy_kernel_s=kernel_s, hash_while_busy_s=hashed_s, busy_kernel_outlived_hashing=still_running)
        print(f"caller's stream busy for {kernel_s:.3f} s: hashed in {hashed_s:.3f} s, "
              + ("the kernel still running after (did not wait)" if still_running
                 else "the kernel done before (WAITED, or the kernel is shorter than the hashing: raise --busy-cycles)"))


if __name__ == "__main__":
    raise SystemExit(main())
