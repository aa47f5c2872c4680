#!/usr/bin/env python
"""Scaling with the number of ranks: ours (DataStatesWriter/Reader with DataStatesSavePlanner)
against DCP (FileSystemWriter/Reader with DefaultSavePlanner), measured in the same run.

    python benchmarks/bench_scaling.py [--part ranks|plan|both] [--quick] [--json OUT]

Part ``ranks``: real saves and loads by W gloo processes on this machine
  For W in --ranks (default 2,4,8,16), W processes are spawned (MASTER_ADDR
  127.0.0.1, gloo, DeviceMesh("cpu", range(W))). Each holds its Shard(0)
  pieces of a transformer-like state whose global size stays fixed
  (--global-mib, default 512; --quick 64): every parameter and its two Adam
  moments are DTensors sharded on dim 0, plus a few small replicated plain
  tensors (the optimizer's steps, a norm) and a BYTES object (a config dict).
  Each repetition saves with ours and with DCP, alternating which goes first,
  into a fresh directory under --dir (default /dev/shm), then loads each back
  into preallocated DTensors (same W) and checks them bit-exact (untimed).
  Thread counts: --threads T (default 1) is passed as DataStatesWriter(
  io_threads=T) and FileSystemWriter(thread_count=T) (their one knob for
  parallel file writes per rank); the readers use their defaults.
  Measured: wall time of dcp.save / dcp.load (each rank times its own call
  after a barrier; the figure is the max over ranks, median over --reps),
  the .metadata size, the number of files in the checkpoint directory, and
  the collectives per save and per load: every call a rank makes of
  torch.distributed's collective functions (broadcast_object_list,
  gather_object, all_gather_object, scatter_object_list, all_reduce,
  all_gather, broadcast, barrier, reduce_scatter, ...) during the call, counted by
  wrapping those functions in each process (DCP's _DistWrapper reaches them as
  attributes of torch.distributed; the calls they make inside c10d are not
  counted). The figure is rank 0's count.
  With more ranks than cores (this machine may have 2) the processes share
  the CPUs: the figures then measure software overhead and coordination,
  not bandwidth; the output says so.

Part ``plan``: the coordinator's planning step and the .metadata, without processes
  Synthetic local plans of --plan-ranks ranks (default 256,1024,8192; --quick
  64,256,1024), each holding its Shard(0) chunk of every tensor of an FSDP2-like
  model (--layers blocks of 6 parameters, plus embedding, norm and output;
  each parameter with two Adam moments) and the replicated items every rank
  plans (each parameter's optimizer step, a BYTES object): the plans DCP's
  planner makes for such a state (DTensor items with offsets, one
  TensorProperties object per item, as after the gather that brings plans to
  the coordinator). Both coordinators get the same plans:
    DCP   DefaultSavePlanner.create_global_plan (dedup, metadata, validation),
          FileSystemWriter.prepare_global_plan, and FileSystemWriter.finish's
          work before the write: the storage data from every rank's write
          results (one _StorageInfo per item) and pickle.dumps(metadata);
          decode: pickle.loads (FileSystemReader.read_metadata)
    ours  DataStatesSavePlanner.create_global_plan, the placement rule sent with
          the plans (DataStatesWriter.prepare_global_plan), the predicted
          layout (coordinator_layout.predict_layout, every rank placed) and
          encode_metadata (what the coordinator does in write_data), and
          finish's check of the prediction against the ranks' reports;
          decode: metadata_file.decode_metadata (the reader's path, record and
          layout validation)
  The ranks' own work (their write results) is built untimed. Reported:
  seconds (best of --plan-reps), peak traced memory (tracemalloc, a separate
  untimed run), bytes of the .metadata, and items per second.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import math
import os
import pickle
import sys
import time
import tracemalloc
import warnings

warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")

import torch  # noqa: E402
from torch.distributed.checkpoint.metadata import (  # noqa: E402
    ChunkStorageMetadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType  # noqa: E402
from torch.distributed.checkpoint.storage import WriteResult  # noqa: E402

from bench_common import fmt, machine_info, write_json  # noqa: E402
from dcp_datastates.native.gc_pause import gc_paused  # noqa: E402

MiB = 1 << 20


# ---------------------------------------------------------------- the model's tensors


def model_tensors(layers: int, d: int, vocab: int) -> list[tuple[str, tuple, torch.dtype]]:
    """``(fqn, global shape, dtype)`` of an FSDP2-like transformer's parameters."""
    out = [("tok_embeddings.weight", (vocab, d), torch.float32)]
    for i in range(layers):
        p = f"layers.{i}."
        out += [
            (p + "attention.wqkv.weight", (3 * d, d), torch.float32),
            (p + "attention.wo.weight", (d, d), torch.float32),
            (p + "feed_forward.w1.weight", (4 * d, d), torch.float32),
            (p + "feed_forward.w2.weight", (d, 4 * d), torch.float32),
            (p + "attention_norm.weight", (d,), torch.float32),
            (p + "ffn_norm.weight", (d,), torch.float32),
        ]
    out += [("norm.weight", (d,), torch.float32), ("output.weight", (vocab, d), torch.float32)]
    return out


