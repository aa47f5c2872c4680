"""What a user switching from DCP's FileSystemWriter/FileSystemReader relies on.

* save-plan caching (``DefaultSavePlanner(enable_plan_caching=True)``): repeated
  saves of one state structure, each into its own directory, on 1 process and
  on 2 gloo ranks, synchronous and ``dcp.async_save``: the later saves take
  their plans from DCP's cache, and every checkpoint loads bit-exactly;
* ``writer.save_id``, ``reader.load_id`` and ``Metadata.storage_meta``, compared
  with what FileSystemWriter/FileSystemReader do;
* a ``.metadata`` written with the legacy ``torch.distributed._shard`` class
  ``TensorProperties`` (older torch) loads, in safe mode and with pickles;
* safe mode admits the inert plain data ``weights_only`` loads refuse (frozenset,
  datetime values, numpy scalars, dtypes and arrays) and still refuses code;
* the refusal to save over a committed checkpoint says how to get DCP's behaviour.
"""

from __future__ import annotations

import builtins
import datetime
import os
import pickle
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

import dist_helpers as dh
import parity_workers as pw
from conftest import assert_same, load, raises_from_checkpoint, save, zeros_like_state
from dcp_datastates import (
    CheckpointExistsError,
    DataStatesReader,
    DataStatesWriter,
    UnsafeCheckpointError,
    _dcp_compat,
    verify,
)
from dcp_datastates.format.file_names import METADATA_FILE
from dcp_datastates.format.metadata_file import decode_metadata, encode_metadata, read_commit_sequence

pytestmark = [pytest.mark.dist, pytest.mark.subprocess, pytest.mark.slow]

HERE = os.path.dirname(os.path.abspath(__file__))


# ---------------------------------------------------------------------------
# 1. save-plan caching
# ---------------------------------------------------------------------------


@pytest.fixture
def fresh_plan_cache():
    pw.clear_plan_caches()
    yield
    pw.clear_plan_caches()


def state_at(i: int) -> dict:
    """One state structure, values a function of ``i``: packed small tensors, page-aligned
    large ones, a non-contiguous one, and objects."""
    g = torch.Generator().manual_seed(700 + i)
    return {
        "model": {
            "w": torch.randn(300, 257, generator=g),
            "b": torch.randn(17, generator=g).to(torch.bfloat16),
            "t": torch.randn(40, 30, generator=g, dtype=torch.float64).t(),
        },
        "steps": torch.arange(5, dtype=torch.int64) + i,
        "epoch": i,
        "cfg": {"name": f"run{i}", "lr": 0.5 / (i + 1)},
    }


def our_files(path) -> set[str]:
    return {f for f in os.listdir(path) if f.endswith((".data", ".index"))}


def layout_of(path):
    return DataStatesReader(path).read_metadata().storage_data


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_plan_caching_one_process(tmp_path, fresh_plan_cache, mode):
    planner = pw.RecordingPlanner(enable_plan_caching=True)
    writers = []
    for i in range(4):
        with DataStatesWriter(tmp_path / f"c{i}") as writer:
            if mode == "sync":
                dcp.save(state_at(i), storage_writer=writer, planner=planner, no_dist=True)
            else:
                resp = dcp.async_save(state_at(i), storage_writer=writer, planner=planner, no_dist=True)
                resp.staging_completion.result()
                resp.upload_completion.result()
        writers.append(writer)
    # DCP sent the first local plan and took the others from its cache; so did the writer
    assert planner.local_plan_usable == [True, False, False, False]
    assert [w.last_save_stats.plan_from_cache for w in writers] == [False, True, True, True]
    if mode == "sync":  # cached plans are placed by the coordinator too: metadata written while the data is
        assert all(w.last_save_stats.metadata_serialize_s > 0 for w in writers)
    save_ids = set()
    for i in range(4):
        path = tmp_path / f"c{i}"
        assert verify(path).ok, verify(path)
        layout = layout_of(path)
        save_ids.add(layout.save_id)
        # the checkpoint consists of exactly the files its metadata names: nothing stale, nothing stray
        assert our_files(path) == {n for r in layout.ranks for n in (r.data_file, r.index_file)}
        assert_same(load(zeros_like_state(state_at(i)), path), state_at(i))
    assert len(save_ids) == 4


