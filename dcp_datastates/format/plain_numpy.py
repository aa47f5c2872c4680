"""Checking numpy values in saved objects without trusting numpy's pickles.

numpy's own unpickling believes what a pickle says: a dtype's pickled state
sets its flags, so a pickle can make a float64 dtype claim that it holds
Python objects, and an array of that dtype then reads its raw bytes as object
pointers. Allowlisting ``numpy.dtype`` and ``numpy.ndarray`` for
``torch.load(weights_only=True)`` would admit that. So while safe mode checks
a saved object (:func:`safe_objects.load_checked`), numpy's pickle names
resolve, in that check's own allowlist, to the stand-ins below. Each checks
its arguments in ``__new__``, so a call (REDUCE) and ``cls.__new__(cls, *args)``
(NEWOBJ, which never runs ``__init__``) get the same checks; they accept

* a dtype only when its pickled state is exactly the one numpy writes for a
  dtype built without pickle from the same validated parts (type code, byte
  order, datetime unit, fields, subarray), and that dtype holds no objects;
* an array or a scalar only when it carries exactly the raw bytes its dtype
  and shape need (an object array carries a list instead: refused).

and numpy then builds the value from the checked parts only (the dtype,
``_reconstruct`` plus ``__setstate__``, ``scalar``), exactly as its own
unpickling would for an honest pickle. Anything else raises
``pickle.UnpicklingError`` marked :data:`REFUSED`. A finished dtype or array
stand-in holds its numpy value in ``real``; :func:`reduce_stand_in` tells the
re-pickling in :mod:`safe_objects` to write that value, so DCP never unpickles
the saved bytes. The stand-ins refuse to work outside a check.
"""

from __future__ import annotations

import math
import pickle
import re
import threading

REFUSED = "dcp_datastates refused"

_checking = threading.local()

# Type codes numpy writes in a dtype pickle for non-object dtypes.
_SPEC_RE = re.compile(r"^(?:b1|[iu](?:1|2|4|8)|f(?:2|4|8|12|16)|c(?:8|16|24|32)|[SUV][0-9]{1,9}|[Mm]8)$")
_DATETIME_UNITS = frozenset(
    {b"Y", b"M", b"W", b"D", b"h", b"m", b"s", b"ms", b"us", b"ns", b"ps", b"fs", b"as", b"generic"}
)
_ALIGNED_STRUCT = 0x80  # NPY_ALIGNED_STRUCT in a dtype's flags
_MAX_DIMS = 64
_MAX_ELEMENTS = 1 << 48


def refuse(what: str) -> pickle.UnpicklingError:
    return pickle.UnpicklingError(f"{REFUSED}: {what}")


class checking:
    """Marks the current thread as running a safe-mode check (the stand-ins work only then)."""

    def __enter__(self):
        _checking.depth = getattr(_checking, "depth", 0) + 1

    def __exit__(self, *exc):
        _checking.depth -= 1
        return False


def _require_check() -> None:
    if not getattr(_checking, "depth", 0):
        raise pickle.UnpicklingError(
            "numpy values are admitted by dcp_datastates' safe-mode check only; register numpy's "
            "globals with torch.serialization.add_safe_globals to load them with weights_only=True"
        )


def _shape(value) -> tuple:
    if not (isinstance(value, tuple) and len(value) <= _MAX_DIMS and all(type(n) is int and n >= 0 for n in value)):
        raise refuse(f"a numpy shape {_show(value)}")
    if math.prod(value) > _MAX_ELEMENTS:
        raise refuse(f"a numpy shape {value} of more than 2**48 elements")
    return value


def _real(value):
    """The numpy dtype a checked :class:`NumpyDtype` stands for."""
    if type(value) is not NumpyDtype or value.real is None:
        raise refuse(f"a numpy dtype that is not numpy's own pickle ({_show(value)})")
    return value.real


def _show(value, limit: int = 80) -> str:
    try:
        text = repr(value)
    except Exception:  # noqa: BLE001
        text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[:limit] + "..."


