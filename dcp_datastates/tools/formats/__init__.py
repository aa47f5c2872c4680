"""The output formats of ``convert`` and ``export``: one module each, imported only when chosen.

A ``convert`` format module has ``write(view, tmp, summary, tracker,
max_shard_bytes)``, which builds the whole output at ``tmp`` from a
:class:`CheckpointView`, block by block (``huggingface`` plans first, against
a model's config: its ``HuggingFaceExport`` gives the ``write``); an ``export`` format module has
``write(path, datasets, steps, root_attrs, dataset_attrs, blocks)``.
"""

from __future__ import annotations

import importlib
import sys

BLOCK_BYTES = 64 << 20  # the largest block a conversion reads at once from our format

CONVERT = {
    "torch": "torch_save", "safetensors": "safetensors", "dcp": "dcp", "datastates": "datastates",
    "huggingface": "huggingface",
}
EXPORT = {"hdf5": "hdf5", "zarr": "zarr"}


def module(name: str):
    """The module of format ``name`` (a module of this package)."""
    return importlib.import_module(f"{__name__}.{name}")


def block_bytes(view) -> int:
    """Block size for reads: stock DCP stores each chunk as one torch.save record that is
    read whole whatever box is asked for, so blocks there are whole chunks (splitting
    them would read each chunk once per block)."""
    from dcp_datastates.tools.checkpoint_view import FORMAT_DCP

    return sys.maxsize if view.format == FORMAT_DCP else BLOCK_BYTES
