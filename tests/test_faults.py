"""I/O faults injected at chosen points: ENOSPC, EIO, short writes, failed fsyncs and renames.

Every failing save must raise an error naming the file (and the key, for
data), commit nothing, leave the committed checkpoint it would replace
intact, let the next save succeed, and leak no thread, file descriptor or
memory. Short writes must be retried transparently. See docs/reliability.md.
"""

from __future__ import annotations

import errno
import gc
import os
import shutil
import threading

import pytest
import torch
import torch.distributed.checkpoint as dcp

import dcp_datastates
import dcp_datastates.storage.fsync_files
from dcp_datastates.core.async_save.runtime import runtime
from conftest import assert_same, data_files, load, mounted_tmpfs, raises_from_checkpoint, save, zeros_like_state
from dcp_datastates import DataStatesReader, DataStatesWriter, verify
from dcp_datastates.native.faults import clear, fired, inject_fault

MiB = 1 << 20
SMALL = dict(host_cache_bytes=4 * MiB, window_bytes=1 * MiB)


@pytest.fixture(autouse=True)
def _disarm_and_collect_background_errors():
    yield
    clear()
    runtime().errors.drain()


def make_state(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {
        "big": torch.randn(3 * MiB // 4, generator=g),  # 3 MiB: spans several 1 MiB windows
        "mid": torch.randn(300, 200, generator=g).t(),  # strided, gathered by the engine
        "small": torch.arange(10, dtype=torch.int16),
        "step": 5 + seed,
        "meta": {"name": "run", "lrs": [0.1, 0.01]},
    }


def async_save(state, writer):
    return dcp.async_save(state, storage_writer=writer, no_dist=True)


def assert_clean_failure(path):
    """Nothing committed, no partial file of the failed save left behind."""
    assert not (path / ".metadata").exists()
    leftovers = [n for n in os.listdir(path) if n.startswith("rank") or n.endswith(".tmp")] if path.exists() else []
    assert leftovers == [], leftovers


# -- where a write fails ------------------------------------------------------------------

# (file part, offset, whether the error names the key stored there)
WRITE_FAULTS = [
    (".data", 0, True),
    (".data", 2 * MiB + 4096, True),
    (".data", 3 * MiB + 8192, True),
    (".index", 16, False),
    (".metadata", 100, False),
]


def key_at(path, offset):
    """The key a committed checkpoint of make_state() stores at ``offset`` of its data file."""
    layout = DataStatesReader(path).read_metadata().storage_data
    for fqn, _, _, start, length, ordinal in layout.entries:
        if ordinal < 0 and start <= offset < start + max(length, 1):
            return fqn
    return None


@pytest.mark.parametrize("part,offset,key", WRITE_FAULTS)
@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EIO])
def test_sync_write_fault_names_file_and_commits_nothing(tmp_path, part, offset, key, code):
    path = tmp_path / "c"
    state = make_state()
    with inject_fault("write", path=part, offset=offset, errno=code) as rule:
        with raises_from_checkpoint(OSError, match=os.strerror(code)) as info:
            save(state, path, **SMALL)
        assert fired(rule) == 1
    assert info.value.errno == code and part in info.value.filename
    assert_clean_failure(path)
    # the next save into the same directory succeeds and round-trips
    save(state, path, **SMALL)
    assert_same(load(zeros_like_state(state), path), state)
    assert verify(path).ok


@pytest.mark.parametrize("part,offset,key", WRITE_FAULTS[:3])
def test_write_fault_error_names_the_file_and_key(tmp_path, part, offset, key):
    reference = tmp_path / "reference"
    save(make_state(), reference, **SMALL)
    path = tmp_path / "c"
    with inject_fault("write", path=part, offset=offset, errno=errno.ENOSPC):
        with raises_from_checkpoint(OSError, match="No space left") as info:
            save(make_state(), path, **SMALL)
    err = info.value
    assert err.errno == errno.ENOSPC
    assert err.filename and part in err.filename and str(path) in err.filename
    if key:
        stored = key_at(reference, offset)
        assert stored is not None and f"writing {stored!r} failed" in str(err), (stored, err)


