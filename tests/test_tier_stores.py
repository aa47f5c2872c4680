"""The durable-tier stores: one contract, a shared file system (a tmpfs the test mounts) and
S3 (a real SeaweedFS server on the loopback)."""

from __future__ import annotations

import os

import pytest

from dcp_datastates.storage import StoreError, open_store
from dcp_datastates.storage.local import LocalStore

from conftest import new_durable_url

pytestmark = [pytest.mark.s3, pytest.mark.slow]


@pytest.fixture(params=["posix", "s3"])
def store(request, tmp_path):
    durable_url = new_durable_url(request, request.param)
    st = open_store(durable_url, **({"part_bytes": 5 << 20} if durable_url.startswith("s3://") else {}))
    yield st
    st.close()


def _file(tmp_path, name, size, seed=0):
    path = tmp_path / name
    data = (bytes(range(256)) * (size // 256 + 1))[:size] if seed == 0 else os.urandom(size)
    path.write_bytes(data)
    return str(path), data


def test_objects_round_trip_and_list(store, tmp_path):
    small, small_data = _file(tmp_path, "small", 1000)
    big, big_data = _file(tmp_path, "big", (12 << 20) + 123, seed=1)  # three 5 MiB parts on S3
    seen = []
    assert store.put_file("step_1/rank0.data", big, progress=seen.append) == len(big_data)
    assert sum(seen) == len(big_data)
    store.put_file("step_1/rank0.index", small)
    store.put_bytes("step_1/.metadata", b"meta")
    store.put_bytes("step_2/x", b"")
    assert store.list() == ["step_1/.metadata", "step_1/rank0.data", "step_1/rank0.index", "step_2/x"]
    assert store.list("step_1/") == ["step_1/.metadata", "step_1/rank0.data", "step_1/rank0.index"]
    assert store.list("nothing/") == []
    assert store.size("step_1/rank0.data") == len(big_data)
    assert store.size("step_1/missing") is None
    assert store.read_range("step_1/rank0.data", 5 << 20, 4096) == big_data[5 << 20:(5 << 20) + 4096]
    assert store.read("step_1/rank0.index") == small_data
    assert store.read("step_1/.metadata") == b"meta"
    store.delete(["step_1/rank0.data", "step_1/gone-already"])
    assert store.list("step_1/") == ["step_1/.metadata", "step_1/rank0.index"]


def test_errors_name_the_store_and_the_key(store, tmp_path):
    with pytest.raises(StoreError, match="step_9/none.*no such object"):
        store.read("step_9/none")
    store.put_bytes("short", b"abc")
    with pytest.raises(StoreError, match="short"):
        store.read_range("short", 1, 10)
    with pytest.raises(StoreError, match="missing-local"):
        store.put_file("k", str(tmp_path / "missing-local"))
    for bad in ("", "/abs", "a/../b", "a//b", "dir/"):
        with pytest.raises(ValueError):
            store.put_bytes(bad, b"x")


def test_posix_objects_are_never_replaced_and_partials_are_hidden(shared_mount):
    st = LocalStore(os.path.join(shared_mount, "norepl"))
    st.put_bytes("a/b", b"1")
    with pytest.raises(StoreError, match="already exists"):
        st.put_bytes("a/b", b"2")
    assert st.read("a/b") == b"1"
    partial = os.path.join(st.root, "a", f".c.part-{os.getpid()}")
    with open(partial, "wb") as f:
        f.write(b"torn")
    assert st.list() == ["a/b"]
    assert st.sweep_partials() == [partial] and not os.path.exists(partial)


def test_unsupported_urls_are_refused():
    with pytest.raises(ValueError, match="gs://b"):
        open_store("gs://b/p")
    with pytest.raises(ValueError, match="names no bucket"):
        open_store("s3:///p")


def test_a_server_that_is_down_fails_with_the_key_named(tmp_path):
    pytest.importorskip("obstore")
    st = open_store("s3://bucket/p", endpoint="http://127.0.0.1:9", max_retries=1, retry_timeout_s=2, request_timeout_s=2)
    with pytest.raises(StoreError, match="s3://bucket/p/k"):
        st.put_bytes("k", b"x")


def test_a_step_directory_removed_under_a_writer_is_made_again(tmp_path, monkeypatch):
    """Two ranks drain into one step directory: one rank's delete() takes the directory away while
    it is empty, between the other's mkdir and its create. The writer makes it again."""
    store = LocalStore(str(tmp_path / "tier"))
    real, raced = store._make_dirs, set()

    def racing(directory):
        real(directory)
        if directory not in raced:  # the other rank's rmdir, right after this mkdir
            raced.add(directory)
            os.rmdir(directory)

    monkeypatch.setattr(store, "_make_dirs", racing)
    store.put_bytes("step_1/a", b"x")
    store.put_stream("step_2/b", [b"yz"], 2)
    assert bytes(store.read_range("step_1/a", 0, 1)) == b"x" and bytes(store.read_range("step_2/b", 0, 2)) == b"yz"
    assert raced == {str(tmp_path / "tier" / "step_1"), str(tmp_path / "tier" / "step_2")}
