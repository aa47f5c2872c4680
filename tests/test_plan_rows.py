"""The plans DCP pickles in its collectives, as rows with equal values as one object each: the
same items and fields back, of the same classes, never holding a caller's mutable object, in a
fraction of the bytes; another row layout fails by name."""

from __future__ import annotations

import copy
import dataclasses
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import (
    BytesIOWriteData,
    LoadItemType,
    LoadPlan,
    ReadItem,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)

from dcp_datastates import DataStatesReader, DataStatesSavePlanner, DataStatesWriter
from dcp_datastates.core import plan_rows
from dcp_datastates.core.plan_rows import RowLoadPlan, RowMetadata, RowSavePlan, row_plan
from dcp_datastates.errors import CheckpointError


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


def _pickled(obj):
    return pickle.loads(pickle.dumps(obj))


def test_a_save_plan_is_pickled_as_rows_with_equal_values_shared():
    plan = _local_plan(DefaultSavePlanner, _state())
    rows = row_plan(plan)
    assert type(rows) is RowSavePlan and rows.items is plan.items  # the same items, nothing rebuilt
    assert (rows.storage_data, rows.planner_data, rows.usable) == (plan.storage_data, plan.planner_data, plan.usable)
    assert len(pickle.dumps(rows)) < 0.6 * len(pickle.dumps(plan))
    back = _pickled(rows)  # what the coordinator works on
    assert type(back) is RowSavePlan and back.items == plan.items
    assert [type(i) for i in back.items] == [type(i) for i in plan.items]
    tensors = [i.tensor_data for i in back.items if i.tensor_data is not None]
    assert len({id(d.properties) for d in tensors}) == 3  # one per dtype (DCP made one per tensor)
    assert len({id(d.chunk.offsets) for d in tensors}) == 2  # offsets of 1-d and 2-d tensors
    by_size: dict = {}
    for d in tensors:
        assert by_size.setdefault(tuple(d.size), d.size) is d.size and d.chunk.sizes is d.size
    assert _pickled(back).items == plan.items  # and again: the global plans are scattered as rows
    assert type(dataclasses.replace(back, storage_data="x")) is RowSavePlan
    assert copy.deepcopy(back).items == plan.items


def test_the_rows_keep_none_offsets_bytes_items_and_the_index_hints():
    items = [
        WriteItem(index=MetadataIndex("obj"), type=WriteItemType.BYTE_IO),
        WriteItem(index=MetadataIndex("obj2", None, 3), type=WriteItemType.BYTE_IO, bytes_io_data=BytesIOWriteData(12)),
        WriteItem(
            index=MetadataIndex("t", torch.Size([2, 0]), 5), type=WriteItemType.SHARD,
            tensor_data=TensorWriteData(
                ChunkStorageMetadata(torch.Size([2, 0]), torch.Size([2, 3])), TensorProperties(torch.int8), torch.Size([4, 3])
            ),
        ),
    ]
    back = _pickled(row_plan(SavePlan(items, storage_data={"a": 1}, planner_data=[7], usable=True)))
    assert back.items == items and [i.index.index for i in back.items] == [None, 3, 5]
    assert back.items[0].index.offset is None and back.items[1].bytes_io_data == BytesIOWriteData(12)
    assert (back.storage_data, back.planner_data) == ({"a": 1}, [7])


def test_the_coordinator_never_holds_a_callers_own_properties_object():
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
    back = _pickled(row_plan(SavePlan(items)))
    props = {id(i.tensor_data.properties) for i in back.items}
    assert len(props) == 1 and id(theirs) not in props
    theirs.requires_grad = True  # the caller's edit after the plan was made
    assert not any(i.tensor_data.properties.requires_grad for i in back.items)


def test_the_planners_own_plan_pickles_as_small_rows():
    plan = _local_plan(DataStatesSavePlanner, _state())
    rows = row_plan(plan)
    assert rows.items is plan.items and _pickled(rows).items == plan.items
    assert len(pickle.dumps(rows)) < 0.6 * len(pickle.dumps(plan))


