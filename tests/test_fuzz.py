"""Fuzzing the readers of the rank index and of ``.metadata`` with hypothesis.

Whatever bytes they are given, the decoders may only return a valid result
or raise a CheckpointError naming the file: no other exception, no hang, no
interpreter crash. Index mutations with a recomputed checksum go one step
further, through a whole load: it returns the exact state or raises.
The ``.metadata`` of every stored format fixture (tests/fixtures: versions 1
to 4 pickled our layout as classes, 5 as plain data) is mutated too.
Each property runs a few thousand cases in CI; ``-m long`` runs ten times more.
"""

from __future__ import annotations

import os
import pickle
import shutil
import struct

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.api import CheckpointException

from conftest import assert_same, index_files, load, save, unwrap
from dcp_datastates import CheckpointError, DataStatesReader
from dcp_datastates.native.engine import crc32c
from dcp_datastates.format.checkpoint_layout import CheckpointLayout
from dcp_datastates.format.rank_index import decode_index
from dcp_datastates.format.metadata_file import decode_metadata, split_metadata

pytestmark = pytest.mark.slow

FIXTURES_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures")
CI_EXAMPLES = 2000
SLOW_EXAMPLES = 20000
FAST = settings(max_examples=CI_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None)
LONG = settings(max_examples=SLOW_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None)


def make_state():
    g = torch.Generator().manual_seed(5)
    return {
        "a": torch.randn(70_000, generator=g),  # > 64 KiB: its own page-aligned range
        "b": torch.arange(12, dtype=torch.int32),
        "c": torch.randn(3, 5, generator=g).to(torch.float16),
        "step": 3,
        "cfg": {"lr": 0.5, "name": "x"},
    }


def target():
    return {"a": torch.zeros(70_000), "b": torch.zeros(12, dtype=torch.int32), "c": torch.zeros(3, 5, dtype=torch.float16),
            "step": None, "cfg": {"lr": None, "name": None}}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("fuzz") / "ckpt"
    save(make_state(), path, window_bytes=64 * 1024, host_cache_bytes=256 * 1024)
    return path


@pytest.fixture(scope="module")
def index_blob(ckpt):
    return (ckpt / index_files(ckpt)[0]).read_bytes()


@pytest.fixture(scope="module")
def metadata_blob(ckpt):
    return (ckpt / ".metadata").read_bytes()


def mutated(blob: bytes, data) -> bytes:
    """``blob`` with a few random edits: byte flips, overwritten runs, cuts, insertions."""
    out = bytearray(blob)
    for _ in range(data.draw(st.integers(1, 4), label="edits")):
        kind = data.draw(st.sampled_from(["flip", "set", "cut", "insert", "int"]), label="kind")
        if not out:
            break
        pos = data.draw(st.integers(0, len(out) - 1), label="pos")
        if kind == "flip":
            out[pos] ^= 1 << data.draw(st.integers(0, 7))
        elif kind == "set":
            run = data.draw(st.binary(min_size=1, max_size=16))
            out[pos : pos + len(run)] = run
        elif kind == "cut":
            del out[pos : pos + data.draw(st.integers(1, 64))]
        elif kind == "insert":
            out[pos:pos] = data.draw(st.binary(min_size=1, max_size=16))
        else:  # an integer field overwritten with an extreme value
            value = data.draw(st.sampled_from([0, 1, 2**31 - 1, 2**32 - 1, 2**63 - 1, 2**64 - 1]))
            out[pos : pos + 8] = struct.pack("<Q", value)[: len(out) - pos]
    return bytes(out)


def with_crc(blob: bytes) -> bytes:
    """Re-seal an index so its own checksum passes (a hostile or buggy writer)."""
    body = blob[:-4] if len(blob) >= 4 else blob
    return body + struct.pack("<I", crc32c(body))


# -- rank index -----------------------------------------------------------------------------


def _decode_index_or_named_error(blob: bytes):
    try:
        return decode_index(blob, "/ck/rank00000-x.index")
    except CheckpointError as exc:
        assert "/ck/rank00000-x.index" in str(exc)
        return None


@FAST
@given(st.binary(max_size=512))
def test_index_decoder_on_random_bytes(blob):
    _decode_index_or_named_error(blob)


