"""Hugging Face export and import: what ``from_pretrained`` loads, and runs started from it.

Tiny GPT-2 and Llama models built from configs (no download) take one AdamW
step and are saved as ``{"model": ..., "optim": ...}`` with DataStatesWriter.
The export must load with ``from_pretrained`` with no missing, unexpected or
mismatched key and give the original model's logits bit for bit (in the
exported dtype); its files must name the tensors ``save_pretrained`` names.
The import and the manager's ``init_from_huggingface`` must fill a model
(1 rank, and 2-rank FSDP2) with the Hugging Face model's weights bit for bit.
"""

from __future__ import annotations

import json
import os
import uuid

import pytest
import torch
import torch.distributed.checkpoint as dcp

from cli_checkpoints import run_cli
from dcp_datastates import DataStatesReader, DataStatesWriter
from dcp_datastates.errors import CheckpointExistsError, ModelMismatchError
from dcp_datastates.integrations.huggingface import export_to_huggingface, import_from_huggingface, load_from_huggingface
from dcp_datastates.manager import CheckpointManager, CheckpointManagerOptions

transformers = pytest.importorskip("transformers")
from safetensors import safe_open  # noqa: E402

TOKENS = torch.tensor([[1, 5, 9, 2, 33, 17, 4, 60], [7, 7, 0, 12, 50, 3, 8, 21]])


def _config(kind: str, vocab_size: int = 64):
    if kind == "gpt2":
        return transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=vocab_size, n_positions=16,
                                       bos_token_id=0, eos_token_id=0)
    return transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                                    num_key_value_heads=1, vocab_size=vocab_size, max_position_embeddings=16,
                                    tie_word_embeddings=kind == "llama_tied", bos_token_id=0, eos_token_id=0)


def _trained(kind: str):
    """A tiny model of ``kind`` after one AdamW step, and its optimizer."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_config(kind))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(TOKENS, labels=TOKENS).loss.backward()
    optim.step()
    return model.eval(), optim


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(TOKENS).logits


def _file_keys(directory) -> set[str]:
    keys = set()
    for name in os.listdir(directory):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(directory, name), "pt") as f:
                keys.update(f.keys())
    return keys


def _from_pretrained(directory):
    model, info = transformers.AutoModelForCausalLM.from_pretrained(directory, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    return model


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Per model kind: the trained model, its checkpoint of ours, its config directory (with a
    tokenizer file and the generation config), and what save_pretrained writes for it."""
    out = {}
    for kind in ("gpt2", "llama_tied", "llama_untied"):
        base = tmp_path_factory.mktemp(kind)
        model, optim = _trained(kind)
        dcp.save({"model": model.state_dict(), "optim": optim.state_dict()},
                 storage_writer=DataStatesWriter(str(base / "ckpt")))
        model.save_pretrained(base / "pretrained")
        config_dir = base / "config"
        model.config.save_pretrained(config_dir)
        model.generation_config.save_pretrained(config_dir)
        (config_dir / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "BPE"}}\n')
        out[kind] = dict(model=model, ckpt=str(base / "ckpt"), config=str(config_dir), pretrained=str(base / "pretrained"))
    return out


@pytest.mark.parametrize("kind", ["gpt2", "llama_tied", "llama_untied"])
def test_export_loads_with_from_pretrained_bitwise(runs, kind, tmp_path):
    run = runs[kind]
    summary = export_to_huggingface(run["ckpt"], tmp_path / "hf", config_dir=run["config"])
    assert summary.files == ["model.safetensors", "config.json", "generation_config.json", "tokenizer.json"]
    assert sorted(os.listdir(tmp_path / "hf")) == sorted(summary.files)  # one shard: no index, as save_pretrained
    assert _file_keys(tmp_path / "hf") == _file_keys(run["pretrained"])  # tied weights stored as transformers does
    loaded = _from_pretrained(tmp_path / "hf")
    assert torch.equal(_logits(loaded), _logits(run["model"]))
    with open(os.path.join(run["config"], "tokenizer.json"), "rb") as f:
        assert (tmp_path / "hf" / "tokenizer.json").read_bytes() == f.read()


