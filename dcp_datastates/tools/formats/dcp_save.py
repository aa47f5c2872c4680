"""``dcp.save`` of a checkpoint being converted, each value read from the source only when written.

What ``convert --to dcp`` (stock ``FileSystemWriter``) and ``--to datastates``
(ours) share: a skeleton of meta tensors and placeholders to plan with, and
a planner that reads each tensor or object from the source when the storage
writer resolves it, so the writer pulls one tensor at a time.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from dcp_datastates.errors import CheckpointError


class _Placeholder:
    """Stands for a saved object in the skeleton; the planner reads the real one when asked."""

    def __repr__(self) -> str:
        return "<object read at write time>"


def _lazy_planner_class():
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.metadata import MetadataIndex

    class LazySavePlanner(DefaultSavePlanner):
        """DCP's default planner over a skeleton; each value is read from the source on demand.

        The skeleton is the flat state (the source's keys) of meta tensors,
        which plan like real ones (``TensorProperties.create_from_tensor``
        only reads dtype, layout and ``is_pinned()``, False on meta), and of
        placeholders for objects. ``lookup_object`` reads the real tensor or
        object when the storage writer resolves that item, so the writer
        pulls one tensor at a time. The source's ``planner_data`` is kept as
        it was, so the output unflattens to the same nested structure.

        ``resolve_creates_tensors`` tells DataStatesWriter to resolve and
        release in batches. ``release_previous`` (stock FileSystemWriter
        only) frees each tensor's memory when the next one is resolved:
        FileSystemWriter keeps every tensor of a file in a dict until the file
        is closed (for its safetensors mode), but with one thread and no
        copy-ahead it writes each tensor before resolving the next.
        """

        resolve_creates_tensors = True

        def __init__(self, view, tracker, release_previous: bool) -> None:
            super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
            self.view = view
            self.tracker = tracker
            self.release_previous = release_previous
            self.previous: torch.Tensor | None = None
            self.tensors_read = 0
            self.objects_read = 0

        def set_up_planner(self, state_dict, storage_meta=None, is_coordinator=False) -> None:
            super().set_up_planner(state_dict, storage_meta, is_coordinator)
            mappings = self.view.metadata.planner_data
            if isinstance(mappings, dict) and mappings:
                self.mappings = dict(mappings)
                self.flatten_state_dict = True  # create_*_plan now carry planner_data into the metadata

        def lookup_object(self, index: MetadataIndex) -> Any:
            fqn = index.fqn
            if fqn not in self.view.tensors:
                self.objects_read += 1
                return self.view.read_object(fqn)
            self.release()
            tensor = self.view.read_tensor(fqn)  # the whole (unsharded) tensor: one chunk
            nbytes = tensor.numel() * tensor.element_size()
            self.tracker.add(nbytes)
            self.tensors_read += 1
            if self.release_previous:
                self.previous = tensor
            return tensor

        def release(self) -> None:
            if self.previous is not None:
                self.previous.untyped_storage().resize_(0)
                self.previous = None

    return LazySavePlanner


def _skeleton(view) -> dict[str, Any]:
    """The flat state to plan with: meta tensors of each key's global shape, placeholders for objects."""
    flat: dict[str, Any] = {}
    for fqn in view.keys():
        md = view.tensors.get(fqn)
        if md is not None:
            flat[fqn] = torch.empty(tuple(md.size), dtype=md.properties.dtype, device="meta")
        elif fqn in view.objects:
            flat[fqn] = _Placeholder()
    return flat


def dcp_save(view, writer, tracker, summary, release_previous: bool) -> None:
    """``dcp.save`` of the source through ``writer``, each value read when the writer resolves it."""
    import torch.distributed.checkpoint as dcp

    planner = _lazy_planner_class()(view, tracker, release_previous)
    with _rank_errors():
        try:
            dcp.save(_skeleton(view), storage_writer=writer, planner=planner, no_dist=True)
        finally:
            planner.release()
    summary.tensors = planner.tensors_read
    summary.objects = planner.objects_read
    summary.bytes = sum(view.nbytes(k) for k in view.tensors)


@contextlib.contextmanager
def _rank_errors():
    """DCP wraps a rank's error in CheckpointException (a BaseException): raise the rank's own."""
    from torch.distributed.checkpoint.api import CheckpointException

    from dcp_datastates.manager.collective import unwrap

    try:
        yield
    except CheckpointException as exc:
        inner = unwrap(exc)
        if inner is not exc:
            raise inner from None
        raise CheckpointError(str(exc)) from None
