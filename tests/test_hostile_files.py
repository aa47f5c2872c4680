"""Hostile or damaged checkpoint files: refused by size and structure, in bounded memory, with
an error naming the file; and ``verify`` sees a change to any byte of a checkpoint.

* A 1 GiB (sparse) file in place of ``.metadata`` or a rank index, either all zeros or with a
  plausible header (a pickle's first bytes and a trailer whose checksum is wrong; an index
  header whose counts match the file's size): ``dcp.load``, ``verify`` and the command-line
  tool refuse it, and the peak RSS of the process grows by far less than the file's size
  (measured with ``getrusage`` in a subprocess, against the same run on an intact checkpoint).
* A ``.metadata`` whose layout was crafted (a non-dict, unknown or shadowing keys or
  attributes, fields of the wrong kinds), pickled with a valid checksum as a hostile writer
  would, both as format 5's plain data and as the classes formats 1-4 pickled (under their old
  class paths): a named :class:`CorruptCheckpointError` (or :class:`UnsupportedFormatError`),
  never an AttributeError or TypeError from deep inside the reader; hypothesis crafts many more.
* A byte flipped in any gap no checksum covers (alignment padding between items, after the
  last tensor, after the objects) or appended past the data size: ``verify`` reports the
  file, the offset and the key before it. Clean checkpoints of every dtype still verify.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata

from conftest import assert_same, data_files, index_files, load, raises_from_checkpoint, save, unwrap
from dcp_datastates import CheckpointError, CorruptCheckpointError, DataStatesReader, DataStatesWriter, verify
from dcp_datastates.format.checkpoint_layout import FORMAT_VERSION, CheckpointLayout
from dcp_datastates.format.rank_index import _HEADER, INDEX_MAGIC
from dcp_datastates.format.metadata_file import _TRAILER, TRAILER_MAGIC, encode_metadata
from dcp_datastates.format.storage_data import PLAIN_KEYS, layout_to_plain

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures"))
from pickle_tools import crafted, old_paths_importable  # noqa: E402

pytestmark = [pytest.mark.subprocess, pytest.mark.slow]

GiB = 1 << 30
MiB = 1 << 20
# Peak RSS may grow by this much while refusing a 1 GiB file (KiB, as ru_maxrss counts).
GROWTH_LIMIT_KIB = 64 * 1024


def make_state():
    g = torch.Generator().manual_seed(3)
    return {
        "big": torch.randn(3000, generator=g),  # 12000 bytes: padding after it up to the small tensors
        "s1": torch.arange(5),  # packed small tensors, 64-byte aligned: gaps between them
        "s2": torch.randn(7, generator=g).half(),
        "step": 3,
        "cfg": {"name": "cosine"},
    }


def target():
    s = make_state()
    out = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else None for k, v in s.items()}
    out["cfg"] = {"name": None}
    return out


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    path = tmp_path_factory.mktemp("hostile") / "ckpt"
    save(make_state(), path)
    return path


@pytest.fixture
def ckpt(template, tmp_path):
    path = tmp_path / "ckpt"
    shutil.copytree(template, path)
    return path


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dcp_datastates", *args], capture_output=True, text=True, timeout=300)


# -- 1. huge files in place of .metadata or a rank index -------------------------------------


def _replace_with_sparse(path, size: int, pieces=()) -> None:
    """``path`` becomes a sparse file of ``size`` bytes holding ``pieces`` [(offset, bytes)]."""
    os.unlink(path)
    with open(path, "wb") as f:
        f.truncate(size)
        for offset, blob in pieces:
            f.seek(offset)
            f.write(blob)


def _hostile_metadata(ckpt, kind: str) -> str:
    md = ckpt / ".metadata"
    if kind == "zeros":
        _replace_with_sparse(md, GiB)
    else:  # a pickle's first bytes and a version 4 trailer that matches the size, wrong checksum
        trailer = _TRAILER.pack(TRAILER_MAGIC, GiB - _TRAILER.size, 7, 0x12345678, 0)
        _replace_with_sparse(md, GiB, [(0, b"\x80\x05\x95"), (GiB - _TRAILER.size, trailer)])
    return ".metadata"


def _hostile_index(ckpt, kind: str) -> str:
    name = index_files(ckpt)[0]
    path = ckpt / name
    if kind == "zeros":
        _replace_with_sparse(path, GiB)
    else:  # this checkpoint's own header, with a segment count that matches a ~1 GiB file
        magic, version, rank, sid, data_size, _, _ = _HEADER.unpack_from(path.read_bytes(), 0)
        nseg = (GiB - 64) // 24
        header = _HEADER.pack(magic, version, rank, sid, data_size, nseg, 0)
        _replace_with_sparse(path, _HEADER.size + nseg * 24 + 4, [(0, header)])
    return name


HOSTILE = {"metadata": _hostile_metadata, "index": _hostile_index}

_OPS_SCRIPT = r"""
import json, logging, resource, sys, warnings
warnings.filterwarnings("ignore")
import torch, torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from dcp_datastates import DataStatesReader, verify