def shard0(shape: tuple, rank: int, world: int) -> tuple[tuple, tuple]:
    """``(offsets, sizes)`` of ``rank``'s Shard(0) chunk (torch.chunk's split, as DTensor's)."""
    n = shape[0]
    step = -(-n // world)
    start = min(rank * step, n)
    size = max(0, min(step, n - start))
    return (start, *([0] * (len(shape) - 1))), (size, *shape[1:])


# ---------------------------------------------------------------- part "plan"


def synthetic_plans(world: int, layers: int, d: int, vocab: int) -> tuple[list[SavePlan], int]:
    """Every rank's local plan as DCP's planner makes it for the FSDP2-like state
    ``{"model": params, "optim": {"state": {fqn: {exp_avg, exp_avg_sq, step}}, "param_groups"}}``
    (flattened keys, planner_data paths); returns the plans and the items per rank."""
    params = model_tensors(layers, d, vocab)
    per_rank = 0
    plans = []
    for rank in range(world):
        items, mappings = [], {}

        def tensor_item(fqn, shape, dtype, offsets, sizes):
            props = TensorProperties(dtype=dtype)  # one per item, as DCP's create_from_tensor
            return WriteItem(
                index=MetadataIndex(fqn, torch.Size(offsets)), type=WriteItemType.SHARD if shape else WriteItemType.TENSOR,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes)),
                    properties=props, size=torch.Size(shape),
                ),
            )

        for fqn, shape, dtype in params:
            offsets, sizes = shard0(shape, rank, world)
            key = f"model.{fqn}"
            items.append(tensor_item(key, shape, dtype, offsets, sizes))
            mappings[key] = ("model", fqn)
            for moment in ("exp_avg", "exp_avg_sq"):
                key = f"optim.state.{fqn}.{moment}"
                items.append(tensor_item(key, shape, dtype, offsets, sizes))
                mappings[key] = ("optim", "state", fqn, moment)
            key = f"optim.state.{fqn}.step"  # a replicated 0-d tensor on every rank
            items.append(WriteItem(
                index=MetadataIndex(key, torch.Size([])), type=WriteItemType.TENSOR,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=torch.Size([]), sizes=torch.Size([])),
                    properties=TensorProperties(dtype=torch.float32), size=torch.Size([]),
                ),
            ))
            mappings[key] = ("optim", "state", fqn, "step")
        for key, path in (("optim.param_groups", ("optim", "param_groups")), ("extra.config", ("extra", "config"))):
            items.append(WriteItem(index=MetadataIndex(key), type=WriteItemType.BYTE_IO))
            mappings[key] = path
        per_rank = len(items)
        plans.append(SavePlan(items, planner_data=mappings))
    return plans, per_rank