def _canonical_dtype(spec: str, state):
    """The dtype ``numpy.dtype(spec, False, True)`` becomes with ``state``, if numpy would
    have written exactly ``state`` for it and it holds no objects; refuses otherwise."""
    import numpy as np

    if not (isinstance(state, tuple) and len(state) in (8, 9)):
        raise refuse(f"numpy dtype state {_show(state)}")
    version, byteorder, subarray, names, fields, elsize, alignment, flags = state[:8]
    if (version, len(state)) not in ((3, 8), (4, 9)) or byteorder not in ("<", ">", "|", "="):
        raise refuse(f"numpy dtype state {_show(state)}")
    if type(flags) is not int or type(elsize) is not int or type(alignment) is not int:
        raise refuse(f"numpy dtype state {_show(state)}")
    base = spec
    if spec in ("M8", "m8"):
        meta = state[8] if len(state) == 9 else None
        if not (isinstance(meta, tuple) and len(meta) == 2 and meta[0] is None and isinstance(meta[1], tuple)):
            raise refuse(f"numpy datetime dtype metadata {_show(meta)}")
        if len(meta[1]) != 4:
            raise refuse(f"numpy datetime dtype metadata {_show(meta)}")
        unit, num, den, events = meta[1]
        if unit not in _DATETIME_UNITS or type(num) is not int or not 0 < num < 1 << 31 or den != 1 or events != 1:
            raise refuse(f"numpy datetime dtype metadata {_show(meta)}")
        if unit != b"generic":
            base = f"{spec}[{num if num != 1 else ''}{unit.decode()}]"
    elif len(state) == 9:
        raise refuse(f"numpy dtype metadata on a {spec} dtype")
    normalized = list(state)
    try:
        if subarray is not None:
            if names is not None or fields is not None or not (isinstance(subarray, tuple) and len(subarray) == 2):
                raise refuse(f"numpy subarray dtype state {_show(state)}")
            sub = _real(subarray[0])
            candidate = np.dtype((sub, _shape(subarray[1])))
            normalized[2] = (sub, subarray[1])
        elif names is not None or fields is not None:
            if not (isinstance(names, tuple) and isinstance(fields, dict) and all(isinstance(n, str) for n in names)):
                raise refuse(f"numpy structured dtype state {_show(state)}")
            real_fields = {}
            for key, field in fields.items():
                if not (isinstance(field, tuple) and len(field) in (2, 3) and type(field[1]) is int):
                    raise refuse(f"numpy dtype field {_show(field)}")
                if len(field) == 3 and not isinstance(field[2], str):
                    raise refuse(f"numpy dtype field title {_show(field[2])}")
                real_fields[key] = (_real(field[0]),) + field[1:]
            missing = [n for n in names if n not in real_fields]
            if missing:
                raise refuse(f"numpy structured dtype without fields {missing}")
            described = {
                "names": list(names),
                "formats": [real_fields[n][0] for n in names],
                "offsets": [real_fields[n][1] for n in names],
                "itemsize": elsize,
            }
            titles = [real_fields[n][2] if len(real_fields[n]) == 3 else None for n in names]
            if any(t is not None for t in titles):
                described["titles"] = titles
            candidate = np.dtype(described, align=bool(flags & _ALIGNED_STRUCT))
            normalized[4] = real_fields
        else:
            candidate = np.dtype(base)
        if byteorder in "<>" and candidate.byteorder != "|":
            candidate = candidate.newbyteorder(byteorder)
        expected = candidate.__reduce__()
    except pickle.UnpicklingError:
        raise
    except Exception as exc:  # noqa: BLE001 - numpy rejected the parts: not a dtype it wrote
        raise refuse(f"numpy dtype {spec!r} with state {_show(state)} ({exc})") from None
    if expected[1] != (spec, False, True) or expected[2] != tuple(normalized):
        raise refuse(f"a numpy {candidate} dtype with a pickled state numpy never writes: {_show(state)}")
    if candidate.hasobject:
        raise refuse(f"numpy dtype {candidate} holding Python objects")
    return candidate


def _refusing(method):
    """Any failure inside a stand-in is a refusal (never a TypeError from odd arguments)."""

    def checked(*args):
        try:
            return method(*args)
        except pickle.UnpicklingError:
            raise
        except Exception as exc:  # noqa: BLE001
            raise refuse(f"numpy values {_show(args[1:])} ({type(exc).__name__}: {exc})") from None

    return checked


def _multiarray():
    try:
        from numpy._core import multiarray  # numpy 2
    except ImportError:
        from numpy.core import multiarray
    return multiarray


