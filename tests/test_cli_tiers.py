"""The CLI on durable tiers: ``ls`` of a tier and of a root with ``--durable``, ``verify`` and
``du`` of a durable copy, without a local copy."""

from __future__ import annotations

import json
import os

import pytest

from cli_checkpoints import run_cli, run_program
from dcp_datastates.manager import CheckpointManager, CheckpointManagerOptions
from dcp_datastates.storage import open_store
from manager_workers import state_at

pytestmark = [pytest.mark.s3, pytest.mark.slow]


def cli(*argv):
    r = run_cli(*argv)
    return r.returncode, r.stdout, r.stderr


@pytest.fixture
def drained(tmp_path, durable_url):
    root = tmp_path / "run"
    with CheckpointManager(root, CheckpointManagerOptions(keep_last=1, durable=durable_url, async_save=False)) as mgr:
        for step in (10, 20):
            mgr.save(step, state_at(step))
        mgr.wait_durable()
    store = open_store(durable_url)
    store.put_bytes("step_00000030/rank00000-0123456789ab.data", b"a drain that never finished")
    return root, durable_url, store


def test_ls_of_a_durable_tier_and_of_a_root_with_its_tier(drained):
    root, url, _ = drained
    r = run_program("ls", url, "--json")  # the program itself, on the tier (S3: its endpoint from the environment)
    rc, out = r.returncode, r.stdout
    assert rc == 0, r.stderr
    steps = {c["step"]: c["state"] for c in json.loads(out)["checkpoints"]}
    assert steps == {10: "committed", 20: "committed", 30: "incomplete"}
    rc, out, _ = cli("ls", str(root), "--durable", url)
    assert rc == 0 and "DURABLE" in out
    assert any("20" in line and "committed" in line for line in out.splitlines())
    assert any(line.split()[:1] == ["10"] and "durable only" in line for line in out.splitlines()), out
    rc, out, _ = cli("ls", str(root), "--durable", url, "--json")
    doc = json.loads(out)
    assert doc["checkpoints"][0]["durable"] == "committed" and doc["durable_only"] == [10, 30]


def test_verify_and_du_of_durable_copies(drained):
    _root, url, store = drained
    if url.startswith("s3://"):
        rc, out, _ = cli("verify", url)  # every committed step under a tier's URL
    else:  # a shared file system's copies are checkpoint directories for the local tools
        rc, out, _ = cli("verify", f"{url}/step_00000010", f"{url}/step_00000020")
    assert rc == 0 and out.count("OK: ") == 2, out
    rc, out, _ = cli("verify", f"{url}/step_00000030")
    assert rc == 1 and "NOT COMMITTED" in out, out
    rc, out, _ = cli("du", url, "--json")
    usage = {u["step"]: u for u in json.loads(out)["checkpoints"]}
    assert usage[10]["stray_bytes"] == 0 and usage[10]["checkpoint_bytes"] > 4 << 20
    assert usage[30]["stray_bytes"] == usage[30]["apparent_bytes"] > 0
    # one flipped byte in a durable data object: verify names it
    key = next(k for k in store.list("step_00000020/") if k.endswith(".data"))
    data = bytearray(store.read(key))
    data[1000] ^= 0xFF
    store.delete([key])
    store.put_bytes(key, bytes(data))
    rc, out, _ = cli("verify", f"{url}/step_00000020")
    assert rc == 1 and "CORRUPT" in out and "checksum mismatch" in out, out


def test_a_durable_tier_that_cannot_be_reached_fails_verify_with_its_url():
    pytest.importorskip("obstore")
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "x")
    rc, out, _ = cli("verify", "s3://nobucket/p/step_00000001")
    assert rc == 1 and "s3://nobucket/p" in out


def test_every_command_that_reads_a_checkpoint_takes_its_url(tmp_path, s3_server):
    """inspect, verify --digests, diff, convert and export read a checkpoint in object storage
    as they read a directory (ranged reads, nothing copied to the local disk first)."""
    import torch
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file

    from dcp_datastates import DataStatesWriter

    g = torch.Generator().manual_seed(9)
    state = {"model": {"w": torch.randn(256, 64, generator=g), "b": torch.randn(64, generator=g)}, "step": 3}
    url = f"s3://{s3_server.bucket}/cli-{os.getpid()}-{id(state):x}/step_00000003"
    dcp.save(state, storage_writer=DataStatesWriter(url, record_digests=True), no_dist=True)
    dcp.save(state, storage_writer=DataStatesWriter(tmp_path / "local"), no_dist=True)

    rc, out, err = cli("inspect", url, "--json")
    assert rc == 0, err
    info = json.loads(out)
    assert {k["key"] for k in info["keys"]} >= {"model.w", "model.b", "step"}
    assert all(f["bytes"] for f in info["files"])
    rc, out, _ = cli("verify", "--digests", url)
    assert rc == 0 and "OK: " in out and "content digest(s) recomputed" in out, out
    rc, out, err = cli("diff", url, str(tmp_path / "local"), "--json")
    assert rc == 0, err
    doc = json.loads(out)
    assert doc["compared"] == 2 and doc["unchanged"] == 2 and not doc["objects_changed"], out
    rc, out, err = cli("convert", url, str(tmp_path / "st"), "--to", "safetensors", "--quiet")
    assert rc == 0, err
    tensors = {}
    for name in os.listdir(tmp_path / "st"):
        if name.endswith(".safetensors"):
            tensors.update(load_file(str(tmp_path / "st" / name)))
    assert torch.equal(tensors["model.w"], state["model"]["w"]) and torch.equal(tensors["model.b"], state["model"]["b"])
    pytest.importorskip("h5py")
    rc, out, err = cli("export", url, "--format", "hdf5", "--out", str(tmp_path / "x.h5"), "--quiet")
    assert rc == 0, err
    import h5py

    with h5py.File(tmp_path / "x.h5") as f:
        assert url in str(f.attrs["checkpoints"])
