"""The demo's working directory: where each run puts its checkpoints and logs, and its removal.

::

    ROOT/
        reference_dcp/   the reference run's checkpoints (DCP FileSystemWriter)
        datastates/      the CheckpointManager root the failing and resumed runs share
        logs/            one JSON-lines log per run

A directory given with ``--dir`` must be new or empty; at the end (without
``--keep``) only what the demo made in it is removed, and the directory
itself if that left it empty. A temporary directory is removed whole.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile

REFERENCE_DIR = "reference_dcp"
OURS_DIR = "datastates"
LOGS_DIR = "logs"


@dataclasses.dataclass(frozen=True)
class WorkDir:
    root: str
    created: bool  # a temporary directory the demo made (else given with --dir)

    @property
    def reference(self) -> str:
        return os.path.join(self.root, REFERENCE_DIR)

    @property
    def ours(self) -> str:
        return os.path.join(self.root, OURS_DIR)

    @property
    def logs(self) -> str:
        return os.path.join(self.root, LOGS_DIR)

    def remove(self) -> None:
        if self.created:
            shutil.rmtree(self.root, ignore_errors=True)
            return
        for name in (REFERENCE_DIR, OURS_DIR, LOGS_DIR):
            shutil.rmtree(os.path.join(self.root, name), ignore_errors=True)
        try:
            os.rmdir(self.root)
        except OSError:
            pass


def open_workdir(path: str | None) -> WorkDir:
    """A fresh temporary directory, or ``path`` (created if missing; refused unless empty)."""
    if path is None:
        return WorkDir(tempfile.mkdtemp(prefix="dcp_datastates_demo_"), created=True)
    root = os.path.abspath(path)
    if os.path.isdir(root) and os.listdir(root):
        raise SystemExit(f"--dir {root} is not empty; give a new or empty directory")
    os.makedirs(root, exist_ok=True)
    return WorkDir(root, created=False)
