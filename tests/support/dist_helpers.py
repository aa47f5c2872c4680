"""Multi-process helpers for tests/test_distributed.py (gloo on CPU).

Two halves:

* the launcher, used by the pytest process: :func:`run_ranks` starts one
  subprocess per rank running this file as a script, with a free TCP port,
  a wall-clock timeout, and every rank's output captured; a rank that fails
  (an assertion, an exception, a crash) or a hang fails the test with the
  output of every rank, the failing rank's traceback first;
* the worker cases (``@case``), run inside those subprocesses after
  ``init_process_group("gloo", ...)``; the process group is always destroyed.

Reference data (:func:`reference_tensors`, :data:`OBJECTS`, the MLP) is
built deterministically from fixed seeds, so the pytest process and every
rank compute the same full values without communicating.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import traceback
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
SPAWN_TIMEOUT_S = 150.0  # per launch: a hang fails the test instead of blocking CI
PG_TIMEOUT_S = 60.0  # gloo collectives give up after this
FAILURE_GRACE_S = 5.0  # after a rank fails, how long the others get before being killed

warnings.filterwarnings("ignore", message="torch.distributed is disabled")

import torch  # noqa: E402  (after the warnings filter)
from torch import nn  # noqa: E402

from ports import free_port  # noqa: E402,F401  (the tests import it from here too)


# ---------------------------------------------------------------------------
# reference data
# ---------------------------------------------------------------------------

SEED = 20240601

# key -> (shape, dtype, placement) for the DTensors of the saved state dict;
# placement is "S0", "S1" (Shard(dim)) or "R" (Replicate). Sizes deliberately
# do not divide by 2 or 3; dt_tiny leaves ranks with empty shards; the big ones
# (>= 64 KiB per shard) take the page-aligned path of the layout.
DTENSOR_SPECS = {
    "dt_s0": ((7, 5), torch.float32, "S0"),
    "dt_s1": ((7, 5, 3), torch.float64, "S1"),
    "dt_s0_3d": ((5, 3, 2), torch.float16, "S0"),
    "dt_rep": ((6, 4), torch.float32, "R"),
    "dt_big_s0": ((257, 129), torch.float32, "S0"),
    "dt_big_s1": ((129, 257), torch.float32, "S1"),
    "dt_tiny": ((1, 3), torch.float32, "S0"),
}
PLAIN_KEYS = ("rep_f32", "rep_i64", "rep_bf16", "rep_scalar")

OBJECTS = {
    "epoch": 3,
    "name": "run-\u00e4/\u03b2",
    "cfg": {"lr": 0.125, "betas": [0.9, 0.95], "nested": {"flag": True, "tags": ["a", "b"], "depth": 2}},
}


def reference_tensors() -> dict:
    """Every tensor of the saved state dict, as full plain CPU tensors."""
    g = torch.Generator().manual_seed(SEED)

    def randn(shape, dtype=torch.float32):
        return torch.randn(shape, generator=g, dtype=torch.float32).to(dtype)

    ref = {
        "rep_f32": randn((4, 3)),
        "rep_i64": torch.randint(-(10**12), 10**12, (10,), generator=g, dtype=torch.int64),
        "rep_bf16": randn((3, 5), torch.bfloat16),
        "rep_scalar": randn(()),
    }
    for key, (shape, dtype, _) in DTENSOR_SPECS.items():
        ref[key] = randn(shape, dtype)
    return ref


def placeholder(obj):
    """A value of the same structure as ``obj`` holding nothing of it (a load target)."""
    if isinstance(obj, dict):
        return {k: placeholder(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return []
    if isinstance(obj, bool):
        return False
    if isinstance(obj, (int, float, str)):
        return type(obj)()
    return None


def full_targets() -> dict:
    """A 1-process load target: zero full tensors and placeholder objects."""
    out = {k: torch.zeros_like(v) for k, v in reference_tensors().items()}
    out.update(placeholder(OBJECTS))
    return out


def reference_state() -> dict:
    out = dict(reference_tensors())
    out.update(OBJECTS)
    return out


def _placement(code: str):
    from torch.distributed.tensor import Replicate, Shard

    return Replicate() if code == "R" else Shard(int(code[1:]))


def dtensor_state(mesh, zeros: bool, placements: dict | None = None) -> dict:
    """The state dict on one rank: plain replicated tensors, DTensors, objects.

    ``zeros`` gives load targets (zero tensors, placeholder objects) of the
    same structure. ``placements`` overrides the placement code per key; a
    key named there that is a plain key becomes a DTensor too.
    """
    from torch.distributed.tensor import distribute_tensor

    ref = reference_tensors()
    codes = {k: spec[2] for k, spec in DTENSOR_SPECS.items()}
    codes.update(placements or {})
    out = {}
    for key, full in ref.items():
        value = torch.zeros_like(full) if zeros else full.clone()
        code = codes.get(key)
        out[key] = value if code is None else distribute_tensor(value, mesh, [_placement(code)])
    out.update(placeholder(OBJECTS) if zeros else json.loads(json.dumps(OBJECTS)))
    return out


def assert_equal_exact(actual, expected, path="state"):
    """Bit-exact comparison of nested values; DTensors compare as their full tensor."""
    from torch.distributed.tensor import DTensor

    if isinstance(actual, DTensor):
        actual = actual.full_tensor()
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), f"{path}: got {type(actual).__name__}, expected a tensor"
        assert not isinstance(expected, DTensor), f"{path}: reference must be a plain tensor"
        assert actual.dtype == expected.dtype, f"{path}: dtype {actual.dtype} != {expected.dtype}"
        assert actual.shape == expected.shape, f"{path}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
        a = actual.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        e = expected.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        assert torch.equal(a, e), f"{path}: bytes differ"
    elif isinstance(expected, dict):
        assert isinstance(actual, dict), f"{path}: got {type(actual).__name__}, expected a dict"
        assert set(actual) == set(expected), f"{path}: keys differ: {sorted(map(str, set(actual) ^ set(expected)))}"
        for k in expected:
            assert_equal_exact(actual[k], expected[k], f"{path}.{k}")
    elif isinstance(expected, (list, tuple)):
        assert isinstance(actual, (list, tuple)) and len(actual) == len(expected), f"{path}: {actual!r} != {expected!r}"
        for i, (x, y) in enumerate(zip(actual, expected)):
            assert_equal_exact(x, y, f"{path}[{i}]")
    else:
        assert type(actual) is type(expected) and actual == expected, f"{path}: {actual!r} != {expected!r}"


def assert_local_shards(state: dict, mesh, codes: dict) -> None:
    """Each DTensor of ``state`` has the placement in ``codes`` and the right local shard."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    ref = reference_tensors()
    for key, code in codes.items():
        value = state[key]
        assert isinstance(value, DTensor), f"{key}: loaded as {type(value).__name__}, expected a DTensor"
        assert tuple(value.placements) == (_placement(code),), f"{key}: placements {value.placements}"
        expected_local = distribute_tensor(ref[key], mesh, [_placement(code)]).to_local()
        assert_equal_exact(value.to_local(), expected_local, f"{key} (local shard of rank {mesh.get_rank()})")


