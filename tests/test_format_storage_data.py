"""``Metadata.storage_data`` as stored: plain data in format 5, our classes in formats 1-4.

* A fresh ``.metadata`` names no class of ours (its pickle's GLOBAL and
  STACK_GLOBAL opcodes are scanned), DCP's plain ``pickle.load`` reads it in
  a process where dcp_datastates cannot even be imported, and encoding never
  changes the caller's ``Metadata``.
* The class paths formats 1-4 pickled (``dcp_datastates.format.*``, and
  ``dcp_datastates.format.rank_index.*``) still load, in safe mode and with
  ``allow_pickle``, through stand-ins; their states are checked as strictly
  as before, and the stand-ins themselves are admitted under no other name.
* The plain form is checked key by key; every malformed one is a named error.
* A stock DCP checkpoint is still recognised, and refused by our reader.
"""

from __future__ import annotations

import copyreg
import os
import pickle
import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex

from conftest import assert_same, load, save
from dcp_datastates import (
    CorruptCheckpointError,
    DataStatesReader,
    DataStatesWriter,
    UnsafeCheckpointError,
    UnsupportedFormatError,
    verify,
)
from dcp_datastates.format.metadata_file import encode_metadata, read_metadata_file
from dcp_datastates.format.checkpoint_layout import CheckpointLayout, ItemLocation
from dcp_datastates.format.storage_data import PLAIN_KEYS, layout_of, layout_to_plain

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures"))
from pickle_tools import crafted, old_paths_importable, pickle_globals, plain_types  # noqa: E402


def make_state():
    return {
        "w": torch.arange(20, dtype=torch.float32).reshape(4, 5),
        "h": torch.arange(6, dtype=torch.bfloat16),
        "big": torch.zeros(20_000),  # compressed with zstd
        "step": 5,
        "cfg": {"name": "x"},
    }


def target():
    return {"w": torch.zeros(4, 5), "h": torch.zeros(6, dtype=torch.bfloat16), "big": torch.ones(20_000),
            "step": None, "cfg": {"name": None}}


def _save(path, kind: str) -> None:
    if kind == "async":
        writer = DataStatesWriter(path)
        dcp.async_save(make_state(), storage_writer=writer, no_dist=True).upload_completion.result()
        writer.close()
    else:
        save(make_state(), path, **({"compression": "zstd"} if kind == "zstd" else {}))


@pytest.fixture
def ckpt(tmp_path):
    path = tmp_path / "ckpt"
    _save(path, "sync")
    return path


# -- format 5: plain data -------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["sync", "async", "zstd"])
def test_a_saved_metadata_names_no_class_of_ours(tmp_path, kind):
    _save(tmp_path / "c", kind)
    pickled = (tmp_path / "c" / ".metadata").read_bytes()
    names = pickle_globals(pickled)
    assert names and not [n for n in names if "dcp_datastates" in n], names
    assert all(n.startswith(("torch.", "collections.", "pathlib.", "functools.partial")) for n in names), names
    storage = pickle.loads(pickled).storage_data  # DCP's plain pickle.load stops before the trailer
    assert list(storage) == list(PLAIN_KEYS) and storage["version"] == 9
    assert plain_types(dict(storage)) <= {dict, list, tuple, str, int, type(None)}
    assert (storage["compression"] is not None) == (kind == "zstd")
    assert_same(load(target(), tmp_path / "c"), make_state())


@pytest.mark.subprocess
@pytest.mark.slow
def test_dcp_reads_the_metadata_where_dcp_datastates_cannot_be_imported(ckpt):
    script = (
        "import pickle, sys\n"
        "sys.modules['dcp_datastates'] = None  # any import of it fails\n"
        f"md = pickle.load(open({str(ckpt / '.metadata')!r}, 'rb'))\n"
        "assert md.storage_data['format'] == 'dcp_datastates', md.storage_data\n"
        "assert 'w' in md.state_dict_metadata\n"
        "print('ok')\n"
    )
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr


def test_encoding_leaves_the_callers_metadata_as_it_was(ckpt):
    md = DataStatesReader(ckpt).read_metadata()
    layout, before = md.storage_data, dict(md.__dict__)
    blob = encode_metadata(md, 3)
    assert md.storage_data is layout and isinstance(layout, CheckpointLayout)
    assert md.__dict__ == before and "_table" not in pickle.loads(blob).storage_data
    assert pickle.loads(blob).storage_data == layout_to_plain(layout)


def test_decoding_hands_back_a_validated_layout(ckpt):
    md, checksummed = read_metadata_file(str(ckpt / ".metadata"))
    assert checksummed and isinstance(md.storage_data, CheckpointLayout)
    reader = DataStatesReader(ckpt)
    assert reader.layout is None
    assert reader.read_metadata().storage_data is reader.layout
    assert reader.layout.location(MetadataIndex("step")).is_object


# -- plain data, malformed ------------------------------------------------------------------


def _plain(ckpt) -> dict:
    return layout_to_plain(DataStatesReader(ckpt).read_metadata().storage_data)


def _rank(plain, *fields):
    r = plain["ranks"][0]
    return {**plain, "ranks": [fields if fields else r]}


PLAIN_CASES = {
    # (edit of the plain form, error type, what the message says)
    "an unknown key": (lambda p: {**p, "extra": 1}, CorruptCheckpointError, "'extra'"),
    "a non-string key": (lambda p: {**p, 3: 4}, CorruptCheckpointError, "[3]"),
    "a key missing": (lambda p: {k: v for k, v in p.items() if k != "compression"}, CorruptCheckpointError, "compression"),
    "version 4 as plain data": (lambda p: {**p, "version": 4}, CorruptCheckpointError, "pickled as a class"),
    "a newer version": (lambda p: {**p, "version": 10, "new": 1}, UnsupportedFormatError, "version 10"),
    "a bool version": (lambda p: {**p, "version": True}, UnsupportedFormatError, "version True"),
    "another format": (lambda p: {**p, "format": "zarr"}, UnsupportedFormatError, "'zarr'"),
    "no format": (lambda p: {**p, "format": None}, UnsupportedFormatError, "None"),
    "ranks not a list": (lambda p: {**p, "ranks": tuple(p["ranks"])}, CorruptCheckpointError, "ranks is a tuple"),
    "entries not a list": (lambda p: {**p, "entries": "abc"}, CorruptCheckpointError, "entries is a str"),
    "compression a list": (lambda p: {**p, "compression": ["zstd", 4096]}, CorruptCheckpointError, "compression is a list"),
    "a rank of three fields": (lambda p: _rank(p, *p["ranks"][0][:3]), CorruptCheckpointError, "rank entry"),
    "a rank as a dict": (lambda p: {**p, "ranks": [{"rank": 0}]}, CorruptCheckpointError, "rank entry"),
    "a rank's file an int": (lambda p: _rank(p, 0, 5, p["ranks"][0][2], ""), CorruptCheckpointError, "rank entry"),
    "a bool rank": (lambda p: _rank(p, True, *p["ranks"][0][1:]), CorruptCheckpointError, "rank entry"),
    "a negative rank": (lambda p: _rank(p, -1, *p["ranks"][0][1:]), CorruptCheckpointError, "rank entry"),
    "a file outside": (lambda p: _rank(p, 0, "../x.data", *p["ranks"][0][2:]), CorruptCheckpointError, "not a rank file name"),
    "a malformed save id": (lambda p: {**p, "save_id": "../../x"}, UnsupportedFormatError, "malformed save id"),
    "an entry of five fields": (lambda p: {**p, "entries": [e[:5] for e in p["entries"]]}, CorruptCheckpointError, "item entry"),
    # format 8: base checkpoints and content digests
    "a base outside the parent": (lambda p: _base(p, "../x"), CorruptCheckpointError, "not a sibling directory's name"),
    "a base with a slash": (lambda p: _base(p, "a/b"), CorruptCheckpointError, "not a sibling directory's name"),
    "a base named ..": (lambda p: _base(p, ".."), CorruptCheckpointError, "not a sibling directory's name"),
    "a base without save id": (lambda p: _base(p, "step_1", sid=""), CorruptCheckpointError, "records no save id"),
    "a base before own ranks": (lambda p: {**_base(p, "step_1"), "ranks": _base(p, "step_1")["ranks"][::-1]},
                                CorruptCheckpointError, "own ranks come first"),
    "a base's object": (lambda p: _base(p, "step_1", entry=("o", None, 1, -1, -1, 0)), CorruptCheckpointError,
                        "refers to an object of base checkpoint"),
    "a base in version 7": (lambda p: {**_base(p, "step_1"), "version": 7}, CorruptCheckpointError, "keys"),
    "a digest too short": (lambda p: {**p, "digests": [("w", (0, 0), "ab")]}, CorruptCheckpointError, "content digest"),
    "a digest in capitals": (lambda p: {**p, "digests": [("w", (0, 0), "AB" * 16)]}, CorruptCheckpointError, "content digest"),
    "a digest of no chunk": (lambda p: {**p, "digests": [("nope", (0,), "ab" * 16)]}, CorruptCheckpointError, "no raw tensor chunk"),
    "a digest of an object": (lambda p: {**p, "digests": [("step", None, "ab" * 16)]}, CorruptCheckpointError, "no raw tensor chunk"),
    "a digest twice": (lambda p: {**p, "digests": [("w", (0, 0), "ab" * 16)] * 2}, CorruptCheckpointError, "two content digests"),
    "a digest as a dict": (lambda p: {**p, "digests": {}}, CorruptCheckpointError, "digests is a dict"),
}


