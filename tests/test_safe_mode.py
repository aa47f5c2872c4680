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
from dcp_datastates.metadata_file import encode_metadata


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
    from dcp_datastates._native import crc32c
    from dcp_datastates.metadata_file import _TRAILER, TRAILER_MAGIC

    return pickled + _TRAILER.pack(TRAILER_MAGIC, len(pickled), crc32c(pickled), 0)


def test_metadata_stays_readable_by_dcps_plain_pickle(tmp_path):
    save({"w": torch.arange(3.0)}, tmp_path / "c")
    with open(tmp_path / "c" / ".metadata", "rb") as f:
        md = pickle.load(f)  # what DCP's own tools do; the trailer after the pickle is ignored
    assert "w" in md.state_dict_metadata