def copy_plans(plans: list[SavePlan]) -> list[SavePlan]:
    """A deep copy (what each coordinator gets from its own gather: objects of its own)."""
    return pickle.loads(pickle.dumps(plans, protocol=pickle.HIGHEST_PROTOCOL))


class DcpCoordinator:
    """DCP's coordinator: DefaultSavePlanner + FileSystemWriter (see the module docstring)."""

    name = "DCP"

    def __init__(self, path: str) -> None:
        from torch.distributed.checkpoint import FileSystemWriter
        from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

        self.planner = DefaultSavePlanner()
        self.writer = FileSystemWriter(path, thread_count=1)
        self.writer.set_up_storage_writer(True)

    def plan(self, plans: list[SavePlan]):
        final, metadata = self.planner.create_global_plan(plans)
        final = self.writer.prepare_global_plan(final)
        return final, metadata

    @staticmethod
    def rank_results(final: list[SavePlan]) -> list[list[WriteResult]]:
        """What each rank's FileSystemWriter.write_data returns (one file per rank, thread_count=1)."""
        from torch.distributed.checkpoint.filesystem import _StorageInfo

        out = []
        for plan in final:
            name = f"{plan.storage_data.prefix}0.distcp"
            offset, results = 0, []
            for item in plan.items:
                n = item.tensor_storage_size() or 64
                results.append(WriteResult(index=item.index, size_in_bytes=n, storage_data=_StorageInfo(name, offset, n)))
                offset += n
            out.append(results)
        return out

    def encode(self, metadata, results) -> bytes:
        """FileSystemWriter.finish up to the file write."""
        from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION

        metadata.version = CURRENT_DCP_VERSION
        storage_md = {}
        for wr_list in results:
            storage_md.update({wr.index: wr.storage_data for wr in wr_list})
        metadata.storage_data = storage_md
        metadata.storage_meta = self.writer.storage_meta()
        return pickle.dumps(metadata)

    @staticmethod
    def decode(blob: bytes):
        return pickle.loads(blob)


class OursCoordinator:
    """Our coordinator: DataStatesSavePlanner + DataStatesWriter's coordinator steps."""

    name = "ours"

    def __init__(self, path: str, save_id: str = "5ca1ab1e0001") -> None:
        from dcp_datastates import DataStatesSavePlanner
        from dcp_datastates.core.placement import AUTO_STRIPE_MIN_BYTES, PlacementRule

        self.planner = DataStatesSavePlanner()
        self.path = path
        # DataStatesWriter._rule of a local destination with io_threads=1 (a fixed save id, so
        # that the ranks' results built once match every repetition's prediction)
        self.rule = PlacementRule(save_id, None, (1, AUTO_STRIPE_MIN_BYTES))
        self.prediction = None

    def plan(self, plans: list[SavePlan]):
        final, metadata = self.planner.create_global_plan(plans)
        final = [dataclasses.replace(p, storage_data=self.rule) if p.usable else p for p in final]
        return final, metadata

    def rank_results(self, final: list[SavePlan]) -> list[list[WriteResult]]:
        """What each rank's DataStatesWriter.write_data returns: its report, with every item's entry."""
        from dcp_datastates.core.placement import place_rank
        from dcp_datastates.core.rank_reports import RankReport, item_entry, rank_results

        out = []
        for rank, plan in enumerate(final):
            placement = place_rank(plan.items, rank, self.rule)
            entries = [item_entry(item.index, placement.locations[item.index]) for item in plan.items]
            files = placement.files()
            out.append(rank_results(RankReport(files.data_file, files.index_file, files.save_id, None, files.stripes), entries))
        return out

    def encode_early(self, final: list[SavePlan], metadata) -> bytes:
        """The coordinator's write_data: the predicted layout and the staged metadata."""
        from dcp_datastates import _dcp_compat
        from dcp_datastates.core.coordinator_layout import predict_layout
        from dcp_datastates.format.metadata_file import encode_metadata

        self.prediction = predict_layout(final, self.rule)
        metadata.storage_data = self.prediction.layout
        metadata.storage_meta = StorageMeta(checkpoint_id=self.path, save_id="0" * 36)
        version = _dcp_compat.dcp_metadata_version()
        if version is not None:
            metadata.version = version
        return encode_metadata(metadata, 0)

    def check(self, results) -> None:
        """finish(): the reports confirm the prediction (else the layout is rebuilt)."""
        from dcp_datastates.core.rank_reports import split_reports

        items, reports = split_reports(results)
        if not self.prediction.holds(items, reports):
            raise AssertionError("the predicted layout does not hold for the synthetic results")

    @staticmethod
    def decode(blob: bytes):
        from dcp_datastates.format.metadata_file import decode_metadata

        return decode_metadata(blob, ".metadata")[0]


