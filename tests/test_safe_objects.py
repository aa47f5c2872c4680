"""Safe mode loads what it checked: the check builds the object from validated parts, and DCP
unpickles a fresh pickle of that object, never the saved bytes (one unpickler checking and
another loading let through NEWOBJ numpy.ndarray: an object array of forged pointers, or a
1 KB pickle loading as a 16 GiB array). Every stand-in the check admits refuses bad arguments
under each pickle opcode that can reach it; the view, convert and verify load objects the same way.
"""

from __future__ import annotations

import copyreg
import datetime
import io
import os
import pickle
import subprocess
import sys
import zipfile

import numpy as np
import pytest
import torch

from conftest import load, save
from dcp_datastates import CorruptCheckpointError, UnsafeCheckpointError, verify
from dcp_datastates.tools.checkpoint_view import CheckpointView
from dcp_datastates.format import safe_objects
from dcp_datastates.format.safe_objects import check_object_is_plain

HERE = os.path.dirname(os.path.abspath(__file__))


def _torch_blob(pickled: bytes) -> bytes:
    """A torch.save archive whose data.pkl is ``pickled`` (hand-written)."""
    buf = io.BytesIO()
    torch.save(0, buf)
    src = zipfile.ZipFile(io.BytesIO(buf.getvalue()))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as z:
        for name in src.namelist():
            z.writestr(name, pickled if name.endswith("/data.pkl") else src.read(name))
    return out.getvalue()


def _global(name: str) -> bytes:
    module, attr = name.rsplit(".", 1)
    return b"c" + module.encode() + b"\n" + attr.encode() + b"\n"


# Every pickle name safe mode admits beyond torch's defaults (each resolves to a stand-in).
ADMITTED = [
    "numpy.dtype", "numpy.ndarray",
    "numpy._core.multiarray._reconstruct", "numpy.core.multiarray._reconstruct",
    "numpy._core.multiarray.scalar", "numpy.core.multiarray.scalar",
    "builtins.bytes", "builtins.frozenset",
    "datetime.date", "datetime.time", "datetime.datetime", "datetime.timedelta", "datetime.timezone",
]


def _args(args: tuple) -> bytes:
    """``args`` as protocol-2 pickle opcodes (what torch.save writes), without PROTO and STOP."""
    return pickle.dumps(args, 2)[2:-1]


# Arguments no stand-in accepts: raw bytes, a 2**31 shape, the object type code.
_BAD_ARGS = _args((b"A" * 8, (1 << 31,), "O"))
# numpy.ndarray((2**31,), 'f8'): the 1.3 KB pickle that loaded as a 16 GiB array
_BIG_ARGS = _args(((1 << 31,), "f8"))


def _opcode_pickles(name: str) -> dict[str, bytes]:
    g = _global(name)
    return {
        "REDUCE": b"\x80\x02" + g + _BAD_ARGS + b"R.",
        "REDUCE big": b"\x80\x02" + g + _BIG_ARGS + b"R.",
        "NEWOBJ": b"\x80\x02" + g + _BAD_ARGS + b"\x81.",
        "NEWOBJ big": b"\x80\x02" + g + _BIG_ARGS + b"\x81.",
        "NEWOBJ_EX": b"\x80\x04" + g + _BAD_ARGS + b"}\x92.",
        "BUILD on the global": b"\x80\x02" + g + b"}X\x01\x00\x00\x00xK\x01sb.",
        "the global itself": b"\x80\x02" + g + b".",
    }


@pytest.mark.filterwarnings("ignore:Detected pickle protocol 4")  # the NEWOBJ_EX pickles
@pytest.mark.parametrize("name", ADMITTED)
@pytest.mark.parametrize("opcode", list(_opcode_pickles("a.b")))
def test_every_stand_in_refuses_bad_arguments_under_every_opcode(name, opcode):
    blob = _torch_blob(_opcode_pickles(name)[opcode])
    with pytest.raises(UnsafeCheckpointError, match="'bad'"):
        check_object_is_plain(blob, "bad", "test")


# A real value of each admitted kind, pickled by its own class, then one more BUILD.
_BUILT = {
    "numpy.dtype": np.dtype("f8"),
    "numpy._core.multiarray._reconstruct": np.arange(3.0),
    "numpy._core.multiarray.scalar": np.float32(2),
    "builtins.bytes": b"",
    "builtins.frozenset": frozenset({1}),
    "datetime.date": datetime.date(2024, 1, 2),
    "datetime.time": datetime.time(1, 2),
    "datetime.datetime": datetime.datetime(2024, 1, 2, 3, 4),
    "datetime.timedelta": datetime.timedelta(3),
    "datetime.timezone": datetime.timezone.utc,
}


@pytest.mark.parametrize("state", [b"K\x01", b"}X\x01\x00\x00\x00xK\x01s", b"(K\x01K\x02t"])
@pytest.mark.parametrize("name", list(_BUILT))
def test_build_on_an_admitted_value_is_refused(name, state):
    good = _torch_blob(pickle.dumps(_BUILT[name], 2))
    check_object_is_plain(good, "good", "test")  # the value itself is plain data
    forged = _torch_blob(pickle.dumps(_BUILT[name], 2)[:-1] + state + b"b.")
    with pytest.raises(UnsafeCheckpointError, match="'bad'"):
        check_object_is_plain(forged, "bad", "test")


