"""Shared helpers for the dcp_datastates test suite."""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from dcp_datastates import DataStatesReader, DataStatesWriter

warnings.filterwarnings("ignore", message="torch.distributed is disabled")


# The helpers the tests and their child processes import (launchers, workers, servers).
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "support"))

# Markers (pyproject.toml): what a case needs -- ``s3`` (SeaweedFS, added here to every case that
# uses the server), ``dist`` (gloo process groups), ``subprocess`` (new interpreters), ``cuda`` --
# and ``slow``, the cases the fast tier leaves out: ``python -m pytest -q tests -m "not slow"``.
# ``long`` marks the long versions of the reliability cases, run only when selected (``-m long``).


@pytest.hookimpl(tryfirst=True)  # before -m deselects: the s3 marks must be in place
def pytest_collection_modifyitems(config, items):
    s3 = pytest.mark.s3
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if "s3_server" in item.fixturenames or params.get("durable_url") == "s3":
            item.add_marker(s3)
    if "long" in (config.getoption("markexpr", "") or ""):
        return
    skip = pytest.mark.skip(reason="long version: select it with -m long")
    for item in items:
        if "long" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _no_error_leaks_between_tests():
    """Every background save error must have been raised to the test that caused it:
    one left unraised would otherwise surface in (and fail) an unrelated later test."""
    from dcp_datastates.core.async_save.runtime import runtime

    yield
    leaked = runtime().errors.drain()
    assert not leaked, f"background save errors never raised: {leaked}"


def save(state, path, **writer_kwargs):
    writer = DataStatesWriter(path, **writer_kwargs)
    dcp.save(state, storage_writer=writer, no_dist=True)
    return writer


def load(state, path, **reader_kwargs):
    dcp.load(state, storage_reader=DataStatesReader(path, **reader_kwargs), no_dist=True)
    return state


def zeros_like_state(state):
    """A load target shaped like ``state``: its tensors zeroed, its dicts copied, every other
    value None (DCP's load replaces objects whatever the target holds)."""
    if isinstance(state, dict):
        return {k: zeros_like_state(v) for k, v in state.items()}
    if isinstance(state, torch.Tensor):
        return torch.zeros_like(state)
    return None


def unwrap(exc: BaseException) -> BaseException:
    """The error a rank raised, whether or not DCP wrapped it in a CheckpointException."""
    if isinstance(exc, CheckpointException):
        return next(iter(exc.failures.values()))[0]
    return exc


class RaisedInfo:
    """What raises_from_checkpoint caught: ``.value`` is the rank's own error."""

    value: BaseException | None = None


class _LoggedErrors(logging.Handler):
    """The errors the reader logged because DCP swallows them (torch before 2.13)."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.errors: list[BaseException] = []

    def emit(self, record: logging.LogRecord) -> None:
        if isinstance(getattr(record, "error", None), BaseException):
            self.errors.append(record.error)


@contextlib.contextmanager
def raises_from_checkpoint(expected, match=None):
    """Like pytest.raises, for errors DCP may wrap in CheckpointException (a BaseException).

    On a torch whose ``dcp.load`` replaces the reader's metadata error by
    ``AssertionError("metadata is None")`` (before 2.13), the error checked is
    the one the reader logged for that reason.
    """
    from dcp_datastates import _dcp_compat

    info = RaisedInfo()
    logged = _LoggedErrors()
    logger = logging.getLogger("dcp_datastates")
    logger.addHandler(logged)
    try:
        yield info
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - we re-check the type below
        inner = unwrap(exc)
        swallowed = isinstance(inner, AssertionError) and str(inner) == "metadata is None"
        if swallowed and logged.errors and not _dcp_compat.dcp_load_reports_read_metadata_errors():
            inner = logged.errors[-1]
        info.value = inner
        if not isinstance(inner, expected):
            raise AssertionError(f"expected {expected}, got {type(inner).__name__}: {inner}") from exc
        if match is not None and match not in str(inner):
            raise AssertionError(f"{match!r} not in error message: {inner}") from exc
        return
    finally:
        logger.removeHandler(logged)
    raise AssertionError(f"expected {expected} to be raised")


def data_files(path):
    return sorted(f for f in os.listdir(path) if f.endswith(".data"))


def index_files(path):
    return sorted(f for f in os.listdir(path) if f.endswith(".index"))


@contextlib.contextmanager
def mounted_tmpfs(mnt, options: str):
    """Mount a tmpfs with ``options`` (say ``size=2m``) on the new directory ``mnt`` for the
    block (root only; the test is skipped where mounting is not allowed); unmounted after."""
    mnt.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a size-limited tmpfs needs root")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(mnt)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount tmpfs here: {r.stderr.decode().strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 2 MiB tmpfs mounted for the test (root only); yields its path."""
    with mounted_tmpfs(tmp_path / "tmpfs", "size=2m") as mnt:
        yield mnt