# -- the model of the FSDP2 cases ---------------------------------------------

MLP_SEED = 1234


class MLP(nn.Module):
    """A few thousand parameters; row counts (37, 11) do not divide by 2."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(13, 37)
        self.norm = nn.LayerNorm(37)
        self.fc2 = nn.Linear(37, 37)
        self.head = nn.Linear(37, 11)

    def forward(self, x):
        x = torch.nn.functional.gelu(self.fc1(x))
        x = self.norm(x)
        x = torch.relu(self.fc2(x)) + x
        return self.head(x)


def new_model_and_optim(seed: int):
    torch.manual_seed(seed)
    model = MLP()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.05)
    return model, optim


def fsdp_model_and_optim(seed: int, mesh):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = MLP()
    for layer in (model.fc1, model.fc2, model.head):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.05)
    return model, optim


# ---------------------------------------------------------------------------
# worker cases
# ---------------------------------------------------------------------------

class WorkerCases(dict):
    """A worker script's rank cases, by name: ``case`` registers one, ``run_ranks`` launches one
    on ``world_size`` ranks that each run the script, and ``main`` is a rank's entry point."""

    def __init__(self, script: str, inherited: dict | None = None, timeout: float = SPAWN_TIMEOUT_S) -> None:
        super().__init__(inherited or {})
        self.script = os.path.abspath(script)
        self.timeout = timeout  # a launch's default time limit

    def case(self, fn):
        self[fn.__name__] = fn
        return fn

    def run_ranks(self, case_name: str, world_size: int, log_dir, timeout: float | None = None, **kwargs) -> float:
        timeout = self.timeout if timeout is None else timeout
        return run_ranks(case_name, world_size, log_dir, timeout, worker_script=self.script, worker_cases=self, **kwargs)

    def main(self, argv: list[str] | None = None):
        """Run this rank's case and leave without finalizing the interpreter: torch 2.13 + gloo
        can abort (SIGABRT, "terminate called without an active exception") during finalization,
        after the case has passed and the process group is destroyed (a gloo thread frees a
        finished collective whose tensors need the GIL). The verdict is decided by then; the demo
        leaves the same way."""
        code = _worker_main(sys.argv[1:] if argv is None else argv, self)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


