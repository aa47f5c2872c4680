"""Damaged checkpoints: every load raises a clear error naming the file (and key), never a
wrong tensor and never a crash; ``dcp_datastates.verify`` reports each problem.

Each case damages a copy of one checkpoint (tensors of several sizes and
dtypes, a strided tensor, objects) in one way: flipped bytes (everywhere in
the index and the metadata, at sampled offsets of the data), truncation,
deleted or swapped files, and index edits whose own checksum was recomputed
(so only the cross-checks can catch them).
"""

from __future__ import annotations

import os
import shutil
import struct

import pytest
import torch

from torch.distributed.checkpoint.api import CheckpointException

from conftest import assert_same, data_files, index_files, load, save, unwrap
from dcp_datastates import (
    CheckpointError,
    ChecksumMismatchError,
    CorruptCheckpointError,
    DataStatesReader,
    IncompleteCheckpointError,
    UnsupportedFormatError,
    verify,
)
from dcp_datastates.native.engine import crc32c
from dcp_datastates.format.rank_index import _HEADER, _OBJECT, _SEGMENT, decode_index

MiB = 1 << 20


def make_state():
    g = torch.Generator().manual_seed(11)
    return {
        "emb": torch.randn(600, 256, generator=g),  # 600 KiB: page-aligned, several segments with 256 KiB windows
        "w_t": torch.randn(100, 70, generator=g).t(),  # strided
        "bias": torch.randn(33, generator=g).to(torch.bfloat16),  # packed small tensors
        "ids": torch.arange(17, dtype=torch.int64),
        "flag": torch.tensor(True),
        "step": 1234,
        "sched": {"name": "cosine", "milestones": [10, 20]},
    }


def target():
    s = make_state()
    out = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else None for k, v in s.items()}
    out["sched"] = {"name": None, "milestones": None}
    return out


WRITER = dict(window_bytes=256 * 1024, host_cache_bytes=1 * MiB)


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    path = tmp_path_factory.mktemp("corruption") / "ckpt"
    save(make_state(), path, **WRITER)
    return path


@pytest.fixture
def ckpt(template, tmp_path):
    path = tmp_path / "ckpt"
    shutil.copytree(template, path)
    return path


def layout_of(path):
    return DataStatesReader(path).read_metadata().storage_data


def load_outcome(path, **reader_kwargs):
    """'exact' if the load returned exactly the saved state, else the rank's error.

    A load that returns anything else is the one outcome that must never happen.
    """
    try:
        out = load(target(), path, **reader_kwargs)
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - classified below
        err = unwrap(exc)
        if isinstance(err, AssertionError) and ".metadata" in str(err):
            return err  # DCP 2.13 re-raises read_metadata errors as AssertionError with our text
        assert isinstance(err, (CheckpointError, OSError)), f"unexpected {type(err).__name__}: {err}"
        return err
    assert_same(out, make_state())
    return "exact"


def flip(path, offset, mask=0x10):
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ mask]))


# -- data file ------------------------------------------------------------------------------


def test_intact_checkpoint_loads_and_verifies(ckpt):
    assert load_outcome(ckpt) == "exact"
    report = verify(ckpt)
    assert report.ok, report.summary()
    assert report.items == 8 and report.segments_checked >= 5 and report.notes == []