def run_dcp(plans, results_cache: dict):
    c = DcpCoordinator("/dev/shm/unused-bench-scaling")
    t0 = time.perf_counter()
    final, metadata = c.plan(plans)
    t1 = time.perf_counter()
    results = results_cache.get("dcp")
    if results is None:
        results = results_cache["dcp"] = c.rank_results(final)
    t2 = time.perf_counter()
    blob = c.encode(metadata, results)
    t3 = time.perf_counter()
    return {"plan_s": t1 - t0, "encode_s": t3 - t2, "blob": blob}


def run_ours(plans, results_cache: dict):
    c = OursCoordinator("/dev/shm/unused-bench-scaling")
    t0 = time.perf_counter()
    final, metadata = c.plan(plans)
    t1 = time.perf_counter()
    with gc_paused():  # as DataStatesWriter.write_data and finish run in the caller's thread
        blob = c.encode_early(final, metadata)
    t2 = time.perf_counter()
    results = results_cache.get("ours")
    if results is None:
        results = results_cache["ours"] = c.rank_results(final)
    t3 = time.perf_counter()
    with gc_paused():
        c.check(results)
    t4 = time.perf_counter()
    return {"plan_s": t1 - t0, "encode_s": (t2 - t1) + (t4 - t3), "blob": blob}


def time_decode(fn, blob: bytes) -> float:
    t = time.perf_counter()
    fn(blob)
    return time.perf_counter() - t


def plan_case(world: int, layers: int, d: int, vocab: int, reps: int, memory: bool) -> dict:
    """Both coordinators on the same synthetic plans of ``world`` ranks."""
    t = time.perf_counter()
    plans, per_rank = synthetic_plans(world, layers, d, vocab)
    built_s = time.perf_counter() - t
    items = world * per_rank
    out = {"ranks": world, "items_per_rank": per_rank, "items": items, "build_s": built_s}
    cache: dict = {}
    runs = {"DCP": run_dcp, "ours": run_ours}
    decoders = {"DCP": DcpCoordinator.decode, "ours": OursCoordinator.decode}
    best: dict = {}
    # The synthetic inputs (and the ranks' results, once built) are moved out of the collector's
    # sight: both coordinators' collections then walk what they allocate, not this harness's heap.
    gc.collect()
    gc.freeze()
    for rep in range(reps):  # the ranks' results are built (untimed) in the first
        order = list(runs) if rep % 2 == 0 else list(reversed(runs))
        for name in order:
            r = runs[name](plans, cache)
            r["decode_s"] = time_decode(decoders[name], r["blob"])
            r["bytes"] = len(r.pop("blob"))
            gc.collect()
            gc.freeze()
            b = best.setdefault(name, dict(r))
            for k in ("plan_s", "encode_s", "decode_s"):
                b[k] = min(b[k], r[k])
    if memory:  # peak memory of the coordinator's steps (planning + encode) and of decoding
        for name in runs:
            tracemalloc.start()
            r = runs[name](plans, cache)
            _, peak = tracemalloc.get_traced_memory()
            tracemalloc.reset_peak()
            base, _ = tracemalloc.get_traced_memory()
            decoders[name](r["blob"])
            _, dpeak = tracemalloc.get_traced_memory()
            tracemalloc.stop()
            best[name]["peak_mib"] = peak / MiB
            best[name]["decode_peak_mib"] = (dpeak - base) / MiB
            del r
            gc.collect()
    gc.unfreeze()
    for name, b in best.items():
        b["total_s"] = b["plan_s"] + b["encode_s"]
        b["items_per_s"] = items / b["total_s"]
    out.update(best)
    return out


