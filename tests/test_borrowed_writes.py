"""Writes without a staging copy (``Engine.write(..., borrow=True)``) and the CRC-32C kernel.

A borrowed job writes windows of contiguous host memory straight from the
caller's buffers when the file is buffered, or when every piece is
page-aligned for O_DIRECT; everything else (strided views, unaligned memory
under O_DIRECT) still goes through the pool. Either way the file's bytes and
checksums must be exactly those of a copied write.
"""

from __future__ import annotations

import errno
import mmap
import os
import struct

import pytest
import torch

from dcp_datastates import DataStatesReader, DataStatesWriter, _engine
from dcp_datastates.native import faults
from dcp_datastates.native.engine import HostRegion, StridedRegion, get_engine

from conftest import mounted_tmpfs

WINDOW = 64 << 10


@pytest.fixture(scope="module")
def engine():
    return get_engine(host_cache_bytes=4 * WINDOW, io_threads=2, window_bytes=WINDOW)


def _bytes(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


def host(t: torch.Tensor, offset: int, nbytes: int | None = None) -> HostRegion:
    return HostRegion(address=t.data_ptr(), nbytes=t.nbytes if nbytes is None else nbytes, file_offset=offset)


def _write(engine, path, regions, keep, **kw):
    job = engine.write(str(path), regions, keep, **kw)
    job.seal()
    segments = job.wait()
    return job, segments


def _off_page(n: int, seed: int) -> torch.Tensor:
    """``_bytes(n, seed)`` at an address that is not page-aligned. Where the allocator puts a
    tensor is its own business (a large one may well start on a page), so a case that needs
    the pool path under O_DIRECT must not rely on where it lands."""
    full = _bytes(n + 128, seed)
    shift = 64 if (full.data_ptr() + 64) % mmap.PAGESIZE else 128
    return full[shift : shift + n]


def _mixed_regions():
    """Small packed tensors, gaps, a multi-window tensor, and a transposed (strided) view, none
    of them page-aligned."""
    a, b, c = _off_page(1000, 1), _off_page(3 * WINDOW + 123, 2), _off_page(10, 3)
    m = torch.arange(64 * 48, dtype=torch.int32).reshape(64, 48).t()  # not contiguous
    regions = [
        host(a, 0),
        host(b, 8192),
        host(c, 8192 + b.numel() + 5),
        StridedRegion(address=m.data_ptr(), nbytes=m.nbytes, sizes=list(m.shape), strides=list(m.stride()), itemsize=4,
                      file_offset=16 * WINDOW),
    ]
    return regions, [a, b, c, m]


@pytest.mark.parametrize("direct_io", ["off", "auto"])
def test_borrowed_write_equals_copied_write(engine, tmp_path, direct_io):
    regions, keep = _mixed_regions()
    copied, seg_copied = _write(engine, tmp_path / "copied", regions, keep, direct_io=direct_io)
    borrowed, seg_borrowed = _write(engine, tmp_path / "borrowed", regions, keep, direct_io=direct_io, borrow=True)
    assert (tmp_path / "borrowed").read_bytes() == (tmp_path / "copied").read_bytes()
    assert seg_borrowed == seg_copied
    assert borrowed.borrows and not copied.borrows
    assert copied.windows_from_source == 0
    if not borrowed.direct:  # buffered: every window of contiguous memory skipped the pool
        assert borrowed.windows_from_source >= 4
    else:  # O_DIRECT and memory that is not page-aligned: the pool path, still exact
        assert borrowed.windows_from_source == 0
    blob = (tmp_path / "borrowed").read_bytes()
    for s in seg_borrowed:
        assert _engine.crc32c(blob[s.offset : s.offset + s.nbytes]) == s.crc32c


def test_page_aligned_memory_is_written_from_source_with_o_direct(engine, tmp_path):
    # mmap'd memory is page-aligned, as a pinned or pool allocation would be.
    buf = mmap.mmap(-1, 3 * WINDOW)
    payload = os.urandom(3 * WINDOW - 4096)
    buf[: len(payload)] = payload
    t = torch.frombuffer(buf, dtype=torch.uint8)
    path = tmp_path / "aligned"
    try:
        job = engine.write(str(path), [host(t, 0, len(payload))], [t], direct_io="on", borrow=True)
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            pytest.skip(f"{tmp_path} refuses O_DIRECT")
        raise
    job.seal()
    segments = job.wait()
    assert job.direct and job.windows_from_source == 3
    assert path.read_bytes()[: len(payload)] == payload
    assert sum(s.nbytes for s in segments) == len(payload)
    del t
    buf.close()


def test_short_writes_of_borrowed_windows_are_retried(engine, tmp_path):
    regions, keep = _mixed_regions()
    _write(engine, tmp_path / "ref", regions, keep, direct_io="off")
    faults.clear()
    try:
        faults.arm("write", action="short", times=-1)
        job, _ = _write(engine, tmp_path / "short", regions, keep, direct_io="off", borrow=True)
    finally:
        faults.clear()
    assert job.windows_from_source > 0
    assert (tmp_path / "short").read_bytes() == (tmp_path / "ref").read_bytes()


def test_a_failed_borrowed_write_names_file_and_offset(engine, tmp_path):
    regions, keep = _mixed_regions()
    errors = {}
    for borrow in (False, True):
        path = tmp_path / f"fails-{borrow}"
        faults.clear()
        try:
            faults.arm("write", path="fails", offset=8192 + WINDOW + 7, errno=errno.EIO)
            job = engine.write(str(path), regions, keep, direct_io="off", borrow=borrow)
            job.seal()
            with pytest.raises(OSError) as info:
                job.wait()
        finally:
            faults.clear()
        assert info.value.errno == errno.EIO and info.value.filename == str(path)
        errors[borrow] = info.value
    # The same failure either way: the write of the window holding the offset, named by it.
    assert errors[True].offset == errors[False].offset
    assert errors[True].offset <= 8192 + WINDOW + 7 < errors[True].offset + 4096


def test_release_staged_of_a_borrowed_job_waits_until_written(engine, tmp_path):
    data = _bytes(5 * WINDOW, 9)
    job = engine.write(str(tmp_path / "f"), [host(data, 0)], [data], direct_io="off", borrow=True)
    assert job.release_staged()
    assert job.windows_from_source == 5  # written, not merely copied
    job.seal()
    job.wait()


def test_tmpfs_is_written_buffered_in_auto_mode(engine, tmp_path):
    """tmpfs takes O_DIRECT on new kernels, but there it is one more copy into the same pages;
    auto mode writes buffered, so a synchronous save writes the tensors without a staging copy."""
    with mounted_tmpfs(tmp_path / "shm", "size=64m") as mnt:
        state = {f"w{i}": torch.randn(1024, 1024 + i) for i in range(6)}  # 4 MiB each: whole windows
        state["t"] = torch.randn(300, 200).t()  # strided: gathered through the pool
        writer = DataStatesWriter(str(mnt / "ckpt"))
        import torch.distributed.checkpoint as dcp

        dcp.save(state, storage_writer=writer, no_dist=True)
        stats = writer.last_save_stats
        assert stats.direct_io is False and stats.windows_from_source >= 1
        out = {k: torch.zeros_like(v) for k, v in state.items()}
        dcp.load(out, storage_reader=DataStatesReader(str(mnt / "ckpt")), no_dist=True)
        for k, v in state.items():
            assert torch.equal(out[k], v), k


# -- CRC-32C -------------------------------------------------------------------------------


def _crc32c_reference(data: bytes, crc: int = 0) -> int:
    """Bit-at-a-time CRC-32C (Castagnoli, reflected): slow and obviously right."""
    crc ^= 0xFFFFFFFF
    table = _TABLE
    for byte in data:
        crc = table[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def _make_table() -> list[int]:
    out = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ (0x82F63B78 if c & 1 else 0)
        out.append(c)
    return out


_TABLE = _make_table()


@pytest.mark.parametrize(
    "length",
    [0, 1, 7, 8, 9, 767, 768, 769, 3 * 256 * 2 + 5, 24575, 24576, 24577, 2 * 24576 + 3 * 256 + 13, 100_003],
)
@pytest.mark.parametrize("start", [0, 3])
def test_crc32c_matches_the_reference_across_lane_boundaries(length, start):
    data = os.urandom(length + start)[start:]
    assert _engine.crc32c(data) == _crc32c_reference(data)
    seed = struct.unpack("<I", os.urandom(4))[0]
    assert _engine.crc32c(data, seed) == _crc32c_reference(data, seed)


def test_crc32c_of_zeros_and_ones_over_many_lanes():
    for data in (b"\0" * (1 << 20), b"\xff" * (1 << 20) + b"\x01"):
        half = len(data) // 2 + 11
        assert _engine.crc32c(data) == _engine.crc32c(data[half:], _engine.crc32c(data[:half]))
    assert _engine.crc32c(b"\xff" * 100_000) == _crc32c_reference(b"\xff" * 100_000)
