"""The state of one save on one rank, and its statistics.

DCP drives a save through a fixed sequence of writer calls (``storage_meta``,
``set_up_storage_writer``, ``prepare_local_plan``, ``prepare_global_plan`` on
the coordinator, ``write_data``, ``finish`` on the coordinator), and for
``dcp.async_save`` runs them in a background thread. :class:`RankSave` is what
those calls share, created when the save begins and ended (its files kept or
removed) when it commits or fails.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata

from dcp_datastates.core.async_save.order import Ticket
from dcp_datastates.core.async_save.snapshot import Snapshot
from dcp_datastates.format.checkpoint_layout import CheckpointLayout


@dataclasses.dataclass
class SaveStats:
    """Timings of the last save on this rank (seconds), for benchmarks and logs."""

    began_at: float = 0.0  # time.perf_counter() when the save began (async: its snapshot's capture)
    bytes_written: int = 0
    items: int = 0
    direct_io: bool = False
    # sync: windows written straight from the caller's tensors, without a staging copy
    windows_from_source: int = 0
    asynchronous: bool = False
    stage_call_s: float = 0.0  # async: time the caller spent in stage()
    staged_s: float = 0.0  # async: from stage() until every byte left the caller's tensors
    submit_s: float = 0.0  # resolving items and handing regions to the engine
    objects_s: float = 0.0  # serializing Python objects (overlaps the engine)
    metadata_serialize_s: float = 0.0  # coordinator: pickling + writing the metadata (overlaps)
    metadata_done_before_data: bool = False  # the engine was still writing when metadata was done
    data_write_s: float = 0.0  # sync: from handing regions to the engine until data fsynced
    index_s: float = 0.0
    commit_s: float = 0.0  # coordinator: finish()
    plan_from_cache: bool = False  # DCP's plan cache (enable_plan_caching) supplied this rank's plan
    # Incremental saves (a base, or digests recorded): bytes of large chunks hashed, bytes
    # referred to in the base instead of written, and the time the hashing took.
    hashed_bytes: int = 0
    referenced_bytes: int = 0
    hash_s: float = 0.0
    # This rank's files (a checkpoint_layout.RankFiles) once written: what a durable tier copies.
    rank_files: Any = None


@dataclasses.dataclass(frozen=True)
class SaveTarget:
    """What one save is, fixed when it begins (DCP's first call, ``storage_meta``)."""

    path: str
    dest: Any  # where it writes (core.destination): the directory, or the prefix in a store
    save_id: str  # the id in this save's own file names and its metadata temp name
    dcp_save_id: str  # writer.save_id when the save began (StorageMeta.save_id)
    thread: threading.Thread
    ticket: Ticket  # its place in the process-wide order of saves
    snapshot: Snapshot | None  # asynchronous saves: the staged snapshot
    writer_serial: int  # which writer (see async_save.runtime.BackgroundErrors)

    @property
    def asynchronous(self) -> bool:
        return self.snapshot is not None


@dataclasses.dataclass(frozen=True)
class StagedMetadata:
    """The checkpoint's metadata serialized for the commit, with the layout it holds."""

    metadata: Metadata
    layout: CheckpointLayout
    handle: Any  # destination.stage_metadata's


@dataclasses.dataclass
class RankSave:
    """One save on this rank, from ``storage_meta`` to its end: what the writer's calls share.

    Only the writer holds and changes it. What the save's calls fix is kept in
    immutable records: its :class:`SaveTarget`, the coordinator's plans and its
    prediction of the layout (``coordinator_layout.LayoutPrediction``). The rest
    is the save's progress: the engine job to stop and the files to remove
    should it fail, the metadata staged for the commit, and whether it ended.
    """

    target: SaveTarget
    stats: SaveStats
    rank: int = 0
    is_coordinator: bool = False
    plans: tuple | None = None  # coordinator: the final plans of a save without cached plans
    prediction: Any = None  # coordinator: the layout it expects the ranks to report
    job: Any = None  # the engine job writing this rank's data files
    written_files: list = dataclasses.field(default_factory=list)  # synchronous: this rank's file names
    staged: StagedMetadata | None = None
    gc_pause: Any = None  # native.gc_pause.CallPause, from set_up_storage_writer to the save's end
    ended: bool = False


# The writer's log (README names it): one line per rank and save.
_log = logging.getLogger("dcp_datastates.core.writer")


def log_rank_written(rank: int, path: str, stats: SaveStats) -> None:
    """One INFO line per rank and save: bytes, seconds since the save began, rate, and for an
    asynchronous save how long the caller was blocked (the rest overlapped training)."""
    if not _log.isEnabledFor(logging.INFO):
        return
    seconds = time.perf_counter() - stats.began_at
    rate = stats.bytes_written / seconds / 1e9 if seconds > 0 else float("inf")
    line = f"rank {rank} wrote {stats.bytes_written} bytes to {path} in {seconds:.3f} s ({rate:.2f} GB/s)"
    if stats.asynchronous:
        line += f"; async: the caller was blocked {stats.stage_call_s:.3f} s, the snapshot was copied after {stats.staged_s:.3f} s"
    if stats.referenced_bytes:
        line += f"; {stats.referenced_bytes} bytes referred to in the base"
    _log.info("%s", line)
