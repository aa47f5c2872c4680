"""DCP stream transforms in our writer (``_extensions=[...]``, format 9): any transform DCP's
FileSystemWriter accepts (an encryption, say) is applied to every stored byte, each block of
every tensor chunk and every object, its descriptors recorded in the layout as DCP records
them, and undone on load through DCP's ExtensionRegistry. ZStandard alone keeps the native
zstd frames (tests/test_compression.py)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp

from conftest import assert_same, load, raises_from_checkpoint, save, zeros_like_state
from dcp_datastates import DataStatesReader, DataStatesWriter, UnsupportedFormatError, verify
from dcp_datastates._dcp_compat import zstandard_extension_class
from dcp_datastates.core.compression import codec
from stream_transforms import DESCRIPTOR, Rot13Bytes, registry
from test_reshard_verify import _SliceLoadPlanner

ZStandard = zstandard_extension_class()
MARK = b"plain-text-marker-0123456789"  # appears in the saved state; must not appear on disk


@pytest.fixture
def small_blocks(monkeypatch):
    """4 KiB blocks: the large tensors below are many frames, a slice reads a few."""
    monkeypatch.setattr(codec, "DEFAULT_BLOCK_BYTES", 4096)


def _state() -> dict:
    g = torch.Generator().manual_seed(5)
    return {
        "w": torch.randn(64, 48, generator=g),
        "small": torch.frombuffer(bytearray(MARK * 4), dtype=torch.uint8).clone(),  # small: packed raw with zstd
        "bf16": torch.randn(17, 3, generator=g).to(torch.bfloat16),
        "scalar": torch.tensor(7, dtype=torch.int64),
        "empty": torch.zeros(0),
        "step": 9,
        "meta": {"note": MARK.decode()},
    }


def _stored_bytes(path) -> bytes:
    return b"".join(p.read_bytes() for p in sorted(path.iterdir()) if p.suffix == ".data")


@pytest.mark.parametrize("extensions", [["rot13"], ["zstd", "rot13"]], ids=["rot13", "zstd+rot13"])
def test_every_stored_byte_goes_through_the_transforms_and_loads_bit_exactly(tmp_path, small_blocks, extensions):
    make = {"zstd": ZStandard, "rot13": Rot13Bytes}
    save(_state(), tmp_path / "c", _extensions=[make[name]() for name in extensions])
    ref = _state()
    stored = _stored_bytes(tmp_path / "c")
    assert MARK not in stored and ref["w"].numpy().tobytes()[:64] not in stored  # small tensors and objects too
    reader = DataStatesReader(tmp_path / "c", _extension_registry=registry())
    reader.read_metadata()
    descriptors = (DESCRIPTOR,) if extensions == ["rot13"] else (DESCRIPTOR, "stream.zstd/1")  # as DCP records them
    assert reader.layout.compression == ("stream", 4096, descriptors) and reader.layout.version == 9
    assert_same(load(zeros_like_state(ref), tmp_path / "c", _extension_registry=registry()), ref)
    part = {"w": torch.zeros(9, 48)}  # rows 40..49: a few frames of the 12 KiB chunk
    dcp.load(part, storage_reader=DataStatesReader(tmp_path / "c", _extension_registry=registry()),
             planner=_SliceLoadPlanner(40), no_dist=True)
    assert torch.equal(part["w"], ref["w"][40:49])
    report = verify(tmp_path / "c", reader=DataStatesReader(tmp_path / "c", _extension_registry=registry()))
    assert report.ok, report.summary()


def test_an_asynchronous_save_transforms_too(tmp_path, small_blocks):
    writer = DataStatesWriter(tmp_path / "c", _extensions=[Rot13Bytes()])
    dcp.async_save(_state(), storage_writer=writer, no_dist=True).upload_completion.result()
    writer.close()
    assert MARK not in _stored_bytes(tmp_path / "c")
    assert_same(load(zeros_like_state(_state()), tmp_path / "c", _extension_registry=registry()), _state())


def test_a_reader_without_the_extension_names_it(tmp_path):
    save(_state(), tmp_path / "c", _extensions=[Rot13Bytes()])
    with raises_from_checkpoint((UnsupportedFormatError, AssertionError), match=f"'{DESCRIPTOR}'"):
        load(zeros_like_state(_state()), tmp_path / "c")
    report = verify(tmp_path / "c")
    assert not report.ok and DESCRIPTOR in report.summary()


def test_writer_settings_that_mix_codecs_or_name_nothing_are_refused():
    class Nameless(Rot13Bytes):
        def get_descriptor(self) -> str:
            return ""

    with pytest.raises(ValueError, match="Nameless describes itself"):
        DataStatesWriter("/nonexistent", _extensions=[Nameless()])
    with pytest.raises(ValueError, match="list ZStandard"):
        DataStatesWriter("/nonexistent", compression_level=5, _extensions=[Rot13Bytes()])


@pytest.mark.dist
@pytest.mark.slow
def test_two_ranks_save_through_a_transform_and_one_process_loads_it(tmp_path):
    import dist_helpers as dh
    import stock_workers

    stock_workers.run_ranks("save_dtensor_state_transformed", 2, tmp_path / "logs", path=str(tmp_path / "c"))
    big = max(dh.reference_tensors().values(), key=lambda t: t.nbytes)
    assert big.contiguous().view(torch.uint8).numpy().tobytes()[:64] not in _stored_bytes(tmp_path / "c")
    target = dh.full_targets()
    load(target, tmp_path / "c", _extension_registry=registry())
    dh.assert_equal_exact(target, dh.reference_state())
