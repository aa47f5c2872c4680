"""DataStatesSavePlanner: DCP's default save planner, without its per-item overhead.

DCP's ``DefaultSavePlanner`` costs tens of microseconds per item: it
flattens the state dict through a generic traversal, builds each tensor's
``TensorProperties`` afresh (``Tensor.is_pinned()`` included), and copies
every write item twice with ``dataclasses.replace`` while it builds the
metadata. For a state dict of tens of thousands of small tensors that was a
large part of the save (docs/benchmarks.md). This subclass makes the same
plans and the same ``Metadata`` for the common case, plain tensors and
plain values, in one pass each:

- a state dict of dicts, lists and plain tensors or values (a model's and
  an optimizer's ``state_dict()``) is flattened in one walk by DCP's rules
  (the same keys and ``planner_data`` paths); anything else (DTensor,
  ShardedTensor, parameters, other Mappings) goes through DCP's code;
- a plain tensor's write item is built directly, with one
  ``TensorProperties`` object shared by every tensor of the same dtype,
  ``requires_grad`` and pinning, and equal sizes one object (as the writer
  shares them before DCP pickles the plan);
- the global plan and metadata are built in one loop (index hints included)
  and checked as DCP's validation checks them, in time that grows with the
  number of chunks times its logarithm (DCP's sweeps every tensor along
  its largest dimension: a tensor sharded along another one, such as a
  feed-forward output weight under FSDP, costs it the square of the number
  of ranks); only a plan that fails is handed to DCP's own validation, which
  names the problems.

Its plans, metadata and ``planner_data`` equal DefaultSavePlanner's
(``tests/test_planner.py`` compares them). DCP's save-plan caching
(``enable_plan_caching=True``) works as with DefaultSavePlanner: an
unchanged local plan is not sent, and a repeated save reuses the cached
global plan and metadata (the one-pass local plan is still made, to be
compared: that is what tells a changed structure from an unchanged one).
The file
layout is not the planner's business: each rank's ``DataStatesWriter`` places
its items itself (with its stripes and compression, :mod:`placement`)::

    dcp.save(state, storage_writer=DataStatesWriter(path), planner=DataStatesSavePlanner())
"""

from __future__ import annotations

import bisect
import dataclasses
import math
import sys
from collections import ChainMap
from collections.abc import Mapping

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
from dcp_datastates.core.plan_rows import SharedValues, row_metadata
from dcp_datastates.native.gc_pause import main_thread_gc_paused


def _flatten_plain(state_dict) -> tuple[dict, dict] | None:
    """DCP's flattening (``flatten_state_dict``: keys joined by dots, list positions as path
    items) of a state dict whose leaves are plain ``torch.Tensor`` objects or values that are
    not tensors at all, in one pass; None if anything needs DCP's own handling (a tensor
    subclass such as DTensor, ShardedTensor or a parameter, an object with
    ``__create_write_items__``, a Mapping that is not a dict).

    The rules are DCP's (``_traverse.traverse_state_dict``): a dict is walked with ``str(key)``;
    a list is walked with its positions when it holds a tensor, a Mapping or a list that is
    walked, and is a leaf otherwise; a tuple and every other value is a leaf; an empty dict
    leaves nothing; a key that two paths join to is an error."""
    flat: dict = {}
    mappings: dict = {}
    tensor = torch.Tensor
    stack = [((str(k),), v) for k, v in reversed(state_dict.items())]
    while stack:
        path, value = stack.pop()
        kind = type(value)
        if kind is dict or (kind is not tensor and isinstance(value, dict)):  # OrderedDict and the like
            stack.extend((path + (str(k),), v) for k, v in reversed(value.items()))
            continue
        if kind is list and not _is_terminal_list(value):
            stack.extend((path + (i,), v) for i, v in reversed(list(enumerate(value))))
            continue
        if kind is not tensor and (
            isinstance(value, (tensor, Mapping)) or hasattr(value, "__create_write_items__")
        ):
            return None  # a subclass of Tensor, another Mapping: DCP's code
        fqn = path[0] if len(path) == 1 else ".".join(map(str, path))
        if fqn in flat:
            raise ValueError(f"duplicated flatten key {fqn}")
        flat[fqn] = value
        mappings[fqn] = path
    return flat, mappings


def _is_terminal_list(values: list) -> bool:
    """DCP's ``_is_terminal`` for a list: a leaf unless it holds a tensor, a Mapping, or a list
    that is not a leaf."""
    for entry in values:
        if isinstance(entry, (torch.Tensor, Mapping)):
            return False
        if isinstance(entry, list) and not _is_terminal_list(entry):
            return False
    return True


