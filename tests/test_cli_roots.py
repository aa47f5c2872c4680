"""The command-line tool at its edges: startup without torch, run roots, ``--json``, partial outputs.

* ``--help``, ``--version``, ``ls`` and ``du`` of a run root never import torch
  (checked in a fresh interpreter, without timing), while the package's public
  names import on first use, with the torch version check.
* ``verify`` and ``inspect`` of a run root (a directory of step directories, or
  a tier's root URL) take every committed step, or with ``--latest`` the one the
  ``latest`` pointer names; ``verify --json`` and ``convert --json`` print one
  document.
* ``du`` reports the hidden partial output a killed ``convert`` leaves.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

import dcp_datastates
from cli_checkpoints import run_cli as cli
from dcp_datastates.tools.checkpoint_view import CheckpointView
from dcp_datastates.manager.checkpoint_root import write_latest
from dcp_datastates.tools.output import partial_output_of, temporary_path

STEPS = ("step_00000010", "step_00000020", "step_00000030")

_NO_TORCH_CHILD = r"""
import io, json, sys
root = sys.argv[1]
import dcp_datastates
from dcp_datastates.tools import cli
assert "torch" not in sys.modules, "import dcp_datastates imported torch"
results = {}
for argv in (["--help"], ["--version"], ["ls", root], ["ls", root, "--json"], ["du", root], ["du", root, "--json"]):
    out = io.StringIO()
    rc = cli.run(argv, stdout=out, stderr=out)
    results[" ".join(argv[:1] + argv[2:])] = [rc, "torch" in sys.modules, "numpy" in sys.modules, out.getvalue()]