def _base(plain, base, sid="00000000beef", entry=("frozen", (0,), 1, 0, 65536, -1)):
    """``plain`` with a base rank in slot 1 (rank 0 of ``base``) and ``entry`` referring to it."""
    rank = (0, "rank00000-00000000beef.data", "rank00000-00000000beef.index", sid, (), base)
    return {**plain, "ranks": [*plain["ranks"], rank], "entries": [*plain["entries"], entry]}


@pytest.mark.parametrize("case", sorted(PLAIN_CASES))
def test_malformed_plain_layouts_are_named_errors(ckpt, case):
    edit, error, text = PLAIN_CASES[case]
    with pytest.raises(error, match="^ckpt/.metadata: ") as info:
        layout_of(edit(_plain(ckpt)), "ckpt/.metadata")
    assert text in str(info.value)


def test_storage_data_that_is_not_ours_is_left_alone():
    for other in ({MetadataIndex("w"): 1}, {}, [1, 2], ("format",), None, {"version": 5}):
        assert layout_of(other, "m") is None


def test_a_plain_layout_in_a_file_is_refused_by_the_files_name(ckpt):
    md = DataStatesReader(ckpt).read_metadata()
    plain = {**layout_to_plain(md.storage_data), "ranks": []}
    (ckpt / ".metadata").write_bytes(encode_metadata(Metadata(md.state_dict_metadata, md.planner_data, plain)))
    with pytest.raises(CorruptCheckpointError, match=f"^{ckpt / '.metadata'}: .* rank 0, which has no files"):
        DataStatesReader(ckpt).read_metadata()
    assert not verify(ckpt).ok


# -- formats 1 to 4: our classes, pickled ----------------------------------------------------


