"""Helpers for tests/test_property.py and tests/test_stress.py (issue 4).

Four parts:

* random data shared by the pytest process and the ranks: every dtype, tensors
  of random *bytes* (NaN payloads, -0.0, any bit pattern), plain Python
  objects, and seeded random state dicts of DTensors (:func:`random_dist_spec`)
  that every rank and the pytest process rebuild identically from the seed;
* :func:`assert_exact`: a bit-exact comparison that is stricter than
  ``conftest.assert_same`` (object types must match, floats compare by their
  bits, so NaN and -0.0 objects are checked too);
* the two-writer scenario of test_stress.py (:func:`two_writers_main`), run
  in a subprocess with a watchdog that prints every thread's stack on a stall;
* worker cases for multi-process launches: ``run_ranks`` here is
  dist_helpers' launcher with this file as the worker script and its
  ``CASES`` as the case table.

Worker cases run after ``init_process_group("gloo")``; DTensors are built with
``distribute_tensor(..., src_data_rank=None)``, which slices the full tensor on
every rank without a collective (gloo cannot broadcast float8, uint16, ...).
"""

from __future__ import annotations

import copy
import math
import os
import random
import struct
import sys
import threading
import time
import traceback
import warnings
import zlib

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

warnings.filterwarnings("ignore", message="torch.distributed is disabled")
warnings.filterwarnings("ignore", message="ComplexHalf support is experimental")

import torch  # noqa: E402

import dist_helpers as dh  # noqa: E402

SPAWN_TIMEOUT_S = 240.0


# ---------------------------------------------------------------------------
# random tensors and objects
# ---------------------------------------------------------------------------

DTYPE_NAMES = [
    "float32", "float64", "float16", "bfloat16",
    "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu",
    "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
    "bool", "complex32", "complex64", "complex128",
]
DTYPES = [getattr(torch, n) for n in DTYPE_NAMES if hasattr(torch, n)]


def random_bits(shape, dtype, seed: int) -> torch.Tensor:
    """A contiguous tensor of ``shape`` whose bytes are random (any bit pattern)."""
    gen = torch.Generator().manual_seed(seed & 0x7FFF_FFFF_FFFF_FFFF)
    n = math.prod(shape)
    raw = torch.randint(0, 256, (n * dtype.itemsize,), dtype=torch.uint8, generator=gen)
    if dtype == torch.bool:
        raw = raw % 2  # other bytes are not valid bools
    return raw.view(dtype).reshape(tuple(shape))


