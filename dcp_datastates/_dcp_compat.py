"""Every private torch / DCP name dcp_datastates relies on, and nothing else.

DCP's public protocols (``StorageWriter``, ``StorageReader``, ``AsyncStager``,
the planners, ``Metadata``) carry almost everything this package needs. The
few things they do not carry are reached here, and only here, so that a torch
release that moves one of them breaks one function with a clear message
instead of a save path in the middle of a checkpoint. Each function names
what it relies on and what happens where it is missing; each is pinned by
``tests/test_dcp_compat.py`` on every torch the suite runs on.

Supported: torch 2.11 and newer (checked on 2.11 and 2.13).
"""

from __future__ import annotations

import functools
import re
from typing import Any

import torch

MIN_TORCH = (2, 11)


def torch_version() -> tuple[int, int]:
    """``(major, minor)`` of the running torch (``2.13.0+cpu`` -> ``(2, 13)``)."""
    m = re.match(r"(\d+)\.(\d+)", torch.__version__)
    if m is None:  # pragma: no cover - every release has one
        raise ImportError(f"dcp_datastates cannot parse torch version {torch.__version__!r}")
    return int(m.group(1)), int(m.group(2))


def check_torch_version() -> None:
    if torch_version() < MIN_TORCH:
        raise ImportError(
            f"dcp_datastates needs torch {MIN_TORCH[0]}.{MIN_TORCH[1]} or newer; this is torch {torch.__version__}"
        )


# -- tensors ------------------------------------------------------------------------


def version_counter(tensor: torch.Tensor) -> int:
    """The tensor's in-place version counter (``Tensor._version``).

    Every in-place operation through autograd-visible paths (``add_``,
    ``copy_``, an optimizer's ``foreach`` updates) increments it; writes
    through ``.data`` do not. The lazy snapshot compares it before and after
    its copies to prove that the bytes it saved are the state at the call.
    """
    return tensor._version


def local_shard(value: torch.Tensor) -> torch.Tensor:
    """The plain tensor holding this rank's bytes: a DTensor's local shard, else ``value``.

    ``DTensor.to_local()`` is public but goes through autograd and returns a
    new alias on every call; the snapshot needs the shard object itself (its
    version counter, and one identity per shard), which is ``_local_tensor``.
    """
    dtensor = _dtensor_class()
    if dtensor is not None and isinstance(value, dtensor):
        return value._local_tensor
    return value


def dtensor_chunk_offsets(value: torch.Tensor) -> tuple | None:
    """The global offsets of this rank's chunk of a DTensor, as DCP's planner names it in
    ``MetadataIndex.offset`` (``DTensor.__create_chunk_list__``, the dunder DCP plans with);
    None when it is not one chunk (or not a DTensor)."""
    dtensor = _dtensor_class()
    if dtensor is None or not isinstance(value, dtensor):
        return None
    try:
        chunks = value.__create_chunk_list__()
    except RuntimeError:  # partial placements: DCP refuses them too
        return None
    return tuple(chunks[0].offsets) if len(chunks) == 1 else None


@functools.lru_cache(maxsize=None)
def _dtensor_class():
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch built without distributed
        return None
    return DTensor


def cuda_event_handle(event: torch.cuda.Event) -> int:
    """The ``cudaEvent_t`` of a recorded torch CUDA event, as an integer for the engine."""
    return event.cuda_event


# -- DCP internals ---------------------------------------------------------------


def flatten_state_dict(state_dict: dict) -> dict:
    """DCP's flattening of a nested state dict into its planner keys (``a.b.0``).

    DCP's default planner plans flattened keys; the writer resolves the staged
    tensors of a plan's items the same way. Private in DCP
    (``_nested_dict.flatten_state_dict``), stable since 2.2.
    """
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict as flatten

    return flatten(state_dict)[0]


def dedup_save_plans(planner, plans: list) -> list:
    """DefaultSavePlanner's deduplication of replicated items across ranks' plans, with the
    planner's own setting (``dedup_save_to_lowest_rank``): ``DefaultSavePlanner._dedup_save_plans``,
    private, present since 2.2."""
    return planner._dedup_save_plans(plans)


def plan_caching_enabled(planner) -> bool:
    """Whether ``DefaultSavePlanner(enable_plan_caching=True)`` made ``planner``: the argument is
    kept only as the private attribute ``_enable_plan_caching`` (absent: off)."""
    return bool(getattr(planner, "_enable_plan_caching", False))


GLOBAL_PLAN_STEP = "_create_global_plan"
"""The method ``DefaultSavePlanner.create_global_plan`` calls to deduplicate, build the metadata
and validate (private; with plan caching, only when a local plan changed). DataStatesSavePlanner
defines its one-pass version under this name, so that DCP's caching uses it and a subclass's own
step overrides it; were DCP to rename it, DCP's slower step would run, with the same result."""


