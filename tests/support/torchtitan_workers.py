"""Rank cases of tests/test_torchtitan.py: torchtitan's CheckpointManager on dcp_datastates.

torchtitan's trainer needs CUDA, so each rank drives the checkpointer the way
the trainer does (``Config.build`` with model parts, an optimizers container, lr
schedulers, a dataloader and the train state; ``maybe_wait_for_staging()``
before ``optimizers.step()``; ``save(step)`` after it), on an FSDP2 model over
gloo. What a checkpoint must hold is cloned right after each ``save()``
returns; loads into freshly built components are compared with it bit for bit.
"""

from __future__ import annotations

import os
import pickle
import sys
import time
from concurrent.futures import Future

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import dist_helpers as dh  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

CASES = dh.WorkerCases(__file__)
case = CASES.case
run_ranks = CASES.run_ranks
STAGING_DELAY_S = 0.2  # a slow storage stand-in: see _slow_staging
MODES = ("disabled", "async", "async_with_pinned_mem")


class TrainState:
    """The trainer's own entry (torchtitan passes ``states={"train_state": trainer}``)."""

    def __init__(self) -> None:
        self.step, self.ntokens_seen = 0, 0

    def state_dict(self):
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, sd):
        self.step, self.ntokens_seen = sd["step"], sd["ntokens_seen"]


class Loader:
    """A dataloader's checkpoint entry as torchtitan's has it: one pickled blob per data-parallel rank."""

    def __init__(self, rank: int) -> None:
        self.rank, self.consumed = rank, 0

    def state_dict(self):
        return {f"dp_rank_{self.rank}": pickle.dumps({"consumed": self.consumed}), "world_size": 2}

    def load_state_dict(self, sd):
        self.consumed = pickle.loads(sd[f"dp_rank_{self.rank}"])["consumed"]