CASES = WorkerCases(__file__)
case = CASES.case


def _mesh(world_size: int):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (world_size,))


@case
def save_dtensor_state(rank, world_size, default_path, planner_path, striped_path=None):
    """Save the mixed state dict twice: DCP's default planner, then DataStatesSavePlanner;
    and with ``striped_path``, a third time with each rank's data striped over files."""
    import torch.distributed.checkpoint as dcp

    from dcp_datastates import DataStatesSavePlanner, DataStatesWriter

    mesh = _mesh(world_size)
    state = dtensor_state(mesh, zeros=False)
    dcp.save(state, storage_writer=DataStatesWriter(default_path))
    # The state dict must be untouched by the save.
    assert_equal_exact(state, reference_state())
    state = dtensor_state(mesh, zeros=False)
    dcp.save(state, storage_writer=DataStatesWriter(planner_path), planner=DataStatesSavePlanner())
    if striped_path is not None:
        state = dtensor_state(mesh, zeros=False)
        dcp.save(state, storage_writer=DataStatesWriter(striped_path, stripes=4))


@case
def load_dtensor_state(rank, world_size, path, placements=None):
    """Load into DTensors of the given placements (default: the saved ones) and check."""
    import torch.distributed.checkpoint as dcp

    from dcp_datastates import DataStatesReader

    mesh = _mesh(world_size)
    codes = {k: spec[2] for k, spec in DTENSOR_SPECS.items()}
    codes.update(placements or {})
    state = dtensor_state(mesh, zeros=True, placements=placements)
    dcp.load(state, storage_reader=DataStatesReader(path))
    assert_local_shards(state, mesh, codes)
    for key in PLAIN_KEYS:
        if key not in codes:
            assert type(state[key]) is torch.Tensor, f"{key}: {type(state[key]).__name__}"
    assert_equal_exact(state, reference_state())


@case
def load_resharded(rank, world_size, path):
    """Load on a mesh of another size: once with every tensor Shard(0), once Shard(1)."""
    ref = reference_tensors()
    for dim in (0, 1):
        codes = {k: f"S{min(dim, t.dim() - 1)}" for k, t in ref.items() if t.dim() >= 1}
        load_dtensor_state(rank, world_size, path, placements=codes)