@FAST
@given(data=st.data())
def test_index_decoder_on_mutations_of_a_real_index(index_blob, data):
    blob = mutated(index_blob, data)
    _decode_index_or_named_error(blob)
    idx = _decode_index_or_named_error(with_crc(blob))
    if idx is not None:  # whatever decodes is self-consistent
        assert all(o + n <= idx.data_size for o, n in zip(idx.seg_offsets, idx.seg_lengths))
        assert all(o + n <= idx.data_size for o, n in idx.objects)


def _load_with_index(ckpt, tmp_path, blob):
    case = tmp_path / "case"
    if case.exists():
        shutil.rmtree(case)
    shutil.copytree(ckpt, case)
    (case / index_files(case)[0]).write_bytes(blob)
    try:
        out = load(target(), case)
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - classified below
        err = unwrap(exc)
        assert isinstance(err, (CheckpointError, OSError)), f"{type(err).__name__}: {err}"
        return
    assert_same(out, make_state())  # never a wrong tensor


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(data=st.data())
def test_loads_through_resealed_index_mutations_are_exact_or_fail(ckpt, index_blob, tmp_path_factory, data):
    _load_with_index(ckpt, tmp_path_factory.mktemp("load"), with_crc(mutated(index_blob, data)))


# -- .metadata ------------------------------------------------------------------------------


def _decode_metadata_or_named_error(blob: bytes) -> None:
    try:
        metadata, _ = decode_metadata(blob, "/ck/.metadata")
    except CheckpointError as exc:
        assert "/ck/.metadata" in str(exc)
        return
    layout = metadata.storage_data
    if isinstance(layout, CheckpointLayout):  # decoded, so validated: checking it again passes
        layout.validate("/ck/.metadata")
        layout.check_covers(metadata, "/ck/.metadata")


@FAST
@given(st.binary(max_size=512))
def test_metadata_decoder_on_random_bytes(blob):
    _decode_metadata_or_named_error(blob)


@FAST
@given(data=st.data())
def test_metadata_decoder_on_mutated_pickles(metadata_blob, data):
    pickled, _, _ = split_metadata(metadata_blob, "m")
    # Without the trailer the unpickler itself sees every mutation.
    _decode_metadata_or_named_error(mutated(bytes(pickled), data))


@FAST
@given(data=st.data())
def test_metadata_reader_on_mutated_files(metadata_blob, data):
    _decode_metadata_or_named_error(mutated(metadata_blob, data))


def _fixture_metadata(directory: str) -> bytes:
    with open(os.path.join(FIXTURES_DIR, directory, ".metadata"), "rb") as f:
        return f.read()


@pytest.mark.parametrize("directory", ["format_v1/sync", "format_v2/async", "format_v4/zstd", "format_v5/zstd"])
@settings(max_examples=CI_EXAMPLES // 4, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(data=st.data())
def test_metadata_decoder_on_mutated_pickles_of_every_format(directory, data):
    """Versions 1-4 pickled our layout as classes (decoded through stand-ins), 5 as plain data."""
    pickled, _, _ = split_metadata(_fixture_metadata(directory), "m")
    _decode_metadata_or_named_error(mutated(bytes(pickled), data))


@pytest.mark.long
@LONG
@given(data=st.data())
def test_long_fuzz_index_and_metadata(index_blob, metadata_blob, data):
    _decode_index_or_named_error(with_crc(mutated(index_blob, data)))
    pickled, _, _ = split_metadata(metadata_blob, "m")
    _decode_metadata_or_named_error(mutated(bytes(pickled), data))


def test_reader_accepts_the_unmutated_files(ckpt, metadata_blob):
    metadata, checked = decode_metadata(metadata_blob, "m")
    assert checked and isinstance(metadata.storage_data, CheckpointLayout)
    assert pickle.loads(metadata_blob).storage_data["save_id"] == metadata.storage_data.save_id  # DCP's plain pickle.load
    assert DataStatesReader(ckpt).read_metadata().storage_data.save_id == metadata.storage_data.save_id
    assert os.path.getsize(ckpt / ".metadata") == len(metadata_blob)
