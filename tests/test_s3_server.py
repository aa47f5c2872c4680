"""The tests' own S3 server leaves the machine's other servers alone: it listens on a port
free when it is made, never on the default 8333 a user's server (README's object-storage
section starts one) or a second suite holds, and it keeps its endpoint across a kill and
restart, which the durable tier's fault cases rely on."""

from __future__ import annotations

import socket

import pytest

pytestmark = pytest.mark.s3

pytest.importorskip("obstore", reason="the s3 extra (obstore) is not installed")


@pytest.fixture
def default_port_taken():
    """Something listening on 127.0.0.1:8333 for the test, ours or the user's own server."""
    sock = socket.socket()
    try:
        sock.bind(("127.0.0.1", 8333))
        sock.listen()
    except OSError:  # already taken, by the user's server or another suite: the case to test
        sock.close()
        sock = None
    yield
    if sock is not None:
        sock.close()


def test_a_server_beside_a_taken_default_port_serves_its_bucket_and_survives_a_restart(default_port_taken, tmp_path):
    from s3_server import WeedServer, running

    from dcp_datastates.storage import open_store

    with running(WeedServer(bucket="beside-8333")) as server:
        assert server.port != 8333
        assert server.endpoint == f"http://127.0.0.1:{server.port}"
        store = open_store("s3://beside-8333/run", endpoint=server.endpoint)
        store.put_bytes("a", b"before the restart")
        server.kill()
        server.start()
        assert store.read("a") == b"before the restart"


def test_two_servers_at_once_have_their_own_endpoints():
    from s3_server import WeedServer, running

    from dcp_datastates.storage import open_store

    with running(WeedServer(bucket="first-one")) as first, running(WeedServer(bucket="second-one")) as second:
        assert first.endpoint != second.endpoint
        open_store("s3://first-one/x", endpoint=first.endpoint).put_bytes("k", b"1")
        open_store("s3://second-one/x", endpoint=second.endpoint).put_bytes("k", b"2")
        assert open_store("s3://first-one/x", endpoint=first.endpoint).read("k") == b"1"
        assert open_store("s3://second-one/x", endpoint=second.endpoint).read("k") == b"2"