def random_object(rng: random.Random, depth: int = 0):
    """A random plain-Python value (no classes: the reader refuses arbitrary pickles)."""
    kinds = ["int", "bigint", "float", "str", "bytes", "none", "bool"]
    if depth < 2:
        kinds += ["list", "dict"]
    kind = rng.choice(kinds)
    if kind == "int":
        return rng.randint(-1000, 1000)
    if kind == "bigint":
        return rng.randint(-(2**100), 2**100)
    if kind == "float":
        return rng.choice([rng.uniform(-1e6, 1e6), float("inf"), -0.0, 1e-310, struct.unpack("<d", struct.pack("<Q", 0x7FF8_0000_DEAD_BEEF))[0]])
    if kind == "str":
        return "".join(rng.choice("ab/.\u00e4\u03b2\u6f22 \n") for _ in range(rng.randint(0, 8)))
    if kind == "bytes":
        return bytes(rng.randrange(256) for _ in range(rng.randint(0, 16)))
    if kind == "none":
        return None
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "list":
        return [random_object(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return {f"k{i}": random_object(rng, depth + 1) for i in range(rng.randint(0, 3))}


def placeholder(value):
    """A load target of the same structure as ``value``: zero contiguous tensors, ``None`` objects.

    Lists and dicts are mirrored element by element, which keeps DCP's
    flattening the same (a list is traversed iff it holds a tensor or a mapping).
    """
    if isinstance(value, torch.Tensor):
        return torch.zeros(tuple(value.shape), dtype=value.dtype)
    if isinstance(value, dict):
        return {k: placeholder(v) for k, v in value.items()}
    if isinstance(value, list):
        return [placeholder(v) for v in value]
    return None


def clone_state(value):
    """A deep copy; tensors become contiguous clones."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone(memory_format=torch.contiguous_format)
    if isinstance(value, dict):
        return {k: clone_state(v) for k, v in value.items()}
    if isinstance(value, list):
        return [clone_state(v) for v in value]
    if isinstance(value, tuple):
        return tuple(clone_state(v) for v in value)
    return copy.deepcopy(value)


def tensor_bytes(t: torch.Tensor) -> bytes:
    # A fresh clone: contiguous() keeps odd strides of size-0/size-1 dims, which view(uint8) refuses.
    flat = t.detach().cpu().clone(memory_format=torch.contiguous_format).reshape(-1)
    return flat.view(torch.uint8).numpy().tobytes()


def assert_exact(actual, expected, path: str = "state") -> None:
    """Bit-exact comparison; tensors by dtype, shape and bytes; objects by type and value (floats by bits)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover
        DTensor = ()
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), f"{path}: got {type(actual).__name__}, expected a tensor"
        if isinstance(actual, DTensor):
            actual = actual.to_local()
        if isinstance(expected, DTensor):
            expected = expected.to_local()
        assert actual.dtype == expected.dtype, f"{path}: dtype {actual.dtype} != {expected.dtype}"
        assert actual.shape == expected.shape, f"{path}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
        a, e = tensor_bytes(actual), tensor_bytes(expected)
        if a != e:
            first = next(i for i in range(len(a)) if a[i] != e[i])
            raise AssertionError(f"{path}: {expected.dtype}{tuple(expected.shape)} bytes differ, first at byte {first} of {len(e)}")
    elif isinstance(expected, dict):
        assert isinstance(actual, dict), f"{path}: got {type(actual).__name__}, expected a dict"
        assert set(actual) == set(expected), f"{path}: keys differ: {sorted(map(repr, set(actual) ^ set(expected)))}"
        for k in expected:
            assert_exact(actual[k], expected[k], f"{path}.{k}")
    elif isinstance(expected, (list, tuple)):
        assert type(actual) is type(expected), f"{path}: got {type(actual).__name__}, expected {type(expected).__name__}"
        assert len(actual) == len(expected), f"{path}: length {len(actual)} != {len(expected)}"
        for i, (x, y) in enumerate(zip(actual, expected)):
            assert_exact(x, y, f"{path}[{i}]")
    else:
        assert type(actual) is type(expected), f"{path}: got {type(actual).__name__} {actual!r}, expected {type(expected).__name__} {expected!r}"
        if isinstance(expected, float):
            assert struct.pack("<d", actual) == struct.pack("<d", expected), f"{path}: {actual!r} != {expected!r} (bits)"
        else:
            assert actual == expected, f"{path}: {actual!r} != {expected!r}"


# ---------------------------------------------------------------------------
# seeded random distributed state dicts
# ---------------------------------------------------------------------------

# Shapes whose dims do not divide by 2, 3 or 4; 0 and 1 leave ranks with empty shards.
_DIMS = [0, 1, 2, 3, 5, 7, 13]
_BIG_SHAPES = [(257, 129), (129, 257), (1031, 67)]  # > 64 KiB per shard: the page-aligned path


def random_dist_spec(seed: int) -> dict:
    """key path -> ("dt", shape, dtype, placement) | ("plain", shape, dtype, view) | ("obj", value).

    Key paths are tuples: entries are nested in dicts (and one list) of the state dict.
    Every rank, and the pytest process, computes the same spec from ``seed``.
    """
    rng = random.Random(seed)
    containers = [(), ("model",), ("model", "layers"), ("optim", "state"), ("extra",)]
    spec = {}
    n_dt = rng.randint(4, 9)
    for i in range(n_dt):
        dtype = rng.choice(DTYPES)
        if rng.random() < 0.15:
            shape = rng.choice(_BIG_SHAPES)
        else:
            shape = tuple(rng.choice(_DIMS) for _ in range(rng.choice([0, 1, 2, 2, 3])))
        codes = ["R"] + [f"S{d}" for d in range(len(shape))]
        spec[rng.choice(containers) + (f"dt{i}",)] = ("dt", shape, dtype, rng.choice(codes))
    for i in range(rng.randint(1, 4)):
        shape = tuple(rng.choice(_DIMS) for _ in range(rng.choice([0, 1, 2])))
        view = rng.choice(["contiguous", "transposed", "strided"]) if len(shape) == 2 else "contiguous"
        spec[rng.choice(containers) + (f"plain{i}",)] = ("plain", shape, rng.choice(DTYPES), view)
    for i in range(rng.randint(1, 4)):
        spec[rng.choice(containers) + (f"obj{i}",)] = ("obj", random_object(rng))
    # A list holding a tensor and an object (DCP traverses lists that hold tensors).
    spec[("buffers", 0)] = ("plain", (3, 2), torch.float32, "contiguous")
    spec[("buffers", 1)] = ("obj", {"note": f"seed {seed}"})
    return spec


def _stable_hash(seed: int, path: tuple) -> int:
    return zlib.crc32(repr((seed, path)).encode()) + seed * 7919


def _plain_value(shape, dtype, view, s: int) -> torch.Tensor:
    if view == "transposed":
        return random_bits((shape[1], shape[0]), dtype, s).t()
    if view == "strided":
        base = random_bits((max(2 * shape[0], 1), shape[1] + 1), dtype, s)
        return base[::2, 1:][: shape[0]]
    return random_bits(shape, dtype, s)


def full_value(seed: int, path: tuple, entry):
    """The full (unsharded) value of one spec entry."""
    kind = entry[0]
    if kind == "obj":
        return json_clone(entry[1])
    s = _stable_hash(seed, path)
    if kind == "dt":
        return random_bits(entry[1], entry[2], s)
    return _plain_value(entry[1], entry[2], entry[3], s)


def json_clone(obj):
    """A fresh copy of a plain object (so ranks never share mutable values with the spec)."""
    if isinstance(obj, list):
        return [json_clone(v) for v in obj]
    if isinstance(obj, dict):
        return {k: json_clone(v) for k, v in obj.items()}
    return obj


def _set_path(root: dict, path: tuple, value) -> None:
    node = root
    for i, part in enumerate(path[:-1]):
        nxt = path[i + 1]
        if isinstance(node, list):
            while len(node) <= part:
                node.append(None)
            if node[part] is None:
                node[part] = [] if isinstance(nxt, int) else {}
            node = node[part]
        else:
            node = node.setdefault(part, [] if isinstance(nxt, int) else {})
    last = path[-1]
    if isinstance(node, list):
        while len(node) <= last:
            node.append(None)
        node[last] = value
    else:
        node[last] = value


def reference_state(seed: int) -> dict:
    """The full state dict of ``seed`` as plain tensors and objects (what a 1-process load yields)."""
    out: dict = {}
    for path, entry in random_dist_spec(seed).items():
        value = full_value(seed, path, entry)
        if isinstance(value, torch.Tensor):
            value = value.contiguous()
        _set_path(out, path, value)
    return out


def one_process_targets(seed: int) -> dict:
    return placeholder(reference_state(seed))


def _placement(code: str):
    from torch.distributed.tensor import Replicate, Shard

    return Replicate() if code == "R" else Shard(int(code[1:]))


def local_dtensor(full: torch.Tensor, mesh, code: str):
    """``full`` distributed with placement ``code`` without a collective (each rank slices)."""
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(full, mesh, [_placement(code)], src_data_rank=None)


def reshard_codes(seed: int) -> dict:
    """Load-time placements for the reshard: every tensor gets a random code (0-d: plain or R).

    Plain tensors may become DTensors and DTensors may become plain tensors ("plain").
    """
    rng = random.Random(seed * 31 + 7)
    codes = {}
    for path, entry in random_dist_spec(seed).items():
        if entry[0] == "obj":
            continue
        shape = entry[1]
        options = ["plain", "R"] + [f"S{d}" for d in range(len(shape))]
        codes[path] = rng.choice(options)
    return codes


def dist_state(seed: int, mesh, zeros: bool, codes: dict | None = None) -> dict:
    """The state dict of ``seed`` on one rank (``codes`` overrides placements; "plain" = plain tensor)."""
    out: dict = {}
    for path, entry in random_dist_spec(seed).items():
        kind = entry[0]
        value = full_value(seed, path, entry)
        if kind == "obj":
            _set_path(out, path, placeholder(value) if zeros else value)
            continue
        code = (codes or {}).get(path, entry[3] if kind == "dt" else "plain")
        if zeros or code != "plain":
            value = value.contiguous()  # distribute_tensor shards contiguous tensors
        if zeros:
            value = torch.zeros(tuple(value.shape), dtype=value.dtype)
        _set_path(out, path, value if code == "plain" else local_dtensor(value, mesh, code))
    return out


def expected_rank_state(seed: int, mesh, codes: dict) -> dict:
    """What a rank must hold after loading into ``dist_state(seed, mesh, True, codes)``: local shards."""
    out: dict = {}
    for path, entry in random_dist_spec(seed).items():
        value = full_value(seed, path, entry)
        if entry[0] != "obj":
            value = value.contiguous()
            code = codes.get(path, "plain")
            if code != "plain":
                value = local_dtensor(value, mesh, code).to_local()
        _set_path(out, path, value)
    return out


def to_local_tree(value):
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        return value.to_local()
    if isinstance(value, dict):
        return {k: to_local_tree(v) for k, v in value.items()}
    if isinstance(value, list):
        return [to_local_tree(v) for v in value]
    return value


# ---------------------------------------------------------------------------
# the 4-rank stress state: DTensors + an FSDP2 model and AdamW, mutated every step
# ---------------------------------------------------------------------------

STRESS_SEED = 4242
# key -> (shape, dtype, placement); row counts uneven on 4 ranks, some ranks empty.
STRESS_SPECS = {
    "emb": ((1031, 67), torch.float32, "S0"),  # ~270 KiB: streams through the small cache
    "proj": ((67, 517), torch.bfloat16, "S1"),
    "tiny": ((3, 5), torch.float64, "S0"),  # rank 3 holds an empty shard
    "none": ((0, 4), torch.float32, "S0"),  # every shard empty
    "rep": ((6, 4), torch.float32, "R"),
    "counts": ((13,), torch.int64, "S0"),
    "mask": ((9, 2), torch.bool, "S1"),
}


def stress_reference(step: int) -> dict:
    """Full values of the DTensor entries after ``step`` calls of :func:`stress_mutate`."""
    out = {}
    for key, (shape, dtype, _) in STRESS_SPECS.items():
        t = random_bits(shape, torch.uint8 if dtype == torch.bool else dtype, _stable_hash(STRESS_SEED, (key,)))
        if dtype == torch.bool:
            t = (t % 2).to(torch.bool)
        elif dtype.is_floating_point:
            t = t.nan_to_num(0.0, 1.0, -1.0)  # finite values, so the updates stay deterministic
        for i in range(step):
            stress_mutate(t, i)
        out[key] = t
    return out


def stress_mutate(t: torch.Tensor, step: int) -> None:
    """An elementwise in-place update: bit-identical on a shard and on the full tensor."""
    if t.dtype == torch.bool:
        t.logical_not_()
    elif t.dtype.is_floating_point:
        t.mul_(0.5).add_(float(step + 1))
    else:
        t.add_(step + 1)


# ---------------------------------------------------------------------------
# two writers at once in one process (test_stress.py runs this in a subprocess)
# ---------------------------------------------------------------------------

MiB = 1 << 20


def tensors_of(tree):
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, dict):
        for v in tree.values():
            yield from tensors_of(v)
    elif isinstance(tree, (list, tuple)):
        for v in tree:
            yield from tensors_of(v)


