"""The process group the exchange moves bytes on: one of its own, never training's or a save's.

A :class:`Channel` is a group made for the exchange alone (``dist.new_group``, a collective
of every rank of the job), with the settings every transfer on it uses: the backend (gloo,
or NCCL where GPUs carry the fabric), the timeout after which a peer that does not answer
fails the transfer, the size of a message and how many are in flight per rank. A channel on
which a transfer failed is *broken*: what was in flight is unknown, so it refuses further
transfers (naming the first failure) instead of pairing sends with the wrong receives.
"""

from __future__ import annotations

import datetime
import threading
from collections.abc import Sequence

import torch.distributed as dist

from dcp_datastates.errors import CheckpointError

DEFAULT_TIMEOUT_S = 300.0  # a peer silent this long fails the transfer
DEFAULT_CHUNK_BYTES = 8 << 20  # bytes of one message
DEFAULT_WINDOW = 4  # messages a rank has in flight at once
BACKENDS = ("gloo", "nccl")


class ExchangeError(CheckpointError):
    """Bytes could not be moved between ranks: a peer died, did not answer within the
    exchange's timeout, or the channel failed earlier. Nothing received was published."""


def check_settings(backend: str, timeout_s: float, what: str = "exchange") -> None:
    """The exchange's options, checked before any group is made (ValueError naming them)."""
    if backend not in BACKENDS:
        raise ValueError(f"{what}_backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
        raise ValueError(f"{what}_timeout_s must be a positive number of seconds, got {timeout_s!r}")


class Channel:
    """A process group of the exchange's own and how transfers run on it."""

    def __init__(self, group, *, backend: str = "gloo", timeout_s: float = DEFAULT_TIMEOUT_S,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES, window: int = DEFAULT_WINDOW,
                 nodes: Sequence[int] | None = None) -> None:
        if chunk_bytes < 1 or window < 1:
            raise ValueError(f"an exchange needs chunk_bytes and window >= 1, got {chunk_bytes}, {window}")
        self.group = group
        self.backend = backend
        self.timeout_s = float(timeout_s)
        self.chunk_bytes = int(chunk_bytes)
        self.window = int(window)
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.ranks = tuple(dist.get_global_rank(group, r) for r in range(self.world))  # global rank of each
        self.nodes = tuple(nodes) if nodes is not None else None  # node of each group rank (None: unknown)
        self._broken: str | None = None
        self._lock = threading.Lock()

    @classmethod
    def create(cls, *, backend: str = "gloo", timeout_s: float = DEFAULT_TIMEOUT_S, desc: str = "exchange",
               **settings) -> Channel:
        """A new group over every rank of the job: every rank must call this, in the same order
        as its other groups (as ``dist.new_group``)."""
        check_settings(backend, timeout_s)
        group = dist.new_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s),
                               group_desc=f"dcp_datastates {desc}")
        return cls(group, backend=backend, timeout_s=timeout_s, **settings)

    def with_nodes(self, nodes: Sequence[int]) -> Channel:
        """This channel, knowing the node of each rank (routes cross each node boundary once)."""
        self.nodes = tuple(nodes)
        return self

    def check(self) -> None:
        """Refuse to start a transfer on a channel that failed before."""
        with self._lock:
            if self._broken is not None:
                raise ExchangeError(f"the exchange failed earlier ({self._broken}); it is not used again in this process")

    def fail(self, why: str) -> None:
        """Mark the channel broken (the first reason stays)."""
        with self._lock:
            if self._broken is None:
                self._broken = why

    @property
    def broken(self) -> str | None:
        return self._broken

    def gather(self, value) -> list:
        """Every rank's ``value``, by group rank (small objects: plans' inputs, verdicts)."""
        self.check()
        out = [None] * self.world
        try:
            dist.all_gather_object(out, value, group=self.group)
        except Exception as exc:  # noqa: BLE001 - a peer gone or silent: the channel is unusable
            why = f"gathering from every rank failed: {type(exc).__name__}: {exc}"
            self.fail(why)
            raise ExchangeError(why) from exc
        return out

    def global_rank(self, rank: int) -> int:
        return self.ranks[rank]
