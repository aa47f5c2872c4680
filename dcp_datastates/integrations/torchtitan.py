"""torchtitan's ``CheckpointManager`` saving and loading through ``DataStatesWriter``/``DataStatesReader``.

torchtitan builds its checkpointer from the ``checkpoint`` field of its
trainer's config (``config.checkpoint.build(...)``), so choosing ours is one
line where the config is written::

    from dcp_datastates.integrations.torchtitan import DataStatesCheckpointManager

    checkpoint=DataStatesCheckpointManager.Config(enable=True, async_mode="async", interval=500)

:class:`DataStatesCheckpointManager` subclasses torchtitan's and keeps all of
its policy (``step-N`` folders, ``interval``, ``keep_latest_k``, ``load_step``,
``exclude_from_loading``, ``last_save_model_only``/``export_dtype``, the
initial loads): it replaces only where the bytes go (``dcp_save``,
``dcp_load``) and the waits for them. Both asynchronous modes are our lazy
snapshot (``stage()`` returns at once; the engine copies through its bounded,
reused host pool, pinned when CUDA is present) instead of torchtitan's full
host copy or pinned replica, and the fence that makes ``optimizer.step()``
wait while a snapshot still copies is installed here. docs/torchtitan.md
says what maps to what.

torchtitan is imported by this module only, so the package imports without it.
"""

from __future__ import annotations

import datetime
import os
import shutil
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

TORCHTITAN_INSTALL = ('pip install "dcp_datastates[torchtitan]" && '
                      "pip install --no-deps torchtitan==0.3.0 torchdata==0.11.0 torch_checkpointing==0.1.1")


def _missing_torchtitan_message(exc: ImportError) -> str:
    """What to install: torchtitan itself, or the one dependency of its that is missing (with
    torchtitan installed --no-deps, following a message that names torchtitan changes nothing)."""
    missing = (exc.name or "").split(".")[0]
    if missing == "torchtitan" or not missing:
        return (f"dcp_datastates.integrations.torchtitan needs torchtitan (tested with 0.3.0): {TORCHTITAN_INSTALL}"
                f" ({exc})")
    return (f"dcp_datastates.integrations.torchtitan: torchtitan is installed but its dependency "
            f"{missing!r} is not (No module named {exc.name!r}); the torchtitan extra has its light "
            f"dependencies: {TORCHTITAN_INSTALL}")


try:
    from torchtitan.components.checkpointer import MODEL, AsyncMode, CheckpointManager
    from torchtitan.tools import filesystem
    from torchtitan.tools.utils import GarbageCollection
except ImportError as exc:  # pragma: no cover - exercised by tests that hide torchtitan or a dependency
    raise ImportError(_missing_torchtitan_message(exc)) from exc

from dcp_datastates.core.async_save.fence import install_global_fence
from dcp_datastates.core.reader import DataStatesReader
from dcp_datastates.core.writer import DataStatesWriter
from dcp_datastates.errors import CheckpointError
from dcp_datastates.native import engine as _native
from dcp_datastates.storage.url import url_scheme

__all__ = ["DataStatesCheckpointManager"]

# Where a Hugging Face export is saved before rank 0 converts it: inside the checkpoint folder,
# under a name torchtitan's listing and purge (which match ``step-N``) pass by.
HF_EXPORT_STAGING = ".datastates_hf_export"
HF_EXPORT_WAIT = datetime.timedelta(hours=6)  # how long the other ranks wait for rank 0's export

# torchtitan internals this module relies on (tests/test_torchtitan.py pins each):
# * CheckpointManager._save, in async_with_pinned_mem mode, builds its pinned-memory
#   DefaultStager only while ``self.stager is None``, and _close() calls ``self.stager.close()``.
#   We put our in-flight saves in that slot: torchtitan then builds no replica of its own (which
#   needs an accelerator) and its close() drains our saves.
# * _save calls ``self.dcp_save(states, checkpoint_id=..., async_mode=..., [enable_garbage_collection=...,
#   to_hf=...])`` and asserts a ``Future`` back in async mode, an ``AsyncSaveResponse`` in
#   async_with_pinned_mem mode; _load calls ``self.dcp_load(states, checkpoint_id=..., from_hf=...,
#   from_quantized=...)``; ``self.pg`` is the gloo group of its asynchronous saves.
# * _wait_for_saving() is what maybe_wait_for_saving() runs while ``self.save_future`` is set;
#   _load() is what load() runs.
# * torchtitan.tools.filesystem lists a remote folder through ``fsspec.core.url_to_fs(path)`` with no
#   options, so our ``url_to_fs(folder)`` gets the same cached instance (see _forget_stale_listings).