def load_and_check(path, expected, what):
    """Load ``path`` into zero-filled targets of ``expected``'s structure; compare bit-exactly."""
    import torch.distributed.checkpoint as dcp

    from dcp_datastates import DataStatesReader

    import dcp_datastates

    report = dcp_datastates.verify(path)
    assert report.ok, report.summary()
    target = placeholder(expected)
    dcp.load(target, storage_reader=DataStatesReader(path), no_dist=True)
    assert_exact(target, expected, what)


def _thread_state(seed: int, mib: float):
    g = torch.Generator().manual_seed(seed)
    n = int(mib * MiB) // 4 // 4
    return {
        "w": {f"p{i}": torch.randn(n, generator=g) for i in range(3)},
        "t": torch.randn(200, 130, generator=g).t(),
        "i": torch.randint(-100, 100, (1000,), generator=g, dtype=torch.int32),
        "scalar": torch.tensor(float(seed)),
        "meta": {"seed": seed, "log": []},
    }


def _mutate(state, i):
    for t in tensors_of(state):
        if t.dtype.is_floating_point:
            t.mul_(-0.5).add_(i)
        else:
            t.add_(1)
    state["meta"]["log"].append(i)


def _writer_thread(tag, root, saves, settings, fence, start, results, errors, max_in_flight=None):
    import torch.distributed.checkpoint as dcp

    import dcp_datastates
    from dcp_datastates import DataStatesWriter

    try:
        state = _thread_state(seed=ord(tag), mib=3)
        start.wait(timeout=60)  # both threads save at the same time
        writer = DataStatesWriter(**settings)  # one writer per thread, reused with reset()
        responses = []
        for i in range(saves):
            if max_in_flight and len(responses) >= max_in_flight:
                responses[-max_in_flight].upload_completion.result()  # bound the saves in flight
            path = os.path.join(root, f"{tag}-{i:03d}")
            writer.reset(path)
            results.append((path, clone_state(state)))
            resp = dcp.async_save(state, storage_writer=writer, no_dist=True)
            responses.append(resp)
            if fence == "staging":
                resp.staging_completion.result()
            else:
                dcp_datastates.wait_for_snapshots()
            _mutate(state, i)
        for resp in responses:
            resp.upload_completion.result()
        writer.close()
    except BaseException as exc:  # noqa: BLE001 - reported by the main thread
        traceback.print_exc()
        errors.append((tag, exc))


