"""Carrying out a rank's part of a plan: its sends and receives, a few in flight at a time.

:func:`run_ops` posts a rank's operations (:func:`plan.ops_of`) in the plan's total order,
at most ``window`` outstanding, and completes them oldest first; a send that forwards what
this rank received waits for that receive first. Every rank doing so cannot deadlock (the
earliest unfinished operation of the whole plan is posted by both its ranks) and holds at
most ``window`` messages of memory. An :class:`Endpoint` says where each message's bytes
come from and go to: straight from or into their place when a message is one range, or a
buffer of the message's size the endpoint fills or empties.

Two transports carry a message: gloo sends host memory as it is; NCCL sends device memory,
so each message goes through one of ``window`` device buffers of a message's size (staged
there before a send, copied out after a receive).
"""

from __future__ import annotations

import collections
import datetime

import torch
import torch.distributed as dist

from dcp_datastates.exchange import faults
from dcp_datastates.exchange.channel import Channel, ExchangeError
from dcp_datastates.exchange.plan import Op


class Endpoint:
    """Where a rank's messages come from and go to (see the module docstring)."""

    def send_bytes(self, op: Op) -> torch.Tensor:
        """The bytes to send (a uint8 CPU tensor of the message's size, valid until ``sent``)."""
        raise NotImplementedError

    def recv_bytes(self, op: Op) -> torch.Tensor:
        """Where to receive the message (a uint8 CPU tensor of its size)."""
        raise NotImplementedError

    def received(self, op: Op, data: torch.Tensor) -> None:
        """The message arrived in ``data``."""

    def sent(self, op: Op) -> None:
        """The message left; its bytes may be reused."""


class BufferPool:
    """Message buffers used again and again: a fresh buffer of a message's size would cost its
    page faults at every message (more than the transfer itself on the loopback)."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self._free: list[torch.Tensor] = []
        self._out: dict[int, torch.Tensor] = {}  # what each op holds, by op

    def take(self, op: Op, n: int) -> torch.Tensor:
        buf = self._free.pop() if self._free else torch.empty(self.nbytes, dtype=torch.uint8)
        self._out[id(op)] = buf
        return buf[:n]

    def held(self, op: Op, n: int) -> torch.Tensor:
        """The buffer ``op`` took (still held)."""
        return self._out[id(op)][:n]

    def give(self, op: Op) -> None:
        buf = self._out.pop(id(op), None)
        if buf is not None:
            self._free.append(buf)


def run_ops(channel: Channel, ops: list[Op], endpoint: Endpoint) -> None:
    """Carry out ``ops`` on ``channel`` (module docstring); a failure of the group (a peer
    gone, the timeout) is an :class:`ExchangeError` naming the peer, and breaks the channel."""
    if not ops:
        return
    channel.check()
    transport = _transport(channel)
    outstanding: collections.deque = collections.deque()
    done = [False] * len(ops)

    def complete_oldest() -> None:
        i, handle, data = outstanding.popleft()
        op = ops[i]
        try:
            transport.wait(handle)
        except Exception as exc:  # noqa: BLE001 - the group's failure: the channel is unusable
            raise _failed(channel, op, exc) from exc
        done[i] = True
        if op.send:
            endpoint.sent(op)
        else:
            endpoint.received(op, data)

    try:
        for i, op in enumerate(ops):
            if op.after is not None:
                while not done[op.after]:
                    complete_oldest()
            while len(outstanding) >= channel.window:
                complete_oldest()
            data = endpoint.send_bytes(op) if op.send else endpoint.recv_bytes(op)
            if data.numel() != op.message.nbytes:
                raise AssertionError(f"message {op.message.index}: {data.numel()} bytes, the plan has {op.message.nbytes}")
            try:
                handle = transport.post(op, data)
            except Exception as exc:  # noqa: BLE001
                raise _failed(channel, op, exc) from exc
            outstanding.append((i, handle, data))
        while outstanding:
            complete_oldest()
    except ExchangeError:
        raise
    except BaseException as exc:
        # The endpoint failed (a bug, or an interrupt): the peers' operations are left
        # unmatched, so the channel cannot be used again.
        channel.fail(f"a transfer stopped half-way: {type(exc).__name__}: {exc}")
        raise


def _failed(channel: Channel, op: Op, exc: BaseException) -> ExchangeError:
    what = f"{'sending to' if op.send else 'receiving from'} rank {channel.global_rank(op.peer)}"
    why = f"{what} failed ({type(exc).__name__}: {exc})"
    channel.fail(why)
    return ExchangeError(f"the exchange of checkpoint bytes between ranks: {why}; the peer died or did not "
                         f"answer within {channel.timeout_s:.0f} s (exchange_timeout_s)")


def _transport(channel: Channel):
    return _DeviceStaged(channel) if channel.backend == "nccl" else _Host(channel)


class _Host:
    """gloo: the message's host memory is sent and received as it is."""

    def __init__(self, channel: Channel) -> None:
        self.channel = channel
        self.timeout = datetime.timedelta(seconds=channel.timeout_s)

    def post(self, op: Op, data: torch.Tensor):
        peer = self.channel.global_rank(op.peer)
        if op.send:
            return dist.isend(faults.outgoing(data), dst=peer, group=self.channel.group)
        return dist.irecv(data, src=peer, group=self.channel.group)

    def wait(self, work) -> None:
        work.wait(self.timeout)


class _DeviceStaged:
    """NCCL: every message through one of ``window`` device buffers of a message's size."""

    def __init__(self, channel: Channel) -> None:
        self.channel = channel
        device = torch.device("cuda", torch.cuda.current_device())
        self.free = [torch.empty(channel.chunk_bytes, dtype=torch.uint8, device=device) for _ in range(channel.window)]

    def post(self, op: Op, data: torch.Tensor):
        stage = self.free.pop()[: data.numel()]
        peer = self.channel.global_rank(op.peer)
        if op.send:
            stage.copy_(faults.outgoing(data))
            work = dist.isend(stage, dst=peer, group=self.channel.group)
        else:
            work = dist.irecv(stage, src=peer, group=self.channel.group)
        return work, stage, None if op.send else data

    def wait(self, handle) -> None:
        work, stage, into = handle
        work.wait()
        if into is not None:
            into.copy_(stage)  # synchronous: the bytes are on the host when this returns
        self.free.append(stage._base if stage._base is not None else stage)
