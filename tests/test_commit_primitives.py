"""The commit's primitives, as every save and copy uses them: a small object staged, then published
without replacing one (``Store.stage_bytes``), ``storage.commit_checkpoint`` and
``storage.is_committed``, on a directory store (``LocalStore``: a file staged durably under a
temporary name) and as an object store stages (``StagedBytes``: held in memory until one write).
"""

from __future__ import annotations

import os

import pytest
import torch

from conftest import save
from dcp_datastates.errors import CorruptCheckpointError
from dcp_datastates.format.file_names import METADATA_FILE
from dcp_datastates.storage import ObjectExistsError, commit_checkpoint, is_committed
from dcp_datastates.storage.local import LocalStore, is_committed_directory
from dcp_datastates.storage.store import StagedBytes


def _staged(kind: str, store: LocalStore, key: str, data: bytes, staging_key: str | None = None):
    if kind == "file":
        return store.stage_bytes(key, data, staging_key)
    return StagedBytes(store, key, data)


@pytest.mark.parametrize("kind", ["file", "memory"])
def test_a_staged_object_appears_only_when_published_and_never_over_another(tmp_path, kind):
    store = LocalStore(str(tmp_path))
    key = "step_1/.metadata"
    staged = _staged(kind, store, key, b"ours", "step_1/.metadata.abc.tmp")
    assert store.size(key) is None and not is_committed(store, "step_1") and staged.landed() is False
    if kind == "file":  # durable under its staging name already, while the save's data is written
        assert (tmp_path / "step_1" / ".metadata.abc.tmp").read_bytes() == b"ours"
    staged.publish()
    assert store.read(key) == b"ours" and is_committed(store, "step_1") and staged.landed() is True
    assert sorted(os.listdir(tmp_path / "step_1")) == [METADATA_FILE]  # the staging name is gone

    theirs = _staged(kind, store, key, b"theirs", "step_1/.metadata.def.tmp")
    with pytest.raises(ObjectExistsError, match="step_1/.metadata"):
        theirs.publish()
    assert theirs.landed() is False and store.read(key) == b"ours"
    theirs.abandon()
    assert sorted(os.listdir(tmp_path / "step_1")) == [METADATA_FILE]

    again = _staged(kind, store, key, b"ours")  # a commit retried after it landed: its own bytes
    again.publish()
    assert again.landed() is True and store.read(key) == b"ours"

    newer = _staged(kind, store, key, b"newer")
    newer.publish(replace=True)  # an overwriting save, a newer save of a copied step
    assert store.read(key) == b"newer"


def test_commit_checkpoint_is_the_one_commit_of_a_copy(tmp_path):
    store = LocalStore(str(tmp_path))
    store.put_in_place("step_2/rank00000-abc.index", b"index")  # in place: only .metadata refers to it
    assert not is_committed(store, "step_2")
    commit_checkpoint(store, "step_2", b"meta")
    assert is_committed(store, "step_2") and is_committed_directory(str(tmp_path / "step_2"))
    commit_checkpoint(store, "step_2", b"meta")  # retried: these very bytes
    with pytest.raises(ObjectExistsError):
        commit_checkpoint(store, "step_2", b"other")
    commit_checkpoint(store, "step_2", b"other", replace=True)
    assert store.read("step_2/.metadata") == b"other"
    assert sorted(os.listdir(tmp_path / "step_2")) == [METADATA_FILE, "rank00000-abc.index"]


def test_a_delete_takes_an_emptied_step_directory_but_never_the_root(tmp_path):
    store = LocalStore(str(tmp_path / "root"))
    store.put_bytes("a", b"1")
    store.put_bytes("step_1/b", b"2")
    store.delete(["a", "step_1/b"])
    assert os.path.isdir(tmp_path / "root") and os.listdir(tmp_path / "root") == []


def test_a_metadata_that_is_not_a_regular_file_is_refused_by_every_committed_check(tmp_path):
    from dcp_datastates.tools.checkpoints import CORRUPT, open_checkpoint

    ckpt = tmp_path / "c"
    save({"w": torch.arange(10.0)}, ckpt)
    assert is_committed_directory(str(ckpt))
    real = tmp_path / "elsewhere"
    real.write_bytes((ckpt / METADATA_FILE).read_bytes())
    (ckpt / METADATA_FILE).unlink()
    (ckpt / METADATA_FILE).symlink_to(real)
    with pytest.raises(CorruptCheckpointError, match="is a symbolic link"):
        is_committed_directory(str(ckpt))
    with pytest.raises(CorruptCheckpointError, match="is a symbolic link"):
        is_committed(LocalStore(str(tmp_path)), "c")
    state, view, why = open_checkpoint(str(ckpt))  # what ls and verify report
    assert state == CORRUPT and view is None and "symbolic link" in why
