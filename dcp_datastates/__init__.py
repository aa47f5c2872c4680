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

try:
    import torch  # noqa: F401
except ImportError as exc:  # pragma: no cover
    raise ImportError(
        "dcp_datastates needs PyTorch 2.11 or newer; install it first "
        "(for example `pip install torch==2.13.0`)"
    ) from exc

from dcp_datastates._dcp_compat import check_torch_version

check_torch_version()

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
from dcp_datastates.core.async_save.fence import install_fence, install_global_fence, snapshots_in_flight, wait_for_snapshots
from dcp_datastates.manager import CheckpointManager, CheckpointManagerOptions, ManagedSave, SkippedCheckpointWarning
from dcp_datastates.core.planner import DataStatesSavePlanner
from dcp_datastates.core.reader import DataStatesReader
from dcp_datastates.core.verify import VerifyReport, verify
from dcp_datastates.core.writer import DataStatesWriter, SaveStats
from dcp_datastates.native.engine import EngineBusyError, release_engines

StoreReader = DataStatesReader  # its earlier name for loads from object storage: the same reader

__version__ = "0.1.0"

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
