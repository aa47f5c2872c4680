"""Fork safety: a process forked after its parent used the library saves and loads.

A forked child (DataLoader workers, ``multiprocessing`` with fork) inherits the
parent's engines, snapshots, sequencer and locks, but none of their threads.
Each case runs in a fresh interpreter (``python tests/test_fork.py CASE DIR``)
that uses the library, forks, and checks the child; the interpreter and every
child run under a deadline and are killed when it passes, so a regression
fails here instead of hanging the suite.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import traceback

import pytest

pytestmark = [pytest.mark.subprocess, pytest.mark.slow]

# Per child; the whole case gets a multiple of it. Shorten it (DCPDS_FORK_DEADLINE_S=10)
# to see how a hang fails.
CHILD_DEADLINE_S = float(os.environ.get("DCPDS_FORK_DEADLINE_S", "60"))
CASE_DEADLINE_S = 3 * CHILD_DEADLINE_S + 60

MiB = 1 << 20
SETTINGS = dict(host_cache_bytes=4 * MiB, io_threads=2, window_bytes=1 * MiB)  # tensors stream through 4 windows


def _run_case(case: str, tmp_path) -> str:
    proc = subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), case, str(tmp_path)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=CASE_DEADLINE_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the case and every child it forked
        out, _ = proc.communicate()
        pytest.fail(f"case {case!r} hung (killed after {CASE_DEADLINE_S:g} s):\n{out}")
    assert proc.returncode == 0, f"case {case!r} failed (exit status {proc.returncode}):\n{out}"
    assert f"CASE {case} OK" in out, out
    return out


def test_os_fork_after_sync_and_async_saves(tmp_path):
    _run_case("os_fork", tmp_path)


def test_multiprocessing_fork_context(tmp_path):
    _run_case("mp_fork", tmp_path)


def test_dataloader_fork_workers_save_and_load(tmp_path):
    _run_case("dataloader", tmp_path)


def test_fork_while_an_async_save_is_in_flight(tmp_path):
    _run_case("in_flight", tmp_path)


def test_parent_engine_in_child_raises_and_is_never_destroyed(tmp_path):
    _run_case("engine", tmp_path)


def test_compressed_saves_after_fork(tmp_path):
    pytest.importorskip("zstandard")
    _run_case("compressed", tmp_path)


def test_runtime_in_a_fork_child_keeps_only_the_global_fence():
    """The async-save runtime's fork reset (run here on a runtime of its own, without forking):
    the parent's order, errors, snapshots, monitor and locks are gone, every writer forgets its
    saves, and the global fence's hook stays with its holders."""
    from dcp_datastates.core.async_save.runtime import AsyncSaveRuntime

    class Writer:
        forgot = False

        def _forget_parent_saves(self):
            self.forgot = True

    class Snap:
        begun, abandoned = False, None

    rt = AsyncSaveRuntime()
    writer, hook = Writer(), object()
    rt.writers.add(writer)
    rt.order.reserve()  # a parent's save that never ends in the child
    rt.errors.record(1, "/parent", RuntimeError("the parent's"))
    rt.track(Snap())
    rt.fence_hook, rt.fence_holders = hook, 2
    before = (rt.order, rt.errors, rt.monitor, rt.fence_lock)
    rt.after_fork_in_child()
    assert all(new is not old for new, old in zip((rt.order, rt.errors, rt.monitor, rt.fence_lock), before))
    assert rt.order.wait_ended(lambda t: True, timeout=0) and rt.errors.drain() == [] and rt.unbegun() == []
    assert writer.forgot and rt.fence_hook is hook and rt.fence_holders == 2


# ---------------------------------------------------------------- the cases (a fresh interpreter)


