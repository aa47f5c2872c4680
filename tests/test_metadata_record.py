"""The plain record of ``.metadata`` (format 6): what our reader decodes instead of the pickle.

It must hand back exactly the ``Metadata`` the pickle holds (DCP's tools
still read the pickle), be used only when it can be exact, and refuse a
damaged record by name, never by running anything.
"""

from __future__ import annotations

import json
import pathlib
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from conftest import assert_same
from dcp_datastates import DataStatesReader, DataStatesWriter
from dcp_datastates.errors import CheckpointError, CorruptCheckpointError
from dcp_datastates.format import metadata_file
from dcp_datastates.format.checkpoint_layout import FORMAT_VERSION, CheckpointLayout, RankFiles
from dcp_datastates.format.metadata_file import decode_metadata, encode_metadata, split_metadata
from dcp_datastates.format.metadata_record import NotRecordable, decode_record, encode_record
from dcp_datastates.format.storage_data import layout_to_plain

LAYOUT = CheckpointLayout(
    "dcp_datastates", FORMAT_VERSION, "0123456789ab",
    [RankFiles(0, "rank00000-0123456789ab.data", "rank00000-0123456789ab.index", "", (4096,))],  # two stripes
    [("w", (0, 0), 0, 0, 32, -1), ("h", (0,), 0, 64, 6, -1), ("step", None, 0, -1, -1, 0)],
)


def metadata(**overrides) -> Metadata:
    fields = dict(
        state_dict_metadata={
            "w": TensorStorageMetadata(
                TensorProperties(dtype=torch.float32), torch.Size([2, 4]),
                [ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([2, 4]))],
            ),
            "h": TensorStorageMetadata(
                TensorProperties(dtype=torch.bfloat16, requires_grad=True), torch.Size([3]),
                [ChunkStorageMetadata(torch.Size([0]), torch.Size([3]))],
            ),
            "step": BytesStorageMetadata(),
        },
        planner_data={"w": ("model", "w"), "h": ("opt", 0, "h"), "step": ("step",)},
        storage_data=LAYOUT,
        storage_meta=StorageMeta(checkpoint_id=pathlib.Path("/ckpt/7"), save_id="s1", load_id=None, modules=["m"]),
        version="1.0.0",
    )
    fields.update(overrides)
    return Metadata(**fields)


RECORD_GOLDEN = {
    "record": 1,
    "properties": [["float32", "strided", False, "contiguous_format", False],
                   ["bfloat16", "strided", True, "contiguous_format", False]],
    "items": [["w", 0, [2, 4], [[[0, 0], [2, 4]]]], ["h", 1, [3], [[[0], [3]]]], ["step", "bytes"]],
    "planner_data": {"w": ["model", "w"], "h": ["opt", 0, "h"], "step": ["step"]},
    "storage_meta": ["path", "/ckpt/7", "s1", None, ["m"]],
    "version": "1.0.0",
    "storage_data": {
        "format": "dcp_datastates", "version": FORMAT_VERSION, "save_id": "0123456789ab",
        "ranks": [[0, "rank00000-0123456789ab.data", "rank00000-0123456789ab.index", "", [4096], ""]],
        "entries": [["w", [0, 0], 0, 0, 32, -1], ["h", [0], 0, 64, 6, -1], ["step", None, 0, -1, -1, 0]],
        "compression": None,
        "digests": [],
    },
}


def test_the_record_of_a_fixed_metadata():
    assert json.loads(encode_record(metadata())) == RECORD_GOLDEN


def test_record_and_pickle_decode_to_the_same_metadata():
    blob = encode_metadata(metadata(), sequence=3)
    pickled, record, checked = split_metadata(blob, "m")
    assert checked and len(record) > 0
    from_record, _ = decode_metadata(blob, "m")
    # The pickle alone (as DCP's tools read it), decoded through our safe unpickler.
    from_pickle = metadata_file._unpickle_metadata(pickled, "m", False, True)
    assert from_record == from_pickle == metadata()
    assert type(from_record.storage_meta.checkpoint_id) is type(pathlib.Path("/ckpt/7"))
    assert from_record.planner_data["h"] == ("opt", 0, "h")
    assert pickle.loads(blob).storage_data["format"] == "dcp_datastates"  # DCP's plain pickle.load


@pytest.mark.parametrize(
    "why,overrides",
    [
        ("a custom planner's data", dict(planner_data={"w": object()})),
        ("paths that are lists", dict(planner_data={"w": ["model", "w"]})),
        ("a checkpoint id of another kind", dict(storage_meta=StorageMeta(checkpoint_id=b"/ckpt"))),
        ("storage data that is not ours", dict(storage_data={"x": 1})),
    ],
)
def test_a_metadata_the_record_cannot_hold_gets_none_and_is_unpickled(why, overrides):
    md = metadata(**overrides)
    with pytest.raises(NotRecordable):
        encode_record(md)
    if why == "a custom planner's data":
        return  # not picklable by our safe unpickler either: nothing more to check
    blob = encode_metadata(md)
    _, record, checked = split_metadata(blob, "m")
    assert checked and len(record) == 0
    if why != "storage data that is not ours":
        decoded, _ = decode_metadata(blob, "m")
        assert decoded.storage_meta == md.storage_meta and decoded.planner_data == md.planner_data


