"""Safe mode for saved Python objects: plain data only, unless the user allows pickles.

DCP stores every non-tensor value of a state dict with ``torch.save`` and
loads it with ``torch.load(weights_only=False)``, which runs whatever the
pickle asks for. Before DCP sees the bytes, the reader checks them with
torch's restricted unpickler (``weights_only=True``: containers, numbers,
strings, tensors, and globals registered with
``torch.serialization.add_safe_globals``). An object that needs more raises
:class:`UnsafeCheckpointError` naming the key and the global it wanted.
"""

from __future__ import annotations

import io
import pickle
import re

import torch

from .errors import CorruptCheckpointError, UnsafeCheckpointError

# torch's wording differs between releases and between refused and blocked modules.
_GLOBAL_RE = re.compile(r"(?:Unsupported global: GLOBAL|unsupported GLOBAL) ([\w.]+)")


def _empty_bytes(*args):
    """``builtins.bytes`` as the restricted unpickler sees it: ``torch.save`` pickles ``b""``
    as a call of ``bytes()`` (protocol 2). Only that call is plain data; ``bytes(n)``
    would let a pickle allocate any amount of memory."""
    if args:
        raise pickle.UnpicklingError("bytes() called with arguments is not plain data")
    return b""


def check_object_is_plain(blob: bytes | bytearray, key: str, where: str) -> None:
    """Raise unless ``blob`` (a ``torch.save`` of the object ``key``) loads with weights_only."""
    try:
        with torch.serialization.safe_globals([(_empty_bytes, "builtins.bytes")]):
            torch.load(io.BytesIO(blob), weights_only=True, map_location="cpu")
    except Exception as exc:  # noqa: BLE001 - classified below
        message = str(exc)
        if "Weights only load failed" in message or "weights_only" in message:
            found = _GLOBAL_RE.search(message)
            what = f"the class {found.group(1)}" if found else "a type outside plain data"
            raise UnsafeCheckpointError(
                f"{where}: the saved object {key!r} needs {what} to be unpickled, which could run "
                "code; it was not loaded. If you trust this checkpoint, load it with "
                "DataStatesReader(path, allow_pickle=True), or allow that one class with "
                "torch.serialization.add_safe_globals([...])"
            ) from None
        raise CorruptCheckpointError(f"{where}: the saved object {key!r} cannot be decoded: {exc}") from exc
