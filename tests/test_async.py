"""dcp.async_save through DataStatesWriter: lazy snapshots, the fence, ordering, errors."""

from __future__ import annotations

import os
import threading

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType, AsyncSaveResponse

import dcp_datastates
from dcp_datastates import CheckpointError, CheckpointExistsError, DataStatesWriter, SnapshotMutatedError, _dcp_compat

from conftest import assert_same, data_files, load, raises_from_checkpoint

MiB = 1 << 20
SMALL_CACHE = dict(host_cache_bytes=4 * MiB, window_bytes=1 * MiB)  # 4 windows: back-pressure


def make_state(total_mib=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    n = total_mib * MiB // 4 // 8
    return {
        "model": {f"w{i}": torch.randn(n, generator=g) for i in range(8)},
        "bf16": torch.randn(513, 7, generator=g).to(torch.bfloat16),
        "transposed": torch.randn(300, 200, generator=g).t(),  # strided: gathered by the engine
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 3),
        "step": 7,
        "meta": {"note": "x", "lrs": [0.1, 0.2]},
    }


def zeros_like_state(state):
    if isinstance(state, torch.Tensor):
        return torch.zeros_like(state)
    if isinstance(state, dict):
        return {k: zeros_like_state(v) for k, v in state.items()}
    if isinstance(state, list):
        return [type(v)() for v in state]
    return type(state)() if not isinstance(state, str) else ""


def clone_state(state):
    if isinstance(state, torch.Tensor):
        return state.clone()
    if isinstance(state, dict):
        return {k: clone_state(v) for k, v in state.items()}
    if isinstance(state, list):
        return list(state)
    return state


def mutate_in_place(state):
    for v in state.values():
        if isinstance(v, torch.Tensor) and v.numel():
            if v.dtype.is_floating_point:
                v.mul_(-2).add_(1)
            else:
                v.add_(1)
        elif isinstance(v, dict):
            mutate_in_place(v)
        elif isinstance(v, list):
            v.append(99.0)


def async_save(state, writer, **kw):
    return dcp.async_save(state, storage_writer=writer, no_dist=True, **kw)


def test_async_save_returns_response_and_round_trips(tmp_path):
    state = make_state()
    with DataStatesWriter(tmp_path / "c") as writer:
        resp = async_save(state, writer)
        assert isinstance(resp, AsyncSaveResponse)
        resp.staging_completion.result()
        resp.upload_completion.result()
    stats = writer.last_save_stats
    assert stats.asynchronous and stats.bytes_written > 0
    out = load(zeros_like_state(state), tmp_path / "c")
    assert_same(out, state)


def test_checkpoint_holds_state_at_call_time_after_mutation_past_the_fence(tmp_path):
    # The state is 6x the cache: most bytes reach the disk before staging completes.
    state = make_state(24)
    expected = clone_state(state)
    writer = DataStatesWriter(tmp_path / "c", **SMALL_CACHE)
    resp = async_save(state, writer)
    resp.staging_completion.result()  # the fence
    mutate_in_place(state)  # every tensor and every object, right after the fence
    state["step"] = 8
    resp.upload_completion.result()
    writer.close()
    out = load(zeros_like_state(expected), tmp_path / "c")
    assert_same(out, expected)


def test_optimizer_fence_waits_for_the_snapshot(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 512))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(4, 512)).sum().backward()
    opt.step()
    handle = dcp_datastates.install_fence(opt)
    try:
        state = {"model": model.state_dict(), "optim": opt.state_dict()}
        expected = clone_state({"model": model.state_dict()})
        writer = DataStatesWriter(tmp_path / "c", **SMALL_CACHE)
        resp = async_save(state, writer)
        model(torch.randn(4, 512)).sum().backward()
        opt.step()  # the pre-hook waits while the snapshot copies
        assert resp.staging_completion.done()
        resp.upload_completion.result()
        writer.close()
    finally:
        handle.remove()
    out = load({"model": zeros_like_state(expected["model"])}, tmp_path / "c")
    assert_same(out, expected)
    assert dcp_datastates.snapshots_in_flight() == 0


