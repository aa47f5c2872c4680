"""``export --format zarr``: a zarr v2 group directory, one array (tensorstore's "zarr" driver) per key."""

from __future__ import annotations

import json
import os


def write(path, datasets, n_steps, root_attrs, dataset_attrs, blocks) -> None:
    """A zarr v2 group directory: ``.zgroup``, ``.zattrs``, one array (tensorstore "zarr") per key."""
    import numpy as np
    import tensorstore as ts

    os.mkdir(path)
    _write_json(os.path.join(path, ".zgroup"), {"zarr_format": 2})
    _write_json(os.path.join(path, ".zattrs"), root_attrs)
    stores = {}
    for ds in datasets:
        array_dir = os.path.join(path, ds.name)
        spec = {
            "driver": "zarr",
            "kvstore": {"driver": "file", "path": array_dir},
            "metadata": {
                "shape": [n_steps, *ds.shape],
                "chunks": list(ds.chunks),
                "dtype": np.dtype(ds.stored_as).str,
                "compressor": None,
                "fill_value": None,
                "order": "C",
            },
        }
        stores[ds.name] = ts.open(spec, create=True, delete_existing=False).result()
        # tensorstore's zarr v2 driver does not write attributes; they are plain JSON.
        _write_json(os.path.join(array_dir, ".zattrs"), dataset_attrs[ds.name])

    for ds, index, array in blocks:
        stores[ds.name][index].write(array).result()
        del array


def _write_json(path: str, value) -> None:
    with open(path, "x", encoding="utf-8") as f:
        json.dump(value, f, allow_nan=False)
        f.write("\n")
