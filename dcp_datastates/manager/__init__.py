"""Run management: a root of step checkpoints (``checkpoint_root``: names, the ``latest``
pointer, resume order), what may be deleted in it (``cleanup``), and the manager that
saves, loads and decides when each happens (``checkpoint_manager``)."""

from dcp_datastates.manager.checkpoint_manager import CheckpointManager, ManagedSave, SkippedCheckpointWarning

__all__ = ["CheckpointManager", "ManagedSave", "SkippedCheckpointWarning"]
