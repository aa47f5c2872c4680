"""Saving straight to object storage: ``DataStatesWriter("s3://...")`` streams each rank's files
from the engine's pool by multipart upload and commits ``.metadata`` last, against a real
SeaweedFS server; sync, async, two ranks, overwrite, and failures that leave nothing committed."""

from __future__ import annotations

import os
import uuid

import pytest
import torch
import torch.distributed.checkpoint as dcp

from conftest import assert_same, raises_from_checkpoint, zeros_like_state
from dcp_datastates import CheckpointExistsError, DataStatesReader, DataStatesWriter, install_fence, verify
from dcp_datastates.format.file_names import METADATA_FILE
from dcp_datastates.storage import StoreError, open_store
from dcp_datastates.storage.url import split_parent

pytestmark = [pytest.mark.s3, pytest.mark.dist, pytest.mark.slow]


def _state(seed=5):
    g = torch.Generator().manual_seed(seed)
    return {
        "big": torch.randn(3 << 20, generator=g),  # 12 MiB: more than two 5 MiB parts, many windows
        "w": torch.randn(300, 77, generator=g),
        "t": torch.randn(64, 48, generator=g).t(),  # not contiguous
        "half": torch.randn(33, 65, generator=g).to(torch.bfloat16),
        "step": 7,
        "extra": {"name": "run", "lrs": [0.1, 0.01]},
    }


_SMALL = {"host_cache_bytes": 4 << 20, "window_bytes": 512 << 10, "store_options": {"part_bytes": 5 << 20}}


@pytest.fixture
def url(s3_server):
    return f"s3://{s3_server.bucket}/direct-{uuid.uuid4().hex[:8]}/step_00000001"


def _keys(url):
    root, name = split_parent(url)
    store = open_store(root)
    try:
        return sorted(k[len(name) + 1:] for k in store.list(f"{name}/"))
    finally:
        store.close()


@pytest.mark.parametrize("stripes", [1, 3])
def test_a_save_streams_to_object_storage_and_loads_back_bit_exact(url, stripes):
    state = _state()
    writer = DataStatesWriter(url, stripes=stripes, **_SMALL)
    dcp.save(state, storage_writer=writer, no_dist=True)
    assert writer.last_save_stats.direct_io is False
    names = _keys(url)
    assert METADATA_FILE in names and all(n == METADATA_FILE or n.startswith("rank00000-") for n in names), names
    assert (sum(n.endswith(".data") for n in names) > 1) == (stripes > 1)
    out = zeros_like_state(state)
    dcp.load(out, storage_reader=DataStatesReader(url), no_dist=True)
    assert_same(out, state)
    report = verify(url)
    assert report.ok and report.padding_bytes_checked > 0, report.summary()


def test_dcp_save_and_load_take_the_url_as_checkpoint_id(url):
    state = _state(6)
    dcp.save(state, storage_writer=DataStatesWriter(**_SMALL), checkpoint_id=url, no_dist=True)
    out = zeros_like_state(state)
    dcp.load(out, storage_reader=DataStatesReader(), checkpoint_id=url, no_dist=True)
    assert_same(out, state)


def test_async_save_stages_into_the_pool_and_the_upload_drains_it(url):
    model = torch.nn.Linear(512, 512)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    install_fence(opt)  # the step waits only while a snapshot is copying
    writer = DataStatesWriter(url, **_SMALL)
    state = {"model": model.state_dict(), "step": 1}
    expected = {"model": {k: v.clone() for k, v in model.state_dict().items()}, "step": 1}
    response = dcp.async_save(state, storage_writer=writer, no_dist=True)
    model(torch.randn(4, 512)).sum().backward()
    opt.step()  # after the fence: the saved bytes are the state at the call
    response.upload_completion.result()
    writer.close()
    out = zeros_like_state(expected)
    dcp.load(out, storage_reader=DataStatesReader(url), no_dist=True)
    assert_same(out, expected)
    assert not torch.equal(model.weight, expected["model"]["weight"])


