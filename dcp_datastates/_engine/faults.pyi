"""Type stub of dcp_datastates._engine.faults: fault injection for the reliability tests.

The rules hook the engine's own pwrite/pread/fsync calls (and, through
:func:`point`, the Python side's); dcp_datastates.native.faults is the face
tests use. Nothing is armed unless a test arms it.
"""

import enum

ANY_OFFSET: int
"""An offset that matches every call of a rule's operation."""

class Op(enum.Enum):
    write = 0
    read = 1
    fsync = 2
    rename = 3

class Action(enum.Enum):
    error = 0
    short = 1
    kill = 2
    stall = 3

def add(
    op: Op,
    path_part: str = "",
    offset: int = ...,
    action: Action = Action.error,
    errno: int = ...,
    skip: int = 0,
    times: int = 1,
    stall_us: int = 0,
) -> int:
    """Arm a rule; returns its index for :func:`fired`. A ``stall`` rule waits ``stall_us``, then lets the call through."""

def clear() -> None: ...
def fired(rule_index: int) -> int:
    """How many times rule ``rule_index`` fired; IndexError if there is no such rule."""

def armed() -> bool: ...
def point(op: Op, path: str, offset: int = 0, nbytes: int = 0) -> int:
    """How many of ``nbytes`` a Python-side transfer may move; raises the injected OSError."""
