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


def _load(tmp_path, case, world, path, **kwargs) -> list[dict]:
    """Run ``case``, which loads reading once and not; each rank's figures of both."""
    out = tmp_path / f"out-{case}"
    out.mkdir()
    _cases().run_ranks(case, world, tmp_path / "logs", path=str(path), out=str(out), **kwargs)
    return _reports(out)


def _sum(reports, variant, field) -> int:
    return sum(r[variant][field] for r in reports)


def test_ddp_replicated_state_is_read_once_and_lands_bit_exact_on_every_rank(tmp_path):
    path = tmp_path / "ckpt"
    _cases().run_ranks("ddp_save", 4, tmp_path / "logs", path=str(path))
    got = _load(tmp_path, "ddp_load", 4, path)
    stored = _stored(path)
    assert _sum(got, "once", "read") <= 1.05 * stored
    assert all(r["once"]["read"] > 0 for r in got)  # the reads are shared out
    assert _sum(got, "every", "read") >= 3.9 * _sum(got, "once", "read")  # each rank read it all
    assert _sum(got, "once", "received") >= 2.9 * stored and not _sum(got, "every", "received")
    # The defaults: a few MiB read by every rank is below the bytes worth the exchange.
    assert not _sum(got, "default", "received") and _sum(got, "default", "read") == _sum(got, "every", "read")


def test_hsdp_replicas_read_each_shard_once(tmp_path):
    path = tmp_path / "ckpt"
    got = _load(tmp_path, "hsdp_save_load", 8, path)
    stored = _stored(path)
    assert _sum(got, "once", "read") <= 1.05 * stored
    assert _sum(got, "every", "read") >= 3.9 * stored  # each shard read by its 4 replicas


def test_resharded_loads_share_the_chunks_ranks_cut_through(tmp_path):
    path = tmp_path / "ckpt"
    DIST_CASES.run_ranks("save_dtensor_state", 2, tmp_path / "logs", default_path=str(path),
                         planner_path=str(tmp_path / "planner"))
    got = _load(tmp_path, "reshard_load", 3, path)
    assert _sum(got, "once", "read") < _sum(got, "every", "read")
    assert _sum(got, "once", "read") <= 1.05 * _stored(path)


def test_damaged_bytes_are_named_on_every_rank(tmp_path):
    path = tmp_path / "ckpt"
    _cases().run_ranks("ddp_save", 4, tmp_path / "logs", path=str(path))
    data = sorted(f for f in os.listdir(path) if f.endswith(".data"))[1]
    got = _load(tmp_path, "ddp_load_fails", 4, path, flip_rank=2, damage=str(path / data))
    flight = [r["in flight"] for r in got]
    assert all(e and e.startswith("ChecksumMismatchError") for e in flight), flight
    assert any("received from rank 2" in e for e in flight), flight
    source = [r["source"] for r in got]
    assert all(e and e.startswith("ChecksumMismatchError") and data in e for e in source), source


@pytest.mark.s3
def test_read_once_from_object_storage(tmp_path, s3_server):
    url = f"s3://{s3_server.bucket}/read-once-{os.getpid()}-{tmp_path.name}"
    _cases().run_ranks("ddp_save", 4, tmp_path / "logs", path=url)
    got = _load(tmp_path, "ddp_load", 4, url)
    assert _sum(got, "every", "read") >= 3.9 * _sum(got, "once", "read")
    assert _sum(got, "once", "received") > 0