def _state(seed: int):
    import torch

    g = torch.Generator().manual_seed(seed)
    return {
        "big": torch.randn(3 * MiB // 4 + 123, generator=g),  # larger than a window, not aligned
        "bf16": torch.randn(257, 9, generator=g).to(torch.bfloat16),
        "ints": torch.randint(-(1 << 40), 1 << 40, (1000,), generator=g, dtype=torch.int64),
        "transposed": torch.randn(64, 48, generator=g).t(),
        "step": seed,
    }


def _zeros_like(state):
    import torch

    return {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else -1 for k, v in state.items()}


def _assert_same(got, want, where: str) -> None:
    import torch

    assert set(got) == set(want), where
    for k, w in want.items():
        g = got[k]
        if isinstance(w, torch.Tensor):
            assert g.dtype == w.dtype and g.shape == w.shape, f"{where}: {k}"
            a = g.contiguous().view(-1).view(torch.uint8)
            b = w.contiguous().view(-1).view(torch.uint8)
            assert torch.equal(a, b), f"{where}: {k} differs"
        else:
            assert g == w, f"{where}: {k}: {g!r} != {w!r}"


def _save_sync(state, path, writer=None) -> None:
    import torch.distributed.checkpoint as dcp

    from dcp_datastates import DataStatesWriter

    writer = writer or DataStatesWriter(path, **SETTINGS)
    dcp.save(state, storage_writer=writer, checkpoint_id=path, no_dist=True)


def _save_async(state, path, writer=None) -> None:
    import torch.distributed.checkpoint as dcp

    from dcp_datastates import DataStatesWriter

    own = writer is None
    writer = writer or DataStatesWriter(path, **SETTINGS)
    writer.reset(path)  # async saves need the path before stage()
    resp = dcp.async_save(state, storage_writer=writer, no_dist=True)
    resp.upload_completion.result(timeout=CHILD_DEADLINE_S)
    if own:  # a writer passed in is used again
        writer.close(timeout=CHILD_DEADLINE_S)


def _check_load(state, path, reader=None) -> None:
    import torch.distributed.checkpoint as dcp

    from dcp_datastates import DataStatesReader

    reader = reader or DataStatesReader(path)
    out = _zeros_like(state)
    dcp.load(out, storage_reader=reader, checkpoint_id=path, no_dist=True)
    _assert_same(out, state, path)


def _use_in_parent(root: str):
    """Sync and async saves and loads in the parent; returns a used writer and reader."""
    from dcp_datastates import DataStatesReader, DataStatesWriter

    state = _state(1)
    writer = DataStatesWriter(None, **SETTINGS)
    reader = DataStatesReader(None)
    _save_sync(state, f"{root}/parent_sync", writer)
    _check_load(state, f"{root}/parent_sync", reader)
    _save_async(state, f"{root}/parent_async", writer)
    _check_load(state, f"{root}/parent_async", reader)
    return writer, reader


def _work_in_child(root: str, tag: str, parent_writer, parent_reader) -> None:
    """Save and load with new objects and with the parent's: sync and async."""
    from dcp_datastates.core.async_save import fence

    assert fence.snapshots_in_flight() == 0  # the parent's snapshots are not the child's
    fence.wait_for_snapshots()
    state = _state(100 + len(tag))
    _save_sync(state, f"{root}/{tag}_new_sync")
    _check_load(state, f"{root}/{tag}_new_sync")
    _save_async(state, f"{root}/{tag}_new_async")
    _check_load(state, f"{root}/{tag}_new_async")
    _save_sync(state, f"{root}/{tag}_old_sync", parent_writer)
    _check_load(state, f"{root}/{tag}_old_sync", parent_reader)
    _save_async(state, f"{root}/{tag}_old_async", parent_writer)
    _check_load(state, f"{root}/{tag}_old_async", parent_reader)
    assert parent_writer._engine.owner_pid == os.getpid()
    assert parent_reader.store.engine.owner_pid == os.getpid()


def _check_child_output(root: str, tag: str) -> None:
    """The parent loads what the child committed, bit-exactly."""
    state = _state(100 + len(tag))
    for kind in ("new_sync", "new_async", "old_sync", "old_async"):
        _check_load(state, f"{root}/{tag}_{kind}")


def _torch_after_fork() -> None:
    """What DataLoader workers do first: torch's own CPU thread pool (GNU OpenMP) does
    not survive a fork, and the child's first parallel op would hang in torch."""
    import torch

    torch.set_num_threads(1)


def _fork(child, exit_normally: bool = False) -> int:
    """Run ``child()`` in a forked process; returns its pid. The child's exit status
    says whether it passed; with ``exit_normally`` it leaves through interpreter
    shutdown (destructors, atexit) instead of ``os._exit``."""
    pid = os.fork()
    if pid:
        return pid
    import faulthandler

    faulthandler.dump_traceback_later(max(1.0, CHILD_DEADLINE_S - 3), exit=True)  # where a hang is
    _torch_after_fork()
    code = 1
    try:
        child()
        code = 0
    except BaseException:  # noqa: BLE001 - reported through the exit status
        traceback.print_exc()
    sys.stdout.flush()
    sys.stderr.flush()
    if exit_normally:
        raise SystemExit(code)  # unwinds the parent's frames too: nothing after fork runs here
    os._exit(code)


def _reap(pid: int, what: str) -> None:
    deadline = time.monotonic() + CHILD_DEADLINE_S
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            code = os.waitstatus_to_exitcode(status)
            assert code == 0, f"{what} failed (exit status {code})"
            return
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    raise AssertionError(f"{what} hung: killed after {CHILD_DEADLINE_S:g} s")


def case_os_fork(root: str) -> None:
    writer, reader = _use_in_parent(root)
    pid = _fork(lambda: _work_in_child(root, "child", writer, reader), exit_normally=True)
    _reap(pid, "the forked child")
    _check_child_output(root, "child")
    state = _state(2)  # the parent's engines still work
    _save_async(state, f"{root}/parent_after", writer)
    _check_load(state, f"{root}/parent_after", reader)


def _mp_target(root, writer, reader) -> None:
    _torch_after_fork()
    _work_in_child(root, "mp", writer, reader)


def case_mp_fork(root: str) -> None:
    import multiprocessing

    writer, reader = _use_in_parent(root)
    proc = multiprocessing.get_context("fork").Process(target=_mp_target, args=(root, writer, reader))
    proc.start()
    proc.join(CHILD_DEADLINE_S)
    if proc.is_alive():
        proc.kill()
        proc.join()
        raise AssertionError(f"the multiprocessing child hung: killed after {CHILD_DEADLINE_S:g} s")
    assert proc.exitcode == 0, f"the multiprocessing child failed (exit code {proc.exitcode})"
    _check_child_output(root, "mp")


class _SavingDataset:
    """Each item is saved and loaded in a worker: with a new writer and reader, and
    with the writer and reader the parent created (and used) before the fork."""

    def __init__(self, root: str, writer, reader) -> None:
        self.root, self.writer, self.reader = root, writer, reader

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int):
        import torch

        state = _state(10 + i)
        _save_sync(state, f"{self.root}/item{i}_new")
        _check_load(state, f"{self.root}/item{i}_new")
        _save_async(state, f"{self.root}/item{i}_old", self.writer)
        _check_load(state, f"{self.root}/item{i}_old", self.reader)
        return torch.tensor([i, os.getpid()])


