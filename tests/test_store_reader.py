"""StoreReader: a checkpoint loaded straight from a durable store (a directory on a second
filesystem, and a prefix of a real SeaweedFS bucket), with ranged reads, verified."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed.checkpoint as dcp

from conftest import FailingReads, assert_same, data_files, raises_from_checkpoint, save, zeros_like_state
from dcp_datastates import ChecksumMismatchError, CorruptCheckpointError
from dcp_datastates.errors import CheckpointNotFoundError, IncompleteCheckpointError
from dcp_datastates.format.file_names import METADATA_FILE
from dcp_datastates.storage import Store, StoreError, open_store
from dcp_datastates import StoreReader
from test_reshard_verify import _SliceLoadPlanner

pytestmark = [pytest.mark.s3, pytest.mark.slow]


@pytest.fixture
def store(durable_url):
    st = open_store(durable_url)
    yield st
    st.close()


def upload(local_dir, store, prefix: str) -> None:
    """The checkpoint's files into ``prefix/`` of the store, ``.metadata`` last (as a drain commits)."""
    names = sorted(n for n in os.listdir(local_dir) if n != METADATA_FILE)
    for name in [*names, METADATA_FILE]:
        store.put_file(f"{prefix}/{name}", os.path.join(local_dir, name))


def _state():
    g = torch.Generator().manual_seed(7)
    return {
        "big": torch.randn(3 << 18, generator=g),  # 3 MiB: split into several ranged reads below
        "small": {f"p{i}": torch.randn(17, 3, generator=g) for i in range(40)},  # merged into few reads
        "half": torch.randn(64, 64, generator=g).to(torch.bfloat16),
        "ints": torch.arange(1000, dtype=torch.int64),
        "scalar": torch.tensor(3.5),
        "extra": {"epoch": 4, "name": "run-a", "lr": [0.1, 0.01]},
    }


def _replace(store, key, data) -> None:
    """Damage an object in place (a directory store never replaces one: delete it first)."""
    store.delete([key])
    store.put_bytes(key, bytes(data))


class _Counting:
    """A store that counts the reads a load asks of it."""

    def __init__(self, store):
        self.inner, self.ranges = store, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def read_range(self, key, offset, length):
        self.ranges.append((key, offset, length))
        return self.inner.read_range(key, offset, length)

    def read_into(self, key, offset, out):
        self.ranges.append((key, offset, len(out)))
        return self.inner.read_into(key, offset, out)

    def read_batch(self, reads, threads=None):  # the ranged reads an object store makes, counted
        return Store.read_batch(self, reads, threads=threads)


@pytest.mark.parametrize("writer_kwargs", [{}, {"stripes": 3}, {"compression": "zstd"}], ids=["plain", "stripes", "zstd"])
def test_loads_bit_exact_from_the_store(tmp_path, store, writer_kwargs):
    if writer_kwargs.get("compression"):
        pytest.importorskip("zstandard")
    state = _state()
    save(state, tmp_path / "c", window_bytes=256 << 10, host_cache_bytes=1 << 20, **writer_kwargs)
    upload(tmp_path / "c", store, "step_00000010")
    counting = _Counting(store)
    counting.range_bytes = 1 << 20
    reader = StoreReader("step_00000010", store=counting)
    out = zeros_like_state(state)
    dcp.load(out, storage_reader=reader, no_dist=True)
    assert_same(out, state)
    data_reads = [r for r in counting.ranges if ".data" in r[0]]
    assert max(length for _, _, length in data_reads) <= 1 << 20  # split at range_bytes
    if not writer_kwargs:
        # 45 items: the big tensor in 3-4 pieces, every small one merged with its neighbours
        assert len(data_reads) <= 8, data_reads


def test_loads_from_its_own_url(tmp_path, durable_url):
    state = _state()
    save(state, tmp_path / "c")
    st = open_store(durable_url)
    upload(tmp_path / "c", st, "step_00000020")
    st.close()
    reader = StoreReader(f"{durable_url}/step_00000020")
    out = zeros_like_state(state)
    dcp.load(out, storage_reader=reader, no_dist=True)
    assert_same(out, state)
    reader.close()
    # dcp.load's checkpoint_id names the checkpoint too
    out = zeros_like_state(state)
    dcp.load(out, storage_reader=StoreReader(), checkpoint_id=f"{durable_url}/step_00000020", no_dist=True)
    assert_same(out, state)


