#!/usr/bin/env python
"""How long ``dcp.async_save`` blocks the trainer with our writer, and how much of that is DCP's.

    python benchmarks/bench_stage_call.py [--device cpu|cuda] [--tensors N] [--rows N]
                                          [--reps N] [--dir D] [--json OUT]

The same ``--tensors`` tensors (``--rows`` x 1024 float32 each) are saved, alternating, as a
flat state dict (one top-level key per tensor, as bench_async_save.py passes them) and nested
under one key (as ``{"model": model.state_dict()}`` or torchtitan's checkpointer passes them).
Before it stages anything, DCP's ``async_save`` wraps each top-level value in its call logger
(a message dict, a UUID, the group's size and backend looked up); our ``stage()`` is the same
work either way. So the difference between the two medians is DCP's own per-key cost, and the
nested median is the closest a user's call gets to our part alone. Each save is waited for
(committed) before the next; the checkpoints are removed at the end.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from bench_common import init_gloo, machine_info, make_scratch, pick_device, remove_scratch, write_json
from dcp_datastates import DataStatesWriter
from dcp_datastates.native.engine import release_engines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--tensors", type=int, default=382, help="tensor count (default 382: bench_async_save's 4 GiB state)")
    ap.add_argument("--rows", type=int, default=16, help="rows of 1024 float32 per tensor (default 16: 64 KiB)")
    ap.add_argument("--reps", type=int, default=7, help="timed calls of each layout (default 7)")
    ap.add_argument("--dir", default=None, help="directory for checkpoints (default ./bench_tmp; /dev/shm for software cost)")
    ap.add_argument("--json", default=None, help="write the figures to this JSON file")
    args = ap.parse_args()
    device = pick_device(args.device)
    init_gloo()
    tensors = {f"layer{i}.weight": torch.randn(args.rows, 1024, device=device) for i in range(args.tensors)}
    layouts = {"flat": tensors, "nested": {"model": dict(tensors)}}
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    cache = max(256 << 20, nbytes + (64 << 20))  # the whole state fits: no call waits for the disk
    base, scratch, owned = make_scratch(args.dir, "stage-call-")
    machine = machine_info(base)  # read while the directory exists (the run removes it)
    count = 0

    def call(state: dict) -> float:
        nonlocal count
        count += 1
        t = time.perf_counter()
        resp = dcp.async_save(state, storage_writer=DataStatesWriter(os.path.join(scratch, f"ck{count}"),
                                                                      host_cache_bytes=cache))
        blocked = time.perf_counter() - t
        resp.upload_completion.result()
        return blocked

    try:
        for state in layouts.values():  # untimed: the engine's pool, imports, the first plan
            call(state)
        times: dict[str, list[float]] = {k: [] for k in layouts}
        for _ in range(args.reps):
            for name, state in layouts.items():
                times[name].append(call(state))
    finally:
        remove_scratch(base, scratch, owned)
        release_engines()
        dist.destroy_process_group()
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"async_save's blocking call, {args.tensors} tensors of {args.rows * 4} KiB on {device}, "
          f"median of {args.reps} (alternating), ms")
    for name in layouts:
        print(f"  {name:<7} {med[name] * 1e3:7.1f}   ({', '.join(f'{x * 1e3:.1f}' for x in times[name])})")
    print(f"  DCP's own per-key part (flat - nested): {(med['flat'] - med['nested']) * 1e3:.1f} ms "
          f"({(med['flat'] - med['nested']) / args.tensors * 1e6:.0f} us a top-level key)")
    if args.json:
        write_json(args.json, {"args": vars(args), "machine": machine, "device": str(device),
                               "bytes": nbytes, "blocked_s": times, "median_s": med})


if __name__ == "__main__":
    main()
