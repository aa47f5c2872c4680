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

import time

import torch

from dcp_datastates.core.async_save.runtime import runtime


def snapshots_in_flight() -> int:
    """How many snapshots of this process are still copying out of the saved tensors."""
    return len(runtime().staging_in_flight())


def wait_for_snapshots(timeout: float | None = None) -> None:
    """Block until every snapshot started so far has left the saved tensors.

    Returns at once when none is in flight. A snapshot that failed counts as
    done: its error is reported through the save's future.
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    for snap in runtime().staging_in_flight():
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        if not snap.staged.wait(left):
            return


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


class GlobalFenceHandle:
    """One holder's share of the process-wide fence (what :func:`install_global_fence` returns).

    ``remove()`` gives the share up (again is a no-op); the hook itself is
    uninstalled when the last share is removed, so two managers open at once
    share one hook and closing one does not unfence the other.
    """

    def __init__(self) -> None:
        self._held = True

    def remove(self) -> None:
        rt = runtime()
        with rt.fence_lock:
            if not self._held:
                return
            self._held = False
            rt.fence_holders -= 1
            if rt.fence_holders == 0:
                rt.fence_hook.remove()
                rt.fence_hook = None

    def __enter__(self) -> GlobalFenceHandle:
        return self

    def __exit__(self, *exc) -> None:
        self.remove()


def install_global_fence(timeout: float | None = None) -> GlobalFenceHandle:
    """Make every optimizer's ``step()`` in this process wait for in-flight snapshots.

    A process-wide step pre-hook (``torch.optim.optimizer.register_optimizer_step_pre_hook``),
    installed once however often this is called (the first call's ``timeout``
    holds); ``CheckpointManager`` uses it so that saving needs no handle on the
    optimizer. It costs one lock and a set lookup per step when nothing is in
    flight. Returns this caller's :class:`GlobalFenceHandle`: the hook stays
    until every handle returned has been removed.
    """
    rt = runtime()
    with rt.fence_lock:
        if rt.fence_hook is None:
            from torch.optim.optimizer import register_optimizer_step_pre_hook

            rt.fence_hook = register_optimizer_step_pre_hook(lambda _opt, _args, _kwargs: wait_for_snapshots(timeout))
        rt.fence_holders += 1  # counted before the handle exists: a collection meanwhile cannot reach zero
        return GlobalFenceHandle()