def test_a_committed_checkpoint_is_refused_unless_overwritten(url):
    first, second = _state(1), _state(2)
    dcp.save(first, storage_writer=DataStatesWriter(url, **_SMALL), no_dist=True)
    old = _keys(url)
    with raises_from_checkpoint(CheckpointExistsError, match="overwrite=True"):
        dcp.save(second, storage_writer=DataStatesWriter(url, **_SMALL), no_dist=True)
    assert _keys(url) == old  # nothing of the refused save was written
    dcp.save(second, storage_writer=DataStatesWriter(url, overwrite=True, **_SMALL), no_dist=True)
    new = _keys(url)
    assert not set(new) & (set(old) - {METADATA_FILE})  # the replaced checkpoint's objects are gone
    out = zeros_like_state(second)
    dcp.load(out, storage_reader=DataStatesReader(url), no_dist=True)
    assert_same(out, second)


def test_a_failed_upload_fails_the_save_and_commits_nothing(url, monkeypatch):
    from dcp_datastates.storage.s3 import S3Store

    real = S3Store.put_stream
    sent = []

    def failing(self, key, blocks, size, progress=None, **options):
        def counted():
            for data in blocks:
                sent.append(len(data))
                if sum(sent) > (6 << 20):
                    raise StoreError(f"{self.where(key)}: connection reset", transient=True)
                yield data
        return real(self, key, counted(), size, progress, **options)

    monkeypatch.setattr(S3Store, "put_stream", failing)
    with raises_from_checkpoint(StoreError, match="connection reset"):
        dcp.save(_state(), storage_writer=DataStatesWriter(url, stripes=1, **_SMALL), no_dist=True)
    monkeypatch.setattr(S3Store, "put_stream", real)
    assert METADATA_FILE not in _keys(url)
    assert _keys(url) == []  # the failed save's objects were removed
    # The engine's pool is whole again: the next save into the same place succeeds.
    state = _state(3)
    dcp.save(state, storage_writer=DataStatesWriter(url, **_SMALL), no_dist=True)
    out = zeros_like_state(state)
    dcp.load(out, storage_reader=DataStatesReader(url), no_dist=True)
    assert_same(out, state)


def test_an_object_that_reads_back_wrong_fails_the_save(url, monkeypatch):
    """The read-back after each upload compares the stored bytes with those sent."""
    from dcp_datastates.storage import store as store_module

    real = store_module.StoredFile.crc32c
    monkeypatch.setattr(store_module.StoredFile, "crc32c", lambda self, start, end, crc=0: real(self, start, end, crc) ^ 1)
    with raises_from_checkpoint(StoreError, match="reads back with CRC-32C"):
        dcp.save(_state(), storage_writer=DataStatesWriter(url, **_SMALL), no_dist=True)
    monkeypatch.undo()
    assert _keys(url) == []


def test_what_a_direct_save_does_not_do_is_refused_naming_the_alternative(url, tmp_path):
    with pytest.raises(ValueError, match="durable=URL"):
        DataStatesWriter(url, compression="zstd")
    with pytest.raises(ValueError, match="durable=URL"):
        DataStatesWriter(url, base=os.fspath(tmp_path / "step_0"))
    with raises_from_checkpoint(ValueError, match="needs a prefix of its own"):
        dcp.save({"a": torch.zeros(3)}, storage_writer=DataStatesWriter(url.split("/direct-")[0]), no_dist=True)