@pytest.mark.parametrize(
    "args",
    [_args((b"\x07\xe8\x02\xff",)), _args((b"\x07\xe8\x02\x00",)), _args((2024, 2, 0))],
    ids=["day 255", "day 0", "ints"],
)
def test_a_date_numpy_never_writes_is_refused(args):
    # date(b'\x07\xe8\x02\xff') is 2024-02-255: datetime checks only the month of a pickled state
    blob = _torch_blob(b"\x80\x02" + _global("datetime.date") + args + b"R.")
    with pytest.raises(UnsafeCheckpointError, match="'when'"):
        check_object_is_plain(blob, "when", "test")


_NO_ARGS = {"builtins.bytes": b"", "builtins.frozenset": frozenset(), "datetime.time": datetime.time(),
            "datetime.timedelta": datetime.timedelta()}


@pytest.mark.parametrize("name", ADMITTED)
def test_newobj_without_arguments_is_the_plain_value_or_refused(name):
    blob = _torch_blob(b"\x80\x02" + _global(name) + b")\x81.")
    if name in _NO_ARGS:
        value = safe_objects.load_plain_object(blob, "k", "test")
        assert type(value) is type(_NO_ARGS[name]) and value == _NO_ARGS[name]
    else:
        with pytest.raises(UnsafeCheckpointError, match="'k'"):
            check_object_is_plain(blob, "k", "test")


_RECONSTRUCT = (  # _reconstruct(numpy.ndarray, (0,), b"b"), as numpy's pickles start
    _global("numpy._core.multiarray._reconstruct") + _global("numpy.ndarray") + _args((0,)) + _args(b"b") + b"\x87R"
)
_UNBUILT_DTYPE = _global("numpy.dtype") + _args(("f8", False, True)) + b"R"


@pytest.mark.parametrize(
    "pickled, what",
    [
        (b"\x80\x02" + _UNBUILT_DTYPE + b".", "dtype whose state was never set"),
        (b"\x80\x02" + _RECONSTRUCT + b".", "array whose state was never set"),
        # an array whose dtype never got its state
        (b"\x80\x02" + _RECONSTRUCT + b"(K\x01" + _args((1,)) + _UNBUILT_DTYPE + b"\x89" + _args(b"\x00" * 8) + b"tb.",
         "not numpy's own pickle"),
    ],
    ids=["dtype", "array", "array of an unfinished dtype"],
)
def test_unfinished_stand_ins_are_refused(pickled, what):
    with pytest.raises(UnsafeCheckpointError, match="'k'") as info:
        check_object_is_plain(_torch_blob(pickled), "k", "test")
    assert what in str(info.value)


def test_deep_nesting_is_refused_not_crashed():
    blob = _torch_blob(b"\x80\x02]" + b"(]" * 100_000 + b"e" * 100_000 + b".")
    with pytest.raises(CorruptCheckpointError, match="nested too deeply"):
        check_object_is_plain(blob, "k", "test")


def test_torchs_allowlist_holds_the_stand_ins_only_during_a_check():
    """The stand-ins are registered with torch for the duration of the check only."""
    values = {"d": datetime.date(2020, 1, 1), "a": np.arange(3), "f": frozenset({1}), "dt": np.dtype(">i2")}
    buf = io.BytesIO()
    torch.save(values, buf)
    out = safe_objects.load_plain_object(buf.getvalue(), "v", "test")
    assert out["d"] == values["d"] and np.array_equal(out["a"], values["a"]) and out["dt"] == values["dt"]
    for opcode in ("NEWOBJ", "NEWOBJ big", "REDUCE big"):
        with pytest.raises(UnsafeCheckpointError, match="'bad'"):
            check_object_is_plain(_torch_blob(_opcode_pickles("numpy.ndarray")[opcode]), "bad", "test")
    assert not any("numpy" in str(g) for g in torch.serialization.get_safe_globals())


class _NewobjArray:
    """The reviewer's pickles: NEWOBJ numpy.ndarray(shape, dtype[, buffer])."""

    __class__ = property(lambda self: np.ndarray)

    def __init__(self, args):
        self.args = args

    def __reduce_ex__(self, proto):
        return (copyreg.__newobj__, (np.ndarray, *self.args))


_REVIEW_CASE = r"""
import resource, sys, numpy as np, torch
sys.path.insert(0, sys.argv[2])
from conftest import load, save
from test_safe_objects import _NewobjArray
from dcp_datastates import UnsafeCheckpointError
args = {"objbuf": ((1,), "O", b"\x41" * 8), "big": ((1 << 31,), "f8")}[sys.argv[3]]
save({"w": torch.zeros(2), "x": _NewobjArray(args)}, sys.argv[1])
try:
    out = load({"w": torch.zeros(2), "x": None}, sys.argv[1])
except BaseException as exc:
    print(type(exc).__name__, exc)
else:
    print("LOADED", type(out["x"]), getattr(out["x"], "shape", None), flush=True)
    print(out["x"][0] if out["x"].dtype == object else out["x"].nbytes)
print("maxrss MiB", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024)
"""