def two_writers_main(root, engines, saves, stall_s, max_in_flight=None):
    """Two threads, each with its own DataStatesWriter and state, saving asynchronously at once.

    Thread "a" waits for its own staging future before mutating, thread "b" uses
    ``wait_for_snapshots()``; ``engines`` is "shared" (same writer settings: one
    engine and pool) or "separate"; ``max_in_flight`` bounds each thread's saves
    not yet uploaded (default: none awaited until the end). Every checkpoint is
    then loaded and compared.
    A watchdog prints every thread's stack and exits with code 3 if the saves
    have not ended after ``stall_s`` seconds. Prints "OK" on success.
    """
    import faulthandler

    torch.set_num_threads(1)
    faulthandler.dump_traceback_later(stall_s, exit=True)  # a stall: every stack, exit code 1
    small = dict(host_cache_bytes=1 * MiB, window_bytes=256 << 10)  # each state is ~2.4 MiB
    other = small if engines == "shared" else dict(host_cache_bytes=2 * MiB, window_bytes=512 << 10)
    results_a, results_b, errors = [], [], []
    start = threading.Barrier(2)
    threads = [
        threading.Thread(target=_writer_thread, args=("a", root, saves, small, "staging", start, results_a, errors, max_in_flight)),
        threading.Thread(
            target=_writer_thread, args=("b", root, saves, other, "wait_for_snapshots", start, results_b, errors, max_in_flight)
        ),
    ]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    saved_s = time.monotonic() - t0
    if errors:
        raise AssertionError(f"writer thread {errors[0][0]} failed: {errors[0][1]!r}") from errors[0][1]
    assert len(results_a) == len(results_b) == saves
    for path, expected in results_a + results_b:
        load_and_check(path, expected, os.path.basename(path))
    faulthandler.cancel_dump_traceback_later()
    print(f"OK: 2 x {saves} async saves ({engines} engine) in {saved_s:.1f}s, all loaded bit-exactly", flush=True)
    sys.stdout.flush()
    os._exit(0)  # the staging monitor and engine threads are daemons: skip finalization


