"""Some of a checkpoint's tensors, under other names, in another dtype: a view over a view.

An export writes a part of a checkpoint (the model, not the optimizer) under
the names its consumer expects (the ``model.`` prefix stripped) and often in
another dtype. :class:`SelectedView` presents exactly that to the writers of
:mod:`tools.formats`, which read it as they read a :class:`CheckpointView`:
each block is read from the source under its saved name and cast on the way,
so memory stays bounded by a block (and its cast copy).
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

# The dtypes a cast applies to; integer, boolean and float8 tensors keep theirs (as ``model.to(dtype)``).
CASTABLE = (torch.float64, torch.float32, torch.float16, torch.bfloat16)


class SelectedView:
    """The tensors ``names`` (new name -> the source's key) of ``source``, cast to ``dtype``."""

    objects: list[str] = []

    def __init__(self, source, names: dict[str, str], *, dtype: torch.dtype | None = None) -> None:
        self.source = source
        self.path = source.path
        self.format = source.format
        self.allow_pickle = source.allow_pickle
        self.names = dict(names)
        self.tensors: dict[str, TensorStorageMetadata] = {}
        for name, key in self.names.items():
            md = source.tensors[key]
            if dtype is not None and md.properties.dtype in CASTABLE:
                md = dataclasses.replace(md, properties=dataclasses.replace(md.properties, dtype=dtype))
            self.tensors[name] = md

    def keys(self) -> list[str]:
        return list(self.tensors)

    def nbytes(self, fqn: str) -> int:
        md = self._md(fqn)
        return math.prod(md.size) * md.properties.dtype.itemsize

    def read_block(self, fqn: str, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> torch.Tensor:
        dtype = self._md(fqn).properties.dtype
        block = self.source.read_block(self.names[fqn], offsets, sizes)
        return block if block.dtype == dtype else block.to(dtype)

    def read_tensor(self, fqn: str) -> torch.Tensor:
        md = self._md(fqn)
        return self.read_block(fqn, (0,) * len(md.size), tuple(md.size))

    def _md(self, fqn: str) -> TensorStorageMetadata:
        md = self.tensors.get(fqn)
        if md is None:
            raise KeyError(f"{self.path}: {fqn!r} is not among the selected tensors")
        return md
