"""Where a run's checkpoints are on disk: one ``step_<N>`` directory per step under a root.

Both the reference run (DCP's FileSystemWriter) and ours (CheckpointManager)
use the manager's step directory names, so the parent can pair their
checkpoints of one step, find the newest committed one a resume should load,
and measure their size.
"""

from __future__ import annotations

import os

from dcp_datastates.manager.checkpoint_root import is_committed, step_dir_name, step_dirs


def step_dir(root: str, step: int) -> str:
    return os.path.join(root, step_dir_name(step))


def committed_step_dirs(root: str) -> dict[int, str]:
    """``{step: path}`` of every committed ``step_*`` directory under ``root``."""
    paths = {s: os.path.join(root, n) for s, n in step_dirs(root).items()}
    return {s: path for s, path in paths.items() if is_committed(path)}


def latest_committed_checkpoint(root: str) -> tuple[int, str] | None:
    """The newest committed ``step_*`` directory under ``root`` (what the parent expects a resume to load)."""
    committed = committed_step_dirs(root)
    return max(committed.items()) if committed else None


def dir_bytes(path: str) -> int:
    """The bytes of the regular files directly in ``path``: a checkpoint's size on disk."""
    total = 0
    for entry in os.scandir(path):
        if entry.is_file(follow_symlinks=False):
            total += entry.stat(follow_symlinks=False).st_size
    return total
