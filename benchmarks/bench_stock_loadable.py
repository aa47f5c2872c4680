"""What making our checkpoints loadable by stock DCP's FileSystemReader would cost.

Stock DCP's ``FileSystemReader`` loads an item by ``torch.load`` of the byte range its
``_StorageInfo`` names: every tensor item would have to be stored as a ``torch.save``
archive (a zip: ``data.pkl`` and a local header before the raw bytes, the remaining records
and the central directory after them), and ``.metadata`` would have to map every item's
``MetadataIndex`` to such a record. This measures, on one state, on tmpfs:

* ours: ``DataStatesWriter`` save time and bytes (median of ``--reps``);
* stock: ``FileSystemWriter(thread_count=2)`` save time and bytes (what stock-loadable costs
  done DCP's way, every item through ``torch.save``);
* the framing our writer would add: per tensor item, the bytes of its archive around the raw
  bytes (``torch.save`` with CRC-32 off: ``torch.load`` does not check it), with the data kept
  at its aligned offset (4 KiB for large tensors, 64 bytes for small ones), and the CPU time
  to make the frames (``torch.save`` of the same tensor on the meta device: the archive
  without its bytes);
* the metadata: pickling ``{MetadataIndex: _StorageInfo}`` for every item.

Two states: ``model`` (~300 MiB, ~100 bf16 tensors of a transformer) and ``small``
(``--small`` tensors of 1-4 KiB: the per-item costs).

    python benchmarks/bench_stock_loadable.py --dir /dev/shm/stockbench --json stock.json
"""

from __future__ import annotations

import argparse
import io
import os
import pickle
import shutil
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_common  # noqa: E402

PAGE, SMALL_ALIGN, SMALL_BYTES = 4096, 64, 64 * 1024


def model_state(layers: int, d: int, vocab: int) -> dict:
    import torch

    g = torch.Generator().manual_seed(0)

    def t(*shape):
        return torch.randn(*shape, generator=g).to(torch.bfloat16)

    state = {"embed": t(vocab, d)}
    for i in range(layers):
        state[f"layers.{i}"] = {
            "attn.qkv": t(3 * d, d), "attn.qkv_bias": t(3 * d), "attn.out": t(d, d),
            "mlp.up": t(4 * d, d), "mlp.up_bias": t(4 * d), "mlp.down": t(d, 4 * d),
            "norm1": t(d), "norm2": t(d),
        }
    return state


def small_state(n: int) -> dict:
    import torch

    g = torch.Generator().manual_seed(1)
    return {f"p{i}": torch.randn(256 * (1 + i % 4), generator=g) for i in range(n)}


def flat_tensors(state: dict, prefix: str = "") -> list:
    out = []
    for k, v in state.items():
        if isinstance(v, dict):
            out += flat_tensors(v, f"{prefix}{k}.")
        else:
            out.append((f"{prefix}{k}", v))
    return out


def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, n)) for n in os.listdir(path))


def timed_save(state: dict, path: str, writer) -> float:
    import torch.distributed.checkpoint as dcp

    t0 = time.perf_counter()
    dcp.save(state, storage_writer=writer, no_dist=True)
    return time.perf_counter() - t0


