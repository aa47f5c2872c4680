"""Untrusted checkpoints: loading one must not run code unless the user allows pickles.

``.metadata`` is read by a restricted unpickler (DCP's metadata types only),
and saved Python objects must load with ``torch.load(weights_only=True)``.
``DataStatesReader(path, allow_pickle=True)`` lifts both for trusted
checkpoints; ``torch.serialization.add_safe_globals`` admits single classes.
"""

from __future__ import annotations

import dataclasses
import os
import pickle

import pytest
import torch

from conftest import assert_same, load, raises_from_checkpoint, save
from dcp_datastates import CheckpointManagerOptions, DataStatesReader, UnsafeCheckpointError, verify
from dcp_datastates.format.metadata_file import encode_metadata


@dataclasses.dataclass
class RunInfo:
    """A user class saved as a state-dict object (module-level so it pickles)."""

    name: str
    epoch: int


class _RunsCommand:
    """A pickle that runs a shell command when unpickled (the attack safe mode stops)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_plain_objects_load_in_safe_mode(tmp_path):
    state = {"w": torch.arange(6.0), "step": 3, "cfg": {"lr": 0.1, "tags": ["a", b"b", None, (1, 2.5)]}}
    save(state, tmp_path / "c")
    out = load({"w": torch.zeros(6), "step": None, "cfg": {"lr": None, "tags": None}}, tmp_path / "c")
    assert_same(out, state)


def test_custom_class_object_is_refused_by_default_and_named(tmp_path):
    state = {"w": torch.arange(6.0), "info": RunInfo("run", 4)}
    save(state, tmp_path / "c")
    with raises_from_checkpoint(UnsafeCheckpointError, match="'info'") as info:
        load({"w": torch.zeros(6), "info": None}, tmp_path / "c")
    assert "RunInfo" in str(info.value) and "allow_pickle=True" in str(info.value)
    # trusted: allow pickles
    out = load({"w": torch.zeros(6), "info": None}, tmp_path / "c", allow_pickle=True)
    assert out["info"] == RunInfo("run", 4)


def test_add_safe_globals_admits_one_class(tmp_path):
    save({"info": RunInfo("run", 4)}, tmp_path / "c")
    with torch.serialization.safe_globals([RunInfo]):
        out = load({"info": None}, tmp_path / "c")
    assert out["info"] == RunInfo("run", 4)


def test_object_that_runs_code_is_never_run(tmp_path):
    marker = tmp_path / "pwned"
    save({"w": torch.zeros(2), "evil": _RunsCommand(marker)}, tmp_path / "c")
    assert not marker.exists()
    with raises_from_checkpoint(UnsafeCheckpointError, match="'evil'") as info:
        load({"w": torch.zeros(2), "evil": None}, tmp_path / "c")
    assert "system" in str(info.value)  # the global it asked for is named
    assert not marker.exists()


def _hostile_metadata(ckpt, marker):
    """Replace the checkpoint's .metadata with one whose pickle runs a command (checksum intact)."""
    md = DataStatesReader(ckpt).read_metadata()
    md.planner_data = {"x": _RunsCommand(marker)}
    (ckpt / ".metadata").write_bytes(encode_metadata(md))


def test_hostile_metadata_is_refused_and_not_run(tmp_path):
    ckpt, marker = tmp_path / "c", tmp_path / "pwned"
    save({"w": torch.arange(3.0)}, ckpt)
    _hostile_metadata(ckpt, marker)
    with pytest.raises(UnsafeCheckpointError, match="system") as info:
        DataStatesReader(ckpt).read_metadata()
    assert str(ckpt / ".metadata") in str(info.value)
    with raises_from_checkpoint((UnsafeCheckpointError, AssertionError), match="allow_pickle=True"):
        load({"w": torch.zeros(3)}, ckpt)
    report = verify(ckpt)
    assert not report.ok and "system" in report.problems[0]
    assert not marker.exists()


def test_overwriting_a_hostile_checkpoint_does_not_run_it(tmp_path):
    ckpt, marker = tmp_path / "c", tmp_path / "pwned"
    save({"w": torch.arange(3.0)}, ckpt)
    _hostile_metadata(ckpt, marker)
    state = {"w": torch.arange(4.0)}
    save(state, ckpt, overwrite=True)  # the writer reads the old .metadata to find its files
    assert not marker.exists()
    assert_same(load({"w": torch.zeros(4)}, ckpt), state)


