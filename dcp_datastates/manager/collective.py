"""How the ranks of a manager agree: rank 0 decides and tells every rank; verdicts are combined.

Every decision about the root (what to list, which base to save against, what the durable tier
holds) is taken on rank 0 and broadcast, and every rank's verdict on a checkpoint is gathered,
so that all ranks try the same checkpoints in the same order and an error is raised on every
rank, never on rank 0 alone while the others wait in a collective.
"""

from __future__ import annotations

import dataclasses
import errno
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from dcp_datastates.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    UnsafeCheckpointError,
    UnsupportedFormatError,
)

# Resume skips a checkpoint for these, and a new save may replace it: its files are bad.
_BAD_FILES = (CorruptCheckpointError, IncompleteCheckpointError)
# Resume skips a checkpoint for these too, but leaves it alone: it may be fine (it vanished
# while we looked, it is another format, the disk failed to read it this time).
_UNREADABLE = (CheckpointNotFoundError, UnsupportedFormatError)
_READ_ERRNOS = {errno.EIO, errno.ENOENT, errno.ESTALE, errno.ENODATA}
# Anything else (a state dict that does not match, unsafe objects, EACCES, EMFILE, a durable
# store that does not answer: StoreError, after the client's own retries) is raised: falling
# back to an older checkpoint would hide it (and a save after it would make the newer step
# look abandoned).

Verdict = Any  # None (loads), (why, the files are bad), or a Raise


@dataclasses.dataclass(frozen=True)
class Raise:
    """A verdict that is not about the checkpoint's files: every rank raises it. A class, not a
    sentinel object: verdicts travel between ranks pickled, and a sentinel would not survive."""

    text: str
    unsafe: bool = False  # raised as UnsafeCheckpointError (what ``except UnsafeCheckpointError`` expects)

    def error(self, prefix: str = "") -> CheckpointError:
        return (UnsafeCheckpointError if self.unsafe else CheckpointError)(prefix + self.text)


def classify(exc: BaseException) -> Verdict:
    """(why, the files are bad) for errors that make resume skip a checkpoint; a :class:`Raise` otherwise."""
    if isinstance(exc, UnsafeCheckpointError):
        return Raise(describe(exc), unsafe=True)
    if isinstance(exc, _BAD_FILES):
        return describe(exc), True
    if isinstance(exc, _UNREADABLE) or (isinstance(exc, OSError) and exc.errno in _READ_ERRNOS):
        return describe(exc), False
    return Raise(f"{type(exc).__name__}: {describe(exc)}")


def describe(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return " ".join(text.split())


def unwrap(exc: BaseException) -> BaseException:
    """The error a rank raised, out of DCP's CheckpointException (the first failing rank's)."""
    if isinstance(exc, CheckpointException) and exc.failures:
        inner = next(iter(exc.failures.values()))
        inner = inner[0] if isinstance(inner, tuple) else getattr(inner, "exc", inner)
        return inner if isinstance(inner, BaseException) else exc
    return exc


class Ranks:
    """The group a manager saves and loads on, this rank's place in it, and its agreements.

    By default, with asynchronous saves in a distributed run, the group is a new gloo group, so
    the background save's collectives never interleave with training's; base choices go over a
    group of their own, since the save group may be carrying a background save at that moment.
    """

    def __init__(self, where: str, group: Any, async_save: bool, incremental: bool) -> None:
        self.where = where  # names the root in errors
        self.distributed = dist.is_available() and dist.is_initialized()
        if self.distributed and group is None and async_save:
            group = dist.new_group(backend="gloo")
        self.group = group
        self.rank = dist.get_rank(group) if self.distributed else 0
        self.base_group = dist.new_group(backend="gloo") if self.distributed and incremental else None

    @property
    def world(self) -> int:
        return dist.get_world_size(self.group) if self.distributed else 1

    def dcp_kwargs(self) -> dict:
        """How ``dcp.save``/``dcp.load`` run on this group."""
        return {"process_group": self.group} if self.distributed else {"no_dist": True}

    def on_rank0(self, fn, what: str, group: Any = None):
        """Run ``fn`` on rank 0 and hand its result (or its error, raised) to every rank (over
        ``group``, by default the manager's)."""
        group = group if group is not None else self.group
        try:
            result = (True, fn()) if self.rank == 0 else None
        except Exception as exc:  # noqa: BLE001 - raised below on every rank
            if not self.distributed:
                raise
            result = (False, f"{type(exc).__name__}: {exc}")
        if self.distributed:
            box = [result]
            dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0) if group else 0, group=group)
            result = box[0]
        ok, value = result
        if not ok:
            raise CheckpointError(f"{self.where}: rank 0 failed {what}: {value}")
        return value

    def on_leaders(self, fn, what: str, nodes) -> list:
        """Run ``fn`` on each node's leader (``nodes``: a :class:`manager.nodes.NodeMap`) and hand
        every rank the results, by node; a leader's error is raised on every rank, naming it."""
        try:
            result = (True, fn()) if nodes.is_leader else None
        except Exception as exc:  # noqa: BLE001 - raised below on every rank
            if not self.distributed:
                raise
            result = (False, f"{type(exc).__name__}: {exc}")
        results = [result]
        if self.distributed:
            results = [None] * self.world
            dist.all_gather_object(results, result, group=self.group)
        out = []
        for n in range(nodes.count):
            ok, value = results[nodes.leader(n)]
            if not ok:
                raise CheckpointError(f"{self.where}: node {n} (rank {nodes.leader(n)}) failed {what}: {value}")
            out.append(value)
        return out

    def agree(self, verdict: Verdict) -> Verdict:
        """Every rank's verdict on a checkpoint, combined: bad on one rank is bad on all,
        and an error that must be raised is raised on every rank."""
        if self.distributed:
            verdicts: list[Any] = [None] * self.world
            dist.all_gather_object(verdicts, verdict, group=self.group)
        else:
            verdicts = [verdict]
        for r, v in enumerate(verdicts):
            if isinstance(v, Raise):
                raise v.error(f"rank {r}: " if self.distributed else "")
        bad = [(r, v) for r, v in enumerate(verdicts) if v is not None]
        if not bad:
            return None
        why = "; ".join(f"rank {r}: {v[0]}" if self.distributed else v[0] for r, v in bad)
        return why, any(v[1] for _r, v in bad)