@pytest.mark.parametrize("what", ["data fsync", "index fsync", "metadata fsync", "directory fsync", "rename"])
def test_failed_fsync_or_rename_commits_nothing(tmp_path, what):
    path = tmp_path / "c"
    state = make_state()
    op, part = {
        "data fsync": ("fsync", ".data"),
        "index fsync": ("fsync", ".index"),
        "metadata fsync": ("fsync", ".metadata."),
        "directory fsync": ("fsync", str(path)),
        "rename": ("rename", ".metadata"),
    }[what]
    if what == "directory fsync":
        part = str(path)  # matches every file too: the first fsync of anything under it fails
    with inject_fault(op, path=part, errno=errno.EIO):
        with raises_from_checkpoint(OSError, match="Input/output error") as info:
            save(state, path, **SMALL)
    assert info.value.filename and str(path) in info.value.filename
    assert_clean_failure(path)
    save(state, path, **SMALL)
    assert verify(path).ok


def test_failed_overwrite_keeps_the_committed_checkpoint_intact(tmp_path):
    path = tmp_path / "c"
    old = make_state(0)
    save(old, path, **SMALL)
    committed = sorted(os.listdir(path))
    for part, offset, _ in WRITE_FAULTS:
        with inject_fault("write", path=part, offset=offset, errno=errno.ENOSPC):
            with raises_from_checkpoint(OSError, match="No space left"):
                save(make_state(1), path, overwrite=True, **SMALL)
        assert sorted(os.listdir(path)) == committed  # only the old checkpoint's files
        assert verify(path).ok
        assert_same(load(zeros_like_state(old), path), old)
    with inject_fault("rename", path=".metadata", errno=errno.EIO):
        with raises_from_checkpoint(OSError):
            save(make_state(1), path, overwrite=True, **SMALL)
    assert sorted(os.listdir(path)) == committed
    new = make_state(1)
    save(new, path, overwrite=True, **SMALL)
    assert_same(load(zeros_like_state(new), path), new)


@pytest.mark.parametrize("part,offset", [(".data", 0), (".data", MiB + 4096), (".metadata", 0)])
def test_async_write_fault_reaches_the_future_and_the_next_save(tmp_path, part, offset):
    state = make_state()
    committed = tmp_path / "committed"
    save(state, committed, **SMALL)
    path = tmp_path / "c"
    with inject_fault("write", path=part, offset=offset, errno=errno.ENOSPC, times=-1):
        resp = async_save(state, DataStatesWriter(path, **SMALL))
        resp.staging_completion.result(timeout=60)  # the fence releases even when the write fails
        with raises_from_checkpoint(OSError, match="No space left") as info:
            resp.upload_completion.result(timeout=60)
    assert part in info.value.filename
    assert_clean_failure(path)
    # the failure is raised once more, at the next save call, then saves work again
    with pytest.raises(dcp_datastates.CheckpointError, match="No space left"):
        async_save(state, DataStatesWriter(tmp_path / "d", **SMALL))
    async_save(state, DataStatesWriter(tmp_path / "d", **SMALL)).upload_completion.result(timeout=60)
    assert_same(load(zeros_like_state(state), tmp_path / "d"), state)
    assert verify(committed).ok


# -- short writes and reads are retried -----------------------------------------------------


@pytest.mark.parametrize("direct_io", ["auto", "off"])
def test_short_writes_everywhere_still_produce_an_exact_checkpoint(tmp_path, direct_io):
    state = make_state()
    path = tmp_path / "c"
    rules = [
        dict(path=".data"),  # every data write is cut short (4 KiB aligned)
        dict(path=".index"),
        dict(path=".metadata"),
    ]
    from dcp_datastates.native.faults import arm

    ids = [arm("write", action="short", times=-1, **r) for r in rules]
    try:
        save(state, path, direct_io=direct_io, **SMALL)
        assert all(fired(i) > 0 for i in ids), [fired(i) for i in ids]
    finally:
        clear()
    assert_same(load(zeros_like_state(state), path), state)
    assert verify(path).ok


def test_short_reads_are_retried(tmp_path):
    state = make_state()
    save(state, tmp_path / "c", **SMALL)
    with inject_fault("read", path=".data", action="short", times=-1) as rule:
        out = load(zeros_like_state(state), tmp_path / "c")
        assert fired(rule) > 0
    assert_same(out, state)


