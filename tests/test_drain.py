"""Draining a committed checkpoint to a durable tier: verified copies, ``.metadata`` last,
crashes and corruption never committing anything on the durable tier."""

from __future__ import annotations

import os

import pytest
import torch

from conftest import FailingReads, assert_same, load, save
from dcp_datastates import DataStatesReader, verify
from dcp_datastates.errors import CorruptCheckpointError
from dcp_datastates.storage import StoreError, open_store
from dcp_datastates.storage.local import LocalStore
from dcp_datastates.tiers.drain import (
    DrainError,
    clear_incomplete_step,
    commit_durable,
    confirmation_key,
    drain_rank,
    durable_steps,
    failure_key,
    fetch_step,
)

pytestmark = [pytest.mark.s3, pytest.mark.slow]


def _state(seed=0):
    g = torch.Generator().manual_seed(seed)
    state = {f"w{i}": torch.randn(256, 1024, generator=g) for i in range(6)}  # 6 MiB: two stripes
    state.update({"small": torch.arange(10), "step": seed, "name": "run"})
    return state


def _rank_files(path):
    return DataStatesReader(path).read_metadata().storage_data.ranks


def _store(url):
    return open_store(url, **({"part_bytes": 5 << 20} if url.startswith("s3://") else {}))


def _drain(local, step_dir, store, **kw):
    drains = [drain_rank(LocalStore(str(local)), step_dir, files, store, block=1 << 20, **kw) for files in _rank_files(local)]
    commit_durable(LocalStore(str(local)), step_dir, store)
    return drains


def test_a_drained_checkpoint_is_committed_and_loads_from_the_durable_tier(tmp_path, durable_url):
    local = tmp_path / "step_00000005"
    state = _state(5)
    save(state, local, stripes=2, window_bytes=1 << 20)
    assert len(_rank_files(local)[0].stripes) == 1
    store = _store(durable_url)
    seen = []
    drains = _drain(local, "step_00000005", store, progress=seen.append)
    assert sum(seen) == sum(d.bytes for d in drains) == sum(os.path.getsize(local / f) for f in os.listdir(local) if f != ".metadata")
    assert durable_steps(store) == {5: ("step_00000005", True)}
    assert not [k for k in store.list() if "/.drain/" in k]  # confirmations removed after the commit
    assert store.read("step_00000005/.metadata") == (local / ".metadata").read_bytes()
    if not durable_url.startswith("s3://"):  # a shared file system: the copy is a checkpoint as it is
        assert verify(os.path.join(durable_url, "step_00000005")).ok
    fetched = tmp_path / "fetched"
    fetch_step(store, "step_00000005", LocalStore(str(fetched)), block=1 << 20, concurrency=3)  # ranges in flight, written at their offsets
    assert verify(fetched).ok
    out = {k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else None) for k, v in state.items()}
    assert_same(load(out, fetched), state)


def test_a_damaged_local_copy_is_never_uploaded(tmp_path, durable_url):
    local = tmp_path / "c"
    save(_state(1), local, window_bytes=1 << 20)
    files = _rank_files(local)[0]
    with open(local / files.data_file, "r+b") as f:  # one bit of a tensor, far into the file
        f.seek(3 << 20)
        b = f.read(1)
        f.seek(3 << 20)
        f.write(bytes([b[0] ^ 1]))
    store = _store(durable_url)
    with pytest.raises(CorruptCheckpointError, match="checksum mismatch.*not drained"):
        drain_rank(LocalStore(str(local)), "step_00000001", files, store, block=1 << 20)
    assert store.size(f"step_00000001/{files.data_file}") is None  # the upload was abandoned
    assert durable_steps(store) == {}


class _CrashingStore:
    """Forwards to a store and raises after ``allowed`` objects were written (a crash mid-drain)."""

    def __init__(self, store, allowed):
        self._store, self.allowed = store, allowed

    def __getattr__(self, name):
        return getattr(self._store, name)

    def _count(self):
        if self.allowed == 0:
            raise StoreError("crash")
        self.allowed -= 1

    def put_stream(self, *a, **k):
        self._count()
        return self._store.put_stream(*a, **k)

    def put_bytes(self, *a, **k):
        self._count()
        return self._store.put_bytes(*a, **k)

    def stage_bytes(self, *a, **k):  # the commit: .metadata staged, then published
        self._count()
        return self._store.stage_bytes(*a, **k)


