"""A Hugging Face directory of safetensors files, read key by key like :class:`CheckpointView`.

What ``convert`` (and :func:`dcp_datastates.integrations.huggingface.import_from_huggingface`)
takes as a source when a directory holds ``model.safetensors`` or the shards
``model.safetensors.index.json`` names: every tensor is put under a prefix
(``model`` by default, so that a ``{"model": model.state_dict()}`` load finds it)
and read on demand with ``safe_open``, one tensor or one slice at a time,
so memory is bounded by what is read, not by the model.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorProperties, TensorStorageMetadata

from dcp_datastates.errors import CheckpointNotFoundError, CorruptCheckpointError
from dcp_datastates.format.file_names import METADATA_FILE
from dcp_datastates.storage.url import is_store_url

FORMAT_HUGGINGFACE = "huggingface"
INDEX = "model.safetensors.index.json"
SUFFIX = ".safetensors"


def is_safetensors_dir(path: str | os.PathLike) -> bool:
    """A local directory holding safetensors files and no ``.metadata`` (not a DCP checkpoint)."""
    path = os.fspath(path)
    if is_store_url(path) or not os.path.isdir(path) or os.path.exists(os.path.join(path, METADATA_FILE)):
        return False
    return any(name.endswith(SUFFIX) for name in os.listdir(path))


@dataclasses.dataclass(frozen=True)
class _Planner:
    """Stands for a checkpoint's ``.metadata`` where the convert machinery reads ``planner_data``."""

    planner_data: dict[str, tuple[str, ...]]