def test_two_ranks_save_to_object_storage_and_one_loads_resharded(tmp_path, url):
    import dist_helpers

    planner_url = url.replace("step_00000001", "step_00000002")
    dist_helpers.run_ranks("save_dtensor_state", 2, tmp_path / "logs", default_path=url, planner_path=planner_url)
    dist_helpers.run_ranks("load_dtensor_state", 2, tmp_path / "logs", path=url)
    tensors = {k: v.contiguous() for k, v in dist_helpers.reference_tensors().items()}
    out = {k: torch.zeros_like(v) for k, v in tensors.items()}
    dcp.load(out, storage_reader=DataStatesReader(planner_url), no_dist=True)
    for key, tensor in tensors.items():
        assert torch.equal(out[key], tensor), key
    assert verify(url).ok and verify(planner_url).ok


def test_a_cancelled_upload_never_completes_its_object(url):
    """The save gives up (another rank or stripe failed): the upload is abandoned, the job's
    own error is raised, and no object appears under the key."""
    from dcp_datastates.native.engine import get_engine

    root, name = split_parent(url)
    store = open_store(root, part_bytes=5 << 20)
    engine = get_engine(host_cache_bytes=4 << 20, io_threads=2, window_bytes=512 << 10)
    data = torch.randn(4 << 20)  # 16 MiB: several parts, more than the pool
    from dcp_datastates.native.engine import HostRegion

    job = store.start_write(engine, f"{name}/cut.data", [HostRegion(address=data.data_ptr(), nbytes=data.nbytes, file_offset=0)], [data])
    job.cancel("the save failed elsewhere")
    job.seal()
    with pytest.raises(OSError, match="the save failed elsewhere") as info:
        job.wait()
    assert not isinstance(info.value, StoreError)  # the job's error, not an upload's
    assert store.size(f"{name}/cut.data") is None
    assert engine.jobs_in_flight == 0
    store.close()


def test_a_commit_whose_answer_was_lost_is_told_by_its_bytes(tmp_path):
    """A create-only PUT of .metadata retried after it landed meets its own bytes: committed.
    Another save's .metadata there: CheckpointExistsError. A store that cannot say: None, and
    a failed save's cleanup then keeps the objects (never deleted under a .metadata naming them)."""
    from dcp_datastates.core.destination import Destination
    from dcp_datastates.storage.local import LocalStore
    from dcp_datastates.storage.store import StagedBytes

    store = LocalStore(str(tmp_path))
    dest = Destination(store, "step_1", "s3://b/run/step_1")
    key = "step_1/.metadata"
    store.put_new(key, b"ours")  # the PUT landed; its answer was lost
    ours = StagedBytes(store, key, b"ours")  # staged as an object store stages it: in memory
    dest.commit_metadata(ours, overwrite=False)  # the retry finds its own bytes
    assert dest.committed_by(ours) is True
    with pytest.raises(CheckpointExistsError, match="another save committed"):
        dest.commit_metadata(StagedBytes(store, key, b"theirs"), overwrite=False)

    class Unreachable:
        def __getattr__(self, name):
            return getattr(store, name)

        def size(self, key):
            raise StoreError("s3://b/run/step_1/.metadata: connection refused", transient=True)

    assert Destination(Unreachable(), "step_1", "s3://b/run/step_1").committed_by(StagedBytes(Unreachable(), key, b"ours")) is None


def test_an_upload_is_told_the_size_its_object_will_have(url, monkeypatch):
    """The rank's planned bytes size the upload's parts (S3 takes at most 10,000 of them)."""
    from dcp_datastates.storage.s3 import S3Store

    real, hints = S3Store.put_stream, []

    def recording(self, key, blocks, size, progress=None, **options):
        hints.append((key.rsplit("/", 1)[-1], options.get("size_hint")))
        return real(self, key, blocks, size, progress, **options)

    monkeypatch.setattr(S3Store, "put_stream", recording)
    state = _state()
    dcp.save(state, storage_writer=DataStatesWriter(url, **_SMALL), no_dist=True)
    tensor_bytes = sum(v.nbytes for v in state.values() if isinstance(v, torch.Tensor))
    data = [hint for name, hint in hints if name.endswith(".data")]
    assert len(data) == 1 and data[0] >= tensor_bytes, hints
