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
from dcp_datastates import DataStatesReader, UnsafeCheckpointError, verify
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
