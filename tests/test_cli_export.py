"""``dcp-datastates export``: HDF5 and zarr output read back with h5py and tensorstore.

Every test runs the real command (``cli.run``, in this process) on the session's real
checkpoints and compares what it wrote with the tensors that were saved,
bit for bit (raw bytes, so NaN payloads, -0.0, bfloat16 and float8 count).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp

from cli_checkpoints import run_cli
from dcp_datastates import DataStatesWriter

pytestmark = [pytest.mark.subprocess, pytest.mark.slow]

h5py = pytest.importorskip("h5py")
ts = pytest.importorskip("tensorstore")

FORMATS = ["hdf5", "zarr"]
RAW_BITS = {  # torch dtypes numpy lacks -> what the export stores
    torch.bfloat16: "uint16", torch.complex32: "uint32",
    torch.float8_e4m3fn: "uint8", torch.float8_e5m2: "uint8",
    torch.float8_e4m3fnuz: "uint8", torch.float8_e5m2fnuz: "uint8",
}


def export_batch(*calls, check=None):
    """Run several ``dcp-datastates export`` command lines (``cli.run``, in this process), in order."""
    results = [run_cli("export", *args) for args in calls]
    for res in results:
        if check is not None:
            assert res.returncode == check, res.stderr
    return results


def export(*args, check=None):
    """One ``dcp-datastates export ...`` command line."""
    return export_batch(args, check=check)[0]


def assert_one_line_error(r, *needles):
    assert r.returncode == 1, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dcp-datastates export: error: "), r.stderr
    assert "Traceback" not in r.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


def out_path(tmp_path, fmt, name="out"):
    return tmp_path / (f"{name}.h5" if fmt == "hdf5" else f"{name}.zarr")


def read_export(path, fmt):
    """(root attrs, {key: (array with step axis, attrs, chunk shape)}) read with h5py or tensorstore."""
    if fmt == "hdf5":
        with h5py.File(path, "r") as f:
            root = {k: _plain(v) for k, v in f.attrs.items()}
            root["objects"] = json.loads(root["objects"])
            data = {}
            for name, ds in f.items():
                attrs = {k: _plain(v) for k, v in ds.attrs.items()}
                data[attrs["key"]] = (ds[...], attrs, ds.chunks, name)
        return root, data
    root = json.loads((path / ".zattrs").read_text())
    assert json.loads((path / ".zgroup").read_text()) == {"zarr_format": 2}
    data = {}
    for entry in sorted(os.listdir(path)):
        if entry.startswith("."):
            continue
        spec = {"driver": "zarr", "kvstore": {"driver": "file", "path": str(path / entry)}}
        store = ts.open(spec, open=True).result()
        attrs = json.loads((path / entry / ".zattrs").read_text())
        chunks = tuple(json.loads((path / entry / ".zarray").read_text())["chunks"])
        data[attrs["key"]] = (store.read().result(), attrs, chunks, entry)
    return root, data


def _plain(v):
    if isinstance(v, np.ndarray):
        return [x.decode() if isinstance(x, bytes) else (x if isinstance(x, str) else x.item()) for x in v.tolist()] \
            if v.dtype.kind in "OSU" else v.tolist()
    if isinstance(v, np.generic):
        return v.item()
    return v


def raw(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def assert_bit_exact(array, step: int, expected: torch.Tensor, key: str):
    """Step ``step`` of an exported dataset holds exactly ``expected``'s bytes, shape and (stored) dtype."""
    got = np.array(array[step], order="C")  # (ascontiguousarray would make 0-d 1-d)
    assert got.shape == tuple(expected.shape), key
    assert got.dtype == np.dtype(RAW_BITS.get(expected.dtype, str(expected.dtype).removeprefix("torch."))), key
    assert got.tobytes() == raw(expected), f"{key}: step {step} differs"


def assert_same_checkpoints(out, fmt, checkpoints, steps):
    root, data = read_export(out, fmt)
    assert root["format"] == "dcp_datastates export" and root["version"] == 1
    assert root["steps"] == steps
    assert root["checkpoints"] == [os.path.abspath(c.path) for c in checkpoints]
    assert set(data) == set(checkpoints[0].tensors)
    for key, expected in checkpoints[0].tensors.items():
        array, attrs, _chunks, _name = data[key]
        assert array.shape == (len(checkpoints), *expected.shape), key
        assert attrs["dtype"] == str(expected.dtype).removeprefix("torch."), key
        assert attrs["stored_as"] == str(array.dtype), key
        assert attrs["steps"] == steps and attrs["key"] == key
        for i, ckpt in enumerate(checkpoints):
            assert_bit_exact(array, i, ckpt.tensors[key], key)
    return root, data


