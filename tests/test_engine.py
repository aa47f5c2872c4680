"""The native engine on its own: regions to offsets, checksums, errors with context.

Also its boundary: the typed records (validated, read-only), the stub that
describes the module, the benchmark probes kept out of it, and
release_engines() giving the host pools back.
"""

from __future__ import annotations

import errno
import gc
import os
import random
import threading
import weakref

import pytest
import torch

from dcp_datastates import _engine, _probes
from dcp_datastates.native import engine as _native
from dcp_datastates.native.engine import (
    DeviceRegion,
    EngineBusyError,
    HostRegion,
    ReadFailure,
    ReadRequest,
    Segment,
    SegmentCheck,
    StridedRegion,
    get_engine,
    release_engines,
)

WINDOW = 64 << 10


@pytest.fixture(scope="module")
def engine():
    return get_engine(host_cache_bytes=4 * WINDOW, io_threads=2, window_bytes=WINDOW)


def _bytes(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


def host(t: torch.Tensor, offset: int, nbytes: int | None = None) -> HostRegion:
    return HostRegion(address=t.data_ptr(), nbytes=t.nbytes if nbytes is None else nbytes, file_offset=offset)


def request(t: torch.Tensor, offset: int, nbytes: int, checks=(), file_index: int = 0) -> ReadRequest:
    return ReadRequest(file_index=file_index, offset=offset, nbytes=nbytes, address=t.data_ptr(), checks=checks)


def as_checks(segments) -> list[SegmentCheck]:
    """A written file's segments as the checks of one read of it from offset 0."""
    return [SegmentCheck(offset_in_request=s.offset, nbytes=s.nbytes, crc32c=s.crc32c) for s in segments]


def test_crc32c_known_values():
    assert _engine.crc32c(b"123456789") == 0xE3069283
    assert _engine.crc32c(b"") == 0
    assert _engine.crc32c(b"\x00" * 32) == 0x8A9136AA
    data = os.urandom(10_000)
    assert _engine.crc32c(data[5000:], _engine.crc32c(data[:5000])) == _engine.crc32c(data)
    assert _engine.crc32c_backend() in ("sse4.2+pclmul", "sse4.2", "armv8-crc", "table")
    # The engine's kernel is one this CPU runs (of two hardware kernels, the faster, timed once).
    assert _engine.crc32c_backend() in _probes.crc32c_kernels()
    kernels = _probes.crc32c_kernels()
    assert _engine.crc32c_backend() != "table" or kernels == ["table"]


@pytest.mark.parametrize("kernel", _probes.crc32c_kernels())
def test_every_crc32c_kernel_gives_the_bytewise_crc(kernel):
    """Each implementation this CPU runs (the engine uses the fastest) against the table
    kernel, over lengths around every block size the kernels switch at (16-byte folds,
    64-byte and 128-byte thresholds, 256-byte and 8 KiB chains), misaligned starts and
    chained calls."""
    rng = random.Random(kernel)
    data = bytes(rng.getrandbits(8) for _ in range(3 * 8192 * 3 + 300))
    lengths = sorted({n + d for n in (0, 8, 16, 64, 128, 256, 768, 3 * 8192, 9 * 8192) for d in (-9, -1, 0, 1, 7, 15, 63)} - {-9, -1})
    for n in lengths:
        for start in (0, 1, 13):
            init = rng.getrandbits(32)
            chunk = data[start : start + n]
            assert _probes.crc32c_with(kernel, chunk, init) == _probes.crc32c_with("table", chunk, init), (n, start)
    whole = _probes.crc32c_with(kernel, data)
    assert _probes.crc32c_with(kernel, data[5000:], _probes.crc32c_with(kernel, data[:5000])) == whole == _engine.crc32c(data)
    assert _probes.crc32c_with(kernel, b"123456789") == 0xE3069283
    with pytest.raises(ValueError, match="not available"):
        _probes.crc32c_with("no-such-kernel", b"x")


@pytest.mark.parametrize("direct_io", ["auto", "off"])
def test_regions_land_at_their_offsets_with_zero_gaps(engine, tmp_path, direct_io):
    a, b, c = _bytes(1000, 1), _bytes(3 * WINDOW + 123, 2), _bytes(10, 3)
    regions = [host(b, 8192), host(a, 0), host(c, 8192 + b.numel() + 5)]
    path = tmp_path / "f"
    job = engine.write(str(path), regions, [a, b, c], direct_io=direct_io)
    job.seal()
    segments = job.wait()
    blob = path.read_bytes()
    assert len(blob) % 4096 == 0
    assert blob[:1000] == bytes(a.tolist()) and blob[1000:8192] == b"\0" * 7192
    assert blob[8192 : 8192 + b.numel()] == bytes(b.tolist())
    end_c = 8192 + b.numel() + 5
    assert blob[end_c : end_c + 10] == bytes(c.tolist()) and blob[end_c + 10 :] == b"\0" * (len(blob) - end_c - 10)
    # Segments cover every region byte once, split at windows, with correct CRCs.
    assert all(isinstance(s, Segment) for s in segments)
    assert [s.offset for s in segments] == sorted(s.offset for s in segments)
    assert sum(s.nbytes for s in segments) == 1000 + b.numel() + 10
    for s in segments:
        assert _engine.crc32c(blob[s.offset : s.offset + s.nbytes]) == s.crc32c


def test_append_after_seal_is_refused_and_overlap_is_refused(engine, tmp_path):
    a = _bytes(5000)
    job = engine.write(str(tmp_path / "f"), [host(a, 0, 5000)], [a])
    with pytest.raises(ValueError, match="overlaps"):
        job.append([host(a, 4096, 10)], [a])
    job.append([host(a, 8192, 100)], [a])
    job.seal()
    job.wait()
    with pytest.raises(Exception, match="sealed"):
        job.append([host(a, 1 << 20, 10)], [a])


def test_existing_file_is_never_overwritten(engine, tmp_path):
    p = tmp_path / "exists"
    p.write_bytes(b"keep me")
    with pytest.raises(FileExistsError) as ei:
        engine.write(str(p), [])
    assert ei.value.filename == str(p)
    assert p.read_bytes() == b"keep me"


def test_missing_directory_names_the_path(engine, tmp_path):
    with pytest.raises(FileNotFoundError) as ei:
        engine.write(str(tmp_path / "no" / "f"), [])
    assert "no/f" in ei.value.filename


def test_enospc_names_file_and_offset(engine, small_tmpfs):
    big = _bytes(4 << 20)
    path = small_tmpfs / "f"
    job = engine.write(str(path), [host(big, 0)], [big], direct_io="off")
    job.seal()
    with pytest.raises(OSError) as ei:
        job.wait()
    assert ei.value.errno == errno.ENOSPC and ei.value.filename == str(path)
    assert ei.value.offset >= 0 and "offset" in str(ei.value)


def test_enospc_detected_up_front_with_preallocation(engine, small_tmpfs):
    big = _bytes(4 << 20)
    with pytest.raises(OSError) as ei:
        engine.write(str(small_tmpfs / "g"), [host(big, 0)], [big], preallocate=big.numel())
    assert ei.value.errno == errno.ENOSPC and "reserving space" in str(ei.value)


def test_dropped_job_waits_before_releasing_memory(engine, tmp_path):
    for i in range(20):
        t = _bytes(256 << 10, i)
        job = engine.write(str(tmp_path / f"f{i}"), [host(t, 0)], [t])
        del t, job  # dropped mid-flight: must cancel and wait, never read freed memory
    assert engine.free_windows == 4


def test_reads_verify_checksums_and_report_truncation(engine, tmp_path):
    data = _bytes(200_000, 9)
    path = tmp_path / "f"
    job = engine.write(str(path), [host(data, 0)], [data])
    job.seal()
    checks = as_checks(job.wait())
    out = torch.empty_like(data)
    assert engine.read([str(path)], [request(out, 0, data.numel(), checks)], [out]).wait() == []
    assert torch.equal(out, data)
    raw = bytearray(path.read_bytes())
    raw[70_000] ^= 0xFF
    path.write_bytes(bytes(raw))
    failures = engine.read([str(path)], [request(out, 0, data.numel(), checks)], [out]).wait()
    assert [f.kind for f in failures] == ["checksum"] and failures[0].path == str(path)
    assert isinstance(failures[0], ReadFailure) and failures[0].request == 0 and failures[0].offset >= 65536
    big = torch.empty(10 << 20, dtype=torch.uint8)  # kept alive: the engine writes into it
    failures = engine.read([str(path)], [request(big, 0, 10 << 20)], [big]).wait()
    assert failures and failures[0].kind == "truncated"
    failures = engine.read([str(tmp_path / "missing")], [request(out, 0, 10)], [out]).wait()
    assert failures[0].kind == "io" and failures[0].errno == errno.ENOENT and failures[0].offset == -1


@pytest.mark.parametrize("direct_io", ["auto", "off"])
@pytest.mark.parametrize("stream", [False, True])
def test_checksum_bytes_cuts_segments_at_its_multiples_in_the_file(tmp_path, direct_io, stream):
    eng = get_engine(host_cache_bytes=4 * WINDOW, io_threads=2, window_bytes=WINDOW, checksum_bytes=4096)
    assert eng.checksum_bytes == 4096
    # One region across windows (from 1000: windows start at 0, segments at multiples of 4096),
    # a small one inside a segment, one ending mid-segment.
    a, b, c = _bytes(3 * WINDOW + 777, 1), _bytes(100, 2), _bytes(5000, 3)
    b_at, c_at = 1000 + a.numel() + 300, 1000 + a.numel() + 4096 * 3
    path = tmp_path / "f"
    job = eng.write(str(path), [host(a, 1000), host(b, b_at), host(c, c_at)], [a, b, c], direct_io=direct_io,
                    stream=stream)
    job.seal()
    blob = _drain_stream(job) if stream else b""
    segments = job.wait()
    if not stream:
        blob = path.read_bytes()
    expected = []
    for start, n in ((1000, a.numel()), (b_at, 100), (c_at, 5000)):
        cut = start
        while cut < start + n:
            nxt = min(start + n, (cut // 4096 + 1) * 4096)
            expected.append((cut, nxt - cut))
            cut = nxt
    assert [(s.offset, s.nbytes) for s in segments] == expected
    for s in segments:
        assert _engine.crc32c(bytes(blob[s.offset : s.offset + s.nbytes])) == s.crc32c
    if not stream:  # a read of the whole file, verified segment by segment (read in runs)
        out = torch.empty(len(blob), dtype=torch.uint8)
        checks = as_checks(segments)
        assert eng.read([str(path)], [request(out, 0, len(blob), checks)], [out]).wait() == []
        assert bytes(out.tolist()) == bytes(blob)
        raw = bytearray(blob)
        raw[1000 + 5 * 4096 + 17] ^= 0x01
        path.write_bytes(bytes(raw))
        failures = eng.read([str(path)], [request(out, 0, len(blob), checks)], [out]).wait()
        assert [(f.kind, f.offset) for f in failures] == [("checksum", 5 * 4096)]


@pytest.mark.parametrize("bad", [3000, 2048, 6 * 4096, 2 * WINDOW])
def test_checksum_bytes_must_be_a_power_of_two_within_the_window(bad):
    with pytest.raises(ValueError, match="checksum_bytes"):
        get_engine(host_cache_bytes=4 * WINDOW, io_threads=2, window_bytes=WINDOW, checksum_bytes=bad)


def test_many_small_regions_coalesce(engine, tmp_path):
    ts = [_bytes(100, i) for i in range(3000)]
    regions = [host(t, i * 128) for i, t in enumerate(ts)]
    job = engine.write(str(tmp_path / "f"), regions, ts)
    job.seal()
    segs = job.wait()
    assert len(segs) >= 3000
    blob = (tmp_path / "f").read_bytes()
    assert all(blob[i * 128 : i * 128 + 100] == bytes(t.tolist()) for i, t in enumerate(ts[:50]))
    assert engine.free_windows == 4


def test_probes_live_in_their_own_module(tmp_path):
    """The disk probes are benchmark equipment: in dcp_datastates._probes, not in the engine."""
    from dcp_datastates import _probes

    p = str(tmp_path / "probe")
    assert _probes.probe_sequential_write(p, 1 << 20, 1 << 18, False) > 0
    _probes.drop_page_cache(p)
    n, s = _probes.probe_sequential_read(p, 1 << 18)
    assert n == 1 << 20 and s > 0
    with pytest.raises(FileNotFoundError) as info:  # errors name the file, as the engine's do
        _probes.probe_sequential_read(str(tmp_path / "missing"))
    assert info.value.filename == str(tmp_path / "missing")
    assert not [name for name in dir(_engine) if "probe" in name or "page_cache" in name]


@pytest.mark.parametrize("durable", [True, False])
def test_durable_false_skips_the_fsync_of_scratch_files(engine, tmp_path, durable):
    """Async compressed saves stage raw bytes into a scratch file that is read back and
    removed: it is written without the fsync a checkpoint file gets (an fsync fault shows it)."""
    from dcp_datastates.native.faults import inject_fault

    data = _bytes(3 * engine.window_bytes + 17)
    path = str(tmp_path / "scratch")
    with inject_fault("fsync", path=path, errno=errno.EIO):
        job = engine.write(path, [host(data, 0)], [data], direct_io="off", durable=durable)
        job.seal()
        if durable:
            with pytest.raises(OSError) as info:
                job.wait()
            assert info.value.errno == errno.EIO and info.value.filename == path
            return
        job.wait()
    with open(path, "rb") as f:
        written = f.read()
    assert written[: data.nbytes] == data.numpy().tobytes() and not written[data.nbytes :].strip(b"\0")


def test_tmpfs_is_not_preallocated_but_its_free_space_is_checked(engine, tmp_path):
    """fallocate on tmpfs zeroes every page before the writes fill them again (an extra
    pass: 6% of a write to /dev/shm in benchmarks/probe_file_writes.cc, and 61 ms of stage() for 200 MB when it ran in the
    caller's thread). On tmpfs the job checks the free space at once and reserves nothing;
    on an extent-based filesystem it still reserves at once."""
    import tempfile

    nbytes = 64 << 20
    shm = tempfile.mkdtemp(dir="/dev/shm") if os.path.isdir("/dev/shm") else None
    if shm is None:
        pytest.skip("no /dev/shm")
    try:
        path = os.path.join(shm, "lazy")
        job = engine.write(path, [], [], direct_io="off", preallocate=nbytes)
        assert os.stat(path).st_blocks == 0  # nothing reserved in the caller's thread
        data = _bytes(engine.window_bytes)
        job.append([host(data, 0)], [data])
        job.seal()
        job.wait()
        with open(path, "rb") as f:
            assert f.read(data.nbytes) == data.numpy().tobytes()
        assert os.stat(path).st_blocks * 512 < nbytes  # only the written pages: no reservation either
        with pytest.raises(OSError) as info:  # more than tmpfs can hold: refused at once
            engine.write(os.path.join(shm, "huge"), [], [], direct_io="off", preallocate=1 << 60)
        assert info.value.errno == errno.ENOSPC and info.value.filename.endswith("huge")
    finally:
        import shutil

        shutil.rmtree(shm, ignore_errors=True)
    eager = str(tmp_path / "eager")
    job = engine.write(eager, [], [], direct_io="off", preallocate=nbytes)
    import subprocess

    fs = subprocess.run(["stat", "-f", "-c", "%T", str(tmp_path)], capture_output=True, text=True).stdout.strip()
    if fs in ("ext2/ext3", "xfs", "btrfs"):  # extent-based: reserved in the caller's thread, at once
        assert os.stat(eager).st_blocks * 512 >= nbytes
    job.seal()
    job.wait()


# -- the typed boundary ----------------------------------------------------------------------


def test_strided_region_is_gathered_in_row_major_order(engine, tmp_path):
    base = torch.arange(300 * 200, dtype=torch.int32).reshape(300, 200)
    view = base.t()[5:150]  # strided: gathered run by run, never made contiguous
    region = StridedRegion(
        address=view.data_ptr(), nbytes=view.nbytes, file_offset=4096, sizes=view.shape, strides=view.stride(),
        itemsize=view.element_size(),
    )
    assert region.sizes == (145, 300) and region.strides == (1, 200) and region.itemsize == 4
    job = engine.write(str(tmp_path / "f"), [region], [base], direct_io="off")
    job.seal()
    job.wait()
    with open(tmp_path / "f", "rb") as f:
        f.seek(4096)
        assert f.read(view.nbytes) == view.contiguous().numpy().tobytes()


def test_records_have_named_read_only_fields_and_a_useful_repr():
    r = HostRegion(address=0x1000, nbytes=10, file_offset=4096)
    assert (r.address, r.nbytes, r.file_offset) == (0x1000, 10, 4096)
    assert repr(r) == "HostRegion(address=0x1000, nbytes=10, file_offset=4096)"
    with pytest.raises(AttributeError):
        r.nbytes = 5
    d = DeviceRegion(address=0x2000, nbytes=8, file_offset=0, device=1, ready_event=0xBEEF)
    assert (d.device, d.ready_event) == (1, 0xBEEF) and "device=1, ready_event=0xbeef" in repr(d)
    assert DeviceRegion(address=0x2000, nbytes=8, file_offset=0, device=0).ready_event is None
    assert all(isinstance(x, _engine.Region) for x in (r, d))
    with pytest.raises(TypeError):  # the base class describes; only its subclasses are made
        _engine.Region()
    c = SegmentCheck(offset_in_request=0, nbytes=4096, crc32c=0xE3069283)
    q = ReadRequest(file_index=2, offset=8192, nbytes=4096, address=0x3000, checks=[c])
    assert q.checks == (c,) and q.file_index == 2 and "crc32c=0xe3069283" in repr(q)
    assert Segment(offset=1, nbytes=2, crc32c=3) == Segment(offset=1, nbytes=2, crc32c=3)
    assert len({Segment(offset=1, nbytes=2, crc32c=3), Segment(offset=1, nbytes=2, crc32c=3)}) == 1
    f = ReadFailure(request=0, kind="checksum", errno=errno.EIO, path="/x", offset=7, message="bad")
    assert (f.kind, f.errno, f.offset) == ("checksum", errno.EIO, 7) and "kind='checksum'" in repr(f)
    with pytest.raises(TypeError):  # keyword-only: field order is never guessed
        HostRegion(0x1000, 10, 4096)


@pytest.mark.parametrize(
    ("make", "error", "message"),
    [
        (lambda: HostRegion(address=-1, nbytes=1, file_offset=0), ValueError, r"HostRegion\.address must be >= 0"),
        (lambda: HostRegion(address=0, nbytes=1, file_offset=0), ValueError, r"HostRegion\.address is 0"),
        (lambda: HostRegion(address="0x10", nbytes=1, file_offset=0), TypeError, r"HostRegion\.address must be an int"),
        (lambda: HostRegion(address=16, nbytes=True, file_offset=0), TypeError, r"HostRegion\.nbytes must be an int"),
        (lambda: HostRegion(address=16, nbytes=1, file_offset=-4096), ValueError, r"HostRegion\.file_offset must be >= 0"),
        (lambda: HostRegion(address=16, nbytes=1 << 62, file_offset=1 << 62), ValueError, r"past the largest file offset"),
        (
            lambda: StridedRegion(address=16, nbytes=40, file_offset=0, sizes=[3, 4], strides=[1, 3], itemsize=4),
            ValueError, r"StridedRegion\.nbytes is 40 but sizes \(3, 4\) of itemsize 4 hold 48 bytes",
        ),
        (
            lambda: StridedRegion(address=16, nbytes=48, file_offset=0, sizes=[3, 4], strides=[1], itemsize=4),
            ValueError, r"sizes has 2 dimensions but strides has 1",
        ),
        (
            lambda: StridedRegion(address=16, nbytes=48, file_offset=0, sizes=[3, 4], strides=[-1, 3], itemsize=4),
            ValueError, r"StridedRegion\.strides\[0\] must be >= 0",
        ),
        (
            lambda: StridedRegion(address=16, nbytes=0, file_offset=0, sizes=[0], strides=[1], itemsize=0),
            ValueError, r"StridedRegion\.itemsize must be > 0",
        ),
        (lambda: DeviceRegion(address=16, nbytes=1, file_offset=0, device=-1), ValueError, r"DeviceRegion\.device must be >= 0"),
        (
            lambda: DeviceRegion(address=16, nbytes=1, file_offset=0, device=0, ready_event="ev"),
            TypeError, r"DeviceRegion\.ready_event must be an int",
        ),
        (lambda: SegmentCheck(offset_in_request=0, nbytes=1, crc32c=1 << 32), ValueError, r"SegmentCheck\.crc32c must be at most"),
        (
            lambda: ReadRequest(file_index=0, offset=0, nbytes=10, address=16, checks=[
                SegmentCheck(offset_in_request=0, nbytes=6, crc32c=0), SegmentCheck(offset_in_request=4, nbytes=6, crc32c=0)]),
            ValueError, r"ReadRequest\.checks\[1\] covers bytes \[4, 10\)",
        ),
        (
            lambda: ReadRequest(file_index=0, offset=0, nbytes=10, address=16, checks=[SegmentCheck(offset_in_request=8, nbytes=6, crc32c=0)]),
            ValueError, r"ReadRequest\.checks\[0\] covers bytes \[8, 14\)",
        ),
        (lambda: ReadRequest(file_index=0, offset=0, nbytes=10, address=16, checks=[object()]), TypeError, r"ReadRequest\.checks\[0\] must be a SegmentCheck"),
        (lambda: ReadRequest(file_index=1 << 32, offset=0, nbytes=1, address=16), ValueError, r"ReadRequest\.file_index must be at most"),
        (lambda: ReadFailure(request=0, kind="disk", errno=5, path="p", offset=0, message="m"), ValueError, r"ReadFailure\.kind must be"),
    ],
)
def test_records_are_validated_naming_the_field(make, error, message):
    with pytest.raises(error, match=message):
        make()


def test_jobs_refuse_what_is_not_a_record(engine, tmp_path):
    with pytest.raises(TypeError, match=r"regions\[0\] must be a HostRegion, StridedRegion or DeviceRegion, got int"):
        engine.write(str(tmp_path / "f"), [5])
    assert not (tmp_path / "f").exists()
    with pytest.raises(TypeError, match=r"requests\[0\] must be a ReadRequest, got dict"):
        engine.read([str(tmp_path / "f")], [{}])


def test_records_accept_numpy_integers(engine, tmp_path):
    np = pytest.importorskip("numpy")
    a = _bytes(100)
    job = engine.write(str(tmp_path / "f"), [HostRegion(address=a.data_ptr(), nbytes=np.int64(100), file_offset=np.uint32(0))], [a])
    job.seal()
    assert [s.nbytes for s in job.wait()] == [100]


def test_fault_hooks_are_a_submodule_of_the_engine():
    import dcp_datastates._engine.faults as faults

    assert faults is _engine.faults
    assert {"add", "clear", "fired", "armed", "point", "Op", "Action", "ANY_OFFSET"} <= set(dir(faults))
    try:
        index = faults.add(faults.Op.rename, "no-such-file-ever", action=faults.Action.error, errno=errno.EIO)
        assert faults.armed() and faults.fired(index) == 0
        with pytest.raises(OSError) as info:
            faults.point(faults.Op.rename, "/x/no-such-file-ever")
        assert info.value.errno == errno.EIO and faults.fired(index) == 1
        with pytest.raises(IndexError):
            faults.fired(index + 1)
    finally:
        faults.clear()
    assert not faults.armed()
    assert not [n for n in dir(_engine) if n.startswith("_fault")]


# -- the stub ----------------------------------------------------------------------------------


def _stub_members(path: str) -> tuple[set[str], dict[str, set[str]]]:
    """Public names of a .pyi, and each class's public members (its stub bases' included)."""
    import ast

    with open(path) as f:
        tree = ast.parse(f.read())
    names: set[str] = set()
    classes: dict[str, ast.ClassDef] = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            classes[node.name] = node
            names.add(node.name)
        elif isinstance(node, ast.FunctionDef):
            names.add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.ImportFrom) and node.module is None:
            names.update(a.asname or a.name for a in node.names)

    def members(cls: ast.ClassDef) -> set[str]:
        out = set()
        for node in cls.body:
            if isinstance(node, ast.FunctionDef):
                out.add(node.name)
            elif isinstance(node, ast.Assign):
                out.update(t.id for t in node.targets if isinstance(t, ast.Name))
        for base in cls.bases:
            if isinstance(base, ast.Name) and base.id in classes:
                out |= members(classes[base.id])
        return {m for m in out if not m.startswith("_")}

    return {n for n in names if not n.startswith("_")}, {n: members(c) for n, c in classes.items()}


def _module_members(module) -> tuple[set[str], dict[str, set[str]]]:
    import enum
    import inspect

    names = {n for n in dir(module) if not n.startswith("_")}
    classes = {}
    for n in names:
        obj = getattr(module, n)
        if not inspect.isclass(obj):
            continue
        if issubclass(obj, BaseException):
            classes[n] = set()  # exceptions: described by their base
        elif hasattr(obj, "__members__") and not issubclass(obj, enum.Enum):  # a pybind11 enum
            classes[n] = set(obj.__members__)
        else:
            classes[n] = {m for m in vars(obj) if not m.startswith("_")}
            for base in obj.__mro__[1:]:
                if base.__module__ == module.__name__:
                    classes[n] |= {m for m in vars(base) if not m.startswith("_")}
    return names, classes


@pytest.mark.parametrize("module_name", ["_engine", "_engine.faults", "_probes"])
def test_stub_and_module_name_the_same_things(module_name):
    """Every public function, class, attribute and class member of the extension is in its
    stub, and every name in the stub exists: the stub cannot drift from the module."""
    import importlib

    import dcp_datastates

    module = importlib.import_module(f"dcp_datastates.{module_name}")
    base = os.path.dirname(dcp_datastates.__file__)
    stub = {
        "_engine": os.path.join(base, "_engine", "__init__.pyi"),
        "_engine.faults": os.path.join(base, "_engine", "faults.pyi"),
        "_probes": os.path.join(base, "_probes.pyi"),
    }[module_name]
    stub_names, stub_classes = _stub_members(stub)
    names, classes = _module_members(module)
    assert names == stub_names, f"only in the module: {names - stub_names}; only in the stub: {stub_names - names}"
    for cls, members in classes.items():
        assert members == stub_classes[cls], (
            f"{cls}: only in the module: {members - stub_classes[cls]}; only in the stub: {stub_classes[cls] - members}"
        )


def test_stubs_are_installed_with_the_package():
    """The stubs and py.typed sit in the package directory, which the wheel ships whole."""
    import dcp_datastates

    base = os.path.dirname(dcp_datastates.__file__)
    for name in ("_engine/__init__.pyi", "_engine/faults.pyi", "_probes.pyi", "py.typed"):
        assert os.path.isfile(os.path.join(base, name)), name


# -- release_engines() ---------------------------------------------------------------------------


def _mapped(address: int, nbytes: int) -> bool:
    """Whether any mapping of this process overlaps [address, address + nbytes)."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            lo, hi = (int(x, 16) for x in line.split(None, 1)[0].split("-"))
            if lo < address + nbytes and address < hi:
                return True
    return False


def _released_and_gone(ref: weakref.ref, address: int, nbytes: int) -> None:
    gc.collect()
    assert ref() is None, "the released engine is still alive"
    assert not _mapped(address, nbytes), "the released engine's pool is still mapped"


@pytest.fixture()
def private_settings():
    """Engine settings no other test uses (3 windows of 68 KiB), so its engine is this test's."""
    return dict(host_cache_bytes=3 * (68 << 10), io_threads=1, window_bytes=68 << 10)


def test_release_engines_gives_the_host_pool_back(tmp_path, private_settings):
    eng = get_engine(**private_settings)
    data = _bytes(3 * (68 << 10) + 5)
    job = eng.write(str(tmp_path / "f"), [host(data, 0)], [data])
    job.seal()
    job.wait()  # a finished job keeps no reference to its engine
    ref, address, nbytes = weakref.ref(eng), eng.pool_address, eng.pool_bytes
    assert _mapped(address, nbytes) and eng.jobs_in_flight == 0
    del eng
    assert release_engines() >= 1
    _released_and_gone(ref, address, nbytes)
    fresh = get_engine(**private_settings)
    assert fresh.pool_address != 0 and ref() is None
    del job  # a finished job outliving the release is harmless


def test_release_engines_refuses_while_a_job_is_in_flight(tmp_path, private_settings):
    eng = get_engine(**private_settings)
    data = _bytes(1000)
    job = eng.write(str(tmp_path / "open"), [host(data, 0)], [data])  # not sealed: in flight
    reader_job = None
    try:
        assert eng.jobs_in_flight == 1
        with pytest.raises(EngineBusyError, match=r"io_threads=1, window_bytes=69632: 1 job\(s\)"):
            release_engines()
        assert get_engine(**private_settings) is eng  # nothing was released
    finally:
        job.seal()
        job.wait()
    assert eng.jobs_in_flight == 0
    out = torch.empty_like(data)
    reader_job = eng.read([str(tmp_path / "open")], [request(out, 0, 1000)], [out])
    assert reader_job.wait() == [] and eng.jobs_in_flight == 0
    ref, address, nbytes = weakref.ref(eng), eng.pool_address, eng.pool_bytes
    del eng
    release_engines()
    _released_and_gone(ref, address, nbytes)


def test_failed_and_dropped_jobs_are_not_left_in_flight(tmp_path, private_settings):
    eng = get_engine(**private_settings)
    with pytest.raises(FileNotFoundError):
        eng.write(str(tmp_path / "no" / "dir"), [])
    a = _bytes(100)
    job = eng.write(str(tmp_path / "f"), [host(a, 0)], [a])
    job.cancel("the test gives up")
    job.seal()
    with pytest.raises(OSError, match="the test gives up"):
        job.wait()
    dropped = eng.write(str(tmp_path / "g"), [host(a, 0)], [a])
    del dropped  # cancelled and waited for by the binding
    assert eng.jobs_in_flight == 0


def test_writers_and_readers_get_a_fresh_engine_after_a_release(tmp_path, private_settings):
    import torch.distributed.checkpoint as dcp

    from dcp_datastates import DataStatesReader, DataStatesWriter

    state = {"w": torch.randn(64, 64), "step": 3}
    writer = DataStatesWriter(tmp_path / "a", **private_settings)
    dcp.save(state, storage_writer=writer, no_dist=True)
    reader = DataStatesReader(tmp_path / "a", io_threads=1, window_bytes=68 << 10)  # a reader needs its checkpoint
    out = {"w": torch.zeros(64, 64), "step": 0}
    dcp.load(out, storage_reader=reader, no_dist=True)
    old_writer_engine, old_reader_engine = writer._engine, reader.store.engine
    refs = [weakref.ref(old_writer_engine), weakref.ref(old_reader_engine)]
    pools = [(e.pool_address, e.pool_bytes) for e in (old_writer_engine, old_reader_engine)]
    del old_writer_engine, old_reader_engine
    release_engines()
    for ref, (address, nbytes) in zip(refs, pools):
        _released_and_gone(ref, address, nbytes)
    dcp.save(state, storage_writer=writer, checkpoint_id=tmp_path / "b", no_dist=True)  # same writer, new engine
    out = {"w": torch.zeros(64, 64), "step": 0}
    dcp.load(out, storage_reader=reader, checkpoint_id=tmp_path / "b", no_dist=True)
    assert torch.equal(out["w"], state["w"]) and out["step"] == 3
    assert writer._engine is _native.get_engine(**private_settings)


def test_a_segment_table_gives_a_request_its_checks_and_refuses_gaps(engine, tmp_path):
    """A reader hands the rank index's segments once (SegmentTable); each request takes the
    segments of its range natively, and a range they do not tile is refused, not read unverified."""
    data = _bytes(3 * WINDOW, 4)
    path = tmp_path / "f"
    job = engine.write(str(path), [host(data, 0)], [data])
    job.seal()
    segments = job.wait()
    table = _engine.SegmentTable(
        offsets=[s.offset for s in segments], lengths=[s.nbytes for s in segments], crc32cs=[s.crc32c for s in segments]
    )
    assert len(table) == len(segments) == 3 and table.first_gap(0, data.numel()) is None
    out = torch.zeros_like(data)
    req = ReadRequest(file_index=0, offset=0, nbytes=data.numel(), address=out.data_ptr(), verify_with=table)
    assert req.checks == tuple(as_checks(segments))
    assert engine.read([str(path)], [req], [out]).wait() == [] and torch.equal(out, data)
    # A range that cuts a segment: its first untiled bytes are named, and the request refused.
    assert table.first_gap(WINDOW, WINDOW + 100) == (2 * WINDOW, 2 * WINDOW + 100)
    with pytest.raises(ValueError, match="not covered"):
        ReadRequest(file_index=0, offset=WINDOW, nbytes=WINDOW + 100, address=out.data_ptr(), verify_with=table)
    with pytest.raises(ValueError, match="not both"):
        ReadRequest(file_index=0, offset=0, nbytes=WINDOW, address=out.data_ptr(), verify_with=table,
                    checks=[SegmentCheck(offset_in_request=0, nbytes=WINDOW, crc32c=segments[0].crc32c)])
    # A flipped byte is caught through the table's checks like through explicit ones.
    with open(path, "r+b") as f:
        f.seek(WINDOW + 5)
        byte = f.read(1)
        f.seek(WINDOW + 5)
        f.write(bytes([byte[0] ^ 1]))
    req = ReadRequest(file_index=0, offset=0, nbytes=data.numel(), address=out.data_ptr(), verify_with=table)
    failures = engine.read([str(path)], [req], [out]).wait()
    assert [f.kind for f in failures] == ["checksum"]


@pytest.mark.parametrize(
    "offsets,lengths,crcs,words",
    [([0, 10], [20, 5], [1, 2], "out of order or overlaps"), ([0], [1, 2], [3], "differ in length")],
)
def test_a_malformed_segment_table_is_refused(offsets, lengths, crcs, words):
    with pytest.raises(ValueError, match=words):
        _engine.SegmentTable(offsets=offsets, lengths=lengths, crc32cs=crcs)


# -- streamed jobs (an object store's upload takes the windows) ------------------------------


def _drain_stream(job) -> bytes:
    out = bytearray()
    while (chunk := job.next_chunk()) is not None:
        offset, view = chunk
        assert offset >= len(out)
        out += bytes(offset - len(out))
        out += view
    return bytes(out)


def test_a_streamed_job_hands_out_the_bytes_a_file_would_hold(engine, tmp_path):
    a, b = _bytes(3 * WINDOW + 123, seed=1), _bytes(WINDOW // 2, seed=2)
    regions = [host(a, 0), host(b, 5 * WINDOW + 64)]  # a gap between them
    job = engine.write(str(tmp_path / "f"), regions, [a, b])
    job.seal()
    file_segments = [(s.offset, s.nbytes, s.crc32c) for s in job.wait()]
    streamed = engine.write("s3://bucket/f", regions, [a, b], stream=True)
    assert streamed.streams and not job.streams
    streamed.append([host(b, 7 * WINDOW)], [b])  # appended windows come after, in order
    streamed.seal()
    data = _drain_stream(streamed)
    segments = [(s.offset, s.nbytes, s.crc32c) for s in streamed.wait()]
    on_disk = (tmp_path / "f").read_bytes()
    assert data[: len(on_disk)] == on_disk
    assert data[7 * WINDOW : 7 * WINDOW + b.numel()] == bytes(b.numpy())
    assert segments[: len(file_segments)] == file_segments and len(segments) == len(file_segments) + 1
    assert engine.jobs_in_flight == 0


def test_a_streamed_job_is_bounded_by_the_pool_and_paced_by_its_taker(engine):
    """Four windows of pool, twelve windows of data: the stager waits for the taker."""
    a = _bytes(12 * WINDOW, seed=3)
    job = engine.write("s3://bucket/paced", [host(a, 0)], [a], stream=True)
    job.seal()
    staged = threading.Thread(target=job.wait_staged)
    staged.start()
    staged.join(0.5)
    assert staged.is_alive()  # the pool is full of windows nobody took: the rest waits
    got = _drain_stream(job)
    staged.join(5)
    assert not staged.is_alive()
    assert got == bytes(a.numpy()) and job.wait() and job.done


@pytest.mark.parametrize("when", ["after a window", "before any", "dropped"])
def test_a_cancelled_or_dropped_streamed_job_gives_its_pool_back(engine, when):
    a = _bytes(10 * WINDOW, seed=4)
    job = engine.write("s3://bucket/gone", [host(a, 0)], [a], stream=True)
    if when == "dropped":
        job.next_chunk()
        del job  # the binding cancels it and gives back every window nobody will take
    else:
        if when == "after a window":
            job.next_chunk()
        job.cancel("the upload failed")
        with pytest.raises(OSError, match="the upload failed"):
            while job.next_chunk() is not None:
                pass
        job.seal()
        with pytest.raises(OSError, match="the upload failed"):
            job.wait()
    assert engine.jobs_in_flight == 0
    # every slot is free again: a job as large as the pool streams through
    b = _bytes(8 * WINDOW, seed=5)
    again = engine.write("s3://bucket/again", [host(b, 0)], [b], stream=True)
    again.seal()
    assert _drain_stream(again) == bytes(b.numpy())


def test_a_failed_streamed_job_never_reads_as_finished(engine):
    """Once its owner waited for a failed streamed job, an upload asking for the next window
    gets the job's error, never the end (which would complete a truncated object)."""
    a = _bytes(6 * WINDOW, seed=6)
    job = engine.write("s3://bucket/cut", [host(a, 0)], [a], stream=True)
    job.next_chunk()
    job.cancel("another stripe failed")
    job.seal()
    with pytest.raises(OSError, match="another stripe failed"):
        job.wait()
    with pytest.raises(OSError, match="another stripe failed"):
        job.next_chunk()
    assert engine.jobs_in_flight == 0


def test_a_taker_asking_while_the_owner_ends_the_job_keeps_the_engine_it_runs_in():
    """An upload thread keeps asking for windows while the save's thread cancels, seals and
    waits for the job, and the wait drops the job's reference to its engine (here the last
    one) as soon as it has the GIL back: which it gets when a next_chunk call releases it.
    Every call after the cancel raises it, none crashes in an engine let go of meanwhile
    (before the fix, a segfault in some runs of this test)."""
    for _ in range(20):
        eng = _engine.Engine(io_threads=1, pool_bytes=4 * WINDOW, window_bytes=WINDOW, checksum_bytes=0)
        a = _bytes(2 * WINDOW, seed=7)
        job = eng.write("s3://bucket/owned", [host(a, 0)], [a], stream=True)
        del eng
        assert job.next_chunk()[0] == 0
        stop, outcomes = threading.Event(), []

        def take():  # until a call made after the owner's wait returned has raised
            while True:
                late = stop.is_set()
                try:
                    outcomes.append(job.next_chunk())
                except OSError as exc:
                    outcomes.append(exc)
                    if late:
                        return

        taker = threading.Thread(target=take)
        taker.start()
        job.cancel("the save failed")
        job.seal()
        with pytest.raises(OSError, match="the save failed"):
            job.wait()
        stop.set()
        taker.join(10)
        assert not taker.is_alive()
        failed_at = next(i for i, o in enumerate(outcomes) if isinstance(o, OSError))
        assert all(isinstance(o, OSError) and "the save failed" in str(o) for o in outcomes[failed_at:])
        assert all(o is not None for o in outcomes)  # never "the end" of a cancelled job


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 4096, 100_003])
def test_crc32c_combine_joins_checksums_of_consecutive_blocks(n):
    data = os.urandom(n + 37)
    for cut in sorted({0, 1, n // 2, n}):
        a, b = data[:cut], data[cut:]
        assert _engine.crc32c_combine(_engine.crc32c(a), _engine.crc32c(b), len(b)) == _engine.crc32c(data)
    assert _engine.crc32c_combine(_engine.crc32c(data), 0, 0) == _engine.crc32c(data)


def _segments_of(pieces, cut):
    """The segments Engine::checksum() makes of whole pieces ``(file offset, nbytes)``: one per piece,
    or cut at multiples of ``cut`` in the file."""
    out = []
    for start, n in pieces:
        if not cut:
            out.append((start, n))
            continue
        at = start
        while at < start + n:
            nxt = min(start + n, (at // cut + 1) * cut)
            out.append((at, nxt - at))
            at = nxt
    return out


@pytest.mark.parametrize("cut", [None, 4096, 64 << 10])
@pytest.mark.parametrize("borrow", [False, True])
def test_buffered_windows_written_a_block_at_a_time_keep_every_segment(tmp_path, cut, borrow):
    """Windows larger than the engine's fused block (checksummed and written a block at a time while
    cached, then read back and verified the same way): pieces across block and window edges,
    gaps of zeros, many small pieces in one block; the segments and the bytes are as a one-pass
    checksum and one write would have them, and a flipped byte in a later block of a piece is
    found in its own segment."""
    window = 1 << 20
    eng = get_engine(host_cache_bytes=4 * window, io_threads=2, window_bytes=window, checksum_bytes=cut)
    block = _engine.FUSED_BLOCK_BYTES
    assert window > 2 * block
    sizes = [block + 4096 + 37, 100, 3 * block - 11, 64] + [300 + i for i in range(40)] + [2 * window + 5]
    tensors, regions, pieces, at = [], [], [], 512
    for i, n in enumerate(sizes):
        t = _bytes(n, i)
        tensors.append(t)
        regions.append(host(t, at))
        pieces.append((at, n))
        at += n + (64 if i % 3 else 4096 + 8)
    path = tmp_path / "f"
    job = eng.write(str(path), regions, tensors, direct_io="off", borrow=borrow)
    job.seal()
    segments = job.wait()
    assert not borrow or job.windows_from_source > 0
    blob = path.read_bytes()
    for (start, n), t in zip(pieces, tensors):
        assert blob[start : start + n] == bytes(t.tolist())
    # Window edges cut pieces too (a piece is a region's part in one window).
    edges = []
    for start, n in pieces:
        at = start
        while at < start + n:
            nxt = min(start + n, (at // window + 1) * window)
            edges.append((at, nxt - at))
            at = nxt
    assert [(s.offset, s.nbytes) for s in segments] == _segments_of(edges, cut)
    for s in segments:
        assert _engine.crc32c(blob[s.offset : s.offset + s.nbytes]) == s.crc32c
    out = torch.empty(len(blob), dtype=torch.uint8)
    assert eng.read([str(path)], [request(out, 0, len(blob), as_checks(segments))], [out]).wait() == []
    assert bytes(out.tolist()) == blob
    flipped = pieces[2][0] + 2 * block + 5  # inside the third piece's third block
    raw = bytearray(blob)
    raw[flipped] ^= 0x40
    path.write_bytes(bytes(raw))
    failures = eng.read([str(path)], [request(out, 0, len(blob), as_checks(segments))], [out]).wait()
    hit = [s for s in segments if s.offset <= flipped < s.offset + s.nbytes]
    assert [(f.kind, f.offset) for f in failures] == [("checksum", hit[0].offset)]
