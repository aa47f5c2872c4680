"""Saving to object storage: straight there, or locally then drained, against DCP's fsspec writer
and the store's own limit, on a SeaweedFS server this script starts on the loopback.

    python benchmarks/bench_store_save.py [--quick] [--state-mib N] [--reps N] [--local-dir DIR]
                                          [--host-cache-mib N] [--s3-nice N] [--json OUT]

One process per variant and repetition (its peak RSS is its own), each saving the same
--state-mib MiB of float32 tensors (16 MiB each) with dcp.save:

  raw_put           obstore's multipart upload of the same bytes from memory as one object, 64 MiB
                    parts, 4 in flight (what any writer through this client can reach: the limit
                    in this run)
  direct            DataStatesWriter("s3://bench/...") (each rank file streamed from the engine's
                    pool by multipart upload, every object read back and compared)
  direct_noverify   the same with verify_upload=False (what the read-back costs)
  local_then_drain  DataStatesWriter(local dir) then the manager's drain of that checkpoint
                    (tiers.drain.drain_rank + commit_durable: checked blocks, read-back): the
                    time until the copy in the store is committed, and the local save's part
  dcp_fsspec        DCP's FsspecWriter("s3://...") through s3fs (if installed; pip install s3fs)

Reported per variant: seconds until the checkpoint is committed in the store (median of
--reps), GB/s of state, peak RSS of the process above its RSS once the state was built, and
the ratio to raw_put. The server runs at nice --s3-nice (default 19: it stands in for a remote
one, which would not share this machine's cores); on a 2-core machine it still shares them.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
import uuid

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "support"))

MiB = 1 << 20
VARIANTS = ("raw_put", "direct", "direct_noverify", "local_then_drain", "dcp_fsspec")


def _state(state_mib: int):
    import torch

    g = torch.Generator().manual_seed(0)
    return {f"p{i}": torch.randn(4 << 20, generator=g) for i in range(max(1, state_mib // 16))}


def _rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) << 10
    return 0


def run_variant(variant: str, args) -> dict:
    """In a child process: save once, return seconds and memory."""
    import torch.distributed.checkpoint as dcp

    from dcp_datastates import DataStatesWriter

    state = _state(args.state_mib)
    nbytes = sum(t.nbytes for t in state.values())
    base_rss = _rss()
    url = f"s3://{args.bucket}/{variant}-{uuid.uuid4().hex[:8]}/step_00000001"
    options = {"endpoint": args.endpoint}
    out: dict = {"variant": variant, "bytes": nbytes}
    t0 = time.perf_counter()
    if variant == "raw_put":
        from dcp_datastates.storage import open_store

        store = open_store(url.rsplit("/", 1)[0], **options)
        blocks = (memoryview(t.numpy()).cast("B") for t in state.values())
        store.put_stream("raw.bin", blocks, nbytes)
    elif variant in ("direct", "direct_noverify"):
        writer = DataStatesWriter(url, store_options=options, verify_upload=variant == "direct",
                                  host_cache_bytes=args.host_cache_mib * MiB)
        dcp.save(state, storage_writer=writer, no_dist=True)
    elif variant == "local_then_drain":
        from dcp_datastates.format.metadata_file import read_metadata_file
        from dcp_datastates.storage import open_store
        from dcp_datastates.tiers.drain import commit_durable, drain_rank

        local = os.path.join(args.local_dir, f"ckpt-{uuid.uuid4().hex[:8]}")
        dcp.save(state, storage_writer=DataStatesWriter(local, host_cache_bytes=args.host_cache_mib * MiB), no_dist=True)
        out["local_save_s"] = time.perf_counter() - t0
        store = open_store(url.rsplit("/", 1)[0], **options)
        layout = read_metadata_file(os.path.join(local, ".metadata"))[0].storage_data
        for files in layout.own_ranks:
            drain_rank(local, "step_00000001", files, store)
        commit_durable(local, "step_00000001", store)
        import shutil

        shutil.rmtree(local)
    elif variant == "dcp_fsspec":
        try:
            import s3fs  # noqa: F401
            # DCP's fsspec writer; torch exports it from this module only
            from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter
        except ImportError:
            return {"variant": variant, "skipped": "s3fs is not installed (pip install s3fs)"}
        writer = FsspecWriter(url, client_kwargs={"endpoint_url": args.endpoint},
                              thread_count=1, sync_files=False)
        dcp.save(state, storage_writer=writer, no_dist=True)
    out["seconds"] = time.perf_counter() - t0
    out["peak_rss_above_state"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base_rss
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a 128 MiB state, one repetition")
    ap.add_argument("--state-mib", type=int, default=512)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--host-cache-mib", type=int, default=256)
    ap.add_argument("--local-dir", default="/dev/shm", help="where local_then_drain saves first (default /dev/shm)")
    ap.add_argument("--s3-nice", type=int, default=19)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--endpoint", help=argparse.SUPPRESS)
    ap.add_argument("--bucket", default="bench", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(run_variant(args.child, args)))
        return
    if args.quick:
        args.state_mib, args.reps = 128, 1
    from bench_common import machine_info, median, write_json
    from s3_server import WeedServer, running

    results: dict = {"state_mib": args.state_mib, "reps": args.reps, "host_cache_mib": args.host_cache_mib,
                     "machine": machine_info(args.local_dir), "variants": {}}
    with running(WeedServer(bucket=args.bucket, nice=args.s3_nice)) as server:
        env = dict(os.environ)
        for variant in args.variants.split(","):
            runs = []
            for _ in range(args.reps):
                cmd = [sys.executable, __file__, "--child", variant, "--endpoint", server.endpoint,
                       "--bucket", args.bucket, "--state-mib", str(args.state_mib),
                       "--host-cache-mib", str(args.host_cache_mib), "--local-dir", args.local_dir]
                done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
                if done.returncode != 0:
                    raise SystemExit(f"{variant} failed:\n{done.stdout}\n{done.stderr}")
                runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
            if "skipped" in runs[0]:
                results["variants"][variant] = runs[0]
                print(f"{variant:18s} skipped: {runs[0]['skipped']}")
                continue
            secs = median([r["seconds"] for r in runs])
            row = {"seconds": secs, "gb_per_s": runs[0]["bytes"] / secs / 1e9,
                   "peak_rss_above_state_mib": median([r["peak_rss_above_state"] for r in runs]) / MiB,
                   "runs": runs}
            if "local_save_s" in runs[0]:
                row["local_save_s"] = median([r["local_save_s"] for r in runs])
            results["variants"][variant] = row
            print(f"{variant:18s} {secs:7.2f} s  {row['gb_per_s']:5.2f} GB/s  peak RSS +{row['peak_rss_above_state_mib']:6.0f} MiB"
                  + (f"  (local save {row['local_save_s']:.2f} s)" if "local_save_s" in row else ""), flush=True)
    raw = results["variants"].get("raw_put", {}).get("seconds")
    if raw:
        for name, row in results["variants"].items():
            if "seconds" in row:
                row["vs_raw_put"] = row["seconds"] / raw
        print("time / raw_put: " + ", ".join(f"{n} {r['vs_raw_put']:.2f}" for n, r in results["variants"].items() if "vs_raw_put" in r))
    if args.json:
        write_json(args.json, results)


if __name__ == "__main__":
    main()
