"""``convert --to huggingface``: what ``transformers``' ``from_pretrained`` loads.

A training checkpoint holds ``{"model": ..., "optim": ...}``; a Hugging Face
directory holds the model's weights alone, named as ``save_pretrained`` names
them, plus ``config.json`` and the tokenizer. So the tensors under one prefix
are selected and renamed (:class:`SelectedView`), cast to the dtype asked for
block by block, and written by the one safetensors writer
(:mod:`tools.formats.safetensors`): ``model.safetensors`` when one shard holds
them, else ``model-0000i-of-0000N.safetensors`` with an index, as
``save_pretrained`` does. With a config directory, the model it describes is
built on the meta device to learn which tensors ``save_pretrained`` writes
(tied weights once: GPT-2 stores no ``lm_head.weight``) and their shapes; a
tensor missing, extra or of another shape is refused, naming it, before
anything is written. Then ``config.json`` (its dtype set to what was written)
and the directory's tokenizer and generation files are copied in.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from typing import Callable

import torch

from dcp_datastates.errors import ModelMismatchError
from dcp_datastates.format.huggingface_model import CONFIG, ModelKeys, model_keys
from dcp_datastates.storage.fsync_files import fsync_dir
from dcp_datastates.tools.formats import safetensors
from dcp_datastates.tools.selected_view import SelectedView

DEFAULT_PREFIX = "model"
# The dtypes an export may cast to, by the names people type.
DTYPES = {
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp16": torch.float16, "float16": torch.float16, "half": torch.float16,
    "fp32": torch.float32, "float32": torch.float32, "float": torch.float32,
}
# Files of a model directory that are weights (ours replace them), never copied with the config.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf", ".index.json")


def model_prefixes(keys) -> list[str]:
    """The prefixes ending in a ``model`` part under which a checkpoint holds tensors, shortest
    first: ``app.model`` for a state saved as ``{"app": AppState}`` whose state dict has a
    ``model`` entry (README's loop). Where the default prefix finds nothing, they are the hint."""
    found = set()
    for key in keys:
        parts = key.split(".")
        for i, part in enumerate(parts[:-1]):
            if part == DEFAULT_PREFIX:
                found.add(".".join(parts[: i + 1]))
                break
    return sorted(found, key=lambda p: (p.count("."), p))


def parse_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    """``"bf16"`` (or ``torch.bfloat16``) -> ``torch.bfloat16``; None keeps the saved dtypes."""
    if dtype is None or isinstance(dtype, torch.dtype):
        if isinstance(dtype, torch.dtype) and dtype not in DTYPES.values():
            raise ValueError(f"dtype {dtype} is not one an export writes; choose bf16, fp16 or fp32")
        return dtype
    found = DTYPES.get(str(dtype).lower())
    if found is None:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    return found


@dataclasses.dataclass
class HuggingFaceExport:
    """What an export writes: the selected, renamed, cast tensors, and the config directory."""

    view: SelectedView
    config_dir: str | None
    skipped: list[str]  # objects under the prefix, which safetensors cannot hold

    @classmethod
    def plan(cls, source, *, config_dir=None, prefix: str | None = None, dtype=None) -> "HuggingFaceExport":
        """Select the tensors under ``prefix`` of ``source`` and check them against ``config_dir``'s
        model; raises :class:`ModelMismatchError` naming the key, before anything is written."""
        prefix = DEFAULT_PREFIX if prefix is None else prefix
        out_dtype = parse_dtype(dtype)
        lead = f"{prefix}." if prefix else ""
        names = {k[len(lead):]: k for k in source.tensors if k.startswith(lead)}
        skipped = [k for k in source.objects if k.startswith(lead)]
        if not names:
            tops = sorted({k.split(".", 1)[0] for k in source.keys()})
            candidates = [p for p in model_prefixes(source.tensors) if p != prefix]
            hint = ""
            if len(candidates) == 1:
                hint = f"; the model's tensors are under {candidates[0]!r}: pass --prefix {candidates[0]} " \
                       f"(prefix={candidates[0]!r} from Python)"
            elif candidates:
                hint = f"; model tensors are under {', '.join(map(repr, candidates))}: pass one with --prefix"
            raise ModelMismatchError(
                f"{source.path}: no tensor under the prefix {prefix!r}; its top-level keys are {', '.join(tops)}{hint}"
            )
        if config_dir is not None:
            config_dir = os.fspath(config_dir)
            names = _match_model(source, names, model_keys(config_dir), lead)
        view = SelectedView(source, names, dtype=out_dtype)
        safetensors.check_dtypes(view)
        return cls(view, config_dir, skipped)

    def write_with(self, max_shard_bytes: int) -> Callable:
        """The ``write(tmp, summary, tracker)`` the convert machinery builds the output with."""

        def write(tmp: str, summary, tracker) -> None:
            safetensors.write(self.view, tmp, summary, tracker, max_shard_bytes, single_file=True)
            summary.skipped = list(self.skipped)
            if self.config_dir is not None:
                summary.files += copy_model_files(self.config_dir, tmp, self.written_dtype())
            fsync_dir(tmp)

        return write

    def written_dtype(self) -> torch.dtype | None:
        """The dtype of the floating-point weights written, when they all share one."""
        found = {md.properties.dtype for md in self.view.tensors.values() if md.properties.dtype.is_floating_point}
        return found.pop() if len(found) == 1 else None


def _match_model(source, names: dict[str, str], model: ModelKeys, lead: str) -> dict[str, str]:
    """``names`` (model key -> source key) reduced to what ``save_pretrained`` writes, in the
    model's order; a stored key the source holds only as its tied twin is read from the twin."""
    twins: dict[str, list[str]] = {}
    for alias, key in model.tied.items():
        twins.setdefault(key, []).append(alias)
    out: dict[str, str] = {}
    missing: list[str] = []
    for key, shape in model.stored.items():
        src = names.get(key) or next((names[t] for t in twins.get(key, ()) if t in names), None)
        if src is None:
            missing.append(key)
            continue
        saved = tuple(source.tensors[src].size)
        if saved != shape:
            raise ModelMismatchError(
                f"{source.path}: {src!r} has shape {list(saved)}, but the model of {model.config_path} "
                f"expects {list(shape)} for {key!r}"
            )
        out[key] = src
    if missing:
        raise ModelMismatchError(
            f"{source.path}: the model of {model.config_path} expects {missing[0]!r} (key {lead + missing[0]!r} here), "
            f"which the checkpoint lacks ({len(missing)} missing: {', '.join(missing[:6])}"
            f"{', ...' if len(missing) > 6 else ''}); check the prefix and the config"
        )
    for alias, key in model.tied.items():
        if alias in names and key in names and not _same_tensor_values(source, names[alias], names[key]):
            raise ModelMismatchError(
                f"{source.path}: {names[alias]!r} differs from {names[key]!r}, but the model of "
                f"{model.config_path} ties {alias!r} to {key!r} and stores only the latter (from_pretrained "
                "would make both the same): the checkpoint was trained untied; export with a config that does "
                "not tie them (tie_word_embeddings=false)"
            )
    extra = [k for k in names if k not in model.stored and k not in model.tied]
    if extra:
        raise ModelMismatchError(
            f"{source.path}: {names[extra[0]]!r} has no place in the model of {model.config_path} "
            f"({len(extra)} unexpected: {', '.join(extra[:6])}{', ...' if len(extra) > 6 else ''}); "
            "check the prefix and the config"
        )
    return out


COMPARE_BLOCK_BYTES = 8 << 20  # the two blocks compared at a time: small beside the export's own


def _same_tensor_values(source, a: str, b: str) -> bool:
    """Whether tensors ``a`` and ``b`` of ``source`` hold the same bytes (compared block by block)."""
    ma, mb = source.tensors[a], source.tensors[b]
    if tuple(ma.size) != tuple(mb.size) or ma.properties.dtype != mb.properties.dtype:
        return False
    for offsets, sizes in source.block_boxes(a, COMPARE_BLOCK_BYTES):
        x, y = source.read_block(a, offsets, sizes), source.read_block(b, offsets, sizes)
        if not torch.equal(x.contiguous().view(torch.uint8), y.contiguous().view(torch.uint8)):
            return False
    return True


def copy_model_files(config_dir: str, out: str, dtype: torch.dtype | None) -> list[str]:
    """Copy ``config.json`` (its ``dtype`` set to ``dtype``, what ``from_pretrained`` loads in)
    and every other file of ``config_dir`` that is not weights (tokenizer, generation config)."""
    with open(os.path.join(config_dir, CONFIG)) as f:
        config = json.load(f)
    if dtype is not None:
        name = str(dtype).removeprefix("torch.")
        config["dtype"] = name
        if "torch_dtype" in config:
            config["torch_dtype"] = name
    _write_durably(os.path.join(out, CONFIG), json.dumps(config, indent=2, sort_keys=True) + "\n")
    copied = [CONFIG]
    for name in sorted(os.listdir(config_dir)):
        path = os.path.join(config_dir, name)
        if name == CONFIG or name.startswith(".") or name.endswith(_WEIGHT_SUFFIXES) or not os.path.isfile(path):
            continue
        shutil.copyfile(path, os.path.join(out, name))
        with open(os.path.join(out, name), "rb+") as f:
            os.fsync(f.fileno())
        copied.append(name)
    return copied


def _write_durably(path: str, text: str) -> None:
    with open(path, "x") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())

