"""Safe mode for saved Python objects: plain data only, unless the user allows pickles.

DCP stores every non-tensor value of a state dict with ``torch.save`` and
loads it with ``torch.load(weights_only=False)``, which runs whatever the
pickle asks for. In safe mode :func:`load_checked` loads the saved bytes with
torch's restricted unpickler (the one behind ``weights_only=True``: containers,
numbers, strings, tensors, and globals registered with
``torch.serialization.add_safe_globals``). An object that needs more raises
:class:`UnsafeCheckpointError` naming the key and the global it wanted.

DCP never unpickles the saved bytes: they could mean something else to its
full unpickler than to the check (numpy's ``NEWOBJ ndarray`` forging object
pointers; a memo index that makes the C unpickler allocate gigabytes).
:func:`plain_object_stream` hands DCP a fresh ``torch.save`` of the checked
values instead: our own pickle of validated values, in torch's legacy format
and pickle protocol 4, which is cheaper to write and read than the saved
archive. Every loader of saved objects goes through :func:`load_checked`: the
reader, :class:`~dcp_datastates.tools.checkpoint_view.CheckpointView`, convert and
verify.

Besides torch's defaults, the check admits plain data that cannot run code:
``set`` and ``frozenset``, the ``datetime`` values (date, time, datetime,
timedelta, timezone), and numpy scalars, dtypes and arrays of non-object
dtypes, which the stand-ins of :mod:`plain_numpy` verify (numpy's own
unpickling trusts dtype flags a pickle can forge). Each pickle name resolves to
a stand-in whose ``__new__`` checks its arguments and returns the real value
(or, for numpy dtypes and arrays, a stand-in finished by a checked BUILD), so
REDUCE and NEWOBJ get the same checks and BUILD on a finished value is refused.
They are admitted through torch's public ``safe_globals`` while a check
runs (shared, reference counted, by concurrent checks). The stand-ins raise
if they are used outside a check, so another thread's
``torch.load(weights_only=True)`` during a check never receives one; it may
accept a plain datetime or frozenset meanwhile, and a user's
``add_safe_globals`` made in another thread while a check runs is undone
when the last check ends (torch restores its list as it was): call it before
loading.
"""

from __future__ import annotations

import datetime
import functools
import io
import os
import pickle
import re
import threading
import types
from typing import Any

import torch

from dcp_datastates.format import plain_numpy
from dcp_datastates.errors import CorruptCheckpointError, UnsafeCheckpointError

# torch's wording differs between releases and between refused and blocked modules.
_GLOBAL_RE = re.compile(r"(?:Unsupported global: GLOBAL|unsupported GLOBAL) ([\w.]+)")
_REFUSED_RE = re.compile(re.escape(plain_numpy.REFUSED) + r": ([^\n]+)")
_REASON_RE = re.compile(r"WeightsUnpickler error: ([^\n]+)")


def _empty_bytes(*args):
    """``builtins.bytes`` as the restricted unpickler sees it: ``torch.save`` pickles ``b""``
    as a call of ``bytes()`` (protocol 2). Only that call is plain data; ``bytes(n)``
    would let a pickle allocate any amount of memory."""
    if args:
        raise plain_numpy.refuse("a call of bytes() with arguments (only b'' is plain data)")
    return b""


def _date(*args):
    value = datetime.date(*args)  # a pickled state is checked for its month only: rebuild it
    return datetime.date(value.year, value.month, value.day)


def _time(*args):
    v = datetime.time(*args)
    return datetime.time(v.hour, v.minute, v.second, v.microsecond, v.tzinfo, fold=v.fold)


def _datetime(*args):
    v = datetime.datetime(*args)
    return datetime.datetime(v.year, v.month, v.day, v.hour, v.minute, v.second, v.microsecond, v.tzinfo, fold=v.fold)


def _stand_in(name: str, build) -> type:
    """The stand-in for the pickle name ``name``: a call (REDUCE) and NEWOBJ both run
    ``build(*args)``, which returns a real, checked value (never an instance of the
    stand-in), so BUILD on the result is refused by the unpickler."""

    def __new__(cls, *args):
        try:
            return build(*args)
        except pickle.UnpicklingError:
            raise
        except Exception as exc:  # noqa: BLE001 - any bad argument is a refusal
            raise plain_numpy.refuse(f"{name}{plain_numpy._show(args)}, which is not a valid {name} ({exc})") from None

    return type(f"Plain_{name.replace('.', '_')}", (), {"__new__": __new__, "__slots__": (), "__module__": __name__})


@functools.lru_cache(maxsize=None)
def _plain_data_globals() -> tuple:
    """``(stand-in, pickle name)`` pairs the check admits besides torch's defaults."""
    builds = {
        "builtins.bytes": _empty_bytes, "builtins.frozenset": frozenset,
        "datetime.date": _date, "datetime.time": _time, "datetime.datetime": _datetime,
        "datetime.timedelta": datetime.timedelta, "datetime.timezone": datetime.timezone,
    }
    out = [(_stand_in(name, build), name) for name, build in builds.items()]
    try:
        import numpy  # noqa: F401
    except ImportError:  # no numpy: no numpy values to check
        return tuple(out)
    return tuple(out + plain_numpy.allowlist())


