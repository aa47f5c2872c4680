"""``dcp-datastates convert``: every output format checked bit-exactly against the saved tensors.

Conversions run through ``cli.run`` in this process (same parser, same error
handling, same exit status as ``python -m dcp_datastates``); the interrupted
conversion and the memory bound run as real processes.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import struct
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed.checkpoint as dcp

import cli_checkpoints
from cli_checkpoints import run_cli
from conftest import assert_same
from dcp_datastates import DataStatesReader, DataStatesWriter, verify
from dcp_datastates.tools.checkpoint_view import CheckpointView

safetensors = pytest.importorskip("safetensors")
from safetensors import safe_open  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

pytestmark = [pytest.mark.subprocess, pytest.mark.slow]

HERE = os.path.dirname(os.path.abspath(__file__))
CPLX_UNSUPPORTED = ("model.complex.c128", "model.complex.c32")  # dtypes safetensors has no name for


def run_all(jobs: list[list[str]]) -> list[dict]:
    """Each command line through ``cli.run``: ``{"rc", "stdout", "stderr"}``."""
    return [{"rc": r.returncode, "stdout": r.stdout, "stderr": r.stderr} for r in (run_cli(*argv) for argv in jobs)]


def assert_one_line_error(result, status: int = 1) -> str:
    assert result.returncode == status, (result.returncode, result.stdout, result.stderr)
    assert "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dcp-datastates convert: error: "), result.stderr
    return lines[0]


def zeros_like_bits(t: torch.Tensor) -> torch.Tensor:
    """A zero tensor of t's dtype and shape (via bytes: fine for float8, complex32, uint*)."""
    n = t.numel()
    return torch.zeros(max(n, 1) * t.element_size(), dtype=torch.uint8).view(t.dtype)[:n].reshape(t.shape)


def nested_expected(saved: cli_checkpoints.SavedCheckpoint) -> dict:
    """The nested state as saved, rebuilt from the fixture's flat keys with DCP's own unflattening."""
    from dcp_datastates._dcp_compat import unflatten_state_dict

    mappings = CheckpointView(saved.path).metadata.planner_data
    return unflatten_state_dict({**saved.tensors, **saved.objects}, mappings)


def without_complex(saved: cli_checkpoints.SavedCheckpoint) -> dict:
    return {k: v for k, v in saved.tensors.items() if k not in CPLX_UNSUPPORTED}


# ---------------------------------------------------------------------------
# the conversions, run once for the module
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def st_dtype_checkpoints(tmp_path_factory):
    """The every-dtype state without complex128/complex32 (safetensors has no names for them), ours and stock."""
    state = cli_checkpoints.dtype_state()
    del state["model"]["complex"]["c128"], state["model"]["complex"]["c32"]
    base = tmp_path_factory.mktemp("convert_st_dtypes")
    ours, stock = str(base / "ours"), str(base / "stock")
    dcp.save(state, storage_writer=DataStatesWriter(ours), no_dist=True)
    dcp.save(state, storage_writer=dcp.FileSystemWriter(stock), no_dist=True)
    flat = cli_checkpoints.flatten(state)
    tensors = {k: v.contiguous() for k, v in flat.items() if isinstance(v, torch.Tensor)}
    objects = {k: v for k, v in flat.items() if not isinstance(v, torch.Tensor)}
    return (cli_checkpoints.SavedCheckpoint(ours, tensors, objects), cli_checkpoints.SavedCheckpoint(stock, tensors, objects))


@pytest.fixture(scope="module")
def sources(sharded_checkpoint, dtype_checkpoints, run_checkpoints, st_dtype_checkpoints):
    ours, stock = dtype_checkpoints
    st_ours, st_stock = st_dtype_checkpoints
    return {
        "sharded": sharded_checkpoint,
        "dtypes_ours": ours,
        "dtypes_dcp": stock,
        "run": run_checkpoints.checkpoints[-1],
        "st_dtypes_ours": st_ours,
        "st_dtypes_dcp": st_stock,
    }


