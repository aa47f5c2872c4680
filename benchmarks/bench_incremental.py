#!/usr/bin/env python
"""Incremental checkpoints (issue 17): bytes written and time per checkpoint when most of the
state is frozen, against a full save and DCP's writer, and the cost when nothing is frozen.

    python benchmarks/bench_incremental.py [--dir DIR] [--layers N] [--frozen 0.95] [--reps N] [--json OUT]

The state has the shapes of a 1B-parameter decoder (hidden 2048, MLP 8192, vocabulary 32000,
fp32), with ``--layers`` of its 20 layers (memory: 4 layers are 1.1 GB). A fine-tuning run
freezes most of it: ``--frozen`` of the bytes (the embedding and the first layers' matrices)
never change; every other tensor changes in place (``add_``) before every checkpoint, as an
optimizer step would change it. For each variant, ``--reps`` checkpoints are taken one after
the other into fresh directories of ``--dir`` (tmpfs by default: the software's cost without the
disk; pass a disk directory to see the disk), and the medians reported:

* ``dcp``: DCP's FileSystemWriter (``dcp.save``), a full checkpoint every time;
* ``full``: ``DataStatesWriter`` without a base (what a checkpoint costs without this feature);
* ``incremental``: ``DataStatesWriter(base=<the previous checkpoint>, change_tracker=...)``, as
  ``CheckpointManager`` saves: the tensors whose counters moved are written without hashing,
  the frozen ones hashed (XXH3-128) and referred to;
* ``incremental, no tracker``: the same without version counters: every large chunk is hashed;
* ``manager async``: ``CheckpointManager`` (async, incremental): the time ``save()`` blocks, and
  from ``save()`` to the commit; ``manager async full`` the same with ``incremental=False``.

Targets (issue 17): bytes written at most 1.1x the changed bytes, time at most 0.2x a full save
with 95% frozen; with nothing frozen, the incremental save under 5% slower than a full one.
Every incremental checkpoint is loaded back and compared bit for bit at the end.
"""

from __future__ import annotations

import argparse
import os
import shutil
import time
import warnings

import torch
import torch.distributed.checkpoint as dcp

from bench_common import add_common_args, machine_info, make_scratch, median, remove_scratch, write_json

warnings.filterwarnings("ignore", message="torch.distributed is disabled")

HIDDEN, MLP, VOCAB = 2048, 8192, 32000


def model_state(layers: int) -> dict:
    """A decoder's parameters in the shapes of a 1B model (``layers`` of them), deterministic."""
    g = torch.Generator().manual_seed(0)
    state = {"embed.weight": torch.randn(VOCAB, HIDDEN, generator=g)}
    for i in range(layers):
        p = f"layers.{i}."
        for name in ("q", "k", "v", "o"):
            state[p + f"attn.{name}.weight"] = torch.randn(HIDDEN, HIDDEN, generator=g)
        state[p + "mlp.up.weight"] = torch.randn(MLP, HIDDEN, generator=g)
        state[p + "mlp.down.weight"] = torch.randn(HIDDEN, MLP, generator=g)
        state[p + "norm1.weight"] = torch.ones(HIDDEN)
        state[p + "norm2.weight"] = torch.ones(HIDDEN)
    state["norm.weight"] = torch.ones(HIDDEN)
    return state


def split_frozen(state: dict, frozen: float) -> list[str]:
    """The keys that change before every checkpoint: the last ones (the top layers, the norms)
    whose bytes add up to ``1 - frozen`` of the total (at least one tensor when ``frozen < 1``)."""
    total = sum(t.nbytes for t in state.values())
    changing, nbytes = [], 0
    for key in reversed(list(state)):
        if nbytes >= (1 - frozen) * total:
            break
        changing.append(key)
        nbytes += state[key].nbytes
    return changing


def step(state: dict, changing: list[str], k: int) -> None:
    for key in changing:
        state[key].add_(1e-3 * k)


def own_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, n)) for n in os.listdir(path) if n.endswith((".data", ".distcp")))


class Chain:
    """One variant's checkpoints, taken one after the other: each incremental one against the
    previous; only the chain's first (full) checkpoint and the newest are kept on disk (the
    frozen chunks are referred to in the first, nothing refers to the ones between)."""

    def __init__(self, name: str, root: str) -> None:
        from dcp_datastates.core.incremental import ChangeTracker

        self.name, self.root = name, root
        self.tracker = ChangeTracker()
        self.paths: list[str] = []
        self.times: list[float] = []
        self.written: list[int] = []

    def save(self, state: dict, k: int, timed: bool) -> None:
        from dcp_datastates import DataStatesWriter

        path = os.path.join(self.root, f"{self.name.replace(' ', '_').replace(',', '')}_{k}")
        base = self.paths[-1] if self.paths else None
        if self.name == "dcp":
            writer = dcp.FileSystemWriter(path, thread_count=2)
        elif self.name == "full":
            writer = DataStatesWriter(path)
        elif self.name == "incremental":
            writer = DataStatesWriter(path, base=base, record_digests=True, change_tracker=self.tracker)
        else:  # incremental, no tracker
            writer = DataStatesWriter(path, base=base, record_digests=True)
        t = time.perf_counter()
        dcp.save(state, storage_writer=writer, no_dist=True)
        elapsed = time.perf_counter() - t
        if timed:
            self.times.append(elapsed)
            self.written.append(own_bytes(path))
        self.paths.append(path)
        keep_first = self.name.startswith("incremental")
        if len(self.paths) > (2 if keep_first else 1):
            shutil.rmtree(self.paths[-2], ignore_errors=True)
            if keep_first and len(self.paths) > 2:
                self.paths.pop(-2)
            elif not keep_first:
                self.paths.pop(0)

    def result(self) -> dict:
        return {"s": median(self.times), "times": self.times, "bytes": median(self.written), "last": self.paths[-1]}


