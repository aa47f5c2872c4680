"""Compression: ratio and save/load speed on real weights and optimizer state.

The state is real, not random: the demo's GPT-like model (dcp_datastates.demo.model.TinyGPT,
made wider and deeper) trained for ``--steps`` AdamW steps on the demo's synthetic
token streams, saved as it would be in mixed-precision training: fp32 master weights,
a bf16 copy of them, and AdamW's fp32 ``exp_avg`` / ``exp_avg_sq``. The trained state
is cached in the scratch directory's parent (``--state-cache``) so that reruns skip
training.

Variants, each saved and loaded ``--reps`` times (medians reported), alternating:
ours raw, ours zstd level 1 and 3, DCP FileSystemWriter raw and with
``_extensions=[ZStandard()]`` (loads by its FileSystemReader). Run it on tmpfs
(``--dir /dev/shm/...``) so the software cost shows rather than the disk's.

    python benchmarks/bench_compression.py --dir /dev/shm/bench --json comp.json
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_common  # noqa: E402


def train_state(steps: int, d_model: int, layers: int, seed: int = 0) -> dict:
    import torch

    from dcp_datastates.demo.model import ModelConfig, TinyGPT, global_batch

    torch.manual_seed(seed)
    cfg = ModelConfig(vocab=512, seq_len=64, d_model=d_model, n_layers=layers, n_heads=max(1, d_model // 64))
    model = TinyGPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    t0 = time.perf_counter()
    for step in range(1, steps + 1):
        x, y = global_batch(seed, step, 8, cfg.seq_len, cfg.vocab)
        loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step % 50 == 0 or step == steps:
            print(f"  train step {step}/{steps} loss {loss.item():.3f} ({time.perf_counter() - t0:.0f} s)", flush=True)
    master = {k: v.detach().clone() for k, v in model.state_dict().items()}
    names = dict(enumerate(n for n, _ in model.named_parameters()))
    exp_avg = {names[i]: s["exp_avg"] for i, s in opt.state_dict()["state"].items()}
    exp_avg_sq = {names[i]: s["exp_avg_sq"] for i, s in opt.state_dict()["state"].items()}
    return {
        "master_fp32": master,
        "weights_bf16": {k: v.to(torch.bfloat16) for k, v in master.items()},
        "exp_avg_fp32": exp_avg,
        "exp_avg_sq_fp32": exp_avg_sq,
        "step": steps,
    }


def tensor_bytes(tree) -> int:
    import torch

    if isinstance(tree, torch.Tensor):
        return tree.numel() * tree.element_size()
    if isinstance(tree, dict):
        return sum(tensor_bytes(v) for v in tree.values())
    return 0


def stored_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if not f.startswith("."))


def zeros_like(tree):
    import torch

    if isinstance(tree, torch.Tensor):
        return torch.zeros_like(tree)
    if isinstance(tree, dict):
        return {k: zeros_like(v) for k, v in tree.items()}
    return tree


def same(a, b) -> bool:
    import torch

    if isinstance(a, torch.Tensor):
        return torch.equal(a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8))
    if isinstance(a, dict):
        return all(same(a[k], b[k]) for k in a)
    return a == b


def variants():
    import torch.distributed.checkpoint as dcp
    from dcp_datastates._dcp_compat import zstandard_extension_class

    ZStandard = zstandard_extension_class()  # DCP's experimental extension, private in DCP

    from dcp_datastates import DataStatesReader, DataStatesWriter

    ours = lambda p: DataStatesReader(p)  # noqa: E731
    stock = lambda p: dcp.FileSystemReader(p)  # noqa: E731
    # name -> (writer, reader, saved with dcp.async_save)
    return {
        "ours raw": (lambda p: DataStatesWriter(p), ours, False),
        "ours zstd-1": (lambda p: DataStatesWriter(p, compression="zstd", compression_level=1), ours, False),
        "ours zstd-3": (lambda p: DataStatesWriter(p, compression="zstd", compression_level=3), ours, False),
        "DCP raw": (lambda p: dcp.FileSystemWriter(p, thread_count=2), stock, False),
        "DCP ZStandard": (lambda p: dcp.FileSystemWriter(p, thread_count=2, _extensions=[ZStandard()]), stock, False),
        "ours raw async": (lambda p: DataStatesWriter(p), ours, True),
        "ours zstd-1 async": (lambda p: DataStatesWriter(p, compression="zstd", compression_level=1), ours, True),
        "DCP ZStd async": (lambda p: dcp.FileSystemWriter(p, thread_count=2, _extensions=[ZStandard()]), stock, True),
    }


def group_ratios(path: str, state: dict) -> dict:
    """Per part of the state (ours, compressed): raw bytes / stored bytes."""
    from dcp_datastates.tools.checkpoint_view import CheckpointView

    view = CheckpointView(path)
    out = {}
    for group in ("master_fp32", "weights_bf16", "exp_avg_fp32", "exp_avg_sq_fp32"):
        raw = stored = 0
        for fqn in view.tensors:
            if fqn.startswith(group + "."):
                raw += view.nbytes(fqn)
                stored += sum(c.length for c in view.stored_chunks(fqn))
        out[group] = raw / stored if stored else None
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bench_common.add_common_args(ap, "a small model, 30 steps, 1 repetition")
    ap.add_argument("--steps", type=int, default=300, help="AdamW steps to train (default 300)")
    ap.add_argument("--d-model", type=int, default=384)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--state-cache", default=None, help="torch.save the trained state here and reuse it")
    args = ap.parse_args()
    if args.quick:
        args.steps, args.d_model, args.layers = 30, 128, 2
    reps = args.reps or (1 if args.quick else 3)

    import torch
    import torch.distributed.checkpoint as dcp

    torch.set_num_threads(2)
    base, root, created = bench_common.make_scratch(args.dir, "comp-")
    try:
        cache = args.state_cache
        if cache and os.path.exists(cache):
            state = torch.load(cache, weights_only=True)
            print(f"state from {cache}")
        else:
            print(f"training: d_model {args.d_model}, {args.layers} layers, {args.steps} AdamW steps")
            state = train_state(args.steps, args.d_model, args.layers)
            if cache:
                torch.save(state, cache)
        raw = tensor_bytes(state)
        print(f"state: {raw / 1e6:.1f} MB of tensors ({sum(1 for _ in state['master_fp32'])} parameters per copy)")
        results = {name: {"save_s": [], "blocked_s": [], "load_s": [], "stored": None, "exact": True} for name in variants()}
        for rep in range(reps):
            for name, (make_writer, make_reader, asynchronous) in variants().items():
                path = os.path.join(root, f"{name.replace(' ', '_')}-{rep}")
                writer = make_writer(path)
                t0 = time.perf_counter()
                if asynchronous:  # save_s: until committed; blocked_s: the time async_save held the caller
                    resp = dcp.async_save(state, storage_writer=writer, checkpoint_id=path, no_dist=True)
                    results[name]["blocked_s"].append(time.perf_counter() - t0)
                    getattr(resp, "upload_completion", resp).result()
                else:
                    dcp.save(state, storage_writer=writer, no_dist=True)
                t1 = time.perf_counter()
                if hasattr(writer, "close"):
                    writer.close()
                target = zeros_like(state)
                t2 = time.perf_counter()
                dcp.load(target, storage_reader=make_reader(path), no_dist=True)
                t3 = time.perf_counter()
                r = results[name]
                r["save_s"].append(t1 - t0)
                r["load_s"].append(t3 - t2)
                r["stored"] = stored_bytes(path)
                r["exact"] = r["exact"] and same(state, target)
                if name == "ours zstd-3" and rep == 0:
                    r["groups"] = group_ratios(path, state)
                del target
                bench_common.remove(path)
        print(f"\n{'variant':<18} {'stored MB':>10} {'ratio':>6} {'save s':>7} {'save GB/s':>9} {'blocked s':>9} "
              f"{'load s':>7} {'load GB/s':>9} exact")
        for name, r in results.items():
            save_s, load_s = bench_common.median(r["save_s"]), bench_common.median(r["load_s"])
            blocked = bench_common.median(r["blocked_s"]) if r["blocked_s"] else None
            r.update(save_median_s=save_s, load_median_s=load_s, blocked_median_s=blocked, ratio=raw / r["stored"])
            shown = f"{blocked:>9.3f}" if blocked is not None else f"{'-':>9}"
            print(f"{name:<18} {r['stored'] / 1e6:>10.1f} {raw / r['stored']:>6.3f} {save_s:>7.3f} "
                  f"{raw / save_s / 1e9:>9.2f} {shown} {load_s:>7.3f} {raw / load_s / 1e9:>9.2f} {r['exact']}")
        groups = results["ours zstd-3"].get("groups") or {}
        print("\nratio per part (ours, zstd level 3): " + ", ".join(f"{k} {v:.3f}" for k, v in groups.items() if v))
        if args.json:
            bench_common.write_json(args.json, {"machine": bench_common.machine_info(root), "raw_bytes": raw,
                                                "reps": reps, "results": results, "args": vars(args)})
        return 0 if all(r["exact"] for r in results.values()) else 1
    finally:
        bench_common.remove_scratch(base, root, created)


if __name__ == "__main__":
    sys.exit(main())
