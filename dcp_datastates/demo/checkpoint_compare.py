"""Are two checkpoints the same? Ours and DCP's of one step, loaded whole, compared bit for bit.

Both are loaded into this process without a process group (DCP reshards
every saved shard into whole tensors), so the comparison does not depend
on how many ranks wrote either, nor on either on-disk format.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader

from dcp_datastates import DataStatesReader
from dcp_datastates._dcp_compat import load_whole_checkpoint


def compare_checkpoints(ours: str, theirs: str) -> tuple[bool | None, str]:
    """Load both checkpoints whole in this process and compare every entry bit for bit.

    ``(True, summary)`` when identical, ``(False, the first difference)``, or
    ``(None, why)`` when this torch cannot load a whole checkpoint (skipped, not failed).
    """
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            a = load_whole_checkpoint(DataStatesReader(ours, verify=True))
            b = load_whole_checkpoint(FileSystemReader(theirs))
    except ImportError as exc:  # private DCP helper moved: skip, do not fail
        return None, f"skipped ({exc})"
    fa, fb = _flatten(a), _flatten(b)
    if fa.keys() != fb.keys():
        return False, f"different keys: {sorted(fa.keys() ^ fb.keys())[:5]}"
    n_tensors = n_bytes = 0
    for k, va in fa.items():
        vb = fb[k]
        if isinstance(va, torch.Tensor):
            if not (isinstance(vb, torch.Tensor) and va.dtype == vb.dtype and va.shape == vb.shape
                    and torch.equal(va, vb)):
                return False, f"{k!r} differs"
            n_tensors += 1
            n_bytes += va.numel() * va.element_size()
        elif va != vb:
            return False, f"{k!r} differs: {va!r} != {vb!r}"
    return True, f"{len(fa)} entries ({n_tensors} tensors, {n_bytes / 1e6:.1f} MB) identical"


def _flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    """``{"a.b.0": leaf}`` for every leaf of nested dicts, lists and tuples."""
    out: dict[str, Any] = {}
    if isinstance(d, dict):
        for k, v in d.items():
            out.update(_flatten(v, f"{prefix}{k}."))
    elif isinstance(d, (list, tuple)):
        for i, v in enumerate(d):
            out.update(_flatten(v, f"{prefix}{i}."))
    else:
        out[prefix[:-1]] = d
    return out
