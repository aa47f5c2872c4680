"""Simulated nodes on one machine: one ``torchrun --nnodes=K --node-rank=i`` launcher per node on
127.0.0.1 (gloo), each node with its own root (``$NODE_ROOT``). Used by tests/test_nodes.py and
benchmarks/bench_nodes.py.

torchrun starts every rank in a session of its own, so killing a launcher's process group does
not reach them: each rank registers its pid (:func:`register_rank`) in ``$NODE_PIDS``, and the
launcher kills every registered rank before it returns, whatever happened.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

KILLED = "KILLING"  # what a rank that is about to kill its node writes to $NODE_PIDS/events


def say(line: str) -> None:
    """A rank's report line, written to stdout in one ``write`` so that the lines of the ranks a
    launcher's pipe shares never interleave (``print`` may write the text and its newline apart)."""
    data = (line + "\n").encode()
    while data:
        data = data[os.write(1, data):]


class LineHandler(logging.Handler):
    """Log records as whole report lines (:func:`say`)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            say(self.format(record))
        except Exception:  # noqa: BLE001 - logging's own rule: a record that cannot be written is reported, not raised
            self.handleError(record)


def register_rank() -> None:
    """A rank: make this process killable by the launcher (when ``$NODE_PIDS`` is set)."""
    if os.environ.get("NODE_PIDS"):
        open(os.path.join(os.environ["NODE_PIDS"], str(os.getpid())), "w").close()


def say_killing(rank: int) -> None:
    """A rank about to SIGKILL itself: the launcher then stops every other rank, as a scheduler would."""
    with open(os.path.join(os.environ["NODE_PIDS"], "events"), "a") as f:
        f.write(f"{KILLED} rank {rank}\n")


def launch_nodes(roots: list[str], nproc: int | list[int], argv: list[str], *, env: dict | None = None,
                 timeout: float = 180, until_killed: bool = False,
                 grace_s: float = 1.0) -> tuple[float, list[int], list[str]]:
    """Run ``python ARGV`` on ``nproc`` ranks per node (or ``nproc[i]`` on node ``i``), one node
    per root; return the wall time, each launcher's exit status and output. ``until_killed``: a
    rank kills its node (:func:`say_killing`); ``grace_s`` later every other rank is killed too."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    pids = tempfile.mkdtemp(prefix="node-pids-")
    procs = []
    t0 = time.perf_counter()
    try:
        for i, root in enumerate(roots):
            cmd = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={len(roots)}", f"--node-rank={i}",
                   f"--nproc-per-node={nproc[i] if isinstance(nproc, list) else nproc}", "--master-addr=127.0.0.1", f"--master-port={port}", *argv]
            e = dict(os.environ, NODE_ROOT=root, NNODES=str(len(roots)), NODE_PIDS=pids, OMP_NUM_THREADS="1",
                     **(env or {}))
            procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=e,
                                          start_new_session=True))
        if until_killed:
            deadline = time.monotonic() + timeout
            while not any(line.startswith(KILLED) for line in _events(pids)) and time.monotonic() < deadline:
                time.sleep(0.2)
            time.sleep(grace_s)  # the other nodes go on a while (their copies to the dead node fail)
            _kill_ranks(pids)
            outs = [p.communicate(timeout=60)[0] for p in procs]
        else:
            outs = [p.communicate(timeout=timeout)[0] for p in procs]
        wall = time.perf_counter() - t0
    finally:
        _kill_ranks(pids)
        shutil.rmtree(pids, ignore_errors=True)
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)  # the launcher, should it still run
            p.wait()
    return wall, [p.returncode for p in procs], outs


def wipe(root: str) -> None:
    """Empty a node's root, as a replaced node's disk is."""
    for name in os.listdir(root):
        path = os.path.join(root, name)
        shutil.rmtree(path) if os.path.isdir(path) and not os.path.islink(path) else os.unlink(path)


def _events(pids: str) -> list[str]:
    path = os.path.join(pids, "events")
    return open(path).read().splitlines() if os.path.exists(path) else []


def _kill_ranks(pids: str) -> None:
    for name in os.listdir(pids):
        if name.isdigit():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(name), signal.SIGKILL)