def assert_same(a, b, path="state"):
    """Bit-exact comparison of nested state dicts (tensors by bytes, dtype and shape)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), f"{path}: {type(b)}"
        assert a.dtype == b.dtype and a.shape == b.shape, f"{path}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
        # Compare raw bytes: NaN payloads, -0.0 and every dtype (bool, float8, complex) exactly.
        assert torch.equal(_bytes_of(a), _bytes_of(b)), f"{path}: bytes differ"
    elif isinstance(a, dict):
        assert set(a) == set(b), f"{path}: keys {set(a) ^ set(b)}"
        for k in a:
            assert_same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]")
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().reshape(-1).contiguous().view(torch.uint8)


# ---------------------------------------------------------------------------
# real checkpoints for the command-line tests (made once per session)
# ---------------------------------------------------------------------------


@pytest.fixture(scope="session")
def sharded_checkpoint(tmp_path_factory):
    """A 2-rank DTensor checkpoint (ours): ``cli_checkpoints.SavedCheckpoint``."""
    import cli_checkpoints

    return cli_checkpoints.make_sharded(str(tmp_path_factory.mktemp("cli_sharded")))


@pytest.fixture(scope="session")
def dtype_checkpoints(tmp_path_factory):
    """(ours, stock DCP) checkpoints of a state with every dtype: two ``SavedCheckpoint``."""
    import cli_checkpoints

    return cli_checkpoints.make_dtypes(str(tmp_path_factory.mktemp("cli_dtypes")))


@pytest.fixture(scope="session")
def run_checkpoints(tmp_path_factory):
    """Three checkpoints (steps 10, 20, 30) of one training run: ``cli_checkpoints.SavedRun``."""
    import cli_checkpoints

    return cli_checkpoints.make_run(str(tmp_path_factory.mktemp("cli_run")))


# -- durable tiers: a real S3 server and a second filesystem ---------------------------


@pytest.fixture(scope="session")
def s3_server():
    """SeaweedFS on the loopback for the session (tests/support/s3_server.py), with the client's
    endpoint and dummy credentials in the environment; stopped at the end."""
    pytest.importorskip("obstore", reason="the s3 extra (obstore) is not installed")
    from s3_server import WeedServer, running

    with running(WeedServer()) as server:
        yield server


@pytest.fixture(scope="session")
def shared_mount(tmp_path_factory):
    """A second filesystem standing in for shared storage: a tmpfs mounted for the session."""
    with mounted_tmpfs(tmp_path_factory.mktemp("shared") / "mnt", "size=1g") as mnt:
        yield str(mnt)


_tier_counter = iter(range(1_000_000))


@pytest.fixture(params=["posix", "s3"])
def durable_url(request):
    """A fresh durable destination: a directory on the shared mount, or a prefix in the S3 bucket."""
    return new_durable_url(request, request.param)


class FailingReads:
    """A durable store whose reads fail where ``fails(key, offset)`` says, as a server that
    stopped answering would (a :class:`StoreError` naming the object's URL and ``why``);
    everything else is forwarded."""

    def __init__(self, store, fails, why: str = "connection reset"):
        self._store, self._fails, self._why = store, fails, why

    def __getattr__(self, name):
        return getattr(self._store, name)

    def _check(self, key: str, offset: int) -> None:
        if self._fails(key, offset):
            from dcp_datastates.storage import StoreError

            raise StoreError(f"{self._store.where(key)}: {self._why}")

    def read_range(self, key, offset, length):
        self._check(key, offset)
        return self._store.read_range(key, offset, length)

    def read_into(self, key, offset, out):
        self._check(key, offset)
        return self._store.read_into(key, offset, out)

    def read_batch(self, reads, threads=None):  # the ranged reads, through the failing ones
        from dcp_datastates.storage.store import Store

        return Store.read_batch(self, reads, threads=threads)


def new_durable_url(request, kind: str) -> str:
    """A fresh durable destination of ``kind`` ("posix" or "s3"), for tests that pick their own."""
    n = next(_tier_counter)
    if kind == "posix":
        return os.path.join(request.getfixturevalue("shared_mount"), f"t{n}")
    return f"s3://{request.getfixturevalue('s3_server').bucket}/t{n}"


def assert_resumes(mgr, expected: int, step=None, values_of=None) -> None:
    """``mgr.load`` (of ``step``, or a resume) loads step ``expected``, holding bit-exactly the
    state ``manager_workers.state_at(values_of or expected)`` saved."""
    from manager_workers import load_step, state_at

    got, target = load_step(mgr, step)
    assert got == expected
    assert_same(target, state_at(expected if values_of is None else values_of))