print(json.dumps(results))
"""


@pytest.mark.subprocess
def test_listing_commands_start_without_torch(run_checkpoints):
    r = subprocess.run([sys.executable, "-c", _NO_TORCH_CHILD, run_checkpoints.root],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    results = json.loads(r.stdout)
    for command, (rc, torch_imported, numpy_imported, output) in results.items():
        assert rc == 0, (command, output)
        assert not torch_imported, f"{command} imported torch"
        assert not numpy_imported, f"{command} imported numpy (most of a listing's start-up time)"
    # The same answers as with torch at hand (ls of a root reads the metadata's record).
    ls = json.loads(results["ls --json"][3])
    assert [(c["name"], c["state"], c["ranks"], c["keys"]) for c in ls["checkpoints"]] == [
        (name, "committed", 1, len(CheckpointView(os.path.join(run_checkpoints.root, name)).keys())) for name in STEPS
    ]
    du = json.loads(results["du --json"][3])
    assert [u["state"] for u in du["checkpoints"]] == ["committed"] * 3
    assert all(u["checkpoint_bytes"] == u["apparent_bytes"] > 0 for u in du["checkpoints"])
    assert "dcp-datastates" in results["--help"][3] and dcp_datastates.__version__ in results["--version"][3]


def test_public_names_import_on_first_use_with_the_torch_check(monkeypatch):
    import torch

    assert set(dcp_datastates.__all__) == set(dcp_datastates._PUBLIC) | set(dcp_datastates._ALIASES)
    assert set(dcp_datastates.__all__) <= set(dir(dcp_datastates))
    assert all(getattr(dcp_datastates, n) is not None for n in dcp_datastates.__all__)
    assert dcp_datastates.StoreReader is dcp_datastates.DataStatesReader
    assert dcp_datastates.CheckpointManager.__module__ == "dcp_datastates.manager.checkpoint_manager"
    with pytest.raises(AttributeError, match="has no attribute 'no_such_name'"):
        dcp_datastates.no_such_name
    monkeypatch.delitem(vars(dcp_datastates), "DataStatesWriter")  # as before its first use
    monkeypatch.setattr(torch, "__version__", "2.10.0")
    with pytest.raises(ImportError, match="needs torch 2.11 or newer; this is torch 2.10.0"):
        dcp_datastates.DataStatesWriter


def test_submodules_are_attributes_and_any_first_import_checks_torch(tmp_path):
    """``dcp_datastates.errors.X`` after a bare ``import dcp_datastates``, as the docs spell errors;
    and a first import of a module deeper down (the torchtitan integration's) refuses an old torch."""
    script = (
        "import sys, torch, dcp_datastates\n"
        "assert dcp_datastates.errors.ModelMismatchError.__name__ == 'ModelMismatchError'\n"
        "torch.__version__ = '2.10.0'\n"
        "try:\n"
        "    import dcp_datastates.core.writer\n"
        "except ImportError as exc:\n"
        "    print('refused:', exc)\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "refused: dcp_datastates needs torch 2.11 or newer; this is torch 2.10.0"


@pytest.fixture
def run_root(run_checkpoints, tmp_path):
    """A copy of the run root with a ``latest`` pointer (step 20) and an uncommitted step 40."""
    root = str(tmp_path / "run")
    shutil.copytree(run_checkpoints.root, root)
    write_latest(root, 20)
    os.makedirs(os.path.join(root, "step_00000040"))
    with open(os.path.join(root, "step_00000040", "rank00000-0123456789ab.data"), "wb") as f:
        f.write(b"x" * 100)
    return root


def _damage_a_data_byte(ckpt: str) -> str:
    data = next(n for n in sorted(os.listdir(ckpt)) if n.endswith(".data"))
    with open(os.path.join(ckpt, data), "r+b") as f:
        byte = f.read(1)
        f.seek(0)
        f.write(bytes([byte[0] ^ 0x01]))
    return os.path.join(ckpt, data)


def test_verify_and_inspect_of_a_run_root(run_root):
    paths = [os.path.join(run_root, s) for s in STEPS]
    every = cli("verify", "--quiet", run_root)
    assert every.returncode == 0, every.stdout + every.stderr
    lines = every.stdout.splitlines()
    assert [ln.split(": ")[:2] for ln in lines[:3]] == [["OK", p] for p in paths]
    assert lines[3] == "3 checkpoints: 3 OK, 0 failed" and "step_00000040" not in every.stdout

    latest = cli("verify", "--quiet", "--latest", "--json", run_root)
    doc = json.loads(latest.stdout)
    assert latest.returncode == 0 and (doc["ok"], doc["failed"]) == (1, 0)
    [one] = doc["checkpoints"]
    assert (one["path"], one["status"], one["ok"], one["problems"]) == (paths[1], "OK", True, [])
    assert one["bytes_checked"] > 0 and one["ranks"] == 1

    damaged = _damage_a_data_byte(paths[0])
    bad = cli("verify", "--quiet", "--json", run_root)
    doc = json.loads(bad.stdout)
    assert bad.returncode == 1 and (doc["ok"], doc["failed"]) == (2, 1)
    assert [c["status"] for c in doc["checkpoints"]] == ["CORRUPT", "OK", "OK"]
    assert any(damaged in p for p in doc["checkpoints"][0]["problems"]), doc["checkpoints"][0]

    many = json.loads(cli("inspect", "--json", run_root).stdout)
    assert many["root"] == run_root and [c["path"] for c in many["checkpoints"]] == paths
    latest = cli("inspect", "--json", "--latest", run_root)
    assert latest.returncode == 0 and latest.stdout == cli("inspect", "--json", paths[1]).stdout
    text = cli("inspect", run_root).stdout
    assert [ln.split()[1] for ln in text.splitlines() if ln.startswith("checkpoint ")] == paths


def test_latest_needs_a_root_with_a_pointer_to_a_committed_step(run_root, tmp_path):
    os.remove(os.path.join(run_root, "latest"))
    none = cli("verify", "--latest", run_root)
    pointer = os.path.join(run_root, "latest")
    assert none.returncode == 1 and none.stdout.startswith(f"FAILED: {run_root}: {pointer}: no such pointer"), none.stdout
    write_latest(run_root, 40)
    unc = cli("inspect", "--latest", run_root)
    assert unc.returncode == 1 and "names step 40, whose checkpoint" in unc.stderr and "not committed" in unc.stderr
    one = cli("verify", "--latest", os.path.join(run_root, STEPS[0]))
    assert one.returncode == 1 and "is not a run root" in one.stdout
    empty = tmp_path / "empty"
    empty.mkdir()  # no checkpoint under it: verified as it is, and it is not one
    assert cli("verify", "--quiet", str(empty)).stdout.startswith(f"NOT A CHECKPOINT: {empty}")


def test_convert_json_is_its_summary(run_checkpoints, tmp_path):
    src = os.path.join(run_checkpoints.root, STEPS[2])
    out = tmp_path / "st"
    r = cli("convert", src, "--to", "safetensors", str(out), "--quiet", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    saved = run_checkpoints.checkpoints[2]
    assert (doc["source"], doc["out"], doc["to"]) == (src, str(out), "safetensors")
    assert doc["source_format"] == "dcp_datastates"
    assert doc["tensors"] == len(saved.tensors) and doc["bytes"] == sum(t.nbytes for t in saved.tensors.values())
    assert sorted(doc["skipped"]) == sorted(saved.objects) and sorted(doc["files"]) == sorted(os.listdir(out))


def test_du_reports_a_partial_output_and_ls_does_not_list_it(run_root):
    out = os.path.join(run_root, "export")
    partial = temporary_path(out, "convert")  # where convert builds OUT: what a killed one leaves
    assert partial_output_of(os.path.basename(partial)) == "export"
    os.makedirs(partial)
    for name, size in (("rank00000-0123456789ab.data", 5000), ("rank00000-0123456789ab.index", 300)):
        with open(os.path.join(partial, name), "wb") as f:
            f.write(b"\1" * size)
    du = cli("du", run_root)
    assert du.returncode == 0, du.stderr
    row = next(ln for ln in du.stdout.splitlines() if ln.startswith(partial))
    assert row.split()[1:3] == ["partial", "2"], row
    assert "TOTAL (4 checkpoints, 1 partial)" in du.stdout
    assert "in 1 partial output of convert or export" in du.stdout.splitlines()[-1]
    doc = json.loads(cli("du", run_root, "--json").stdout)
    [p] = doc["partial_outputs"]
    assert (p["path"], p["state"], p["step"]) == (partial, "partial", None)
    assert (p["apparent_bytes"], p["other_bytes"], p["stray_bytes"], p["checkpoint_bytes"]) == (5300, 5300, 0, 0)
    assert partial not in [c["path"] for c in doc["checkpoints"]]
    assert doc["total"]["apparent_bytes"] == sum(u["apparent_bytes"] for u in doc["checkpoints"]) + 5300
    listed = json.loads(cli("ls", run_root, "--json").stdout)
    assert [c["name"] for c in listed["checkpoints"]] == [*STEPS, "step_00000040"]


@pytest.mark.s3
@pytest.mark.slow
def test_verify_latest_of_a_tier_root_url(s3_server, run_checkpoints):
    """A tier's root URL: every committed step, or the one its mirrored pointer names."""
    from dcp_datastates.manager.checkpoint_root import Pointer
    from dcp_datastates.storage import open_store

    url = f"s3://{s3_server.bucket}/cli_roots"
    store = open_store(url)
    for name in STEPS[:2]:
        local = os.path.join(run_checkpoints.root, name)
        for f in os.listdir(local):
            with open(os.path.join(local, f), "rb") as fh:
                store.put_bytes(f"{name}/{f}", fh.read())
    every = cli("verify", "--quiet", url)
    assert every.returncode == 0 and every.stdout.count("OK: ") == 2, every.stdout
    assert cli("verify", "--latest", url).stdout.startswith(f"FAILED: {url}: {url}/latest: no such pointer")
    store.put_bytes("latest", Pointer(10, None).encode())
    doc = json.loads(cli("verify", "--quiet", "--latest", "--json", url).stdout)
    assert [(c["path"], c["status"]) for c in doc["checkpoints"]] == [(f"{url}/{STEPS[0]}", "OK")]
    store.close()
