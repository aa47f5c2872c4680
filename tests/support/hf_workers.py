"""Gloo rank cases of tests/test_huggingface.py, launched by ``dist_helpers.run_ranks``.

Each rank builds the tiny model of a Hugging Face directory's ``config.json``
(other initial weights), shards it with FSDP2, fills it, and compares its
full parameters and its logits with the reference the pytest process wrote
(``torch.save`` of the Hugging Face model's state and of its logits), bitwise.
"""

from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import dist_helpers as dh  # noqa: E402
import torch  # noqa: E402

CASES = dh.WorkerCases(__file__)
case = CASES.case


def _fsdp_model(hf_dir: str, mesh):
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(1234)  # not the weights of hf_dir
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(hf_dir))
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return model, optim


def _assert_matches(model, optim, reference: dict, what: str) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    full, _ = get_state_dict(model, optim, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if torch.distributed.get_rank() == 0:
        assert set(full) == set(reference["state"]), (what, set(full) ^ set(reference["state"]))
        for key, expected in reference["state"].items():
            assert full[key].dtype == expected.dtype and torch.equal(full[key], expected), f"{what}: {key} differs"
    with torch.no_grad():
        logits = model.eval()(reference["tokens"]).logits
    assert torch.equal(logits, reference["logits"]), f"{what}: logits differ"


@case
def fsdp_load_hf(rank, world_size, hf_dir, imported, root, reference):
    """The imported checkpoint through DataStatesReader, then a fresh manager root initialized from
    the Hugging Face directory: both fill a 2-rank FSDP2 model bit for bit."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from dcp_datastates import DataStatesReader
    from dcp_datastates.manager import CheckpointManager, CheckpointManagerOptions

    mesh = dh._mesh(world_size)
    ref = torch.load(reference, weights_only=True)

    model, optim = _fsdp_model(hf_dir, mesh)
    msd, osd = get_state_dict(model, optim)
    state = {"model": msd}
    dcp.load(state, storage_reader=DataStatesReader(imported))
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=osd)
    _assert_matches(model, optim, ref, "imported checkpoint")

    model, optim = _fsdp_model(hf_dir, mesh)
    msd, osd = get_state_dict(model, optim)
    state = {"model": msd, "optim": osd}
    mgr = CheckpointManager(root, CheckpointManagerOptions(async_save=False, init_from_huggingface=hf_dir))
    try:
        assert mgr.load(state) == 0 and mgr.initialized_from == hf_dir
        set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
        _assert_matches(model, optim, ref, "manager init")
    finally:
        mgr.close()


if __name__ == "__main__":
    CASES.main()
