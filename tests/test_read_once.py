"""Read-once loads: saved bytes several ranks need are read from storage by one of them and
passed to the others over the exchange (DataStatesReader(read_once=True), the default), bit
for bit, with every byte verified where it lands. DDP-replicated state, HSDP (2 shards x 4
replicas on 8 ranks), resharded loads, damage at the source and on the way, and s3://.
Worker cases: tests/support/exchange_workers.py."""

from __future__ import annotations

import json
import os

import pytest
from dist_helpers import CASES as DIST_CASES

pytestmark = [pytest.mark.dist, pytest.mark.subprocess, pytest.mark.slow]


def _cases():
    import exchange_workers

    return exchange_workers.CASES


def _reports(out) -> list[dict]:
    return [json.load(open(os.path.join(out, f))) for f in sorted(os.listdir(out), key=lambda n: int(n[4:-5]))]


def _stored(path) -> int:
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".data"))


def _load(tmp_path, case, world, path, read_once, **kwargs) -> list[dict]:
    out = tmp_path / f"out-{case}-{read_once}"
    out.mkdir()
    _cases().run_ranks(case, world, tmp_path / "logs", path=str(path), out=str(out), read_once=read_once, **kwargs)
    return _reports(out)


def test_ddp_replicated_state_is_read_once_and_lands_bit_exact_on_every_rank(tmp_path):
    path = tmp_path / "ckpt"
    _cases().run_ranks("ddp_save", 4, tmp_path / "logs", path=str(path))
    once = _load(tmp_path, "ddp_load", 4, path, True)
    every = _load(tmp_path, "ddp_load", 4, path, False)
    stored = _stored(path)
    assert sum(r["read"] for r in once) <= 1.05 * stored
    assert all(r["read"] > 0 for r in once)  # the reads are shared out
    assert sum(r["read"] for r in every) >= 3.9 * sum(r["read"] for r in once)  # each rank read it all
    assert sum(r["received"] for r in once) >= 2.9 * stored and not any(r["received"] for r in every)


def test_hsdp_replicas_read_each_shard_once(tmp_path):
    path = tmp_path / "ckpt"
    once = _load(tmp_path, "hsdp_save_load", 8, path, True)
    every = _load(tmp_path, "hsdp_save_load", 8, path, False)
    stored = _stored(path)
    assert sum(r["read"] for r in once) <= 1.05 * stored
    assert sum(r["read"] for r in every) >= 3.9 * stored  # each shard read by its 4 replicas


def test_resharded_loads_share_the_chunks_ranks_cut_through(tmp_path):
    path = tmp_path / "ckpt"
    DIST_CASES.run_ranks("save_dtensor_state", 2, tmp_path / "logs", default_path=str(path),
                         planner_path=str(tmp_path / "planner"))
    once = _load(tmp_path, "reshard_load", 3, path, True)
    every = _load(tmp_path, "reshard_load", 3, path, False)
    assert sum(r["read"] for r in once) < sum(r["read"] for r in every)
    assert sum(r["read"] for r in once) <= 1.05 * _stored(path)


@pytest.mark.parametrize("where", ["source", "in flight"])
def test_damaged_bytes_are_named_on_every_rank(tmp_path, where):
    path = tmp_path / "ckpt"
    _cases().run_ranks("ddp_save", 4, tmp_path / "logs", path=str(path))
    flip = -1
    if where == "source":
        data = sorted(f for f in os.listdir(path) if f.endswith(".data"))[1]
        blob = bytearray((path / data).read_bytes())
        blob[len(blob) // 3] ^= 0x10
        (path / data).write_bytes(blob)
    else:
        flip = 2
    out = tmp_path / "out"
    out.mkdir()
    _cases().run_ranks("ddp_load_fails", 4, tmp_path / "logs", path=str(path), out=str(out), flip_rank=flip)
    errors = [r["error"] for r in _reports(out)]
    assert all(e and e.startswith("ChecksumMismatchError") for e in errors), errors
    if where == "source":
        assert all(data in e for e in errors), errors
    else:
        assert any("received from rank 2" in e for e in errors), errors


@pytest.mark.s3
def test_read_once_from_object_storage(tmp_path, s3_server):
    url = f"s3://{s3_server.bucket}/read-once-{os.getpid()}-{tmp_path.name}"
    _cases().run_ranks("ddp_save", 4, tmp_path / "logs", path=url)
    once = _load(tmp_path, "ddp_load", 4, url, True)
    every = _load(tmp_path, "ddp_load", 4, url, False)
    assert sum(r["read"] for r in every) >= 3.9 * sum(r["read"] for r in once)
    assert sum(r["received"] for r in once) > 0