@pytest.fixture(scope="module")
def converted(sources, tmp_path_factory):
    """Run every conversion; ``converted[(name, to)] = (out, result)``."""
    base = tmp_path_factory.mktemp("converted")
    jobs, keys = [], []

    def job(name, to, out, *extra):
        keys.append((name, to))
        jobs.append(["convert", sources[name].path, "--to", to, str(out), "--quiet", *extra])

    for name in ("sharded", "dtypes_ours", "dtypes_dcp", "run"):
        job(name, "torch", base / f"{name}.pt")
        job(name, "dcp", base / f"{name}_dcp")
    for name in ("sharded", "run", "st_dtypes_ours", "st_dtypes_dcp"):
        job(name, "safetensors", base / f"{name}_st")
    for name in ("dtypes_dcp", "sharded", "run"):
        job(name, "datastates", base / f"{name}_ours")
    job("run", "safetensors-small", base / "run_st_small")
    jobs[-1][3] = "safetensors"
    jobs[-1].extend(["--max-shard-size", "2KiB"])
    # --overwrite: a dcp output of step 30 replaced by a conversion of step 10
    job("run", "dcp-to-replace", base / "run_over")
    jobs[-1][3] = "dcp"
    job("run", "dcp-overwrite", base / "run_over")
    jobs[-1][1], jobs[-1][3] = sources["run"].path.replace("step_00000030", "step_00000010"), "dcp"
    jobs[-1].append("--overwrite")
    results = run_all(jobs)
    return {k: (j[4], r) for k, j, r in zip(keys, jobs, results)}


def ok(converted, name, to):
    out, result = converted[(name, to)]
    assert result["rc"] == 0, result
    assert "Traceback" not in result["stderr"]
    return out, result


# ---------------------------------------------------------------------------
# --to torch
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["sharded", "dtypes_ours", "dtypes_dcp", "run"])
def test_to_torch_is_the_nested_state_bit_exact(converted, sources, name):
    out, result = ok(converted, name, "torch")
    assert result["stderr"] == ""
    loaded = torch.load(out, weights_only=True)
    assert_same(loaded, nested_expected(sources[name]))
    assert re.search(r"^tensors\s+%d " % len(sources[name].tensors), result["stdout"], re.M)


def test_to_torch_keeps_structure_and_every_dtype(converted, dtype_checkpoints, run_checkpoints):
    loaded = torch.load(ok(converted, "dtypes_dcp", "torch")[0], weights_only=True)
    assert_same(loaded, cli_checkpoints.dtype_state())  # the user's state, objects included
    assert loaded["meta"] == {"name": "dtype-run", "lr": 0.125, "tags": ["a", "b"]}
    run = torch.load(ok(converted, "run", "torch")[0], weights_only=True)
    assert set(run) == {"model", "optim", "step"} and run["step"] == 30
    assert "0.weight" in run["model"]  # keys with dots stay keys: unflattened by planner_data, not by "."
    assert isinstance(run["optim"]["param_groups"], list)


# ---------------------------------------------------------------------------
# --to safetensors
# ---------------------------------------------------------------------------


def check_safetensors_dir(out: str, expected: dict, max_shard: int | None = None) -> dict:
    with open(os.path.join(out, "model.safetensors.index.json")) as f:
        index = json.load(f)
    assert set(index["weight_map"]) == set(expected)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in expected.values())
    shards = sorted(set(index["weight_map"].values()))
    n = len(shards)
    assert shards == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert sorted(os.listdir(out)) == sorted(shards + ["model.safetensors.index.json"])
    for shard in shards:
        path = os.path.join(out, shard)
        with open(path, "rb") as f:
            (hlen,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(hlen))
        assert hlen % 8 == 0 and header["__metadata__"] == {"format": "pt"}
        keys = [k for k, v in index["weight_map"].items() if v == shard]
        loaded = load_file(path)
        assert set(loaded) == set(keys)
        with safe_open(path, framework="pt") as f:
            assert set(f.keys()) == set(keys) and f.metadata() == {"format": "pt"}
            for k in keys:
                assert_same(f.get_tensor(k), expected[k], k)
                assert_same(loaded[k], expected[k], k)
        if max_shard is not None and len(keys) > 1:
            assert sum(expected[k].numel() * expected[k].element_size() for k in keys) <= max_shard
    return index


