"""What a checkpoint of the demo holds, and how a resumed run restores it.

A checkpoint is the whole training state: the FSDP2 model and optimizer
state dicts (DTensors, sharded over this run's ranks), the step, the data
position and the RNG. It is built the same way for both writers, so our
checkpoint of a step and DCP's can be compared entry by entry. A resume
builds the same structure for *this* run's world size as the template DCP
loads into (resharding the saved shards to it).
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from dcp_datastates import CheckpointManager
from dcp_datastates.demo.run_spec import RunSpec


def build_state(step: int, model: nn.Module, optim: torch.optim.Optimizer, spec: RunSpec) -> dict:
    model_sd, optim_sd = get_state_dict(model, optim)
    rng = {"torch": torch.get_rng_state()}
    return {
        "model": model_sd,
        "optim": optim_sd,
        "step": step,
        "data": {
            "seed": spec.seed,
            "next_step": step + 1,
            "global_batch": spec.global_batch,
            "samples_seen": step * spec.global_batch,
        },
        "rng": rng,
    }


def load_checkpoint(manager: CheckpointManager, model: nn.Module, optim: torch.optim.Optimizer,
                    spec: RunSpec) -> int:
    """Resume: the manager loads the newest committed checkpoint that loads (every byte verified)."""
    state = build_state(-1, model, optim, spec)  # template: shapes and shardings of this world
    state["data"] = {"seed": -1, "next_step": -1, "global_batch": -1, "samples_seen": -1}
    found = manager.load(state)
    path = manager.root
    if found is None:
        raise RuntimeError(f"no committed checkpoint under {path} to resume from")
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    torch.set_rng_state(state["rng"]["torch"])
    step = int(state["step"])
    data = state["data"]
    if found != step:
        raise RuntimeError(f"{manager.path_of(found)} holds step {step}, its directory name says {found}")
    if data["seed"] != spec.seed or data["global_batch"] != spec.global_batch or data["next_step"] != step + 1:
        raise RuntimeError(f"{path}: data position {data} does not match this run (seed {spec.seed})")
    return step
