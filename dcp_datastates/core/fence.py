"""The fence: wait for in-flight snapshots before state is mutated in place.

An asynchronous save copies tensors while training runs forward and
backward, which do not modify parameters or optimizer state. The optimizer
step does. ``install_fence(optimizer)`` registers a step pre-hook that waits
only while a snapshot in this process is still copying, so a training loop
needs one line and no bookkeeping::

    dcp_datastates.install_fence(optimizer)
    ...
    dcp.async_save(state, storage_writer=DataStatesWriter(path))
    loss = model(batch).sum(); loss.backward()   # copies overlap these
    optimizer.step()                              # waits here if still copying

Modules whose forward mutates saved buffers (BatchNorm running statistics)
need the fence before forward: ``install_fence(model)`` registers a forward
pre-hook instead.
"""

from __future__ import annotations

import os
import threading
from concurrent import futures
from concurrent.futures import Future

import torch

_lock = threading.Lock()
_in_flight: set[Future] = set()


def _forget_parent_snapshots() -> None:
    """In a fork child: the parent's snapshots complete in the parent only; waiting
    for them here would wait forever. Their lock may have been held at the fork."""
    global _lock, _in_flight
    _lock = threading.Lock()
    _in_flight = set()


os.register_at_fork(after_in_child=_forget_parent_snapshots)


def track(future: Future) -> None:
    """Count ``future`` (a snapshot's staging future) as in flight until it completes."""
    with _lock:
        _in_flight.add(future)
    future.add_done_callback(_forget)


def _forget(future: Future) -> None:
    with _lock:
        _in_flight.discard(future)


def snapshots_in_flight() -> int:
    with _lock:
        return len(_in_flight)


def wait_for_snapshots(timeout: float | None = None) -> None:
    """Block until every snapshot started so far has left the saved tensors.

    Returns at once when none is in flight. A snapshot that failed counts as
    done: its error is reported through the save's future.
    """
    with _lock:
        pending = list(_in_flight)
    # futures.wait, not result(): a staging future's result() is how the writer
    # recognizes the thread that runs its save (see snapshot.StagingFuture).
    futures.wait(pending, timeout)


def install_fence(target, timeout: float | None = None):
    """Make ``target`` wait for in-flight snapshots before it mutates state.

    ``target`` is a ``torch.optim.Optimizer`` (a step pre-hook) or an
    ``nn.Module`` (a forward pre-hook). Returns the hook handle; call
    ``.remove()`` on it to uninstall.
    """
    if isinstance(target, torch.optim.Optimizer):
        return target.register_step_pre_hook(lambda _opt, _args, _kwargs: wait_for_snapshots(timeout))
    if isinstance(target, torch.nn.Module):
        return target.register_forward_pre_hook(lambda _mod, _args: wait_for_snapshots(timeout))
    raise TypeError(f"install_fence expects a torch.optim.Optimizer or nn.Module, got {type(target).__name__}")


_global_hook = None


def install_global_fence(timeout: float | None = None):
    """Make every optimizer's ``step()`` in this process wait for in-flight snapshots.

    A process-wide step pre-hook (``torch.optim.optimizer.register_optimizer_step_pre_hook``),
    installed once however often this is called; ``CheckpointManager`` uses it so
    that saving needs no handle on the optimizer. It costs one lock and a set
    lookup per step when nothing is in flight. Returns the hook handle.
    """
    global _global_hook
    with _lock:
        if _global_hook is None:
            from torch.optim.optimizer import register_optimizer_step_pre_hook

            _global_hook = register_optimizer_step_pre_hook(lambda _opt, _args, _kwargs: wait_for_snapshots(timeout))
        return _global_hook
