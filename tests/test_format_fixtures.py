"""Every format version the reader promises to read, as the releases that wrote it left it.

``tests/fixtures/format_v<N>/<kind>/`` are real checkpoints written by the
commit that introduced (or last wrote) each format version;
``tests/fixtures/make_fixture.py`` says which, and holds the state they all
saved. Each must load bit for bit in safe mode (and with ``allow_pickle``),
pass ``verify``, and open in the tools' ``CheckpointView`` and CLI. The
pickle of each ``.metadata`` is checked to name the class paths its writer
used, so the old paths stay covered (format 5 names none of ours).
"""

from __future__ import annotations

import os
import shutil
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import MetadataIndex

from conftest import assert_same
from dcp_datastates import DataStatesReader, verify
from dcp_datastates.format.metadata_file import read_commit_sequence, read_metadata_file, split_metadata

FIXTURES_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures")
sys.path.insert(0, FIXTURES_DIR)
from make_fixture import FIXTURES, ZSTD_SEQUENCE, expected_state  # noqa: E402
from pickle_tools import pickle_globals  # noqa: E402

IDS = [f.directory for f in FIXTURES]


@pytest.fixture(params=FIXTURES, ids=IDS)
def fixture(request, tmp_path):
    """A fixture and a copy of its checkpoint (nothing may write into the repository's)."""
    fx = request.param
    if fx.kind == "incremental":  # the checkpoint and its base, siblings as they were saved
        shutil.copytree(os.path.dirname(os.path.join(FIXTURES_DIR, fx.directory)), tmp_path / "chain")
        return fx, tmp_path / "chain" / os.path.basename(fx.directory)
    path = tmp_path / "ckpt"
    shutil.copytree(os.path.join(FIXTURES_DIR, fx.directory), path)
    return fx, path


def _zeros(state):
    if isinstance(state, torch.Tensor):
        return torch.full_like(state, 7) if state.dtype != torch.bool else torch.zeros_like(state)
    if isinstance(state, dict):
        return {k: _zeros(v) for k, v in state.items()}
    return None


def test_every_promised_version_has_fixtures():
    from dcp_datastates.format.checkpoint_layout import FORMAT_VERSION

    assert {f.version for f in FIXTURES} == set(range(1, FORMAT_VERSION + 1))
    for fx in FIXTURES:
        assert os.path.isfile(os.path.join(FIXTURES_DIR, fx.directory, ".metadata")), fx


@pytest.mark.parametrize("allow_pickle", [False, True], ids=["safe", "allow_pickle"])
def test_fixture_loads_bit_exactly(fixture, allow_pickle):
    fx, path = fixture
    state = _zeros(expected_state(fx.kind))
    dcp.load(state, storage_reader=DataStatesReader(path, allow_pickle=allow_pickle), no_dist=True)
    assert_same(state, expected_state(fx.kind))


def test_fixture_metadata_is_what_its_writer_wrote(fixture):
    fx, path = fixture
    with open(path / ".metadata", "rb") as f:
        pickled = f.read()
    ours = {name for name in pickle_globals(pickled) if name.startswith("dcp_datastates")}
    assert ours == set(fx.pickled_classes)
    reader = DataStatesReader(path)
    metadata = reader.read_metadata()
    layout = reader.layout
    assert metadata.storage_data is layout and layout.version == fx.version
    _, checksummed = read_metadata_file(str(path / ".metadata"))
    assert checksummed == (fx.version >= 3)
    # From version 6 on our reader decodes the plain record; the pickle stays for DCP's tools.
    _, record, _ = split_metadata(pickled, str(path))
    assert (len(record) > 0) == (fx.version >= 6)
    assert read_commit_sequence(str(path / ".metadata")) == (ZSTD_SEQUENCE if fx.kind == "zstd" else None)
    own_ids = [r.save_id for r in layout.own_ranks if r.save_id and r.save_id != layout.save_id]
    assert bool(own_ids) == (fx.kind == "async")  # an async save names its files with its own id
    compressed = [e for e in layout.entries if e[5] >= 0 and e[4] >= 0]
    assert (layout.compression is not None, bool(compressed)) == ((fx.kind == "zstd",) * 2)
    striped = [r for r in layout.ranks if r.stripes]  # format 7: a rank's data over several files
    assert bool(striped) == (fx.kind == "striped")
    assert sorted(n for n in os.listdir(path) if n.endswith(".data")) == sorted(
        n for r in layout.own_ranks for n in r.data_files()
    )
    assert layout.bases == (["step_1"] if fx.kind == "incremental" else [])
    if fx.kind == "incremental":  # "frozen" is referred to in step_1, "moving" was written again
        assert layout.location(MetadataIndex("model.frozen", torch.Size([0]))).relative_path.startswith("../step_1/")
        assert not layout.location(MetadataIndex("model.moving", torch.Size([0]))).relative_path.startswith("../")
    assert len({e[0] for e in layout.entries}) == len(metadata.state_dict_metadata)


def test_fixture_verifies(fixture):
    _fx, path = fixture
    report = verify(path)
    assert report.ok and not report.notes, report.summary()
    assert report.bytes_checked > 0 and report.items >= 12


def test_fixture_opens_in_the_tools(fixture, capsys):
    from dcp_datastates.tools.checkpoint_view import CheckpointView
    from dcp_datastates.tools.cli import run

    fx, path = fixture
    view = CheckpointView(path)
    want = expected_state(fx.kind)
    assert_same(view.read_tensor("model.transposed"), want["model"]["transposed"])
    assert_same(view.read_tensor("model.bf16"), want["model"]["bf16"])
    assert view.read_object("name") == "format fixture" and view.training_step() == 42
    assert run(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert "model.bf16" in out and "bfloat16" in out