def print_plan_table(rows: list[dict]) -> None:
    print()
    print("coordinator planning + .metadata (no processes; seconds are the best of the repetitions)")
    print(f"{'ranks':>6} {'items':>9} {'who':>5} {'plan s':>8} {'encode s':>9} {'total s':>8} {'Mitems/s':>9} "
          f"{'decode s':>9} {'bytes':>11} {'peak MiB':>9} {'dec MiB':>8}")
    for row in rows:
        for name in ("DCP", "ours"):
            r = row[name]
            print(f"{row['ranks']:>6} {row['items']:>9} {name:>5} {fmt(r['plan_s'], '.3f')} {fmt(r['encode_s'], '.3f', 9)} "
                  f"{fmt(r['total_s'], '.3f')} {fmt(r['items_per_s'] / 1e6, '.3f', 9)} {fmt(r['decode_s'], '.3f', 9)} "
                  f"{r['bytes']:>11} {fmt(r.get('peak_mib'), '.0f', 9)} {fmt(r.get('decode_peak_mib'), '.0f')}")
        d, o = row["DCP"], row["ours"]
        print(f"{'':>6} {'':>9} {'ratio':>5} DCP/ours: planning+encode {d['total_s'] / o['total_s']:.1f}x, "
              f"decode {d['decode_s'] / o['decode_s']:.1f}x, bytes {d['bytes'] / o['bytes']:.2f}x")


# ---------------------------------------------------------------- part "ranks"

COLLECTIVES = (
    "broadcast_object_list", "gather_object", "all_gather_object", "scatter_object_list", "all_reduce",
    "all_gather", "all_gather_into_tensor", "broadcast", "barrier", "reduce_scatter", "reduce_scatter_tensor",
    "gather", "scatter", "reduce", "all_to_all", "monitored_barrier",
)


