"""DataStatesSavePlanner: DCP's default save planning in one pass per item, with the same results."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from conftest import load
from dcp_datastates import DataStatesReader, DataStatesSavePlanner, DataStatesWriter, verify
from dcp_datastates.core.planner import _global_plan_and_metadata
from dcp_datastates.format.metadata_file import read_metadata_file


def _flat_state():
    g = torch.Generator().manual_seed(3)
    state = {f"t{i}": torch.randn(5, i + 1, generator=g) for i in range(20)}
    state.update({
        "bf16": torch.randn(7, generator=g).to(torch.bfloat16),
        "ints": torch.arange(9, dtype=torch.int32),
        "grad": torch.randn(3, generator=g).requires_grad_(),
        "zero_d": torch.tensor(2.5),
        "empty": torch.empty(0, 4),
        "strided": torch.randn(4, 6, generator=g).t(),
        "mask": torch.arange(6) % 2 == 0,
        "step": 11, "lr": 0.5, "name": "run", "flag": True, "none": None, "raw": b"\x00\x01",
    })
    return state


def _nested_state():
    return {"model": {"w": torch.ones(3, 2), "b": torch.zeros(2)}, "optim": {"state": {0: {"exp": torch.ones(3)}}, "lr": [0.1, 0.2]}, "step": 3}


def _training_state():
    """What a training loop saves: a module's and an optimizer's state_dict() (OrderedDict, int
    keys, param_groups as a list of dicts), with every kind of leaf DCP's flattening knows."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    optim = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    optim.step()
    return {
        "model": model.state_dict(),
        "optim": optim.state_dict(),
        "extra": {
            "terminal_list": [1, 2.5, "x", (3, 4)], "nested_lists": [[1, 2], [torch.ones(2)]],
            "tuple_leaf": (torch.ones(1), 2), "empty": {}, "deep": {"empty": {}, "t": torch.arange(3)},
            "tensors": [torch.zeros(2), {"in_list": torch.ones(1)}],
        },
        "step": 7,
    }


def _plans(planner_cls, state, ranks=1):
    planner = planner_cls()
    planner.set_up_planner(state, None, True)
    local = planner.create_local_plan()
    global_plans, metadata = planner.create_global_plan([local] * ranks)
    return planner, local, global_plans, metadata


def _item_key(item, hint=True):
    td = item.tensor_data
    return (item.index, item.index.index if hint else None, item.type, None if td is None else (td.chunk, td.properties, td.size))


@pytest.mark.parametrize("make", [_flat_state, _nested_state, _training_state], ids=["flat", "nested", "training"])
def test_plans_and_metadata_equal_the_default_planners(make):
    state = make()
    ours = _plans(DataStatesSavePlanner, state)
    dcps = _plans(DefaultSavePlanner, state)
    assert ours[0]._flat  # the one-pass path made these plans
    assert ours[0].mappings == dcps[0].mappings
    assert list(ours[0].state_dict) == list(dcps[0].state_dict)
    # Local items are equal (a MetadataIndex compares without its index hint, which ours sets early).
    assert [_item_key(i, hint=False) for i in ours[1].items] == [_item_key(i, hint=False) for i in dcps[1].items]
    assert ours[1].planner_data == dcps[1].planner_data
    assert [[_item_key(i) for i in p.items] for p in ours[2]] == [[_item_key(i) for i in p.items] for p in dcps[2]]
    assert ours[3].state_dict_metadata == dcps[3].state_dict_metadata
    assert ours[3].planner_data == dcps[3].planner_data
    for item in ours[2][0].items:  # what write_data gets back for each item
        got, want = ours[0].resolve_data(item), dcps[0].resolve_data(item)
        assert type(got) is type(want)
        if isinstance(got, torch.Tensor):
            assert got is want