@pytest.mark.parametrize("name", ["sharded", "run", "st_dtypes_ours", "st_dtypes_dcp"])
def test_to_safetensors_bit_exact(converted, sources, name):
    out, result = ok(converted, name, "safetensors")
    saved = sources[name]
    index = check_safetensors_dir(out, saved.tensors)
    assert len(set(index["weight_map"].values())) == 1  # default 5GB: one shard, index anyway
    # objects cannot be stored: one line on stderr names them, and it is not an error
    lines = result["stderr"].strip().splitlines()
    assert len(lines) == 1 and f"skipped {len(saved.objects)} non-tensor" in lines[0], result["stderr"]
    for key in list(saved.objects)[:3]:
        assert key in lines[0]


def test_to_safetensors_small_shards(converted, sources):
    out, _ = ok(converted, "run", "safetensors-small")
    index = check_safetensors_dir(out, sources["run"].tensors, max_shard=2048)
    files = set(index["weight_map"].values())
    assert len(files) > 3
    # shards follow the checkpoint's key order
    order = list(CheckpointView(sources["run"].path).tensors)
    assert [index["weight_map"][k] for k in order] == sorted(index["weight_map"][k] for k in order)


# ---------------------------------------------------------------------------
# --to dcp / --to datastates
# ---------------------------------------------------------------------------


def load_flat(saved, reader) -> dict:
    state = {k: zeros_like_bits(v) for k, v in saved.tensors.items()}
    state.update({k: None for k in saved.objects})
    dcp.load(state, storage_reader=reader, no_dist=True)
    return state


@pytest.mark.parametrize("name", ["sharded", "dtypes_ours", "dtypes_dcp", "run"])
def test_to_dcp_loads_with_stock_reader(converted, sources, name):
    out, _ = ok(converted, name, "dcp")
    saved = sources[name]
    state = load_flat(saved, dcp.FileSystemReader(out))
    assert_same(state, {**saved.tensors, **saved.objects})
    view = CheckpointView(out)
    assert view.format == "dcp"
    assert view.metadata.planner_data == CheckpointView(saved.path).metadata.planner_data
    assert view.metadata.storage_data and all(
        info.relative_path == "__0_0.distcp" for info in view.metadata.storage_data.values()
    )
    for key, tensor in saved.tensors.items():
        assert_same(view.read_tensor(key), tensor, key)


def test_overwrite_replaces_an_existing_output(converted, run_checkpoints):
    ok(converted, "run", "dcp-to-replace")
    out, result = ok(converted, "run", "dcp-overwrite")
    first = run_checkpoints.checkpoints[0]
    state = load_flat(first, dcp.FileSystemReader(out))
    assert_same(state, {**first.tensors, **first.objects})
    parent = os.path.dirname(out)
    assert not [n for n in os.listdir(parent) if n.startswith(".")]  # no temporary or replaced leftovers


@pytest.mark.parametrize("name", ["dtypes_dcp", "sharded", "run"])
def test_to_datastates_verifies_and_loads(converted, sources, name):
    out, _ = ok(converted, name, "datastates")
    saved = sources[name]
    report = verify(out)
    assert report.ok, report.summary()
    state = load_flat(saved, DataStatesReader(out))
    assert_same(state, {**saved.tensors, **saved.objects})
    assert CheckpointView(out).format == "dcp_datastates"


