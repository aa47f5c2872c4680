"""The engine's CUDA path, tested without a GPU against a stand-in CUDA runtime.

The engine resolves the CUDA runtime by path at run time, so the tests give it
tests/cuda_standin/cudart_standin.cpp, built here with the system compiler:
copies are memcpy, streams are ordered queues run by threads, events complete
after an injectable delay, host registrations are recorded and any call can be
made to fail. That exercises event ordering, per-device streams, pool pinning
and every CUDA error path on every CI run. It does not replace running on a
GPU (test_async.py's CUDA case); it keeps the CUDA logic from rotting between
GPU runs.

A process loads one CUDA runtime for good, so each case runs in a fresh
interpreter (tests/cuda_standin/cases.py); this process never loads one.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from dcp_datastates import _engine

pytestmark = pytest.mark.subprocess

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cuda_standin")
CASE_TIMEOUT_S = 120  # a hang fails the case instead of the whole run


@pytest.fixture(scope="session")
def standin(tmp_path_factory) -> str:
    """The stand-in runtime, built once per session (skipped without a C++ compiler)."""
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if not cxx:
        pytest.skip("no C++ compiler (c++, g++, clang++ or $CXX) to build the stand-in CUDA runtime")
    out = tmp_path_factory.mktemp("cudart") / "libcudart_standin.so"
    cmd = [cxx, "-std=c++17", "-O1", "-Wall", "-shared", "-fPIC", "-pthread",
           os.path.join(HERE, "cudart_standin.cpp"), "-o", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        pytest.fail(f"building the stand-in CUDA runtime failed ({' '.join(cmd)}):\n{proc.stderr}")
    return str(out)


def run_case(name: str, standin: str, tmp_path, *args: str) -> None:
    cmd = [sys.executable, os.path.join(HERE, "cases.py"), name, _engine.__file__, standin, str(tmp_path), *args]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=CASE_TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"case {name} {' '.join(args)} hung (no end after {CASE_TIMEOUT_S} s): {exc.stderr}")
    assert proc.returncode == 0 and proc.stdout.strip().endswith("OK"), (
        f"case {name} {' '.join(args)} exited {proc.returncode}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"
    )


def test_copy_waits_for_the_event_recorded_after_the_producer(standin, tmp_path):
    run_case("event_ordering", standin, tmp_path)


def test_device_windows_are_staged_when_copied_not_when_written(standin, tmp_path):
    run_case("staged_ahead_of_slow_writes", standin, tmp_path)


def test_a_reused_event_handle_is_waited_for_again(standin, tmp_path):
    run_case("event_handle_reuse", standin, tmp_path)


def test_each_device_gets_its_own_stream(standin, tmp_path):
    run_case("per_device_streams", standin, tmp_path)


def test_the_hashing_stream_is_a_new_non_blocking_stream_on_the_current_device(standin, tmp_path):
    run_case("hashing_stream", standin, tmp_path)


def test_pool_is_pinned_once_and_unregistered_with_the_engine(standin, tmp_path):
    run_case("pool_pinning", standin, tmp_path)


def test_refused_pinning_leaves_copies_working(standin, tmp_path):
    run_case("host_register_fails", standin, tmp_path)


@pytest.mark.parametrize(
    "call",
    [
        "cudaSetDevice",
        "cudaStreamCreateWithFlags",
        "cudaStreamWaitEvent",
        "cudaMemcpyAsync",
        "cudaEventCreateWithFlags",
        "cudaEventRecord",
        "cudaEventSynchronize",
        "cudaEventDestroy",
    ],
)
def test_a_failing_cuda_call_fails_the_job_naming_call_and_file(standin, tmp_path, call):
    run_case("error", standin, tmp_path, call)


def test_without_a_runtime_device_regions_fail_cleanly(standin, tmp_path):
    run_case("no_runtime", standin, tmp_path)


def test_a_streamed_job_copies_after_the_event_and_fails_cleanly(standin, tmp_path):
    run_case("streamed_device", standin, tmp_path)