def test_tensor_subclasses_and_other_mappings_go_through_dcps_flattening():
    import types

    param = {"model": {"w": torch.nn.Parameter(torch.ones(2))}, "b": torch.zeros(1)}
    proxy = {"model": types.MappingProxyType({"w": torch.ones(2)})}
    for state in (param, proxy):
        ours = _plans(DataStatesSavePlanner, state)
        dcps = _plans(DefaultSavePlanner, state)
        assert not ours[0]._flat
        assert ours[3].state_dict_metadata == dcps[3].state_dict_metadata and ours[0].mappings == dcps[0].mappings


def test_a_key_two_paths_join_to_is_refused_like_dcp():
    state = {"a.b": torch.ones(1), "a": {"b": torch.zeros(1)}}
    for planner_cls in (DataStatesSavePlanner, DefaultSavePlanner):
        with pytest.raises(ValueError, match="duplicated flatten key a.b"):
            planner_cls().set_up_planner(state, None, True)


def test_flat_state_dicts_share_tensor_properties():
    _, local, _, metadata = _plans(DataStatesSavePlanner, _flat_state())
    props = {id(i.tensor_data.properties) for i in local.items if i.tensor_data is not None and i.index.fqn.startswith("t")}
    assert len(props) == 1  # 20 float32 tensors, one TensorProperties
    assert metadata.state_dict_metadata["grad"].properties.requires_grad


def test_a_replicated_plan_of_several_ranks_is_deduplicated_like_dcps():
    ours = _plans(DataStatesSavePlanner, _flat_state(), ranks=2)
    dcps = _plans(DefaultSavePlanner, _flat_state(), ranks=2)
    assert [[_item_key(i) for i in p.items] for p in ours[2]] == [[_item_key(i) for i in p.items] for p in dcps[2]]
    assert ours[3].state_dict_metadata == dcps[3].state_dict_metadata


def test_an_invalid_global_plan_is_refused_by_dcps_validation():
    from test_dcp_compat import _plan

    planner = DataStatesSavePlanner()
    planner.set_up_planner({}, None, True)
    with pytest.raises(ValueError, match="Failed to validate global plan"):
        planner.create_global_plan([_plan("w", (0,), (3,), (4,)), _plan("w", (2,), (3,), (4,))])
    with pytest.raises(ValueError, match="'w' is planned twice"):
        _global_plan_and_metadata([_flat_plan("w"), _flat_plan("w")])


def _flat_plan(fqn):
    planner = DataStatesSavePlanner()
    planner.set_up_planner({fqn: torch.ones(2)}, None, True)
    return planner.create_local_plan()


def test_saves_with_the_planner_round_trip_with_the_writers_layout(tmp_path):
    state = {**_flat_state(), **{f"big{i}": torch.randn(256, 256) for i in range(3)}}
    writer = DataStatesWriter(tmp_path / "c", stripes=3)
    dcp.save(state, storage_writer=writer, planner=DataStatesSavePlanner(), no_dist=True)
    metadata, _ = read_metadata_file(os.path.join(tmp_path / "c", ".metadata"))
    assert len(metadata.storage_data.ranks[0].stripes) == 2  # placed by the writer, with its stripes
    out = {k: (torch.zeros_like(v.contiguous()) if isinstance(v, torch.Tensor) else None) for k, v in state.items()}
    load(out, tmp_path / "c")
    for k, v in state.items():
        if isinstance(v, torch.Tensor):
            assert out[k].dtype == v.dtype and torch.equal(out[k], v), k
        else:
            assert out[k] == v, k
    assert verify(tmp_path / "c").ok


class _CachingPlanner(DataStatesSavePlanner):
    """DCP keys its plan cache by the planner's class name: one of our own here."""


def test_dcp_plan_caching_is_supported(tmp_path):
    state = _flat_state()
    for i in range(3):
        state["step"] = i
        writer = DataStatesWriter(tmp_path / f"s{i}")
        dcp.save(state, storage_writer=writer, planner=_CachingPlanner(enable_plan_caching=True), no_dist=True)
        assert writer.last_save_stats.plan_from_cache == (i > 0)
        out = load({k: (torch.zeros_like(v.contiguous()) if isinstance(v, torch.Tensor) else None) for k, v in state.items()}, tmp_path / f"s{i}")
        assert out["step"] == i and torch.equal(out["strided"], state["strided"])