class CollectiveCounter:
    """Counts the calls of torch.distributed's collective functions made through the
    ``torch.distributed`` module (DCP's _DistWrapper calls ``dist.<name>``), while enabled."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self.on = False
        self.counts: dict = {}
        for name in COLLECTIVES:
            fn = getattr(dist, name, None)
            if fn is not None:
                setattr(dist, name, self._wrap(name, fn))

    def _wrap(self, name, fn):
        def counted(*args, **kwargs):
            if self.on:
                self.counts[name] = self.counts.get(name, 0) + 1
            return fn(*args, **kwargs)

        return counted

    def start(self) -> None:
        self.counts, self.on = {}, True

    def stop(self) -> dict:
        self.on = False
        return dict(self.counts)


def state_dims(global_mib: int) -> tuple[int, int, int]:
    """``(d, layers, vocab)`` of the ranks' model: 2 blocks, vocab 8d; d a multiple of 64 (every
    dimension divides by 16 ranks) such that parameters and two Adam moments hold about
    ``global_mib`` MiB of float32."""
    layers = 2
    per_d2 = 4 * 3 * (2 * 8 + 12 * layers)  # bytes per d**2: (embedding and output 8d x d, 12 d**2 a block) x 3 x 4
    d = max(64, int(math.sqrt(global_mib * MiB / per_d2)) // 64 * 64)
    return d, layers, 8 * d


def rank_state(mesh, global_mib: int, rank: int, zero: bool = False) -> dict:
    """This rank's part of the training state: Shard(0) DTensors of every parameter and of its
    two moments, a replicated 0-d step tensor per parameter, and a few small replicated values."""
    from torch.distributed.tensor import DTensor, Shard

    d, layers, vocab = state_dims(global_mib)
    world = mesh.size()
    shapes = [(fqn, shape) for fqn, shape, _ in model_tensors(layers, d, vocab)]
    gen = torch.Generator().manual_seed(1234 + rank)

    def local(shape):
        offsets, sizes = shard0(shape, rank, world)
        t = torch.empty(sizes, dtype=torch.float32)
        return t.zero_() if zero else t.normal_(generator=gen)

    def dt(shape):
        return DTensor.from_local(local(shape), mesh, [Shard(0)], run_check=False, shape=torch.Size(shape),
                                  stride=torch.empty(shape, device="meta").stride())

    model = {fqn: dt(shape) for fqn, shape in shapes}
    optim = {fqn: {"exp_avg": dt(shape), "exp_avg_sq": dt(shape), "step": torch.tensor(0.0 if zero else 100.0)}
             for fqn, shape in shapes}
    return {
        "model": model,
        "optim": {"state": optim, "param_groups": [{"lr": 0.0 if zero else 3e-4, "betas": (0.9, 0.95)}]},
        "extra": {"rng": torch.zeros(16, dtype=torch.uint8) if zero else torch.arange(16, dtype=torch.uint8),
                  "run": None if zero else ("scaling-bench", 7, {"seed": 1234})},
    }


def same_state(a, b) -> bool:
    """Bit-exact equality of two rank states (DTensors compared by their local shards)."""
    from torch.distributed.tensor import DTensor

    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same_state(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(same_state(x, y) for x, y in zip(a, b))
    if isinstance(a, DTensor):
        return isinstance(b, DTensor) and torch.equal(a.to_local(), b.to_local())
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    return a == b


def count_files(path: str) -> int:
    return sum(len(files) for _, _, files in os.walk(path))


def rank_worker(rank: int, world: int, port: int, cfg: dict, out_path: str) -> None:
    """One rank of part ``ranks``: saves and loads with both writers, alternating; rank 0 writes
    every rank's figures to ``out_path``."""
    import json
    import shutil

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.device_mesh import DeviceMesh

    from dcp_datastates import DataStatesReader, DataStatesSavePlanner, DataStatesWriter

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    counter = CollectiveCounter()
    try:
        mesh = DeviceMesh("cpu", list(range(world)))
        state = rank_state(mesh, cfg["global_mib"], rank)
        dest = rank_state(mesh, cfg["global_mib"], rank, zero=True)
        threads = cfg["threads"]
        writers = {
            "ours": lambda path: (DataStatesWriter(path, io_threads=threads), DataStatesSavePlanner()),
            "DCP": lambda path: (FileSystemWriter(path, thread_count=threads), DefaultSavePlanner()),
        }
        readers = {"ours": DataStatesReader, "DCP": FileSystemReader}
        rows = []
        for rep in range(cfg["reps"] + 1):  # repetition 0: an untimed warm-up of each
            order = ["ours", "DCP"] if rep % 2 == 0 else ["DCP", "ours"]
            for who in order:
                path = os.path.join(cfg["root"], f"w{world}-{who}-{rep}")
                writer, planner = writers[who](path)
                dist.barrier()
                counter.start()
                t = time.perf_counter()
                dcp.save(state, storage_writer=writer, planner=planner)
                save_s = time.perf_counter() - t
                save_calls = counter.stop()
                dist.barrier()
                counter.start()
                t = time.perf_counter()
                dcp.load(dest, storage_reader=readers[who](path))
                load_s = time.perf_counter() - t
                load_calls = counter.stop()
                dist.barrier()
                exact = same_state(state, dest)
                dest = rank_state(mesh, cfg["global_mib"], rank, zero=True)
                row = {"who": who, "rep": rep, "save_s": save_s, "load_s": load_s, "exact": exact,
                       "save_calls": save_calls, "load_calls": load_calls}
                if who == "ours":  # where the rank's save went (DataStatesWriter.last_save_stats)
                    st = writer.last_save_stats
                    row["stats"] = {k: getattr(st, k) for k in ("submit_s", "data_write_s", "index_s", "commit_s",
                                                               "metadata_serialize_s", "bytes_written")}
                if rank == 0:
                    row["metadata_bytes"] = os.path.getsize(os.path.join(path, ".metadata"))
                    row["files"] = count_files(path)
                    row["bytes"] = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(path) for f in fs)
                dist.barrier()
                if rank == 0:
                    shutil.rmtree(path)
                if rep > 0:
                    rows.append(row)
        every = [None] * world
        dist.all_gather_object(every, rows)
        if rank == 0:
            with open(out_path, "w") as f:
                json.dump(every, f)
    finally:
        dist.destroy_process_group()


