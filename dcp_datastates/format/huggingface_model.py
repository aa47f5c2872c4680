"""The tensors a Hugging Face model stores: what ``save_pretrained`` writes for a ``config.json``.

A model's ``state_dict()`` and its files differ: tied weights are stored once
(GPT-2 stores ``transformer.wte.weight`` and no ``lm_head.weight``). Which
ones is transformers' knowledge, so it is asked, once, of the model the config
describes built on the meta device (no memory, no download). Exports check
against it, imports and loads add the tied keys the files leave out.
transformers is imported only here, and only when called.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os

import torch

from dcp_datastates.errors import ModelMismatchError

CONFIG = "config.json"


@dataclasses.dataclass
class ModelKeys:
    """The tensors of the model a config describes, as ``save_pretrained`` writes them."""

    config_path: str
    stored: dict[str, tuple[int, ...]]  # key -> shape, in the model's state_dict order
    tied: dict[str, str]  # a key left out (tied) -> the stored key whose tensor it shares


def model_keys(config_dir: str | os.PathLike) -> ModelKeys:
    """Build the model of ``config_dir/config.json`` on the meta device (no memory, no download)
    and ask transformers which of its tensors ``save_pretrained`` writes, and which it ties."""
    config_path = os.path.join(os.fspath(config_dir), CONFIG)
    if not os.path.isfile(config_path):
        raise FileNotFoundError(f"{config_path}: no such file; the config directory must hold the model's {CONFIG}")
    import transformers
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    config = transformers.AutoConfig.from_pretrained(os.fspath(config_dir), local_files_only=True)
    classes = [getattr(transformers, a, None) for a in getattr(config, "architectures", None) or []]
    model_class = next((c for c in classes if c is not None), None)
    with torch.device("meta"):
        model = model_class(config) if model_class is not None else transformers.AutoModelForCausalLM.from_config(config)
    _refuse_weight_conversions(model, config_path)
    state = model.state_dict()
    for key in getattr(model, "_keys_to_ignore_on_save", None) or ():
        state.pop(key, None)
    kept = remove_tied_weights_from_state_dict(dict(state), model)
    stored = {k: tuple(v.shape) for k, v in state.items() if k in kept}
    owner = {id(model.get_parameter_or_buffer(k)): k for k in stored}
    tied = {k: owner[id(model.get_parameter_or_buffer(k))] for k in state if k not in kept}
    return ModelKeys(config_path, stored, tied)


def _refuse_weight_conversions(model, config_path: str) -> None:
    """Some model classes rename or fuse weights between their ``state_dict`` and their files
    (transformers' conversion mappings); an export writes names as they are, so refuse those."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import PrefixChange
    except ImportError:  # a transformers without conversion mappings: names are written as they are
        return
    conversions = [c for c in get_model_conversion_mapping(model, add_legacy=False) if not isinstance(c, PrefixChange)]
    if conversions:
        raise ModelMismatchError(
            f"{config_path}: {type(model).__name__} converts its weights when saved ({len(conversions)} "
            "conversion(s)); exporting such a model is not supported"
        )


def tied_aliases(model_dir: str | os.PathLike) -> dict[str, str]:
    """For a Hugging Face directory: each tied key its files leave out -> the key it repeats
    (empty without a ``config.json`` or without transformers)."""
    if not os.path.isfile(os.path.join(os.fspath(model_dir), CONFIG)) or importlib.util.find_spec("transformers") is None:
        return {}
    return model_keys(model_dir).tied
