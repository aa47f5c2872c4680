"""The peer transport: a node's directory served by a StoreServer, read and written by another
node's RemoteStore over the loopback (the store contract itself runs in test_tier_stores)."""

from __future__ import annotations

import ctypes
import json
import os
import socket
import threading
import time

import pytest

from dcp_datastates.native import engine as native
from dcp_datastates.storage import ObjectExistsError, RangeRead, ShortObjectError, StoreError
from dcp_datastates.storage import remote
from dcp_datastates.storage.local import LocalStore
from dcp_datastates.storage.remote import RemoteStore, StoreServer


@pytest.fixture
def server(tmp_path):
    srv = StoreServer(LocalStore(str(tmp_path / "node1")))
    yield srv
    srv.close()


@pytest.fixture(params=["", "partner/node1"])
def peer(request, server):
    st = RemoteStore(server.address, server.token, request.param)
    yield st
    st.close()


def _served(server, peer, key):
    """The file a peer's key is on the serving node."""
    return os.path.join(server.store.root, *filter(None, peer.prefix.split("/")), *key.split("/"))


def _address(buf) -> int:
    return ctypes.addressof((ctypes.c_char * len(buf)).from_buffer(buf))


def test_every_operation_round_trips(server, peer):
    seen = []
    peer.put_stream("step_1/rank0.data", iter([b"ab" * 1000, b"", b"cd" * 500]), 3000, progress=seen.append)
    assert sum(seen) == 3000
    peer.put_bytes("step_1/.metadata", b"meta")
    peer.put_new("step_1/commit", b"1")
    with pytest.raises(ObjectExistsError, match="step_1/commit"):
        peer.put_new("step_1/commit", b"2")
    peer.replace_bytes("latest", b"step_1")
    first = peer.identity("latest")
    peer.replace_bytes("latest", b"step_2")
    assert peer.read("latest") == b"step_2" and peer.identity("latest") != first
    assert peer.url.startswith(f"peer://127.0.0.1:{server.address[1]}/{peer.prefix}")
    with open(_served(server, peer, "step_1/.metadata"), "rb") as f:  # where the server keeps it
        assert f.read() == b"meta"

    assert peer.list() == ["latest", "step_1/.metadata", "step_1/commit", "step_1/rank0.data"]
    assert peer.list("step_1/") == ["step_1/.metadata", "step_1/commit", "step_1/rank0.data"]
    assert peer.list("none/") == []
    assert peer.size("step_1/rank0.data") == 3000 and peer.size("step_1/none") is None
    assert bytes(peer.read_range("step_1/rank0.data", 1999, 3)) == b"bcd"
    out = bytearray(4)
    peer.read_into("step_1/rank0.data", 1998, memoryview(out))
    assert out == b"abcd"
    assert b"".join(bytes(b) for _, b in peer.read_blocks("step_1/rank0.data", 3000, 512)) == b"ab" * 1000 + b"cd" * 500
    assert peer.missing_prefix("none/") is True  # the serving directory store can tell
    assert peer.missing_prefix("step_1/") is False

    partial = os.path.join(os.path.dirname(_served(server, peer, "step_1/x")), ".x.part-1")
    with open(partial, "wb") as f:
        f.write(b"torn")
    assert peer.list("step_1/") == ["step_1/.metadata", "step_1/commit", "step_1/rank0.data"]
    assert peer.sweep_partials() == [partial] and not os.path.exists(partial)

    peer.delete(["step_1/commit", "step_1/gone-already"])
    assert peer.list("step_1/") == ["step_1/.metadata", "step_1/rank0.data"]
    peer.delete_checkpoint("step_1")
    assert peer.list() == ["latest"]
    assert len(peer._idle) == 1  # one thread, one connection, kept across every call and error


