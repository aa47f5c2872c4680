"""The native engine on its own: regions to offsets, checksums, errors with context."""

from __future__ import annotations

import errno
import os

import pytest
import torch

from dcp_datastates import _engine
from dcp_datastates.native.engine import get_engine

WINDOW = 64 << 10


@pytest.fixture(scope="module")
def engine():
    return get_engine(host_cache_bytes=4 * WINDOW, io_threads=2, window_bytes=WINDOW)


def _bytes(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


def test_crc32c_known_values():
    assert _engine.crc32c(b"123456789") == 0xE3069283
    assert _engine.crc32c(b"") == 0
    assert _engine.crc32c(b"\x00" * 32) == 0x8A9136AA
    data = os.urandom(10_000)
    assert _engine.crc32c(data[5000:], _engine.crc32c(data[:5000])) == _engine.crc32c(data)
    assert _engine.crc32c_backend() in ("sse4.2", "armv8-crc", "table")


@pytest.mark.parametrize("direct_io", ["auto", "off"])
def test_regions_land_at_their_offsets_with_zero_gaps(engine, tmp_path, direct_io):
    a, b, c = _bytes(1000, 1), _bytes(3 * WINDOW + 123, 2), _bytes(10, 3)
    regions = [(b.data_ptr(), b.numel(), 8192), (a.data_ptr(), a.numel(), 0), (c.data_ptr(), c.numel(), 8192 + b.numel() + 5)]
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
    assert sum(n for _, n, _ in segments) == 1000 + b.numel() + 10
    for off, n, crc in segments:
        assert _engine.crc32c(blob[off : off + n]) == crc


def test_append_after_seal_is_refused_and_overlap_is_refused(engine, tmp_path):
    a = _bytes(5000)
    job = engine.write(str(tmp_path / "f"), [(a.data_ptr(), 5000, 0)], [a])
    with pytest.raises(ValueError, match="overlaps"):
        job.append([(a.data_ptr(), 10, 4096)], [a])
    job.append([(a.data_ptr(), 100, 8192)], [a])
    job.seal()
    job.wait()
    with pytest.raises(Exception, match="sealed"):
        job.append([(a.data_ptr(), 10, 1 << 20)], [a])


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
    job = engine.write(str(path), [(big.data_ptr(), big.numel(), 0)], [big], direct_io="off")
    job.seal()
    with pytest.raises(OSError) as ei:
        job.wait()
    assert ei.value.errno == errno.ENOSPC and ei.value.filename == str(path)
    assert ei.value.offset >= 0 and "offset" in str(ei.value)


def test_enospc_detected_up_front_with_preallocation(engine, small_tmpfs):
    big = _bytes(4 << 20)
    with pytest.raises(OSError) as ei:
        engine.write(str(small_tmpfs / "g"), [(big.data_ptr(), big.numel(), 0)], [big], preallocate=big.numel())
    assert ei.value.errno == errno.ENOSPC and "reserving space" in str(ei.value)


def test_dropped_job_waits_before_releasing_memory(engine, tmp_path):
    for i in range(20):
        t = _bytes(256 << 10, i)
        job = engine.write(str(tmp_path / f"f{i}"), [(t.data_ptr(), t.numel(), 0)], [t])
        del t, job  # dropped mid-flight: must cancel and wait, never read freed memory
    assert engine.free_windows == 4


def test_reads_verify_checksums_and_report_truncation(engine, tmp_path):
    data = _bytes(200_000, 9)
    path = tmp_path / "f"
    job = engine.write(str(path), [(data.data_ptr(), data.numel(), 0)], [data])
    job.seal()
    segs = job.wait()
    out = torch.empty_like(data)
    checks = [(o, n, c) for o, n, c in segs]
    assert engine.read([str(path)], [(0, 0, data.numel(), out.data_ptr(), checks)], [out]).wait() == []
    assert torch.equal(out, data)
    raw = bytearray(path.read_bytes())
    raw[70_000] ^= 0xFF
    path.write_bytes(bytes(raw))
    failures = engine.read([str(path)], [(0, 0, data.numel(), out.data_ptr(), checks)], [out]).wait()
    assert [f[1] for f in failures] == ["checksum"] and failures[0][3] == str(path)
    big = torch.empty(10 << 20, dtype=torch.uint8)  # kept alive: the engine writes into it
    failures = engine.read([str(path)], [(0, 0, 10 << 20, big.data_ptr(), [])], [big]).wait()
    assert failures and failures[0][1] == "truncated"
    failures = engine.read([str(tmp_path / "missing")], [(0, 0, 10, out.data_ptr(), [])], [out]).wait()
    assert failures[0][1] == "io" and failures[0][2] == errno.ENOENT


def test_many_small_regions_coalesce(engine, tmp_path):
    ts = [_bytes(100, i) for i in range(3000)]
    regions = [(t.data_ptr(), 100, i * 128) for i, t in enumerate(ts)]
    job = engine.write(str(tmp_path / "f"), regions, ts)
    job.seal()
    segs = job.wait()
    assert len(segs) >= 3000
    blob = (tmp_path / "f").read_bytes()
    assert all(blob[i * 128 : i * 128 + 100] == bytes(t.tolist()) for i, t in enumerate(ts[:50]))
    assert engine.free_windows == 4


def test_probes(tmp_path):
    p = str(tmp_path / "probe")
    assert _engine.probe_sequential_write(p, 1 << 20, 1 << 18, False) > 0
    _engine.drop_page_cache(p)
    n, s = _engine.probe_sequential_read(p, 1 << 18)
    assert n == 1 << 20 and s > 0


@pytest.mark.parametrize("durable", [True, False])
def test_durable_false_skips_the_fsync_of_scratch_files(engine, tmp_path, durable):
    """Async compressed saves stage raw bytes into a scratch file that is read back and
    removed: it is written without the fsync a checkpoint file gets (an fsync fault shows it)."""
    from dcp_datastates.native.faults import inject_fault

    data = _bytes(3 * engine.window_bytes + 17)
    path = str(tmp_path / "scratch")
    with inject_fault("fsync", path=path, errno=errno.EIO):
        job = engine.write(path, [(data.data_ptr(), data.nbytes, 0)], [data], direct_io="off", durable=durable)
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


def test_preallocation_on_tmpfs_is_left_to_the_io_threads(engine, tmp_path):
    """fallocate on tmpfs zeroes every page: done in the caller's thread it made stage()
    take time proportional to the state (61 ms for 200 MB). On tmpfs the job checks the
    free space at once and reserves on the thread that writes its first window; on an
    extent-based filesystem it still reserves at once."""
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
        job.append([(data.data_ptr(), data.nbytes, 0)], [data])
        job.seal()
        job.wait()
        with open(path, "rb") as f:
            assert f.read(data.nbytes) == data.numpy().tobytes()
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
