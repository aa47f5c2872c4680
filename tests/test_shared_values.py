"""The plans DCP pickles in its collectives, with equal values as one object each: the same
items, equal to the planner's, never holding a caller's mutable object, and cheaper to pickle."""

from __future__ import annotations

import pickle

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem, SavePlan, TensorWriteData, WriteItem, WriteItemType

from dcp_datastates import DataStatesReader, DataStatesSavePlanner, DataStatesWriter
from dcp_datastates.core.shared_values import shared_load_plan, shared_save_plan


def _state(n: int = 300) -> dict:
    g = torch.Generator().manual_seed(0)
    state = {}
    for i in range(n):
        dtype = (torch.float32, torch.bfloat16, torch.int64)[i % 3]
        shape = ((i % 7) + 1,) if i % 2 else ((i % 5) + 1, 3)
        state[f"m.layer{i}.w"] = (torch.rand(shape, generator=g) * 100).to(dtype)
    state["step"] = 7
    return state


def _local_plan(planner_class, state) -> SavePlan:
    planner = planner_class()
    planner.set_up_planner(state, is_coordinator=True)
    return planner.create_local_plan()


def test_a_save_plan_keeps_its_items_with_equal_values_shared():
    plan = _local_plan(DefaultSavePlanner, _state())
    shared = shared_save_plan(plan)
    assert shared.items == plan.items and shared.planner_data == plan.planner_data and shared.usable == plan.usable
    tensors = [i.tensor_data for i in shared.items if i.tensor_data is not None]
    assert len({id(d.properties) for d in tensors}) == 3  # one per dtype (DCP made one per tensor)
    assert len({id(d.chunk.offsets) for d in tensors}) == 2  # offsets of 1-d and 2-d tensors
    by_size: dict = {}
    for d in tensors:
        assert by_size.setdefault(tuple(d.size), d.size) is d.size and d.chunk.sizes is d.size
    assert not any(d.properties is o.tensor_data.properties for d, o in zip(tensors, plan.items))  # our own objects
    assert len(pickle.dumps(shared)) < 0.85 * len(pickle.dumps(plan))
    back = pickle.loads(pickle.dumps(shared))  # what the coordinator works on: the sharing survives
    assert back.items == plan.items
    assert len({id(i.tensor_data.properties) for i in back.items if i.tensor_data is not None}) == 3


def test_a_callers_own_properties_object_stays_its_own():
    """A ShardedTensor's items carry its own metadata's properties, which it may edit later."""
    theirs = TensorProperties(dtype=torch.float32)
    size = torch.Size([4])
    items = [
        WriteItem(
            index=MetadataIndex(f"t{i}", torch.Size([0])), type=WriteItemType.SHARD,
            tensor_data=TensorWriteData(ChunkStorageMetadata(torch.Size([0]), size), theirs, size),
        )
        for i in range(3)
    ]
    shared = shared_save_plan(SavePlan(items))
    props = {id(i.tensor_data.properties) for i in shared.items}
    assert len(props) == 1 and id(theirs) not in props
    theirs.requires_grad = True  # the caller's edit after the plan was made
    assert not any(i.tensor_data.properties.requires_grad for i in shared.items)


def test_the_planners_own_plan_is_shared_already():
    plan = _local_plan(DataStatesSavePlanner, _state())
    shared = shared_save_plan(plan)
    assert all(a is b for a, b in zip(shared.items, plan.items))  # nothing rebuilt


def test_a_load_plan_shares_sizes_and_an_index_equal_to_its_destination():
    state = _state(60)
    item = ReadItem(
        type=torch.distributed.checkpoint.planner.LoadItemType.TENSOR,
        dest_index=MetadataIndex("x", [0], 0), dest_offsets=torch.Size([0]),
        storage_index=MetadataIndex("x", [0], 2), storage_offsets=torch.Size([0]), lengths=torch.Size([4]),
    )
    planner = DefaultLoadPlanner()
    planner.set_up_planner(state, _metadata_of(state), is_coordinator=True)
    plan = planner.create_local_plan()
    plan = LoadPlan([*plan.items, item], plan.storage_data, plan.planner_data)
    shared = shared_load_plan(plan)
    assert shared.items == plan.items
    tensors = [i for i in shared.items if i.type == torch.distributed.checkpoint.planner.LoadItemType.TENSOR]
    assert all(i.storage_index is i.dest_index for i in tensors[:-1])
    last = shared.items[-1]
    assert last.storage_index is not last.dest_index and last.storage_index.index == 2  # another hint: kept
    assert len({id(i.dest_offsets) for i in tensors} | {id(i.storage_offsets) for i in tensors}) == 2
    assert len(pickle.dumps(shared)) < 0.85 * len(pickle.dumps(plan))


def _metadata_of(state):
    planner = DefaultSavePlanner()
    planner.set_up_planner(state, is_coordinator=True)
    _, metadata = planner.create_global_plan([planner.create_local_plan()])
    return metadata


class _Recording(DataStatesWriter):
    def finish(self, metadata, results):
        self.sent = results
        return super().finish(metadata, results)


def test_a_save_with_dcps_planner_round_trips_and_each_rank_sends_one_write_result(tmp_path):
    state = _state()
    writer = _Recording(tmp_path / "ckpt")
    metadata = dcp.save(state, storage_writer=writer, no_dist=True)
    assert [len(r) for r in writer.sent] == [1]  # the rank's report, with every item's entry
    assert len(writer.sent[0][0].storage_data.items) == len(state)
    assert metadata.state_dict_metadata == _metadata_of(state).state_dict_metadata
    out = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else None for k, v in state.items()}
    dcp.load(out, storage_reader=DataStatesReader(tmp_path / "ckpt"), no_dist=True)
    for k, v in state.items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(out[k], v) and out[k].dtype == v.dtype, k
    assert out["step"] == 7


def test_a_planners_own_item_classes_are_kept():
    import dataclasses

    @dataclasses.dataclass(frozen=True)
    class TaggedItem(WriteItem):
        tag: str = ""

    @dataclasses.dataclass(frozen=True)
    class TaggedRead(ReadItem):
        tag: str = ""

    size = torch.Size([4])
    props = TensorProperties(dtype=torch.float32)
    items = [
        TaggedItem(
            index=MetadataIndex(f"t{i}", torch.Size([0])), type=WriteItemType.TENSOR, tag=f"x{i}",
            tensor_data=TensorWriteData(ChunkStorageMetadata(torch.Size([0]), torch.Size([4])), props, size),
        )
        for i in range(2)
    ]
    shared = shared_save_plan(SavePlan(items))
    assert [type(i) for i in shared.items] == [TaggedItem] * 2 and [i.tag for i in shared.items] == ["x0", "x1"]
    assert shared.items == items and shared.items[0].tensor_data.properties is shared.items[1].tensor_data.properties
    reads = [
        TaggedRead(
            type=torch.distributed.checkpoint.planner.LoadItemType.TENSOR, dest_index=MetadataIndex("t", [0]),
            dest_offsets=torch.Size([0]), storage_index=MetadataIndex("t", [0]), storage_offsets=torch.Size([0]),
            lengths=torch.Size([4]), tag="r",
        )
    ]
    back = shared_load_plan(LoadPlan(reads))
    assert type(back.items[0]) is TaggedRead and back.items[0].tag == "r" and back.items == reads
