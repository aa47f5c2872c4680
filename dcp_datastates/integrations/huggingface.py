"""Hugging Face ``transformers``: export a training checkpoint for ``from_pretrained``, start a run from one.

* :func:`export_to_huggingface`: the model part of a checkpoint (ours, stock
  DCP, local or ``s3://``) as a directory ``from_pretrained`` loads, streamed
  block by block (``dcp-datastates convert CKPT --to huggingface OUT``).
* :func:`import_from_huggingface`: a Hugging Face directory as a checkpoint of
  ours under the ``model`` prefix, loadable at any world size
  (``dcp-datastates convert HF_DIR --to datastates OUT``).
* :func:`load_from_huggingface`: fill the model part of a state dict, at any
  world size, straight from a Hugging Face directory; what
  ``CheckpointManagerOptions(init_from_huggingface=...)`` does on a fresh root.

All three are the library face of the machinery in :mod:`tools.conversion`
and :mod:`manager.huggingface_init`; docs/huggingface.md describes them.
transformers is imported only where a config must be read.
"""

from __future__ import annotations

import os

from dcp_datastates.errors import CheckpointNotFoundError
from dcp_datastates.manager.huggingface_init import load_from_huggingface
from dcp_datastates.tools.conversion import DEFAULT_MAX_SHARD_BYTES, ConvertSummary, Progress, convert_checkpoint
from dcp_datastates.tools.formats.huggingface import DEFAULT_PREFIX
from dcp_datastates.tools.safetensors_view import is_safetensors_dir

__all__ = ["export_to_huggingface", "import_from_huggingface", "load_from_huggingface"]


def export_to_huggingface(
    checkpoint: str | os.PathLike,
    out: str | os.PathLike,
    *,
    config_dir: str | os.PathLike | None = None,
    prefix: str = DEFAULT_PREFIX,
    dtype: str | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    overwrite: bool = False,
    allow_pickle: bool = False,
    progress: Progress | None = None,
) -> ConvertSummary:
    """Write the tensors under ``prefix`` of ``checkpoint`` to ``out`` as ``from_pretrained`` loads them.

    The prefix is stripped; ``dtype`` (``"bf16"``, ``"fp16"``, ``"fp32"``;
    None keeps the saved ones) casts floating-point tensors block by block.
    With ``config_dir`` (a directory holding the model's ``config.json``, and
    maybe its tokenizer), the tensors are checked against the model it
    describes (a missing, extra or misshapen one raises
    :class:`~dcp_datastates.errors.ModelMismatchError` naming it, before
    anything is written), tied weights are written once as ``save_pretrained``
    writes them, and the config (its dtype set) and the tokenizer and
    generation files are copied. One shard is ``model.safetensors``; more are
    ``model-0000i-of-0000N.safetensors`` of at most ``max_shard_bytes`` with
    ``model.safetensors.index.json``. ``out`` appears whole or not at all.
    """
    return convert_checkpoint(
        checkpoint, out, "huggingface", max_shard_bytes=max_shard_bytes, overwrite=overwrite,
        allow_pickle=allow_pickle, progress=progress, prefix=prefix, config_dir=config_dir, dtype=dtype,
    )


def import_from_huggingface(
    model_dir: str | os.PathLike,
    out: str | os.PathLike,
    *,
    prefix: str = DEFAULT_PREFIX,
    overwrite: bool = False,
    progress: Progress | None = None,
) -> ConvertSummary:
    """Write the safetensors weights of ``model_dir`` (one file or shards) as a checkpoint of ours at ``out``.

    Keys go under ``prefix`` (``model.transformer.wte.weight``), so
    ``dcp.load({"model": model.state_dict()}, storage_reader=DataStatesReader(out))``
    fills a model at any world size. Tied weights the files leave out are
    added when ``model_dir`` holds a ``config.json`` (and transformers is
    installed), as the model's ``state_dict()`` holds them. Read tensor by
    tensor; ``out`` (a local directory) appears whole or not at all.
    """
    if not is_safetensors_dir(model_dir):
        raise CheckpointNotFoundError(f"{os.fspath(model_dir)}: not a Hugging Face model directory (no *.safetensors "
                                      "file, or a checkpoint's .metadata)")
    return convert_checkpoint(model_dir, out, "datastates", overwrite=overwrite, progress=progress, prefix=prefix)