def _legacy(layout: CheckpointLayout, module: str, version: int = 4, **overrides):
    """The layout as a format ``version`` writer pickled it under ``module`` (version 1: locations)."""
    dropped = ({"save_id"} if version == 1 else set()) | {"stripes", "base"}  # version 1 had no per-rank save id; stripes came with 7, base with 8
    ranks = [crafted("RankFiles", {k: v for k, v in r.__dict__.items() if k not in dropped}, module) for r in layout.ranks]
    state = {"format": layout.format, "version": version, "save_id": layout.save_id, "ranks": ranks}
    if version == 1:
        files = {r.rank: r.data_file for r in layout.ranks}
        state["locations"] = {
            MetadataIndex(fqn, None if off is None else torch.Size(off)): crafted(
                "ItemLocation",
                {"relative_path": files[rank], "offset": offset, "length": length, "object_ordinal": ordinal},
            )
            for fqn, off, rank, offset, length, ordinal in layout.entries
        }
    else:
        state["entries"] = layout.entries
        if layout.compression is not None:
            state["compression"] = layout.compression
    state.update(overrides)
    return crafted("CheckpointLayout", state, module)


def _write(ckpt, storage, metadata=None) -> None:
    metadata = metadata or DataStatesReader(ckpt).read_metadata()
    with old_paths_importable():
        blob = encode_metadata(Metadata(metadata.state_dict_metadata, metadata.planner_data, storage))
    (ckpt / ".metadata").write_bytes(blob)


MODULES = ["dcp_datastates.format", "dcp_datastates.format.rank_index"]


@pytest.mark.parametrize("allow_pickle", [False, True], ids=["safe", "allow_pickle"])
@pytest.mark.parametrize("module", MODULES)
@pytest.mark.parametrize("version", [2, 3, 4])
def test_layouts_pickled_as_classes_still_load(ckpt, module, version, allow_pickle):
    layout = DataStatesReader(ckpt).read_metadata().storage_data
    _write(ckpt, _legacy(layout, module, version))
    assert f"{module}.CheckpointLayout" in pickle_globals((ckpt / ".metadata").read_bytes())
    reader = DataStatesReader(ckpt, allow_pickle=allow_pickle)
    assert reader.read_metadata().storage_data.version == version
    assert reader.layout.entries == layout.entries and reader.layout.ranks == layout.ranks
    assert_same(load(target(), ckpt, allow_pickle=allow_pickle), make_state())
    assert verify(ckpt, allow_pickle=allow_pickle).ok


@pytest.mark.parametrize("allow_pickle", [False, True], ids=["safe", "allow_pickle"])
def test_a_version_1_layout_of_locations_still_loads(ckpt, allow_pickle):
    layout = DataStatesReader(ckpt).read_metadata().storage_data
    _write(ckpt, _legacy(layout, "dcp_datastates.format", 1))
    assert "dcp_datastates.format.ItemLocation" in pickle_globals((ckpt / ".metadata").read_bytes())
    reader = DataStatesReader(ckpt, allow_pickle=allow_pickle)
    reader.read_metadata()
    assert sorted(reader.layout.entries, key=str) == sorted(layout.entries, key=str)
    assert reader.layout.location(MetadataIndex("w", torch.Size([0, 0]))) == layout.location(
        MetadataIndex("w", torch.Size([0, 0]))
    )
    assert_same(load(target(), ckpt, allow_pickle=allow_pickle), make_state())


def _reduce_calling(cls_name: str):
    obj = crafted(cls_name, None)
    cls = type(obj)
    obj.__reduce_ex__ = lambda _protocol: (cls, ())  # REDUCE: the class called, as a constructor
    return obj


def _never_built():
    obj = crafted("CheckpointLayout", None)
    cls = type(obj)
    obj.__reduce_ex__ = lambda _protocol: (copyreg.__newobj__, (cls,))  # NEWOBJ, and no BUILD
    return obj


