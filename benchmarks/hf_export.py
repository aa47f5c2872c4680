"""Exporting a training checkpoint for Hugging Face: ours against DCP's ``HuggingFaceStorageWriter``.

The state is a GPT-2 (124M parameters by default, about 500 MB in fp32) after
one AdamW step, saved as ``{"model": ..., "optim": ...}`` with DataStatesWriter
on /dev/shm (tmpfs: software cost, not the disk, decides). Each variant runs
in a fresh child process, alternating, and reports its wall time and peak RSS
above its RSS right after its imports (transformers' model code included: importing
it takes seconds on this machine, the same for both):

* ``ours``: ``export_to_huggingface(ckpt, out, config_dir=...)`` (the model
  part, tied weights once, ``config.json`` written), streamed block by block;
* ``dcp``: what DCP offers for the same result: ``dcp.load`` of the model part
  into a model's state dict (DataStatesReader), the tied weight dropped, then
  ``dcp.save`` through ``HuggingFaceStorageWriter(save_distributed=True,
  enable_consolidation=True)``, which writes per-rank shards under
  ``out/sharded`` and consolidates them into ``out`` (``consolidate_safetensors_files``).
  Its load and save times are also given apart (the save alone is what a
  trainer holding the model in memory would pay).

Both outputs are checked to hold the same tensors, bit for bit.

    python benchmarks/hf_export.py                  # GPT-2 124M, 3 rounds
    python benchmarks/hf_export.py --quick          # 2 layers, 1 round
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap

CHILD = textwrap.dedent(
    """
    import json, os, sys, time
    import torch
    import transformers
    from dcp_datastates.integrations.huggingface import export_to_huggingface
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    from dcp_datastates import DataStatesReader
    from transformers import GPT2LMHeadModel, modeling_utils  # import costs (seconds) out of both timings
    variant, ckpt, config_dir, out = sys.argv[1:5]

    def status_kib(field):  # VmHWM: this process's peak (ru_maxrss would carry the parent's over exec)
        with open("/proc/self/status") as f:
            return next(int(l.split()[1]) for l in f if l.startswith(field + ":"))

    base = status_kib("VmRSS")
    t0 = time.perf_counter()
    times = {}
    if variant == "ours":
        export_to_huggingface(ckpt, out, config_dir=config_dir)
    else:
        config = transformers.AutoConfig.from_pretrained(config_dir)
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config)
        model = model.to_empty(device="cpu")
        state = model.state_dict()
        state.pop("lm_head.weight", None)  # tied: stored once, as save_pretrained does
        dcp.load({"model": state}, storage_reader=DataStatesReader(ckpt), no_dist=True)
        times["load_s"] = time.perf_counter() - t0
        t1 = time.perf_counter()
        writer = HuggingFaceStorageWriter(out, save_distributed=True, enable_consolidation=True)
        dcp.save(state, storage_writer=writer, no_dist=True)
        times["save_s"] = time.perf_counter() - t1
    times["total_s"] = time.perf_counter() - t0
    peak = status_kib("VmHWM")
    print(json.dumps({**times, "peak_above_imports_mib": (peak - base) / 1024}))
    """
)


def make_checkpoint(root: str, layers: int) -> tuple[str, str, int]:
    """The trained GPT-2's checkpoint and config directory; returns them and the model's bytes."""
    import torch
    import torch.distributed.checkpoint as dcp
    import transformers

    from dcp_datastates import DataStatesWriter

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=layers, bos_token_id=0, eos_token_id=0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(0, config.vocab_size, (1, 16))
    model(tokens, labels=tokens).loss.backward()
    optim.step()
    ckpt, config_dir = os.path.join(root, "ckpt"), os.path.join(root, "config")
    dcp.save({"model": model.state_dict(), "optim": optim.state_dict()}, storage_writer=DataStatesWriter(ckpt))
    config.save_pretrained(config_dir)
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return ckpt, config_dir, nbytes


def run_child(variant: str, ckpt: str, config_dir: str, out: str) -> dict:
    res = subprocess.run([sys.executable, "-c", CHILD, variant, ckpt, config_dir, out],
                         capture_output=True, text=True, check=False)
    if res.returncode != 0:
        raise RuntimeError(f"{variant} failed:\n{res.stderr[-4000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def same_tensors(a: str, b: str) -> None:
    """The two outputs hold the same tensors, bit for bit."""
    import torch
    from safetensors import safe_open

    def tensors(d):
        out = {}
        for name in sorted(os.listdir(d)):
            if name.endswith(".safetensors"):
                with safe_open(os.path.join(d, name), "pt") as f:
                    out.update({k: f.get_tensor(k) for k in f.keys()})
        return out

    ta, tb = tensors(a), tensors(b)
    assert set(ta) == set(tb), set(ta) ^ set(tb)
    for k in ta:
        assert ta[k].dtype == tb[k].dtype and torch.equal(ta[k], tb[k]), k


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default="/dev/shm", help="scratch directory (default /dev/shm)")
    ap.add_argument("--layers", type=int, default=12, help="GPT-2 layers (default 12: 124M parameters)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="2 layers, 1 round")
    args = ap.parse_args()
    if args.quick:
        args.layers, args.rounds = 2, 1
    root = tempfile.mkdtemp(prefix="hf_export_", dir=args.dir)
    try:
        ckpt, config_dir, nbytes = make_checkpoint(root, args.layers)
        results: dict[str, list[dict]] = {"ours": [], "dcp": []}
        for r in range(args.rounds):
            for variant in (("ours", "dcp") if r % 2 == 0 else ("dcp", "ours")):
                out = os.path.join(root, f"out_{variant}")
                shutil.rmtree(out, ignore_errors=True)
                results[variant].append(run_child(variant, ckpt, config_dir, out))
        same_tensors(os.path.join(root, "out_ours"), os.path.join(root, "out_dcp"))
        print(f"GPT-2 {args.layers} layers, model {nbytes / 2**20:.0f} MiB (fp32), checkpoint on {args.dir}, "
              f"{args.rounds} rounds, medians; outputs equal bit for bit")
        for variant, runs in results.items():
            fields = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
            print(f"  {variant:5s} " + "  ".join(f"{k} {v:.2f}" for k, v in fields.items())
                  + f"  ({nbytes / 2**30 / fields['total_s']:.2f} GiB/s)")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
