"""The command-line tool on a checkpoint bigger than its memory budget: time and peak memory.

Each command runs in a fresh child process (``dcp_datastates.tools.cli.main``), with
the checkpoint's files evicted from the page cache first, so every figure is
a cold run. Per command it reports wall time, GB/s of checkpoint bytes, the
ratio of that time to the raw disk's time for the same bytes measured in this
run (cold O_DIRECT read of the source plus O_DIRECT write of the output, where
there is an output), and the child's peak RSS growth over its RSS right
before the command (so the torch import is not counted). The baselines are
what people use without us, in the same run and the same way:

* ``dcp_to_torch_save`` (torch.distributed.checkpoint.format_utils): DCP's own
  conversion of a stock DCP checkpoint to a torch.save file (loads it all);
* ``safetensors.save_file`` of the whole state loaded with ``dcp.load``.

    python benchmarks/bench_tools.py --dir /work/bench_tmp            # 1 GiB state, 2 reps
    python benchmarks/bench_tools.py --quick --dir /work/bench_tmp    # 256 MiB, 1 rep
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import textwrap

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from bench_common import (  # noqa: E402
    add_common_args, drop_tree, fmt, machine_info, make_scratch, median, remove, remove_scratch, write_json,
)

BLOCK = 8 << 20

# The child: baseline RSS after imports, run the command, report time and peak RSS growth.
CHILD = textwrap.dedent(
    """
    import importlib, json, os, pkgutil, sys, time
    import torch, dcp_datastates, dcp_datastates.tools.cli as cli, dcp_datastates.tools.commands as commands
    # Everything a command imports, before the clock: the figure is the command's work (the package
    # loads its names and the commands their modules on first use).
    [getattr(dcp_datastates, name) for name in dcp_datastates.__all__]
    [importlib.import_module(f"{commands.__name__}.{m.name}") for m in pkgutil.iter_modules(commands.__path__)]
    def hwm():
        with open("/proc/self/status") as f:
            for ln in f:
                if ln.startswith("VmHWM:"):
                    return int(ln.split()[1]) * 1024
    def rss():
        with open("/proc/self/status") as f:
            for ln in f:
                if ln.startswith("VmRSS:"):
                    return int(ln.split()[1]) * 1024
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak to the current RSS
    kind, payload = sys.argv[1], json.loads(sys.argv[2])
    base = rss()
    t0 = time.perf_counter()
    if kind == "cli":
        code = cli.main(payload)
    else:
        exec(payload)
        code = 0
    dt = time.perf_counter() - t0
    print(json.dumps({"code": code, "seconds": dt, "peak_growth": hwm() - base}))
    """
)


def make_state(total_bytes: int):
    """64 tensors (fp32 and bf16) of equal bytes: a model-like mix, large enough to stream."""
    import torch

    g = torch.Generator().manual_seed(0)
    n = 64
    each = total_bytes // n
    state = {}
    for i in range(n):
        dtype = torch.bfloat16 if i % 4 == 3 else torch.float32
        cols = 1024
        rows = max(1, each // (cols * dtype.itemsize))
        state[f"layers.{i // 4}.p{i % 4}"] = torch.randn(rows, cols, generator=g).to(dtype)
    return {"model": state, "step": 100}


def tree_bytes(path: str) -> int:
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(r, f)) for r, _d, fs in os.walk(path) for f in fs)


def run_child(kind: str, payload) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, kind, json.dumps(payload)], capture_output=True, text=True, timeout=3600
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{kind} {payload!r} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    rec = json.loads(proc.stdout.strip().splitlines()[-1])
    if rec["code"] != 0:
        raise RuntimeError(f"{payload!r} exited {rec['code']}:\n{proc.stderr[-3000:]}")
    return rec


def raw_seconds(root: str, nbytes: int) -> tuple[float, float]:
    """(O_DIRECT write s, cold read s) for ``nbytes`` on this disk, now."""
    from dcp_datastates import _probes

    path = os.path.join(root, "raw.bin")
    w = _probes.probe_sequential_write(path, nbytes, BLOCK, True)
    drop_tree(path)
    _n, r = _probes.probe_sequential_read(path, BLOCK)
    remove(path)
    return w, r


def commands(src: str, stock: str, out: str) -> list[tuple[str, str, object, str, bool]]:
    """(name, kind, payload, source dir, writes an output)."""
    return [
        ("verify", "cli", ["verify", "--quiet", src], src, False),
        ("inspect", "cli", ["inspect", src], src, False),
        ("convert --to safetensors", "cli", ["convert", src, "--to", "safetensors", out, "--quiet"], src, True),
        ("  baseline: dcp.load + safetensors.save_file", "py", textwrap.dedent(f"""
            import torch.distributed.checkpoint as dcp
            from dcp_datastates.tools.checkpoint_view import CheckpointView
            from dcp_datastates import DataStatesReader
            import safetensors.torch as st
            v = CheckpointView({src!r})
            sd = {{k: torch.empty(tuple(m.size), dtype=m.properties.dtype) for k, m in v.tensors.items()}}
            dcp.load(sd, storage_reader=DataStatesReader({src!r}), no_dist=True)
            os.makedirs({out!r})
            st.save_file(sd, os.path.join({out!r}, "model.safetensors"))
            fd = os.open(os.path.join({out!r}, "model.safetensors"), os.O_RDONLY); os.fsync(fd); os.close(fd)
            """), src, True),
        ("convert --to torch", "cli", ["convert", src, "--to", "torch", out + ".pt", "--quiet"], src, True),
        ("  baseline: dcp_to_torch_save (stock DCP source)", "py", textwrap.dedent(f"""
            from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
            dcp_to_torch_save({stock!r}, {out + '.pt'!r})
            fd = os.open({out + '.pt'!r}, os.O_RDONLY); os.fsync(fd); os.close(fd)
            """), stock, True),
        ("convert --to dcp", "cli", ["convert", src, "--to", "dcp", out, "--quiet"], src, True),
        ("convert stock DCP --to datastates", "cli", ["convert", stock, "--to", "datastates", out, "--quiet"], stock, True),
        ("export --format hdf5", "cli", ["export", src, "--format", "hdf5", "--out", out + ".h5", "--quiet"], src, True),
        ("export --format zarr", "cli", ["export", src, "--format", "zarr", "--out", out + ".zarr", "--quiet"], src, True),
        ("diff (A vs itself)", "cli", ["diff", src, src, "--quiet"], src, False),
    ]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(ap, "256 MiB state, 1 repetition", "repetitions (default 2, --quick 1)")
    ap.add_argument("--mib", type=int, default=None, help="state size in MiB (default 1024, --quick 256)")
    args = ap.parse_args(argv)
    reps = args.reps or (1 if args.quick else 2)
    mib = args.mib or (256 if args.quick else 1024)

    import torch.distributed.checkpoint as dcp

    from dcp_datastates import DataStatesWriter

    base, root, created = make_scratch(args.dir, "tools-")
    try:
        state = make_state(mib << 20)
        src, stock = os.path.join(root, "ours"), os.path.join(root, "stock")
        dcp.save(state, storage_writer=DataStatesWriter(src), no_dist=True)
        dcp.save(state, storage_writer=dcp.FileSystemWriter(stock), no_dist=True)
        del state
        nbytes = tree_bytes(src)
        print(f"checkpoint: {nbytes / 2**20:.0f} MiB in 64 tensors ({src}); {reps} rep(s), medians; "
              f"each command in a fresh process, page cache dropped first")
        results: dict[str, list] = {}
        raw = []
        for rep in range(reps):
            raw.append(raw_seconds(root, nbytes))
            for name, kind, payload, source, writes in commands(src, stock, os.path.join(root, "out")):
                drop_tree(source)
                rec = run_child(kind, payload)
                outs = [p for p in (os.path.join(root, s) for s in ("out", "out.pt", "out.h5", "out.zarr"))
                        if os.path.exists(p)]
                rec["out_bytes"] = sum(tree_bytes(p) for p in outs)
                for p in outs:
                    remove(p)
                results.setdefault(name, []).append(rec)
        w_s = median([r[0] for r in raw])
        r_s = median([r[1] for r in raw])
        print(f"raw disk, same run: O_DIRECT write {nbytes / w_s / 1e9:.2f} GB/s, cold read {nbytes / r_s / 1e9:.2f} GB/s")
        print(f"\n{'command':<48} {'time s':>8} {'GB/s':>7} {'x raw':>7} {'peak RSS +MiB':>14}")
        report = {"machine": machine_info(root), "bytes": nbytes, "raw_write_s": w_s, "raw_read_s": r_s, "commands": {}}
        for name, kind, payload, source, writes in commands(src, stock, os.path.join(root, "out")):
            recs = results[name]
            t = median([r["seconds"] for r in recs])
            grow = max(r["peak_growth"] for r in recs) / 2**20
            ideal = r_s + (w_s if writes else 0.0)
            print(f"{name:<48} {fmt(t, '.2f')} {fmt(nbytes / t / 1e9, '.2f', 7)} {fmt(t / ideal, '.2f', 7)} "
                  f"{fmt(grow, '.0f', 14)}")
            report["commands"][name] = {"seconds": t, "x_raw": t / ideal, "peak_rss_growth_mib": grow, "reps": recs}
        print("\nx raw = time / (cold read of the checkpoint + O_DIRECT write of as many bytes, when the command "
              "writes), both measured above; 1.0 is the disk's limit")
        if args.json:
            write_json(args.json, report)
    finally:
        remove_scratch(base, root, created)
    return 0


if __name__ == "__main__":
    sys.exit(main())