def local_plan_unchanged(planner, plan) -> bool:
    """DCP's plan-cache check of ``DefaultSavePlanner.create_local_plan``: whether ``plan`` equals
    the local plan cached under the planner's key by an earlier save (``SavePlanner._cached_save_plan``,
    compared by ``planner_helpers._compare_save_plans``, both private). If not, ``plan`` is
    remembered the way this torch does: torch 2.11 caches it at once, later releases keep it
    pending (``_pending_local_plan``) until ``finish_plan`` knows the global plan succeeded."""
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.planner import SavePlanner
    from torch.distributed.checkpoint.planner_helpers import _compare_save_plans

    key = planner._cached_plans_key
    cached = SavePlanner._cached_save_plan.get(key)
    if cached is not None and _compare_save_plans(plan, cached):
        return True
    if "_pending_local_plan" in DefaultSavePlanner.finish_plan.__code__.co_names:
        planner._pending_local_plan = plan
    else:
        SavePlanner._cached_save_plan[key] = plan
    return False


def flattening_is_legacy() -> bool:
    """Whether DCP flattens state dicts the torch 2.3 way (``_version._derived_version == "2_3"``,
    private, set when loading a checkpoint of that era): DataStatesSavePlanner then leaves the
    flattening to DCP."""
    from torch.distributed.checkpoint import _version

    return getattr(_version, "_derived_version", None) == "2_3"


def validate_global_save_plan(plans: list, metadata) -> list[str]:
    """DCP's check of a global save plan (chunks inside their tensor, none overlapping, the
    tensor covered): ``default_planner._validate_global_plan``, private. It returns the
    problems from torch 2.13 on and a bool before (logging them as warnings)."""
    from torch.distributed.checkpoint.default_planner import _validate_global_plan

    result = _validate_global_plan(plans, metadata)
    if isinstance(result, bool):
        return [] if result else ["chunks out of bounds, overlapping or not covering their tensor (DCP logged which)"]
    return list(result)


@functools.lru_cache(maxsize=None)
def storage_info_class():
    """DCP ``FileSystemWriter``'s per-item storage record (``filesystem._StorageInfo``):
    what a stock DCP checkpoint's ``.metadata`` holds, read by the tools; None if gone."""
    try:
        from torch.distributed.checkpoint.filesystem import _StorageInfo
    except ImportError:  # pragma: no cover
        return None
    return _StorageInfo


@functools.lru_cache(maxsize=None)
def zstandard_extension_class():
    """DCP's ``ZStandard`` stream extension (``_extension.ZStandard``, experimental), or None."""
    try:
        from torch.distributed.checkpoint._extension import ZStandard
    except ImportError:  # pragma: no cover - every torch we support has it
        return None
    return ZStandard


@functools.lru_cache(maxsize=None)
def legacy_tensor_properties_class():
    """The sharded-tensor ``TensorProperties`` older torch releases pickled into ``.metadata``
    (``_shard.sharded_tensor.metadata``), when it is a class of its own in this torch; else None."""
    from torch.distributed.checkpoint.metadata import TensorProperties

    try:
        from torch.distributed._shard.sharded_tensor.metadata import TensorProperties as Legacy
    except ImportError:  # pragma: no cover - a torch without it cannot have written one either
        return None
    return Legacy if Legacy is not TensorProperties else None


def load_whole_checkpoint(storage_reader) -> dict:
    """Every key of a checkpoint, loaded into a new state dict in this process (no process
    group): DCP's ``state_dict_loader._load_state_dict_from_keys``."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    return _load_state_dict_from_keys(storage_reader=storage_reader)


def fake_tensor_mode():
    """A context in which tensors have shapes and dtypes but no storage
    (``torch._subclasses.fake_tensor.FakeTensorMode``): a skeleton for ``torch.save``."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode()


def dcp_metadata_version() -> Any:
    """The version tag DCP's FileSystemWriter stamps into ``Metadata.version`` (None if absent)."""
    try:
        from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION
    except ImportError:  # pragma: no cover
        return None
    return CURRENT_DCP_VERSION


# -- DCP's asynchronous save threads --------------------------------------------------

# dcp.async_save with the (default) thread executor runs each save on a new
# ThreadPoolExecutor of one worker named with this prefix, submits one save and
# shuts the executor down when that save's future completes (torch 2.11-2.13:
# _async_thread_executor._ThreadBasedAsyncCheckpointExecutor). So such a thread
# runs exactly one save and ends right after the upload future completes, after
# DCP's last collective of the save: joining it is waiting for the upload future.
DCP_ASYNC_SAVE_THREAD_PREFIX = "AsyncCheckpointExecutor_"