def ranks_case(world: int, cfg: dict) -> dict:
    """Spawn ``world`` ranks, run both writers; the figures of every rank, summarized."""
    import json
    import statistics

    import torch.multiprocessing as mp

    from bench_common import free_port

    out_path = os.path.join(cfg["root"], f"w{world}.json")
    t = time.perf_counter()
    mp.start_processes(rank_worker, args=(world, free_port(), cfg, out_path), nprocs=world, join=True,
                       start_method="spawn")
    wall = time.perf_counter() - t
    with open(out_path) as f:
        every = json.load(f)
    os.remove(out_path)
    out = {"ranks": world, "run_s": wall}
    for who in ("ours", "DCP"):
        reps = {}
        for rank_rows in every:
            for r in rank_rows:
                if r["who"] == who:
                    reps.setdefault(r["rep"], []).append(r)
        saves = [max(r["save_s"] for r in rows) for rows in reps.values()]  # max over ranks
        loads = [max(r["load_s"] for r in rows) for rows in reps.values()]
        first = next(iter(reps.values()))
        rank0 = next(r for r in first if "files" in r)
        out[who] = {
            "save_s": statistics.median(saves), "load_s": statistics.median(loads),
            "save_reps": saves, "load_reps": loads,
            "metadata_bytes": rank0["metadata_bytes"], "files": rank0["files"], "bytes": rank0["bytes"],
            "save_collectives": sum(first[0]["save_calls"].values()), "save_calls": first[0]["save_calls"],
            "load_collectives": sum(first[0]["load_calls"].values()), "load_calls": first[0]["load_calls"],
            "exact": all(r["exact"] for rows in reps.values() for r in rows),
        }
    return out


def print_ranks_table(rows: list[dict], cfg: dict) -> None:
    print()
    print(f"save and load by W gloo ranks on this machine ({os.cpu_count()} CPUs), global state "
          f"{cfg['state_mib']:.0f} MiB, --dir {cfg['dir']}; seconds: max over ranks, median of {cfg['reps']}")
    if any(r["ranks"] > (os.cpu_count() or 1) for r in rows):
        print(f"NOTE: more ranks than CPUs ({os.cpu_count()}): these rows measure software overhead and "
              "coordination (processes share the cores), not bandwidth")
    print(f"{'W':>3} {'who':>5} {'save s':>8} {'load s':>8} {'.metadata B':>12} {'files':>6} {'coll/save':>10} "
          f"{'coll/load':>10} {'exact':>6}")
    for row in rows:
        for who in ("DCP", "ours"):
            r = row[who]
            print(f"{row['ranks']:>3} {who:>5} {fmt(r['save_s'], '.3f')} {fmt(r['load_s'], '.3f')} "
                  f"{r['metadata_bytes']:>12} {r['files']:>6} {r['save_collectives']:>10} {r['load_collectives']:>10} "
                  f"{str(r['exact']):>6}")
        d, o = row["DCP"], row["ours"]
        print(f"{'':>3} {'ratio':>5} DCP/ours: save {d['save_s'] / o['save_s']:.2f}x, load {d['load_s'] / o['load_s']:.2f}x, "
              f".metadata {d['metadata_bytes'] / o['metadata_bytes']:.2f}x, files {d['files'] / o['files']:.2f}x")
    last = rows[-1]
    for who in ("DCP", "ours"):
        print(f"collectives of one save at W={last['ranks']} ({who}, rank 0): {last[who]['save_calls']}; "
              f"one load: {last[who]['load_calls']}")