@case
def load_missing_checkpoint(rank, world_size, missing, not_a_checkpoint):
    """dcp.load of a folder that does not exist, and of one that holds no checkpoint, both ways a
    reader takes its path: one typed error a plain ``except Exception`` catches, on every rank,
    raised before DCP's collectives (the group is still usable afterwards)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from dcp_datastates import CheckpointNotFoundError, DataStatesReader

    for path, why in ((missing, "does not exist"), (not_a_checkpoint, ".metadata is missing")):
        for how in ("reader", "checkpoint_id"):
            try:
                if how == "reader":
                    dcp.load({"w": torch.zeros(4)}, storage_reader=DataStatesReader(path))
                else:
                    dcp.load({"w": torch.zeros(4)}, storage_reader=DataStatesReader(), checkpoint_id=path)
            except Exception as exc:  # noqa: BLE001 - what a user's except catches
                assert type(exc) is CheckpointNotFoundError, f"{how}: {type(exc).__name__}: {exc}"
                assert path in str(exc) and why in str(exc), str(exc)
            else:
                raise AssertionError(f"{how}: dcp.load of {path} did not raise")
    dist.barrier()  # every rank got here: nobody was left waiting in a collective
    print(f"rank {rank}: every load raised CheckpointNotFoundError", flush=True)


def unwrap_checkpoint_exception(exc: BaseException) -> BaseException:
    """The error a rank raised, whether or not DCP wrapped it in a CheckpointException."""
    from torch.distributed.checkpoint.api import CheckpointException

    if isinstance(exc, CheckpointException):
        failures = list(exc.failures.values())
        assert failures, exc
        inner = failures[0]
        return inner[0] if isinstance(inner, tuple) else inner
    return exc


@case
def load_expect_checksum_error(rank, world_size, path, placements, data_file, key):
    """Load a corrupted checkpoint into DTensors; every rank must see ChecksumMismatchError."""
    import torch.distributed.checkpoint as dcp

    from dcp_datastates import ChecksumMismatchError, DataStatesReader

    mesh = _mesh(world_size)
    state = dtensor_state(mesh, zeros=True, placements=placements)
    try:
        dcp.load(state, storage_reader=DataStatesReader(path))
    except BaseException as exc:  # noqa: BLE001 - CheckpointException is a BaseException
        err = unwrap_checkpoint_exception(exc)
        assert isinstance(err, ChecksumMismatchError), f"{type(err).__name__}: {err}"
        assert data_file in str(err) and repr(key) in str(err), str(err)
        return
    local = state[key].to_local()
    expected = distribute_tensor_local(reference_tensors()[key], mesh, placements[key])
    raise AssertionError(
        f"rank {rank}: load of a checkpoint with a corrupted byte in {key!r} succeeded without a "
        f"checksum error; loaded shard equals the saved one: {torch.equal(local, expected)}"
    )


def distribute_tensor_local(full, mesh, code):
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(full, mesh, [_placement(code)]).to_local()


def _train_two_steps(model, optim, rank):
    g = torch.Generator().manual_seed(99 + rank)
    for _ in range(2):
        x = torch.randn(8, 13, generator=g)
        y = torch.randn(8, 11, generator=g)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optim.step()
        optim.zero_grad()


@case
def fsdp_save(rank, world_size, path, reference_path):
    """Train an FSDP2 MLP 2 AdamW steps, save its sharded state; rank 0 writes the full reference."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
    from torch.distributed.tensor import DTensor

    from dcp_datastates import DataStatesWriter

    mesh = _mesh(world_size)
    model, optim = fsdp_model_and_optim(MLP_SEED, mesh)
    _train_two_steps(model, optim, rank)
    msd, osd = get_state_dict(model, optim)
    assert all(isinstance(v, DTensor) for v in msd.values()), "FSDP2 state dict should hold DTensors"
    dcp.save({"model": msd, "optim": osd}, storage_writer=DataStatesWriter(path))
    full_m, full_o = get_state_dict(model, optim, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        assert full_o["state"] and all(
            {"step", "exp_avg", "exp_avg_sq"} <= set(s) for s in full_o["state"].values()
        ), "optimizer state missing after two steps"
        torch.save({"model": full_m, "optim": full_o}, reference_path)
    dist.barrier()


@case
def async_save_dtensor_state(rank, world_size, path):
    """dcp.async_save of the mixed state; every tensor is mutated right after the fence."""
    import torch.distributed.checkpoint as dcp

    from dcp_datastates import DataStatesWriter

    mesh = _mesh(world_size)
    state = dtensor_state(mesh, zeros=False)
    with DataStatesWriter(path, host_cache_bytes=1 << 20, window_bytes=256 << 10) as writer:
        resp = dcp.async_save(state, storage_writer=writer)
        resp.staging_completion.result()
        for value in state.values():
            if isinstance(value, torch.Tensor):
                local = value.to_local() if hasattr(value, "to_local") else value
                local.add_(1)
        resp.upload_completion.result()


@case
def fsdp_async_saves(rank, world_size, path, reference_path, saves=3):
    """FSDP2 + AdamW with the optimizer fence: an async save after every step, none awaited.

    Rank 0 writes the full state at each save as reference ``{reference_path}.{i}``.
    """
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    import dcp_datastates
    from dcp_datastates import DataStatesWriter

    mesh = _mesh(world_size)
    model, optim = fsdp_model_and_optim(MLP_SEED, mesh)
    dcp_datastates.install_fence(optim)
    # Training runs FSDP collectives on the default (gloo) group while saves run
    # theirs in the background: checkpoints get a group of their own.
    ckpt_group = dist.new_group(backend="gloo")
    _train_two_steps(model, optim, rank)
    responses = []
    for i in range(saves):
        msd, osd = get_state_dict(model, optim)
        full_m, full_o = get_state_dict(model, optim, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if rank == 0:
            torch.save({"model": full_m, "optim": full_o}, f"{reference_path}.{i}")
        writer = DataStatesWriter(f"{path}.{i}", host_cache_bytes=1 << 20, window_bytes=256 << 10)
        responses.append(dcp.async_save({"model": msd, "optim": osd}, storage_writer=writer, process_group=ckpt_group))
        _train_two_steps(model, optim, rank)  # each step waits in the fence while copying
    for resp in responses:
        resp.upload_completion.result()
    dist.barrier()


@case
def fsdp_load(rank, world_size, path, reference_path):
    """Load the checkpoint into a freshly built FSDP2 model + AdamW and compare the full state."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

    from dcp_datastates import DataStatesReader

    mesh = _mesh(world_size)
    model, optim = fsdp_model_and_optim(MLP_SEED + 1, mesh)  # other initial weights
    msd, osd = get_state_dict(model, optim)
    state = {"model": msd, "optim": osd}
    dcp.load(state, storage_reader=DataStatesReader(path))
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    full_m, full_o = get_state_dict(model, optim, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        ref = torch.load(reference_path, weights_only=False)
        assert_equal_exact(full_m, ref["model"], "model")
        assert_equal_exact(full_o, ref["optim"], "optim")
    # The sharded (per-rank) view as well, on every rank.
    msd2, osd2 = get_state_dict(model, optim)
    ref = torch.load(reference_path, weights_only=False)
    assert_equal_exact(msd2, ref["model"], "model (sharded)")
    assert_equal_exact(osd2, ref["optim"], "optim (sharded)")


@case
def selftest_fail(rank, world_size):
    """Harness self-test: every rank fails an assertion naming itself."""
    assert rank < 0, f"deliberate failure on rank {rank}"


@case
def selftest_hang(rank, world_size):
    """Harness self-test: rank 1 never arrives, so rank 0 waits forever."""
    if rank == 1:
        time.sleep(3600)
    torch.distributed.barrier()


# ---------------------------------------------------------------------------
# worker entry point
# ---------------------------------------------------------------------------


def _worker_main(argv, cases: dict | None = None) -> int:
    """One rank of a launch: ``cases`` (default: this module's) names the case functions."""
    case_name, rank, world_size, port, kwargs = argv[0], int(argv[1]), int(argv[2]), int(argv[3]), json.loads(argv[4])
    torch.set_num_threads(1)
    import datetime
    import faulthandler
    import signal

    import torch.distributed as dist

    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the launcher asks for stacks on a hang
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=PG_TIMEOUT_S),
    )
    try:
        (CASES if cases is None else cases)[case_name](rank, world_size, **kwargs)
        dist.barrier()  # nobody tears the store down while another rank still uses it
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        return 1
    finally:
        dist.destroy_process_group()
    return 0


# ---------------------------------------------------------------------------
# launcher (pytest process)
# ---------------------------------------------------------------------------


class WorkersFailed(AssertionError):
    pass


def run_ranks(
    case_name: str,
    world_size: int,
    log_dir,
    timeout: float = SPAWN_TIMEOUT_S,
    *,
    worker_script: str | None = None,
    worker_cases: dict | None = None,
    **kwargs,
) -> float:
    """Run ``case_name`` on ``world_size`` ranks; raise with every rank's output on failure.

    The ranks run ``worker_script`` (default: this file), whose case table is
    ``worker_cases`` (default: ``CASES``). Returns the wall time in seconds. A
    launch that lost the race for its TCP port (another process bound it
    between our probe and rank 0's store) is retried once on a new port; a
    hang sends every rank SIGUSR1 (faulthandler: all stacks into the logs)
    before the kill.
    """
    if case_name not in (CASES if worker_cases is None else worker_cases):
        raise KeyError(case_name)
    script = worker_script or os.path.abspath(__file__)
    try:
        return _run_ranks_once(case_name, world_size, log_dir, timeout, kwargs, script)
    except WorkersFailed as exc:
        if "Address already in use" not in str(exc) and "EADDRINUSE" not in str(exc):
            raise
    return _run_ranks_once(case_name, world_size, log_dir, timeout, kwargs, script)


def _run_ranks_once(case_name, world_size, log_dir, timeout, kwargs, script) -> float:
    import signal

    os.makedirs(log_dir, exist_ok=True)
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("MASTER_ADDR", None)
    env.pop("MASTER_PORT", None)
    port = free_port()
    args = json.dumps({k: os.fspath(v) if isinstance(v, os.PathLike) else v for k, v in kwargs.items()})
    procs, logs = [], []
    t0 = time.monotonic()
    timed_out = False
    try:
        for rank in range(world_size):
            log = open(os.path.join(log_dir, f"{case_name}-rank{rank}.log"), "w+b")
            logs.append(log)
            procs.append(
                subprocess.Popen(
                    [sys.executable, script, case_name, str(rank), str(world_size), str(port), args],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    env=env,
                    cwd=HERE,
                )
            )
        deadline = t0 + timeout
        first_failure_at = None
        while any(p.poll() is None for p in procs):
            now = time.monotonic()
            if any(p.returncode not in (None, 0) for p in procs):
                first_failure_at = first_failure_at or now
                if now - first_failure_at > FAILURE_GRACE_S:
                    break
            if now > deadline:
                timed_out = True
                break
            time.sleep(0.05)
    finally:
        if timed_out:  # every thread's stack into the logs before the kill
            for p in procs:
                if p.poll() is None:
                    p.send_signal(signal.SIGUSR1)
            time.sleep(1.0)
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    elapsed = time.monotonic() - t0
    codes = [p.returncode for p in procs]
    try:
        if timed_out or any(c != 0 for c in codes):
            outputs = []
            for rank in sorted(range(world_size), key=lambda r: codes[r] in (0, -9)):  # real failures first
                logs[rank].seek(0)
                text = logs[rank].read().decode("utf-8", "replace")
                outputs.append(f"----- rank {rank} (exit code {codes[rank]}) -----\n{text[-20000:]}")
            what = f"timed out after {timeout:.0f}s" if timed_out else f"failed (exit codes {codes})"
            raise WorkersFailed(f"{case_name} on {world_size} ranks {what}:\n" + "\n".join(outputs))
    finally:
        for log in logs:
            log.close()
    return elapsed


if __name__ == "__main__":
    CASES.main()