@pytest.mark.subprocess
@pytest.mark.parametrize("case", ["objbuf", "big"])
@pytest.mark.slow
def test_reviewers_newobj_ndarray_is_refused_without_crash_or_allocation(tmp_path, case):
    r = subprocess.run(
        [sys.executable, "-c", _REVIEW_CASE, str(tmp_path / "c"), HERE, case],
        capture_output=True, text=True, timeout=300, cwd=HERE,
    )
    assert r.returncode == 0, (r.returncode, r.stdout, r.stderr[-2000:])  # a segfault is -11
    assert "LOADED" not in r.stdout and "UnsafeCheckpointError" in r.stdout and "'x'" in r.stdout, r.stdout
    assert int(r.stdout.rsplit("maxrss MiB", 1)[1]) < 2048, r.stdout


def test_reader_hands_dcp_the_validated_object_not_the_saved_bytes(tmp_path, monkeypatch):
    """What DCP unpickles is our own pickle of the checked values."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    seen = []
    original = DefaultLoadPlanner.load_bytes

    def spy(self, read_item, value):
        seen.append(value.getvalue())
        return original(self, read_item, value)

    monkeypatch.setattr(DefaultLoadPlanner, "load_bytes", spy)
    state = {"w": torch.arange(3.0), "a": np.arange(4), "n": ("k", [1, "x", None])}
    save(state, tmp_path / "c")
    out = load({"w": torch.zeros(3), "a": None, "n": None}, tmp_path / "c")
    assert np.array_equal(out["a"], np.arange(4)) and out["n"] == ("k", [1, "x", None])
    stored = [open(tmp_path / "c" / f, "rb").read() for f in os.listdir(tmp_path / "c") if f.endswith(".data")]
    assert len(seen) == 2 and not any(blob in data for blob in seen for data in stored)


def test_load_plain_object_returns_real_values():
    values = {
        "tags": {"a", "b"}, "frozen": frozenset({1}), "when": datetime.datetime(2024, 1, 1, 5),
        "rng": np.arange(3, dtype=np.int16), "dt": np.dtype(">f4"), "s": np.float64(2.5), "b": b"",
    }
    buf = io.BytesIO()
    torch.save(values, buf)
    out = safe_objects.load_plain_object(buf.getvalue(), "values", "test")
    assert out.keys() == values.keys()
    for k, v in values.items():
        assert type(out[k]) is type(v), k
    assert np.array_equal(out["rng"], values["rng"]) and out["rng"].flags.writeable
    assert out["dt"] == values["dt"] and out["when"] == values["when"] and out["tags"] == values["tags"]


def test_view_and_convert_read_set_datetime_and_numpy_objects(tmp_path):
    from dcp_datastates.tools.cli import run

    state = {
        "w": torch.ones(4), "tags": {"a", "b"}, "when": datetime.datetime(2024, 1, 1),
        "rng": np.arange(3), "dtype": np.dtype("M8[D]"),
    }
    save(state, tmp_path / "c")
    view = CheckpointView(tmp_path / "c")  # safe mode
    assert view.read_object("tags") == {"a", "b"}
    assert view.read_object("when") == datetime.datetime(2024, 1, 1)
    assert np.array_equal(view.read_object("rng"), np.arange(3))
    assert view.read_object("dtype") == np.dtype("M8[D]")
    assert verify(tmp_path / "c").ok
    assert run(["convert", str(tmp_path / "c"), "--to", "torch", str(tmp_path / "out.pt"), "--quiet"]) == 0
    out = torch.load(tmp_path / "out.pt", weights_only=False)
    assert out["when"] == state["when"] and out["tags"] == state["tags"] and np.array_equal(out["rng"], state["rng"])


def test_view_refuses_what_the_reader_refuses(tmp_path):
    save({"w": torch.zeros(2), "x": _NewobjArray(((4,), "f8"))}, tmp_path / "c")
    with pytest.raises(UnsafeCheckpointError, match="'x'"):
        CheckpointView(tmp_path / "c").read_object("x")
    report = verify(tmp_path / "c")
    assert not report.ok and "'x'" in report.problems[0]


def test_huge_memo_index_in_a_saved_object_does_not_allocate(tmp_path, monkeypatch):
    """A 100-byte pickle that torch's weights_only unpickler accepts (its memo is a dict) makes
    the C unpickler DCP uses allocate 16 bytes per memo index (LONG_BINPUT 2**28: 4 GiB)."""
    blob = _torch_blob(b"\x80\x02}r\x00\x00\x00\x10.")
    with open("/proc/self/statm") as f:
        before = int(f.read().split()[1])
    out = safe_objects.load_plain_object(blob, "m", "test")
    with open("/proc/self/statm") as f:
        grown = (int(f.read().split()[1]) - before) * os.sysconf("SC_PAGE_SIZE")
    assert out == {} and grown < 256 << 20