class DataStatesSavePlanner(DefaultSavePlanner):
    """``DefaultSavePlanner`` with one-pass local and global planning (see the module docstring)."""

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator: bool = False) -> None:
        with main_thread_gc_paused():
            self._set_up(state_dict, storage_meta, is_coordinator)

    def _set_up(self, state_dict, storage_meta, is_coordinator: bool) -> None:
        flat = None
        if (
            self.flatten_state_dict and self.flatten_sharded_tensors and isinstance(state_dict, dict)
            and not _dcp_compat.flattening_is_legacy()
        ):
            flat = _flatten_plain(state_dict)
        self._flat = flat is not None
        if flat is None:
            super().set_up_planner(state_dict, storage_meta, is_coordinator)
            return
        self.state_dict, self.mappings = flat
        self.is_coordinator = is_coordinator

    def create_local_plan(self) -> SavePlan:
        with main_thread_gc_paused():
            return self._local_plan()

    def _local_plan(self) -> SavePlan:
        if not getattr(self, "_flat", False):
            return super().create_local_plan()
        # A subclass that calls this and then edits items' properties in place (DCP's FP16Planner
        # example) gets one TensorProperties per item, as from DCP; otherwise kinds share one.
        share = type(self).create_local_plan is DataStatesSavePlanner.create_local_plan
        self.plan = SavePlan(_plain_write_items(self.state_dict, share), planner_data=self.mappings)
        if _dcp_compat.plan_caching_enabled(self) and _dcp_compat.local_plan_unchanged(self, self.plan):
            # DCP's caching: an unchanged plan is not sent; finish_plan returns the cached final plan.
            return SavePlan([], usable=False)
        return self.plan

    def resolve_data(self, write_item: WriteItem):
        """A plain tensor of the flattened state dict is the item's data as it is (DCP finds it
        through ``find_state_dict_object``: a lookup and its checks per item), unless a subclass
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

    def _one_pass_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        """DCP's global planning step (deduplication, metadata with index hints, planner data,
        validation) with one pass over the items. DCP's ``create_global_plan`` calls it, with or
        without plan caching, under the private name ``_dcp_compat.GLOBAL_PLAN_STEP``."""
        with main_thread_gc_paused():
            return self._global_step(all_plans)

    def _global_step(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        if len(all_plans) == 1:
            deduped = all_plans
        elif type(self)._dedup_save_plans is DefaultSavePlanner._dedup_save_plans:
            deduped = dedup_save_plans(all_plans, self.dedup_save_to_lowest_rank)
        else:  # a subclass's own deduplication
            deduped = _dcp_compat.dedup_save_plans(self, all_plans)
        plans, metadata = _global_plan_and_metadata(deduped)
        if self.flatten_state_dict:
            data = [p.planner_data for p in plans if p.planner_data is not None]
            merged = dict(data[0]) if len(data) == 1 else dict(ChainMap(*data))
            metadata.planner_data = merged
        errors = _dcp_compat.validate_global_save_plan(plans, metadata) if _plan_is_suspect(plans, metadata) else []
        if errors:
            summary = "; ".join(errors)
            raise ValueError(f"Failed to validate global plan: {summary[:500]}{'... (truncated)' if len(summary) > 500 else ''}")
        return plans, metadata


setattr(DataStatesSavePlanner, _dcp_compat.GLOBAL_PLAN_STEP, DataStatesSavePlanner._one_pass_global_plan)


def dedup_save_plans(plans: list[SavePlan], save_to_lowest_rank: bool = False) -> list[SavePlan]:
    """DCP's ``dedup_save_plans``: an item several plans hold (a replicated tensor, an object
    every rank saves) is kept in one of them, the plan with the fewest bytes assigned so far
    (ties broken as DCP breaks them; ``save_to_lowest_rank``: the lowest rank), in the order
    the items first appear.
    The same plans as DCP's; items are keyed by plain tuples (DCP hashes a dataclass per
    item several times) and a plan that keeps every item is returned as it is."""
    holders: dict = {}  # (fqn, offset) -> plan position, or a list of them when several hold it
    items: dict = {}  # (fqn, offset) -> the last plan's item (DCP sizes that one)
    shared = False
    for p, plan in enumerate(plans):
        for item in plan.items:
            index = item.index
            key = (index.fqn, index.offset)
            held = holders.get(key)
            if held is None:
                holders[key] = p
            else:
                shared = True
                if type(held) is int:
                    holders[key] = [held, p] if held != p else held
                elif held[-1] != p:
                    held.append(p)
            items[key] = item
    if not shared:
        return list(plans)
    assigned = [0] * len(plans)
    keep: dict = {}  # key -> the plan that keeps it, for keys several plans hold
    for key, held in holders.items():
        item = items[key]
        nbytes = _storage_size(item) or 1
        if type(held) is int:
            assigned[held] += nbytes
            continue
        # DCP takes the minimum over a set of positions: its order decides ties
        chosen = held[0] if save_to_lowest_rank else min(set(held), key=assigned.__getitem__)
        assigned[chosen] += nbytes
        keep[key] = chosen
    out = []
    for p, plan in enumerate(plans):
        kept = [item for item in plan.items if keep.get((item.index.fqn, item.index.offset), p) == p]
        out.append(plan if len(kept) == len(plan.items) else dataclasses.replace(plan, items=kept))
    return out


def _storage_size(item: WriteItem) -> int | None:
    """``WriteItem.tensor_storage_size()``: the bytes of a tensor item's whole tensor (not its
    chunk's, as DCP counts them), None for other items."""
    data = item.tensor_data
    if data is None:
        return None
    return math.prod(data.size) * data.properties.dtype.itemsize


