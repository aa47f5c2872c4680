"""Fill a model's state dict, at any world size, straight from a Hugging Face directory.

The first load of a run fine-tuned from a published model finds no checkpoint
in its root; ``CheckpointManagerOptions(init_from_huggingface=DIR)`` then
loads the model part of the state from ``DIR`` instead. It reads through DCP's
public ``HuggingFaceStorageReader``: DCP's planner computes which slice of
each saved tensor every rank's shards need (plain tensors, FSDP2 or TP
DTensors, any world size), and each rank reads only those slices from the
safetensors files, in place, with no copy of the model written first (the
files are read where they are; there is nothing of ours to checksum yet).
Tied weights the files leave out (GPT-2's ``lm_head.weight``) are the same
tensor as the key they repeat in the model, so loading that key fills both.
"""

from __future__ import annotations

import os
from typing import Any

from dcp_datastates.errors import CheckpointNotFoundError, ModelMismatchError
from dcp_datastates.format.huggingface_model import tied_aliases


def load_from_huggingface(
    model_state: dict[str, Any], model_dir: str | os.PathLike, *, process_group=None, no_dist: bool | None = None,
) -> list[str]:
    """Load the safetensors weights of ``model_dir`` into ``model_state`` in place; return the keys loaded.

    ``model_state`` is a model's state dict (``model.state_dict()``, or the
    model part of ``get_state_dict``), named as ``save_pretrained`` names it;
    its tensors may be DTensors of any sharding. Every rank of
    ``process_group`` calls it (like ``dcp.load``; ``no_dist`` as there,
    None: whether a process group is initialized). A key of the model that no
    file holds (and that is not a tied weight the files store once), or a
    tensor of the files the model has no place for, raises
    :class:`ModelMismatchError` naming it, as does a shape that differs.
    """
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    path = os.fspath(model_dir)
    if no_dist is None:
        no_dist = not (dist.is_available() and dist.is_initialized())
    try:
        wanted, problem = _checked_targets(model_state, path), None
    except (ModelMismatchError, CheckpointNotFoundError, TypeError) as exc:
        wanted, problem = None, (type(exc).__name__, str(exc))
    # Checked on every rank (a DTensor's local shard, a directory on node-local disk): a refusal on
    # one rank is raised on all, before any rank enters dcp.load's collectives.
    problems = [problem]
    if not no_dist:
        problems = [None] * dist.get_world_size(process_group)
        dist.all_gather_object(problems, problem, group=process_group)
    for rank, found in enumerate(problems):
        if found is not None:
            kind, text = found
            error = {"TypeError": TypeError, "CheckpointNotFoundError": CheckpointNotFoundError}.get(kind, ModelMismatchError)
            raise error(text if len(problems) == 1 else f"rank {rank}: {text}")
    dcp.load(wanted, storage_reader=HuggingFaceStorageReader(path), process_group=process_group, no_dist=no_dist)
    return list(wanted)


def _checked_targets(model_state: dict[str, Any], path: str) -> dict[str, Any]:
    """The entries of ``model_state`` to load from ``path``, once every key, tie and shape agrees."""
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    if not os.path.isdir(path) or not any(n.endswith(".safetensors") for n in os.listdir(path)):
        raise CheckpointNotFoundError(f"{path}: no Hugging Face model there (no *.safetensors file)")
    if not isinstance(model_state, dict):
        raise TypeError(f"the model part of the state must be a dict (a state_dict), got {type(model_state).__name__}")
    stored = HuggingFaceStorageReader(path).read_metadata().state_dict_metadata
    tied = tied_aliases(path)
    wanted: dict[str, Any] = {}
    for key, value in model_state.items():
        if key in stored:
            saved, shape = tuple(stored[key].size), tuple(getattr(value, "shape", ()))
            if saved != shape:  # a DTensor's shape is the global one
                raise ModelMismatchError(f"{path}: {key!r} has shape {list(saved)} there, the model's is {list(shape)}")
            wanted[key] = value
        elif not (key in tied and tied[key] in model_state and tied[key] in stored):
            raise ModelMismatchError(
                f"{path}: the model's {key!r} is in none of its safetensors files"
                + ("" if tied else " (and no config.json there says it is a tied weight)")
            )
        elif not _same_storage(value, model_state[tied[key]]):
            raise ModelMismatchError(
                f"{path}: the files store {key!r} as {tied[key]!r} (its config ties them), but this model's "
                f"{key!r} is a tensor of its own: loading {tied[key]!r} would leave it as it is; build the "
                "model with its weights tied, as the config says"
            )
    extra = [k for k in stored if k not in wanted]
    if extra:
        raise ModelMismatchError(
            f"{path}: {extra[0]!r} has no place in the model ({len(extra)} unexpected: {', '.join(extra[:6])}"
            f"{', ...' if len(extra) > 6 else ''}); is it the model this run trains?"
        )
    return wanted


def _same_storage(a: Any, b: Any) -> bool:
    """Whether two entries of a state dict are one tensor (tied weights), DTensors by their local shards."""
    a, b = (t.to_local() if hasattr(t, "to_local") else t for t in (a, b))
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() and a.storage_offset() == b.storage_offset()