def runs_one_save(thread) -> bool:
    """Whether ``thread`` is one of DCP's per-save asynchronous threads (see above).

    Any other thread (the caller's, a user's executor) may run more saves,
    so its saves are not waited for by joining it.
    """
    return thread.name.startswith(DCP_ASYNC_SAVE_THREAD_PREFIX)


def dcp_load_reports_read_metadata_errors() -> bool:
    """Whether ``dcp.load`` passes on what ``StorageReader.read_metadata`` raised.

    torch 2.13 raises an ``AssertionError`` that includes the reader's
    message; torch 2.11 catches the error, logs only "Global metadata is not
    found" at INFO and raises ``AssertionError("metadata is None")``, so there
    the reader logs its error itself (2.12 is treated as 2.11: the check was
    made on 2.11 and 2.13).
    """
    return torch_version() >= (2, 13)


# -- DCP's logging --------------------------------------------------------------------


def quiet_discarded_dcp_debug_records() -> bool:
    """Raise DCP's own logger to INFO where its DEBUG records can reach nobody; True when
    its DEBUG records are off (now or already).

    DCP wraps every top-level key of a state dict (``_stateful_to_state_dict``)
    and every step of a save or load in ``_dcp_method_logger``, which builds
    two DEBUG ``LogRecord``s per call on ``logger._dcp_logger``
    (``c10d-NullHandler-dcp_logger``: level DEBUG, ``propagate=False``, a
    ``NullHandler``). The records are thrown away, yet are a visible part of a
    ``dcp.save`` of many top-level keys (``benchmarks/bench_dcp_logging.py``),
    with DCP's writers as much as ours. Where every handler of that logger is a
    ``NullHandler`` and it does not propagate, no output can change, so its
    level is raised; a logger someone gave a real handler (or propagation) is
    left as it is. Undo with ``logging.getLogger(name).setLevel(logging.DEBUG)``.
    """
    import logging

    logger = dcp_logger()
    if not isinstance(logger, logging.Logger):  # None: a torch without it has nothing to quiet
        return False
    if logger.getEffectiveLevel() > logging.DEBUG:
        return True  # quiet already
    if logger.propagate or not logger.handlers:
        return False
    if not all(type(h) is logging.NullHandler for h in logger.handlers):
        return False
    logger.setLevel(logging.INFO)
    return True


# -- private names the tests reach for (here, so that this module stays the only one) -------


def unflatten_state_dict(flat: dict, mappings: dict) -> dict:
    """DCP's ``_nested_dict.unflatten_state_dict``: flat planner keys back into the nesting
    (tests rebuild the nested state a checkpoint's ``planner_data`` describes)."""
    from torch.distributed.checkpoint._nested_dict import unflatten_state_dict as unflatten

    return unflatten(flat, mappings)


def async_thread_executor_module():
    """DCP's ``_async_thread_executor`` module (``dcp.async_save``'s default executor and its
    ``save_wrapper``), for tests that make it refuse or delay work."""
    import torch.distributed.checkpoint._async_thread_executor as executor

    return executor


def stream_transform_extension_class():
    """DCP's experimental ``_extension.StreamTransformExtension`` (tests write their own transform)."""
    from torch.distributed.checkpoint._extension import StreamTransformExtension

    return StreamTransformExtension


def extension_registry():
    """A new ``_extension.ExtensionRegistry`` with DCP's default extensions (ZStandard): how
    ``FileSystemReader`` turns the transform descriptors of stored items back into extensions."""
    from torch.distributed.checkpoint._extension import ExtensionRegistry

    return ExtensionRegistry()


def load_into_empty_state_dict(storage_reader) -> dict:
    """What ``format_utils.dcp_to_torch_save`` does: every saved item into an empty state dict,
    through DCP's ``_load_state_dict`` and ``_EmptyStateDictLoadPlanner``."""
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    state: dict = {}
    _load_state_dict(state, storage_reader=storage_reader, planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    return state


def dcp_logger():
    """DCP's own logger (``logger._dcp_logger``), or None where this torch has none."""
    try:
        from torch.distributed.checkpoint.logger import _dcp_logger
    except ImportError:  # pragma: no cover
        return None
    return _dcp_logger


def cuda_sleep(cycles: int) -> None:
    """``torch.cuda._sleep``: a kernel that spins for ``cycles`` on the current stream (tests of
    ordering against work still running on the device)."""
    import torch

    torch.cuda._sleep(cycles)


def allowed_private_globals() -> tuple:
    """``(metadata._MEM_FORMAT_ENCODING, serialization._get_layout)``: private globals the safe
    unpickler of ``.metadata`` admits (DCP's pickles name them), which the safe-mode tests check
    a hostile pickle cannot change."""
    import torch.serialization
    from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING

    return _MEM_FORMAT_ENCODING, torch.serialization._get_layout


# Every module that touches DCP imports this one: a torch too old for the package is refused
# here, whichever module is imported first (the package's names check it again on first use).
check_torch_version()
