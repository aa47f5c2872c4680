"""``export --format hdf5``: one HDF5 file, a dataset per key at its root, attributes as HDF5 attributes."""

from __future__ import annotations

import json

# HDF5's chunk cache: the two partly written chunks at a block's ends (export's chunks are at most 4 MiB).
CHUNK_CACHE_BYTES = 8 << 20


def write(path, datasets, n_steps, root_attrs, dataset_attrs, blocks) -> None:
    """One HDF5 file: datasets at the root, attributes as HDF5 attributes (objects as JSON text)."""
    import h5py
    import numpy as np

    # libver v108: dense attribute storage, so an "objects" attribute over 64 KiB is allowed
    # (readable by HDF5 1.8 and later).
    with h5py.File(
        path, "w-", libver=("v108", "latest"), rdcc_nbytes=CHUNK_CACHE_BYTES, rdcc_nslots=10007
    ) as f:
        for name, value in root_attrs.items():
            f.attrs[name] = _attr(name, value, np)
        for ds in datasets:
            shape = (n_steps,) + ds.shape
            empty = 0 in shape
            h = f.create_dataset(ds.name, shape=shape, dtype=ds.stored_as, chunks=None if empty else ds.chunks)
            for name, value in dataset_attrs[ds.name].items():
                h.attrs[name] = _attr(name, value, np)
            del h
        # One dataset open at a time: each open dataset keeps its own chunk cache
        # (dirty chunks included) until it is closed, so keeping every dataset
        # open would hold up to a cache per key (measured: RSS grew by the whole
        # checkpoint). Closing the previous one writes its cached chunks out.
        current: list = [None, None]  # name, handle

        for ds, index, array in blocks:
            if current[0] != ds.name:
                current[1] = None  # closes the previous dataset (h5py closes on the last reference)
                current[0], current[1] = ds.name, f[ds.name]
            current[1][index] = array
            del array
        current[1] = None


def _attr(name: str, value, np):
    """An attribute value HDF5 can hold: int arrays, string arrays, JSON text for ``objects``."""
    if name == "objects":
        return json.dumps(value)
    if name == "steps":
        return np.asarray(value, dtype=np.int64)
    if name == "checkpoints":
        import h5py

        return np.asarray(value, dtype=h5py.string_dtype())
    return value