def test_export_bf16_sharded_matches_the_model_cast(runs, tmp_path):
    run = runs["gpt2"]
    summary = export_to_huggingface(run["ckpt"], tmp_path / "hf", config_dir=run["config"], dtype="bf16",
                                    max_shard_bytes=16 << 10)
    shards = [f for f in summary.files if f.endswith(".safetensors")]
    assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == _file_keys(run["pretrained"]) and set(index["weight_map"].values()) == set(shards)
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["dtype"] == "bfloat16"
    loaded = _from_pretrained(tmp_path / "hf")
    assert loaded.dtype == torch.bfloat16
    cast = transformers.AutoModelForCausalLM.from_config(run["model"].config)
    cast.load_state_dict(run["model"].state_dict())
    assert torch.equal(_logits(loaded), _logits(cast.to(torch.bfloat16)))


def test_export_from_s3_and_from_stock_dcp(runs, s3_server, tmp_path):
    run = runs["llama_tied"]
    url = f"s3://{s3_server.bucket}/hf-{uuid.uuid4().hex[:8]}/step_00000001"
    model, optim = run["model"], torch.optim.AdamW(run["model"].parameters())
    state = {"model": model.state_dict(), "optim": optim.state_dict()}
    dcp.save(state, storage_writer=DataStatesWriter(url))
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp_path / "stock")), no_dist=True)
    for source, out in ((url, tmp_path / "from_s3"), (str(tmp_path / "stock"), tmp_path / "from_stock")):
        export_to_huggingface(source, out, config_dir=run["config"])
        assert torch.equal(_logits(_from_pretrained(out)), _logits(model)), source


def test_export_refusals_name_the_key_and_leave_nothing(runs, tmp_path):
    out = tmp_path / "hf"
    with pytest.raises(ModelMismatchError, match=r"'model\.embed_tokens\.weight' \(key 'model\.model\.embed_tokens\.weight' here\).*lacks"):
        export_to_huggingface(runs["gpt2"]["ckpt"], out, config_dir=runs["llama_untied"]["config"])
    with pytest.raises(ModelMismatchError, match="no tensor under the prefix 'net'.*model, optim"):
        export_to_huggingface(runs["gpt2"]["ckpt"], out, prefix="net")
    with pytest.raises(ValueError, match="unknown dtype 'int4'"):
        export_to_huggingface(runs["gpt2"]["ckpt"], out, dtype="int4")
    assert os.listdir(tmp_path) == []  # nothing written, no temporary left
    export_to_huggingface(runs["gpt2"]["ckpt"], out)  # without a config: every model tensor, as saved
    assert _file_keys(out) == set(runs["gpt2"]["model"].state_dict())
    with pytest.raises(CheckpointExistsError):
        export_to_huggingface(runs["gpt2"]["ckpt"], out, config_dir=runs["gpt2"]["config"])
    export_to_huggingface(runs["gpt2"]["ckpt"], out, config_dir=runs["gpt2"]["config"], overwrite=True)
    assert _file_keys(out) == _file_keys(runs["gpt2"]["pretrained"]) and os.listdir(tmp_path) == ["hf"]


def test_cli_export_and_import(runs, tmp_path):
    run = runs["gpt2"]
    res = run_cli("convert", run["ckpt"], "--to", "huggingface", tmp_path / "hf", "--config", run["config"],
                  "--dtype", "fp16", "--quiet")
    assert res.returncode == 0, res.stderr
    assert "files    model.safetensors, config.json, generation_config.json, tokenizer.json" in res.stdout
    assert _from_pretrained(tmp_path / "hf").dtype == torch.float16
    res = run_cli("convert", run["pretrained"], "--to", "datastates", tmp_path / "ours", "--quiet")
    assert res.returncode == 0, res.stderr
    assert "(huggingface)" in res.stdout
    assert "Hugging Face" in run_cli("--help").stdout.split("\n    convert ", 1)[1].split("\n    export ", 1)[0]
    res = run_cli("convert", run["ckpt"], "--to", "torch", tmp_path / "x.pt", "--dtype", "bf16")
    assert res.returncode == 1 and "dtype apply to conversions to huggingface only" in res.stderr