def test_64_mib_streams_and_reads_back_bit_exact(server):
    peer = RemoteStore(server.address, server.token, "partner/node1", concurrency=4)
    data = os.urandom(64 << 20)
    view = memoryview(data)
    peer.put_stream("big", (view[at:at + (3 << 20) + 1] for at in range(0, len(data), (3 << 20) + 1)), len(data))
    assert peer.size("big") == len(data)
    assert peer.read_range("big", (40 << 20) + 7, 1 << 20) == data[(40 << 20) + 7:(41 << 20) + 7]
    whole = bytearray(len(data))
    peer.read_into("big", 0, memoryview(whole))
    assert whole == data
    assert b"".join(bytes(b) for _, b in peer.read_blocks("big", 20 << 20, peer.read_block, start=5)) == data[5:(20 << 20) + 5]

    # three reads (one split into ranges, two merged), each verified against checksum segments
    seg = 1 << 20
    spans = [(0, 24 << 20), ((30 << 20), 3 << 20), ((33 << 20) + 100, 2 << 20)]
    bufs = [bytearray(n) for _, n in spans]
    reads = []
    for (offset, n), buf in zip(spans, bufs):
        checks = [(at, min(seg, n - at), native.crc32c(data[offset + at:offset + at + min(seg, n - at)])) for at in range(0, n, seg)]
        reads.append(RangeRead("big", offset, n, _address(buf), checks=checks))
    reads[2].checks[1] = (reads[2].checks[1][0], reads[2].checks[1][1], reads[2].checks[1][2] ^ 1)  # a damaged segment
    failures = peer.read_batch(reads)
    assert [(f.request, f.kind) for f in failures] == [(2, "checksum")]
    for (offset, n), buf in zip(spans, bufs):
        assert buf == data[offset:offset + n]
    short = bytearray(10)
    failures = peer.read_batch([RangeRead("big", len(data) - 5, 10, _address(short))])
    assert [(f.request, f.kind) for f in failures] == [(0, "truncated")] and "big" in failures[0].path
    peer.close()


def test_a_wrong_token_is_refused_and_the_server_goes_on(server):
    intruder = RemoteStore(server.address, b"x" * 32)
    with pytest.raises(StoreError, match=f"127.0.0.1:{server.address[1]}.*refused the token") as err:
        intruder.size("k")
    assert not err.value.transient
    st = RemoteStore(server.address, server.token)
    st.put_bytes("k", b"v")
    assert st.read("k") == b"v"
    st.close()


def test_keys_escaping_the_root_are_refused(server, tmp_path):
    (tmp_path / "secret").write_bytes(b"s")
    st = RemoteStore(server.address, server.token)
    for bad in ("../secret", "/etc/passwd", "a/../../secret", ""):
        with pytest.raises(ValueError):
            st.read_range(bad, 0, 1)
    with pytest.raises(ValueError):
        RemoteStore(server.address, server.token, "../up")
    # a client that skips its own checks: the server refuses, and goes on serving the connection
    for op, args in ((remote.READ, {"key": "../secret", "offset": 0, "length": 1}), (remote.SIZE, {"key": "../secret"}),
                     (remote.LIST, {"prefix": "../"}), (remote.PUT_BYTES, {"key": "/tmp/x"}),
                     (remote.DELETE_CHECKPOINT, {"prefix": ".."}), (remote.SWEEP_PARTIALS, {"prefix": "../"})):
        with pytest.raises(StoreError, match="store key|list prefix") as err:
            st._call(op, "asking", "k", args, into=memoryview(bytearray(1)) if op == remote.READ else None)
        assert not err.value.transient
    assert (tmp_path / "secret").read_bytes() == b"s" and st.list() == []
    assert len(st._idle) == 1
    st.close()


