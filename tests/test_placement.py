"""Placement as pure functions: each rank places its own items; the coordinator predicts the
layout from the plans and keeps it only where the ranks' reports confirm it."""

from __future__ import annotations

import dataclasses
import pickle

import pytest
import torch
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan
from torch.distributed.checkpoint.storage import WriteResult

from dcp_datastates import DataStatesSavePlanner
from dcp_datastates.core.coordinator_layout import LayoutPrediction, layout_from_reports, predict_layout
from dcp_datastates.core.placement import PAGE, SMALL_ALIGN, PlacementRule, place_rank, rule_to_place
from dcp_datastates.core.rank_reports import REPORT_INDEX, RankReport, item_entry, rank_results, split_reports
from dcp_datastates.errors import CheckpointError
from dcp_datastates.format.checkpoint_layout import ItemLocation

MB = 1 << 20


def plan_of(state: dict) -> SavePlan:
    planner = DataStatesSavePlanner()
    planner.set_up_planner(state, is_coordinator=True)
    return planner.create_local_plan()


def items_of(rank: int) -> SavePlan:
    return plan_of({
        f"small{rank}": torch.zeros(3), f"big{rank}": torch.zeros(MB // 4), f"more{rank}": torch.zeros(MB // 4),
        f"obj{rank}": "an object",
    })


def by_fqn(placement) -> dict:
    return {index.fqn: loc for index, loc in placement.locations.items()}


def test_place_rank_packs_small_tensors_pages_large_ones_and_numbers_objects():
    rule = PlacementRule("0123456789ab")
    placement = place_rank(plan_of({"a": torch.zeros(3), "b": torch.zeros(MB // 4), "c": torch.zeros(5), "o": 1}).items, 2, rule)
    locs = by_fqn(placement)
    assert placement.data_file == "rank00002-0123456789ab.data" and placement.index_file == "rank00002-0123456789ab.index"
    assert locs["a"] == ItemLocation(placement.data_file, 0, 12, -1)
    assert locs["c"] == ItemLocation(placement.data_file, SMALL_ALIGN, 20, -1)
    assert locs["b"] == ItemLocation(placement.data_file, PAGE, MB, -1)
    assert locs["o"] == ItemLocation(placement.data_file, -1, -1, 0)
    assert placement.tensor_bytes_end == PAGE + MB and placement.objects_base == PAGE + MB
    assert placement.stripes == () and placement.file_names() == [placement.data_file, placement.index_file]


def test_place_rank_stripes_and_compression_follow_the_rule():
    items = items_of(0).items
    striped = place_rank(items, 0, PlacementRule("0123456789ab", None, (2, 0)))
    assert striped.stripes == (by_fqn(striped)["more0"].offset,)
    assert striped.file_names() == ["rank00000-0123456789ab.data", "rank00000-0123456789ab.s1.data", "rank00000-0123456789ab.index"]
    compressed = place_rank(items, 0, PlacementRule("0123456789ab", ("zstd", 4 * MB), (2, 0)))
    locs = by_fqn(compressed)
    assert compressed.stripes == ()  # a compressed rank is one file
    assert locs["obj0"].object_ordinal == 0 and locs["big0"].is_compressed and locs["big0"].object_ordinal == 1
    assert locs["more0"].object_ordinal == 2 and locs["small0"].offset == 0


def test_a_rule_is_placed_by_once_then_a_rank_uses_its_own():
    sent, own = PlacementRule("aaaaaaaaaaaa"), PlacementRule("bbbbbbbbbbbb")
    assert rule_to_place(sent, own) is sent
    assert rule_to_place(sent, own) is own  # DCP's plan cache handed the same plan back
    assert rule_to_place(dataclasses.replace(sent), own) is not own  # an equal rule of a new save
    assert rule_to_place(object(), own) is own  # another writer's storage data
    with pytest.raises(CheckpointError, match="prepare_global_plan"):
        rule_to_place(None, own)


def _written(prediction: LayoutPrediction, rank: int) -> list[tuple]:
    """The item entries of rank ``rank`` had it written every item where the prediction says."""
    files = prediction.layout.ranks[rank]
    return [(fqn, off, files.data_file, *where) for (fqn, off), where in prediction.expected[rank].items()]


def _report(files, **kw) -> RankReport:
    return RankReport(files.data_file, files.index_file, "0123456789ab", None, files.stripes, **kw)


def test_the_prediction_holds_only_where_the_reports_confirm_it():
    rule = PlacementRule("0123456789ab", None, (2, 0))
    plans = [items_of(0), items_of(1)]
    own = place_rank(plans[0].items, 0, rule)
    prediction = predict_layout(plans, rule, own)
    assert prediction.expected[0] == {
        (index.fqn, tuple(index.offset) if index.offset is not None else None): (loc.offset, loc.length, loc.object_ordinal)
        for index, loc in own.locations.items()
    }
    assert [r.save_id for r in prediction.layout.ranks] == ["", ""] and prediction.layout.save_id == rule.save_id
    results = [_written(prediction, 0), _written(prediction, 1)]
    reports = [_report(files) for files in prediction.layout.ranks]
    assert prediction.holds(results, reports)
    assert not prediction.holds(results, [reports[0], None])
    assert not prediction.holds(results, [reports[0], dataclasses.replace(reports[1], data_file="rank00001-ffffffffffff.data")])
    assert not prediction.holds(results, [reports[0], dataclasses.replace(reports[1], digests=(("big1", (0,), "0" * 32),))])
    assert not prediction.holds(results, [reports[0], dataclasses.replace(reports[1], compression=("zstd", 4 * MB))])
    moved = [(*e[:3], 8 * MB, *e[4:]) if e[0] == "big1" else e for e in results[1]]
    assert not prediction.holds([results[0], moved], reports)
    assert not prediction.holds([results[0], results[1][1:]], reports)  # an item not written
    twice = [results[1][0], *results[1][:-1]]  # as many entries, one of them twice and one missing
    assert not prediction.holds([results[0], twice], reports)
    elsewhere = [(e[0], e[1], "rank00001-ffffffffffff.data", *e[3:]) for e in results[1]]
    assert not prediction.holds([results[0], elsewhere], reports)


def test_the_layout_from_reports_names_each_ranks_files_and_checks_them():
    rule = PlacementRule("0123456789ab")
    plans = [items_of(0), items_of(1)]
    prediction = predict_layout(plans, rule)
    results = [_written(prediction, 0), _written(prediction, 1)]
    reports = [_report(files) for files in prediction.layout.ranks]
    metadata = DataStatesSavePlanner()
    metadata.set_up_planner({}, is_coordinator=True)
    _, md = metadata.create_global_plan(plans)
    layout = layout_from_reports(results, reports, rule.save_id, md, "here")
    assert [r.save_id for r in layout.ranks] == [rule.save_id] * 2  # explicit, as reported
    assert sorted(layout.entries) == sorted(prediction.layout.entries)
    stray = [results[0], [(e[0], e[1], "rank00007-0123456789ab.data", *e[3:]) for e in results[1]]]
    with pytest.raises(CheckpointError, match="rank 1's write result for '.*' names 'rank00007-0123456789ab.data'"):
        layout_from_reports(stray, reports, rule.save_id, md, "here")
    with pytest.raises(CheckpointError, match="rank 1 did not report its files"):
        layout_from_reports(results, [reports[0], None], rule.save_id, md, "here")
    with pytest.raises(CheckpointError, match="different compression"):
        layout_from_reports(results, [reports[0], dataclasses.replace(reports[1], compression=("zstd", 4 * MB))],
                            rule.save_id, md, "here")


def test_a_rank_reports_its_items_in_one_write_result():
    loc = ItemLocation("rank00000-0123456789ab.data", 0, 4, -1)
    entries = [item_entry(MetadataIndex("x", [0]), loc), item_entry(MetadataIndex("o"), ItemLocation(loc.relative_path, -1, -1, 0))]
    assert entries == [("x", (0,), loc.relative_path, 0, 4, -1), ("o", None, loc.relative_path, -1, -1, 0)]
    report = RankReport("rank00000-0123456789ab.data", "rank00000-0123456789ab.index", "0123456789ab")
    sent = rank_results(report, entries)
    assert len(sent) == 1 and sent[0].index == REPORT_INDEX
    assert pickle.loads(pickle.dumps(sent)) == sent  # what DCP gathers to the coordinator
    foreign = [WriteResult(index=MetadataIndex("x"), size_in_bytes=4, storage_data=loc)]  # another writer's results
    assert split_reports([sent, foreign]) == ([tuple(entries), ()], [dataclasses.replace(report, items=tuple(entries)), None])