class _CachingPlanner2(DataStatesSavePlanner):
    """A second cache key, for the test below."""


def test_plan_caching_replans_when_the_structure_changes(tmp_path):
    state = _training_state()
    for i, grow in enumerate([False, False, True, True]):
        if grow:
            state["model"]["new"] = torch.full((4,), float(i))
        writer = DataStatesWriter(tmp_path / f"s{i}")
        dcp.save(state, storage_writer=writer, planner=_CachingPlanner2(enable_plan_caching=True), no_dist=True)
        assert writer.last_save_stats.plan_from_cache == (i in (1, 3)), i
        out = {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()}}
        dcp.load(out, storage_reader=DataStatesReader(tmp_path / f"s{i}"), no_dist=True)
        for k, v in state["model"].items():
            assert torch.equal(out["model"][k], v), (i, k)


class _HalfEmbeddings(DataStatesSavePlanner):
    """DCP's documented extension: edit the local plan's properties in place (FP16Planner)."""

    def create_local_plan(self):
        plan = super().create_local_plan()
        for item in plan.items:
            if item.index.fqn == "t3":
                item.tensor_data.properties.dtype = torch.float16
        return plan


class _Doubling(DataStatesSavePlanner):
    """DCP's other extension points: transform_object sees every tensor."""

    def transform_object(self, write_item, object):
        return object * 2 if isinstance(object, torch.Tensor) else super().transform_object(write_item, object)


def test_subclasses_that_edit_properties_or_transform_objects_keep_dcps_semantics():
    planner, local, _, metadata = _plans(_HalfEmbeddings, _flat_state())
    dtypes = {i.index.fqn: i.tensor_data.properties.dtype for i in local.items if i.tensor_data is not None}
    assert dtypes["t3"] == torch.float16 and dtypes["t4"] == torch.float32  # no shared object edited
    assert metadata.state_dict_metadata["t5"].properties.dtype == torch.float32
    state = _flat_state()
    planner, _, plans, _ = _plans(_Doubling, state)
    item = next(i for i in plans[0].items if i.index.fqn == "t2")
    assert torch.equal(planner.resolve_data(item), state["t2"] * 2)


def test_a_subclass_global_planning_step_is_used():
    calls = []

    class Own(DataStatesSavePlanner):
        def _create_global_plan(self, all_plans):
            calls.append(len(all_plans))
            return super()._create_global_plan(all_plans)

    ours = _plans(Own, _flat_state())
    assert calls == [1]
    assert ours[3].state_dict_metadata == _plans(DefaultSavePlanner, _flat_state())[3].state_dict_metadata


# -- the coordinator's step at scale: deduplication and validation like DCP's, in linear time --


def _chunk_item(fqn, offsets, sizes, size, dtype=torch.float32):
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

    return WriteItem(
        index=MetadataIndex(fqn, torch.Size(offsets)), type=WriteItemType.SHARD if size else WriteItemType.TENSOR,
        tensor_data=TensorWriteData(
            chunk=ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes)),
            properties=TensorProperties(dtype=dtype), size=torch.Size(size),
        ),
    )