def test_read_error_names_file_and_key(tmp_path):
    state = make_state()
    save(state, tmp_path / "c", **SMALL)
    with inject_fault("read", path=".data", offset=MiB, errno=errno.EIO, times=-1):
        with raises_from_checkpoint(OSError, match="Input/output error") as info:
            load(zeros_like_state(state), tmp_path / "c")
    assert ".data" in info.value.filename and "'big'" in str(info.value)


# -- no leaks across many failing saves ------------------------------------------------------


def _threads():
    return len(os.listdir("/proc/self/task"))


def _fds():
    return len(os.listdir("/proc/self/fd"))


def _rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _failing_saves(tmp_path, n, tag):
    state = make_state()
    for i in range(n):
        path = tmp_path / f"{tag}{i}"
        offset = (i * 397 * 4096) % (3 * MiB)  # a different point each time, inside the data
        with inject_fault("write", path=".data", offset=offset, errno=errno.ENOSPC, times=-1):
            if i % 2:
                resp = async_save(state, DataStatesWriter(path, **SMALL))
                with raises_from_checkpoint(OSError):
                    resp.upload_completion.result(timeout=60)
                runtime().errors.drain()  # raised above already
            else:
                with raises_from_checkpoint(OSError):
                    save(state, path, **SMALL)
        assert data_files(path) == []


def test_fifty_failing_saves_leak_no_thread_fd_or_memory(tmp_path):
    _failing_saves(tmp_path, 4, "warm")  # engines, pools and DCP's executor exist from here on
    gc.collect()
    threads, fds, rss = _threads(), _fds(), _rss()
    py_threads = threading.active_count()
    _failing_saves(tmp_path, 50, "f")
    gc.collect()
    dcp_datastates.wait_for_snapshots()
    assert _threads() <= threads + 1, (threads, _threads())  # +1: DCP's executor may be mid-shutdown
    assert threading.active_count() <= py_threads + 1
    assert _fds() <= fds, (fds, _fds())
    grown = _rss() - rss
    assert grown < 48 * MiB, f"RSS grew {grown / MiB:.1f} MiB over 50 failing saves"
    # and the engine still works
    state = make_state(3)
    save(state, tmp_path / "ok", **SMALL)
    assert_same(load(zeros_like_state(state), tmp_path / "ok"), state)


# -- a real full disk ------------------------------------------------------------------------


def test_real_disk_full_then_space_back(small_tmpfs):
    committed = small_tmpfs / "small"
    tiny = {"w": torch.arange(1000, dtype=torch.float32)}
    save(tiny, committed)
    filler = small_tmpfs / "filler"
    filler.write_bytes(b"\0" * (1 * MiB))
    with raises_from_checkpoint(OSError, match="No space left") as info:
        save({"w": torch.randn(256 * 1024)}, small_tmpfs / "big")  # 1 MiB no longer fits
    assert str(small_tmpfs / "big") in info.value.filename
    assert_clean_failure(small_tmpfs / "big")
    assert verify(committed).ok
    assert_same(load({"w": torch.zeros(1000)}, committed), tiny)
    filler.unlink()  # space is back
    state = {"w": torch.randn(256 * 1024)}
    save(state, small_tmpfs / "big")
    assert_same(load({"w": torch.zeros(256 * 1024)}, small_tmpfs / "big"), state)


def test_fault_rules_are_validated():
    from dcp_datastates.native.faults import arm

    with pytest.raises(ValueError, match="fault op"):
        arm("truncate")
    with pytest.raises(ValueError, match="fault action"):
        arm("write", action="explode")
    with pytest.raises(ValueError, match="stall_s"):
        arm("write", action="stall")  # a stall needs its duration
    with pytest.raises(ValueError, match="stall_s"):
        arm("write", action="error", stall_s=0.1)  # and only a stall has one
    reader = DataStatesReader  # the module imports cleanly without any rule armed
    assert reader is not None