@pytest.mark.parametrize(
    "module,name",
    [("builtins", "eval"), ("os", "system"), ("subprocess", "Popen"), ("torch", "load"), ("torch", "tensor")],
)
def test_only_metadata_types_are_admitted(tmp_path, module, name):
    ckpt = tmp_path / "c"
    save({"w": torch.arange(3.0)}, ckpt)
    # A pickle naming the global, appended to a valid Metadata (checksum recomputed).
    blob = b"\x80\x04c" + f"{module}\n{name}\n".encode() + b"."
    (ckpt / ".metadata").write_bytes(_with_trailer(blob))
    with pytest.raises(UnsafeCheckpointError, match=f"{module}.{name}"):
        DataStatesReader(ckpt).read_metadata()


def _with_trailer(pickled: bytes) -> bytes:
    """A hostile pickle with a valid trailer and no plain record: read through the safe unpickler."""
    from dcp_datastates.format.metadata_file import encode_trailer

    return pickled + encode_trailer(pickled)


def test_metadata_stays_readable_by_dcps_plain_pickle(tmp_path):
    save({"w": torch.arange(3.0)}, tmp_path / "c")
    with open(tmp_path / "c" / ".metadata", "rb") as f:
        md = pickle.load(f)  # what DCP's own tools do; the trailer after the pickle is ignored
    assert "w" in md.state_dict_metadata


# -- regressions from the review of safe mode ------------------------------------------------


def _checksummed(pickled: bytes, ckpt):
    (ckpt / ".metadata").write_bytes(_with_trailer(pickled))


def test_build_on_an_allowed_global_is_refused(tmp_path):
    # GLOBAL _MEM_FORMAT_ENCODING; REDUCE(0) -> the enum member; BUILD {'_value_': 99}
    # would change the member for the whole process (every later save unreadable).
    from dcp_datastates._dcp_compat import allowed_private_globals

    mem_format_encoding, get_layout = allowed_private_globals()

    ckpt = tmp_path / "c"
    save({"w": torch.arange(3.0)}, ckpt)
    payload = (
        b"\x80\x04ctorch.distributed.checkpoint.metadata\n_MEM_FORMAT_ENCODING\n"
        b"K\x00\x85R}\x8c\x07_value_Kcsb."
    )
    _checksummed(payload, ckpt)
    with pytest.raises(UnsafeCheckpointError, match="sets the state"):
        DataStatesReader(ckpt).read_metadata()
    assert mem_format_encoding.TORCH_CONTIGUOUS_FORMAT.value == 0
    # a function's __dict__ is refused the same way
    _checksummed(b"\x80\x04ctorch.serialization\n_get_layout\n}\x8c\x01xK\x01sb.", ckpt)
    with pytest.raises(UnsafeCheckpointError, match="function"):
        DataStatesReader(ckpt).read_metadata()
    assert "x" not in get_layout.__dict__


def test_huge_memo_index_does_not_allocate(tmp_path):
    ckpt = tmp_path / "c"
    save({"w": torch.arange(3.0)}, ckpt)
    _checksummed(b"\x80\x02Nr\xff\xff\xff\xff.", ckpt)  # LONG_BINPUT 2**32-1: a 64 GiB memo in C
    with open("/proc/self/statm") as f:
        before = int(f.read().split()[1])
    with pytest.raises(Exception) as info:
        DataStatesReader(ckpt).read_metadata()
    assert "not DCP Metadata" in str(info.value)
    with open("/proc/self/statm") as f:
        grown = (int(f.read().split()[1]) - before) * os.sysconf("SC_PAGE_SIZE")
    assert grown < 64 << 20


def test_overwrite_never_deletes_a_file_the_old_metadata_names_outside(tmp_path):
    from dcp_datastates.format.checkpoint_layout import RankFiles

    ckpt, precious = tmp_path / "c", tmp_path / "precious.txt"
    precious.write_text("keep me")
    save({"w": torch.arange(3.0)}, ckpt)
    md = DataStatesReader(ckpt).read_metadata()
    md.storage_data.ranks.append(RankFiles(7, str(precious), "../precious.txt"))
    (ckpt / ".metadata").write_bytes(encode_metadata(md))
    save({"w": torch.arange(4.0)}, ckpt, overwrite=True)
    assert precious.read_text() == "keep me"


@pytest.mark.parametrize("kind", ["symlink to /dev/zero", "fifo", "symlink to a file"])
@pytest.mark.parametrize("which", [".metadata", ".index", ".data"])
def test_checkpoint_files_must_be_regular_files(tmp_path, kind, which):
    from conftest import data_files, index_files

    ckpt = tmp_path / "c"
    state = {"w": torch.arange(300.0)}
    save(state, ckpt)
    name = {".metadata": ".metadata", ".index": index_files(ckpt)[0], ".data": data_files(ckpt)[0]}[which]
    victim = ckpt / name
    copy = tmp_path / "elsewhere"
    copy.write_bytes(victim.read_bytes())
    victim.unlink()
    if kind == "fifo":
        os.mkfifo(victim)
    else:
        victim.symlink_to("/dev/zero" if "zero" in kind else copy)
    with raises_from_checkpoint((Exception,), match="regular file") as info:
        load({"w": torch.zeros(300)}, ckpt)
    assert name in str(info.value) or "symbolic link" in str(info.value)
    assert not verify(ckpt).ok


