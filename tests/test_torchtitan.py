"""torchtitan's CheckpointManager on dcp_datastates (dcp_datastates.integrations.torchtitan), against the real package."""

from __future__ import annotations

import importlib
import inspect
import sys

import pytest

try:
    import torchtitan  # noqa: F401
except ImportError as exc:  # a failure, not a skip: the suite's install line installs it
    raise ImportError("tests/test_torchtitan.py needs torchtitan: README's test command installs it "
                      "(pip install --no-deps torchtitan==0.3.0 torchdata==0.11.0 torch_checkpointing==0.1.1)") from exc

from torchtitan.components.checkpointer import CheckpointManager
from torchtitan.components.checkpointer import dcp as titan_dcp
from torchtitan.tools import filesystem as titan_filesystem

from dcp_datastates.integrations.torchtitan import DataStatesCheckpointManager
from torchtitan_workers import run_ranks  # tests/support, on sys.path through conftest


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.subprocess
def test_torchtitan_checkpointing_on_two_ranks(tmp_path):
    """disabled, async and async_with_pinned_mem: saves, the fence, keep_latest_k, resume and
    load_step bit-exact; exclude_from_loading; a failed background save; a stock torchtitan
    checkpoint resumed; last_save_model_only with export_dtype; last_save_in_hf."""
    run_ranks("torchtitan_checkpointing", 2, tmp_path / "logs", root=str(tmp_path / "run"))


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.subprocess
def test_torchtitan_folder_in_object_storage(tmp_path, s3_server):
    """async saves into an s3:// folder, purged by torchtitan through fsspec, resumed bit-exact."""
    pytest.importorskip("s3fs", reason="torchtitan lists an s3:// folder through fsspec's s3fs (pip install s3fs)")
    run_ranks("torchtitan_on_s3", 2, tmp_path / "logs", url=f"s3://{s3_server.bucket}/torchtitan-{tmp_path.name}")


def test_config_selects_our_manager_and_checks_our_options():
    cfg = DataStatesCheckpointManager.Config(enable=False, async_mode="async_with_pinned_mem", io_threads=3)
    assert cfg.build(
        dataloader=None, model_parts=[], optimizers=None, lr_schedulers=None, states={}, sd_adapter=None
    ).__class__ is DataStatesCheckpointManager
    with pytest.raises(ValueError, match="checkpoint.direct_io"):
        DataStatesCheckpointManager.Config(direct_io="sometimes")
    with pytest.raises(ValueError, match="checkpoint.host_cache_bytes"):
        DataStatesCheckpointManager.Config(host_cache_bytes=0)


def test_torchtitan_internals_the_integration_relies_on():
    """What dcp_datastates/integrations/torchtitan.py names as torchtitan internals still holds."""
    save_src = inspect.getsource(titan_dcp.CheckpointManager._save)
    assert "if self.stager is None:" in save_src  # the pinned replica is built only without a stager
    assert "self.dcp_save(" in save_src and "isinstance(result, Future)" in save_src
    assert "isinstance(result, AsyncSaveResponse)" in save_src
    assert "self.stager.close()" in inspect.getsource(titan_dcp.CheckpointManager._close)
    assert "self.dcp_load(" in inspect.getsource(titan_dcp.CheckpointManager._load)
    assert "self._wait_for_saving()" in inspect.getsource(titan_dcp.BaseCheckpointManager.maybe_wait_for_saving)
    assert "self._load(step)" in inspect.getsource(titan_dcp.BaseCheckpointManager.load)
    assert "url_to_fs(path)" in inspect.getsource(titan_filesystem._resolve)
    assert list(inspect.signature(CheckpointManager.dcp_save).parameters) == [
        "self", "state_dict", "checkpoint_id", "async_mode", "enable_garbage_collection", "to_hf"
    ]
    assert list(inspect.signature(CheckpointManager.dcp_load).parameters) == [
        "self", "state_dict", "checkpoint_id", "from_hf", "from_quantized"
    ]


def test_failed_hf_export_keeps_the_weights_and_names_them(tmp_path, monkeypatch):
    """An export that fails leaves the model saved in our format, and the error says where."""
    import torch
    import torch.distributed.checkpoint as dcp

    from dcp_datastates import CheckpointError, DataStatesReader
    from dcp_datastates.integrations import huggingface
    from dcp_datastates.integrations.torchtitan import HF_EXPORT_STAGING

    class Adapter:
        fqn_to_index_mapping = hf_assets_path = None

        def to_hf(self, state_dict):
            return {f"hf.{k}": v for k, v in state_dict.items()}

    def disk_full(checkpoint, out, **_):
        raise OSError(28, "No space left on device", str(out))

    monkeypatch.setattr(huggingface, "export_to_huggingface", disk_full)
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    cfg = DataStatesCheckpointManager.Config(
        enable=True, folder="ck", last_save_model_only=True, last_save_in_hf=True, keep_latest_k=0
    )
    mgr = cfg.build(
        dataloader=None, model_parts=[model], optimizers=None, lr_schedulers=None, states={},
        sd_adapter=Adapter(), base_folder=str(tmp_path),
    )
    with pytest.raises(CheckpointError, match=r"Hugging Face export into .*ck/step-7 failed on rank 0 .*No space") as info:
        mgr.save(7, last_step=True)
    staging = str(tmp_path / "ck" / HF_EXPORT_STAGING)
    assert f"kept in dcp_datastates format at {staging}" in str(info.value)
    target = {"hf.weight": torch.zeros(2, 3), "hf.bias": torch.zeros(2)}
    dcp.load(target, storage_reader=DataStatesReader(staging), no_dist=True)
    assert torch.equal(target["hf.weight"], model.weight) and torch.equal(target["hf.bias"], model.bias)
    mgr.close()


def test_module_names_the_install_line_without_torchtitan(monkeypatch):
    name = "dcp_datastates.integrations.torchtitan"
    for loaded in [m for m in sys.modules if m == "torchtitan" or m.startswith("torchtitan.")]:
        monkeypatch.setitem(sys.modules, loaded, None)  # importing it now raises ImportError
    monkeypatch.delitem(sys.modules, name)
    with pytest.raises(ImportError, match=r"needs torchtitan .*pip install --no-deps torchtitan==0\.3\.0"):
        importlib.import_module(name)


def test_module_names_the_missing_dependency_when_torchtitan_is_installed(monkeypatch):
    """torchtitan installed --no-deps without its light dependencies: the message names the one
    missing (tyro, which its config imports) and the extra that has it, not torchtitan."""
    dependency = "tyro"
    name = "dcp_datastates.integrations.torchtitan"
    for loaded in [m for m in sys.modules if m.split(".")[0] in ("torchtitan", dependency)]:
        monkeypatch.delitem(sys.modules, loaded)
    monkeypatch.setitem(sys.modules, dependency, None)
    monkeypatch.delitem(sys.modules, name)
    with pytest.raises(ImportError) as info:
        importlib.import_module(name)
    text = str(info.value)
    assert f"its dependency '{dependency}' is not" in text
    assert 'pip install "dcp_datastates[torchtitan]"' in text
    assert "needs torchtitan" not in text