class Parts:
    """One rank's trainer components: an FSDP2 model and what torchtitan builds around it."""

    def __init__(self, seed: int, mesh, rank: int) -> None:
        from torch.distributed.fsdp import fully_shard
        from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer, ParamGroupConfig

        torch.manual_seed(seed)
        self.model = nn.Sequential(nn.Linear(16, 96), nn.LayerNorm(96), nn.Linear(96, 96), nn.Linear(96, 5))
        for layer in (self.model[0], self.model[2], self.model[3]):
            fully_shard(layer, mesh=mesh)
        fully_shard(self.model, mesh=mesh)
        self.optimizers = OptimizersContainer.Config(
            param_groups=[ParamGroupConfig(pattern=".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 1e-2, "weight_decay": 0.05})],
            implementation="for-loop",
        ).build(model_parts=[self.model])
        self.lr_schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=self.optimizers, training_steps=20)
        self.loader = Loader(rank)
        self.train_state = TrainState()
        self.rank = rank

    def manager(self, root: str, mode: str, sd_adapter=None, **config):
        from dcp_datastates.integrations.torchtitan import DataStatesCheckpointManager

        settings = dict(
            enable=True, folder=mode, interval=1, async_mode=mode, keep_latest_k=2, last_save_model_only=False,
            host_cache_bytes=16 << 20,
        )
        cfg = DataStatesCheckpointManager.Config(**{**settings, **config})
        return cfg.build(
            dataloader=self.loader, model_parts=[self.model], optimizers=self.optimizers,
            lr_schedulers=self.lr_schedulers, states={"train_state": self.train_state}, sd_adapter=sd_adapter,
            base_folder=root,
        )

    def train_step(self, mgr, step: int) -> None:
        g = torch.Generator().manual_seed(100 * step + self.rank)
        self.model(torch.randn(8, 16, generator=g)).square().mean().backward()
        if mgr is not None:
            mgr.maybe_wait_for_staging()  # as torchtitan's trainer does, before the step
        self.optimizers.step()
        self.optimizers.zero_grad()
        self.lr_schedulers.step()
        self.train_state.step, self.train_state.ntokens_seen = step, 8 * step
        self.loader.consumed = 8 * step

    def captured(self) -> dict:
        """Everything a checkpoint of this rank holds, cloned (local shards of DTensors)."""
        return _clone({
            "model": self.model.state_dict(), "optimizer": self.optimizers.state_dict(),
            "lr_scheduler": self.lr_schedulers.state_dict(), "dataloader": self.loader.state_dict(),
            "train_state": self.train_state.state_dict(),
        })


class RenamingAdapter:
    """The part of torchtitan's state dict adapter a Hugging Face save uses: ``to_hf`` renames
    (a real adapter also reshapes, on the same DTensors)."""

    fqn_to_index_mapping = None
    hf_assets_path = None

    @staticmethod
    def hf_name(key: str) -> str:
        return f"model.layers.{key}"

    def to_hf(self, state_dict):
        return {self.hf_name(k): v for k, v in state_dict.items()}


def _clone(value):
    from torch.distributed.tensor import DTensor

    if isinstance(value, dict):
        return {k: _clone(v) for k, v in value.items()}
    if isinstance(value, DTensor):
        return value.to_local().clone()
    if isinstance(value, torch.Tensor):
        return value.clone()
    return value


def assert_holds(parts: Parts, expected: dict, what: str, keys=None) -> None:
    actual = parts.captured()
    for key in keys or expected:
        dh.assert_equal_exact(actual[key], expected[key], f"{what}: {key}")


def _slow_staging(delay_s: float):
    """Make every snapshot take ``delay_s`` longer to leave the saved tensors, so that an
    ``optimizers.step()`` right after a save finds it still in flight unless fenced."""
    from dcp_datastates.core.async_save.snapshot import Snapshot

    original = Snapshot.await_staged

    def await_staged(self):
        time.sleep(delay_s)
        original(self)

    Snapshot.await_staged = await_staged


def committed_steps(folder: str) -> list[str]:
    """The ``step-N`` entries of ``folder`` holding a ``.metadata``, listed as torchtitan lists (fsspec
    for a URL, its cache dropped first; an object store may keep an emptied prefix as a directory)."""
    from torchtitan.tools import filesystem

    if filesystem.is_remote(folder):
        from fsspec.core import url_to_fs

        url_to_fs(folder)[0].invalidate_cache()
    names = filesystem.listdir(folder)
    return sorted(n for n in names if filesystem.isfile(filesystem.join(filesystem.join(folder, n), ".metadata")))


@case
def torchtitan_checkpointing(rank, world_size, root):
    """Every mode: three saves with keep_latest_k=2, then the latest and an older step loaded into
    fresh components; then exclude_from_loading, a failed save, a checkpoint of torchtitan's own
    manager, a last model-only bfloat16 save, and one exported to Hugging Face safetensors."""
    mesh = dh._mesh(world_size)
    _slow_staging(STAGING_DELAY_S)
    for mode in MODES:
        expected = _saves_and_loads(mesh, rank, root, mode)
    _exclude_from_loading(mesh, rank, root, expected[3])
    _failed_save(mesh, rank, root)
    _stock_checkpoint_resumes(mesh, rank, root)
    _model_only_last_save(mesh, rank, root)
    _hf_last_save(mesh, rank, root)


def _saves_and_loads(mesh, rank, root, mode, folder=None, steps=(1, 2, 3)) -> dict:
    """Saves of ``steps`` (fenced, purged by keep_latest_k=2) into ``root/mode`` (or the ``folder``
    URL), resumed from the last and loaded at the one before into fresh components; returns what
    each step's checkpoint holds on this rank."""
    import torch.distributed as dist
    from torch.futures import Future as TorchFuture

    import dcp_datastates
    from dcp_datastates.core.async_save.runtime import runtime
    from dcp_datastates.integrations.torchtitan import DataStatesCheckpointManager

    where = {} if folder is None else {"folder": folder}
    folder = folder or os.path.join(root, mode)
    parts = Parts(seed=1, mesh=mesh, rank=rank)
    mgr = parts.manager(root, mode, **where)
    assert isinstance(mgr, DataStatesCheckpointManager)
    assert (runtime().fence_hook is not None) == (mode != "disabled"), mode
    # Runs after the fence (global pre-hooks first), as the container's own hooks (MoE) do.
    in_flight_at_step = []
    parts.optimizers.register_step_pre_hook(lambda *_: in_flight_at_step.append(dcp_datastates.snapshots_in_flight()))
    expected = {}
    for step in steps:
        parts.train_step(mgr, step)
        mgr.save(step)
        if mode == "async_with_pinned_mem":
            assert isinstance(mgr.staging_future, (Future, TorchFuture)), type(mgr.staging_future)
        if mode != "disabled":
            assert mgr.save_future is not None, mode
        expected[step] = parts.captured()
    parts.train_step(mgr, steps[-1] + 1)  # changes every tensor while the last save may still be writing
    mgr.maybe_wait_for_saving()
    assert mgr.save_future is None
    mgr.close()  # joins torchtitan's purge thread
    assert runtime().fence_hook is None, f"{mode}: close() left the fence installed"
    assert in_flight_at_step == [0] * len(in_flight_at_step) and in_flight_at_step, (mode, in_flight_at_step)
    dist.barrier()
    # keep_latest_k=2: torchtitan purges right after a save is staged. A directory's newest step
    # exists by then and is one of the two kept; under a URL it has no object yet, so the two
    # before it are kept too (the older goes at the next save).
    kept = [f"step-{n}" for n in steps[-2 if where == {} else -3:]]
    assert committed_steps(folder) == kept, (committed_steps(folder), kept)
    assert dcp_datastates.verify(f"{folder}/step-{steps[-1]}").ok, mode

    fresh = Parts(seed=2, mesh=mesh, rank=rank)
    resumed = fresh.manager(root, mode, **where)
    assert resumed.load() is True  # the latest
    assert_holds(fresh, expected[steps[-1]], f"{mode}: resume")
    assert resumed.load(step=steps[-2]) is True  # load_step
    assert_holds(fresh, expected[steps[-2]], f"{mode}: load_step={steps[-2]}")
    resumed.close()
    dist.barrier()
    return expected


@case
def torchtitan_on_s3(rank, world_size, url):
    """The folder an s3:// URL: torchtitan lists and purges it through fsspec, we write and read it."""
    _slow_staging(STAGING_DELAY_S)  # no object of a save appears before torchtitan's purge lists
    _saves_and_loads(dh._mesh(world_size), rank, "", "async", folder=url, steps=(1, 2, 3, 4))


def _exclude_from_loading(mesh, rank, root, latest: dict) -> None:
    """Model and optimizer restored, the excluded entries left as they were."""
    fresh = Parts(seed=3, mesh=mesh, rank=rank)
    untouched = fresh.captured()
    mgr = fresh.manager(root, "disabled", exclude_from_loading=["lr_scheduler", "dataloader", "train_state"])
    assert mgr.load() is True
    assert_holds(fresh, latest, "exclude_from_loading", keys=["model", "optimizer"])
    assert_holds(fresh, untouched, "exclude_from_loading", keys=["lr_scheduler", "dataloader", "train_state"])
    mgr.close()


def _failed_save(mesh, rank, root) -> None:
    """A background save that fails is raised once, naming its folder, by the wait before the next
    save (not again by that save, which commits)."""
    import errno

    import torch.distributed as dist

    import dcp_datastates
    from dcp_datastates import CheckpointError
    from dcp_datastates.native.faults import inject_fault

    parts = Parts(seed=8, mesh=mesh, rank=rank)
    mgr = parts.manager(root, "async", folder="failing", keep_latest_k=0)
    parts.train_step(mgr, 1)
    with inject_fault("write", path=".data", errno=errno.ENOSPC, times=-1):
        mgr.save(1)
        try:
            mgr.maybe_wait_for_saving()
        except CheckpointError as exc:
            assert "failing/step-1" in str(exc) and "No space left" in str(exc), str(exc)
        else:
            raise AssertionError("a save that could not write its data did not fail")
    assert mgr.save_future is None
    parts.train_step(mgr, 2)
    mgr.save(2)
    saved = parts.captured()
    mgr.close()
    assert dcp_datastates.verify(os.path.join(root, "failing", "step-2")).ok
    dist.barrier()
    assert not os.path.exists(os.path.join(root, "failing", "step-1", ".metadata"))
    fresh = Parts(seed=9, mesh=mesh, rank=rank)
    mgr = fresh.manager(root, "disabled", folder="failing")
    assert mgr.load() is True
    assert_holds(fresh, saved, "after a failed save")
    mgr.close()


def _stock_checkpoint_resumes(mesh, rank, root) -> None:
    """A run checkpointed by torchtitan's own manager (stock DCP files) resumes through ours."""
    from torchtitan.components.checkpointer import CheckpointManager

    parts = Parts(seed=6, mesh=mesh, rank=rank)
    stock = CheckpointManager.Config(enable=True, folder="stock", interval=1, keep_latest_k=0).build(
        dataloader=parts.loader, model_parts=[parts.model], optimizers=parts.optimizers,
        lr_schedulers=parts.lr_schedulers, states={"train_state": parts.train_state}, sd_adapter=None, base_folder=root,
    )
    parts.train_step(stock, 1)
    stock.save(1)
    stock.close()
    saved_by_stock = parts.captured()
    fresh = Parts(seed=7, mesh=mesh, rank=rank)
    mgr = fresh.manager(root, "disabled", folder="stock")
    assert mgr.load() is True
    assert_holds(fresh, saved_by_stock, "stock torchtitan checkpoint")
    mgr.close()


def _model_only_last_save(mesh, rank, root) -> None:
    """last_save_model_only + export_dtype, in async mode: the last save is synchronous and holds
    the model alone, cast."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import DTensor

    from dcp_datastates import DataStatesReader

    parts = Parts(seed=4, mesh=mesh, rank=rank)
    mgr = parts.manager(root, "async", last_save_model_only=True, export_dtype="bfloat16", keep_latest_k=0)
    parts.train_step(mgr, 1)
    mgr.save(5, last_step=True)
    assert mgr.save_future is None  # nothing left in flight
    model_sd = parts.model.state_dict()
    path = os.path.join(root, "async", "step-5")
    md = DataStatesReader(path).read_metadata()
    assert sorted(md.state_dict_metadata) == sorted(model_sd), sorted(md.state_dict_metadata)
    assert {m.properties.dtype for m in md.state_dict_metadata.values()} == {torch.bfloat16}
    target = {k: torch.zeros_like(v, dtype=torch.bfloat16) for k, v in model_sd.items()}
    dcp.load(target, storage_reader=DataStatesReader(path))
    for k, v in model_sd.items():
        assert isinstance(target[k], DTensor)
        dh.assert_equal_exact(target[k].to_local(), v.to_local().to(torch.bfloat16), f"export_dtype: {k}")
    mgr.close()


def _hf_last_save(mesh, rank, root) -> None:
    """last_save_in_hf: the adapter's names, exported by rank 0 to safetensors, the staging copy removed."""
    import torch.distributed as dist
    from safetensors.torch import load_file

    parts = Parts(seed=5, mesh=mesh, rank=rank)
    mgr = parts.manager(root, "async", sd_adapter=RenamingAdapter(), folder="hf", last_save_model_only=True,
                        last_save_in_hf=True, export_dtype="bfloat16", keep_latest_k=0)
    parts.train_step(mgr, 1)
    mgr.save(6, last_step=True)
    mgr.close()
    full = {RenamingAdapter.hf_name(k): v.full_tensor().to(torch.bfloat16) for k, v in parts.model.state_dict().items()}
    dist.barrier()
    assert sorted(os.listdir(os.path.join(root, "hf"))) == ["step-6"]
    exported = load_file(os.path.join(root, "hf", "step-6", "model.safetensors"))
    dh.assert_equal_exact(exported, full, "last_save_in_hf")


if __name__ == "__main__":
    CASES.main()
