"""``convert --to torch``: one ``torch.save`` file holding the nested state dict as it was saved.

The nesting is rebuilt from ``metadata.planner_data``, as DCP's own
``dcp_to_torch_save`` does. A skeleton of fake tensors is saved without data,
mapped back (``MAP_SHARED``) and filled block by block.
"""

from __future__ import annotations

import mmap
import os
from typing import Any

import torch

from dcp_datastates.errors import CheckpointError
from dcp_datastates.format.safe_objects import load_checked
from dcp_datastates.tools.formats import block_bytes


def write(view, tmp: str, summary, tracker, _shard: int) -> None:
    """One torch.save file: a data-less skeleton saved, mapped back shared, filled block by block.

    Only one block is in anonymous memory at a time; the file's pages go
    through the page cache (the mapping), which the kernel writes back and
    reclaims, and are flushed with an fsync before the rename.
    """
    from dcp_datastates._dcp_compat import fake_tensor_mode

    flat: dict[str, Any] = {}
    with fake_tensor_mode():
        for fqn, md in view.tensors.items():
            flat[fqn] = torch.empty(tuple(md.size), dtype=md.properties.dtype)
    for fqn in view.objects:
        flat[fqn] = view.read_object(fqn)
    paths = _nested_paths(view)
    skeleton = _unflatten({k: flat[k] for k in view.keys() if k in flat}, paths)
    with torch.serialization.skip_data(materialize_fake_tensors=True):
        torch.save(skeleton, tmp)
    del skeleton, flat
    # The data regions are holes until the mapping fills them; a full disk would then
    # kill the process with SIGBUS. Reserving the blocks first turns that into ENOSPC.
    fd = os.open(tmp, os.O_RDWR | os.O_CLOEXEC)
    try:
        os.posix_fallocate(fd, 0, os.fstat(fd).st_size)
    finally:
        os.close(fd)
    with torch.serialization.set_default_mmap_options(mmap.MAP_SHARED):
        if view.allow_pickle:
            mapped = torch.load(tmp, mmap=True, weights_only=False)
        else:  # its objects are safe mode's plain data (set, datetime, numpy): load it the same way
            mapped = load_checked(tmp, "the converted state", tmp, mmap=True, map_location="cpu")
    try:
        for fqn in view.tensors:
            target = _get_path(mapped, paths[fqn])
            for offsets, block in view.blocks(fqn, block_bytes(view)):
                box = target
                for d, (o, n) in enumerate(zip(offsets, block.shape)):
                    box = box.narrow(d, o, n)
                box.copy_(block)
                tracker.add(block.numel() * block.element_size())
                del block, box  # before the next block is read, not after
            summary.tensors += 1
            summary.bytes += view.nbytes(fqn)
    finally:
        del mapped  # unmaps the file: the pages written are in the page cache
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    summary.objects = len(view.objects)
    summary.files = [os.path.basename(summary.out)]


def _nested_paths(view) -> dict[str, tuple]:
    """Each key's path in the nested state dict (``planner_data``), or the key itself."""
    mappings = view.metadata.planner_data if isinstance(view.metadata.planner_data, dict) else {}
    return {fqn: tuple(mappings.get(fqn) or (fqn,)) for fqn in view.keys()}


def _unflatten(flat: dict[str, Any], paths: dict[str, tuple]) -> dict:
    """The nested state dict: like DCP's unflattening, an int path element means a list index."""
    root: dict = {}
    for fqn, value in flat.items():
        path = paths[fqn]
        cur: Any = root
        for key, following in zip(path, path[1:]):
            cur = _child(cur, key, [] if isinstance(following, int) else {}, fqn)
        _put(cur, path[-1], value, fqn)
    return root


def _child(container: Any, key: Any, default: Any, fqn: str) -> Any:
    if isinstance(container, dict):
        value = container.setdefault(key, default)
    else:
        _put(container, key, None, fqn, keep=True)
        if container[key] is None:
            container[key] = default
        value = container[key]
    if not isinstance(value, (dict, list)):
        raise CheckpointError(f"key {fqn!r}: its path {key!r} is also a value of another key (planner_data is inconsistent)")
    return value


def _put(container: Any, key: Any, value: Any, fqn: str, keep: bool = False) -> None:
    if isinstance(container, dict):
        container[key] = value
        return
    if not isinstance(key, int) or key < 0:
        raise CheckpointError(f"key {fqn!r}: path element {key!r} indexes a list")
    container.extend([None] * (key + 1 - len(container)))
    if not keep:
        container[key] = value


def _get_path(root: Any, path: tuple) -> Any:
    for key in path:
        root = root[key]
    return root
