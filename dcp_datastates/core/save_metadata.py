"""The checkpoint's final metadata, serialized while the engine still writes tensor bytes.

Offsets are fixed when the items are placed, so the coordinator predicts the checkpoint's
layout (:mod:`coordinator_layout`) and stages its ``.metadata`` (encoded, written under a
temporary name) during ``write_data``; ``finish`` keeps it if the ranks' reports confirm the
prediction, and stages it again otherwise. This module is that staging, for
:class:`DataStatesWriter`."""

from __future__ import annotations

import time

from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner

from dcp_datastates import _dcp_compat
from dcp_datastates.core.coordinator_layout import predict_layout, predict_staged_layout
from dcp_datastates.core.placement import PlacementRule
from dcp_datastates.core.plan_rows import plain_metadata
from dcp_datastates.core.save_state import RankSave, StagedMetadata
from dcp_datastates.format.checkpoint_layout import CheckpointLayout
from dcp_datastates.format.metadata_file import encode_metadata


def stage_predicted(save: RankSave, planner: SavePlanner, rule: PlacementRule, own, sequence: int) -> None:
    """Predict the layout (the coordinator's own placement ``own`` included; ``rule``: the save's
    placement rule) and stage the final metadata with it; without a prediction (or without
    the planner's metadata), ``finish`` serializes it."""
    if save.target.asynchronous:
        prediction = predict_staged_layout(list(save.plans), save.target.save_id) if save.plans else None
    else:
        plans = save.plans or _cached_global_plans(planner)
        prediction = predict_layout(plans, rule, own) if plans else None
    save.prediction = prediction
    metadata = getattr(planner, "metadata", None)
    if prediction is None or not isinstance(metadata, Metadata):
        return
    t = time.perf_counter()
    stage(save, metadata, prediction.layout, sequence)
    save.stats.metadata_serialize_s = time.perf_counter() - t


def stage(save: RankSave, metadata: Metadata, layout: CheckpointLayout, sequence: int) -> None:
    """Encode ``metadata`` with ``layout`` (commit sequence ``sequence``) under a temporary name
    of the save's destination, for the commit."""
    metadata.storage_data = layout
    metadata.storage_meta = StorageMeta(checkpoint_id=save.target.path, save_id=save.target.dcp_save_id)
    version = _dcp_compat.dcp_metadata_version()
    if version is not None:
        metadata.version = version
    handle = save.target.dest.stage_metadata(layout.save_id, encode_metadata(plain_metadata(metadata), sequence))
    save.staged = StagedMetadata(metadata, layout, handle)


def discard(save: RankSave) -> None:
    """Remove the save's staged metadata (a prediction the reports refuted, a failed save)."""
    if save.staged is not None:
        save.target.dest.discard_metadata(save.staged.handle)
        save.staged = None


def _cached_global_plans(planner: SavePlanner) -> list[SavePlan] | None:
    """Every rank's final plan where DCP's cache stood in for some (``DefaultSavePlanner``
    keeps them as ``global_plan``); None where the planner keeps none."""
    plans = getattr(planner, "global_plan", None)
    if isinstance(plans, list) and plans and all(isinstance(p, SavePlan) and p.usable for p in plans):
        return plans
    return None