def no_leftovers(out):
    from dcp_datastates.tools.output import partial_output_of

    out = str(out)
    return not any(partial_output_of(n) == os.path.basename(out) for n in os.listdir(os.path.dirname(out)))


def save(path, state):
    dcp.save(state, storage_writer=DataStatesWriter(str(path)), no_dist=True)
    return str(path)


# -- values ------------------------------------------------------------------------------------


def test_run_exports_every_step_bit_exact(run_checkpoints, tmp_path):
    paths = [c.path for c in run_checkpoints.checkpoints]
    model_keys = sorted(k for k in run_checkpoints.checkpoints[0].tensors if k.startswith("model."))
    h5, zarr, from_root, filtered = (tmp_path / n for n in ("run.h5", "run.zarr", "root.h5", "keys.zarr"))
    results = export_batch(
        (*paths, "--format", "hdf5", "--out", h5),
        (*paths, "--format", "zarr", "--out", zarr),
        (run_checkpoints.root, "--format", "hdf5", "--out", from_root, "--keys", "model.*"),  # a run root
        (*paths, "--format", "zarr", "--out", filtered, "--keys", "model.*.weight", "--keys", "*.exp_avg"),
        (*paths, "--format", "zarr", "--out", tmp_path / "none.zarr", "--keys", "nothing.*"),
    )
    for r in results[:4]:
        assert r.returncode == 0, r.stderr
    assert "steps     10 20 30" in results[0].stdout and "datasets  24" in results[0].stdout, results[0].stdout
    for out, fmt in ((h5, "hdf5"), (zarr, "zarr")):
        root, _ = assert_same_checkpoints(out, fmt, run_checkpoints.checkpoints, [10, 20, 30])
        # Plain objects, per step, in the root attribute "objects".
        assert [o["step"] for o in root["objects"]] == [10, 20, 30]
        assert root["objects"][0]["optim.param_groups.0.lr"] == 0.01
        assert root["objects"][0]["optim.param_groups.0.betas"] == [0.9, 0.999]
        assert no_leftovers(out)
    root, data = read_export(from_root, "hdf5")
    assert root["steps"] == [10, 20, 30] and sorted(data) == model_keys
    assert root["checkpoints"] == [os.path.abspath(p) for p in paths]
    root, data = read_export(filtered, "zarr")
    tensors = run_checkpoints.checkpoints[0].tensors
    assert sorted(data) == sorted(
        k for k in tensors if k.endswith(".exp_avg") or (k.startswith("model.") and k.endswith(".weight"))
    )
    for key, (array, *_rest) in data.items():
        for i, ckpt in enumerate(run_checkpoints.checkpoints):
            assert_bit_exact(array, i, ckpt.tensors[key], key)
    assert root["objects"] == [{}, {}, {}]  # objects are filtered by the same globs
    assert_one_line_error(results[4], "no tensor keys match --keys nothing.*")


def test_every_dtype_small_blocks(dtype_checkpoints, tmp_path):
    cases = [("hdf5", dtype_checkpoints[0]), ("zarr", dtype_checkpoints[0]), ("hdf5", dtype_checkpoints[1])]
    outs = [out_path(tmp_path, fmt, f"out{i}") for i, (fmt, _) in enumerate(cases)]
    export_batch(
        *[(ckpt.path, "--format", fmt, "--out", out, "--block-bytes", "4096") for (fmt, ckpt), out in zip(cases, outs)],
        check=0,
    )
    for (fmt, ckpt), out in zip(cases, outs):  # ours (hdf5, zarr) and stock DCP (hdf5)
        root, data = assert_same_checkpoints(out, fmt, [ckpt], [42])  # the saved int "step" object
        assert root["objects"][0]["meta.name"] == "dtype-run"
        expected_storage = {
            "model.float.bf16": ("bfloat16", "uint16"), "model.complex.c32": ("complex32", "uint32"),
            "model.float8.e4m3fn": ("float8_e4m3fn", "uint8"), "model.float8.e5m2fnuz": ("float8_e5m2fnuz", "uint8"),
            "model.int.bool": ("bool", "bool"), "model.complex.c64": ("complex64", "complex64"),
            "model.int.u64": ("uint64", "uint64"),
        }
        for key, (dtype, stored) in expected_storage.items():
            assert (data[key][1]["dtype"], data[key][1]["stored_as"]) == (dtype, stored), key
        # The documented way back to torch values: reinterpret the raw bits.
        bf16 = torch.from_numpy(np.array(data["model.float.bf16"][0][0])).view(torch.bfloat16)
        assert torch.equal(bf16, ckpt.tensors["model.float.bf16"])
        f8 = torch.from_numpy(np.array(data["model.float8.e5m2"][0][0])).view(torch.float8_e5m2)
        assert raw(f8) == raw(ckpt.tensors["model.float8.e5m2"])
        # 0-d -> (S,), empty dims kept, chunks one step each and at most 4 MiB.
        assert data["model.shape.scalar"][0].shape == (1,)
        assert data["model.shape.empty"][0].shape == (1, 0, 4)
        assert data["model.shape.wide"][2] == (1, 300, 2000)
        if fmt == "zarr":
            assert data["model.shape.empty"][2] == (1, 1, 4)  # chunk dims >= 1


