#!/usr/bin/env python
"""What a durable tier adds to a CheckpointManager's start, and what each commit adds.

    python benchmarks/bench_tier_start.py [--steps N] [--local N] [--starts N] [--puts N]
                                          [--port P] [--tree DIR] [--json OUT]

On a SeaweedFS server started here (loopback, tests/support/s3_server.py), a run saves ``--steps``
steps (the last ``--local`` kept locally, all of them on the tier); then the manager is opened
``--starts`` times on that root with the tier and without it (median of each), and the run's
pointer is written to the tier ``--puts`` times (``replace_bytes("latest")``: the mirror each
commit adds, in the drain thread). Roots and the server's data live on /dev/shm.

``--tree DIR`` imports dcp_datastates from another source checkout instead (its extension
modules copied next to its sources), to compare two versions in one sitting; a version without
the pointer mirror reports no PUT figure.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))


def use_tree(tree: str) -> None:
    """Import dcp_datastates (and the tests' helpers) from ``tree``, not the editable install."""
    sys.path.insert(0, tree)
    sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in type(f).__module__]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=10, help="steps saved, all drained (default 10)")
    ap.add_argument("--local", type=int, default=3, help="steps kept locally (default 3)")
    ap.add_argument("--starts", type=int, default=7, help="manager starts timed (default 7)")
    ap.add_argument("--puts", type=int, default=30, help="pointer PUTs timed (default 30)")
    ap.add_argument("--port", type=int, default=None, help="the server's port (default: a free one)")
    ap.add_argument("--tree", default=None, help="a source checkout to import dcp_datastates from")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    tree = os.path.abspath(args.tree) if args.tree else os.path.dirname(HERE)
    if args.tree:
        use_tree(tree)
    sys.path.insert(0, os.path.join(tree, "tests"))  # an older tree kept its helpers here
    sys.path.insert(0, os.path.join(tree, "tests", "support"))
    sys.path.insert(0, HERE)
    warnings.simplefilter("ignore")

    from bench_common import write_json
    from manager_workers import state_at
    from s3_server import WeedServer, running

    import dcp_datastates
    from dcp_datastates.manager import CheckpointManager, CheckpointManagerOptions
    from dcp_datastates.manager.checkpoint_root import read_pointer
    from dcp_datastates.storage import open_store

    results = {"code": os.path.dirname(dcp_datastates.__file__)}
    scratch = tempfile.mkdtemp(prefix="tier_start-", dir="/dev/shm")
    with running(WeedServer(bucket="start", port=args.port)) as server:
        url, options = "s3://start/run", {"endpoint": server.endpoint}
        root = os.path.join(scratch, "run")
        opts = CheckpointManagerOptions(keep_last=args.local, durable=url, async_save=False, durable_options=options)
        with CheckpointManager(root, opts) as m:
            for step in range(1, args.steps + 1):
                m.save(step, state_at(step))
            m.wait_durable()

        def timed_starts(**kw) -> list[float]:
            out = []
            for _ in range(args.starts):
                t = time.perf_counter()
                m = CheckpointManager(root, CheckpointManagerOptions(keep_last=args.local, async_save=False, **kw))
                out.append(time.perf_counter() - t)
                m.close()
            return out

        tier = timed_starts(durable=url, durable_options=options)
        bare = timed_starts()
        results.update(start_with_tier_s=statistics.median(tier), start_without_tier_s=statistics.median(bare))
        store = open_store(url, **options)
        if hasattr(store, "replace_bytes"):
            blob = read_pointer(root).encode()
            puts = []
            for _ in range(args.puts):
                t = time.perf_counter()
                store.replace_bytes("latest", blob)
                puts.append(time.perf_counter() - t)
            results.update(pointer_put_s=statistics.median(puts), pointer_bytes=len(blob))
    print(f"code: {results['code']}")
    print(f"manager start, {args.local} local steps, {args.steps} durable on SeaweedFS: median "
          f"{results['start_with_tier_s'] * 1e3:.1f} ms (without a tier {results['start_without_tier_s'] * 1e3:.1f} ms), "
          f"{args.starts} starts each")
    if "pointer_put_s" in results:
        print(f"pointer mirror (one PUT of {results['pointer_bytes']} bytes): median "
              f"{results['pointer_put_s'] * 1e3:.2f} ms of {args.puts}")
    if args.json:
        write_json(args.json, {"args": vars(args), "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
