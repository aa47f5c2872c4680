"""Bad input gets a clear error that says what and where, and loses nothing."""

from __future__ import annotations

import errno
import os
import pickle
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp

from conftest import assert_same, data_files, index_files, load, raises_from_checkpoint, save
from dcp_datastates import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    ChecksumMismatchError,
    CorruptCheckpointError,
    DataStatesReader,
    DataStatesWriter,
    IncompleteCheckpointError,
    UnsupportedFormatError,
)


def _state():
    g = torch.Generator().manual_seed(0)
    return {"layer.weight": torch.randn(256, 64, generator=g), "layer.bias": torch.randn(64, generator=g), "step": 7}


def _target():
    return {"layer.weight": torch.zeros(256, 64), "layer.bias": torch.zeros(64), "step": 0}


@pytest.fixture
def ckpt(tmp_path):
    path = tmp_path / "ckpt"
    save(_state(), path)
    return path


def assert_metadata_error(path, expected, match):
    """Metadata errors: typed from read_metadata(); through dcp.load, DCP keeps our message only.

    DCP 2.13 catches exceptions of StorageReader.read_metadata and raises an
    AssertionError whose text includes ours, so that is what users see there.
    """
    with pytest.raises(expected, match=match):
        DataStatesReader(path).read_metadata()
    with raises_from_checkpoint((expected, AssertionError), match=match.replace("\\", "")):
        load(_target(), path)


def test_missing_directory(tmp_path):
    assert_metadata_error(tmp_path / "nope", CheckpointNotFoundError, "does not exist")


def test_directory_without_checkpoint(tmp_path):
    (tmp_path / "empty").mkdir()
    assert_metadata_error(tmp_path / "empty", CheckpointNotFoundError, "metadata is missing")


@pytest.mark.parametrize("how", ["reader", "checkpoint_id"])
@pytest.mark.parametrize("kind", ["missing", "empty", "other files", "incomplete"])
def test_a_load_of_no_checkpoint_raises_one_typed_error_and_prints_nothing(tmp_path, capfd, kind, how, ckpt):
    """Not DCP's CheckpointException (a BaseException a plain ``except Exception`` misses) and no
    "Global metadata is not found" traceback of DCP's on stderr: our error, before dcp.load begins."""
    path = {"missing": tmp_path / "nope", "empty": tmp_path / "empty", "other files": tmp_path / "notes",
            "incomplete": ckpt}[kind]
    if kind == "empty":
        path.mkdir()
    elif kind == "other files":
        path.mkdir()
        (path / "README.txt").write_text("not a checkpoint")
    elif kind == "incomplete":
        os.unlink(ckpt / ".metadata")
    expected = IncompleteCheckpointError if kind == "incomplete" else CheckpointNotFoundError
    capfd.readouterr()
    try:
        if how == "reader":
            dcp.load(_target(), storage_reader=DataStatesReader(path), no_dist=True)
        else:
            dcp.load(_target(), storage_reader=DataStatesReader(), checkpoint_id=path, no_dist=True)
    except Exception as exc:  # noqa: BLE001 - what a user's except catches
        assert type(exc) is expected and str(path) in str(exc), f"{type(exc).__name__}: {exc}"
    else:
        raise AssertionError(f"dcp.load of {path} did not raise")
    out, err = capfd.readouterr()
    assert out == "" and err == "", (out, err)


def test_incomplete_checkpoint_without_metadata(ckpt):
    os.unlink(ckpt / ".metadata")
    assert_metadata_error(ckpt, IncompleteCheckpointError, "is incomplete")