def test_sharded_checkpoint_and_awkward_names(sharded_checkpoint, tmp_path):
    state = {"a/b": torch.arange(6.0).reshape(2, 3), ".hidden": torch.tensor([1, 2]), "50%": torch.tensor(7)}
    named = save(tmp_path / "step_5", state)
    outs = {fmt: (out_path(tmp_path, fmt, "sharded"), out_path(tmp_path, fmt, "named")) for fmt in FORMATS}
    export_batch(
        *[(sharded_checkpoint.path, "--format", fmt, "--out", o[0], "--block-bytes", "4096")
          for fmt, o in outs.items()],
        *[(named, "--format", fmt, "--out", o[1]) for fmt, o in outs.items()],
        check=0,
    )
    for fmt, (sharded_out, named_out) in outs.items():
        # Tensors assembled from the two ranks' shards; no step anywhere: its index.
        root, _ = assert_same_checkpoints(sharded_out, fmt, [sharded_checkpoint], [0])
        assert root["objects"][0]["epoch"] == 3
        # "/" and "%" and a leading "." are escaped in names; "key" keeps the key.
        root, data = read_export(named_out, fmt)
        assert root["steps"] == [5]  # from the directory name
        assert {k: v[3] for k, v in data.items()} == {"a/b": "a%2Fb", ".hidden": "%2Ehidden", "50%": "50%25"}
        for key, t in state.items():
            assert_bit_exact(data[key][0], 0, t, key)


# -- refusals ------------------------------------------------------------------------------------


def test_existing_out_refused_unless_overwrite(run_checkpoints, tmp_path):
    ckpt = run_checkpoints.checkpoints[0]
    h5, zarr = out_path(tmp_path, "hdf5"), out_path(tmp_path, "zarr")
    h5.write_bytes(b"old")
    zarr.mkdir()
    (zarr / ".zgroup").write_text('{"zarr_format": 2}')
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "notes.txt").write_text("keep me")
    refused = export_batch(
        (ckpt.path, "--format", "hdf5", "--out", h5),
        (ckpt.path, "--format", "zarr", "--out", zarr),
        (ckpt.path, "--format", "zarr", "--out", precious, "--overwrite"),
        (ckpt.path, "--format", "zarr", "--out", ckpt.path, "--overwrite"),
        (ckpt.path, "--format", "hdf5", "--out", os.path.join(ckpt.path, ".metadata"), "--overwrite"),
    )
    assert_one_line_error(refused[0], str(h5), "exists; pass --overwrite")
    assert_one_line_error(refused[1], str(zarr), "exists; pass --overwrite")
    assert_one_line_error(refused[2], "not a zarr store")
    assert_one_line_error(refused[3], "would overlap the checkpoint")
    assert_one_line_error(refused[4], "would overlap the checkpoint")  # a file inside the checkpoint
    assert h5.read_bytes() == b"old" and sorted(os.listdir(zarr)) == [".zgroup"]
    assert (precious / "notes.txt").read_text() == "keep me"
    export_batch(
        (ckpt.path, "--format", "hdf5", "--out", h5, "--overwrite"),
        (ckpt.path, "--format", "zarr", "--out", zarr, "--overwrite"),
        check=0,
    )
    for out, fmt in ((h5, "hdf5"), (zarr, "zarr")):
        assert_same_checkpoints(out, fmt, [ckpt], [10])
        assert no_leftovers(out)


def test_shape_dtype_and_missing_key_mismatch(tmp_path):
    a = save(tmp_path / "a", {"w": torch.zeros(4, 3), "b": torch.zeros(2), "step": 1})
    b = save(tmp_path / "b", {"w": torch.zeros(4, 2), "b": torch.zeros(2, dtype=torch.bfloat16), "step": 2})
    c = save(tmp_path / "c", {"w": torch.zeros(4, 3), "step": 3})
    out = tmp_path / "out.h5"
    results = export_batch(
        (a, b, "--format", "hdf5", "--out", out),
        (a, b, "--format", "hdf5", "--out", out, "--keys", "b"),
        (a, c, "--format", "zarr", "--out", out, "--keys", "b"),
    )
    assert_one_line_error(results[0], "'w'", "float32[4, 3]", "float32[4, 2]", a, b)
    assert_one_line_error(results[1], "'b'", "float32[2]", "bfloat16[2]")
    assert_one_line_error(results[2], "'b'", "missing in", c)
    assert not os.path.exists(out) and no_leftovers(out)
    export_batch((a, c, "--format", "hdf5", "--out", out, "--keys", "w"), check=0)  # excluded with --keys
    root, data = read_export(out, "hdf5")
    assert root["steps"] == [1, 3] and list(data) == ["w"]