def framing(tensors: list) -> dict:
    """The frames a stock-loadable layout would put around every tensor's raw bytes: their sizes
    from a real ``torch.save`` of each tensor, and the CPU to make them from ``torch.save`` of
    the same tensor on the meta device (the archive without the bytes, which ours writes anyway)."""
    import torch

    torch.serialization.set_crc32_options(False)  # torch.load never checks it; computing it would cost a pass
    try:
        head_tail = []
        for _, t in tensors:
            blob = io.BytesIO()
            torch.save(t, blob)
            blob = blob.getvalue()
            start = blob.find(t.contiguous().view(torch.uint8).numpy().tobytes()[:64]) if t.nbytes else len(blob)
            head_tail.append((start, len(blob) - start - t.nbytes))
        metas = [torch.empty(t.shape, dtype=t.dtype, device="meta") for _, t in tensors]
        t0 = time.perf_counter()
        for m in metas:
            torch.save(m, io.BytesIO())
        frames_s = time.perf_counter() - t0
    finally:
        torch.serialization.set_crc32_options(True)
    # Placement: small tensors packed at 64 bytes, large at 4 KiB; a frame's raw bytes stay there.
    raw_end = framed_end = 0
    for (_, t), (head, tail) in sorted(zip(tensors, head_tail), key=lambda x: x[0][1].nbytes >= SMALL_BYTES):
        align = PAGE if t.nbytes >= SMALL_BYTES else SMALL_ALIGN
        raw_end = -(-raw_end // align) * align + t.nbytes
        framed_end = -(-(framed_end + head) // align) * align + t.nbytes + tail
    return {
        "frame_bytes": sum(h + t for h, t in head_tail),
        "extra_file_bytes": framed_end - raw_end,
        "frames_cpu_s": frames_s,
    }


def metadata_records(tensors: list) -> dict:
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import MetadataIndex

    records = {MetadataIndex(fqn, (0,) * t.dim()): _StorageInfo("rank00000-0123456789ab.data", i * PAGE, t.nbytes)
               for i, (fqn, t) in enumerate(tensors)}
    t0 = time.perf_counter()
    blob = pickle.dumps(records, protocol=pickle.HIGHEST_PROTOCOL)
    return {"metadata_bytes": len(blob), "metadata_pickle_s": time.perf_counter() - t0}


def run(name: str, state: dict, root: str, reps: int) -> dict:
    import torch.distributed.checkpoint as dcp

    from dcp_datastates import DataStatesWriter

    tensors = flat_tensors(state)
    out = {"state": name, "tensors": len(tensors), "tensor_bytes": sum(t.nbytes for _, t in tensors)}
    times = {"ours": [], "stock": []}
    sizes = {}
    for rep in range(reps):  # alternate the variants: tmpfs and the allocator warm up evenly
        for variant in ("ours", "stock"):
            path = os.path.join(root, f"{name}-{variant}-{rep}")
            writer = DataStatesWriter(path) if variant == "ours" else dcp.FileSystemWriter(path, thread_count=2)
            times[variant].append(timed_save(state, path, writer))
            sizes[variant] = dir_bytes(path)
            shutil.rmtree(path)
    for variant in times:
        out[f"{variant}_save_s"] = bench_common.median(times[variant])
        out[f"{variant}_bytes"] = sizes[variant]
    out.update(framing(tensors))
    out.update(metadata_records(tensors))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="/dev/shm/stock_loadable", help="scratch directory (tmpfs)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--d-model", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--small", type=int, default=20000, help="tensors of the small state")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    os.makedirs(args.dir, exist_ok=True)
    results = []
    for name, state in (("model", model_state(args.layers, args.d_model, args.vocab)), ("small", small_state(args.small))):
        r = run(name, state, args.dir, args.reps)
        results.append(r)
        mb = 1 << 20
        print(f"{name}: {r['tensors']} tensors, {r['tensor_bytes'] / mb:.1f} MiB")
        print(f"  ours  save {r['ours_save_s']:.3f} s, {r['ours_bytes'] / mb:.2f} MiB on disk")
        print(f"  stock save {r['stock_save_s']:.3f} s, {r['stock_bytes'] / mb:.2f} MiB on disk (FileSystemWriter, 2 threads)")
        print(f"  frames: {r['frame_bytes'] / mb:.2f} MiB of headers and trailers, +{r['extra_file_bytes'] / mb:.2f} MiB "
              f"in the data file ({100 * r['extra_file_bytes'] / max(1, r['ours_bytes']):.2f}%), "
              f"{r['frames_cpu_s']:.3f} s CPU to make them ({100 * r['frames_cpu_s'] / r['ours_save_s']:.1f}% of our save)")
        print(f"  metadata records: {r['metadata_bytes'] / mb:.2f} MiB pickled in {r['metadata_pickle_s']:.3f} s")
    shutil.rmtree(args.dir, ignore_errors=True)
    if args.json:
        bench_common.write_json(args.json, {"machine": bench_common.machine_info(), "results": results})


if __name__ == "__main__":
    main()