def test_a_load_plan_shares_sizes_and_an_index_equal_to_its_destination():
    state = _state(60)
    item = ReadItem(
        type=LoadItemType.TENSOR,
        dest_index=MetadataIndex("x", [0], 0), dest_offsets=torch.Size([0]),
        storage_index=MetadataIndex("x", [0], 2), storage_offsets=torch.Size([0]), lengths=torch.Size([4]),
    )
    planner = DefaultLoadPlanner()
    planner.set_up_planner(state, _metadata_of(state), is_coordinator=True)
    plan = planner.create_local_plan()
    plan = LoadPlan([*plan.items, item], plan.storage_data, plan.planner_data)
    rows = row_plan(plan)
    assert type(rows) is RowLoadPlan and rows.items is plan.items
    back = _pickled(rows)
    assert type(back) is RowLoadPlan and back.items == plan.items
    assert [i.storage_index.index for i in back.items] == [i.storage_index.index for i in plan.items]
    tensors = [i for i in back.items if i.type == LoadItemType.TENSOR]
    assert all(i.storage_index is i.dest_index for i in tensors[:-1])
    last = back.items[-1]
    assert last.storage_index is not last.dest_index and last.storage_index.index == 2  # another hint: kept
    assert len({id(i.dest_offsets) for i in tensors} | {id(i.storage_offsets) for i in tensors}) == 2
    assert len(pickle.dumps(rows)) < 0.6 * len(pickle.dumps(plan))
    assert _pickled(back).items == plan.items


def test_a_rank_of_another_row_layout_fails_by_name(monkeypatch):
    blob = pickle.dumps(row_plan(_local_plan(DefaultSavePlanner, _state(3))))
    monkeypatch.setattr(plan_rows, "ROWS_VERSION", 2)
    with pytest.raises(CheckpointError, match="row layout 1, this rank reads layout 2.*same version"):
        pickle.loads(blob)


def test_the_rows_fit_this_torchs_plan_classes():
    """The rows rebuild DCP's public dataclasses from their fields in order: pinned here, so a
    torch that changes them shows up as a failure rather than as slower pickles."""
    assert plan_rows.ROWS_FIT


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


@dataclasses.dataclass(frozen=True)
class TaggedItem(WriteItem):
    tag: str = ""


@dataclasses.dataclass(frozen=True)
class TaggedRead(ReadItem):
    tag: str = ""


def test_a_planners_own_item_classes_are_kept():
    size = torch.Size([4])
    props = TensorProperties(dtype=torch.float32)
    items = [
        TaggedItem(
            index=MetadataIndex(f"t{i}", torch.Size([0])), type=WriteItemType.TENSOR, tag=f"x{i}",
            tensor_data=TensorWriteData(ChunkStorageMetadata(torch.Size([0]), torch.Size([4])), props, size),
        )
        for i in range(2)
    ]
    plain = WriteItem(index=MetadataIndex("p"), type=WriteItemType.BYTE_IO)
    back = _pickled(row_plan(SavePlan([items[0], plain, items[1]])))
    assert [type(i) for i in back.items] == [TaggedItem, WriteItem, TaggedItem]  # in their places
    assert [getattr(i, "tag", None) for i in back.items] == ["x0", None, "x1"] and back.items == [items[0], plain, items[1]]

    class OwnPlan(SavePlan):
        pass

    own = OwnPlan(items)
    assert row_plan(own) is own  # a planner's own plan class: pickled as it is
    reads = [
        TaggedRead(
            type=LoadItemType.TENSOR, dest_index=MetadataIndex("t", [0]),
            dest_offsets=torch.Size([0]), storage_index=MetadataIndex("t", [0]), storage_offsets=torch.Size([0]),
            lengths=torch.Size([4]), tag="r",
        )
    ]
    back = _pickled(row_plan(LoadPlan(reads)))
    assert type(back.items[0]) is TaggedRead and back.items[0].tag == "r" and back.items == reads


def test_the_planners_metadata_is_broadcast_as_rows_and_written_as_dcps(tmp_path):
    state = _state()
    metadata = dcp.save(state, storage_writer=DataStatesWriter(tmp_path / "ckpt"), planner=DataStatesSavePlanner(),
                        no_dist=True)
    assert type(metadata) is RowMetadata
    back = _pickled(metadata)  # what the other ranks get from DCP's broadcast
    assert type(back) is RowMetadata and back.state_dict_metadata == metadata.state_dict_metadata
    assert (back.planner_data, back.storage_meta, back.version) == (metadata.planner_data, metadata.storage_meta, metadata.version)
    assert len(pickle.dumps(metadata)) < 0.8 * len(pickle.dumps(plan_rows.plain_metadata(metadata)))
    blob = (tmp_path / "ckpt" / ".metadata").read_bytes()
    assert b"plan_rows" not in blob and b"RowMetadata" not in blob  # DCP's own classes, for DCP's tools
    read = DataStatesReader(tmp_path / "ckpt").read_metadata()
    assert type(read) is Metadata and read.state_dict_metadata == metadata.state_dict_metadata