def test_chunks_that_do_not_cover_the_tensor_are_refused(tmp_path):
    ckpt = tmp_path / "c"
    save({"w": torch.arange(16.0)}, ckpt)
    md = DataStatesReader(ckpt).read_metadata()
    md.state_dict_metadata["w"].chunks = []
    (ckpt / ".metadata").write_bytes(encode_metadata(md))
    with pytest.raises(Exception, match="hold 0 elements of its 16"):
        DataStatesReader(ckpt).read_metadata()


def _hostile_step(root, marker):
    """A manager root with steps 10 and 20, the newest one's .metadata hostile."""
    from dcp_datastates import CheckpointManager

    with CheckpointManager(root, CheckpointManagerOptions(keep_last=None, async_save=False)) as mgr:
        for step in (10, 20):
            mgr.save(step, {"w": torch.full((3,), float(step))})
    _hostile_metadata(root / "step_00000020", marker)


@pytest.mark.parametrize("step", [None, 20], ids=["resume", "explicit"])
def test_the_manager_raises_unsafe_checkpoint_error_for_a_hostile_metadata(tmp_path, step):
    """Neither skipped (an older step would hide it) nor a plain CheckpointError: the type
    docs/manager.md tells users to catch."""
    from dcp_datastates import CheckpointManager

    root, marker = tmp_path / "run", tmp_path / "pwned"
    _hostile_step(root, marker)
    mgr = CheckpointManager(root, CheckpointManagerOptions(keep_last=None, async_save=False))
    with pytest.raises(UnsafeCheckpointError, match="system"):
        mgr.load({"w": torch.zeros(3)}, step)
    mgr.close()
    assert not marker.exists()


@pytest.mark.dist
@pytest.mark.slow
def test_every_rank_raises_unsafe_checkpoint_error_for_a_hostile_metadata(tmp_path):
    """Two gloo ranks: the verdict travels between ranks pickled, and still says 'raise, unsafe'."""
    from manager_workers import run_ranks

    root, marker = tmp_path / "run", tmp_path / "pwned"
    _hostile_step(root, marker)
    run_ranks("manager_hostile_metadata_raises", 2, tmp_path / "logs", root=str(root))
    assert not marker.exists()


@pytest.mark.parametrize(
    "size, why",
    [
        ([2**62, 64], "which no torch.float32 tensor can have"),  # more bytes than int64 counts
        ([2**63, 1], "which no torch.float32 tensor can have"),  # a dimension past int64
        ([32], "has 64 stored bytes"),  # fits torch, disagrees with the stored entry
    ],
    ids=["bytes-overflow", "dim-overflow", "stored-length"],
)
def test_a_size_torch_cannot_hold_or_the_stored_bytes_contradict_is_refused_when_decoded(tmp_path, size, why):
    """Refused with CorruptCheckpointError naming the file and key when the .metadata is decoded,
    not by DCP's 'Size mismatch' or torch's bare overflow deep inside the load."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    from dcp_datastates.errors import CorruptCheckpointError

    ckpt = tmp_path / "c"
    save({"w": torch.arange(16.0)}, ckpt)
    md = DataStatesReader(ckpt).read_metadata()
    item = md.state_dict_metadata["w"]
    item.size = torch.Size(size)
    item.chunks = [ChunkStorageMetadata(offsets=torch.Size([0] * len(size)), sizes=torch.Size(size))]
    if len(size) == 2:  # the entry is keyed by the chunk's offsets
        layout = md.storage_data
        layout.entries = [(e[0], (0, 0), *e[2:]) if e[0] == "w" else e for e in layout.entries]
        layout.__dict__.pop("_table", None)
    (ckpt / ".metadata").write_bytes(encode_metadata(md))
    with pytest.raises(CorruptCheckpointError, match=why) as info:
        DataStatesReader(ckpt).read_metadata()
    assert str(ckpt / ".metadata") in str(info.value) and "'w'" in str(info.value)
    with raises_from_checkpoint((CorruptCheckpointError, AssertionError), match=why):  # DCP's wrapper on 2.13
        load({"w": torch.zeros(16)}, ckpt)
    assert not verify(ckpt).ok