class ManagerChain:
    """``CheckpointManager``'s asynchronous incremental saves: blocked in save(), and until committed."""

    def __init__(self, root: str, reps: int, incremental: bool) -> None:
        from dcp_datastates import CheckpointManager, CheckpointManagerOptions

        self.mgr = CheckpointManager(
            os.path.join(root, "mgr" if incremental else "mgr_full"),
            CheckpointManagerOptions(keep_last=1, async_save=True, full_every=reps + 2, incremental=incremental),
        )
        self.blocked: list[float] = []
        self.times: list[float] = []

    def save(self, state: dict, k: int, timed: bool) -> None:
        t = time.perf_counter()
        fut = self.mgr.save(k, state)
        t_blocked = time.perf_counter() - t
        fut.result()
        if timed:
            self.blocked.append(t_blocked)
            self.times.append(time.perf_counter() - t)
        self.last = self.mgr.path_of(k)

    def result(self) -> dict:
        self.mgr.close()
        return {"blocked_s": median(self.blocked), "s": median(self.times), "times": self.times,
                "bytes": own_bytes(self.last), "last": self.last}


def check_bit_exact(path: str, state: dict) -> None:
    from dcp_datastates import DataStatesReader

    target = {k: torch.empty_like(v) for k, v in state.items()}
    ours = os.path.basename(path).startswith(("full", "incremental")) or "mgr" in path
    reader = DataStatesReader(path) if ours else dcp.FileSystemReader(path)
    dcp.load(target, storage_reader=reader, no_dist=True)
    bad = [k for k in state if not torch.equal(target[k], state[k])]
    if bad:
        raise SystemExit(f"{path} does not load bit-exactly: {bad[:5]}")


def scenario(root: str, layers: int, frozen: float, reps: int, variants: list[str]) -> dict:
    """Every variant takes its checkpoints in turn (rep by rep, in rotating order), so that a
    drift of the machine during the run touches them all alike."""
    root = os.path.join(root, f"frozen_{round(frozen * 100)}")
    os.makedirs(root)
    state = model_state(layers)
    changing = split_frozen(state, frozen)
    total = sum(t.nbytes for t in state.values())
    changed = sum(state[k].nbytes for k in changing)
    chains = {
        name: ManagerChain(root, reps, name == "manager async") if name.startswith("manager") else Chain(name, root)
        for name in variants
    }
    for k in range(reps + 1):  # the first is the full save every chain starts from (not timed)
        step(state, changing, k + 1)
        order = variants[k % len(variants):] + variants[: k % len(variants)]
        for name in order:
            chains[name].save(state, k, timed=k > 0)
    out = {"frozen": frozen, "state_bytes": total, "changed_bytes": changed, "variants": {}}
    for name in variants:
        result = chains[name].result()
        check_bit_exact(result.pop("last"), state)
        out["variants"][name] = result
    shutil.rmtree(root, ignore_errors=True)
    return out


def report(result: dict) -> None:
    v = result["variants"]
    full_s = v["full"]["s"]
    print(
        f"\n{result['frozen']:.0%} frozen: state {result['state_bytes'] / 2**30:.2f} GiB, "
        f"changed per checkpoint {result['changed_bytes'] / 2**20:.0f} MiB"
    )
    print(f"{'variant':<26}{'seconds':>9}{'x full':>8}{'x dcp':>8}{'MiB written':>13}{'x changed':>11}")
    for name, r in v.items():
        mib = r["bytes"] / 2**20
        print(
            f"{name:<26}{r['s']:>9.3f}{r['s'] / full_s:>8.3f}{r['s'] / v['dcp']['s']:>8.3f}"
            f"{mib:>13.1f}{r['bytes'] / max(1, result['changed_bytes']):>11.3f}"
            + (f"   (save() blocked {r['blocked_s'] * 1e3:.1f} ms)" if "blocked_s" in r else "")
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(ap, "2 layers, 2 repetitions")
    ap.add_argument("--layers", type=int, default=4, help="decoder layers of the 20 a 1B model has (default 4)")
    ap.add_argument("--frozen", type=float, default=0.95, help="fraction of the bytes that never change")
    args = ap.parse_args()
    reps = args.reps or (2 if args.quick else 3)
    layers = 2 if args.quick else args.layers
    base, root, created = make_scratch(args.dir or "/dev/shm", "bench_incremental_")
    variants = ["dcp", "full", "incremental", "incremental, no tracker", "manager async full", "manager async"]
    try:
        results = [
            scenario(root, layers, args.frozen, reps, variants),
            scenario(root, layers, 0.0, reps, ["dcp", "full", "incremental", "incremental, no tracker",
                                               "manager async full", "manager async"]),
        ]
    finally:
        remove_scratch(base, root, created)
    for r in results:
        report(r)
    if args.json:
        write_json(args.json, {"machine": machine_info(base), "layers": layers, "reps": reps, "results": results})


if __name__ == "__main__":
    main()