def case_dataloader(root: str) -> None:
    import torch.utils.data

    writer, reader = _use_in_parent(root)
    ds = _SavingDataset(root, writer, reader)
    loader = torch.utils.data.DataLoader(
        ds, batch_size=None, num_workers=2, multiprocessing_context="fork", timeout=CHILD_DEADLINE_S
    )
    got = [t.tolist() for t in loader]
    assert sorted(i for i, _ in got) == [0, 1, 2, 3], got
    assert len({pid for _, pid in got}) == 2 and os.getpid() not in {pid for _, pid in got}, got
    for i in range(4):
        for kind in ("new", "old"):
            _check_load(_state(10 + i), f"{root}/item{i}_{kind}")


def case_in_flight(root: str) -> None:
    """The parent forks while its async save is staged but not yet begun; the child
    saves and loads (also with that very writer), and the parent's save still commits."""
    import torch.distributed.checkpoint as dcp

    from dcp_datastates import DataStatesWriter
    from dcp_datastates.core.async_save.runtime import runtime

    writer, reader = _use_in_parent(root)
    state = _state(3)
    held = runtime().order.reserve()  # an earlier save that has not begun: later saves wait for it
    busy = DataStatesWriter(f"{root}/parent_in_flight", **SETTINGS)
    resp = dcp.async_save(state, storage_writer=busy, no_dist=True)
    time.sleep(0.5)
    assert not resp.upload_completion.done() and resp.staging_completion.done()  # staged, waiting for its turn

    def child():
        _work_in_child(root, "inflight", writer, reader)
        more = _state(4)
        _save_async(more, f"{root}/inflight_busy", busy)  # the writer whose save is the parent's
        _check_load(more, f"{root}/inflight_busy")

    try:
        pid = _fork(child)
        _reap(pid, "the child forked during an async save")
        assert not resp.upload_completion.done()
    finally:
        runtime().order.end(held)  # else a failure here would leave DCP's thread waiting
    resp.upload_completion.result(timeout=CHILD_DEADLINE_S)
    busy.close(timeout=CHILD_DEADLINE_S)
    _check_load(state, f"{root}/parent_in_flight")
    _check_child_output(root, "inflight")
    _check_load(_state(4), f"{root}/inflight_busy")