def test_plan_caching_overwrite_keeps_files_per_save(tmp_path, fresh_plan_cache):
    """A cached plan carries the save that filled the cache; an overwrite must still get new
    files (an interrupted overwrite would otherwise have clobbered the committed checkpoint)."""
    planner = DefaultSavePlanner(enable_plan_caching=True)
    path = tmp_path / "c"
    names = []
    for i in range(3):
        dcp.save(state_at(i), storage_writer=DataStatesWriter(path, overwrite=True), planner=planner, no_dist=True)
        names.append(our_files(path))
        assert_same(load(zeros_like_state(state_at(i)), path), state_at(i))
    assert not names[0] & names[1] and not names[1] & names[2]  # new names every save, old ones removed


def test_plan_caching_across_writers_uses_each_writers_own_settings(tmp_path, fresh_plan_cache):
    """DCP's plan cache is per planner class and process, so a cached plan may come from
    another writer: a FileSystemWriter save, or one of ours with other compression. Each
    save must still be written the way its own writer says."""
    pytest.importorskip("zstandard")
    from torch.distributed.checkpoint import FileSystemWriter

    planner = pw.RecordingPlanner(enable_plan_caching=True)
    dcp.save(state_at(0), storage_writer=FileSystemWriter(str(tmp_path / "stock")), planner=planner, no_dist=True)
    kinds = [("raw", {}), ("zstd", {"compression": "zstd"}), ("raw2", {})]
    for i, (name, kwargs) in enumerate(kinds, start=1):
        dcp.save(state_at(i), storage_writer=DataStatesWriter(tmp_path / name, **kwargs), planner=planner, no_dist=True)
    assert planner.local_plan_usable == [True, False, False, False]
    for i, (name, kwargs) in enumerate(kinds, start=1):
        path = tmp_path / name
        assert layout_of(path).compression == (None if not kwargs else layout_of(tmp_path / "zstd").compression)
        assert verify(path).ok
        assert_same(load(zeros_like_state(state_at(i)), path), state_at(i))
    assert layout_of(tmp_path / "zstd").compression is not None

    # The cache filled by one of ours, raw, then a compressing writer, then raw again.
    pw.clear_plan_caches()
    planner = pw.RecordingPlanner(enable_plan_caching=True)
    for i, (name, kwargs) in enumerate(kinds, start=1):
        path = tmp_path / f"ours_first_{name}"
        dcp.save(state_at(i), storage_writer=DataStatesWriter(path, **kwargs), planner=planner, no_dist=True)
        assert (layout_of(path).compression is not None) == bool(kwargs)
        assert verify(path).ok
        assert_same(load(zeros_like_state(state_at(i)), path), state_at(i))
    assert planner.local_plan_usable == [True, False, False]


def test_plan_caching_after_structure_change(tmp_path, fresh_plan_cache):
    """A changed structure re-plans (DCP sends the new local plan), then caches again."""
    planner = pw.RecordingPlanner(enable_plan_caching=True)
    states = [state_at(0), state_at(1), {**state_at(2), "extra": torch.ones(3)}, {**state_at(3), "extra": torch.full((3,), 2.0)}]
    for i, state in enumerate(states):
        dcp.save(state, storage_writer=DataStatesWriter(tmp_path / f"c{i}"), planner=planner, no_dist=True)
    assert planner.local_plan_usable == [True, False, True, False]
    for i, state in enumerate(states):
        assert_same(load(zeros_like_state(state), tmp_path / f"c{i}"), state)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_plan_caching_two_ranks(tmp_path, mode):
    pw.run_ranks("cached_saves", 2, tmp_path / "logs", path=str(tmp_path / "ckpt"), mode=mode)
    for i in range(3):
        path = tmp_path / f"ckpt.{i}"
        assert verify(path).ok, verify(path)
        layout = layout_of(path)
        assert sorted(r.rank for r in layout.ranks) == [0, 1]
        assert our_files(path) == {n for r in layout.ranks for n in (r.data_file, r.index_file)}
        out = dh.full_targets()
        out["save"] = None
        load(out, path)
        dh.assert_equal_exact(out, pw.shifted_full(i))


# ---------------------------------------------------------------------------
# 2. save_id / load_id as DCP fills them
# ---------------------------------------------------------------------------