def _random_plans(rng, ranks):
    """Plans as ranks make them: each rank's shard of some tensors, replicated tensors and
    objects that subsets of the ranks hold (sizes differ, so the choice of rank matters), and
    now and then one key twice in a plan."""
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType

    plans = [[] for _ in range(ranks)]
    for t in range(rng.randint(1, 6)):
        rows = rng.randint(1, 3 * ranks)
        step = -(-rows // ranks)
        for r in range(ranks):
            start = min(r * step, rows)
            plans[r].append(_chunk_item(f"s{t}", (start, 0), (max(0, min(step, rows - start)), 3), (rows, 3)))
    for t in range(rng.randint(1, 8)):
        holders = sorted(rng.sample(range(ranks), rng.randint(1, ranks)))
        shape = (rng.randint(1, 50),)
        for r in holders:
            if rng.random() < 0.2:
                plans[r].append(WriteItem(index=MetadataIndex(f"o{t}"), type=WriteItemType.BYTE_IO))
            else:
                plans[r].append(_chunk_item(f"r{t}", (0,), shape, shape, rng.choice([torch.float32, torch.int8])))
    for p in plans:
        rng.shuffle(p)
        if p and rng.random() < 0.1:
            p.append(p[0])
    return [SavePlan(p) for p in plans]


@pytest.mark.parametrize("lowest", [False, True])
def test_deduplication_keeps_the_items_dcps_keeps(lowest):
    import random

    from torch.distributed.checkpoint._dedup_save_plans import dedup_save_plans as dcps_dedup

    from dcp_datastates.core.planner import dedup_save_plans

    rng = random.Random(7)
    for ranks in (1, 2, 3, 5, 16, 40):
        for _ in range(15):
            plans = _random_plans(rng, ranks)
            ours, dcps = dedup_save_plans(plans, lowest), dcps_dedup(plans, lowest)
            assert [[_item_key(i) for i in p.items] for p in ours] == [[_item_key(i) for i in p.items] for p in dcps]


def test_deduplication_ties_break_in_dcps_order_for_distant_ranks():
    from torch.distributed.checkpoint._dedup_save_plans import dedup_save_plans as dcps_dedup
    from torch.distributed.checkpoint.planner import SavePlan

    from dcp_datastates.core.planner import dedup_save_plans

    # Ranks 3 and 9000 hold the same item and nothing else: a set of {3, 9000} iterates 9000 first.
    plans = [SavePlan([]) for _ in range(9001)]
    plans[3] = plans[9000] = SavePlan([_chunk_item("w", (0,), (4,), (4,))])
    ours, dcps = dedup_save_plans(plans), dcps_dedup(plans)
    assert [len(p.items) for p in ours] == [len(p.items) for p in dcps]


def _box_cases():
    """Chunk lists of a (6, 8) tensor: valid tilings along either dimension and in a grid,
    with empty chunks, and broken ones (overlaps, gaps, out of bounds, an empty chunk inside
    another, which DCP's overlap test counts)."""
    rows = [((0, 0), (2, 8)), ((2, 0), (4, 8))]
    cols = [((0, c), (6, 2)) for c in range(0, 8, 2)]
    grid = [((r, c), (3, 4)) for r in (0, 3) for c in (0, 4)]
    empty_end = [((6, 0), (0, 8))]
    return {
        "rows": (rows, True), "cols": (cols, True), "grid": (grid, True),
        "cols+empty at the end": (cols + empty_end * 3, True),
        "overlap": (rows + [((1, 0), (1, 8))], False),
        "overlap in a grid": (grid[:3] + [((2, 3), (3, 4))], False),
        "gap": (rows[:1] + [((3, 0), (3, 8))], False),
        "out of bounds": (rows[:1] + [((2, 0), (5, 8))], False),
        "negative": ([((-1, 0), (7, 8))], False),
        "empty inside": (rows + [((1, 3), (0, 0))], False),
    }


@pytest.mark.parametrize("case", list(_box_cases()))
def test_the_plan_check_agrees_with_dcps_validation(case):
    from torch.distributed.checkpoint.planner import SavePlan

    from dcp_datastates import _dcp_compat
    from dcp_datastates.core.planner import _plan_is_suspect

    chunks, valid = _box_cases()[case]
    plans = [SavePlan([_chunk_item("w", o, s, (6, 8))]) for o, s in chunks]
    _, metadata = _global_plan_and_metadata(plans)
    assert bool(_dcp_compat.validate_global_save_plan(plans, metadata)) is not valid
    assert _plan_is_suspect(plans, metadata) is not valid
    for perm in (plans[::-1], plans[1:] + plans[:1]):  # the order the ranks come in does not matter
        _, metadata = _global_plan_and_metadata(perm)
        assert _plan_is_suspect(perm, metadata) is not valid


def test_a_valid_plan_sharded_along_its_smaller_dimension_skips_dcps_quadratic_sweep(monkeypatch):
    from torch.distributed.checkpoint import default_planner
    from torch.distributed.checkpoint.planner import SavePlan

    # A (1024, 4096) weight sharded on dim 0 over 1024 ranks: DCP sweeps dim 1, where every
    # chunk spans the whole tensor, and compares each chunk with every earlier one.
    monkeypatch.setattr(default_planner, "_validate_global_plan", lambda *a: pytest.fail("DCP's validation ran"))
    plans = [SavePlan([_chunk_item("w2", (r, 0), (1, 4096), (1024, 4096))]) for r in range(1024)]
    _, metadata = DataStatesSavePlanner().create_global_plan(plans)
    assert len(metadata.state_dict_metadata["w2"].chunks) == 1024


def test_the_predicted_layout_names_each_key_with_the_metadatas_string():
    import pickle

    from torch.distributed.checkpoint.planner import SavePlan

    from dcp_datastates.core.coordinator_layout import predict_layout
    from dcp_datastates.core.placement import PlacementRule
    from dcp_datastates.format.storage_data import layout_to_plain

    # Each rank's plan has its own copy of the key (as after the gather): the pickle of the
    # metadata and the layout then spells it once.
    plans = [SavePlan([_chunk_item("".join(["model.", "layer.weight"]), (r, 0), (1, 8), (4, 8))]) for r in range(4)]
    final, metadata = DataStatesSavePlanner().create_global_plan(plans)
    layout = predict_layout(final, PlacementRule("5ca1ab1e0001")).layout
    key = next(iter(metadata.state_dict_metadata))
    assert all(entry[0] is key for entry in layout.entries)
    blob = pickle.dumps((metadata.state_dict_metadata, layout_to_plain(layout)), protocol=pickle.HIGHEST_PROTOCOL)
    assert blob.count(b"model.layer.weight") == 1


def test_the_global_step_pauses_the_gc_only_in_the_main_thread(monkeypatch):
    import gc
    import threading

    from torch.distributed.checkpoint.planner import SavePlan

    plans = [SavePlan([_chunk_item("w", (r,), (1,), (4,))]) for r in range(4)]
    seen = []
    real_disable = gc.disable
    monkeypatch.setattr(gc, "disable", lambda: (seen.append(threading.current_thread()), real_disable()))
    DataStatesSavePlanner().create_global_plan(plans)
    assert seen == [threading.main_thread()] and gc.isenabled()  # paused, then restored
    seen.clear()
    results = []
    worker = threading.Thread(target=lambda: results.append(DataStatesSavePlanner().create_global_plan(plans)))
    worker.start()
    worker.join()
    assert seen == [] and len(results[0][1].state_dict_metadata["w"].chunks) == 4  # another thread's save: untouched


def test_our_planner_plans_with_the_collector_paused_and_restores_it(tmp_path):
    """Its planning steps make objects per item that form no cycles: no collection walks the heap
    meanwhile; the collector is on again after, and left off where the application switched it off."""
    import gc

    seen = []

    class Probe(DataStatesSavePlanner):
        def _local_plan(self):
            seen.append(gc.isenabled())
            return super()._local_plan()

    state = {f"t{i}": torch.full((8,), float(i)) for i in range(4)}
    dcp.save(state, storage_writer=DataStatesWriter(str(tmp_path / "a")), planner=Probe(), no_dist=True)
    assert seen == [False] and gc.isenabled()
    gc.disable()
    try:
        dcp.save(state, storage_writer=DataStatesWriter(str(tmp_path / "b")), planner=Probe(), no_dist=True)
        assert seen == [False, False] and not gc.isenabled()
    finally:
        gc.enable()
