"""A TCP proxy on the loopback in front of the test S3 server, to make its link bad.

``throttle(bytes_per_s)`` slows what clients send (a slow link); ``storm(n)`` answers the
first request of the next ``n`` connections with ``503 SlowDown`` (S3's answer when it sheds
load) and drops the connections open at the time, so that clients reconnect into it.
"""

from __future__ import annotations

import socket
import threading
import time

_BODY = b"<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>"
_SLOW_DOWN = (
    b"HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\nConnection: close\r\n"
    + b"Content-Length: %d\r\n\r\n" % len(_BODY) + _BODY
)


class S3Proxy:
    def __init__(self, upstream_port: int) -> None:
        self.upstream = ("127.0.0.1", upstream_port)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.bytes_per_s: float | None = None
        self.rejected = 0
        self._storm = 0
        self._lock = threading.Lock()
        self._conns: list[socket.socket] = []
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def throttle(self, bytes_per_s: float | None) -> None:
        self.bytes_per_s = bytes_per_s

    def storm(self, requests: int) -> None:
        with self._lock:
            self._storm = requests
            conns, self._conns = self._conns, []
        for c in conns:
            _close(c)

    def close(self) -> None:
        self._closed = True
        _close(self._listener)
        self.storm(0)

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        with self._lock:
            reject = self._storm > 0
            if reject:
                self._storm -= 1
                self.rejected += 1
        if reject:
            try:
                client.settimeout(5)
                head = b""
                while b"\r\n\r\n" not in head:
                    chunk = client.recv(65536)
                    if not chunk:
                        break
                    head += chunk
                client.sendall(_SLOW_DOWN)
            except OSError:
                pass
            _close(client)
            return
        try:
            upstream = socket.create_connection(self.upstream)
        except OSError:
            _close(client)
            return
        with self._lock:
            self._conns += [client, upstream]
        threading.Thread(target=self._pump, args=(upstream, client, False), daemon=True).start()
        self._pump(client, upstream, True)

    def _pump(self, src: socket.socket, dst: socket.socket, slow: bool) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                rate = self.bytes_per_s if slow else None
                if rate:
                    time.sleep(len(data) / rate)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            _close(src)
            _close(dst)


def _close(s: socket.socket) -> None:
    try:
        s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    try:
        s.close()
    except OSError:
        pass