class _SeenByPlanner(DefaultSavePlanner):
    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator=False):
        self.storage_meta = storage_meta
        super().set_up_planner(state_dict, storage_meta=storage_meta, is_coordinator=is_coordinator)


class _SeenByLoadPlanner(DefaultLoadPlanner):
    def set_up_planner(self, state_dict, metadata=None, is_coordinator=False):
        self.load_id = metadata.storage_meta.load_id
        super().set_up_planner(state_dict, metadata, is_coordinator)


def _observe_ids(tmp_path, writer_cls, reader_cls, **writer_kwargs) -> dict:
    """What a user can see of save and load ids through one writer and one reader."""
    state = {"w": torch.arange(4.0), "n": 1}
    seen = {}
    writer = writer_cls(tmp_path / "a", **writer_kwargs)
    first = writer.save_id
    seen["save_id is a non-empty str"] = isinstance(first, str) and bool(first)
    planner = _SeenByPlanner()
    dcp.save(state, storage_writer=writer, planner=planner, no_dist=True)
    seen["planner sees writer.save_id"] = planner.storage_meta.save_id == first
    seen["kept by a save without checkpoint_id"] = writer.save_id == first
    md_a = reader_cls(tmp_path / "a").read_metadata()
    seen["metadata holds it"] = md_a.storage_meta.save_id == first
    dcp.save(state, checkpoint_id=tmp_path / "b", storage_writer=writer, planner=planner, no_dist=True)
    second = writer.save_id
    seen["new after a save with checkpoint_id"] = second != first
    seen["second metadata holds the new one"] = reader_cls(tmp_path / "b").read_metadata().storage_meta.save_id == second
    seen["planner sees the new one"] = planner.storage_meta.save_id == second
    writer.reset()
    seen["new after reset()"] = writer.save_id not in (first, second)
    seen["ids look alike"] = len(first) == 36 and first.count("-") == 4

    reader = reader_cls(tmp_path / "a")
    load_id = reader.load_id
    seen["load_id is a non-empty str"] = isinstance(load_id, str) and bool(load_id)
    md = reader.read_metadata()
    seen["read_metadata stamps load_id"] = md.storage_meta.load_id == load_id
    seen["read_metadata keeps save_id"] = md.storage_meta.save_id == first
    load_planner = _SeenByLoadPlanner()
    dcp.load({"w": torch.zeros(4), "n": None}, storage_reader=reader, planner=load_planner, no_dist=True)
    seen["load without checkpoint_id keeps it"] = reader.load_id == load_id and load_planner.load_id == load_id
    dcp.load({"w": torch.zeros(4), "n": None}, checkpoint_id=tmp_path / "b", storage_reader=reader, planner=load_planner, no_dist=True)
    seen["load with checkpoint_id makes a new one"] = reader.load_id != load_id and load_planner.load_id == reader.load_id
    before = reader.load_id
    reader.reset()
    seen["new after reader.reset()"] = reader.load_id != before
    return seen


def test_save_and_load_ids_follow_filesystem_writer(tmp_path):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # FileSystemWriter warns when it overwrites
        dcp_seen = _observe_ids(tmp_path / "dcp", FileSystemWriter, FileSystemReader)
    ours = _observe_ids(tmp_path / "ours", DataStatesWriter, DataStatesReader)
    assert all(dcp_seen.values()), dcp_seen  # what DCP does (the test's own premise)
    assert ours == dcp_seen


def test_metadata_without_storage_meta_gets_load_id(tmp_path):
    """FileSystemReader gives a metadata without storage_meta a StorageMeta carrying load_id."""
    path = tmp_path / "c"
    save({"w": torch.arange(3.0)}, path)
    md_path = path / METADATA_FILE
    md, _ = decode_metadata(md_path.read_bytes(), str(md_path))
    md.storage_meta = None
    md_path.write_bytes(encode_metadata(md, read_commit_sequence(str(md_path)) or 0))
    reader = DataStatesReader(path)
    got = reader.read_metadata()
    assert got.storage_meta is not None and got.storage_meta.load_id == reader.load_id


# ---------------------------------------------------------------------------
# 3. legacy TensorProperties in .metadata
# ---------------------------------------------------------------------------