class NumpyDtype:
    """Stands for ``numpy.dtype(spec, False, True)``; its state is checked once, when set (BUILD)."""

    __slots__ = ("spec", "real")  # real: the numpy dtype built from the checked state

    @_refusing
    def __new__(cls, *args):
        _require_check()
        spec = args[0] if args else None
        if not (len(args) == 3 and isinstance(spec, str) and _SPEC_RE.match(spec)):
            what = (
                "object dtype (it holds arbitrary Python objects)"
                if isinstance(spec, str) and spec in ("O", "O4", "O8")
                else f"dtype {_show(args)}"
            )
            raise refuse(f"a numpy {what}")
        if args[1] is not False or args[2] is not True:
            raise refuse(f"numpy dtype arguments {_show(args)}")
        self = object.__new__(cls)
        self.spec, self.real = spec, None
        return self

    @_refusing
    def __setstate__(self, state) -> None:
        _require_check()
        if self.real is not None:
            raise refuse("a numpy dtype whose state is set twice")
        self.real = _canonical_dtype(self.spec, state)


class NumpyNdarray:
    """Stands for the class ``numpy.ndarray``, which a numpy pickle only passes to ``_reconstruct``."""

    __slots__ = ()

    def __new__(cls, *args, **kwargs):
        raise refuse("a call of numpy.ndarray (numpy's pickles never make one)")


class NumpyArray:
    """Stands for ``_reconstruct(numpy.ndarray, (0,), b"b")``, the start of every numpy array
    pickle; its state is checked once, when set (BUILD), and numpy builds the array from it."""

    __slots__ = ("real",)  # the numpy array built from the checked state

    @_refusing
    def __new__(cls, *args):
        _require_check()
        subtype, shape, typecode = args if len(args) == 3 else (None, None, None)
        if not (
            subtype is NumpyNdarray and type(shape) is tuple and len(shape) == 1 and type(shape[0]) is int
            and shape[0] == 0 and type(typecode) is bytes and typecode == b"b"
        ):
            raise refuse(f"a numpy array reconstruction {_show(args)}")
        self = object.__new__(cls)
        self.real = None
        return self

    @_refusing
    def __setstate__(self, state) -> None:
        _require_check()
        if self.real is not None:
            raise refuse("a numpy array whose state is set twice")
        if not (isinstance(state, tuple) and len(state) == 5):
            raise refuse(f"numpy array state {_show(state)}")
        version, shape, dtype, fortran, data = state
        if version != 1 or type(fortran) is not bool:
            raise refuse(f"numpy array state {_show(state)}")
        shape = _shape(shape)
        real = _real(dtype)
        if type(data) is not bytes:
            raise refuse(f"a numpy array whose data is a {type(data).__name__}, not raw bytes (an object array)")
        if len(data) != math.prod(shape) * real.itemsize:
            raise refuse(f"a numpy array of shape {shape} and dtype {real} carrying {len(data)} bytes")
        import numpy as np

        array = _multiarray()._reconstruct(np.ndarray, (0,), b"b")
        array.__setstate__((1, shape, real, fortran, data))  # numpy, from checked parts only
        self.real = array


class NumpyScalar:
    """Stands for ``numpy.core.multiarray.scalar(dtype, raw bytes)`` (``numpy._core`` in numpy 2):
    numpy builds the scalar from the checked dtype and bytes, so no stand-in remains."""

    __slots__ = ()

    @_refusing
    def __new__(cls, *args):
        _require_check()
        if len(args) != 2:
            raise refuse(f"a numpy scalar {_show(args)}")
        real, data = _real(args[0]), args[1]
        if type(data) is not bytes or len(data) != real.itemsize:
            raise refuse(f"a numpy scalar of dtype {real} carrying {_show(data)}")
        return _multiarray().scalar(real, data)


def reduce_stand_in(obj):
    """How a re-pickle writes a stand-in found in a checked object: the numpy value it stands for
    (``NotImplemented`` for anything else). A stand-in that never got its state is refused."""
    kind = type(obj)
    if kind is NumpyDtype or kind is NumpyArray:
        if obj.real is None:
            raise refuse(f"a numpy {'dtype' if kind is NumpyDtype else 'array'} whose state was never set")
        return obj.real.__reduce__()
    return NotImplemented


def allowlist() -> list[tuple]:
    """``(stand-in, pickle name)`` pairs: what the check resolves numpy's pickle names to."""
    out = [(NumpyDtype, "numpy.dtype"), (NumpyNdarray, "numpy.ndarray")]
    for module in ("numpy.core.multiarray", "numpy._core.multiarray"):
        out += [(NumpyArray, f"{module}._reconstruct"), (NumpyScalar, f"{module}.scalar")]
    return out