def test_readme_loop_layout_exports_with_the_prefix_its_error_names(runs, tmp_path):
    """README's loop saves ``{"app": AppState, "step": n}``, so the model is under ``app.model``:
    the export without a prefix says the one flag that works, and that flag exports it."""
    run = runs["llama_untied"]
    model, optim = run["model"], torch.optim.AdamW(run["model"].parameters())
    ckpt = str(tmp_path / "run" / "step_00000060")
    dcp.save({"app": {"model": model.state_dict(), "optim": optim.state_dict()}, "step": 60},
             storage_writer=DataStatesWriter(ckpt), no_dist=True)
    res = run_cli("convert", ckpt, "--to", "huggingface", tmp_path / "hf", "--config", run["config"], "--quiet")
    assert res.returncode == 1
    assert ("no tensor under the prefix 'model'; its top-level keys are app, step; the model's tensors are under "
            "'app.model': pass --prefix app.model") in res.stderr, res.stderr
    res = run_cli("convert", ckpt, "--to", "huggingface", tmp_path / "hf", "--config", run["config"],
                  "--prefix", "app.model", "--quiet")
    assert res.returncode == 0, res.stderr
    assert torch.equal(_logits(_from_pretrained(tmp_path / "hf")), _logits(model))


@pytest.mark.parametrize("kind", ["gpt2", "llama_untied"])
def test_import_loads_into_a_model_bitwise(runs, kind, tmp_path):
    run = runs[kind]
    source = tmp_path / "sharded"
    run["model"].save_pretrained(source, max_shard_size="20KB")  # sharded, with an index
    assert os.path.exists(source / "model.safetensors.index.json")
    summary = import_from_huggingface(source, tmp_path / "ours")
    assert summary.tensors == len(run["model"].state_dict())  # tied weights added as state_dict() holds them
    torch.manual_seed(99)
    fresh = transformers.AutoModelForCausalLM.from_config(run["model"].config)
    dcp.load({"model": fresh.state_dict()}, storage_reader=DataStatesReader(str(tmp_path / "ours")))
    assert torch.equal(_logits(fresh), _logits(run["model"]))
    for key, value in run["model"].state_dict().items():
        assert torch.equal(fresh.state_dict()[key], value), key