class _SavesInFlight:
    """The writers of this manager's asynchronous saves that have not been waited for.

    A writer's ``close()`` waits for its save to end and raises (once) the
    error a failed background save recorded, naming the checkpoint; this is
    where those waits happen. It also holds torchtitan's ``stager`` slot (see
    above), so torchtitan's ``close()`` drains it.
    """

    def __init__(self) -> None:
        self._writers: list[DataStatesWriter] = []

    def add(self, writer: DataStatesWriter) -> None:
        self._writers.append(writer)

    def close(self) -> None:
        """Wait for every save in flight; raise the first error after all have ended."""
        writers, self._writers = self._writers, []
        first: BaseException | None = None
        for writer in writers:
            try:
                writer.close()
            except BaseException as exc:  # noqa: BLE001 - every writer is drained, the first error raised
                first = first or exc
        if first is not None:
            raise first


class DataStatesCheckpointManager(CheckpointManager):
    """torchtitan's ``CheckpointManager`` whose checkpoints are written and read by dcp_datastates.

    Built like torchtitan's (``DataStatesCheckpointManager.Config(...).build(...)``,
    which its trainer does from ``config.checkpoint``). Modes: ``disabled`` is
    ``dcp.save`` through :class:`DataStatesWriter`; ``async`` and
    ``async_with_pinned_mem`` are both ``dcp.async_save`` with our lazy
    snapshot, the latter also handing torchtitan the staging future its
    trainer waits for before ``optimizers.step()``. Loads read through
    :class:`DataStatesReader` (checksums verified); initial loads of
    Hugging Face safetensors stay torchtitan's.

    A step saved again (after a rollback to an earlier step) replaces the
    earlier checkpoint of that step once the new one has committed, as
    torchtitan's own saves do.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):
        host_cache_bytes: int = _native.DEFAULT_HOST_CACHE_BYTES
        """Host memory the engine copies through (one pool per process, reused by every save)."""

        io_threads: int = _native.DEFAULT_IO_THREADS
        """Writer threads per save (and up to as many files per rank)."""

        direct_io: str = "auto"
        """O_DIRECT for data files: "auto" (where the file system allows it), "on" or "off"."""

        def __post_init__(self) -> None:
            CheckpointManager.Config.__post_init__(self)  # slots dataclasses: no zero-argument super()
            if self.direct_io not in _native.DIRECT_IO_MODES:
                raise ValueError(f"checkpoint.direct_io must be one of {_native.DIRECT_IO_MODES}, got {self.direct_io!r}")
            for name in ("host_cache_bytes", "io_threads"):
                value = getattr(self, name)
                if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                    raise ValueError(f"checkpoint.{name} must be a positive integer, got {value!r}")

    def __init__(self, config: Config, **components: Any) -> None:
        super().__init__(config, **components)
        if not self.enable:
            return
        self._writer_options = dict(
            host_cache_bytes=config.host_cache_bytes, io_threads=config.io_threads, direct_io=config.direct_io
        )
        # Settings the engine refuses fail here, not at the first save (its pool is mapped once, now).
        _native.ProcessEngine(config.host_cache_bytes, config.io_threads, _native.DEFAULT_WINDOW_BYTES)
        self.stager = _SavesInFlight()  # torchtitan's slot: see the internals above
        # The process-wide fence, not one on the optimizers container: global step pre-hooks run
        # before an optimizer's own, and the container's own (MoE load balancing) mutate buffers.
        self._fence = install_global_fence() if self.async_mode != AsyncMode.DISABLED else None

    @torch.no_grad()
    def dcp_save(
        self,
        state_dict: dict[str, Any],
        checkpoint_id: str,
        async_mode: AsyncMode,
        enable_garbage_collection: bool = False,
        to_hf: bool = False,
    ):
        """Save ``state_dict`` into ``checkpoint_id`` with our writer; what torchtitan's caller expects back:
        None (``disabled``), the upload ``Future`` (``async``), the ``AsyncSaveResponse``
        (``async_with_pinned_mem``)."""
        if to_hf:
            self._export_hf(state_dict, checkpoint_id)
            result = None
        elif async_mode == AsyncMode.DISABLED:
            writer = DataStatesWriter(checkpoint_id, overwrite=True, **self._writer_options)
            try:
                dcp.save(state_dict, storage_writer=writer)
            finally:
                writer.close()
            result = None
        else:
            response = self._async_save(state_dict, checkpoint_id)
            result = response if async_mode == AsyncMode.ASYNC_WITH_PINNED_MEM else response.upload_completion
        if enable_garbage_collection:
            GarbageCollection.collect("GC collection invoked by checkpointer.")
        self._forget_stale_listings()  # torchtitan's purge lists the folder next
        return result

    def _async_save(self, state_dict: dict[str, Any], checkpoint_id: str):
        writer = DataStatesWriter(checkpoint_id, overwrite=True, **self._writer_options)
        try:
            response = dcp.async_save(state_dict, storage_writer=writer, process_group=self.pg)
        except BaseException as exc:
            # It may have staged before raising: no save will run that snapshot.
            writer.abandon_unbegun(f"dcp.async_save into {checkpoint_id} failed: {type(exc).__name__}")
            writer.close()
            raise
        self.stager.add(writer)
        return response

    def _export_hf(self, state_dict: dict[str, Any], checkpoint_id: str) -> None:
        """The last save in Hugging Face safetensors (``last_save_in_hf``): the adapter's ``to_hf``
        names, saved by every rank in our format beside the step folders, then exported by rank 0
        with :func:`~dcp_datastates.integrations.huggingface.export_to_huggingface` (with the
        model's ``config.json`` and tokenizer when ``hf_assets_path`` holds them)."""
        from dcp_datastates.integrations.huggingface import export_to_huggingface

        if url_scheme(checkpoint_id) is not None:  # the same on every rank: every rank raises
            raise CheckpointError(
                f"last_save_in_hf writes safetensors into a local folder, and {checkpoint_id} is a URL: "
                "export the last checkpoint with `dcp-datastates convert CKPT --to huggingface OUT` instead"
            )
        staging = os.path.join(self.folder, HF_EXPORT_STAGING)
        distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        # The other ranks wait for rank 0's export on a gloo group of their own: the trainer's default
        # group (NCCL on GPUs) has the training timeout, which exporting a large model would trip.
        wait_group = dist.new_group(backend="gloo", timeout=HF_EXPORT_WAIT) if distributed else None
        writer = DataStatesWriter(staging, overwrite=True, **self._writer_options)
        try:
            dcp.save(self.sd_adapter.to_hf(state_dict), storage_writer=writer)
        finally:
            writer.close()
        failure: BaseException | None = None
        if _rank() == 0:
            try:
                export_to_huggingface(staging, checkpoint_id, config_dir=_hf_config_dir(self.sd_adapter), prefix="", overwrite=True)
                shutil.rmtree(staging)
            except Exception as exc:  # noqa: BLE001 - every rank raises it, below
                failure = exc
        why = _from_rank0(None if failure is None else f"{type(failure).__name__}: {failure}", wait_group)
        if wait_group is not None:
            dist.destroy_process_group(wait_group)
        if why is not None:
            raise CheckpointError(
                f"the Hugging Face export into {checkpoint_id} failed on rank 0 ({why}); the weights are kept "
                f"in dcp_datastates format at {staging}"
            ) from failure

    def dcp_load(self, state_dict: dict[str, Any], checkpoint_id: str, from_hf: bool, from_quantized: bool) -> None:
        """Load ``checkpoint_id`` into ``state_dict`` with our reader (Hugging Face sources: torchtitan's)."""
        if from_hf:
            super().dcp_load(state_dict, checkpoint_id, from_hf, from_quantized)
            return
        dcp.load(state_dict, storage_reader=DataStatesReader(checkpoint_id))
        # As torchtitan's own dcp_load: the model's entries are flattened into state_dict.
        if MODEL in self.states:
            self.states[MODEL].load_state_dict(state_dict)

    def _load(self, step: int = -1) -> bool:
        self._forget_stale_listings()  # torchtitan finds the step to load by listing the folder
        return super()._load(step)

    def _forget_stale_listings(self) -> None:
        """torchtitan lists a remote folder through fsspec, which caches listings, while our writer
        puts the objects through its own client: without this, a listing cached before a save
        would hide that save from torchtitan's purge and its choice of the step to load."""
        if filesystem.is_remote(self.folder):
            from fsspec.core import url_to_fs

            url_to_fs(self.folder)[0].invalidate_cache()  # the instance torchtitan's calls share

    def _wait_for_saving(self) -> None:
        try:
            self.stager.close()  # our error names the checkpoint; DCP's future would re-raise it
        except BaseException:
            self.save_future = None
            raise
        super()._wait_for_saving()

    def _close(self) -> None:
        try:
            super()._close()  # joins the purge thread, then drains our saves (its stager.close())
        finally:
            if getattr(self, "_fence", None) is not None:
                self._fence.remove()
                self._fence = None


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _from_rank0(value, group=None):
    """``value`` as rank 0 has it, on every rank of ``group`` (itself without a process group)."""
    if not (dist.is_available() and dist.is_initialized()):
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def _hf_config_dir(adapter) -> str | None:
    """The adapter's Hugging Face directory if it holds the model's ``config.json`` (the export then
    checks the tensors against that model and copies the config and tokenizer), else None."""
    path = getattr(adapter, "hf_assets_path", None)
    return path if path and os.path.isfile(os.path.join(path, "config.json")) else None