def test_mutation_before_the_fence_fails_the_save_loudly(tmp_path):
    state = make_state(48)
    writer = DataStatesWriter(tmp_path / "c", **SMALL_CACHE)
    resp = async_save(state, writer)
    state["scalar"].add_(1)  # before staging completed: 44 MiB still had to reach the disk
    with raises_from_checkpoint(SnapshotMutatedError, match="'scalar'"):
        resp.upload_completion.result()
    assert not os.path.exists(tmp_path / "c" / ".metadata")
    assert data_files(tmp_path / "c") == []  # nothing torn left behind
    # The error is raised again by the next save call, once.
    with pytest.raises(CheckpointError, match="earlier asynchronous save"):
        async_save(state, DataStatesWriter(tmp_path / "d"))
    resp = async_save(state, DataStatesWriter(tmp_path / "d"))
    resp.upload_completion.result()


def test_several_saves_in_flight_commit_in_order(tmp_path):
    state = make_state(8)
    expected, responses, done = [], [], []
    for i in range(4):
        resp = async_save(state, DataStatesWriter(tmp_path / f"s{i}", **SMALL_CACHE))
        resp.upload_completion.add_done_callback(lambda _f, i=i: done.append(i))
        responses.append(resp)
        resp.staging_completion.result()
        expected.append(clone_state(state))
        mutate_in_place(state)
    for resp in responses:
        resp.upload_completion.result()
    assert done == [0, 1, 2, 3]
    for i in range(4):
        assert_same(load(zeros_like_state(expected[i]), tmp_path / f"s{i}"), expected[i])


def test_one_writer_reused_with_reset(tmp_path):
    state = make_state(4)
    writer = DataStatesWriter(**SMALL_CACHE)
    expected = []
    for i in range(3):
        writer.reset(tmp_path / f"step{i}")
        resp = async_save(state, writer)
        resp.staging_completion.result()
        expected.append(clone_state(state))
        mutate_in_place(state)
    writer.close()
    for i in range(3):
        assert_same(load(zeros_like_state(expected[i]), tmp_path / f"step{i}"), expected[i])


def test_close_drains_and_context_manager(tmp_path):
    state = make_state(16)
    with DataStatesWriter(tmp_path / "c", **SMALL_CACHE) as writer:
        async_save(state, writer)
    assert os.path.exists(tmp_path / "c" / ".metadata")
    with pytest.raises(RuntimeError, match="closed"):
        writer.stage(state)


def test_async_save_needs_the_path_at_stage_time(tmp_path):
    with pytest.raises(ValueError, match="needs its path"):
        dcp.async_save(make_state(1), checkpoint_id=tmp_path / "c", storage_writer=DataStatesWriter(), no_dist=True)


def test_checkpoint_id_different_from_staged_path_fails_clearly(tmp_path):
    writer = DataStatesWriter(tmp_path / "a")
    resp = dcp.async_save(make_state(1), checkpoint_id=tmp_path / "b", storage_writer=writer, no_dist=True)
    with raises_from_checkpoint(ValueError, match="staged into"):
        resp.upload_completion.result()
    assert not os.path.exists(tmp_path / "a" / ".metadata") and not os.path.exists(tmp_path / "b" / ".metadata")
    with pytest.raises(CheckpointError):
        writer.close()


def test_committed_checkpoint_is_refused_at_stage(tmp_path):
    state = make_state(1)
    async_save(state, DataStatesWriter(tmp_path / "c")).upload_completion.result()
    with pytest.raises(CheckpointExistsError):
        async_save(state, DataStatesWriter(tmp_path / "c"))


def test_async_overwrite_replaces_files_of_the_old_checkpoint(tmp_path):
    state = make_state(2)
    async_save(state, DataStatesWriter(tmp_path / "c")).upload_completion.result()
    old = set(os.listdir(tmp_path / "c"))
    mutate_in_place(state)
    async_save(state, DataStatesWriter(tmp_path / "c", overwrite=True)).upload_completion.result()
    new = set(os.listdir(tmp_path / "c"))
    assert not (old - {".metadata"}) & new and len(new) == 3
    assert_same(load(zeros_like_state(state), tmp_path / "c"), state)


