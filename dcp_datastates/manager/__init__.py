"""Run management: :class:`CheckpointManager` and its options (docs/manager.md); the modules
it orchestrates are listed in :mod:`checkpoint_manager`'s docstring."""

from dcp_datastates.manager.checkpoint_manager import CheckpointManager, ManagedSave, SkippedCheckpointWarning
from dcp_datastates.manager.options import CheckpointManagerOptions

__all__ = ["CheckpointManager", "CheckpointManagerOptions", "ManagedSave", "SkippedCheckpointWarning"]