intact, hostile = sys.argv[1:3]
def target():
    return {"big": torch.zeros(3000), "s1": torch.zeros(5, dtype=torch.int64), "s2": torch.zeros(7, dtype=torch.float16),
            "step": None, "cfg": {"name": None}}
OPS = {
    "load": lambda p: dcp.load(target(), storage_reader=DataStatesReader(p), no_dist=True),
    "verify": lambda p: verify(p).raise_if_bad(),
}
for op in OPS.values():
    op(intact)  # warm: every import and cache an intact run needs is in place before measuring
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
out = {}
logged = []  # before torch 2.13 dcp.load raises only "metadata is None"; the reader logs why


class Logged(logging.Handler):
    def emit(self, record):
        logged.append(getattr(record, "error", None))


logging.getLogger("dcp_datastates").addHandler(Logged(logging.ERROR))
for name, op in OPS.items():
    try:
        op(hostile)
        out[name] = {"type": None}
    except BaseException as exc:
        if isinstance(exc, CheckpointException):
            exc = next(iter(exc.failures.values()))[0]
        if str(exc) == "metadata is None" and logged and logged[-1] is not None:
            exc = logged[-1]
        out[name] = {"type": type(exc).__name__, "message": str(exc)}
    out[name]["growth_kib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
print(json.dumps(out))
"""

_CLI_PEAK_SCRIPT = r"""
import json, resource, subprocess, sys
r = subprocess.run([sys.executable, "-m", "dcp_datastates", *sys.argv[1:]], capture_output=True, text=True)
peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
print(json.dumps({"rc": r.returncode, "out": r.stdout + r.stderr, "peak_kib": peak}))
"""


def _cli_peak(*args: str) -> dict:
    r = subprocess.run([sys.executable, "-c", _CLI_PEAK_SCRIPT, *args], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@pytest.fixture(scope="module")
def cli_baseline(template):
    """Peak RSS of ``verify`` and ``inspect`` on the intact checkpoint (KiB)."""
    return {cmd: _cli_peak(cmd, str(template))["peak_kib"] for cmd in ("verify", "inspect")}


@pytest.mark.parametrize("kind", ["zeros", "plausible header"])
@pytest.mark.parametrize("what", sorted(HOSTILE))
def test_a_huge_file_is_refused_in_bounded_memory(template, ckpt, cli_baseline, what, kind):
    name = HOSTILE[what](ckpt, kind)
    r = subprocess.run([sys.executable, "-c", _OPS_SCRIPT, str(template), str(ckpt)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    outcome = json.loads(r.stdout)
    for op, res in outcome.items():
        # dcp.load turns read_metadata's error into an AssertionError carrying our message.
        allowed = {"CorruptCheckpointError", "UnsupportedFormatError"} | ({"AssertionError"} if what == "metadata" else set())
        assert res["type"] in allowed, (op, res)
        assert name in res["message"] and "corrupt" in res["message"], (op, res)
        assert res["growth_kib"] < GROWTH_LIMIT_KIB, (op, res)
    for cmd in ("verify", "inspect"):
        res = _cli_peak(cmd, str(ckpt))
        assert res["rc"] == 1 and name in res["out"] and "Traceback" not in res["out"], (cmd, res)
        assert res["peak_kib"] - cli_baseline[cmd] < GROWTH_LIMIT_KIB, (cmd, res, cli_baseline)


def test_a_metadata_without_a_pickle_header_is_refused_before_reading_it(ckpt):
    """Zero bytes, text, or bytes after a pickle's STOP without a trailer: refused by their shape."""
    md = ckpt / ".metadata"
    blob = md.read_bytes()
    for bad, words in [
        (b"", "empty"),
        (b"\x00" * 100, "not a pickle"),
        (b"hello world.", "not a pickle"),
        (blob[: -_TRAILER.size] + b"junk", "not a pickle"),  # no trailer, does not end with STOP
    ]:
        md.write_bytes(bad)
        with pytest.raises(CorruptCheckpointError, match=words) as info:
            DataStatesReader(ckpt).read_metadata()
        assert str(md) in str(info.value)
    md.write_bytes(blob)
    assert_same(load(target(), ckpt), make_state())


def test_index_counts_are_bounded_by_the_layout_and_the_data_file(ckpt):
    """Headers whose counts the checkpoint cannot hold are refused from the header alone."""
    name = index_files(ckpt)[0]
    path = ckpt / name
    blob = path.read_bytes()
    magic, version, rank, sid, data_size, nseg, nobj = _HEADER.unpack_from(blob, 0)
    data_bytes = os.path.getsize(ckpt / data_files(ckpt)[0])
    cases = {
        "more objects than the layout places": (data_size, nseg, nobj + 1, "objects"),
        "more segments than the data can hold": (data_size, data_size // 64 + 1, nobj, "segments"),
        "a data size past the data file": (data_bytes + 4096, nseg, nobj, "truncated"),
    }
    for why, (size, s, m, words) in cases.items():
        header = _HEADER.pack(magic, version, rank, sid, size, s, m)
        total = _HEADER.size + s * 24 + m * 16 + 4
        _replace_with_sparse(path, total, [(0, header)])  # the file size matches the counts
        reader = DataStatesReader(ckpt)
        reader.read_metadata()
        with pytest.raises(CorruptCheckpointError, match=words) as info:
            reader.rank_index(data_files(ckpt)[0])
        report = verify(ckpt)
        assert not report.ok and any(name in p or data_files(ckpt)[0] in p for p in report.problems), (why, report)
        assert name in str(info.value) or data_files(ckpt)[0] in str(info.value), (why, info.value)
    path.write_bytes(blob)
    assert verify(ckpt).ok


# -- 2. crafted layout states ----------------------------------------------------------------

# Where a crafted layout goes: format 5's plain data (storage_data itself), or the state of the
# CheckpointLayout class formats 1-4 pickled (under its old path, as version 4).
FORMS = ["plain", "classes"]


def _real(ckpt):
    return DataStatesReader(ckpt).read_metadata()


def _fields(layout: CheckpointLayout, form: str) -> dict:
    """The layout as ``form`` stores it: the plain dict, or the pickled class's state."""
    if form == "plain":
        return layout_to_plain(layout)
    ranks = [crafted("RankFiles", dataclasses.asdict(r)) for r in layout.ranks]
    return {**{f.name: getattr(layout, f.name) for f in dataclasses.fields(layout)}, "version": 4, "ranks": ranks}


def _write_crafted(ckpt, state, form: str, metadata=None) -> None:
    metadata = metadata or _real(ckpt)
    storage = state if form == "plain" else crafted("CheckpointLayout", state)
    with old_paths_importable():
        blob = encode_metadata(Metadata(metadata.state_dict_metadata, metadata.planner_data, storage))
    (ckpt / ".metadata").write_bytes(blob)


def _records_as_tuples(fields, layout):
    table = {(e[0], e[1]): tuple(e[2:]) for e in layout.entries}  # a tuple where a record is expected
    return {**fields, "_table": table}


def _rank_files_shadowing_a_method(fields, layout):
    ranks = [crafted("RankFiles", {**dataclasses.asdict(layout.ranks[0]), "files_save_id": "x"})]
    return {**fields, "ranks": ranks}


CRAFTED = {
    "records replaced by tuples (_table)": _records_as_tuples,
    "a method shadowed (validate)": lambda f, lay: {**f, "validate": 5},
    "a tuple state": lambda f, lay: tuple(f.values()),
    "a list state": lambda f, lay: [f],
    "an int state": lambda f, lay: 7,
    "a (dict, slots) state": lambda f, lay: (f, {"save_id": "x"}),
    "a non-string key": lambda f, lay: {**f, 3: 4},
    "an unknown field": lambda f, lay: {**f, "extra": [1, 2]},
    "a required field missing": lambda f, lay: {k: v for k, v in f.items() if k != "entries"},
    "entries not a list": lambda f, lay: {**f, "entries": "abc"},
    "a rank file's method shadowed": _rank_files_shadowing_a_method,
    "a rank file of the wrong kind": lambda f, lay: {**f, "ranks": [(0, "a", "b")]},
}


def _crafted_state(ckpt, case: str, form: str):
    layout = _real(ckpt).storage_data
    return CRAFTED[case](_fields(layout, form), layout)


def _assert_named_corrupt(exc: BaseException, where: str) -> None:
    text = str(exc)
    assert isinstance(exc, CheckpointError) or (isinstance(exc, AssertionError) and where in text), repr(exc)
    assert where in text and "has no attribute" not in text and "not callable" not in text, text


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("case", sorted(CRAFTED))
def test_a_crafted_layout_state_is_a_named_corrupt_checkpoint(ckpt, case, form):
    _write_crafted(ckpt, _crafted_state(ckpt, case, form), form)
    md = str(ckpt / ".metadata")
    with pytest.raises(CheckpointError) as info:  # corrupt; or unsafe, for a slot state
        DataStatesReader(ckpt).read_metadata()
    _assert_named_corrupt(info.value, md)
    with raises_from_checkpoint((CheckpointError, AssertionError)) as info:
        load(target(), ckpt)
    _assert_named_corrupt(info.value, md)
    report = verify(ckpt)
    assert report.committed and not report.ok and md in report.problems[0], report.summary()
    _assert_named_corrupt(CorruptCheckpointError(report.problems[0]), md)


@pytest.mark.parametrize(
    "case,form",
    [("records replaced by tuples (_table)", "classes"), ("a method shadowed (validate)", "plain"), ("a tuple state", "classes")],
)
def test_the_cli_names_the_file_of_a_crafted_layout(ckpt, case, form):
    _write_crafted(ckpt, _crafted_state(ckpt, case, form), form)
    for cmd in ("inspect", "verify"):
        r = cli(cmd, str(ckpt))
        out = r.stdout + r.stderr
        assert r.returncode == 1 and "Traceback" not in out and ".metadata" in out and "corrupt" in out, (cmd, out)


def test_a_layout_of_an_older_version_without_newer_fields_still_loads(ckpt):
    """Fields added later (with a default) are filled in, not called corrupt: a version 1 rank
    without its save id, a version 3 layout without compression."""
    layout = _real(ckpt).storage_data
    fields = _fields(layout, "classes")
    ranks = [crafted("RankFiles", {k: v for k, v in dataclasses.asdict(r).items() if k not in ("save_id", "stripes", "base")}) for r in layout.ranks]
    _write_crafted(ckpt, {**{k: v for k, v in fields.items() if k not in ("compression", "digests")}, "version": 3, "ranks": ranks}, "classes")
    assert _real(ckpt).storage_data.version == 3
    assert_same(load(target(), ckpt), make_state())
    assert verify(ckpt).ok


_KEYS = {
    "plain": list(PLAIN_KEYS),
    "classes": [f.name for f in dataclasses.fields(CheckpointLayout)] + ["locations"],
}
_leaf = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**64), 2**64), st.text(max_size=8), st.binary(max_size=8),
    st.floats(allow_nan=False),
)
_junk = st.recursive(
    _leaf,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.tuples(inner, inner), st.tuples(*[inner] * 4), st.tuples(*[inner] * 6),
        st.dictionaries(st.one_of(st.text(max_size=4), st.integers()), inner, max_size=3),
        st.builds(lambda s: crafted("RankFiles", s), st.dictionaries(st.sampled_from(["rank", "data_file", "index_file", "save_id", "x"]), inner, max_size=5)),
    ),
    max_leaves=12,
)


@settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(data=st.data())
def test_crafted_layout_states_only_ever_raise_named_checkpoint_errors(template, ckpt, data):
    real = _real(template)
    form = data.draw(st.sampled_from(FORMS), label="form")
    state = _fields(real.storage_data, form)
    kind = data.draw(st.sampled_from(["edit fields", "junk state", "edit an entry", "edit a rank"]), label="kind")
    if kind == "junk state":
        state = data.draw(_junk, label="state")
    elif kind == "edit an entry":  # a record that still passes the type checks, or nearly
        entries = list(state["entries"])
        i = data.draw(st.integers(0, len(entries) - 1), label="entry")
        field = data.draw(st.integers(0, 5), label="field")
        value = data.draw(st.one_of(st.integers(-3, 1 << 20), st.sampled_from([2**62, 2**63, 2**64]), _junk), label="value")
        entries[i] = entries[i][:field] + (value,) + entries[i][field + 1 :]
        state["entries"] = entries
    elif kind == "edit a rank" and form == "plain":  # (rank, data file, index file, save id)
        rank = list(state["ranks"][0])
        rank[data.draw(st.integers(0, 3), label="field")] = data.draw(_junk, label="value")
        state["ranks"] = [tuple(rank)]
    else:
        for _ in range(data.draw(st.integers(1, 3), label="edits")):
            key = data.draw(st.sampled_from(_KEYS[form] + ["_table", "validate", "location", "__dict__", "extra"]), label="key")
            if data.draw(st.booleans(), label="delete") and key in state:
                del state[key]
            else:
                state[key] = data.draw(_junk, label="value")
    _write_crafted(ckpt, state, form, real)
    md = str(ckpt / ".metadata")
    try:
        DataStatesReader(ckpt).read_metadata()
    except CheckpointError as exc:
        assert md in str(exc), exc
    report = verify(ckpt)  # never raises
    if not report.ok:
        assert all(isinstance(p, str) for p in report.problems) and report.problems


