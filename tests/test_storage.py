"""The storage layer: one reader and one ``verify`` over a directory and over object storage
(a real SeaweedFS bucket), with every check on both; URLs work like paths."""

from __future__ import annotations

import os
import uuid

import pytest
import torch
import torch.distributed.checkpoint as dcp

from conftest import assert_same, data_files, save, zeros_like_state
from dcp_datastates import DataStatesReader, verify
from dcp_datastates.errors import CheckpointNotFoundError, CorruptCheckpointError
from dcp_datastates.format.file_names import METADATA_FILE
from dcp_datastates.storage import open_store
from dcp_datastates.storage.local import LocalStore
from dcp_datastates.storage.url import check_location, is_store_url, parse_s3_url, split_parent, url_scheme
from test_store_reader import upload

pytestmark = pytest.mark.slow


def _state():
    g = torch.Generator().manual_seed(3)
    return {
        "w": torch.randn(300, 77, generator=g),  # an odd size: padding after it
        "b": torch.randn(13, generator=g).to(torch.bfloat16),
        "big": torch.randn(1 << 18, generator=g),
        "meta": {"epoch": 2, "tags": ["a", "b"]},
    }


@pytest.fixture
def s3_url(s3_server):
    return f"s3://{s3_server.bucket}/storage-{uuid.uuid4().hex[:8]}"


def _numbers(report):
    return (report.committed, report.ranks, report.items, report.segments_checked, report.bytes_checked,
            report.padding_bytes_checked, report.digests_checked)


def test_url_rules_are_one_place():
    assert url_scheme("s3://b/p") == "s3" and url_scheme("/tmp/x") is None and url_scheme("run:1/x") is None
    assert is_store_url("s3://b/p") and not is_store_url("gs://b/p") and not is_store_url("S3://b/p")
    assert parse_s3_url("s3://b/run/step_1/") == ("b", "run/step_1")
    assert split_parent("s3://b/run/step_1") == ("s3://b/run", "step_1")
    for bad in ("gs://b/p", "S3://b/p", "file:///tmp/x", "https://host/x"):
        with pytest.raises(ValueError, match="use a directory path or s3://bucket/prefix"):
            check_location(bad)
        with pytest.raises(ValueError, match="use a directory path or s3://bucket/prefix"):
            open_store(bad)


def test_dcp_load_takes_a_url_as_its_checkpoint_id(tmp_path, s3_url):
    state = _state()
    save(state, tmp_path / "c", stripes=2)
    root, name = split_parent(s3_url + "/step_00000001")
    store = open_store(root)
    upload(tmp_path / "c", store, name)
    assert DataStatesReader.validate_checkpoint_id(f"{s3_url}/step_00000001")
    out = zeros_like_state(state)
    dcp.load(out, storage_reader=DataStatesReader(), checkpoint_id=f"{s3_url}/step_00000001", no_dist=True)
    assert_same(out, state)
    reader = DataStatesReader(f"{s3_url}/step_00000001")
    reader.read_metadata()
    assert reader.location == f"{s3_url}/step_00000001"
    assert reader.commit_sequence is None  # a plain save records none
    reader.close()


def test_verify_of_a_copy_in_object_storage_makes_every_check_a_local_verify_makes(tmp_path, s3_url):
    state = _state()
    save(state, tmp_path / "c", record_digests=True, stripes=2)
    local = verify(tmp_path / "c", digests=True)
    assert local.ok, local.summary()
    store = open_store(s3_url)
    upload(tmp_path / "c", store, "step_00000005")
    there = verify(f"{s3_url}/step_00000005", digests=True)
    assert there.ok, there.summary()
    # The same checks over the same bytes: segments, padding, digests, objects.
    assert _numbers(there) == _numbers(local)
    assert there.padding_bytes_checked > 0 and there.digests_checked > 0

    # A byte no checksum covers (the padding after 'w'), changed in the store: named with its offset.
    reader = DataStatesReader(f"{s3_url}/step_00000005")
    layout = reader.load_metadata().storage_data
    loc = next(loc for index, loc in layout.locations.items() if index.fqn == "w")
    name = loc.relative_path
    data = bytearray(store.read(f"step_00000005/{name}"))
    pad = loc.offset + loc.length  # 300 * 77 * 4 bytes: not a multiple of 64
    assert data[pad] == 0
    data[pad] = 0x5A
    store.delete([f"step_00000005/{name}"])
    store.put_bytes(f"step_00000005/{name}", bytes(data))
    store.put_bytes("step_00000005/rank00007-0123456789ab.data", b"left by a failed save")
    report = verify(f"{s3_url}/step_00000005")
    assert not report.ok
    assert any(f"the byte at offset {pad} is 0x5a, not zero" in p and "after 'w'" in p for p in report.problems), report.problems
    assert any("rank00007-0123456789ab.data is not part of this checkpoint" in n for n in report.notes), report.notes
    reader.close()
    store.close()


def test_verify_of_a_missing_or_truncated_copy_in_object_storage(tmp_path, s3_url):
    state = _state()
    save(state, tmp_path / "c")
    store = open_store(s3_url)
    report = verify(f"{s3_url}/nothing")
    assert not report.ok and not report.committed and "no checkpoint at" in report.problems[0]
    upload(tmp_path / "c", store, "short")
    name = data_files(tmp_path / "c")[0]
    store.delete([f"short/{name}"])
    store.put_bytes(f"short/{name}", (tmp_path / "c" / name).read_bytes()[:5000])
    report = verify(f"{s3_url}/short")
    assert report.committed and not report.ok
    assert any(name in p and "truncated" in p for p in report.problems), report.problems
    store.close()


def test_a_directory_store_refuses_what_is_not_a_regular_file(tmp_path):
    save({"a": torch.randn(10)}, tmp_path / "c")
    os.symlink(tmp_path / "c" / METADATA_FILE, tmp_path / "c" / "linked")
    store = LocalStore(str(tmp_path))
    with pytest.raises(CorruptCheckpointError, match="is a symbolic link"):
        store.size("c/linked")
    os.mkfifo(tmp_path / "c" / "fifo")
    with pytest.raises(CorruptCheckpointError, match="not a regular file"):
        store.open_file("c/fifo")
    assert store.size("c/none") is None and store.missing_prefix("d") and not store.missing_prefix("c")
    with pytest.raises(CheckpointNotFoundError, match="the directory does not exist"):
        DataStatesReader(tmp_path / "d").read_metadata()


def test_deleting_a_checkpoint_takes_its_metadata_first_and_never_follows_a_link(tmp_path, durable_url):
    from dcp_datastates import CheckpointError

    save({"a": torch.randn(1000)}, tmp_path / "c")
    store = open_store(durable_url)
    upload(tmp_path / "c", store, "step_00000001")
    store.put_bytes("step_00000001/.drain/rank00000.json", b"{}")  # a drain's leftover goes too
    order = []
    real = store.delete
    store.delete = lambda keys: (order.append(list(keys)), real(keys))[1]
    store.delete_checkpoint("step_00000001")
    assert store.list() == []
    if durable_url.startswith("s3://"):
        assert order[0] == ["step_00000001/.metadata"]  # uncommitted before anything else goes
    else:
        assert not os.path.exists(os.path.join(durable_url, "step_00000001"))
        os.symlink(tmp_path / "c", os.path.join(durable_url, "linked"))
        with pytest.raises(CheckpointError, match="never deleted through a link"):
            store.delete_checkpoint("linked")
        assert os.path.exists(tmp_path / "c" / METADATA_FILE)
    store.close()
