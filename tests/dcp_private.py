"""The private DCP names the tests touch, in one place (the package's own are in
``dcp_datastates/_dcp_compat.py``).

Tests reach into DCP where nothing public does the job: to rebuild a nested
state from its flat keys the way DCP unflattens it, to load a checkpoint
into an empty state dict the way ``format_utils.dcp_to_torch_save`` does, to make DCP's
asynchronous executor refuse or delay work, and to use DCP's experimental
stream extensions (its only compression API, which our writer accepts). If
a torch release moves one of these, this file is the one to change.
"""

from __future__ import annotations


def unflatten_state_dict(flat: dict, mappings: dict) -> dict:
    """DCP's ``_nested_dict.unflatten_state_dict``: flat planner keys back into the nesting."""
    from torch.distributed.checkpoint._nested_dict import unflatten_state_dict as unflatten

    return unflatten(flat, mappings)


def async_thread_executor():
    """DCP's ``_async_thread_executor`` module (``dcp.async_save``'s default executor and its
    ``save_wrapper``), for tests that make it fail or stall."""
    import torch.distributed.checkpoint._async_thread_executor as executor

    return executor


def stream_extensions() -> tuple[type, type]:
    """``(StreamTransformExtension, ZStandard)`` from DCP's experimental ``_extension``."""
    from torch.distributed.checkpoint._extension import StreamTransformExtension, ZStandard

    return StreamTransformExtension, ZStandard


def load_into_empty_state_dict(storage_reader) -> dict:
    """What ``format_utils.dcp_to_torch_save`` does: every saved item into an empty state dict,
    through DCP's ``_load_state_dict`` and ``_EmptyStateDictLoadPlanner``."""
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    state: dict = {}
    _load_state_dict(state, storage_reader=storage_reader, planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    return state
