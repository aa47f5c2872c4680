"""dcp_datastates: a fast, safe storage backend for torch.distributed.checkpoint.

    import torch.distributed.checkpoint as dcp
    from dcp_datastates import DataStatesWriter, DataStatesReader

    dcp.save(state, storage_writer=DataStatesWriter(path))
    dcp.load(state, storage_reader=DataStatesReader(path))

    # asynchronous: returns at once; the fence makes optimizer.step() wait
    # only while the snapshot is still copying
    dcp_datastates.install_fence(optimizer)
    resp = dcp.async_save(state, storage_writer=DataStatesWriter(path))

    # every checksum of a checkpoint, every problem listed
    print(dcp_datastates.verify(path))

    # a run: step directories, an atomic "latest" pointer, retention, resume
    mgr = dcp_datastates.CheckpointManager(root, dcp_datastates.CheckpointManagerOptions(keep_last=3))
    start = mgr.load(state) or 0      # newest good checkpoint (None: fresh start)
    mgr.save(step, state)             # asynchronous; optimizer.step() waits only while copying

    # straight from object storage, with ranged reads (no local copy)
    dcp.load(state, storage_reader=dcp_datastates.DataStatesReader("s3://bucket/run/step_00000100"))
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

# Each public name and the module it lives in. They are imported on first use (PEP 562), so
# that ``import dcp_datastates`` and the command-line tool's commands that never touch a tensor
# (``--help``, ``ls``, ``du``) do not pay for importing torch and DCP.
_PUBLIC = {
    "CheckpointError": "dcp_datastates.errors",
    "CheckpointExistsError": "dcp_datastates.errors",
    "CheckpointNotFoundError": "dcp_datastates.errors",
    "ChecksumMismatchError": "dcp_datastates.errors",
    "CorruptCheckpointError": "dcp_datastates.errors",
    "IncompleteCheckpointError": "dcp_datastates.errors",
    "SnapshotMutatedError": "dcp_datastates.errors",
    "UnsafeCheckpointError": "dcp_datastates.errors",
    "UnsupportedFormatError": "dcp_datastates.errors",
    "install_fence": "dcp_datastates.core.async_save.fence",
    "install_global_fence": "dcp_datastates.core.async_save.fence",
    "snapshots_in_flight": "dcp_datastates.core.async_save.fence",
    "wait_for_snapshots": "dcp_datastates.core.async_save.fence",
    "CheckpointManager": "dcp_datastates.manager.checkpoint_manager",
    "ManagedSave": "dcp_datastates.manager.checkpoint_manager",
    "SkippedCheckpointWarning": "dcp_datastates.manager.checkpoint_manager",
    "CheckpointManagerOptions": "dcp_datastates.manager.options",
    "DataStatesSavePlanner": "dcp_datastates.core.planner",
    "DataStatesReader": "dcp_datastates.core.reader",
    "VerifyReport": "dcp_datastates.core.verify",
    "verify": "dcp_datastates.core.verify",
    "DataStatesWriter": "dcp_datastates.core.writer",
    "SaveStats": "dcp_datastates.core.writer",
    "EngineBusyError": "dcp_datastates.native.engine",
    "release_engines": "dcp_datastates.native.engine",
}
_ALIASES = {"StoreReader": "DataStatesReader"}  # its earlier name for loads from object storage: the same reader

__all__ = [
    "CheckpointManager",
    "CheckpointManagerOptions",
    "ManagedSave",
    "SkippedCheckpointWarning",
    "install_global_fence",
    "DataStatesWriter",
    "DataStatesReader",
    "StoreReader",
    "DataStatesSavePlanner",
    "EngineBusyError",
    "release_engines",
    "SaveStats",
    "CheckpointError",
    "CheckpointExistsError",
    "CheckpointNotFoundError",
    "ChecksumMismatchError",
    "CorruptCheckpointError",
    "IncompleteCheckpointError",
    "SnapshotMutatedError",
    "install_fence",
    "snapshots_in_flight",
    "wait_for_snapshots",
    "UnsafeCheckpointError",
    "UnsupportedFormatError",
    "VerifyReport",
    "verify",
]


def _require_torch() -> None:
    """The first use of a public name checks that a supported torch is installed, with an
    ImportError that says what to install."""
    try:
        import torch  # noqa: F401
    except ImportError as exc:  # pragma: no cover - the test environment has torch
        raise ImportError(
            "dcp_datastates needs PyTorch 2.11 or newer; install it first "
            "(for example `pip install torch==2.13.0`)"
        ) from exc
    from dcp_datastates._dcp_compat import check_torch_version

    check_torch_version()


# The subpackages and modules reachable as attributes (``dcp_datastates.errors.X``,
# ``dcp_datastates.native.engine.ForkedEngineError``), imported on first use like the names.
_SUBMODULES = frozenset({"errors", "core", "format", "integrations", "manager", "native", "storage", "tiers", "tools"})


def __getattr__(name: str):
    if name in _SUBMODULES:
        return importlib.import_module(f"dcp_datastates.{name}")
    target = _ALIASES.get(name, name)
    module = _PUBLIC.get(target)
    if module is None:
        raise AttributeError(f"module 'dcp_datastates' has no attribute {name!r}")
    _require_torch()
    value = getattr(importlib.import_module(module), target)
    globals()[name] = value  # imported once; later lookups do not come here
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:  # what type checkers and IDEs see: the names, imported eagerly
    from dcp_datastates.core.async_save.fence import install_fence, install_global_fence, snapshots_in_flight, wait_for_snapshots
    from dcp_datastates.core.planner import DataStatesSavePlanner
    from dcp_datastates.core.reader import DataStatesReader
    from dcp_datastates.core.reader import DataStatesReader as StoreReader
    from dcp_datastates.core.verify import VerifyReport, verify
    from dcp_datastates.core.writer import DataStatesWriter, SaveStats
    from dcp_datastates.errors import (
        CheckpointError,
        CheckpointExistsError,
        CheckpointNotFoundError,
        ChecksumMismatchError,
        CorruptCheckpointError,
        IncompleteCheckpointError,
        SnapshotMutatedError,
        UnsafeCheckpointError,
        UnsupportedFormatError,
    )
    from dcp_datastates.manager.checkpoint_manager import CheckpointManager, ManagedSave, SkippedCheckpointWarning
    from dcp_datastates.manager.options import CheckpointManagerOptions
    from dcp_datastates.native.engine import EngineBusyError, release_engines