def test_writer_batches_and_releases_lazily_resolved_tensors(tmp_path):
    """DataStatesWriter with a ``resolve_creates_tensors`` planner (the converter's path to
    ``--to datastates``): tensors are resolved a batch at a time and each batch is released
    once staged, and the checkpoint is the same as a normal save's."""
    import weakref

    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    class ClonePlanner(DefaultSavePlanner):
        resolve_creates_tensors = True

        def __init__(self):
            super().__init__()
            self.alive, self.peak = [], 0

        def resolve_data(self, item):
            value = super().resolve_data(item)
            if isinstance(value, torch.Tensor):
                live = [t for t in (r() for r in self.alive) if t is not None]
                self.peak = max(self.peak, sum(t.nbytes for t in live))
                self.alive = [weakref.ref(t) for t in live]
                value = value.clone()  # a new tensor per call, like reading it from a checkpoint
                self.alive.append(weakref.ref(value))
            return value

    g = torch.Generator().manual_seed(5)
    state = {
        "small": {str(i): torch.randn(int(n), generator=g) for i, n in enumerate(torch.randint(1, 3000, (40,), generator=g))},
        "big": {str(i): torch.randn(40_000 + 1000 * i, generator=g) for i in range(12)},  # 160-200 KB each
        "strided": torch.randn(300, 200, generator=g).t(),
        "step": 7,
    }
    path = str(tmp_path / "ckpt")
    planner = ClonePlanner()
    pool = 256 << 10
    writer = DataStatesWriter(path, host_cache_bytes=pool, window_bytes=64 << 10)
    dcp.save(state, storage_writer=writer, planner=planner, no_dist=True)
    total = sum(t.nbytes for t in cli_checkpoints.flatten(state).values() if isinstance(t, torch.Tensor))
    assert total > 8 * pool
    assert planner.peak <= pool + (256 << 10), (planner.peak, total)  # one batch (+ one tensor), not all
    assert verify(path).ok
    flat = cli_checkpoints.flatten(state)
    loaded = {k: zeros_like_bits(v) if isinstance(v, torch.Tensor) else None for k, v in flat.items()}
    dcp.load(loaded, storage_reader=DataStatesReader(path), no_dist=True)
    assert_same(loaded, {k: v.contiguous() if isinstance(v, torch.Tensor) else v for k, v in flat.items()})


# ---------------------------------------------------------------------------
# errors
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def error_runs(sources, tmp_path_factory):
    """Bad inputs: ``(base, {case: CompletedProcess})``."""
    base = tmp_path_factory.mktemp("convert_errors")
    run = sources["run"].path
    corrupt = str(base / "corrupt")
    shutil.copytree(run, corrupt)
    data = sorted(n for n in os.listdir(corrupt) if n.endswith(".data"))[0]
    with open(os.path.join(corrupt, data), "r+b") as f:
        b = f.read(1)
        f.seek(0)
        f.write(bytes([b[0] ^ 0xFF]))
    notckpt = base / "notckpt"
    notckpt.mkdir()
    (notckpt / "readme.txt").write_text("hello")
    uncommitted = base / "uncommitted"
    uncommitted.mkdir()
    (uncommitted / "rank00000-0123456789ab.data").write_bytes(b"\0" * 64)
    existing = base / "existing"
    existing.mkdir()
    (existing / ".metadata").write_bytes(b"old")
    existing_file = base / "existing.pt"
    existing_file.write_bytes(b"old")
    runs = {
        "help": ["convert", "--help"],
        "corrupt": ["convert", corrupt, "--to", "safetensors", str(base / "corrupt_out")],
        "exists": ["convert", run, "--to", "dcp", str(existing)],
        "corrupt_dcp": ["convert", corrupt, "--to", "dcp", str(base / "corrupt_dcp")],
        "exists_file": ["convert", run, "--to", "torch", str(existing_file)],
        "missing": ["convert", str(base / "nope"), "--to", "torch", str(base / "nope.pt")],
        "notckpt": ["convert", str(notckpt), "--to", "dcp", str(base / "n_out")],
        "uncommitted": ["convert", str(uncommitted), "--to", "dcp", str(base / "u_out")],
        "complex": ["convert", sources["dtypes_ours"].path, "--to", "safetensors", str(base / "c_out")],
        "overwrite_home": ["convert", run, "--to", "dcp", str(notckpt), "--overwrite"],
        "into_source": ["convert", run, "--to", "torch", os.path.join(run, ".metadata"), "--overwrite"],
        "bad_to": ["convert", run, "--to", "onnx", str(base / "x")],
    }
    return base, {case: run_cli(*argv) for case, argv in runs.items()}