@pytest.mark.parametrize("overwrite", [False, True])
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_error_after_the_rename_keeps_the_committed_checkpoint(tmp_path, monkeypatch, overwrite, mode):
    # Once .metadata is in place the checkpoint is committed: a failing directory fsync
    # after the rename is reported, but must not remove the files .metadata refers to.
    path = tmp_path / "c"
    if overwrite:
        save(make_state(0), path, **SMALL)

    committed_before = os.stat(path / ".metadata").st_ino if overwrite else None
    real_fsync_dir = dcp_datastates.storage.fsync_files.fsync_dir

    def failing_fsync_dir(directory):
        try:
            renamed = os.stat(os.path.join(directory, ".metadata")).st_ino != committed_before
        except FileNotFoundError:
            renamed = False
        if renamed:  # the directory fsyncs after the new .metadata was renamed into place
            raise OSError(errno.EIO, "injected: directory fsync failed", directory)
        real_fsync_dir(directory)

    monkeypatch.setattr(dcp_datastates.storage.fsync_files, "fsync_dir", failing_fsync_dir)
    new = make_state(1)
    with raises_from_checkpoint(dcp_datastates.CheckpointError, match="is committed") as info:
        if mode == "sync":
            save(new, path, overwrite=overwrite, **SMALL)
        else:
            async_save(new, DataStatesWriter(path, overwrite=overwrite, **SMALL)).upload_completion.result(timeout=60)
    assert "power loss" in str(info.value)
    monkeypatch.undo()
    assert verify(path).ok
    assert_same(load(zeros_like_state(new), path), new)


def test_failing_sync_saves_give_their_descriptors_back(tmp_path):
    # An object that cannot be serialized fails the save after the data file was opened
    # and its blocks reserved; the errors are kept alive, as a caller's log would.
    state = {"w": torch.randn(1 << 16), "bad": lambda: None}
    errors = []
    fds = _fds()
    for i in range(10):
        try:
            save(state, tmp_path / f"c{i}", **SMALL)
        except BaseException as exc:  # noqa: BLE001 - CheckpointException is a BaseException
            errors.append(exc)
        assert data_files(tmp_path / f"c{i}") == []
    assert len(errors) == 10
    assert _fds() <= fds, (fds, _fds())


# -- a real full filesystem: every error names its file ------------------------------------


@pytest.fixture
def tiny_tmpfs(tmp_path):
    """A 4 MiB tmpfs with 256 inodes, mounted for the test (root only); yields its path."""
    with mounted_tmpfs(tmp_path / "tiny", "size=4m,nr_inodes=256") as mnt:
        yield mnt


def _leave_free(mnt, blocks=None, inodes=None):
    """Fill ``mnt`` so that exactly ``blocks`` 4 KiB blocks or ``inodes`` inodes stay free."""
    fill = mnt / "fill"
    fill.mkdir(exist_ok=True)
    if blocks is not None:
        with open(fill / "blocks", "wb") as f:
            os.posix_fallocate(f.fileno(), 0, (os.statvfs(mnt).f_bavail - blocks) * 4096)
        assert os.statvfs(mnt).f_bavail == blocks
    if inodes is not None:
        n = 0
        while os.statvfs(mnt).f_favail > inodes:
            (fill / f"i{n}").touch()
            n += 1
        assert os.statvfs(mnt).f_favail == inodes


def _user_errors(exc):
    """The errors a caller sees: DCP's CheckpointException holds each rank's."""
    from torch.distributed.checkpoint.api import CheckpointException

    if isinstance(exc, CheckpointException):
        return [e for e, _tb in exc.failures.values()]
    return [exc]


def _os_errors(exc):
    """``exc`` and the errors it was raised from, as far as they are OSErrors."""
    out, seen = [], set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError):
            out.append(exc)
        exc = exc.__cause__ or (None if exc.__suppress_context__ else exc.__context__)
    return out


def _save_on_full_fs(state, path, mode):
    """Save and return the errors a caller would see ([] if it committed)."""
    writer = DataStatesWriter(path, **SMALL)
    errors = []
    try:
        if mode == "sync":
            dcp.save(state, storage_writer=writer, no_dist=True)
        else:
            async_save(state, writer).upload_completion.result()
    except BaseException as exc:  # noqa: BLE001 - CheckpointException is a BaseException
        errors += _user_errors(exc)
    try:
        writer.close()  # raises an asynchronous save's error once more, if it was kept
    except BaseException as exc:  # noqa: BLE001
        errors += _user_errors(exc)
    return errors


