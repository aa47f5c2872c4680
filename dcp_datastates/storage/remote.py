"""A store on another node: a :class:`LocalStore` served over TCP to :class:`RemoteStore` clients.

The nodes of a job keep checkpoints on node-local storage and no file system
is shared; a node reads, lists and sizes another node's files, and streams
files into another node's storage (a replica on a partner node), through a
peer's :class:`StoreServer`. The server does nothing but run the wrapped
store's methods, so a replica there is published exactly as a local write is
(a temporary file, fsynced, renamed into place): a transfer that is abandoned
or cut leaves nothing under the key.

Wire format (all integers big-endian; one request at a time per connection):

* Handshake, client first: ``b"DCPP"``, version ``u8`` (1), ``u8`` 0, token
  length ``u16``, the token. The server compares the token with
  :func:`hmac.compare_digest` and answers ``b"DCPP"``, status ``u8`` (0: go on,
  1: token refused, 2: version refused), three zero bytes; on a refusal it
  closes the connection.
* Request: ``op u8``, three zero bytes, ``args_len u32``, ``data_len u64``;
  then ``args_len`` bytes of JSON (an object: the operation's small
  arguments, keys as the server's store names them) and ``data_len`` raw
  bytes (the object of ``put_bytes``, ``put_new``, ``replace_bytes``).
* ``put_stream`` is followed by frames: ``length u64`` then that many bytes
  (at most :data:`MAX_FRAME`); ``length`` 0 ends the object, ``2**64 - 1``
  abandons it (the client's ``blocks`` raised). The server answers once the
  frames have ended, even when its write failed early (it reads the rest and
  drops it), so the connection stays in step.
* Response: ``status u8`` (0: done, 1: failed), three zero bytes,
  ``json_len u32``, ``data_len u64``; then the JSON result (``{"result": ...}``)
  or error (``{"kind", "message", "transient"}``), then ``data_len`` raw bytes
  (a read's range, sent with ``sendfile`` straight from the file).

A read is answered only after the file's size was checked, so a short object
is an error reply and the client never waits for bytes that do not exist; a
read is received straight into the caller's buffer. Failures on the server
(the store's errors, with their transient flag) travel back as error replies
and the connection goes on serving; a connection that broke is dropped by the
client, which opens another.
"""

from __future__ import annotations

import errno
import hmac
import json
import os
import secrets
import select
import socket
import stat
import struct
import threading
import time

from dcp_datastates.errors import CheckpointError
from dcp_datastates.storage.local import LocalStore
from dcp_datastates.storage.store import (
    _TRANSIENT_ERRNOS,
    ObjectExistsError,
    Progress,
    RangeRead,
    ShortObjectError,
    Store,
    StoreError,
    _ranged_batch,
    check_key,
)

MAGIC = b"DCPP"
VERSION = 1
_HELLO = struct.Struct("!4sBBH")  # magic, version, 0, token length
_WELCOME = struct.Struct("!4sB3x")  # magic, status
_REQUEST = struct.Struct("!B3xIQ")  # op, args length, data length
_RESPONSE = struct.Struct("!B3xIQ")  # status, json length, data length
_FRAME = struct.Struct("!Q")
_END, _ABANDON = 0, (1 << 64) - 1
MAX_FRAME = 64 << 20  # the largest put_stream frame a server accepts (its receive buffer)
MAX_ARGS = 64 << 20  # the largest JSON argument or result
MAX_SMALL = 1 << 30  # the largest put_bytes object
_SEND_FRAME = 8 << 20  # a client's put_stream frames (larger blocks are split)
_SENDFILE_STEP = 1 << 30
_HANDSHAKE_TIMEOUT_S = 30.0

# operations
PUT_STREAM, PUT_BYTES, PUT_NEW, REPLACE_BYTES, READ, SIZE, IDENTITY, LIST, DELETE, DELETE_CHECKPOINT, \
    MISSING_PREFIX, SWEEP_PARTIALS, CRC32C = range(1, 14)


class _ProtocolError(ConnectionError):
    """The peer broke the wire format (or went away mid-message): the connection is dropped."""


