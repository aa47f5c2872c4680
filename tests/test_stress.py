"""Stress tests (issue 4): every checkpoint of a busy training process verifies and loads.

* many consecutive ``dcp.async_save`` calls of a state that a training loop
  mutates in place (AdamW steps, buffers updated in forward like BatchNorm
  statistics), through a host cache smaller than the state, each save to its
  own directory and all of them in flight at once; the fences
  (``install_fence`` on the optimizer and on the module) are the only thing
  between a save and the next in-place update;
* two writers at once: two threads, each with its own DataStatesWriter and
  state, saving concurrently (one engine shared, or one each), in a
  subprocess with a watchdog (a stalled save would stall every later save of
  the pytest process);
* 4 gloo ranks: FSDP2 + AdamW plus DTensors with uneven and empty shards,
  an async save after every step, none awaited until the end;
* regressions for library bugs these tests found, each in a subprocess: a
  synchronous dcp.save issued while an async save has not begun (deadlock),
  two threads staging at once (stall of every async save), a save whose
  DCP thread starts late (it was given up, then saved from the live
  tensors: a committed checkpoint with wrong values), and DCP's staging
  callback run in the caller's thread (taken for the save's thread: stall).
  All four are fixed.

Afterwards every checkpoint is loaded in one process and compared bit-exactly
with the state recorded when its save was called.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "support")  # the helpers the scripts import

import dcp_datastates  # noqa: E402
import dist_helpers as dh  # noqa: E402
import stress_helpers as sh  # noqa: E402
from dcp_datastates import DataStatesReader, DataStatesWriter  # noqa: E402

pytestmark = [pytest.mark.subprocess, pytest.mark.dist, pytest.mark.slow, pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")]

MiB = 1 << 20


# ---------------------------------------------------------------------------
# many consecutive async saves of a mutating state, cache smaller than the state
# ---------------------------------------------------------------------------


class Net(nn.Module):
    """Linear layers plus buffers that forward updates in place (like BatchNorm statistics)."""

    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.register_buffer("running", torch.zeros(96, width).t())  # a strided buffer
        self.register_buffer("seen", torch.zeros((), dtype=torch.int64))
        self.register_buffer("scale", torch.ones(33, 17, dtype=torch.bfloat16))

    def forward(self, x):
        self.seen.add_(x.shape[0])
        self.running.mul_(0.9).add_(x.mean(0, keepdim=True).t().expand(-1, 96), alpha=0.1)
        self.scale.mul_(1.0001)
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def train_loop_with_async_saves(root, saves: int, width: int, depth: int):
    """Save every step without waiting for the uploads.

    Returns ([(path, state recorded at the call)], bytes of tensors in one state).
    """
    torch.manual_seed(0)
    model = Net(width, depth)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    fences = [dcp_datastates.install_fence(optim), dcp_datastates.install_fence(model)]
    g = torch.Generator().manual_seed(1)

    def step():
        model(torch.randn(16, width, generator=g)).square().mean().backward()  # forward: module fence
        optim.step()  # optimizer fence
        optim.zero_grad()

    step()  # AdamW creates its state
    meta = {"history": [], "tag": "run-\u00e4"}
    checkpoints, responses = [], []
    try:
        for i in range(saves):
            state = {"model": model.state_dict(), "optim": optim.state_dict(), "step": i, "meta": meta}
            expected = sh.clone_state(state)
            path = os.path.join(root, f"step{i:03d}")
            writer = DataStatesWriter(path, host_cache_bytes=2 * MiB, window_bytes=1 * MiB)
            responses.append((dcp.async_save(state, storage_writer=writer, no_dist=True), writer))
            meta["history"].append(i)  # objects are captured at the call too
            checkpoints.append((path, expected))
            step()
        for resp, writer in responses:
            resp.upload_completion.result(timeout=300)
            writer.close()
    finally:
        for handle in fences:
            handle.remove()
    state_bytes = sum(t.numel() * t.element_size() for t in sh.tensors_of(checkpoints[-1][1]))
    return checkpoints, state_bytes


def _check_consecutive_saves(tmp_path, saves, width, depth):
    t0 = time.monotonic()
    checkpoints, state_bytes = train_loop_with_async_saves(tmp_path, saves, width, depth)
    saved_s = time.monotonic() - t0
    assert state_bytes > 2 * MiB, f"the state ({state_bytes} B) must be larger than the 2 MiB cache"
    assert dcp_datastates.snapshots_in_flight() == 0
    for i, (path, expected) in enumerate(checkpoints):
        sh.load_and_check(path, expected, f"step{i:03d}")
        shutil.rmtree(path)  # keep the disk footprint of the long version bounded
    # Consecutive checkpoints differ: the loop really mutated the state between saves.
    assert not torch.equal(checkpoints[0][1]["model"]["layers.0.weight"], checkpoints[-1][1]["model"]["layers.0.weight"])
    print(f"{saves} saves of {state_bytes / MiB:.1f} MiB in {saved_s:.1f}s, verified in {time.monotonic() - t0 - saved_s:.1f}s")


def test_100_async_saves_of_a_mutating_state_through_a_small_cache(tmp_path):
    # 4 x 320x320 Linear + AdamW: ~4.8 MiB of tensors through a 2 MiB cache of 1 MiB windows.
    _check_consecutive_saves(tmp_path, saves=100, width=320, depth=4)


@pytest.mark.long
def test_100_async_saves_of_a_mutating_state_through_a_small_cache_long(tmp_path):
    # ~12 MiB of tensors per save: 6x the cache (the recorded states take ~1.2 GiB of memory).
    _check_consecutive_saves(tmp_path, saves=100, width=512, depth=4)


# ---------------------------------------------------------------------------
# two writers at once in one process
# ---------------------------------------------------------------------------


def _two_writers(tmp_path, engines, saves, stall_s, switch_interval=None, max_in_flight=None):
    """Run :func:`stress_helpers.two_writers_main` in a subprocess: a stalled save stalls every
    later async save of its process, so it must not happen in the pytest process."""
    code = (
        f"import stress_helpers as sh; "
        f"sh.two_writers_main({str(tmp_path)!r}, {engines!r}, {saves}, {stall_s}, {max_in_flight})"
    )
    if switch_interval is not None:
        code = f"import sys; sys.setswitchinterval({switch_interval}); " + code
    try:
        out = subprocess.run(
            [sys.executable, "-c", code], cwd=HERE, capture_output=True, text=True, timeout=stall_s + 120
        )
    except subprocess.TimeoutExpired:
        raise AssertionError("the two-writer script hung outside its watchdog") from None
    assert out.returncode == 0 and "OK" in out.stdout, f"exit code {out.returncode}\n{out.stdout[-2000:]}\n{out.stderr[-12000:]}"
    print(out.stdout.strip())


@pytest.mark.parametrize("engines", ["shared", "separate"])
def test_two_writers_in_two_threads_at_once(tmp_path, engines):
    _two_writers(tmp_path, engines, saves=30, stall_s=60)


@pytest.mark.long
@pytest.mark.parametrize("engines", ["shared", "separate"])
@pytest.mark.parametrize("switch_interval", [None, 1e-5], ids=["default-switch", "10us-switch"])
def test_two_writers_in_two_threads_at_once_long(tmp_path, engines, switch_interval):
    # A 10 us GIL switch interval makes thread interleavings (races) far more likely.
    _two_writers(tmp_path, engines, saves=150, stall_s=60, switch_interval=switch_interval)


# ---------------------------------------------------------------------------
# 4 gloo ranks: FSDP2 + AdamW + DTensors, several async saves each
# ---------------------------------------------------------------------------


def _check_four_rank_saves(root, saves):
    from torch.distributed.checkpoint.state_dict import get_state_dict

    sh.run_ranks("stress_4rank_async_saves", 4, root / "logs", root=root, saves=saves)
    for i in range(saves):
        path = root / f"ckpt{i}"
        ref = torch.load(root / f"ref{i}.pt", weights_only=False)
        model, optim = dh.new_model_and_optim(dh.MLP_SEED + 7)  # other weights than the saved ones
        msd, osd = get_state_dict(model, optim)  # also creates the optimizer state to load into
        extra = sh.stress_reference(i)
        state = {"model": msd, "optim": osd, "extra": sh.placeholder(extra), "step": None, "meta": {"saves": None}}
        report = dcp_datastates.verify(path)
        assert report.ok, report.summary()
        dcp.load(state, storage_reader=DataStatesReader(path), no_dist=True)
        dh.assert_equal_exact(state["model"], ref["model"], f"ckpt{i}.model")
        dh.assert_equal_exact(state["optim"], ref["optim"], f"ckpt{i}.optim")
        sh.assert_exact(state["extra"], extra, f"ckpt{i}.extra")
        assert state["step"] == i and state["meta"] == {"saves": list(range(i))}
    # The DTensor entries really changed between saves (the fence, not luck, kept them apart).
    assert not torch.equal(sh.stress_reference(0)["emb"], sh.stress_reference(saves - 1)["emb"])


def test_four_gloo_ranks_async_saves_load_on_one_process(tmp_path):
    _check_four_rank_saves(tmp_path, saves=4)


@pytest.mark.long
def test_four_gloo_ranks_async_saves_load_on_one_process_long(tmp_path):
    _check_four_rank_saves(tmp_path, saves=20)


# ---------------------------------------------------------------------------
# a synchronous save after an async save that has not begun
# ---------------------------------------------------------------------------

def run_regression_script(script: str, tmp_path, bad_word: str, meaning: str) -> None:
    """Run a regression script in its own process (a deadlock or stall there would stall every
    later save of the pytest process); it prints OK, or ``bad_word`` when the bug shows."""
    try:
        out = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=120, cwd=HERE)
    except subprocess.TimeoutExpired:
        raise AssertionError("the regression script hung outside the part it watches") from None
    assert bad_word not in out.stdout, f"{meaning}: {out.stdout[-2000:]}"
    assert out.returncode == 0 and "OK" in out.stdout, out.stdout[-2000:] + out.stderr[-3000:]


DEADLOCK_SCRIPT = textwrap.dedent(
    """
    import os, sys, threading, time, warnings
    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed.checkpoint as dcp
    from dcp_datastates import DataStatesWriter

    class SlowStartWriter(DataStatesWriter):
        # DCP's background thread reaches the writer late (a busy GIL, a slow collective).
        def storage_meta(self):
            time.sleep(0.5)
            return super().storage_meta()

    d = sys.argv[1]

    def three_saves():  # in one thread, as a training loop issues them
        state = {"w": torch.randn(1000)}
        dcp.save(state, storage_writer=DataStatesWriter(d + "/sync0"), no_dist=True)
        resp = dcp.async_save(state, storage_writer=SlowStartWriter(d + "/async1"), no_dist=True)
        resp.staging_completion.result()
        dcp.save(state, storage_writer=DataStatesWriter(d + "/sync2"), no_dist=True)
        resp.upload_completion.result()

    t = threading.Thread(target=three_saves, daemon=True)  # daemon: a deadlock can be reported
    t.start()
    t.join(5)
    if t.is_alive():
        print("DEADLOCK", flush=True)
        os._exit(3)
    print("OK")
    """
)


def test_sync_save_after_async_save_does_not_deadlock(tmp_path):
    """dcp.save, dcp.async_save, dcp.save in a row (the async save's thread starting late) completes.

    Runs in a subprocess: a deadlocked order of saves would block every later save of this process.
    The same pattern hangs on 2 gloo ranks without any injected delay (sync save per step with
    async saves in flight), which is why random_dist_save issues its sync saves first.
    """
    run_regression_script(DEADLOCK_SCRIPT, tmp_path, "DEADLOCK", "dcp.save after a not-yet-begun dcp.async_save deadlocked")


# ---------------------------------------------------------------------------
# two threads staging at once: ticket order vs. the staging monitor's queue order
# ---------------------------------------------------------------------------

TICKET_ORDER_SCRIPT = textwrap.dedent(
    """
    import os, sys, threading, time, warnings
    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed.checkpoint as dcp
    from dcp_datastates.core.async_save import handoff as staging
    from dcp_datastates import DataStatesWriter

    real_start = staging.start
    first = []

    def preempted_start(snap):
        # The first stage() loses the CPU between taking its ticket (ORDER.reserve()) and
        # handing its snapshot to the staging monitor; the other thread stages meanwhile.
        if not first:
            first.append(snap.ticket)
            time.sleep(0.5)
        return real_start(snap)

    staging.start = preempted_start
    d = sys.argv[1]
    responses = {}

    def save(tag):
        state = {"w": torch.randn(1000)}
        responses[tag] = dcp.async_save(state, storage_writer=DataStatesWriter(d + "/" + tag), no_dist=True)

    a = threading.Thread(target=save, args=("a",))
    a.start()
    time.sleep(0.1)
    b = threading.Thread(target=save, args=("b",))
    b.start()
    a.join()
    b.join()
    for tag in "ab":
        try:
            responses[tag].upload_completion.result(timeout=5)
        except TimeoutError:
            print("STALLED", flush=True)
            os._exit(3)
    print("OK", flush=True)
    os._exit(0)
    """
)


def test_two_threads_staging_at_once_do_not_stall(tmp_path):
    """Deterministic version of a stall that test_two_writers_in_two_threads_at_once_long hits
    (always with sys.setswitchinterval(1e-5), now and then without). Runs in a subprocess."""
    run_regression_script(TICKET_ORDER_SCRIPT, tmp_path, "STALLED", "async saves staged by two threads at once never completed")


# ---------------------------------------------------------------------------
# a save whose DCP thread is slow to start: abandoned, then saved from the live tensors
# ---------------------------------------------------------------------------

ABANDON_SCRIPT = textwrap.dedent(
    """
    import os, sys, threading, time, warnings
    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed.checkpoint as dcp
    from dcp_datastates import DataStatesReader, DataStatesWriter
    from dcp_datastates.core.async_save import handoff as staging

    futures = []
    real_start, real_result = staging.start, staging.StagingFuture.result

    def start(snap):
        future = real_start(snap)
        futures.append(future)
        return future

    def starved_result(self, timeout=None):
        # The executor thread of the first save gets the CPU (the GIL) back 3 s after its
        # staging future resolved, before it takes the staged dict, while the second save
        # waits for its turn.
        if self is futures[0] and threading.current_thread().name.startswith("AsyncCheckpointExecutor"):
            while not self.done():
                time.sleep(0.01)
            time.sleep(3)
        return real_result(self, timeout)

    staging.start, staging.StagingFuture.result = start, starved_result
    d = sys.argv[1]
    state = {"w": torch.randn(1000), "step": 1}
    expected = state["w"].clone()
    r1 = dcp.async_save(state, storage_writer=DataStatesWriter(d + "/one"), no_dist=True)
    r1.staging_completion.result()
    state["w"].add_(1)  # allowed: the staging of save one has completed
    r2 = dcp.async_save(state, storage_writer=DataStatesWriter(d + "/two"), no_dist=True)
    try:
        r1.upload_completion.result(timeout=60)
        r2.upload_completion.result(timeout=60)
    except BaseException as exc:
        print("FAILED", type(exc).__name__, str(exc).strip().splitlines()[-1][:500], flush=True)
        os._exit(2)
    out = {"w": torch.zeros(1000), "step": 0}
    dcp.load(out, storage_reader=DataStatesReader(d + "/one"), no_dist=True)
    if not torch.equal(out["w"], expected):
        mutated = torch.equal(out["w"], expected + 1)
        print("WRONG", "holds the values written after its staging completed" if mutated else "", flush=True)
        os._exit(3)
    print("OK", flush=True)
    os._exit(0)
    """
)


def test_slow_executor_thread_does_not_get_its_save_abandoned(tmp_path):
    """The checkpoint holds the values at the dcp.async_save call however late DCP's thread starts.

    Under stress (2 threads x 150 saves in flight, 10 us GIL switch interval) the same mechanism
    also failed a save with "RuntimeError: write job for ... is already sealed" (the monitor
    cancelled a snapshot whose save had just begun). Runs in a subprocess: it patches the module.
    """
    run_regression_script(ABANDON_SCRIPT, tmp_path, "WRONG", "checkpoint 'one' does not hold the state at its call")


# ---------------------------------------------------------------------------
# DCP's staging callback run in the caller's thread (it claims the staging future)
# ---------------------------------------------------------------------------

CONSUMER_SCRIPT = textwrap.dedent(
    """
    import os, sys, threading, time, warnings
    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed.checkpoint as dcp
    from dcp_datastates._dcp_compat import async_thread_executor_module
    executor = async_thread_executor_module()
    from dcp_datastates import DataStatesWriter
    from dcp_datastates.core.async_save import handoff as staging

    real_wrapper = executor.save_wrapper

    def slow_start_wrapper(*args, **kwargs):
        time.sleep(0.5)  # DCP's executor thread gets the GIL late
        return real_wrapper(*args, **kwargs)

    real_add = staging.StagingFuture.add_done_callback

    def late_add_done_callback(self, fn):
        # dcp.async_save checks staging_future.done(), then calls add_done_callback(); the staging
        # monitor resolves the future in between, so DCP's callback runs at once, in this thread,
        # and calls StagingFuture.result() here.
        while "async_save" in getattr(fn, "__qualname__", "") and not self.done():
            time.sleep(0.001)
        real_add(self, fn)

    executor.save_wrapper = slow_start_wrapper
    staging.StagingFuture.add_done_callback = late_add_done_callback
    d = sys.argv[1]
    state = {"w": torch.randn(16 << 20)}  # 64 MiB: staging still runs when DCP checks done()
    r1 = dcp.async_save(state, storage_writer=DataStatesWriter(d + "/one"), no_dist=True)
    staging.StagingFuture.add_done_callback = real_add
    r2 = dcp.async_save(state, storage_writer=DataStatesWriter(d + "/two"), no_dist=True)
    for r in (r1, r2):
        try:
            r.upload_completion.result(timeout=6)
        except TimeoutError:
            print("STALLED", flush=True)
            os._exit(3)
    print("OK" if os.path.exists(d + "/one/.metadata") and os.path.exists(d + "/two/.metadata") else "MISSING", flush=True)
    os._exit(0)
    """
)


def test_staging_callback_in_the_callers_thread_does_not_stall(tmp_path):
    """Deterministic version of a stall test_two_writers_in_two_threads_at_once_long[10us-switch-*]
    hit now and then with the earlier, stack-polling hand-off (DCP's forwarding callback taken for
    the thread that runs the save). Runs in a subprocess: it patches DCP and the module."""
    run_regression_script(CONSUMER_SCRIPT, tmp_path, "STALLED", "the async saves never completed")