def test_reshards_a_two_rank_checkpoint(sharded_checkpoint, store):
    upload(sharded_checkpoint.path, store, "sharded")
    out = {k: torch.zeros_like(v) for k, v in sharded_checkpoint.tensors.items()}
    dcp.load(out, storage_reader=StoreReader("sharded", store=store), no_dist=True)
    for key, tensor in sharded_checkpoint.tensors.items():
        assert torch.equal(out[key], tensor), key


def test_a_slice_is_verified_through_its_whole_segments(tmp_path, store):
    full = torch.randn(4096, 64)
    save({"w": full}, tmp_path / "c", window_bytes=64 << 10, host_cache_bytes=256 << 10)
    upload(tmp_path / "c", store, "s")
    dest = {"w": torch.zeros(100, 64)}
    dcp.load(dest, storage_reader=StoreReader("s", store=store), planner=_SliceLoadPlanner(1000), no_dist=True)
    assert torch.equal(dest["w"], full[1000:1100])
    # A flipped byte outside the rows read, inside a segment they touch: caught.
    name = data_files(tmp_path / "c")[0]
    data = bytearray(store.read(f"s/{name}"))
    pos = ((1000 * 64 * 4) // (64 << 10)) * (64 << 10)
    data[pos] ^= 1
    _replace(store, f"s/{name}", bytes(data))
    with raises_from_checkpoint(ChecksumMismatchError, match=f"{name} while reading 'w': checksum mismatch for {64 << 10} bytes at offset {pos}"):
        dcp.load({"w": torch.zeros(100, 64)}, storage_reader=StoreReader("s", store=store),
                 planner=_SliceLoadPlanner(1000), no_dist=True)


def test_corrupt_object_is_a_checksum_error_naming_object_and_key(tmp_path, store):
    state = {"a": torch.randn(1000), "b": torch.randn(1000)}
    save(state, tmp_path / "c")
    upload(tmp_path / "c", store, "bad")
    name = data_files(tmp_path / "c")[0]
    data = bytearray(store.read(f"bad/{name}"))
    data[10] ^= 0x40
    _replace(store, f"bad/{name}", bytes(data))
    with raises_from_checkpoint(ChecksumMismatchError, match=f"bad/{name} while reading 'a'"):
        dcp.load(zeros_like_state(state), storage_reader=StoreReader("bad", store=store), no_dist=True)
    out = zeros_like_state(state)  # unverified, as asked: the load goes through
    dcp.load(out, storage_reader=StoreReader("bad", store=store, verify=False), no_dist=True)


@pytest.mark.parametrize("target", ["big:first", "big:last", "small.p30", "extra.name", "zstd:big"])
def test_every_kind_of_read_is_verified(tmp_path, store, target):
    """A flipped byte is caught in the first and the last piece of a split read, in a later part
    of a merged range, in an object, and in a compressed chunk's frames."""
    compressed = target.startswith("zstd:")
    if compressed:
        pytest.importorskip("zstandard")
    state = _state()
    save(state, tmp_path / "c", window_bytes=256 << 10, host_cache_bytes=1 << 20,
         **({"compression": "zstd"} if compressed else {}))
    upload(tmp_path / "c", store, "x")
    key, _, where = target.removeprefix("zstd:").partition(":")
    reader = StoreReader("x", store=store)
    layout = reader.load_metadata().storage_data
    loc = next(loc for index, loc in layout.locations.items() if index.fqn == key)
    if loc.is_object:
        offset, length = reader.rank_index(loc.relative_path).objects[loc.object_ordinal]
    else:
        offset, length = loc.offset, loc.length
    pos = offset + (length - 7 if where == "last" else length // 2)
    name = data_files(tmp_path / "c")[0]
    data = bytearray(store.read(f"x/{name}"))
    data[pos] ^= 0x10
    _replace(store, f"x/{name}", data)
    with raises_from_checkpoint((ChecksumMismatchError, CorruptCheckpointError), match=f"'{key}'"):
        dcp.load(zeros_like_state(state), storage_reader=StoreReader("x", store=store), no_dist=True)


def test_missing_and_incomplete_checkpoints_are_named(tmp_path, store):
    state = {"a": torch.randn(100)}
    save(state, tmp_path / "c")
    with pytest.raises(CheckpointNotFoundError, match="no checkpoint at .*nothing: (.metadata is missing|the directory does not exist)"):
        StoreReader("nothing", store=store).read_metadata()
    # Through dcp.load: torch 2.13 wraps the message in an AssertionError (tests/test_errors.py)
    with raises_from_checkpoint((CheckpointNotFoundError, AssertionError), match="nothing: "):
        dcp.load(zeros_like_state(state), storage_reader=StoreReader("nothing", store=store), no_dist=True)
    for name in data_files(tmp_path / "c"):  # a drain interrupted before its .metadata
        store.put_file(f"partial/{name}", os.path.join(tmp_path / "c", name))
    with pytest.raises(IncompleteCheckpointError, match="partial is incomplete.*never committed"):
        StoreReader("partial", store=store).read_metadata()
    upload(tmp_path / "c", store, "noindex")
    index = next(k for k in store.list("noindex/") if k.endswith(".index"))
    store.delete([index])
    with raises_from_checkpoint(CorruptCheckpointError, match=f"{index} is missing"):
        dcp.load(zeros_like_state(state), storage_reader=StoreReader("noindex", store=store), no_dist=True)


def test_a_truncated_object_is_refused_before_reading(tmp_path, store):
    state = {"a": torch.randn(5000)}
    save(state, tmp_path / "c")
    upload(tmp_path / "c", store, "short")
    name = data_files(tmp_path / "c")[0]
    _replace(store, f"short/{name}", store.read(f"short/{name}")[:1000])
    with raises_from_checkpoint(CorruptCheckpointError, match=f"{name} is truncated"):
        dcp.load(zeros_like_state(state), storage_reader=StoreReader("short", store=store), no_dist=True)


def test_a_failed_read_names_the_object_and_the_keys(tmp_path, store):
    state = {"a": torch.randn(100_000)}
    save(state, tmp_path / "c")
    upload(tmp_path / "c", store, "flaky")

    failing = FailingReads(store, lambda key, _offset: ".data" in key)
    with raises_from_checkpoint(StoreError, match=".data: connection reset (loading 'a')"):
        dcp.load(zeros_like_state(state), storage_reader=StoreReader("flaky", store=failing), no_dist=True)


def test_follows_an_incremental_checkpoints_references_from_its_own_url(tmp_path, durable_url):
    """Opened at a step's URL, the reader reads its base beside it (the store is opened at the
    parent, as a local reader resolves ``../<base>/`` in the parent directory); a checkpoint at
    the store's own root has no sibling to refer to, and says so."""
    state = {"frozen": torch.randn(1 << 18), "hot": torch.randn(1 << 16), "step": 1}
    save(state, tmp_path / "step_1", record_digests=True)
    state["hot"].add_(1)
    state["step"] = 2
    save(state, tmp_path / "step_2", base=tmp_path / "step_1")
    st = open_store(durable_url)
    upload(tmp_path / "step_1", st, "step_1")
    upload(tmp_path / "step_2", st, "step_2")
    st.close()
    reader = StoreReader(f"{durable_url}/step_2")
    reader.read_metadata()
    assert reader.layout.bases == ["step_1"]
    out = zeros_like_state(state)
    dcp.load(out, storage_reader=reader, no_dist=True)
    assert_same(out, state)
    reader.close()
    at_root = open_store(f"{durable_url}/step_2")
    try:
        with raises_from_checkpoint(CorruptCheckpointError, match="outside the store's root"):
            dcp.load(zeros_like_state(state), storage_reader=StoreReader(".", store=at_root), no_dist=True)
    finally:
        at_root.close()


def test_a_checkpoint_url_splits_into_its_parent_store_and_name(tmp_path, monkeypatch):
    from dcp_datastates.storage.url import split_parent as split_checkpoint_url

    assert split_checkpoint_url("s3://b/run/step_1/") == ("s3://b/run", "step_1")
    assert split_checkpoint_url("s3://b/step_1") == ("s3://b", "step_1")
    assert split_checkpoint_url("s3://b") == ("s3://b", "")
    assert split_checkpoint_url(tmp_path / "run" / "step_1") == (str(tmp_path / "run"), "step_1")
    monkeypatch.chdir(tmp_path)
    assert split_checkpoint_url("run/step_1") == (str(tmp_path / "run"), "step_1")
    for bad, why in [("s3://b/run/.", "'.' or '..' parts"), ("s3://b/run//s", "'.' or '..' parts"),
                     ("s3:///s", "names no bucket"), ("gs://b/run/s", "unsupported URL")]:
        with pytest.raises(ValueError, match=why):
            split_checkpoint_url(bad)
        with pytest.raises(ValueError, match=why):
            StoreReader(bad).read_metadata()