def test_disk_full_fails_stage_at_once_when_tensors_do_not_fit(small_tmpfs):
    # The snapshot reserves its tensors' blocks up front: a full disk fails the call.
    with pytest.raises(OSError, match="No space left") as info:
        async_save(make_state(8), DataStatesWriter(small_tmpfs / "c", **SMALL_CACHE))
    assert ".data" in info.value.filename
    assert os.listdir(small_tmpfs / "c") == []


def test_disk_full_in_background_reaches_the_future_and_next_save(small_tmpfs, tmp_path):
    # Tensors fit; the 3 MB object appended in the background does not.
    state = {"w": torch.randn(64 * 1024), "blob": b"x" * (3 * MiB)}
    resp = async_save(state, DataStatesWriter(small_tmpfs / "c", **SMALL_CACHE))
    resp.staging_completion.result()  # the fence still releases: the caller may go on
    with raises_from_checkpoint(OSError, match="No space left"):
        resp.upload_completion.result()
    assert os.listdir(small_tmpfs / "c") == []
    with pytest.raises(CheckpointError, match="No space left"):
        async_save(state, DataStatesWriter(tmp_path / "d"))
    async_save(state, DataStatesWriter(tmp_path / "d")).upload_completion.result()
    assert_same(load({"w": torch.zeros(64 * 1024), "blob": b""}, tmp_path / "d"), state)


def test_async_save_failing_after_stage_does_not_block_later_saves(tmp_path):
    # DCP stages first, then refuses the process executor without a process group:
    # the staged snapshot is never saved and must not hold the next save back. Nothing
    # holds its staging future once the error is handled, which gives it up.
    state = make_state(1)
    with pytest.raises(ValueError, match="process group"):
        async_save(state, DataStatesWriter(tmp_path / "p"), async_checkpointer_type=AsyncCheckpointerType.PROCESS)
    async_save(state, DataStatesWriter(tmp_path / "q")).upload_completion.result(timeout=60)
    assert data_files(tmp_path / "p") == []  # the abandoned snapshot's file is gone
    assert_same(load(zeros_like_state(state), tmp_path / "q"), state)


_EXIT_WITH_A_STAGED_SNAPSHOT = r"""
import sys, warnings, torch
warnings.filterwarnings("ignore")
from dcp_datastates import DataStatesWriter
state = {"w": torch.randn(16 << 20), "step": 3}       # 64 MiB: still streaming when the script ends
DataStatesWriter(sys.argv[1], host_cache_bytes=16 << 20).stage(state)  # staged, never saved
print("exiting", flush=True)
"""