LEGACY_CASES = {
    # (storage data from the real layout, what the error says)
    "version 5 pickled as a class": (lambda lay: _legacy(lay, MODULES[0], 5), "pickled as a class"),
    "version 2 with locations": (lambda lay: _legacy(lay, MODULES[0], 2, locations={}), "has locations instead of entries"),
    "version 1 with entries": (lambda lay: _legacy(lay, MODULES[0], 1, entries=[]), "has entries instead of locations"),
    "compression before version 4": (lambda lay: _legacy(lay, MODULES[0], 3, compression=("zstd", 4096)), "came with version 4"),
    "a rank as a tuple": (lambda lay: _legacy(lay, MODULES[0], ranks=[(0, "a", "b", "")]), "is not a RankFiles"),
    "a rank file's unknown field": (
        lambda lay: _legacy(lay, MODULES[0], ranks=[crafted("RankFiles", {**lay.ranks[0].__dict__, "files_save_id": "x"})]),
        "'files_save_id'",
    ),
    "a location in no rank's file": (
        lambda lay: _legacy(lay, MODULES[0], 1, locations={MetadataIndex("step"): crafted(
            "ItemLocation", {"relative_path": "rank00009-0123456789ab.data", "offset": -1, "length": -1, "object_ordinal": 0})}),
        "no rank's data file",
    ),
    "a location keyed by a string": (
        lambda lay: _legacy(lay, MODULES[0], 1, locations={"step": crafted(
            "ItemLocation", {"relative_path": lay.ranks[0].data_file, "offset": -1, "length": -1})}),
        "is not a MetadataIndex",
    ),
    "a location that is a tuple": (
        lambda lay: _legacy(lay, MODULES[0], 1, locations={MetadataIndex("step"): ItemLocation("a", 1, 2, 3)}),
        "UnsafeCheckpointError",
    ),
    "the class called": (lambda lay: _reduce_calling("CheckpointLayout"), "is called, not restored"),
    "the class never given its state": (lambda lay: _never_built(), "restored from its fields"),
    "a state of the wrong kind": (lambda lay: crafted("CheckpointLayout", [1, 2]), "has a list state"),
    "a bool version": (lambda lay: _legacy(lay, MODULES[0], True), "has a bool as its version"),
}


@pytest.mark.parametrize("case", sorted(LEGACY_CASES))
def test_malformed_legacy_layouts_are_named_errors(ckpt, case):
    make, text = LEGACY_CASES[case]
    layout = DataStatesReader(ckpt).read_metadata().storage_data
    _write(ckpt, make(layout))
    md = str(ckpt / ".metadata")
    with pytest.raises((CorruptCheckpointError, UnsafeCheckpointError)) as info:
        DataStatesReader(ckpt).read_metadata()
    assert md in str(info.value) and (text in str(info.value) or text == type(info.value).__name__), info.value
    report = verify(ckpt)
    assert report.committed and not report.ok and md in report.problems[0]


@pytest.mark.parametrize("name", ["PickledLayout", "PickledRankFiles", "_Pickled"])
def test_the_stand_ins_are_admitted_under_no_other_name(ckpt, name):
    """Only the old class paths resolve to the stand-ins: their own module path is refused."""
    blob = b"\x80\x04cdcp_datastates.format.storage_data\n" + name.encode() + b"\n."
    from dcp_datastates.format.metadata_file import encode_trailer

    (ckpt / ".metadata").write_bytes(blob + encode_trailer(blob))
    with pytest.raises(UnsafeCheckpointError, match=f"storage_data.{name}"):
        DataStatesReader(ckpt).read_metadata()


# -- stock DCP -------------------------------------------------------------------------------


def test_a_stock_dcp_checkpoint_is_recognised_by_our_reader(tmp_path):
    from dcp_datastates.tools.checkpoint_view import FORMAT_DCP, CheckpointView

    state = {"w": torch.arange(6.0), "step": 2}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp_path / "fs"), no_dist=True)
    md, _ = read_metadata_file(str(tmp_path / "fs" / ".metadata"))  # safe mode
    assert isinstance(md.storage_data, dict) and not isinstance(md.storage_data, CheckpointLayout)
    reader = DataStatesReader(tmp_path / "fs")
    reader.read_metadata()
    assert reader.layout is None and set(reader.stock) == set(md.storage_data)
    view = CheckpointView(tmp_path / "fs")
    assert view.format == FORMAT_DCP and torch.equal(view.read_tensor("w"), state["w"])