def case_engine(root: str) -> None:
    """The native guard: the parent's engine and an unfinished job of it, used in a
    child, raise ForkedEngineError naming the parent, and dropping them never hangs."""
    import gc

    import torch

    from dcp_datastates.native import engine as _native

    engine = _native.get_engine(**SETTINGS)
    data = torch.arange(3 * MiB // 8, dtype=torch.int64)
    region = _native.HostRegion(address=data.data_ptr(), nbytes=data.nbytes, file_offset=0)
    job = engine.write(f"{root}/open_job", [region], [data], direct_io="off")
    assert job.wait_staged()  # its windows are written, but it is not sealed: unfinished
    held = {"engine": engine, "job": job}  # the only references the child drops are these
    del engine, job
    parent = os.getpid()

    def child():
        job, engine = held["job"], held["engine"]
        for call in (job.wait, lambda: job.done, lambda: engine.write(f"{root}/x", [], [])):
            try:
                call()
            except _native.ForkedEngineError as exc:
                assert f"created in process {parent} before a fork" in str(exc), exc
            else:
                raise AssertionError("an engine call in a fork child did not raise")
        assert not os.path.exists(f"{root}/x")
        mine = _native.get_engine(**SETTINGS)
        assert mine is not engine and mine.owner_pid == os.getpid() and engine.owner_pid == parent
        del job, engine, call
        _native._inherited.clear()  # drop every reference: the native side must leak, not join
        held.clear()
        gc.collect()
        out = torch.empty_like(data)
        written = mine.write(f"{root}/child_job", [region], [data], direct_io="off")
        written.seal()
        written.wait()
        request = _native.ReadRequest(file_index=0, offset=0, nbytes=data.nbytes, address=out.data_ptr())
        assert mine.read([f"{root}/child_job"], [request], [out]).wait() == []
        assert torch.equal(out, data)

    pid = _fork(child, exit_normally=True)
    _reap(pid, "the child using the parent's engine")
    held["job"].seal()
    held["job"].wait()  # the parent's job finishes in the parent
    with open(f"{root}/open_job", "rb") as f:
        assert f.read() == data.numpy().tobytes()


def case_compressed(root: str) -> None:
    """The compression thread pool does not survive a fork either: the child makes its own."""
    from dcp_datastates import DataStatesReader, DataStatesWriter

    def compressed(path):
        return DataStatesWriter(path, compression="zstd", **SETTINGS)

    state = _state(5)
    _save_sync(state, f"{root}/parent_zstd", compressed(f"{root}/parent_zstd"))  # the parent's pool threads exist
    _check_load(state, f"{root}/parent_zstd", DataStatesReader(None))

    def child():
        for kind, save in (("sync", _save_sync), ("async", _save_async)):
            path = f"{root}/child_zstd_{kind}"
            save(state, path, compressed(path))
            _check_load(state, path)

    pid = _fork(child, exit_normally=True)
    _reap(pid, "the compressing child")
    for kind in ("sync", "async"):
        _check_load(state, f"{root}/child_zstd_{kind}")


if __name__ == "__main__":
    import warnings

    warnings.filterwarnings("ignore")
    case, directory = sys.argv[1], sys.argv[2]
    globals()[f"case_{case}"](directory)
    print(f"CASE {case} OK", flush=True)
