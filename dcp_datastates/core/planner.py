"""DataStatesSavePlanner: DCP's default planner plus our file layout.

DCP's ``DefaultSavePlanner`` flattens the state dict and deduplicates
replicated items across ranks. This subclass then fixes, for every item that
survives deduplication, its rank file and byte offset (see :mod:`layout`)
and completes ``Metadata.storage_data`` in the same step, so the metadata is
final when planning ends and can be serialized while the data is written.

Using it is optional: ``DataStatesWriter`` applies the same layout itself
when ``dcp.save`` runs with DCP's default planner. Pass it explicitly to keep
the layout inside the planner (for example when you subclass it further)::

    dcp.save(state, storage_writer=DataStatesWriter(path), planner=DataStatesSavePlanner())
"""

from __future__ import annotations

from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan

from dcp_datastates.core.layout import assign_checkpoint_layout, assign_staged_layout, has_staged_layout, new_save_id


class DataStatesSavePlanner(DefaultSavePlanner):
    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        if getattr(self, "_enable_plan_caching", False):
            raise NotImplementedError(
                "DataStatesSavePlanner does not support enable_plan_caching: every save gets new files"
            )
        plans, metadata = super().create_global_plan(all_plans)
        # Files get a new save id every save; storage_meta.save_id is DCP's id of the writer's
        # save (kept until reset(), as FileSystemWriter's), so it cannot name files.
        save_id = new_save_id()
        if has_staged_layout(plans):  # dcp.async_save: each rank's snapshot placed its tensors
            layout = assign_staged_layout(plans, save_id)
        else:
            plans, layout, _ = assign_checkpoint_layout(plans, save_id)
        metadata.storage_data = layout
        self.global_plan = plans
        return plans, metadata