def _weights_only_forced() -> bool:
    """torch turns every ``torch.load`` into ``weights_only=True`` (refusing a pickle module)."""
    return os.getenv("TORCH_FORCE_WEIGHTS_ONLY_LOAD", "0").lower() in ("1", "y", "yes", "true")


class _PlainDataAdmitted:
    """Holds the plain-data globals in torch's (process-wide) allowlist while any check runs.

    Reference counted: concurrent checks (a load's I/O threads, several
    readers) share one registration, and the last to leave removes it.
    """

    _lock = threading.Lock()
    _users = 0
    _registration = None

    def __enter__(self):
        cls = type(self)
        with cls._lock:
            if cls._users == 0:
                registration = torch.serialization.safe_globals(list(_plain_data_globals()))
                registration.__enter__()
                cls._registration = registration
            cls._users += 1
        return self

    def __exit__(self, *exc):
        cls = type(self)
        with cls._lock:
            cls._users -= 1
            if cls._users == 0:
                cls._registration.__exit__(None, None, None)
                cls._registration = None
        return False


class CheckedObject(io.BytesIO):
    """A ``torch.save`` that :func:`plain_object_stream` wrote from checked values (not saved bytes)."""


class _Repickler(pickle.Pickler):
    def reducer_override(self, obj):
        if type(obj) is type and obj in _stand_in_names():
            raise plain_numpy.refuse(f"the bare class {_stand_in_names()[obj]} (not a value)")
        return plain_numpy.reduce_stand_in(obj)


@functools.lru_cache(maxsize=None)
def _stand_in_names() -> dict:
    return {obj: name for obj, name in _plain_data_globals()}


_REPICKLE = types.ModuleType(f"{__name__}._repickle")
_REPICKLE.Pickler, _REPICKLE.dump = _Repickler, pickle.dump


def load_checked(file, key: str, where: str, **load_kwargs) -> Any:
    """``torch.load(file, **load_kwargs)`` admitting plain data only; raises
    :class:`UnsafeCheckpointError` (or :class:`CorruptCheckpointError`) naming ``key``.
    numpy dtypes and arrays in the result may still be (finished) stand-ins: see
    :func:`plain_object_stream` for the object itself."""
    try:
        with plain_numpy.checking(), _PlainDataAdmitted():
            return torch.load(file, weights_only=True, **load_kwargs)
    except Exception as exc:  # noqa: BLE001 - classified
        raise _refusal(exc, key, where) from None


def plain_object_stream(blob, key: str, where: str, map_location: Any = "cpu") -> CheckedObject:
    """What safe mode hands DCP for the saved object ``key`` (``torch.save`` bytes ``blob``):
    a fresh ``torch.save`` of the values :func:`load_checked` built and checked."""
    value = load_checked(io.BytesIO(blob), key, where, map_location=map_location)
    out = CheckedObject()
    try:  # protocol 2 under TORCH_FORCE_WEIGHTS_ONLY_LOAD: DCP's forced weights_only load reads only that
        torch.save(value, out, pickle_module=_REPICKLE, pickle_protocol=2 if _weights_only_forced() else 4,
                   _use_new_zipfile_serialization=False)
    except Exception as exc:  # noqa: BLE001 - classified
        raise _refusal(exc, key, where) from None
    out.seek(0)
    return out


def load_plain_object(blob, key: str, where: str) -> Any:
    """The saved object ``key`` (``torch.save`` bytes ``blob``) as safe mode loads it: plain
    data, with real set, datetime and numpy values."""
    stream = plain_object_stream(blob, key, where)
    return torch.load(stream, weights_only=False, map_location="cpu")  # our own pickle of checked values


def check_object_is_plain(blob: bytes | bytearray, key: str, where: str) -> None:
    """Raise unless safe mode loads ``blob`` (a ``torch.save`` of the object ``key``)."""
    plain_object_stream(blob, key, where)


def _refusal(exc: Exception, key: str, where: str) -> Exception:
    """The error for a saved object safe mode did not load."""
    if isinstance(exc, RecursionError):
        return CorruptCheckpointError(f"{where}: the saved object {key!r} cannot be decoded: nested too deeply")
    if isinstance(exc, MemoryError):
        return CorruptCheckpointError(f"{where}: the saved object {key!r} asks for too much memory")
    message = str(exc)
    if not (isinstance(exc, pickle.UnpicklingError) or "Weights only load failed" in message):
        return CorruptCheckpointError(f"{where}: the saved object {key!r} cannot be decoded: {exc}")
    refused = _REFUSED_RE.search(message)
    if refused:
        return UnsafeCheckpointError(
            f"{where}: the saved object {key!r} holds {refused.group(1)}, which safe mode does not "
            "load (it could corrupt memory or run code); it was not loaded. If you trust this "
            "checkpoint, load it with DataStatesReader(path, allow_pickle=True)"
        )
    found = _GLOBAL_RE.search(message)
    reason = _REASON_RE.search(message) or re.match(r"[^\n]*", message)
    what = f"the class {found.group(1)}" if found else "a type outside plain data"
    why = "" if found else f" ({reason.group(reason.lastindex or 0)[:200]})"
    return UnsafeCheckpointError(
        f"{where}: the saved object {key!r} needs {what} to be unpickled{why}, which could run "
        "code; it was not loaded. If you trust this checkpoint, load it with "
        "DataStatesReader(path, allow_pickle=True), or allow that one class with "
        "torch.serialization.add_safe_globals([...])"
    )