def test_corrupt_checkpoint_leaves_no_output(dtype_checkpoints, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(dtype_checkpoints[0].path, copy)
    data_file = next(copy.glob("rank*.data"))
    blob = bytearray(data_file.read_bytes())
    blob[len(blob) // 2] ^= 0x10  # inside the 2.4 MB "model.shape.wide"
    data_file.write_bytes(bytes(blob))
    outs = [out_path(tmp_path, fmt) for fmt in FORMATS]
    results = export_batch(*[(copy, "--format", fmt, "--out", out, "--block-bytes", "64KiB")
                             for fmt, out in zip(FORMATS, outs)])
    for r, out in zip(results, outs):
        assert_one_line_error(r, "checksum", str(copy), "model.shape.wide")
        assert not os.path.exists(out) and no_leftovers(out)


def test_bad_inputs_and_help(tmp_path):
    out = tmp_path / "out.h5"
    (tmp_path / "plain").mkdir()
    uncommitted = tmp_path / "uncommitted"
    uncommitted.mkdir()
    (uncommitted / "rank00000-0123456789ab.data").write_bytes(b"\0" * 64)
    results = export_batch(
        (tmp_path / "missing", "--format", "hdf5", "--out", out),
        (tmp_path / "plain", "--format", "hdf5", "--out", out),
        (uncommitted, "--format", "zarr", "--out", out),
        (tmp_path / "missing", "--format", "netcdf", "--out", out),
    )
    assert_one_line_error(results[0], "missing")
    assert_one_line_error(results[1], "plain")
    assert_one_line_error(results[2], "uncommitted")
    assert results[3].returncode == 2 and "invalid choice" in results[3].stderr
    assert not os.path.exists(out)
    r = export("--help", check=0)
    assert "--format {hdf5,zarr}" in r.stdout and "--block-bytes" in r.stdout and "--keys" in r.stdout


def test_missing_library_is_one_line(run_checkpoints, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "h5py", None)  # import h5py now raises ImportError
    r = export(run_checkpoints.checkpoints[0].path, "--format", "hdf5", "--out", tmp_path / "o.h5")
    assert_one_line_error(r, "export --format hdf5 needs h5py: pip install 'dcp_datastates[export]'")
    assert not os.path.exists(tmp_path / "o.h5")


# -- memory ----------------------------------------------------------------------------------

_MEASURE = r"""
import sys
import h5py, numpy, tensorstore, torch  # imported before the baseline: not the export's memory
import dcp_datastates.tools.cli, dcp_datastates.tools.commands.export

def status(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024

try:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
except OSError:
    pass
base = status("VmRSS")
rc = dcp_datastates.tools.cli.main(sys.argv[1:])
print((status("VmHWM") - base) >> 20)
sys.exit(rc)
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs /proc (Linux)")
@pytest.mark.parametrize("fmt", FORMATS)
def test_memory_is_bounded_by_the_block(tmp_path_factory, tmp_path, fmt):
    """A 128 MiB tensor exported with 4 MiB blocks raises peak RSS by well under half its size.

    What one block costs (measured ~44 MiB for either format, the same for a
    256 MiB tensor): the reader's engine pool (16 MiB, two 8 MiB windows,
    allocated once per process), the block (4 MiB), the reader's read widened
    to whole 8 MiB checksum segments (8-16 MiB), and HDF5's chunk cache (8
    MiB) or tensorstore's chunk buffers. Reading the whole tensor would cost
    128 MiB or more, so 64 MiB separates the two with a wide margin.
    """
    big = tmp_path_factory.getbasetemp() / "export_big"
    if not (big / ".metadata").exists():
        save(big, {"big": torch.randn(8192, 4096, generator=torch.Generator().manual_seed(0))})
    out = out_path(tmp_path, fmt)
    r = subprocess.run(
        [sys.executable, "-c", _MEASURE, "export", str(big), "--format", fmt, "--out", str(out),
         "--block-bytes", "4MiB", "--quiet"],
        capture_output=True, text=True,
    )
    assert r.returncode == 0, r.stderr
    growth_mib = int(r.stdout.strip().splitlines()[-1])
    assert growth_mib < 64, f"peak RSS grew by {growth_mib} MiB exporting a 128 MiB tensor"
    assert os.path.getsize(out) if fmt == "hdf5" else (out / "big" / ".zarray").exists()