def test_manager_initializes_a_fresh_root_from_huggingface(runs, tmp_path):
    run = runs["gpt2"]
    torch.manual_seed(7)
    model = transformers.AutoModelForCausalLM.from_config(run["model"].config)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    options = CheckpointManagerOptions(async_save=False, init_from_huggingface=run["pretrained"])
    with CheckpointManager(tmp_path / "root", options) as mgr:
        msd, osd = get_state_dict(model, optim)
        state = {"model": msd, "optim": osd}
        assert mgr.load(state) == 0 and mgr.initialized_from == run["pretrained"]
        set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
        assert torch.equal(_logits(model), _logits(run["model"]))
        model(TOKENS, labels=TOKENS).loss.backward()
        optim.step()
        mgr.save(1, {"model": model.state_dict(), "optim": optim.state_dict()})
    with CheckpointManager(tmp_path / "root", options) as mgr:  # a checkpoint now: resumed from it, not from HF
        state = {"model": model.state_dict(), "optim": optim.state_dict()}
        assert mgr.load(state) == 1 and mgr.initialized_from is None

    wrong = CheckpointManagerOptions(async_save=False, init_from_huggingface=runs["llama_untied"]["pretrained"])
    with CheckpointManager(tmp_path / "other", wrong) as mgr:
        with pytest.raises(ModelMismatchError, match="the model's 'transformer.wte.weight' is in none"):
            mgr.load({"model": model.state_dict()})
    other = transformers.AutoModelForCausalLM.from_config(_config("gpt2", vocab_size=80))
    with pytest.raises(ModelMismatchError, match=r"'transformer.wte.weight' has shape \[64, 32\] there, the model's is \[80, 32\]"):
        load_from_huggingface(other.state_dict(), run["pretrained"])
    with pytest.raises(ValueError, match="init_prefix"):
        CheckpointManagerOptions(init_prefix="")


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.subprocess
def test_fsdp2_two_ranks_load_import_and_manager_init(runs, tmp_path):
    import hf_workers

    run = runs["gpt2"]
    import_from_huggingface(run["pretrained"], tmp_path / "ours")
    torch.save({"state": {k: v.clone() for k, v in run["model"].state_dict().items()}, "tokens": TOKENS,
                "logits": _logits(run["model"])}, tmp_path / "reference.pt")
    hf_workers.CASES.run_ranks("fsdp_load_hf", 2, tmp_path / "logs", hf_dir=run["pretrained"], imported=str(tmp_path / "ours"),
                               root=str(tmp_path / "root"), reference=str(tmp_path / "reference.pt"))


def test_a_head_trained_untied_is_refused_where_the_config_ties_it(runs, tmp_path):
    """A checkpoint whose lm_head was trained apart from the embedding, with a config that ties them:
    the export would drop the head (from_pretrained ties it back), a load would leave the model's own
    head as it was; both refuse, naming the keys."""
    run = runs["gpt2"]
    torch.manual_seed(3)
    untied = transformers.AutoModelForCausalLM.from_config(
        transformers.GPT2Config(**{**run["model"].config.to_dict(), "tie_word_embeddings": False}))
    with torch.no_grad():
        untied.lm_head.weight.fill_(7.0)
    dcp.save({"model": untied.state_dict()}, storage_writer=DataStatesWriter(str(tmp_path / "ckpt")))
    with pytest.raises(ModelMismatchError, match=r"'model.lm_head.weight' differs from 'model.transformer.wte.weight'"):
        export_to_huggingface(tmp_path / "ckpt", tmp_path / "hf", config_dir=run["config"])
    assert not (tmp_path / "hf").exists()
    with pytest.raises(ModelMismatchError, match=r"'lm_head.weight' is a tensor of its own"):
        load_from_huggingface(untied.state_dict(), run["pretrained"])
    assert torch.equal(untied.lm_head.weight, torch.full_like(untied.lm_head.weight, 7.0))  # nothing loaded


def test_an_output_in_object_storage_is_refused_not_written_locally(runs, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"the output of convert --to huggingface takes a local directory"):
        export_to_huggingface(runs["gpt2"]["ckpt"], "s3://bucket/run/hf", config_dir=runs["gpt2"]["config"])
    assert os.listdir(tmp_path) == []


def test_docs_stateful_first_start_from_huggingface(runs, tmp_path):
    """docs/huggingface.md's first start of a run whose state is a Stateful: the model is loaded
    from the Hugging Face directory when the root has nothing to resume from."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    run = runs["gpt2"]
    torch.manual_seed(11)
    model = transformers.AutoModelForCausalLM.from_config(run["model"].config)
    with CheckpointManager(tmp_path / "root", CheckpointManagerOptions(async_save=False)) as mgr:
        start = mgr.load({"app": {"model": model.state_dict()}})
        if start is None:
            model_sd = get_model_state_dict(model)
            load_from_huggingface(model_sd, run["pretrained"])
            set_model_state_dict(model, model_sd)
            start = 0
    assert start == 0 and torch.equal(_logits(model), _logits(run["model"]))