@pytest.mark.subprocess
@pytest.mark.slow
def test_exit_with_a_staged_snapshot_never_saved_is_clean(tmp_path):
    """The staging monitor (a daemon thread) was still blocked in the engine when the interpreter
    finalized: the process aborted with SIGABRT. At exit the unbegun snapshot is now stopped and
    its files removed; a snapshot that DCP saves still commits (its thread is joined first)."""
    import subprocess
    import sys

    path = tmp_path / "c"
    for _ in range(2):
        proc = subprocess.run([sys.executable, "-c", _EXIT_WITH_A_STAGED_SNAPSHOT, str(path)],
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0 and "exiting" in proc.stdout, (proc.returncode, proc.stderr[-2000:])
        assert "terminate called" not in proc.stderr
        assert os.listdir(path) == []  # uncommitted, and nothing left behind


def test_writer_refuses_to_be_sent_to_another_process(tmp_path):
    import pickle

    with pytest.raises(TypeError, match="another process"):
        pickle.dumps(DataStatesWriter(tmp_path / "c"))


def test_tied_and_aliased_tensors_are_stored_once(tmp_path):
    w = torch.randn(256, 256)
    state = {"emb": w, "head": w, "view": w[:, :10]}
    async_save(state, DataStatesWriter(tmp_path / "c")).upload_completion.result()
    size = os.path.getsize(tmp_path / "c" / data_files(tmp_path / "c")[0])
    assert size < 2 * w.numel() * 4  # w once, plus its strided view
    assert_same(load(zeros_like_state(state), tmp_path / "c"), state)


def test_stage_does_not_copy_in_the_callers_thread(tmp_path):
    # The engine copies in its own threads; stage() only walks and submits.
    state = make_state(32)
    copied_in = []
    real = torch.Tensor.clone

    def spy(self, *a, **k):
        copied_in.append(threading.current_thread().name)
        return real(self, *a, **k)

    torch.Tensor.clone = spy
    try:
        writer = DataStatesWriter(tmp_path / "c")
        future = writer.stage(state)
    finally:
        torch.Tensor.clone = real
    assert copied_in == []
    future.result()
    # finish the save through DCP (this thread took the staged dict, so it runs the save)
    dcp.save(future.result(), storage_writer=writer, no_dist=True)
    assert_same(load(zeros_like_state(state), tmp_path / "c"), state)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.cuda
def test_cuda_state_async_round_trip_and_event_ordering(tmp_path):
    dev = torch.device("cuda")
    state = {
        "w": torch.randn(4096, 1024, device=dev, dtype=torch.bfloat16),
        "m": torch.randn(4096, 1024, device=dev),
        "t": torch.randn(512, 384, device=dev).t(),
        "s": torch.tensor(1.0, device=dev),
    }
    # A kernel still writing "m" when stage() runs must finish before the copy reads it.
    _dcp_compat.cuda_sleep(200_000_000)
    state["m"].fill_(42.0)
    expected = {k: v.detach().cpu().clone() for k, v in state.items()}
    writer = DataStatesWriter(tmp_path / "c")
    resp = dcp.async_save(state, storage_writer=writer, no_dist=True)
    resp.staging_completion.result()
    for v in state.values():
        v.add_(1)
    resp.upload_completion.result()
    writer.close()
    out = {k: torch.zeros_like(v) for k, v in state.items()}
    load(out, tmp_path / "c")
    assert_same({k: v.cpu() for k, v in out.items()}, expected)
    assert writer._engine.pool_pinned


_DTENSOR_MUTATION_SCRIPT = r"""
import os, sys, warnings
warnings.filterwarnings("ignore")
import torch, torch.distributed as dist, torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
from dcp_datastates import DataStatesWriter, SnapshotMutatedError
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
mesh = init_device_mesh("cpu", (1,))
state = {"big": torch.randn(12 << 20), "param": distribute_tensor(torch.zeros(1024, 16), mesh, [Shard(0)])}
writer = DataStatesWriter(sys.argv[1], host_cache_bytes=4 << 20, window_bytes=1 << 20)
resp = dcp.async_save(state, storage_writer=writer, process_group=dist.new_group(backend="gloo"))
state["param"].add_(1)  # an optimizer step on an FSDP2 parameter, before the copy completed
try:
    resp.upload_completion.result()
    print("SAVED", flush=True)
except BaseException as exc:  # DCP's CheckpointException is a BaseException
    print("REFUSED" if "param" in str(exc) and "modified in place" in str(exc) else f"OTHER {exc!r}", flush=True)
try:
    writer.close()
except Exception:
    pass
dist.destroy_process_group()
"""


@pytest.mark.subprocess
@pytest.mark.slow
def test_a_dtensor_mutated_before_its_copy_fails_the_save(tmp_path):
    """In-place ops on a DTensor bump the DTensor's version counter, not its local shard's:
    the snapshot must watch the DTensor (it watched only the shard, so an FSDP2 optimizer step
    before the fence went unnoticed and could commit a torn checkpoint)."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _DTENSOR_MUTATION_SCRIPT, str(tmp_path / "c")],
                         capture_output=True, text=True, timeout=300)
    assert "REFUSED" in out.stdout, out.stdout + out.stderr[-3000:]
    assert not os.path.exists(tmp_path / "c" / ".metadata")