def test_help(error_runs):
    r = error_runs[1]["help"]
    assert r.returncode == 0
    for word in ("--to", "--max-shard-size", "--overwrite", "--allow-pickle", "safetensors", "datastates"):
        assert word in r.stdout


@pytest.mark.parametrize("case", ["corrupt", "corrupt_dcp"])
def test_corrupt_source_fails_and_leaves_nothing(error_runs, case):
    base, runs = error_runs
    line = assert_one_line_error(runs[case])
    assert "checksum" in line and "corrupt" in line
    assert not (base / "corrupt_out").exists() and not (base / "corrupt_dcp").exists()
    assert not [n for n in os.listdir(base) if n.startswith(".")]  # no temporary output left


def test_existing_output_is_refused_and_kept(error_runs):
    base, runs = error_runs
    for case, path in (("exists", base / "existing" / ".metadata"), ("exists_file", base / "existing.pt")):
        line = assert_one_line_error(runs[case])
        assert "already exists" in line and "--overwrite" in line
        assert path.read_bytes() == b"old"


def test_overwrite_never_removes_a_directory_that_is_not_an_output(error_runs):
    base, runs = error_runs
    line = assert_one_line_error(runs["overwrite_home"])
    assert "refusing to replace" in line
    assert (base / "notckpt" / "readme.txt").read_text() == "hello"


def test_output_inside_the_source_is_refused(error_runs, sources):
    line = assert_one_line_error(error_runs[1]["into_source"])
    assert "would overlap the checkpoint" in line
    assert verify(sources["run"].path).ok


@pytest.mark.parametrize("case", ["missing", "notckpt", "uncommitted"])
def test_bad_sources(error_runs, case):
    base, runs = error_runs
    line = assert_one_line_error(runs[case])
    assert str(base) in line
    assert not [n for n in os.listdir(base) if n.endswith("_out") or n == "nope.pt"]


def test_complex_dtypes_refused_for_safetensors_before_writing(error_runs):
    base, runs = error_runs
    line = assert_one_line_error(runs["complex"])
    assert "'model.complex.c128'" in line and "complex128" in line and "complex32" in line
    assert not [n for n in os.listdir(base) if "c_out" in n]


def test_bad_format_is_a_usage_error(error_runs):
    r = error_runs[1]["bad_to"]
    assert r.returncode == 2 and "invalid choice" in r.stderr


# ---------------------------------------------------------------------------
# memory: bounded by a tensor, not the checkpoint
# ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def big_checkpoint(tmp_path_factory):
    """128 MiB in 4 tensors of 32 MiB (ours)."""
    path = str(tmp_path_factory.mktemp("convert_big") / "big")
    state = {f"layer{i}.weight": torch.full((8 << 20,), float(i + 1)) for i in range(4)}
    dcp.save(state, storage_writer=DataStatesWriter(path, host_cache_bytes=64 << 20), no_dist=True)
    return path


MEMORY_CHILD = r"""
import json, os, re, sys
from dcp_datastates.tools import cli
import dcp_datastates.tools.commands.convert  # torch and DCP: imported before any peak is measured

def hwm_kib():
    return int(re.search(r"VmHWM:\s+(\d+)", open("/proc/self/status").read()).group(1))

src, base, fmts = sys.argv[1], sys.argv[2], sys.argv[3].split(",")
out = {}
for fmt in fmts:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # restart the peak (VmHWM) from the current RSS
        reset = True
    except OSError:
        reset = False
    if not reset and out:
        break  # the peak would include the last conversion's: the parent runs the rest in a new child
    before = hwm_kib()
    rc = cli.main(["convert", src, "--to", fmt, os.path.join(base, "mem_" + fmt), "--quiet"])
    out[fmt] = {"rc": rc, "growth_mib": (hwm_kib() - before) / 1024}
print(json.dumps(out))
"""