# -- 3. bytes no checksum covers ---------------------------------------------------------------


def _gaps(path):
    """[(start, end)] of the data file's bytes that no checksum segment covers, with its file."""
    reader = DataStatesReader(path)
    layout = reader.read_metadata().storage_data
    rel = layout.ranks[0].data_file
    idx = reader.rank_index(rel)
    size = os.path.getsize(os.path.join(path, rel))
    gaps, pos = [], 0
    for o, n in zip(idx.seg_offsets, idx.seg_lengths):
        if o > pos:
            gaps.append((pos, o))
        pos = o + n
    if size > pos:
        gaps.append((pos, size))
    return rel, gaps


def _flip(path, offset, mask=0x20):
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ mask]))


def test_a_byte_changed_in_any_gap_is_reported_with_file_offset_and_key(ckpt, tmp_path):
    rel, gaps = _gaps(ckpt)
    reader = DataStatesReader(ckpt)
    layout = reader.read_metadata().storage_data
    objects = reader.rank_index(rel).objects
    starts = sorted((e[3], e[0]) for e in layout.entries if e[5] < 0)
    starts += sorted((objects[e[5]][0], e[0]) for e in layout.entries if e[5] >= 0)
    assert len(gaps) >= 4, gaps  # after "big", between the small tensors, before and after the objects
    for start, end in gaps:
        for offset in sorted({start, (start + end) // 2, end - 1}):
            case = tmp_path / f"gap_{offset}"
            shutil.copytree(ckpt, case)
            _flip(case / rel, offset)
            report = verify(case)
            assert not report.ok and len(report.problems) == 1, (offset, report.summary())
            problem = report.problems[0]
            assert rel in problem and f"offset {offset} is 0x20, not zero" in problem, problem
            key = max((s for s in starts if s[0] < offset), default=None)
            assert (f"after {key[1]!r}" if key else "before the first item") in problem, (key, problem)
            assert_same(load(target(), case), make_state())  # a load never reads the gaps
            shutil.rmtree(case)


@pytest.mark.parametrize("extra", [b"\x00", b"\xff" * 10000])
def test_bytes_past_the_data_size_fail_verify(ckpt, extra):
    rel = data_files(ckpt)[0]
    with open(ckpt / rel, "ab") as f:
        f.write(extra)
    report = verify(ckpt)
    assert not report.ok and any(rel in p and "past" in p for p in report.problems), report.summary()
    assert_same(load(target(), ckpt), make_state())


def test_clean_checkpoints_of_every_dtype_and_layout_still_verify(dtype_checkpoints, tmp_path):
    ours, _stock = dtype_checkpoints
    report = verify(ours.path)
    assert report.ok, report.summary()
    # Windows smaller than the tensors (segments split at windows), objects, an empty tensor.
    state = {**make_state(), "e": torch.empty(0), "w": torch.randn(300, 100), "nested": {"x": [1, 2, {"y": "z"}]}}
    save(state, tmp_path / "small_windows", window_bytes=8192, host_cache_bytes=64 * 1024)
    assert verify(tmp_path / "small_windows").ok
    writer = DataStatesWriter(tmp_path / "async")
    dcp.async_save(state, storage_writer=writer, no_dist=True).upload_completion.result()
    writer.close()
    assert verify(tmp_path / "async").ok