def _with_legacy_properties(md: Metadata) -> Metadata:
    LegacyProperties = _dcp_compat.legacy_tensor_properties_class()
    assert LegacyProperties is not None, "this torch has no legacy TensorProperties class to write"

    for item in md.state_dict_metadata.values():
        if isinstance(item, TensorStorageMetadata):
            p = item.properties
            item.properties = LegacyProperties(
                dtype=p.dtype, layout=p.layout, requires_grad=p.requires_grad,
                memory_format=p.memory_format, pin_memory=p.pin_memory,
            )
    return md


LEGACY_STATE = {"w": torch.randn(64, 33, generator=torch.Generator().manual_seed(5)), "h": torch.arange(7, dtype=torch.float16), "n": 3}


def _legacy_checkpoint_of_ours(tmp_path):
    path = tmp_path / "ours"
    save(LEGACY_STATE, path)
    md_path = path / METADATA_FILE
    md, _ = decode_metadata(md_path.read_bytes(), str(md_path))
    md_path.write_bytes(encode_metadata(_with_legacy_properties(md), read_commit_sequence(str(md_path)) or 0))
    assert b"torch.distributed._shard.sharded_tensor.metadata" in md_path.read_bytes()
    return path


@pytest.mark.parametrize("allow_pickle", [False, True])
def test_legacy_tensor_properties_load(tmp_path, allow_pickle):
    path = _legacy_checkpoint_of_ours(tmp_path)
    out = load(zeros_like_state(LEGACY_STATE), path, allow_pickle=allow_pickle)
    assert_same(out, LEGACY_STATE)
    assert verify(path).ok, verify(path)


def _legacy_stock_checkpoint(tmp_path):
    path = tmp_path / "stock"
    dcp.save(LEGACY_STATE, storage_writer=FileSystemWriter(path), no_dist=True)
    md_path = path / METADATA_FILE
    with open(md_path, "rb") as f:
        md = pickle.load(f)
    with open(md_path, "wb") as f:
        pickle.dump(_with_legacy_properties(md), f)
    # stock DCP loads it (this is what its own compatibility test keeps working)
    out = zeros_like_state(LEGACY_STATE)
    dcp.load(out, storage_reader=FileSystemReader(path), no_dist=True)
    assert_same(out, LEGACY_STATE)
    return path