def test_missing_and_short_objects(peer):
    assert peer.size("none") is None and peer.identity("none") is None
    with pytest.raises(StoreError, match="none.*no such object") as err:
        peer.read_range("none", 0, 1)
    assert not err.value.transient and not isinstance(err.value, ShortObjectError)
    peer.put_bytes("short", b"abc")
    with pytest.raises(ShortObjectError, match="short.*10 bytes asked at offset 1, the object ends at 3"):
        peer.read_range("short", 1, 10)
    with pytest.raises(ShortObjectError, match="short"):
        peer.read_into("short", 5, memoryview(bytearray(1)))
    assert peer.read_range("short", 3, 0) == b""
    assert peer.read("short") == b"abc"  # the connection went on after each error


def test_a_failing_source_leaves_nothing_visible(server, peer):
    def blocks():
        yield b"x" * (1 << 20)
        raise RuntimeError("the source failed")

    with pytest.raises(RuntimeError, match="the source failed"):
        peer.put_stream("step_1/a", blocks(), 2 << 20)
    with pytest.raises(StoreError, match="step_1/b.*1 bytes came, 2 were announced"):
        peer.put_stream("step_1/b", [b"x"], 2)
    assert peer.list() == [] and peer.size("step_1/a") is None
    root = server.store.root
    assert [f for _, _, files in os.walk(root) for f in files] == []  # no temporary file left either
    peer.put_stream("step_1/a", [b"ok"], 2)
    assert peer.read("step_1/a") == b"ok" and len(peer._idle) == 1


def _raw_connection(server) -> socket.socket:
    sock = socket.create_connection(server.address, timeout=5)
    sock.sendall(remote._HELLO.pack(remote.MAGIC, remote.VERSION, 0, len(server.token)) + server.token)
    assert remote._WELCOME.unpack(remote._recv(sock, remote._WELCOME.size))[1] == 0
    return sock


def test_a_client_gone_mid_object_leaves_nothing(server):
    sock = _raw_connection(server)
    body = json.dumps({"key": "k", "size": 10 << 20}).encode()
    sock.sendall(remote._REQUEST.pack(remote.PUT_STREAM, len(body), 0) + body)
    sock.sendall(remote._FRAME.pack(1 << 20) + b"x" * (1 << 20))
    sock.close()
    deadline = time.monotonic() + 5
    while server._conns and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not server._conns
    assert [f for _, _, files in os.walk(server.store.root) for f in files] == []
    st = RemoteStore(server.address, server.token)
    st.put_bytes("k", b"v")
    assert st.read("k") == b"v"
    st.close()


def test_a_closed_server_is_a_transient_error_naming_it(tmp_path):
    before = set(threading.enumerate())
    srv = StoreServer(LocalStore(str(tmp_path / "n")))
    st = RemoteStore(srv.address, srv.token, "p", timeout_s=2)
    st.put_bytes("k", b"v")
    half = _raw_connection(srv)  # a connection idle at close, and one mid-object
    body = json.dumps({"key": "m", "size": None}).encode()
    half.sendall(remote._REQUEST.pack(remote.PUT_STREAM, len(body), 0) + body + remote._FRAME.pack(3) + b"abc")
    srv.close()
    srv.close()  # idempotent
    assert set(threading.enumerate()) == before  # no thread of the server lingers
    for call in (lambda: st.read("k"), lambda: st.put_stream("k2", [b"x"], 1), lambda: st.size("k")):
        with pytest.raises(StoreError, match=f"peer://127.0.0.1:{srv.address[1]}/p/k.*127.0.0.1:{srv.address[1]}") as err:
            call()
        assert err.value.transient
    assert LocalStore(str(tmp_path / "n")).list() == ["p/k"]
    half.close()
    st.close()


def test_the_peer_computes_a_read_back_checksum_where_the_bytes_are(server, peer):
    data = os.urandom(3 << 20) + b"tail"
    peer.put_bytes("step_1/a.data", data)
    assert peer.crc32c_of("step_1/a.data", len(data)) == native.crc32c(data)
    assert peer.crc32c_of("step_1/a.data", 4096) == native.crc32c(data[:4096])
    with pytest.raises(StoreError, match="a.data"):
        peer.crc32c_of("step_1/a.data", len(data) + 1)  # past its end: a short object, named