class _Abandoned(Exception):
    """The client's ``blocks`` raised: the object being streamed is abandoned."""


def _recv_into(sock: socket.socket, view: memoryview) -> None:
    got, n = 0, len(view)
    while got < n:
        r = sock.recv_into(view[got:], n - got)
        if r == 0:
            raise _ProtocolError(f"the connection closed after {got} of {n} bytes")
        got += r


def _recv(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    _recv_into(sock, memoryview(buf))
    return buf


def _set_options(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)


def _check_prefix(prefix: str) -> str:
    """A list prefix (``""`` or ending in ``/``) naming nothing outside the root."""
    if prefix:
        if not prefix.endswith("/"):
            raise ValueError(f"a list prefix ends with '/': {prefix!r}")
        check_key(prefix[:-1])
    return prefix


# ----------------------------------------------------------------------------- server


class StoreServer:
    """Serves a LocalStore to RemoteStore clients over TCP (a thread per connection).

    Every connection presents ``token`` first; keys are checked here (a client may not name
    anything outside the store's root)."""

    def __init__(self, store: LocalStore, host: str = "127.0.0.1", port: int = 0, token: bytes | None = None) -> None:
        if token is not None and (not isinstance(token, bytes) or not token):
            raise ValueError("a store server's token is non-empty bytes")
        self.store = store
        self.token = token if token is not None else secrets.token_bytes(32)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.create_server((host, port), family=family, backlog=64)
        self.address: tuple[str, int] = tuple(self._listener.getsockname()[:2])
        self._lock = threading.Lock()
        self._conns: dict[socket.socket, threading.Thread] = {}
        self._closed = False
        self._acceptor = threading.Thread(target=self._accept, name=f"dcp_datastates-peer-{self.address[1]}", daemon=True)
        self._acceptor.start()

    def __enter__(self) -> StoreServer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _accept(self) -> None:
        while True:
            try:
                conn, _peer = self._listener.accept()
            except OSError:
                if self._closed:
                    return
                time.sleep(0.01)  # a connection reset before it was accepted, or out of descriptors
                continue
            with self._lock:
                if self._closed:
                    conn.close()
                    return
                thread = threading.Thread(target=self._serve, args=(conn,), daemon=True,
                                          name=f"dcp_datastates-peer-{self.address[1]}-conn")
                self._conns[conn] = thread
                thread.start()  # under the lock: close() joins only started threads

    def close(self) -> None:
        """Stop accepting, cut every connection (a transfer in flight is abandoned: nothing is
        published) and wait for the threads."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            conns = dict(self._conns)
        for sock in (self._listener, *conns):
            try:
                sock.shutdown(socket.SHUT_RDWR)  # wakes accept() and recv() in the threads
            except OSError:
                pass
        self._listener.close()
        self._acceptor.join()
        for thread in conns.values():
            thread.join()

    # one connection

    def _serve(self, conn: socket.socket) -> None:
        try:
            _set_options(conn)
            if self._handshake(conn):
                while self._one(conn):
                    pass
        except Exception:
            pass  # the client went away, close() cut it, or it broke the format: nothing was published
        finally:
            with self._lock:
                self._conns.pop(conn, None)
            conn.close()

    def _handshake(self, conn: socket.socket) -> bool:
        conn.settimeout(_HANDSHAKE_TIMEOUT_S)
        magic, version, _zero, n = _HELLO.unpack(_recv(conn, _HELLO.size))
        token = bytes(_recv(conn, n)) if magic == MAGIC and n <= 1024 else b""
        status = 0
        if magic != MAGIC or version != VERSION:
            status = 2
        elif not hmac.compare_digest(token, self.token):
            status = 1
        conn.sendall(_WELCOME.pack(MAGIC, status))
        conn.settimeout(None)
        return status == 0

    def _one(self, conn: socket.socket) -> bool:
        """Serve one request; False when the client closed the connection between requests."""
        head = bytearray(_REQUEST.size)
        first = conn.recv_into(head)
        if first == 0:
            return False
        _recv_into(conn, memoryview(head)[first:])
        op, args_len, data_len = _REQUEST.unpack(head)
        if args_len > MAX_ARGS or data_len > MAX_SMALL:
            raise _ProtocolError(f"a request too large ({args_len} + {data_len} bytes)")
        args = json.loads(_recv(conn, args_len)) if args_len else {}
        data = _recv(conn, data_len) if data_len else b""
        if op == PUT_STREAM:
            return self._put_stream(conn, args)
        if op == READ:
            return self._read(conn, args)
        try:
            result = self._dispatch(op, args, data)
        except Exception as exc:
            self._reply_error(conn, exc)
        else:
            self._reply(conn, result)
        return True

    def _key(self, args) -> str:
        return check_key(args["key"])

    def _dispatch(self, op: int, args: dict, data) -> object:
        st = self.store
        if op == PUT_BYTES:
            return st.put_bytes(self._key(args), bytes(data))
        if op == PUT_NEW:
            return st.put_new(self._key(args), bytes(data))
        if op == REPLACE_BYTES:
            return st.replace_bytes(self._key(args), bytes(data))
        if op == SIZE:
            return st.size(self._key(args))
        if op == IDENTITY:
            return st.identity(self._key(args))
        if op == LIST:
            return st.list(_check_prefix(args["prefix"]))
        if op == DELETE:
            return st.delete([check_key(k) for k in args["keys"]])
        if op == DELETE_CHECKPOINT:
            return st.delete_checkpoint(check_key(args["prefix"]))
        if op == MISSING_PREFIX:
            return st.missing_prefix(_check_prefix(args["prefix"]))
        if op == SWEEP_PARTIALS:
            return st.sweep_partials(_check_prefix(args["prefix"]))
        if op == CRC32C:
            return st.crc32c_of(self._key(args), int(args["size"]))
        raise ValueError(f"unknown operation {op}")

    def _reply(self, conn: socket.socket, result: object = None, data_len: int = 0) -> None:
        body = json.dumps({"result": result}).encode()
        conn.sendall(_RESPONSE.pack(0, len(body), data_len) + body)

    def _reply_error(self, conn: socket.socket, exc: BaseException) -> None:
        if isinstance(exc, ShortObjectError):
            kind = "short"
        elif isinstance(exc, ObjectExistsError):
            kind = "exists"
        elif isinstance(exc, _Abandoned):
            kind = "abandoned"
        elif isinstance(exc, (ValueError, KeyError, TypeError)):
            kind = "refused"
        else:
            kind = "store"
        if isinstance(exc, StoreError):
            transient = exc.transient
        elif isinstance(exc, OSError) and not isinstance(exc, CheckpointError):
            transient = exc.errno in _TRANSIENT_ERRNOS
        else:
            transient = False
        message = str(exc) if isinstance(exc, (OSError, CheckpointError, ValueError)) else f"{type(exc).__name__}: {exc}"
        body = json.dumps({"kind": kind, "message": message, "transient": transient}).encode()
        conn.sendall(_RESPONSE.pack(1, len(body), 0) + body)

    def _put_stream(self, conn: socket.socket, args: dict) -> bool:
        buf = bytearray(1 << 20)
        state = {"ended": False, "broken": False}

        def frame_head() -> int:
            try:
                (n,) = _FRAME.unpack(_recv(conn, _FRAME.size))
            except OSError:
                state["broken"] = True
                raise
            if n in (_END, _ABANDON):
                state["ended"] = True
            elif n > MAX_FRAME:
                state["broken"] = True
                raise _ProtocolError(f"a frame of {n} bytes (at most {MAX_FRAME})")
            return n

        def frames():
            nonlocal buf
            while (n := frame_head()) != _END:
                if n == _ABANDON:
                    raise _Abandoned("the client abandoned the object (its data source failed)")
                if n > len(buf):
                    buf = bytearray(n)
                view = memoryview(buf)[:n]
                try:
                    _recv_into(conn, view)
                except OSError:
                    state["broken"] = True
                    raise
                yield view  # written before the next frame is asked for: the buffer is reused

        def drain() -> None:
            """Read the object's remaining frames (a write that failed early), so the reply is in step."""
            try:
                for _ in stream:
                    pass
            except _Abandoned:
                pass

        stream = frames()
        try:
            self.store.put_stream(check_key(args["key"]), stream, args.get("size"), size_hint=args.get("size_hint"))
        except Exception as exc:
            if state["broken"]:
                return False  # the client went away mid-object; the store removed the temporary file
            if not state["ended"]:
                drain()
            self._reply_error(conn, exc)
            return True
        if not state["ended"]:
            drain()
        self._reply(conn)
        return True

    def _read(self, conn: socket.socket, args: dict) -> bool:
        try:
            key = check_key(args["key"])
            offset, length = int(args["offset"]), int(args["length"])
            if offset < 0 or length < 0:
                raise ValueError(f"a read of {length} bytes at offset {offset}")
            path = self.store._path(key)
            try:
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
            except (FileNotFoundError, NotADirectoryError) as exc:
                raise StoreError(f"{path}: no such object") from exc
            except OSError as exc:
                raise StoreError(f"{path}: {exc.strerror or exc}") from exc
        except Exception as exc:
            self._reply_error(conn, exc)
            return True
        try:
            try:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode):
                    raise StoreError(f"{path} is not a regular file; checkpoint files must be regular files")
                if offset + length > st.st_size:
                    raise ShortObjectError(
                        f"{path}: {length} bytes asked at offset {offset}, the object ends at {max(st.st_size, offset)}"
                    )
            except Exception as exc:
                self._reply_error(conn, exc)
                return True
            self._reply(conn, None, length)
            sent = 0
            while sent < length:  # the bytes go from the page cache to the socket, never through here
                n = os.sendfile(conn.fileno(), fd, offset + sent, min(length - sent, _SENDFILE_STEP))
                if n == 0:  # the file shrank under the read: the reply cannot be completed
                    raise _ProtocolError(f"{path} ended at {offset + sent} during a read")
                sent += n
        finally:
            os.close(fd)
        return True