# ---------------------------------------------------------------------------
# worker cases
# ---------------------------------------------------------------------------

CASES = dh.WorkerCases(__file__, timeout=SPAWN_TIMEOUT_S)
case = CASES.case


_mesh = dh._mesh


@case
def random_dist_save(rank, world_size, root, seeds):
    """For each seed: dcp.save, then (all in flight at once) dcp.async_save of the seed's random state.

    The synchronous saves all come first (written that way while a synchronous
    save issued before an asynchronous one had begun could deadlock; fixed, see
    test_stress.py, test_sync_save_after_async_save_does_not_deadlock).
    """
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from dcp_datastates import DataStatesWriter

    mesh = _mesh(world_size)
    group = dist.new_group(backend="gloo")
    for seed in seeds:
        state = dist_state(seed, mesh, zeros=False)
        dcp.save(state, storage_writer=DataStatesWriter(os.path.join(root, f"seed{seed}", "sync")))
    responses = []
    for seed in seeds:
        state = dist_state(seed, mesh, zeros=False)
        writer = DataStatesWriter(
            os.path.join(root, f"seed{seed}", "async"), host_cache_bytes=256 << 10, window_bytes=64 << 10
        )
        resp = dcp.async_save(state, storage_writer=writer, process_group=group)
        responses.append((resp, writer))
        resp.staging_completion.result()
        # After the fence every tensor may change: the checkpoint keeps the values at the call.
        for value in _leaves(state):
            if isinstance(value, torch.Tensor):
                _scramble(value.to_local() if hasattr(value, "to_local") else value)
    for resp, writer in responses:
        resp.upload_completion.result()
        writer.close()