def test_a_saved_checkpoint_is_read_from_its_record_without_unpickling(tmp_path, monkeypatch):
    state = {"w": torch.randn(4, 8), "b": torch.arange(5, dtype=torch.int64), "nested": {"x": torch.ones(2)}, "step": 3}
    dcp.save(state, storage_writer=DataStatesWriter(tmp_path / "c"), no_dist=True)
    blob = (tmp_path / "c" / ".metadata").read_bytes()
    assert len(split_metadata(blob, "m")[1]) > 0

    def no_unpickling(*_a, **_k):
        raise AssertionError("the pickle was unpickled")

    monkeypatch.setattr(metadata_file, "_unpickle_metadata", no_unpickling)
    out = {"w": torch.zeros(4, 8), "b": torch.zeros(5, dtype=torch.int64), "nested": {"x": torch.zeros(2)}, "step": 0}
    dcp.load(out, storage_reader=DataStatesReader(tmp_path / "c"), no_dist=True)
    assert_same(out, state)


def _record_file(tmp_path, record: dict) -> pathlib.Path:
    """A .metadata whose record is ``record`` (checksummed: only the record's content is wrong)."""
    md = metadata()
    plain = layout_to_plain(md.storage_data)
    pickled = pickle.dumps(Metadata(md.state_dict_metadata, md.planner_data, plain, md.storage_meta, md.version))
    path = tmp_path / ".metadata"
    path.write_bytes(_with_record(pickled, json.dumps(record).encode()))
    return path


def _with_record(pickled: bytes, raw: bytes) -> bytes:
    """``.metadata`` bytes: the pickle, ``raw`` as its record with a true footer, a true trailer."""
    body = pickled + raw + metadata_file._FOOTER.pack(metadata_file.FOOTER_MAGIC, len(pickled), len(raw))
    return body + metadata_file.encode_trailer(body)


def _edit(**changes) -> dict:
    record = json.loads(json.dumps(RECORD_GOLDEN))
    for key, value in changes.items():
        record[key] = value
    return record


@pytest.mark.parametrize(
    "record,words",
    [
        (_edit(record=2), "record version 2"),
        (_edit(extra=1), "keys"),
        (_edit(properties=[["float32", "strided", False, "contiguous_format", False], ["eval", "strided", 0, "x", 0]]), "non-booleans"),
        (_edit(properties=[["float32", "strided", False, "contiguous_format", False], ["load", "strided", True, "contiguous_format", False]]), "dtype 'load'"),
        (_edit(items=[["w", 5, [2, 4], []]]), r"not \[key, properties, size, chunks\]"),
        (_edit(items=[["w", 0, [2, -4], [[[0, 0], [2, 4]]]]]), "not a list of counts"),
        (_edit(items=[["w", 0, [2, 4], [[[0, 0], [2, 4]]]], ["w", "bytes"]]), "recorded twice"),
        (_edit(items=[["w", 0, [2, 4], [[[0, 0], [2, 3]]]], ["h", 1, [3], [[[0], [3]]]], ["step", "bytes"]]), "chunks of 'w' hold 6"),
        (_edit(items=[["w", 0, [2, 4], [[[0, 0]]]]]), r"a chunk of 'w' is not \[offsets, sizes\]"),
        (_edit(items=[["w", 0, [2, 4], [[7, [2, 4]]]]]), "a chunk offset of 'w' is not a list"),
        (_edit(items=[["w", 0, [2, 4], [[[0, 0], [2, "4"]]]]]), "a chunk size of 'w' is not a list of counts"),
        (_edit(items=[["w", 0, 8, [[[0, 0], [2, 4]]]]]), "the size of 'w' is not a list"),
        (_edit(storage_data={**RECORD_GOLDEN["storage_data"], "entries": [["w", [0, 0], 0]]}), "layout entry .* is not a list of 6"),
        (_edit(planner_data={"w": "model.w"}), "path of 'w'"),
        (_edit(storage_meta=["path", None, None, None, []]), "checkpoint id"),
        (_edit(storage_data={"format": "dcp_datastates"}), "format version None"),
        (_edit(storage_data={"x": 1}), "no dcp_datastates layout"),
    ],
)
def test_a_damaged_record_is_a_named_error(tmp_path, record, words):
    path = _record_file(tmp_path, record)
    with pytest.raises(CheckpointError, match=words) as info:
        DataStatesReader(tmp_path).read_metadata()
    assert str(path) in str(info.value)


def test_a_record_that_is_not_json_is_a_named_error(tmp_path):
    md = metadata()
    plain = layout_to_plain(md.storage_data)
    pickled = pickle.dumps(Metadata(md.state_dict_metadata, md.planner_data, plain, md.storage_meta, md.version))
    for raw in (b"{not json", b"[1, 2]", b"\xff\xfe", b"[" * 100_000):
        (tmp_path / ".metadata").write_bytes(_with_record(pickled, raw))
        with pytest.raises(CorruptCheckpointError, match="metadata record"):
            DataStatesReader(tmp_path).read_metadata()


@settings(max_examples=500, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(data=st.data())
def test_mutated_records_decode_or_fail_by_name(data):
    raw = bytearray(encode_record(metadata()))
    for _ in range(data.draw(st.integers(1, 4))):
        at = data.draw(st.integers(0, len(raw) - 1))
        raw[at] = data.draw(st.integers(0, 255))
    try:
        md = decode_record(bytes(raw), "m")
        metadata_file._checked(md, "m", checksummed=True)
    except CheckpointError:
        pass
