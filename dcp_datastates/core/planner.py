"""DataStatesSavePlanner: DCP's default save planner, without its per-item overhead.

DCP's ``DefaultSavePlanner`` costs tens of microseconds per item: it
flattens the state dict through a generic traversal, builds each tensor's
``TensorProperties`` afresh (``Tensor.is_pinned()`` included), and copies
every write item twice with ``dataclasses.replace`` while it builds the
metadata. For a state dict of 20,000 small tensors that was 1.3 s of a
3.5 s save (docs/benchmarks.md, issue 15). This subclass makes the same
plans and the same ``Metadata`` for the common case, plain tensors and
plain values, in one pass each:

- a flat state dict of plain tensors and scalars is its own flattening
  (each key maps to the path ``(key,)``); anything else (nested containers,
  DTensor, ShardedTensor, other objects) goes through DCP's code;
- a plain tensor's write item is built directly, with one
  ``TensorProperties`` object shared by every tensor of the same dtype,
  ``requires_grad`` and pinning;
- the global plan and metadata are built in one loop (index hints included)
  and checked by DCP's own validation.

Its plans, metadata and ``planner_data`` equal DefaultSavePlanner's
(``tests/test_planner.py`` compares them). With DCP's save-plan caching
(``enable_plan_caching=True``) the planning is DefaultSavePlanner's own
(its cache keeps the plans it made; a repeated save skips the global plan
and the metadata). The file
layout is not the planner's business: ``DataStatesWriter`` places every item
itself (with its stripes and compression) in ``prepare_global_plan``::

    dcp.save(state, storage_writer=DataStatesWriter(path), planner=DataStatesSavePlanner())
"""

from __future__ import annotations

import dataclasses
from collections import ChainMap

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

from dcp_datastates import _dcp_compat

# Values a flat state dict may hold for the fast path: DCP's flattening leaves them as they are.
_PLAIN_VALUES = (int, float, bool, str, bytes, type(None))


def _is_flat(state_dict: dict) -> bool:
    """Every value a plain ``torch.Tensor`` (not a subclass: DTensor, ShardedTensor,
    parameters go through DCP) or a plain scalar, every key a string."""
    tensor = torch.Tensor
    for key, value in state_dict.items():
        if type(key) is not str or (type(value) is not tensor and type(value) not in _PLAIN_VALUES):
            return False
    return True


class DataStatesSavePlanner(DefaultSavePlanner):
    """``DefaultSavePlanner`` with one-pass local and global planning (see the module docstring)."""

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator: bool = False) -> None:
        self._flat = (
            self.flatten_state_dict and self.flatten_sharded_tensors and isinstance(state_dict, dict)
            and _is_flat(state_dict)
        )
        if not self._flat:
            super().set_up_planner(state_dict, storage_meta, is_coordinator)
            return
        self.state_dict = state_dict
        self.mappings = {key: (key,) for key in state_dict}
        self.is_coordinator = is_coordinator

    def create_local_plan(self) -> SavePlan:
        if not getattr(self, "_flat", False) or _dcp_compat.plan_caching_enabled(self):
            return super().create_local_plan()
        # A subclass that calls this and then edits items' properties in place (DCP's FP16Planner
        # example) gets one TensorProperties per item, as from DCP; otherwise kinds share one.
        share = type(self).create_local_plan is DataStatesSavePlanner.create_local_plan
        self.plan = SavePlan(_plain_write_items(self.state_dict, share), planner_data=self.mappings)
        return self.plan

    def resolve_data(self, write_item: WriteItem):
        """A flat state dict's plain tensor is the item's data as it is (DCP finds it through
        ``find_state_dict_object``: a lookup and its checks per item), unless a subclass
        extends the lookup (``lookup_object``, ``transform_object``)."""
        cls = type(self)
        if (
            getattr(self, "_flat", False) and write_item.type == WriteItemType.TENSOR
            and cls.lookup_object is DefaultSavePlanner.lookup_object
            and cls.transform_object is DefaultSavePlanner.transform_object
        ):
            value = self.state_dict.get(write_item.index.fqn)
            offset = write_item.index.offset
            if type(value) is torch.Tensor and offset is not None and not any(offset):
                return value
        return super().resolve_data(write_item)

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        if _dcp_compat.plan_caching_enabled(self) or _dcp_compat.extends_global_planning(self):
            return super().create_global_plan(all_plans)
        plans, metadata = self._one_pass_global_plan(all_plans)
        self.global_plan = plans
        self.metadata = metadata
        return plans, metadata

    def _one_pass_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        """DCP's global planning (deduplication, metadata with index hints, validation), with
        one pass over the items."""
        deduped = all_plans if len(all_plans) == 1 else _dcp_compat.dedup_save_plans(self, all_plans)
        plans, metadata = _global_plan_and_metadata(deduped)
        if self.flatten_state_dict:
            data = [p.planner_data for p in plans if p.planner_data is not None]
            merged = dict(data[0]) if len(data) == 1 else dict(ChainMap(*data))
            metadata.planner_data = merged
        errors = _dcp_compat.validate_global_save_plan(plans, metadata)
        if errors:
            summary = "; ".join(errors)
            raise ValueError(f"Failed to validate global plan: {summary[:500]}{'... (truncated)' if len(summary) > 500 else ''}")
        return plans, metadata


