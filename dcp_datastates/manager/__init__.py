"""Run management: a root of step checkpoints, its `latest` pointer, retention and resume order."""

from dcp_datastates.manager.checkpoint_manager import CheckpointManager, ManagedSave, SkippedCheckpointWarning

__all__ = ["CheckpointManager", "ManagedSave", "SkippedCheckpointWarning"]
