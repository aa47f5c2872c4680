"""``.metadata`` is decoded (its record or pickle read, then validated) once per load, not once
per look at it.

Decoding is the costly part of reading a checkpoint's metadata (a record or
pickle of every key and chunk, then every entry validated); a reader remembers the
file it decoded by its identity, so a check before the load, ``verify``, and
DCP's own ``read_metadata`` share one decoding. A new ``.metadata`` (a save
over the same path renames a new file into place) is decoded again.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp

from conftest import assert_same, save
from dcp_datastates import CheckpointManager, CheckpointManagerOptions, DataStatesReader, verify
from dcp_datastates.format import metadata_file


@pytest.fixture
def decodes(monkeypatch):
    """How many times a ``.metadata`` was decoded (the check every decoding ends with counted)."""
    count = [0]
    decode = metadata_file._checked

    def counted(*args, **kwargs):
        count[0] += 1
        return decode(*args, **kwargs)

    monkeypatch.setattr(metadata_file, "_checked", counted)
    return count


def state(step: int = 1) -> dict:
    return {"w": torch.arange(12.0).reshape(3, 4) * step, "b": torch.ones(3, dtype=torch.bfloat16) * step, "step": step}


def target() -> dict:
    return {"w": torch.zeros(3, 4), "b": torch.zeros(3, dtype=torch.bfloat16), "step": None}


def test_a_load_decodes_the_metadata_once(tmp_path, decodes):
    save(state(), tmp_path / "c")
    out = target()
    dcp.load(out, storage_reader=DataStatesReader(tmp_path / "c"), no_dist=True)
    assert decodes[0] == 1
    assert_same(out, state())


def test_a_reader_decodes_each_metadata_file_once(tmp_path, decodes):
    path = tmp_path / "c"
    save(state(), path)
    reader = DataStatesReader(path)
    metadata = reader.read_metadata()  # a check before the load (what CheckpointManager does)
    out = target()
    dcp.load(out, storage_reader=reader, checkpoint_id=path, no_dist=True)  # reset(path), then read_metadata
    assert decodes[0] == 1 and reader.read_metadata() is metadata
    assert_same(out, state())
    dcp.load(out, storage_reader=reader, checkpoint_id=path, no_dist=True)  # again: still the same file
    assert decodes[0] == 1
    # A save over the same path commits a new .metadata: decoded anew, and its data loaded.
    save(state(2), path, overwrite=True)  # (which reads the replaced .metadata for its files)
    decodes[0] = 0
    out = target()
    dcp.load(out, storage_reader=reader, checkpoint_id=path, no_dist=True)
    assert decodes[0] == 1
    assert_same(out, state(2))


def test_verify_then_load_decode_once_with_one_reader(tmp_path, decodes):
    path = tmp_path / "c"
    save(state(), path)
    reader = DataStatesReader(path)
    assert verify(path, reader=reader).ok
    out = target()
    dcp.load(out, storage_reader=reader, checkpoint_id=path, no_dist=True)
    assert decodes[0] == 1
    assert_same(out, state())
    with pytest.raises(ValueError, match="a reader of"):
        verify(tmp_path / "elsewhere", reader=reader)


def test_a_reader_in_safe_mode_does_not_reuse_a_trusting_decode(tmp_path, decodes):
    path = tmp_path / "c"
    save(state(), path)
    reader = DataStatesReader(path, allow_pickle=True)
    reader.read_metadata()
    reader.allow_pickle = False
    reader.read_metadata()
    assert decodes[0] == 2


@pytest.mark.parametrize("full_verify", [False, True])
def test_a_manager_load_decodes_the_metadata_once(tmp_path, decodes, full_verify):
    with CheckpointManager(tmp_path / "run", CheckpointManagerOptions(async_save=False)) as mgr:
        mgr.save(10, state(10))
        decodes[0] = 0
        out = target()
        assert mgr.load(out, full_verify=full_verify) == 10
    assert_same(out, state(10))
    assert decodes[0] == 1
