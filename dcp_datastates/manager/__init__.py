"""Run management: :class:`CheckpointManager` and its options (docs/manager.md); the modules
it orchestrates are listed in :mod:`checkpoint_manager`'s docstring.

The names are imported on first use (PEP 562): the tools read a run's layout
(:mod:`checkpoint_root`) without importing the manager, and with it torch."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_PUBLIC = {
    "CheckpointManager": "dcp_datastates.manager.checkpoint_manager",
    "ManagedSave": "dcp_datastates.manager.checkpoint_manager",
    "SkippedCheckpointWarning": "dcp_datastates.manager.checkpoint_manager",
    "CheckpointManagerOptions": "dcp_datastates.manager.options",
}

__all__ = ["CheckpointManager", "CheckpointManagerOptions", "ManagedSave", "SkippedCheckpointWarning"]


def __getattr__(name: str):
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'dcp_datastates.manager' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:
    from dcp_datastates.manager.checkpoint_manager import CheckpointManager, ManagedSave, SkippedCheckpointWarning
    from dcp_datastates.manager.options import CheckpointManagerOptions