class SafetensorsDirView:
    """The tensors of a Hugging Face directory, under ``prefix``, with ``aliases`` added.

    ``aliases`` maps a (prefix-less) name to the file's key it repeats: a tied
    weight ``save_pretrained`` left out (``lm_head.weight`` of ``transformer.wte.weight``),
    so that the converted checkpoint holds every key of the model's ``state_dict()``.
    """

    format = FORMAT_HUGGINGFACE
    allow_pickle = False
    objects: list[str] = []

    def __init__(self, path: str | os.PathLike, *, prefix: str = "model", aliases: dict[str, str] | None = None) -> None:
        self.path = os.fspath(path)
        if not os.path.isdir(self.path):
            raise CheckpointNotFoundError(f"no Hugging Face model at {self.path}: the directory does not exist")
        self.prefix = prefix
        self.tensors: dict[str, TensorStorageMetadata] = {}
        self._where: dict[str, tuple[str, str]] = {}  # our key -> (file, its key in the file)
        for file in self._files():
            for key, md in _read_header(file).items():
                ours = self.full_key(key)
                if ours in self._where:
                    raise CorruptCheckpointError(
                        f"{self.path}: key {key!r} is in both {self._where[ours][0]} and {file}"
                    )
                self.tensors[ours] = md
                self._where[ours] = (file, key)
        if not self.tensors:
            raise CorruptCheckpointError(f"{self.path}: the safetensors files hold no tensor")
        for alias, source in (aliases or {}).items():
            ours, src = self.full_key(alias), self.full_key(source)
            if ours in self.tensors or src not in self.tensors:
                continue  # stored after all, or a source this directory lacks (reported by the load)
            self.tensors[ours] = self.tensors[src]
            self._where[ours] = self._where[src]
        # how each key nests: {"model": {"lm_head.weight": ...}}, as DCP flattened a model's state dict
        nested = (lambda ours: (prefix, ours[len(prefix) + 1:])) if prefix else (lambda ours: (ours,))
        self.metadata = _Planner({ours: nested(ours) for ours in self.tensors})

    def full_key(self, key: str) -> str:
        """The key of file key ``key`` in the converted checkpoint: ``prefix.key``."""
        return f"{self.prefix}.{key}" if self.prefix else key

    def _files(self) -> list[str]:
        """The files the index names (each once, in order), or every ``*.safetensors`` without one."""
        index = os.path.join(self.path, INDEX)
        if os.path.exists(index):
            try:
                with open(index) as f:
                    weight_map = json.load(f)["weight_map"]
                names = list(dict.fromkeys(weight_map.values()))
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
                raise CorruptCheckpointError(f"{index}: not a safetensors index ({exc})") from exc
            for name in names:
                if not isinstance(name, str) or os.path.basename(name) != name or not name.endswith(SUFFIX):
                    raise CorruptCheckpointError(f"{index}: names {name!r}, not a safetensors file in {self.path}")
                if not os.path.isfile(os.path.join(self.path, name)):
                    raise CorruptCheckpointError(f"{index}: names {name}, which is missing from {self.path}")
        else:
            names = sorted(n for n in os.listdir(self.path) if n.endswith(SUFFIX))
        return [os.path.join(self.path, n) for n in names]

    # -- what the convert machinery reads (the CheckpointView interface) -----------

    def keys(self) -> list[str]:
        return list(self.tensors)

    def nbytes(self, fqn: str) -> int:
        md = self._md(fqn)
        return math.prod(md.size) * md.properties.dtype.itemsize

    def read_tensor(self, fqn: str) -> torch.Tensor:
        file, key = self._locate(fqn)
        with _opened(file) as f:
            return f.get_tensor(key)

    def read_block(self, fqn: str, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> torch.Tensor:
        """The box ``[offsets, offsets + sizes)`` of tensor ``fqn``, read as a slice of its file."""
        md = self._md(fqn)
        if len(offsets) != len(md.size) or any(o < 0 or n < 0 or o + n > s for o, n, s in zip(offsets, sizes, md.size)):
            raise ValueError(f"{fqn!r}: box {offsets}+{sizes} is outside its shape {tuple(md.size)}")
        file, key = self._locate(fqn)
        with _opened(file) as f:
            if not md.size:
                return f.get_tensor(key)
            return f.get_slice(key)[tuple(slice(o, o + n) for o, n in zip(offsets, sizes))].contiguous()

    def read_object(self, fqn: str) -> Any:
        raise KeyError(f"{self.path}: {fqn!r} is not an object (safetensors holds tensors only)")

    def _md(self, fqn: str) -> TensorStorageMetadata:
        md = self.tensors.get(fqn)
        if md is None:
            raise KeyError(f"{self.path}: {fqn!r} is not in the model")
        return md

    def _locate(self, fqn: str) -> tuple[str, str]:
        self._md(fqn)
        return self._where[fqn]


def _read_header(file: str) -> dict[str, TensorStorageMetadata]:
    """Every tensor of one safetensors file, by its key: dtype and shape, as one whole chunk."""
    from dcp_datastates.tools.formats.safetensors import DTYPES

    by_name = {name: dtype for dtype, name in DTYPES.items()}
    out = {}
    with _opened(file) as f:
        for key in f.keys():
            piece = f.get_slice(key)
            name, shape = piece.get_dtype(), list(piece.get_shape())
            if name not in by_name:
                raise CorruptCheckpointError(f"{file}: key {key!r} has dtype {name}, which torch cannot hold")
            size = torch.Size(shape)
            out[key] = TensorStorageMetadata(
                properties=TensorProperties(dtype=by_name[name]),
                size=size,
                chunks=[ChunkStorageMetadata(offsets=torch.Size([0] * len(shape)), sizes=size)],
            )
    return out


class _opened:
    """``safe_open`` of ``file`` whose failures (a torn or foreign file) name it."""

    def __init__(self, file: str) -> None:
        self.file = file

    def __enter__(self):
        from safetensors import safe_open

        try:
            self._cm = safe_open(self.file, framework="pt")
            return self._cm.__enter__()
        except FileNotFoundError:
            raise
        except Exception as exc:  # noqa: BLE001 - safetensors raises its own error type
            raise CorruptCheckpointError(f"{self.file}: not a readable safetensors file ({exc})") from exc

    def __exit__(self, *exc_info):
        return self._cm.__exit__(*exc_info)