def test_legacy_tensor_properties_in_stock_checkpoint_view(tmp_path):
    from dcp_datastates.tools.checkpoint_view import CheckpointView

    path = _legacy_stock_checkpoint(tmp_path)
    view = CheckpointView(path)  # safe mode: the restricted metadata unpickler
    assert sorted(view.tensors) == ["h", "w"]
    assert_same(view.read_tensor("w"), LEGACY_STATE["w"])
    assert_same(view.read_tensor("h"), LEGACY_STATE["h"])
    r = subprocess.run(
        [sys.executable, "-m", "dcp_datastates", "inspect", str(path)], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "float16" in r.stdout and "float32" in r.stdout, r.stdout


# ---------------------------------------------------------------------------
# 4. safe mode: inert plain data loads, code does not
# ---------------------------------------------------------------------------


def _plain_values() -> dict:
    utc_plus_2 = datetime.timezone(datetime.timedelta(hours=2), "CEST")
    return {
        "set": {1, "a", (2, 3)},
        "frozenset": frozenset({4, 5.5, "b"}),
        "nested_sets": [frozenset({1}), {frozenset({2, 3})}],
        "date": datetime.date(2024, 2, 29),
        "time": datetime.time(23, 59, 58, 999999),
        "time_tz": datetime.time(1, 2, 3, tzinfo=datetime.timezone.utc),
        "datetime": datetime.datetime(2025, 12, 31, 23, 59, 59, 123456),
        "datetime_tz": datetime.datetime(2025, 1, 2, 3, 4, 5, tzinfo=utc_plus_2),
        "timedelta": datetime.timedelta(days=-3, seconds=7, microseconds=11),
        "timezone": datetime.timezone(datetime.timedelta(hours=-5, minutes=-30), "X"),
        "np_f16": np.float16(1.5),
        "np_f32": np.float32(-0.0),
        "np_f64_nan": np.frombuffer(b"\x01\x00\x00\x00\x00\x00\xf8\x7f", dtype=np.float64)[0],  # a NaN payload
        "np_longdouble": np.longdouble(1) / 3,
        "np_i8": np.int8(-128),
        "np_u64": np.uint64(2**64 - 1),
        "np_bool": np.bool_(True),
        "np_c64": np.complex64(1 - 2j),
        "np_c128": np.complex128(3 + 4j),
        "np_str": np.str_("näme"),
        "np_bytes": np.bytes_(b"\x00ab"),
        "np_datetime64": np.datetime64("2024-03-01T12:34", "m"),
        "np_timedelta64": np.timedelta64(-7, "us"),
        "np_void": np.void(b"\x01\x02\x03"),
        "dtype": np.dtype("float16"),
        "dtype_be": np.dtype(">i4"),
        "dtype_str": np.dtype("U3"),
        "dtype_datetime": np.dtype("M8[2D]"),
        "dtype_struct": np.dtype([("a", "<i4"), ("b", ">f8", (2,))], align=True),
        "arr_f32": np.arange(12, dtype=np.float32).reshape(3, 4),
        "arr_fortran": np.asfortranarray(np.arange(6, dtype=np.int16).reshape(2, 3)),
        "arr_be": np.arange(5, dtype=">u4"),
        "arr_bool": np.array([True, False, True]),
        "arr_c": np.array([1 + 1j, -2j], dtype=np.complex64),
        "arr_str": np.array(["ab", "c"]),
        "arr_bytes": np.array([b"x", b"yz"]),
        "arr_dt": np.array(["2024-01-01", "1970-01-02"], dtype="M8[D]"),
        "arr_0d": np.array(7.25),
        "arr_empty": np.zeros((0, 3), dtype=np.uint8),
        "arr_struct": np.array([(1, 2.5), (-3, 4.0)], dtype=[("i", "<i8"), ("f", "<f4")]),
        "arr_subarray": np.array([([1, 2, 3],), ([4, 5, 6.5],)], dtype=[("v", "<f4", (3,))]),
        "arr_titled": np.zeros(1, dtype={"names": ["a"], "formats": ["<u2"], "titles": ["A"]}),
        "arr_view": np.arange(10, dtype=np.float64)[::3],
    }


def _same_plain(a, b, path="value"):
    assert type(a) is type(b), f"{path}: {type(a).__name__} vs {type(b).__name__}"
    if isinstance(a, np.ndarray):
        fortran_only = [x.flags.f_contiguous and not x.flags.c_contiguous for x in (a, b)]
        assert a.dtype == b.dtype and a.shape == b.shape and fortran_only[0] == fortran_only[1], path
        assert a.tobytes(order="A") == b.tobytes(order="A"), f"{path}: bytes differ"
    elif isinstance(a, np.generic):
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes(), f"{path}: {a!r} vs {b!r}"
    elif isinstance(a, np.dtype):
        assert a == b and a.str == b.str and a.descr == b.descr and a.isalignedstruct == b.isalignedstruct, path
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _same_plain(x, y, f"{path}[{i}]")
    elif isinstance(a, (datetime.datetime, datetime.time)):
        assert a == b and a.fold == b.fold and a.tzinfo == b.tzinfo and a.isoformat() == b.isoformat(), path
        if a.tzinfo is not None:
            assert a.tzname() == b.tzname(), path
    elif isinstance(a, datetime.timezone):
        assert a == b and a.tzname(None) == b.tzname(None), path
    else:
        assert a == b, f"{path}: {a!r} vs {b!r}"


def test_plain_values_round_trip_in_safe_mode(tmp_path):
    values = _plain_values()
    save({"w": torch.arange(3.0), **values}, tmp_path / "c")
    out = load({"w": torch.zeros(3), **{k: None for k in values}}, tmp_path / "c")  # safe mode
    trusted = load({"w": torch.zeros(3), **{k: None for k in values}}, tmp_path / "c", allow_pickle=True)
    for key, value in values.items():
        _same_plain(out[key], trusted[key], key)  # safe mode changes nothing
        # numpy's own pickles store a non-native array in native byte order (same values)
        _same_plain(out[key], value.astype(value.dtype.newbyteorder("=")) if key == "arr_be" else value, key)


def test_safe_mode_allowlist_is_scoped(tmp_path):
    """The allowlist applies to our check only: afterwards torch.load(weights_only=True) is as
    strict as before, and a user's own add_safe_globals entries are left in place."""
    import io

    save({"d": datetime.date(2020, 1, 1)}, tmp_path / "c")
    torch.serialization.add_safe_globals([datetime.time])
    try:
        load({"d": None}, tmp_path / "c")
        assert datetime.time in torch.serialization.get_safe_globals()
        buf = io.BytesIO()
        torch.save(datetime.date(2020, 1, 1), buf)
        with pytest.raises(pickle.UnpicklingError):
            torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    finally:
        torch.serialization.clear_safe_globals()


class _RunsCommand:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


class _CallsEval:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (builtins.eval, (f"open({self.marker!r}, 'w').close()",))


class _ForgedDtype:
    """A float64 dtype whose pickled state claims it holds Python objects: numpy trusts the
    flags, so an array of it would read its bytes as object pointers."""

    def __reduce__(self):
        return (np.dtype, ("f8", False, True), (3, "<", None, None, None, -1, -1, 1))


class _ForgedStruct:
    """A structured dtype whose flags claim Python objects, around a harmless float field."""

    def __reduce__(self):
        return (np.dtype, ("V8", False, True), (3, "|", None, ("a",), {"a": (np.dtype("f8"), 0)}, 8, 1, 0x11))


class _ForgedScalar:
    """A numpy scalar whose bytes do not fit its dtype."""

    def __reduce__(self):
        from numpy._core.multiarray import scalar

        return (scalar, (np.dtype("f8"), b"\x00" * 3))


class _ForgedArray:
    """An array whose shape asks for more bytes than it carries."""

    def __reduce__(self):
        real = np.arange(2, dtype=np.float64).__reduce__()
        version, shape, dtype, fortran, data = real[2]
        return (real[0], real[1], (version, (10**6,), dtype, fortran, data))


@pytest.mark.parametrize(
    "make, what",
    [
        (lambda m: _RunsCommand(m), "system"),
        (lambda m: _CallsEval(m), "eval"),
        (lambda m: np.array([_RunsCommand(m), 1], dtype=object), "object"),
        (lambda m: np.array([1, "a"], dtype=object), "object"),
        (lambda m: (frozenset({1}), datetime.date(2020, 1, 1), [_RunsCommand(m)]), "system"),
        (lambda m: _ForgedDtype(), "dtype"),
        (lambda m: _ForgedStruct(), "dtype"),
        (lambda m: _ForgedScalar(), "scalar"),
        (lambda m: _ForgedArray(), "array"),
    ],
)
def test_code_and_unsafe_numpy_are_still_refused(tmp_path, make, what):
    marker = tmp_path / "ran"
    save({"w": torch.arange(3.0), "bad": make(marker)}, tmp_path / "c")
    with raises_from_checkpoint(UnsafeCheckpointError, match="'bad'") as info:
        load({"w": torch.zeros(3), "bad": None}, tmp_path / "c")
    assert what in str(info.value), str(info.value)
    assert not marker.exists()


def test_numpy_stand_ins_work_only_inside_the_check():
    """Another thread's torch.load(weights_only=True) during a check never gets a stand-in."""
    from dcp_datastates.format import plain_numpy

    with pytest.raises(pickle.UnpicklingError, match="add_safe_globals"):
        plain_numpy.NumpyDtype("f4", False, True)
    with plain_numpy.checking():
        assert plain_numpy.NumpyDtype("f4", False, True).spec == "f4"


# ---------------------------------------------------------------------------
# 5. saving over a committed checkpoint
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_refusal_to_overwrite_says_how_to_get_dcp_behaviour(tmp_path, mode):
    path = tmp_path / "c"
    save({"w": torch.arange(3.0)}, path)
    with raises_from_checkpoint(CheckpointExistsError) as info:
        if mode == "sync":
            save({"w": torch.arange(3.0)}, path)
        else:
            with DataStatesWriter(path) as writer:
                dcp.async_save({"w": torch.arange(3.0)}, storage_writer=writer, no_dist=True).upload_completion.result()
    message = str(info.value)
    assert f"DataStatesWriter({str(path)!r}, overwrite=True)" in message, message
    assert "FileSystemWriter" in message and "by default" in message, message
    # and doing what it says works
    save({"w": torch.arange(3.0) + 1}, path, overwrite=True)
    assert_same(load({"w": torch.zeros(3)}, path), {"w": torch.arange(3.0) + 1})