# ---------------------------------------------------------------- main


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--part", choices=["ranks", "plan", "both"], default="both")
    ap.add_argument("--quick", action="store_true", help="smaller sizes, 1 repetition")
    ap.add_argument("--dir", default="/dev/shm", help="where part ranks writes (a temporary subdirectory, removed)")
    ap.add_argument("--reps", type=int, default=None, help="repetitions of part ranks (default 3, --quick 1)")
    ap.add_argument("--ranks", default=None, help="world sizes of part ranks (default 2,4,8,16; --quick 2,4,8)")
    ap.add_argument("--global-mib", type=int, default=None, help="global state of part ranks (default 512, --quick 64)")
    ap.add_argument("--threads", type=int, default=1, help="io_threads= (ours) and thread_count= (DCP) per rank")
    ap.add_argument("--plan-ranks", default=None, help="rank counts of part plan (default 256,1024,8192; --quick 64,256,1024)")
    ap.add_argument("--layers", type=int, default=4, help="transformer blocks of part plan's model (6 parameters each)")
    ap.add_argument("--plan-reps", type=int, default=None, help="repetitions of part plan (default 3, 1 from 4,096 ranks)")
    ap.add_argument("--trace-max-ranks", type=int, default=1024,
                    help="measure peak memory (tracemalloc, a further run of each) up to this many ranks")
    ap.add_argument("--json", default=None, help="write every figure to this JSON file")
    args = ap.parse_args()

    import tempfile

    report: dict = {"machine": machine_info(), "args": vars(args)}
    print(f"bench_scaling: nproc={os.cpu_count()} torch={torch.__version__} part={args.part} quick={args.quick}")
    if args.part in ("ranks", "both"):
        worlds = [int(w) for w in (args.ranks or ("2,4,8" if args.quick else "2,4,8,16")).split(",")]
        global_mib = args.global_mib or (64 if args.quick else 512)
        d, layers, vocab = state_dims(global_mib)
        state_mib = sum(math.prod(s) * 4 * 3 for _, s, _ in model_tensors(layers, d, vocab)) / MiB
        root = tempfile.mkdtemp(prefix="bench_scaling-", dir=args.dir)
        cfg = {"root": root, "dir": args.dir, "global_mib": global_mib, "state_mib": state_mib, "threads": args.threads,
               "reps": args.reps or (1 if args.quick else 3)}
        print(f"part ranks: W={worlds}, d={d}, {layers} blocks, vocab {vocab}: {3 * len(model_tensors(layers, d, vocab))} "
              f"Shard(0) DTensors ({state_mib:.0f} MiB) + replicated steps and values; threads per rank {args.threads}")
        rows = []
        try:
            for w in worlds:
                t = time.perf_counter()
                rows.append(ranks_case(w, cfg))
                print(f"  W={w} done in {time.perf_counter() - t:.0f} s", flush=True)
        finally:
            import shutil

            shutil.rmtree(root, ignore_errors=True)
        print_ranks_table(rows, cfg)
        report["ranks"] = rows
    if args.part in ("plan", "both"):
        worlds = [int(w) for w in (args.plan_ranks or ("64,256,1024" if args.quick else "256,1024,8192")).split(",")]
        rows = []
        for w in worlds:
            reps = args.plan_reps or (1 if w >= 4096 or args.quick else 3)
            t = time.perf_counter()
            rows.append(plan_case(w, args.layers, 4096, 32768, reps, w <= args.trace_max_ranks))
            print(f"  {w} ranks done in {time.perf_counter() - t:.0f} s", flush=True)
        print_plan_table(rows)
        report["plan"] = rows
    if args.json:
        write_json(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