@pytest.mark.parametrize("allowed", [0, 1, 2, 3, 4])  # before any object, mid-files, before the confirmation, before .metadata
def test_a_crash_mid_drain_leaves_nothing_committed_and_a_new_drain_commits(tmp_path, durable_url, allowed):
    local = tmp_path / "c"
    state = _state(2)
    save(state, local, stripes=2, window_bytes=1 << 20)
    store = _store(durable_url)
    crashing = _CrashingStore(store, allowed)
    with pytest.raises((StoreError, DrainError)):
        _drain(local, "step_00000002", crashing)
    assert durable_steps(store).get(2, ("", False))[1] is False
    with pytest.raises(DrainError, match="not a committed checkpoint"):
        fetch_step(store, "step_00000002", LocalStore(str(tmp_path / "f")))
    if store.list():
        assert clear_incomplete_step(store, "step_00000002")
    _drain(local, "step_00000002", store)
    fetch_step(store, "step_00000002", LocalStore(str(tmp_path / "f2")))
    assert verify(tmp_path / "f2").ok


def test_a_failed_fetch_leaves_no_checkpoint_and_no_temporaries(tmp_path, durable_url):
    local = tmp_path / "step_00000003"
    state = _state(3)
    save(state, local, window_bytes=1 << 20)
    store = _store(durable_url)
    _drain(local, "step_00000003", store)
    dest = tmp_path / "fetched"
    with pytest.raises(StoreError, match="connection reset"):
        # one ranged read in the middle of a data file fails
        failing = FailingReads(store, lambda key, offset: key.endswith(".data") and offset == 2 << 20)
        fetch_step(failing, "step_00000003", LocalStore(str(dest)), block=1 << 20, concurrency=4)
    assert not (dest / ".metadata").exists()
    assert not [n for n in os.listdir(dest) if ".fetch-" in n]
    fetch_step(store, "step_00000003", LocalStore(str(dest)), block=1 << 20)  # a retry completes it
    out = {k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else None) for k, v in state.items()}
    assert_same(load(out, dest), state)


def test_the_commit_waits_for_every_rank_and_checks_what_it_confirmed(tmp_path, durable_url):
    local = tmp_path / "c"
    save(_state(3), local)
    store = _store(durable_url)
    with pytest.raises(DrainError, match=r"ranks \[0\] did not confirm"):
        commit_durable(LocalStore(str(local)), "step_00000003", store, timeout_s=0.5)
    files = _rank_files(local)[0]
    drain_rank(LocalStore(str(local)), "step_00000003", files, store)
    store.delete([f"step_00000003/{files.index_file}"])
    with pytest.raises(DrainError, match="None bytes in the store"):
        commit_durable(LocalStore(str(local)), "step_00000003", store)
    assert store.size("step_00000003/.metadata") is None


def test_the_commit_stops_waiting_for_a_rank_that_reported_its_failure(tmp_path, durable_url):
    import time

    local = tmp_path / "c"
    save(_state(5), local)
    store = _store(durable_url)
    store.put_bytes(failure_key("step_00000005", 0), b"StoreError: the disk is full")
    t = time.perf_counter()
    with pytest.raises(DrainError, match="rank 0's drain failed .StoreError: the disk is full"):
        commit_durable(LocalStore(str(local)), "step_00000005", store, timeout_s=60)
    assert time.perf_counter() - t < 10
    _drain(local, "step_00000005", store)  # a new drain of the rank clears its failure and commits
    assert durable_steps(store) == {5: ("step_00000005", True)}
    files = _rank_files(local)[0]  # draining it again once committed changes nothing there
    before = {k: store.size(k) for k in store.list()}
    drain_rank(LocalStore(str(local)), "step_00000005", files, store)
    assert {k: store.size(k) for k in store.list()} == before


def test_deleting_a_durable_step_removes_the_commit_first(tmp_path, durable_url):
    local = tmp_path / "c"
    save(_state(4), local)
    store = _store(durable_url)
    _drain(local, "step_00000004", store)
    _drain(local, "step_00000008", store)
    store.delete_checkpoint("step_00000004")
    assert durable_steps(store) == {8: ("step_00000008", True)}
    assert not clear_incomplete_step(store, "step_00000008")  # committed: left alone
    assert confirmation_key("step_00000008", 3) == "step_00000008/.drain/rank00003.json"


def test_a_local_read_error_is_named_and_is_not_taken_for_an_outage_of_the_store(tmp_path):
    """The drain's own reads of the local copy: a failure names the local file and is a
    DrainError, never a StoreError the drain would retry as if the store were down."""
    from dcp_datastates.manager.durable_tier import is_outage
    from dcp_datastates.tiers.drain import DrainError, _local_blocks

    where = tmp_path / "rank00000-0123456789ab.data"
    where.mkdir()  # reading it fails (EISDIR), as a failing disk would with EIO
    with pytest.raises(DrainError, match=str(where)) as info:
        list(_local_blocks(LocalStore(str(tmp_path)), where.name, 1 << 20, None, [0], 1 << 20))
    assert not is_outage(info.value)
