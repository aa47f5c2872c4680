"""Cases of tests/test_cuda_standin.py, each run in a fresh interpreter.

    python cases.py CASE ENGINE_SO STANDIN_SO TMPDIR [ARG]

The engine resolves the CUDA runtime once per process (the first library
that loads wins), so every case gets a process of its own: the test process
never has a CUDA runtime loaded. Only the standard library is imported (the
engine is loaded from its file, without the package and torch), so a case
starts in a fraction of a second. Prints OK when every check passed.
"""

from __future__ import annotations

import ctypes
import errno
import gc
import importlib.util
import os
import sys
import time

WINDOW = 64 << 10
SLOTS = 4
ERROR_CODE = 700  # cudaErrorIllegalAddress: what a failing copy reports on a GPU


def load_engine(path: str):
    spec = importlib.util.spec_from_file_location("dcp_datastates._engine", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class StandIn:
    """The stand-in runtime, driven through ctypes (the same library the engine dlopen()ed)."""

    def __init__(self, path: str) -> None:
        lib = ctypes.CDLL(path)
        vp, i, sz, lng = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t, ctypes.c_long
        for name, args in {
            "cudaSetDevice": [i],
            "cudaStreamCreateWithFlags": [ctypes.POINTER(vp), ctypes.c_uint],
            "cudaEventCreateWithFlags": [ctypes.POINTER(vp), ctypes.c_uint],
            "cudaEventRecord": [vp, vp],
            "cudaEventDestroy": [vp],
            "standin_reset": [i, lng, lng],
            "standin_fail": [ctypes.c_char_p, i, i, i],
            "standin_set_delays": [lng, lng],
            "standin_enqueue_fill": [vp, vp, i, sz, lng],
            "standin_log": [ctypes.c_char_p, sz],
            "standin_count": [ctypes.c_char_p],
        }.items():
            getattr(lib, name).argtypes = args
        lib.standin_log.restype = sz
        self.lib = lib

    def _ok(self, err: int, what: str) -> None:
        assert err == 0, f"{what} failed in the test's own setup: cudaError {err}"

    def reset(self, devices: int = 1, event_delay_s: float = 0, copy_delay_s: float = 0) -> None:
        self.lib.standin_reset(devices, int(event_delay_s * 1e6), int(copy_delay_s * 1e6))

    def delays(self, event_delay_s: float = 0, copy_delay_s: float = 0) -> None:
        self.lib.standin_set_delays(int(event_delay_s * 1e6), int(copy_delay_s * 1e6))

    def fail(self, call: str, code: int = ERROR_CODE, skip: int = 0, times: int = 1) -> None:
        self.lib.standin_fail(call.encode(), code, skip, times)

    def stream(self, device: int = 0) -> int:
        self._ok(self.lib.cudaSetDevice(device), "cudaSetDevice")
        s = ctypes.c_void_p()
        self._ok(self.lib.cudaStreamCreateWithFlags(ctypes.byref(s), 1), "cudaStreamCreateWithFlags")
        return s.value

    def event(self, device: int = 0) -> int:
        self._ok(self.lib.cudaSetDevice(device), "cudaSetDevice")
        e = ctypes.c_void_p()
        self._ok(self.lib.cudaEventCreateWithFlags(ctypes.byref(e), 2), "cudaEventCreateWithFlags")
        return e.value

    def record(self, event: int, stream: int) -> None:
        self._ok(self.lib.cudaEventRecord(event, stream), "cudaEventRecord")

    def destroy_event(self, event: int) -> None:
        self._ok(self.lib.cudaEventDestroy(event), "cudaEventDestroy")

    def kernel(self, stream: int, buffer: "Buffer", value: int, delay_s: float) -> None:
        """A "kernel" on ``stream`` that, after ``delay_s``, overwrites all of ``buffer`` with ``value``."""
        self._ok(self.lib.standin_enqueue_fill(stream, buffer.address, value, buffer.nbytes, int(delay_s * 1e6)), "fill")

    def log(self) -> list[str]:
        n = self.lib.standin_log(None, 0)
        buf = ctypes.create_string_buffer(n)
        self.lib.standin_log(buf, n)
        return buf.value.decode().splitlines()

    def count(self, what: str) -> int:
        return self.lib.standin_count(what.encode())


class Buffer:
    """Fake device (or host) memory: ``nbytes`` bytes of ``value``."""

    def __init__(self, nbytes: int, value: int) -> None:
        self.raw = ctypes.create_string_buffer(bytes([value]) * nbytes, nbytes)
        self.nbytes = nbytes
        self.address = ctypes.addressof(self.raw)


def fields(line: str) -> dict[str, str]:
    return dict(part.split("=", 1) for part in line.split() if "=" in part)


def lines(log: list[str], call: str) -> list[dict[str, str]]:
    return [fields(line) for line in log if line.split()[0] == call]


def read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


class Case:
    def __init__(self, engine_so: str, standin_so: str, tmp: str) -> None:
        self.E = load_engine(engine_so)
        self.lib_path = standin_so
        self.tmp = tmp
        self.n = 0

    def load_standin(self) -> StandIn:
        why = self.E.load_cuda_runtime(self.lib_path)
        assert why == "", why
        assert self.E.cuda_runtime_path() == self.lib_path
        return StandIn(self.lib_path)

    def engine(self):
        return self.E.Engine(io_threads=2, pool_bytes=SLOTS * WINDOW, window_bytes=WINDOW)

    def path(self) -> str:
        self.n += 1
        return os.path.join(self.tmp, f"file{self.n}")

    def device(self, buffer: Buffer, offset: int, device: int = 0, event: int | None = None):
        return self.E.DeviceRegion(
            address=buffer.address, nbytes=buffer.nbytes, file_offset=offset, device=device, ready_event=event
        )

    def host(self, buffer: Buffer, offset: int):
        return self.E.HostRegion(address=buffer.address, nbytes=buffer.nbytes, file_offset=offset)

    def write(self, engine, regions, keep=()) -> tuple[str, list]:
        path = self.path()
        job = engine.write(path, regions, list(keep), direct_io="off")
        job.seal()
        segments = job.wait()
        data = read(path)
        for s in segments:  # the checksums are those of the bytes written
            assert self.E.crc32c(data[s.offset : s.offset + s.nbytes]) == s.crc32c
        return path, segments

    def idle(self, engine) -> None:
        """No job left in flight, every pool window free."""
        assert engine.jobs_in_flight == 0, engine.jobs_in_flight
        assert engine.free_windows == SLOTS, engine.free_windows


# -- cases --------------------------------------------------------------------------------


def case_event_ordering(c: Case) -> None:
    """The copy of a region waits for the event recorded after the producer's "kernel"."""
    s = c.load_standin()
    s.reset(devices=1)
    eng = c.engine()
    producer = s.stream(0)
    n = 3 * WINDOW + 1234  # several windows: each one's copy waits for the event
    dev = Buffer(n, 0xAA)
    s.kernel(producer, dev, 0x55, delay_s=0.3)
    ready = s.event(0)
    s.record(ready, producer)
    host = Buffer(100, 0x11)
    path = c.path()
    job = eng.write(path, [c.host(host, 0), c.device(dev, 4096, event=ready)], direct_io="off")
    t0 = time.monotonic()
    assert job.wait_staged()
    assert time.monotonic() - t0 >= 0.25, "staged before the kernel that writes the region had run"
    job.seal()
    job.wait()
    data = read(path)
    assert data[:100] == b"\x11" * 100 and data[4096 : 4096 + n] == b"\x55" * n, "the copy read the bytes before the kernel"

    # Control: without the event the copy runs at once, before the kernel (the stand-in's
    # streams are concurrent), so the check above is a real one.
    dev2 = Buffer(n, 0xAA)
    s.kernel(producer, dev2, 0x55, delay_s=0.3)
    path2, _ = c.write(eng, [c.device(dev2, 0)])
    assert read(path2)[:n] == b"\xaa" * n

    # A window counts as staged only once the engine's own copy-done event completed.
    s.delays(event_delay_s=0.3)
    dev3 = Buffer(1000, 0x33)
    job = eng.write(c.path(), [c.device(dev3, 0)], direct_io="off")
    t0 = time.monotonic()
    assert job.wait_staged()
    assert time.monotonic() - t0 >= 0.25, "staged before the copy's completion event"
    job.seal()
    job.wait()
    c.idle(eng)


def case_staged_ahead_of_slow_writes(c: Case) -> None:
    """With a pool that holds the whole state, device windows count as staged once their copies
    complete, not when the I/O threads get to write them: a slow disk must not hold the fence."""
    s = c.load_standin()
    s.reset(devices=1)
    eng = c.E.Engine(io_threads=2, pool_bytes=16 * WINDOW, window_bytes=WINDOW)
    stall_s = 0.25
    c.E.faults.add(c.E.faults.Op.write, c.tmp, c.E.faults.ANY_OFFSET, c.E.faults.Action.stall, 0, 0, -1,
                   int(stall_s * 1e6))
    try:
        n = 12 * WINDOW  # 12 windows: 6 stalled writes on each of the 2 I/O threads
        dev = Buffer(n, 0x5A)
        path = c.path()
        t0 = time.monotonic()
        job = eng.write(path, [c.device(dev, 0)], direct_io="off")
        assert job.wait_staged()
        staged = time.monotonic() - t0
        job.seal()
        job.wait()
        written = time.monotonic() - t0
    finally:
        c.E.faults.clear()
    assert written >= 5 * stall_s, f"the writes did not stall ({written:.2f} s): the check below proves nothing"
    assert staged < 2 * stall_s, (
        f"staged after {staged:.2f} s, the writes took {written:.2f} s: staging waited for the writes"
    )
    assert read(path)[:n] == b"\x5a" * n
    idle = eng.free_windows
    assert eng.jobs_in_flight == 0 and idle == 16, (eng.jobs_in_flight, idle)


def case_event_handle_reuse(c: Case) -> None:
    """A ready event destroyed after its batch was staged and created again (same handle, as a
    pooled runtime hands out) for a later append must still be waited for."""
    s = c.load_standin()
    s.reset(devices=1)
    eng = c.engine()
    producer = s.stream(0)
    first = Buffer(WINDOW, 0x01)
    ready = s.event(0)
    s.record(ready, producer)
    path = c.path()
    job = eng.write(path, [c.device(first, 0, event=ready)], direct_io="off")
    assert job.release_staged()
    s.destroy_event(ready)  # the caller is done with it (torch drops its Event)
    again = s.event(0)
    assert again == ready, "the stand-in should hand the destroyed handle out again"
    second = Buffer(WINDOW, 0xAA)
    s.kernel(producer, second, 0x55, delay_s=0.3)
    s.record(again, producer)
    job.append([c.device(second, WINDOW, event=again)])
    job.seal()
    job.wait()
    data = read(path)
    assert data[:WINDOW] == b"\x01" * WINDOW
    assert data[WINDOW : 2 * WINDOW] == b"\x55" * WINDOW, (
        "the second batch's copy did not wait for its event (the same handle as the first batch's)"
    )
    assert len(lines(s.log(), "cudaStreamWaitEvent")) == 2
    c.idle(eng)


def case_per_device_streams(c: Case) -> None:
    """Regions on devices 0 and 1 go to a stream of their own device, made and used with that
    device current; the streams are made once and reused."""
    s = c.load_standin()
    s.reset(devices=2)
    eng = c.engine()
    producers = {d: s.stream(d) for d in (0, 1)}
    events = {d: s.event(d) for d in (0, 1)}
    for d in (0, 1):
        s.record(events[d], producers[d])
    s.reset(devices=2)  # the log from here on is the engine's
    a, b, big = Buffer(1000, 0x0A), Buffer(2000, 0x0B), Buffer(3 * WINDOW, 0x0C)
    regions = [c.device(a, 0, 0, events[0]), c.device(b, 1024, 1, events[1]), c.device(big, 8192, 1, events[1])]
    path, _ = c.write(eng, regions)
    data = read(path)
    assert data[:1000] == b"\x0a" * 1000 and data[1024:3024] == b"\x0b" * 2000
    assert data[8192 : 8192 + 3 * WINDOW] == b"\x0c" * (3 * WINDOW)
    log = s.log()
    assert not [line for line in log if "->" in line], log  # no call failed (e.g. an event on another device's stream)
    created = {f["stream"]: int(f["device"]) for f in lines(log, "cudaStreamCreateWithFlags")}
    assert sorted(created.values()) == [0, 1], created
    copies = lines(log, "cudaMemcpyAsync")
    assert {int(f["src"], 16) for f in copies} >= {a.address, b.address, big.address}
    for f in copies:
        assert f["stream_device"] == f["current"], f  # queued with the stream's device current
        assert created[f["stream"]] == int(f["stream_device"])
        expected = 0 if int(f["src"], 16) == a.address else 1  # `big` is copied in pieces: src inside it
        assert int(f["stream_device"]) == expected, f
    for f in lines(log, "cudaStreamWaitEvent"):
        assert created[f["stream"]] == int(f["current"]), f
    assert {f["device"] for f in lines(log, "cudaSetDevice")} == {"0", "1"}
    s.reset(devices=2)
    c.write(eng, [c.device(a, 0, 0, events[0]), c.device(b, 4096, 1, events[1])])
    assert lines(s.log(), "cudaStreamCreateWithFlags") == [], "a second job made new streams"
    c.idle(eng)


def case_pool_pinning(c: Case) -> None:
    """The pool is registered with cudaHostRegister on the first CUDA copy, the copies land in
    pinned memory, and the engine unregisters it (and destroys its streams) when destroyed."""
    s = c.load_standin()
    s.reset(devices=1)
    eng = c.engine()
    address, nbytes = eng.pool_address, eng.pool_bytes
    assert not eng.pool_pinned and eng.pin_error == ""
    host, dev = Buffer(100, 1), Buffer(5000, 2)  # alive until written: a region holds an address only
    c.write(eng, [c.host(host, 0)])
    assert not eng.pool_pinned, "host-only writes need no pinning"
    c.write(eng, [c.device(dev, 0)])
    assert eng.pool_pinned and eng.pin_error == ""
    log = s.log()
    assert lines(log, "cudaHostRegister") == [{"ptr": hex(address), "nbytes": str(nbytes), "flags": "1"}], log
    assert all(f["dst_pinned"] == "1" for f in lines(log, "cudaMemcpyAsync"))
    eng.pin_pool()  # already pinned: nothing more
    assert len(lines(s.log(), "cudaHostRegister")) == 1
    assert s.count("registered") == 1 and s.count("streams") == 1
    del eng
    gc.collect()
    log = s.log()
    assert lines(log, "cudaHostUnregister") == [{"ptr": hex(address)}], log
    assert len(lines(log, "cudaStreamDestroy")) == 1
    assert s.count("registered") == 0 and s.count("streams") == 0


def case_host_register_fails(c: Case) -> None:
    """A refused cudaHostRegister does not fail the save: the copies run from pageable memory,
    the reason is kept, pin_pool() raises it, and nothing is unregistered at the end."""
    s = c.load_standin()
    s.reset(devices=1)
    s.fail("cudaHostRegister", code=2)
    eng = c.engine()
    dev = Buffer(3000, 0x42)
    path, _ = c.write(eng, [c.device(dev, 0)])
    assert read(path)[:3000] == b"\x42" * 3000
    assert not eng.pool_pinned
    assert "cudaHostRegister of the host pool failed: out of memory (cudaError 2)" in eng.pin_error, eng.pin_error
    assert all(f["dst_pinned"] == "0" for f in lines(s.log(), "cudaMemcpyAsync"))
    try:
        eng.pin_pool()
    except RuntimeError as exc:
        assert "cudaHostRegister" in str(exc) and "out of memory" in str(exc), exc
    else:
        raise AssertionError("pin_pool() did not raise")
    c.write(eng, [c.device(dev, 0)])
    tries = [line for line in s.log() if line.startswith("cudaHostRegister")]
    assert len(tries) == 1, f"a refused registration is not retried on every copy: {tries}"
    c.idle(eng)
    del eng
    gc.collect()
    assert lines(s.log(), "cudaHostUnregister") == []


# What each failing call's error names; the engine raises OSError(EIO) with the file named.
FAILING_CALLS = {
    "cudaSetDevice": "cudaSetDevice(0) failed",
    "cudaStreamCreateWithFlags": "cudaStreamCreateWithFlags for device 0 failed",
    "cudaStreamWaitEvent": "cudaStreamWaitEvent failed",
    "cudaMemcpyAsync": "cudaMemcpyAsync device-to-host failed",
    "cudaEventCreateWithFlags": "cudaEventCreateWithFlags failed",
    "cudaEventRecord": "cudaEventRecord failed",
    "cudaEventSynchronize": "cudaEventSynchronize after the device-to-host copies failed",
    "cudaEventDestroy": "cudaEventDestroy failed",
}


def case_error(c: Case, call: str) -> None:
    """A failing CUDA call fails the job with an OSError naming the call and the file, after the
    copies already queued have finished (their slot is reused next); nothing hangs or leaks,
    and the engine works on."""
    s = c.load_standin()
    s.reset(devices=1)
    eng = c.engine()
    producer = s.stream(0)
    ready = s.event(0)
    s.record(ready, producer)
    first, second = Buffer(1000, 0x61), Buffer(2000, 0x62)
    regions = [c.device(first, 0, event=ready), c.device(second, 4096, event=ready)]  # one window
    if call == "cudaMemcpyAsync":
        s.delays(copy_delay_s=0.3)
        s.fail(call, skip=1)  # the first copy is queued, the second refused
    else:
        s.fail(call)
    path = c.path()
    t0 = time.monotonic()
    job = eng.write(path, regions, direct_io="off")
    job.seal()
    try:
        job.wait()
    except OSError as exc:
        message = str(exc)
        assert FAILING_CALLS[call] in message and f"cudaError {ERROR_CODE}" in message, message
        assert "an illegal memory access was encountered" in message, message
        assert exc.errno == errno.EIO and exc.filename == path, (exc.errno, exc.filename)
        assert exc.offset == 0 or call == "cudaMemcpyAsync", exc.offset
    else:
        raise AssertionError(f"a failing {call} did not fail the write")
    if call == "cudaMemcpyAsync":
        # The queued copy writes into the window's pool slot: the job ends only after it has.
        assert time.monotonic() - t0 >= 0.25, "the failed window's slot was released while its copy ran"
        log = s.log()
        failed_at = log.index("cudaMemcpyAsync -> injected error 700")
        assert any(line.startswith("cudaStreamSynchronize") for line in log[failed_at:]), log
    c.idle(eng)
    s.reset(devices=1)  # the failure is gone: the same engine writes again
    path, _ = c.write(eng, regions)
    data = read(path)
    assert data[:1000] == b"\x61" * 1000 and data[4096:6096] == b"\x62" * 2000
    c.idle(eng)
    # Every event the engine made was destroyed (but the one whose destroy failed), and the test's own lives.
    assert s.count("events") == (2 if call == "cudaEventDestroy" else 1), "an event the engine made was never destroyed"


def case_no_runtime(c: Case) -> None:
    """Without a CUDA runtime a device region fails its job (ENODEV, file named); a library that
    lacks entry points is refused by name, and does not stop a later load."""
    eng = c.engine()
    path = c.path()
    job = eng.write(path, [c.device(Buffer(100, 1), 0)], direct_io="off")
    job.seal()
    try:
        job.wait()
    except OSError as exc:
        assert exc.errno == errno.ENODEV and exc.filename == path and "no CUDA runtime is loaded" in str(exc), exc
    else:
        raise AssertionError("a CUDA region without a runtime did not fail")
    c.idle(eng)
    why = c.E.load_cuda_runtime(os.path.join(c.tmp, "missing.so"))
    assert why.startswith("cannot load the CUDA runtime") and c.E.cuda_runtime_path() is None, why
    why = c.E.load_cuda_runtime("libc.so.6")
    assert "lacks CUDA runtime entry points: cudaSetDevice, cudaStreamCreateWithFlags" in why, why
    assert "cudaStreamSynchronize" in why and c.E.cuda_runtime_path() is None, why
    c.load_standin()
    assert c.E.load_cuda_runtime("libc.so.6") == "", "the first success wins"


def case_hashing_stream(c: Case) -> None:
    """create_cuda_stream (incremental saves copy device tensors for hashing on it): a new
    non-blocking stream on the calling thread's current device per call; without a runtime, or
    when the runtime refuses, a RuntimeError naming the call."""
    try:
        c.E.create_cuda_stream()
    except RuntimeError as exc:
        assert "no CUDA runtime is loaded" in str(exc), exc
    else:
        raise AssertionError("a stream was made without a CUDA runtime")
    s = c.load_standin()
    s.reset(devices=2)
    s._ok(s.lib.cudaSetDevice(1), "cudaSetDevice")
    first, second = c.E.create_cuda_stream(), c.E.create_cuda_stream()
    assert first and second and first != second, (first, second)
    made = lines(s.log(), "cudaStreamCreateWithFlags")
    assert [(f["device"], f["flags"]) for f in made] == [("1", "1"), ("1", "1")], made
    s.fail("cudaStreamCreateWithFlags")
    try:
        c.E.create_cuda_stream()
    except RuntimeError as exc:
        assert "cudaStreamCreateWithFlags for a hashing stream failed" in str(exc) and f"cudaError {ERROR_CODE}" in str(exc), exc
    else:
        raise AssertionError("a refused cudaStreamCreateWithFlags did not raise")


def case_streamed_device(c: Case) -> None:
    """A streamed job (an upload takes its windows) copies device memory after the producer's
    event like a file's job; a failing copy fails the stream, and every slot comes back."""
    s = c.load_standin()
    s.reset(devices=1)
    eng = c.engine()
    producer = s.stream(0)
    n = 3 * WINDOW + 1234
    dev = Buffer(n, 0xAA)
    s.kernel(producer, dev, 0x55, delay_s=0.2)
    ready = s.event(0)
    s.record(ready, producer)
    job = eng.write("s3://bucket/streamed", [c.device(dev, 0, event=ready)], stream=True)
    job.seal()
    out = bytearray()
    while (chunk := job.next_chunk()) is not None:
        offset, view = chunk
        out += bytes(offset - len(out))
        out += view
    segments = job.wait()
    assert bytes(out[:n]) == b"\x55" * n, "the streamed copy read the bytes before the kernel"
    for seg in segments:
        assert c.E.crc32c(bytes(out[seg.offset : seg.offset + seg.nbytes])) == seg.crc32c
    c.idle(eng)
    s.fail("cudaMemcpyAsync")
    failing = Buffer(2 * WINDOW, 0x66)
    job = eng.write("s3://bucket/failing", [c.device(failing, 0, event=ready)], stream=True)
    job.seal()
    try:
        while job.next_chunk() is not None:
            pass
    except OSError as exc:
        assert "cudaMemcpyAsync" in str(exc) and exc.filename == "s3://bucket/failing", (str(exc), exc.filename)
    else:
        raise AssertionError("a failing cudaMemcpyAsync did not fail the streamed job")
    try:
        job.wait()
    except OSError:
        pass
    c.idle(eng)


def main() -> None:
    name, engine_so, standin_so, tmp, *args = sys.argv[1:]
    case = globals()[f"case_{name}"]
    case(Case(engine_so, standin_so, tmp), *args)
    print("OK")


if __name__ == "__main__":
    main()