def test_flipped_byte_in_every_item_is_caught_with_its_key(ckpt, tmp_path):
    layout = layout_of(ckpt)
    data = ckpt / layout.ranks[0].data_file
    idx = decode_index((ckpt / layout.ranks[0].index_file).read_bytes(), "index")
    spans = [(e[0], e[3], e[4]) for e in layout.entries if e[5] < 0 and e[4] > 0]
    spans += [(f"object {i}", o, n) for i, (o, n) in enumerate(idx.objects)]
    names = {e[5]: e[0] for e in layout.entries if e[5] >= 0}
    for key, start, length in spans:
        for rel in sorted({0, length // 2, length - 1}):
            case = tmp_path / f"case_{key.replace(' ', '_')}_{rel}"
            shutil.copytree(ckpt, case)
            flip(case / layout.ranks[0].data_file, start + rel)
            err = load_outcome(case)
            assert isinstance(err, ChecksumMismatchError), (key, rel, err)
            shown = names.get(int(key.split()[1]), key) if key.startswith("object") else key
            assert str(data.name) in str(err) and repr(shown) in str(err), err
            report = verify(case)
            assert not report.ok and len(report.problems) == 1, report.summary()
            assert repr(shown) in report.problems[0] and data.name in report.problems[0]
            shutil.rmtree(case)


@pytest.mark.parametrize("keep", [0, 1, 4096, 0.5, -1])
def test_truncated_data_file(ckpt, keep):
    data = ckpt / data_files(ckpt)[0]
    size = os.path.getsize(data)
    new = int(size * keep) if isinstance(keep, float) else (size + keep if keep < 0 else keep)
    os.truncate(data, new)
    err = load_outcome(ckpt)
    assert isinstance(err, CorruptCheckpointError) and "truncated" in str(err) and data.name in str(err), err
    report = verify(ckpt)
    assert not report.ok and "truncated" in report.problems[0]


def test_garbage_appended_to_data_file_loads_but_fails_verify(ckpt):
    """A load never reads past the data size; verify reports any change, appended bytes too."""
    name = data_files(ckpt)[0]
    with open(ckpt / name, "ab") as f:
        f.write(b"\xff" * 10000)
    assert load_outcome(ckpt) == "exact"
    report = verify(ckpt)
    assert not report.ok and len(report.problems) == 1, report.summary()
    assert name in report.problems[0] and "10000 bytes past" in report.problems[0]


@pytest.mark.parametrize("which", ["data", "index"])
def test_deleted_rank_file(ckpt, which):
    name = (data_files if which == "data" else index_files)(ckpt)[0]
    os.unlink(ckpt / name)
    err = load_outcome(ckpt)
    assert isinstance(err, CorruptCheckpointError) and "missing" in str(err) and name in str(err), err
    report = verify(ckpt)
    assert not report.ok and name in report.problems[0]


def test_rank_files_swapped_between_checkpoints(ckpt, tmp_path):
    other = tmp_path / "other"
    state = make_state()
    state["emb"] = state["emb"] + 1  # same layout, different bytes
    save(state, other, **WRITER)
    mine = data_files(ckpt)[0]
    shutil.copyfile(other / data_files(other)[0], ckpt / mine)  # their data under my name
    err = load_outcome(ckpt)
    assert isinstance(err, ChecksumMismatchError) and mine in str(err), err
    shutil.copyfile(other / index_files(other)[0], ckpt / index_files(ckpt)[0])  # and their index
    err = load_outcome(ckpt)
    assert isinstance(err, CorruptCheckpointError) and "different checkpoints" in str(err), err


# -- rank index -----------------------------------------------------------------------------


def test_every_flipped_byte_of_the_index_is_caught(ckpt):
    index = ckpt / index_files(ckpt)[0]
    blob = index.read_bytes()
    for pos in range(len(blob)):
        damaged = bytearray(blob)
        damaged[pos] ^= 0x01
        index.write_bytes(bytes(damaged))
        err = load_outcome(ckpt)
        assert isinstance(err, (CorruptCheckpointError, UnsupportedFormatError)), (pos, err)
        assert index.name in str(err), (pos, err)
    index.write_bytes(blob)
    assert load_outcome(ckpt) == "exact"


def _edit_index(path, edit):
    """Rewrite the index through ``edit(header, segments, objects)`` and recompute its CRC."""
    blob = path.read_bytes()
    header = list(_HEADER.unpack_from(blob, 0))
    nseg, nobj = header[5], header[6]
    pos = _HEADER.size
    segs = [list(s) for s in _SEGMENT.iter_unpack(blob[pos : pos + nseg * _SEGMENT.size])]
    pos += nseg * _SEGMENT.size
    objs = [list(o) for o in _OBJECT.iter_unpack(blob[pos : pos + nobj * _OBJECT.size])]
    edit(header, segs, objs)
    header[5], header[6] = len(segs), len(objs)
    body = _HEADER.pack(*header) + b"".join(_SEGMENT.pack(*s) for s in segs) + b"".join(_OBJECT.pack(*o) for o in objs)
    path.write_bytes(body + struct.pack("<I", crc32c(body)))


def _largest_segment(segs):
    return max(range(len(segs)), key=lambda i: segs[i][1])


INDEX_EDITS = {
    # what is edited -> (edit, the words the error must contain)
    "segment checksum": (lambda h, s, o: s[0].__setitem__(2, s[0][2] ^ 1), "checksum mismatch"),
    "segment dropped": (lambda h, s, o: s.pop(_largest_segment(s)), "not covered"),
    "segment shortened": (lambda h, s, o: s[_largest_segment(s)].__setitem__(1, s[_largest_segment(s)][1] - 64), "not covered"),
    "object moved": (lambda h, s, o: o[0].__setitem__(0, o[0][0] + 8), "not covered"),
    "object lengthened": (lambda h, s, o: o[0].__setitem__(1, o[0][1] + 1), "not covered"),
    "object table emptied": (lambda h, s, o: o.clear(), "object"),
    "data size grown": (lambda h, s, o: h.__setitem__(4, h[4] + 4096), "truncated"),
    "rank changed": (lambda h, s, o: h.__setitem__(2, 7), "belongs to rank 7"),
    "save id changed": (lambda h, s, o: h.__setitem__(3, b"000000000000".ljust(16, b"\0")), "different checkpoints"),
    "newer version": (lambda h, s, o: h.__setitem__(1, 99), "version 99"),
}


@pytest.mark.parametrize("what", sorted(INDEX_EDITS))
def test_index_edits_with_a_recomputed_checksum_are_caught(ckpt, what):
    edit, words = INDEX_EDITS[what]
    index = ckpt / index_files(ckpt)[0]
    _edit_index(index, edit)
    err = load_outcome(ckpt)
    assert isinstance(err, CheckpointError) and words in str(err), (what, err)
    report = verify(ckpt)
    assert not report.ok and any(words in p for p in report.problems), report.summary()


def test_unverified_load_is_the_only_way_past_a_bad_checksum(ckpt):
    _edit_index(ckpt / index_files(ckpt)[0], INDEX_EDITS["segment checksum"][0])
    assert load_outcome(ckpt, verify=False) == "exact"  # the bytes are fine; only the index lied


# -- metadata -------------------------------------------------------------------------------


def test_every_flipped_byte_of_the_metadata_is_caught(ckpt):
    md = ckpt / ".metadata"
    blob = md.read_bytes()
    reader_errors = 0
    for pos in range(len(blob)):
        damaged = bytearray(blob)
        damaged[pos] ^= 0x04
        md.write_bytes(bytes(damaged))
        with pytest.raises((CorruptCheckpointError, UnsupportedFormatError)) as info:
            DataStatesReader(ckpt).read_metadata()
        assert ".metadata" in str(info.value)
        reader_errors += 1
    assert reader_errors == len(blob)
    md.write_bytes(blob)
    assert load_outcome(ckpt) == "exact"


@pytest.mark.parametrize("cut", [0, 1, 100, -25, -24, -1])
def test_truncated_metadata(ckpt, cut):
    md = ckpt / ".metadata"
    blob = md.read_bytes()
    md.write_bytes(blob[:cut] if cut else b"")
    with pytest.raises(CorruptCheckpointError, match=".metadata"):
        DataStatesReader(ckpt).read_metadata()
    report = verify(ckpt)
    assert not report.ok and report.committed and ".metadata" in report.problems[0]


def test_metadata_deleted_means_incomplete(ckpt):
    os.unlink(ckpt / ".metadata")
    with pytest.raises(IncompleteCheckpointError, match="incomplete"):
        DataStatesReader(ckpt).read_metadata()
    report = verify(ckpt)
    assert not report.committed and "incomplete" in report.problems[0]
    with pytest.raises(IncompleteCheckpointError):
        report.raise_if_bad()


# -- verify() reports -----------------------------------------------------------------------


def test_verify_lists_every_problem_and_stray_files(ckpt):
    layout = layout_of(ckpt)
    data = ckpt / layout.ranks[0].data_file
    emb = next(e for e in layout.entries if e[0] == "emb")
    flip(data, emb[3] + 5)
    flip(data, emb[3] + emb[4] - 5)
    (ckpt / "rank00003-0123456789ab.data").write_bytes(b"x")
    (ckpt / ".metadata.0123456789ab.tmp").write_bytes(b"x")
    seen = []
    report = verify(ckpt, progress=lambda done, total: seen.append((done, total)))
    assert report.committed and not report.ok
    assert len(report.problems) == 2 and all("'emb'" in p for p in report.problems), report.summary()
    assert len(report.notes) == 2 and "safe to delete" in report.notes[0]
    assert seen and seen[-1][0] == seen[-1][1] == report.bytes_checked
    with pytest.raises(CorruptCheckpointError, match="2 problems"):
        report.raise_if_bad()
    assert "CORRUPT" in str(report)