def test_memory_is_bounded_by_one_tensor(big_checkpoint, tmp_path):
    """Converting 128 MiB (4 tensors of 32 MiB) must not hold the checkpoint: peak RSS growth < 100 MiB.

    The bound: one 32 MiB tensor (or block) at a time, plus the reader's
    16 MiB engine pool (mapped and pre-faulted on first use) and, for
    datastates, the writer's 16 MiB host cache: about 64 MiB, against the
    128+ MiB that holding the checkpoint would take. (--to torch is left out:
    its output pages are mapped, so they count in RSS as page cache.)
    """
    todo, results = ["safetensors", "datastates", "dcp"], {}
    while todo:
        r = subprocess.run(
            [sys.executable, "-c", MEMORY_CHILD, big_checkpoint, str(tmp_path), ",".join(todo)],
            capture_output=True, text=True, cwd=HERE,
        )
        assert r.returncode == 0, r.stderr
        done = json.loads(r.stdout.strip().splitlines()[-1])
        results.update(done)
        todo = [f for f in todo if f not in done]
    for fmt, res in results.items():
        assert res["rc"] == 0, (fmt, res)
        assert res["growth_mib"] < 100, (fmt, results)
    assert verify(str(tmp_path / "mem_datastates")).ok
    with safe_open(str(tmp_path / "mem_safetensors" / "model-00001-of-00001.safetensors"), framework="pt") as f:
        assert f.get_slice("layer3.weight")[-2:].tolist() == [4.0, 4.0]
    view = CheckpointView(str(tmp_path / "mem_dcp"))
    assert view.read_block("layer2.weight", (0,), (3,)).tolist() == [3.0, 3.0, 3.0]


@pytest.mark.parametrize("sig,to,name", [(signal.SIGTERM, "torch", "out.pt"), (signal.SIGHUP, "safetensors", "out")],
                         ids=["SIGTERM-file", "SIGHUP-directory"])
def test_interrupted_convert_leaves_no_output(big_checkpoint, tmp_path, sig, to, name):
    """SIGTERM (a scheduler's kill) or SIGHUP (the terminal closed) in the middle of a
    conversion: status 130, no OUT, no temporary file or directory left."""
    from dcp_datastates.tools.output import partial_output_of

    out = tmp_path / name
    p = subprocess.Popen(
        [sys.executable, "-m", "dcp_datastates", "convert", big_checkpoint, "--to", to, str(out), "--quiet"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and p.poll() is None:
        if any(partial_output_of(n) == name for n in os.listdir(tmp_path)):
            break
        time.sleep(0.002)
    p.send_signal(sig)
    _, stderr = p.communicate(timeout=120)
    if p.returncode == 0:
        pytest.skip("the conversion finished before it could be interrupted")
    assert p.returncode == 130, stderr
    assert stderr.strip() == "dcp-datastates: interrupted"
    assert not out.exists()
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("to", ["safetensors", "torch"])  # "dcp": stock FileSystemWriter raises its own RuntimeError
def test_full_disk_error_names_the_output_and_leaves_nothing(small_tmpfs, tmp_path, to):
    """Python's write and fsync raise ENOSPC without a file name; the tools name the output.
    (The torch output is filled through a shared mapping: without its blocks reserved first,
    a full disk killed the process with SIGBUS.)"""
    import errno

    from dcp_datastates.tools.conversion import convert_checkpoint

    src = tmp_path / "src"
    dcp.save({"w": torch.randn(1 << 20), "b": torch.randn(1000)}, storage_writer=DataStatesWriter(src), no_dist=True)
    out = small_tmpfs / "out"
    with pytest.raises(Exception) as info:
        convert_checkpoint(src, out, to)
    err = info.value
    while err is not None and not isinstance(err, OSError):
        err = err.__cause__ or err.__context__
    assert isinstance(err, OSError) and err.errno == errno.ENOSPC, repr(info.value)
    assert err.filename and str(small_tmpfs) in err.filename, repr(err)
    assert os.listdir(small_tmpfs) == []
