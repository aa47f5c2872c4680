"""The state of one save on one rank, its statistics, and errors of background saves.

DCP drives a save through a fixed sequence of writer calls (``storage_meta``,
``set_up_storage_writer``, ``prepare_local_plan``, ``prepare_global_plan`` on
the coordinator, ``write_data``, ``finish`` on the coordinator), and for
``dcp.async_save`` runs them in a background thread. :class:`RankSave` is what
those calls share: plain data, created when the save begins and ended (its
files kept or removed) when it commits or fails.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import threading
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata

from dcp_datastates.core.save_order import Ticket
from dcp_datastates.core.snapshot import Snapshot
from dcp_datastates.errors import CheckpointError
from dcp_datastates.format.checkpoint_layout import CheckpointLayout


@dataclasses.dataclass
class SaveStats:
    """Timings of the last save on this rank (seconds), for benchmarks and logs."""

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


@dataclasses.dataclass
class RankSave:
    """One save on this rank, from DCP's first call (``storage_meta``) to its end."""

    path: str
    dest: Any  # where it writes (core.destination): the directory, or the prefix in a store
    save_id: str  # the id in this save's file names (synchronous saves) and metadata temp name
    thread: threading.Thread
    ticket: Ticket  # its place in the process-wide order of saves
    snapshot: Snapshot | None  # asynchronous saves: the staged snapshot
    stats: SaveStats
    writer_serial: int  # which writer (see BackgroundErrors)
    dcp_save_id: str | None = None  # writer.save_id when the save began (StorageMeta.save_id)
    is_coordinator: bool = False
    rank: int = 0
    layout: CheckpointLayout | None = None  # coordinator: set when the writer (not the planner) placed items
    # Coordinator, sync saves: rank -> (RankLayout, plan item indices), reused by its own
    # write_data and by the check of every rank's results.
    rank_layouts: dict = dataclasses.field(default_factory=dict)
    tensor_locations: dict | None = None  # async: location_key -> (offset, nbytes) in the snapshot
    metadata_tmp: Any = None  # the metadata staged for the commit (destination.stage_metadata)
    metadata_obj: Metadata | None = None
    written_files: list[str] = dataclasses.field(default_factory=list)  # sync: this rank's file names
    job: Any = None  # the engine job writing this rank's data file (stopped if the save fails)
    plan_cached: bool = False  # coordinator: some plans came from DCP's cache; layout from results
    report: Any = None  # the files this rank wrote (plan_cache.RankReport)
    ended: bool = False

    @property
    def asynchronous(self) -> bool:
        return self.snapshot is not None


class BackgroundErrors:
    """Errors of asynchronous saves not yet raised to the caller.

    A background save's error fails its upload future; it is raised once more
    by the next save call in the process (``stage()`` or a synchronous save),
    so a training loop that never looks at its futures still learns of it,
    and ``writer.close()`` raises the errors of that writer's saves. Writers are
    told apart by a serial number (``id()`` values are reused).
    """

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self._lock = threading.Lock()
        self._errors: list[tuple[int, str, BaseException]] = []

    def record(self, writer_serial: int, path: str, exc: BaseException) -> None:
        with self._lock:
            self._errors.append((writer_serial, path, exc))

    def drain(self) -> list[tuple[int, str, BaseException]]:
        """Remove and return every unreported error (tests check that none leaked)."""
        with self._lock:
            errors, self._errors = self._errors, []
        return errors

    def raise_first(self, writer_serial: int | None = None) -> None:
        """Raise (once) the first unreported error, of any writer or of ``writer_serial``'s."""
        with self._lock:
            mine = [e for e in self._errors if writer_serial is None or e[0] == writer_serial]
            for e in mine:
                self._errors.remove(e)
        if mine:
            _, path, exc = mine[0]
            more = f" ({len(mine) - 1} more failed too)" if len(mine) > 1 else ""
            raise CheckpointError(f"an earlier asynchronous save to {path} failed{more}: {exc}") from exc


BACKGROUND_ERRORS = BackgroundErrors()

# A fork child starts without the parent's errors (its saves are the parent's to report).
os.register_at_fork(after_in_child=BACKGROUND_ERRORS._reset)

_serials = itertools.count(1)


def new_writer_serial() -> int:
    return next(_serials)
