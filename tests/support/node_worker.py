"""One rank of a simulated multi-node run (tests/test_nodes.py): every node is its own torchrun
launcher on 127.0.0.1 with its own local root (``$NODE_ROOT``, a tmpfs the test mounts).

``python node_worker.py PHASE STEPS [OPTIONS_JSON]``:

* ``save``: save the state of each step of ``STEPS`` (comma-separated) under a node-local
  manager, wait for every copy (partner, durable), close;
* ``save-kill``: the same, but the ranks of the last node kill themselves (SIGKILL) right after
  the last save returned, its copies still running; ``save-kill-mid``: while the last save runs;
* ``save-kill-copy``: the same, the last node's ranks dying while the last step's partner
  copies run; the other ranks go on training a little and say whether the copy failed;
* ``resume``: resume into a zeroed state, check it bit for bit against the state of the step it
  reports (``RESUMED <step>``), save ``STEPS`` after it, close.

The state of step ``s`` is a function of ``s`` alone: a DTensor sharded over every rank, one
replicated tensor (which DCP saves on one rank only: a node reads it from another's root),
and a Python object.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import time
import warnings

warnings.filterwarnings("ignore")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor import Shard, distribute_tensor  # noqa: E402

import dcp_datastates  # noqa: E402
from node_launch import LineHandler, register_rank, say, say_killing  # noqa: E402


def full_state(step: int) -> dict:
    g = torch.Generator().manual_seed(1000 + step)
    return {
        "w": torch.randn(64, 1024, generator=g),  # 256 KiB, sharded by rows
        "bias": torch.randn(300, generator=g),  # replicated
        "extra": {"step": step, "name": f"step-{step}"},
    }


def local_state(step: int, mesh, zero: bool = False) -> dict:
    full = full_state(step)
    w = torch.zeros_like(full["w"]) if zero else full["w"]
    return {
        "w": distribute_tensor(w, mesh, [Shard(0)]),
        "bias": torch.zeros_like(full["bias"]) if zero else full["bias"].clone(),
        "extra": {"step": -1, "name": ""} if zero else dict(full["extra"]),
    }


def check(state: dict, step: int) -> None:
    full = full_state(step)
    assert torch.equal(state["w"].full_tensor(), full["w"]), "w differs"
    assert torch.equal(state["bias"], full["bias"]), "bias differs"
    assert state["extra"] == full["extra"], state["extra"]


def die() -> None:
    say_killing(dist.get_rank())
    os.kill(os.getpid(), signal.SIGKILL)


def watch_sockets() -> None:
    """Say every socket this process's Python code binds, listens on or connects (the package
    opens none: bytes between nodes go over torch.distributed, whose C++ sockets are not Python's)."""

    def hook(event, args):
        if event in ("socket.bind", "socket.connect", "socket.listen"):
            say(f"SOCKET {event} {args[1:]!r}")

    sys.addaudithook(hook)


def go_on_training(mgr) -> None:
    """The last node's ranks die while this step's partner copies run; the others train on
    (local steps: a real job's collectives would fail with them), learn that the copy failed,
    and wait for the launcher to stop them."""
    last = int(os.environ["NNODES"]) - 1
    if int(os.environ["GROUP_RANK"]) == last:
        time.sleep(0.05)
        die()
    a = torch.randn(256, 256)
    for _ in range(20):
        a = torch.tanh(a @ a / 256)
    say(f"TRAINED ON rank {dist.get_rank()}")
    try:
        mgr.wait_durable()
        say("COPY DONE")
    except Exception as exc:  # noqa: BLE001 - what the test checks
        say(f"COPY FAILED {type(exc).__name__}: {exc}")
    time.sleep(600)  # the job is gone with its node: the scheduler (the launcher) stops this rank


def main() -> None:
    phase, steps = sys.argv[1], [int(s) for s in sys.argv[2].split(",") if s]
    settings = json.loads(sys.argv[3]) if len(sys.argv) > 3 else {}
    watch_sockets()
    handler = LineHandler()
    handler.setFormatter(logging.Formatter("LOG %(name)s %(message)s"))
    logging.basicConfig(handlers=[handler])
    logging.getLogger("dcp_datastates").setLevel(logging.INFO)
    register_rank()
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    options = dcp_datastates.CheckpointManagerOptions(
        node_local=True, incremental=False, **settings)
    mgr = dcp_datastates.CheckpointManager(os.environ["NODE_ROOT"], options)
    node = int(os.environ["GROUP_RANK"])
    if phase == "resume":
        state = local_state(0, mesh, zero=True)
        got = mgr.load(state)
        if got is not None:
            check(state, got)
        say(f"RESUMED {got}")
    dying = phase.startswith("save-kill") and node == int(os.environ["NNODES"]) - 1
    for s in steps:
        last = s == steps[-1]
        if dying and last and phase == "save-kill-mid":
            threading.Timer(0.02, die).start()
        mgr.save(s, local_state(s, mesh)).result()
        if dying and last:
            die()
        if phase == "save-kill-copy" and last:
            go_on_training(mgr)
            return
        mgr.wait_durable()
    mgr.close()
    say(f"DONE node {node} rank {dist.get_rank()}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # Leave without finalizing the interpreter, as dist_helpers' workers do: at finalization a gloo
    # thread can still be freeing a finished collective whose tensors need the GIL, and the rank
    # then aborts ("terminate called without an active exception") after it passed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