def _full_fs_state(nbytes):
    g = torch.Generator().manual_seed(nbytes)
    state = {"w": torch.randn(nbytes // 4, generator=g), "b": torch.arange(7), "step": nbytes, "cfg": {"k": "v" * 100}}
    if nbytes > 64 << 10:
        state["m"] = torch.randn(64, 100, generator=g).t()  # strided: gathered by the engine
    return state


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_every_error_on_a_full_filesystem_names_its_file(tiny_tmpfs, mode):
    """ENOSPC at every step (directory, data, index, metadata temporary) names the file and
    leaves nothing behind; states of 20 sizes, each with the free space just short of what it
    needs, and with no inode left for each file in turn."""
    sizes = [0] + [int(1000 * 1.45**i) for i in range(19)]  # 0 B .. ~1.2 MiB of tensor bytes
    failed_files = set()
    attempts = 0
    for i, nbytes in enumerate(sizes):
        state = _full_fs_state(nbytes)
        probe = tiny_tmpfs / "probe"
        before = os.statvfs(tiny_tmpfs).f_bavail
        save(state, probe, **SMALL)
        need = before - os.statvfs(tiny_tmpfs).f_bavail  # blocks a committed save of it takes
        shutil.rmtree(probe)
        cases = [dict(blocks=b) for b in sorted({0, 1, need // 2, need - 3, need - 2, need - 1}) if 0 <= b < need]
        if i % 7 == 0:
            cases += [dict(inodes=n) for n in range(4)]  # the directory, data, index, metadata temporary
        for j, free in enumerate(cases):
            path = tiny_tmpfs / f"ck{i}_{j}"
            _leave_free(tiny_tmpfs, **free)
            errors = _save_on_full_fs(state, path, mode)
            attempts += 1
            assert errors, (nbytes, free, "the save committed on a full filesystem")
            for err in errors:
                oserrs = _os_errors(err)
                assert oserrs, (nbytes, free, f"{type(err).__name__}: {err}")
                for e in oserrs:
                    assert e.errno == errno.ENOSPC, (nbytes, free, repr(e))
                    assert e.filename and str(tiny_tmpfs) in str(e.filename), (nbytes, free, mode, repr(e))
                    failed_files.add(_step_of(str(e.filename)))
                assert str(oserrs[0].filename) in str(err), (nbytes, free, str(err))  # in the text the user reads
            leftovers = sorted(os.listdir(path)) if path.exists() else []
            assert leftovers == [], (nbytes, free, leftovers)
            shutil.rmtree(tiny_tmpfs / "fill")
            if path.exists():
                path.rmdir()
    assert attempts >= 100
    assert failed_files >= {"directory", "data", "index", "metadata"}, failed_files


def _step_of(filename):
    name = os.path.basename(filename)
    if name.endswith(".data") or name.endswith(".staging"):
        return "data"
    if name.endswith(".index"):
        return "index"
    if name.startswith(".metadata"):
        return "metadata"
    return "directory" if name.startswith("ck") else name


def test_a_stalled_write_waits_then_writes_every_byte(tmp_path):
    """A "stall" rule is a slow disk: each matching write waits, then goes through whole."""
    import time

    from dcp_datastates.native.faults import arm

    state = make_state()
    index = arm("write", path="stalled", action="stall", stall_s=0.2, times=2)
    t0 = time.monotonic()
    save(state, tmp_path / "stalled")
    assert time.monotonic() - t0 >= 0.2 and fired(index) >= 1
    clear()
    assert_same(load(zeros_like_state(state), tmp_path / "stalled"), state)
    assert verify(tmp_path / "stalled").ok


def test_python_side_io_passes_the_same_rules():
    """fault_point() is how Python-side I/O (index, metadata, renames) meets the engine's rules:
    everything passes while nothing is armed; an armed rule cuts a transfer or raises, named."""
    from dcp_datastates.native.faults import arm, fault_point

    assert fault_point("write", "/ck/rank00000.index", 0, 5000) == 5000
    arm("write", path=".index", offset=4096 + 100, action="short")
    assert fault_point("write", "/ck/rank00000.index", 0, 8192) == 4096  # cut at a block boundary
    index = arm("rename", path=".metadata", errno=errno.EXDEV)
    with pytest.raises(OSError) as info:
        fault_point("rename", "/ck/.metadata.tmp")
    assert info.value.errno == errno.EXDEV and info.value.filename == "/ck/.metadata.tmp" and fired(index) == 1
    with pytest.raises(ValueError, match="fault op must be one of"):
        fault_point("unlink", "/ck/x")
    clear()
    assert fault_point("rename", "/ck/.metadata.tmp") == 0