def test_truncated_data_file_names_the_file(ckpt):
    data = ckpt / data_files(ckpt)[0]
    with open(data, "r+b") as f:
        f.truncate(os.path.getsize(data) // 2)
    with raises_from_checkpoint(CorruptCheckpointError, match=f"{data} is truncated"):
        load(_target(), ckpt)


def test_flipped_byte_names_file_and_key(ckpt):
    data = ckpt / data_files(ckpt)[0]
    with open(data, "r+b") as f:
        f.seek(100)  # inside layer.bias: small tensors are packed first, from offset 0
        b = f.read(1)
        f.seek(100)
        f.write(bytes([b[0] ^ 0x40]))
    with raises_from_checkpoint(ChecksumMismatchError, match=str(data)):
        load(_target(), ckpt)
    with raises_from_checkpoint(ChecksumMismatchError, match="'layer.bias'"):
        load(_target(), ckpt)
    # Without verification the damaged bytes come through: the check is what protects.
    out = load(_target(), ckpt, verify=False)
    assert not torch.equal(out["layer.bias"], _state()["layer.bias"])
    assert torch.equal(out["layer.weight"], _state()["layer.weight"])


def test_verify_false_skips_checksums_but_loads(ckpt):
    out = load(_target(), ckpt, verify=False)
    assert out["step"] == 7


def test_missing_rank_data_file(ckpt):
    os.unlink(ckpt / data_files(ckpt)[0])
    with raises_from_checkpoint(CorruptCheckpointError, match="data file"):
        load(_target(), ckpt)


def test_missing_rank_index_file(ckpt):
    os.unlink(ckpt / index_files(ckpt)[0])
    with raises_from_checkpoint(CorruptCheckpointError, match="index file"):
        load(_target(), ckpt)


@pytest.mark.parametrize("where", [0, 20, 60, -1])
def test_corrupt_index_is_rejected(ckpt, where):
    idx = ckpt / index_files(ckpt)[0]
    blob = bytearray(idx.read_bytes())
    blob[where] ^= 0x01
    idx.write_bytes(bytes(blob))
    with raises_from_checkpoint(CorruptCheckpointError, match=str(idx)):
        load(_target(), ckpt)


def test_index_from_another_save_is_rejected(tmp_path):
    save(_state(), tmp_path / "a")
    save(_state(), tmp_path / "b")
    ia, ib = tmp_path / "a" / index_files(tmp_path / "a")[0], tmp_path / "b" / index_files(tmp_path / "b")[0]
    shutil.copyfile(ib, ia)
    with raises_from_checkpoint(CorruptCheckpointError, match="different checkpoints"):
        load(_target(), tmp_path / "a")


def test_key_not_in_checkpoint(ckpt):
    target = _target()
    target["layer.extra"] = torch.zeros(3)
    with raises_from_checkpoint(RuntimeError, match="layer.extra"):
        load(target, ckpt)


def test_shape_mismatch(ckpt):
    target = _target()
    target["layer.weight"] = torch.zeros(128, 64)
    with raises_from_checkpoint(ValueError, match="layer.weight"):
        load(target, ckpt)


def test_stock_checkpoint_whose_record_leaves_its_directory_is_refused(tmp_path):
    """A stock DCP checkpoint loads through our reader (tests/test_stock_dcp.py); one whose
    storage data names a file outside its directory is refused, naming the item."""
    dcp.save(_state(), storage_writer=dcp.FileSystemWriter(tmp_path / "fs"), no_dist=True)
    md_path = tmp_path / "fs" / ".metadata"
    md = pickle.loads(md_path.read_bytes())
    info = next(iter(md.storage_data.values()))
    info.relative_path = "../elsewhere.distcp"
    md_path.write_bytes(pickle.dumps(md))
    assert_metadata_error(tmp_path / "fs", CorruptCheckpointError, "not a file of the checkpoint")


def test_newer_format_version_is_refused(ckpt):
    md_path = ckpt / ".metadata"
    md = pickle.loads(md_path.read_bytes())
    md.storage_data["version"] = 99  # plain data (format 5): DCP's own unpickling yields a dict
    md_path.write_bytes(pickle.dumps(md))
    assert_metadata_error(ckpt, UnsupportedFormatError, "version 99")


def test_garbage_metadata(ckpt):
    (ckpt / ".metadata").write_bytes(b"not a pickle at all")
    assert_metadata_error(ckpt, CorruptCheckpointError, "not a pickle")  # refused by its first bytes


def test_saving_over_committed_checkpoint_is_refused(ckpt):
    before = sorted(os.listdir(ckpt))
    with raises_from_checkpoint(CheckpointExistsError, match="overwrite=True"):
        save({"x": torch.ones(3)}, ckpt)
    assert sorted(os.listdir(ckpt)) == before
    assert_same(_state()["layer.weight"].shape, load(_target(), ckpt)["layer.weight"].shape)


def test_overwrite_replaces_and_cleans_old_files(ckpt):
    old = set(data_files(ckpt))
    new_state = {"layer.weight": torch.ones(256, 64), "layer.bias": torch.ones(64), "step": 8}
    save(new_state, ckpt, overwrite=True)
    assert not (set(data_files(ckpt)) & old)
    assert len(data_files(ckpt)) == 1 and len(index_files(ckpt)) == 1
    assert_same(new_state, load(_target(), ckpt))


def test_failed_save_leaves_nothing_committed_and_cleans_up(tmp_path):
    state = _state()
    state["bad"] = lambda: None  # cannot be pickled
    with raises_from_checkpoint(Exception):
        save(state, tmp_path / "c")
    assert not (tmp_path / "c" / ".metadata").exists()
    assert data_files(tmp_path / "c") == [] and index_files(tmp_path / "c") == []


def test_failed_overwrite_keeps_the_committed_checkpoint(ckpt):
    state = _state()
    state["bad"] = lambda: None
    with raises_from_checkpoint(Exception):
        save(state, ckpt, overwrite=True)
    assert_same(_state(), load(_target(), ckpt))


def test_disk_full_names_file_and_keeps_other_checkpoints(tmp_path, small_tmpfs, ckpt):
    big = {"w": torch.randn(1 << 20)}  # 4 MiB into a 2 MiB filesystem
    with raises_from_checkpoint(OSError) as _:
        save(big, small_tmpfs / "c")
    try:
        save(big, small_tmpfs / "c2")
    except BaseException as exc:  # noqa: BLE001
        from conftest import unwrap

        err = unwrap(exc)
        assert isinstance(err, OSError) and err.errno == errno.ENOSPC, err
        assert "rank00000-" in str(err.filename)
        assert "(the space of 'w')" in str(err), err  # the reservation names the key it was for
    for d in ("c", "c2"):
        assert not (small_tmpfs / d / ".metadata").exists()
        assert data_files(small_tmpfs / d) == []  # partial files removed, space returned
    assert_same(_state(), load(_target(), ckpt))
    save({"w": torch.randn(1000)}, small_tmpfs / "c3")  # space is back: the next save succeeds
    assert (small_tmpfs / "c3" / ".metadata").exists()


def test_no_path_is_a_clear_error():
    with raises_from_checkpoint(ValueError, match="no path"):
        dcp.save({"a": torch.ones(1)}, storage_writer=DataStatesWriter(), no_dist=True)


def test_bad_writer_arguments():
    with pytest.raises(ValueError, match="direct_io"):
        DataStatesWriter("/tmp/x", direct_io="sometimes")
    with pytest.raises(ValueError, match="two windows"):
        DataStatesWriter("/tmp/x", host_cache_bytes=1 << 20, window_bytes=1 << 20)
    with pytest.raises(ValueError, match="multiple of 4096"):
        DataStatesReader("/tmp/x", window_bytes=1000)


_TAKING_URLS = {
    "writer": lambda url: DataStatesWriter(url),
    "dcp.save checkpoint_id": lambda url: dcp.save(
        {"w": torch.zeros(3)}, storage_writer=DataStatesWriter(), checkpoint_id=url, no_dist=True),
    "reader": lambda url: DataStatesReader(url),
    "dcp.load checkpoint_id": lambda url: dcp.load(
        {"w": torch.zeros(3)}, storage_reader=DataStatesReader(), checkpoint_id=url, no_dist=True),
}


@pytest.mark.parametrize("make", list(_TAKING_URLS.values()), ids=list(_TAKING_URLS))
@pytest.mark.parametrize("url", ["gs://bucket/ckpt", "S3://bucket/ckpt", "file:///tmp/ckpt"])
def test_a_url_no_store_serves_is_refused_naming_the_ones_served(tmp_path, monkeypatch, make, url):
    """Before, DataStatesWriter("s3://bucket/ckpt/step_1") saved into ./s3:/bucket/ckpt/step_1. The
    writer and reader take s3:// URLs (tests/test_store_writer.py, tests/test_store_reader.py); any
    other scheme is refused, never looked for or written as a folder of that name."""
    monkeypatch.chdir(tmp_path)
    with raises_from_checkpoint((ValueError, AssertionError), match="use a directory path or s3://bucket/prefix"):
        make(url)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("url", ["s3://bucket/run", "gs://bucket/run", "S3://bucket/run"])
def test_a_manager_root_is_a_local_directory_and_a_url_names_durable(tmp_path, monkeypatch, url):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=f"'{url}' is a .*:// URL") as info:
        __import__("dcp_datastates").CheckpointManager(url)
    assert "durable=URL" in str(info.value)
    assert os.listdir(tmp_path) == []