def _plan_is_suspect(plans: list[SavePlan], metadata: Metadata) -> bool:
    """Whether DCP's validation of the global plan (``_validate_global_plan``) could find a
    problem: a chunk out of its tensor's bounds, two chunks overlapping, or (several plans)
    chunks that do not add up to their tensor. The same checks as DCP's, with its sweep for
    overlaps run along the dimension where the chunks' starts differ most (any dimension
    finds every overlapping pair; this one keeps the sweep's active set small)."""
    several = len(plans) > 1
    for value in metadata.state_dict_metadata.values():
        if type(value) is not TensorStorageMetadata:
            if isinstance(value, TensorStorageMetadata):
                return True  # a subclass: let DCP's code judge it
            continue
        size = value.size
        dims = len(size)
        if dims == 0:
            continue
        chunks = value.chunks
        volume = 0
        for chunk in chunks:
            offsets, sizes = chunk.offsets, chunk.sizes
            if len(offsets) != dims or len(sizes) != dims:
                return True
            n = 1
            for o, s, d in zip(offsets, sizes, size):
                if o < 0 or s < 0 or o + s > d:
                    return True
                n *= s
            volume += n
        if several and volume != math.prod(size):
            return True
        if len(chunks) > 1 and _chunks_overlap(chunks, dims):
            return True
    return False


def _chunks_overlap(chunks: list, dims: int) -> bool:
    """Whether two of ``chunks`` overlap by DCP's test (``_check_box_overlap``; a chunk of no
    elements strictly inside another counts): a sweep along one dimension that compares each
    chunk only with those it could overlap there."""
    if dims == 1:
        sweep = 0
    else:
        sweep = max(range(dims), key=lambda d: len({c.offsets[d] for c in chunks}))
    order = sorted(chunks, key=lambda c: (c.offsets[sweep], *c.offsets))
    active: list = []  # (end along the sweep, position in order), by end
    for i, current in enumerate(order):
        start = current.offsets[sweep]
        cut = bisect.bisect_right(active, (start, sys.maxsize))
        if cut:
            del active[:cut]
        for _, j in active:
            other = order[j]
            if all(
                o0 < o1 + s1 and o1 < o0 + s0
                for o0, s0, o1, s1 in zip(current.offsets, current.sizes, other.offsets, other.sizes)
            ):
                return True
        bisect.insort(active, (start + current.sizes[sweep], i))
    return False


def _plain_write_items(state_dict: dict, share_properties: bool = True) -> list[WriteItem]:
    """DCP's write items of a flattened state dict of plain tensors and other values (see
    ``_flatten_plain``); with ``share_properties``, one ``TensorProperties`` object per kind of
    tensor (DCP makes one per tensor), and the sizes shared (fewer objects made; the rows
    :mod:`plan_rows` pickles share them too)."""
    items = []
    values = SharedValues()
    tensor_item, bytes_item, contiguous = WriteItemType.TENSOR, WriteItemType.BYTE_IO, torch.contiguous_format
    for fqn, value in state_dict.items():
        if type(value) is not torch.Tensor:
            items.append(WriteItem(index=MetadataIndex(fqn), type=bytes_item))
            continue
        size = values.size(value.size())
        offsets = values.zeros(len(size))
        dtype, layout, requires_grad, pinned = value.dtype, value.layout, value.requires_grad, value.is_pinned()
        if share_properties:
            props = values.properties_for(dtype, layout, requires_grad, contiguous, pinned)
        else:
            props = TensorProperties(dtype=dtype, layout=layout, requires_grad=requires_grad, memory_format=contiguous, pin_memory=pinned)
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
    return out, row_metadata(md)  # DCP broadcasts it: pickled as rows