# ----------------------------------------------------------------------------- client


class RemoteStore(Store):
    """A peer's store, through its :class:`StoreServer`: keys are under ``prefix`` there.

    A few connections are kept (one per thread in flight, up to ``concurrency`` idle);
    ``timeout_s`` bounds every wait on the peer (a connection, each send or receive)."""

    read_block = 4 << 20  # a request each; the loopback or a fast network is not latency-bound at this size

    def __init__(self, address: tuple[str, int], token: bytes, prefix: str = "", *, name: str | None = None,
                 timeout_s: float = 60.0, concurrency: int = 8) -> None:
        host, port = address
        self.address = (host, int(port))
        self.token = bytes(token)
        self.prefix = prefix.strip("/")
        if self.prefix:
            check_key(self.prefix)
        shown = f"[{host}]" if ":" in host else host
        self.url = name or f"peer://{shown}:{port}/{self.prefix}"
        self.timeout_s = timeout_s
        self.concurrency = max(1, concurrency)
        self.read_concurrency = self.concurrency
        self._idle: list[socket.socket] = []
        self._lock = threading.Lock()
        self._closed = False

    # connections

    def _peer(self) -> str:
        return f"peer {self.address[0]}:{self.address[1]}"

    def _connect(self) -> socket.socket:
        sock = socket.create_connection(self.address, timeout=self.timeout_s)
        try:
            _set_options(sock)
            sock.sendall(_HELLO.pack(MAGIC, VERSION, 0, len(self.token)) + self.token)
            magic, status = _WELCOME.unpack(_recv(sock, _WELCOME.size))
        except BaseException:
            sock.close()
            raise
        if magic != MAGIC or status != 0:
            sock.close()
            why = {1: "refused the token", 2: "refused the protocol version"}.get(status, "is not a store server")
            raise _Refused(f"{self._peer()} {why}")
        return sock

    def _take(self) -> tuple[socket.socket, bool]:
        """A connection and whether it was kept from an earlier call."""
        with self._lock:
            if self._closed:
                raise StoreError(f"{self.url}: the store was closed", transient=False)
            while self._idle:
                sock = self._idle.pop()
                if _alive(sock):
                    return sock, True
                sock.close()
        return self._connect(), False

    def _give(self, sock: socket.socket) -> None:
        with self._lock:
            if not self._closed and len(self._idle) < self.concurrency:
                self._idle.append(sock)
                return
        sock.close()

    def _call(self, op: int, what: str, key: str, args: dict, data=b"", *, into: memoryview | None = None,
              retry: bool = True, send=None):
        """One request and its reply (a read's bytes into ``into``); the reply's result.
        ``send(sock)``: what follows the request's header and arguments (a streamed object's
        frames), instead of ``data``."""
        for attempt in (0, 1):
            sock, kept = None, False
            try:
                sock, kept = self._take()
                body = json.dumps(args).encode()
                sock.sendall(_REQUEST.pack(op, len(body), len(data)) + body)
                if send is not None:
                    send(sock)
                elif data:
                    sock.sendall(data)
                result = self._answer(sock, what, key, into)
            except _Refused as exc:
                raise StoreError(f"{what} {self.where(key)}: {exc}", transient=False) from None
            except StoreError:
                if sock is not None:
                    self._give(sock)  # an error reply: the connection is in step
                raise
            except OSError as exc:
                if sock is not None:
                    sock.close()
                if retry and kept and attempt == 0:
                    continue  # the peer dropped a kept connection (restarted): once more, on a new one
                raise StoreError(f"{what} {self.where(key)}: {self._peer()}: {_reason(exc)}", transient=True) from exc
            except BaseException:
                if sock is not None:
                    sock.close()
                raise
            self._give(sock)
            return result

    def _answer(self, sock: socket.socket, what: str, key: str, into: memoryview | None = None):
        status, json_len, data_len = _RESPONSE.unpack(_recv(sock, _RESPONSE.size))
        if json_len > MAX_ARGS:
            raise _ProtocolError(f"a reply of {json_len} bytes")
        body = json.loads(_recv(sock, json_len)) if json_len else {}
        if status != 0:
            if data_len:
                raise _ProtocolError("an error reply with data")
            raise self._error(what, key, body)
        if data_len != (len(into) if into is not None else 0):
            raise _ProtocolError(f"{data_len} bytes came, {len(into) if into is not None else 0} were asked")
        if data_len:
            _recv_into(sock, into)
        return body.get("result")

    def _error(self, what: str, key: str, body: dict) -> StoreError:
        message = f"{what} {self.where(key)}: {body.get('message')}"
        kind = body.get("kind")
        if kind == "short":
            return ShortObjectError(message)
        if kind == "exists":
            return ObjectExistsError(message)
        return StoreError(message, transient=bool(body.get("transient")))

    def _server_key(self, key: str) -> str:
        check_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def _server_prefix(self, prefix: str) -> str:
        if prefix and not prefix.endswith("/"):
            raise ValueError(f"a list prefix ends with '/': {prefix!r}")
        if prefix:
            check_key(prefix[:-1])
        return f"{self.prefix}/{prefix}" if self.prefix else prefix

    # the Store protocol

    def put_stream(self, key: str, blocks, size: int | None, progress: Progress | None = None,
                   size_hint: int | None = None) -> None:
        """The blocks go out in frames as they come; the server writes them into a temporary file
        it publishes once the last has come. ``blocks`` raising abandons the object there (and
        propagates here)."""
        failed: list[BaseException] = []

        def send(sock: socket.socket) -> None:
            source = iter(blocks)
            while True:
                try:
                    data = next(source)
                except StopIteration:
                    break
                except BaseException as exc:  # the caller's data failed: the object is abandoned there
                    failed.append(exc)
                    break
                view = memoryview(data).cast("B")
                for at in range(0, len(view), _SEND_FRAME):
                    part = view[at:at + _SEND_FRAME]
                    sock.sendall(_FRAME.pack(len(part)))
                    sock.sendall(part)
                if progress is not None:
                    progress(len(view))
            sock.sendall(_FRAME.pack(_ABANDON if failed else _END))

        args = {"key": self._server_key(key), "size": size, "size_hint": size_hint}
        try:
            # never repeated: the blocks are consumed once
            self._call(PUT_STREAM, "writing", key, args, retry=False, send=send)
        except StoreError:
            if failed:  # the server's "abandoned", as asked, or the connection lost meanwhile
                raise failed[0] from None
            raise
        if failed:
            raise failed[0]

    def put_bytes(self, key: str, data: bytes) -> None:
        self._call(PUT_BYTES, "writing", key, {"key": self._server_key(key)}, memoryview(data).cast("B"))

    def put_new(self, key: str, data: bytes) -> None:
        # never repeated: a first try that committed would make the second an ObjectExistsError
        self._call(PUT_NEW, "writing", key, {"key": self._server_key(key)}, memoryview(data).cast("B"), retry=False)

    def replace_bytes(self, key: str, data: bytes) -> None:
        self._call(REPLACE_BYTES, "writing", key, {"key": self._server_key(key)}, memoryview(data).cast("B"))

    def read_range(self, key: str, offset: int, length: int) -> bytearray:
        out = bytearray(length)
        self.read_into(key, offset, memoryview(out))
        return out

    def read_into(self, key: str, offset: int, out: memoryview) -> None:
        out = memoryview(out).cast("B") if memoryview(out).format != "B" else memoryview(out)
        args = {"key": self._server_key(key), "offset": offset, "length": len(out)}
        self._call(READ, "reading", key, args, into=out)

    def size(self, key: str) -> int | None:
        return self._call(SIZE, "asking the size of", key, {"key": self._server_key(key)})

    def identity(self, key: str):
        found = self._call(IDENTITY, "asking about", key, {"key": self._server_key(key)})
        return None if found is None else (self.where(key), *found)

    def list(self, prefix: str = "") -> list[str]:
        keys = self._call(LIST, "listing", prefix, {"prefix": self._server_prefix(prefix)})
        if not self.prefix:
            return keys
        strip = len(self.prefix) + 1
        return [k[strip:] for k in keys]

    def delete(self, keys: list[str]) -> None:
        if keys:
            self._call(DELETE, "deleting", keys[0], {"keys": [self._server_key(k) for k in keys]})

    def delete_checkpoint(self, prefix: str) -> None:
        self._call(DELETE_CHECKPOINT, "deleting", prefix, {"prefix": self._server_key(prefix)})

    def missing_prefix(self, prefix: str) -> bool:
        return self._call(MISSING_PREFIX, "asking about", prefix, {"prefix": self._server_prefix(prefix)})

    def crc32c_of(self, key: str, size: int, pace=None) -> int:
        """Computed by the peer, where the bytes are: a read-back without sending them back."""
        return self._call(CRC32C, "checksumming", key, {"key": self._server_key(key), "size": size})

    def sweep_partials(self, prefix: str = "") -> list[str]:
        """Remove the temporary files interrupted copies left on the peer; their paths there."""
        return self._call(SWEEP_PARTIALS, "sweeping", prefix, {"prefix": self._server_prefix(prefix)})

    def read_batch(self, reads: list[RangeRead], *, threads: int | None = None) -> list:
        return _ranged_batch(self, reads, threads or self.concurrency)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for sock in idle:
            sock.close()


class _Refused(Exception):
    """The peer refused the handshake (a wrong token or protocol version)."""


def _alive(sock: socket.socket) -> bool:
    """Whether a kept connection is still usable: the peer may have closed it while it was idle,
    and anything readable on it now (an end, a reset, stray bytes) means it is not."""
    try:
        readable, _, _ = select.select([sock], [], [], 0)
    except (OSError, ValueError):
        return False
    return not readable


def _reason(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError) or isinstance(exc, socket.timeout):
        return "timed out"
    if isinstance(exc, OSError) and exc.errno is not None:
        return f"{exc.strerror or errno.errorcode.get(exc.errno, exc.errno)}"
    return str(exc) or type(exc).__name__