def _plain_write_items(state_dict: dict, share_properties: bool = True) -> list[WriteItem]:
    """DCP's write items of a flat state dict of plain tensors and scalars (see ``_is_flat``);
    with ``share_properties``, one ``TensorProperties`` object per kind of tensor."""
    items = []
    properties: dict = {}  # one TensorProperties per kind of tensor (DCP makes one per tensor)
    tensor_item, bytes_item, contiguous = WriteItemType.TENSOR, WriteItemType.BYTE_IO, torch.contiguous_format
    for fqn, value in state_dict.items():
        if type(value) is not torch.Tensor:
            items.append(WriteItem(index=MetadataIndex(fqn), type=bytes_item))
            continue
        size = value.size()
        offsets = torch.Size([0] * len(size))
        pinned = value.is_pinned()
        key = (value.dtype, value.layout, value.requires_grad, pinned)
        props = properties.get(key) if share_properties else None
        if props is None:
            props = properties[key] = TensorProperties(
                dtype=value.dtype, layout=value.layout, requires_grad=value.requires_grad,
                memory_format=contiguous, pin_memory=pinned,
            )
        items.append(WriteItem(  # index hint 0 already: the global plan keeps the item as it is
            index=MetadataIndex(fqn, offsets, 0), type=tensor_item,
            tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets=offsets, sizes=size), properties=props, size=size),
        ))
    return items


def _global_plan_and_metadata(plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
    """``create_default_global_save_plan`` of DCP, each item rebuilt once (not twice through
    ``dataclasses.replace``): the same plans (index hints rewritten) and the same metadata."""
    md: dict = {}
    out = []
    for plan in plans:
        items = []
        for item in plan.items:
            fqn = item.index.fqn
            if item.type != WriteItemType.SHARD and fqn in md:
                raise ValueError(f"{fqn!r} is planned twice (two items of the same key in the plans)")
            if item.type == WriteItemType.BYTE_IO:
                md[fqn] = BytesStorageMetadata()
                items.append(item)
                continue
            data = item.tensor_data
            if data is None or data.chunk is None:
                raise ValueError(f"{fqn!r} is a tensor item without its chunk")
            tensor_md = md.get(fqn)
            if tensor_md is None:
                tensor_md = md[fqn] = TensorStorageMetadata(properties=data.properties, size=data.size, chunks=[])
            hint = len(tensor_md.chunks)
            if item.index.index != hint:  # the index hint DCP's global plan writes (not compared)
                item = WriteItem(index=MetadataIndex(fqn, item.index.offset, hint), type=item.type, tensor_data=data)
            items.append(item)
            tensor_md.chunks.append(data.chunk)
        out.append(dataclasses.replace(plan, items=items))
    return out, Metadata(md)