def _scramble(t: torch.Tensor) -> None:
    """Change a tensor's bytes in place, whatever its dtype (and bump its version)."""
    if t.dtype == torch.bool:
        t.logical_not_()
    elif t.is_contiguous():
        t.reshape(-1).view(torch.uint8).bitwise_not_()
    else:
        t.zero_()


def _leaves(value):
    if isinstance(value, dict):
        for v in value.values():
            yield from _leaves(v)
    elif isinstance(value, list):
        for v in value:
            yield from _leaves(v)
    else:
        yield value


@case
def random_dist_load(rank, world_size, root, seeds, modes=("sync", "async")):
    """Load each seed's checkpoint into other placements (reshard) and check every local shard."""
    import torch.distributed.checkpoint as dcp

    from dcp_datastates import DataStatesReader

    mesh = _mesh(world_size)
    for seed in seeds:
        codes = reshard_codes(seed)
        expected = expected_rank_state(seed, mesh, codes)
        for mode in modes:
            state = dist_state(seed, mesh, zeros=True, codes=codes)
            dcp.load(state, storage_reader=DataStatesReader(os.path.join(root, f"seed{seed}", mode)))
            assert_exact(to_local_tree(state), expected, f"seed{seed}/{mode}@rank{rank}")


@case
def stress_4rank_async_saves(rank, world_size, root, saves):
    """FSDP2 MLP + AdamW and DTensors on 4 ranks; an async save per step, none awaited until the end.

    Rank 0 writes the full model/optimizer reference of save ``i`` to ``{root}/ref{i}.pt``;
    the DTensor entries at save ``i`` are :func:`stress_reference` (i).
    """
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    import dcp_datastates
    import dist_helpers as dh
    from dcp_datastates import DataStatesWriter

    mesh = _mesh(world_size)
    model, optim = dh.fsdp_model_and_optim(dh.MLP_SEED, mesh)
    dcp_datastates.install_fence(optim)
    ckpt_group = dist.new_group(backend="gloo")
    extra = {k: local_dtensor(v, mesh, STRESS_SPECS[k][2]) for k, v in stress_reference(0).items()}
    g = torch.Generator().manual_seed(99 + rank)

    def train_step():
        x, y = torch.randn(8, 13, generator=g), torch.randn(8, 11, generator=g)
        torch.nn.functional.mse_loss(model(x), y).backward()
        optim.step()  # the fence: waits while a snapshot still copies
        optim.zero_grad()

    train_step()
    responses = []
    for i in range(saves):
        msd, osd = get_state_dict(model, optim)
        full_m, full_o = get_state_dict(model, optim, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if rank == 0:
            torch.save({"model": full_m, "optim": full_o}, os.path.join(root, f"ref{i}.pt"))
        state = {"model": msd, "optim": osd, "extra": extra, "step": i, "meta": {"saves": list(range(i))}}
        writer = DataStatesWriter(os.path.join(root, f"ckpt{i}"), host_cache_bytes=256 << 10, window_bytes=64 << 10)
        responses.append((dcp.async_save(state, storage_writer=writer, process_group=ckpt_group), writer))
        train_step()
        # The DTensor entries are not the optimizer's: fence them explicitly, alternating the two ways.
        if i % 2:
            dcp_datastates.wait_for_snapshots()
        else:
            responses[-1][0].staging_completion.result()
        for v in extra.values():
            stress_mutate(v.to_local(), i)
    for resp, writer in responses:
        resp.upload_completion.result()
        writer.close()
    dist.barrier()


# ---------------------------------------------------------------------------
# worker entry point and launcher
# ---------------------------------------------------------------------------


run_ranks = CASES.run_ranks


if __name__ == "__main__":
    CASES.main()
