"""Single-process save/load round trips: every dtype and shape, bit-exact."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed.checkpoint as dcp

from conftest import assert_same, data_files, index_files, load, save
from dcp_datastates import DataStatesReader, DataStatesSavePlanner, DataStatesWriter
from dcp_datastates.format.checkpoint_layout import FORMAT_VERSION


def _all_dtypes():
    names = [
        "float64", "float32", "float16", "bfloat16",
        "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu",
        "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
        "bool", "complex64", "complex128", "complex32",
    ]
    return [getattr(torch, n) for n in names if hasattr(torch, n)]


def _random_bits(shape, dtype, gen):
    """A tensor whose bytes are random (any bit pattern, NaNs included)."""
    n = 1
    for s in shape:
        n *= s
    nbytes = n * dtype.itemsize
    raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
    if dtype == torch.bool:
        raw = raw % 2
    return raw.view(dtype).reshape(shape)


def _fresh_like(value):
    if isinstance(value, torch.Tensor):
        return torch.zeros_like(value, memory_format=torch.contiguous_format) if value.dtype != torch.bool else torch.zeros(value.shape, dtype=torch.bool)
    if isinstance(value, dict):
        return {k: _fresh_like(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_fresh_like(v) for v in value]
    return None if not isinstance(value, (int, float, str)) else type(value)()


@pytest.mark.parametrize("dtype", _all_dtypes(), ids=str)
def test_every_dtype_roundtrips_bit_exactly(tmp_path, dtype):
    gen = torch.Generator().manual_seed(1)
    state = {
        "matrix": _random_bits((33, 17), dtype, gen),
        "big": _random_bits((300, 257), dtype, gen),  # above the small-tensor packing threshold for wide dtypes
        "scalar": _random_bits((), dtype, gen),
        "empty": _random_bits((0, 4), dtype, gen),
    }
    save(state, tmp_path / "ckpt")
    out = load({k: torch.zeros(v.shape, dtype=dtype) for k, v in state.items()}, tmp_path / "ckpt")
    assert_same(state, out)


def test_shapes_views_nesting_and_objects(tmp_path):
    base = torch.randn(64, 48)
    state = {
        "transposed": base.t(),  # non-contiguous
        "strided": base[::2, 1::3],  # non-contiguous with offset
        "view_a": base[:10],  # two views of one storage are saved independently
        "view_b": base[5:20],
        "channels_last": torch.randn(2, 3, 5, 7).to(memory_format=torch.channels_last),
        "nested": {"deep": {"w": torch.arange(12).reshape(3, 4), "list": [torch.ones(2), torch.zeros(3)]}},
        "step": 1234,
        "name": "run-α",
        "config": {"lr": 3e-4, "betas": (0.9, 0.95), "tags": ["a", "b"]},
        "scalar": torch.tensor(2.5),
    }
    save(state, tmp_path / "c")
    target = {
        "transposed": torch.zeros(48, 64),
        "strided": torch.zeros(32, 16),
        "view_a": torch.zeros(10, 48),
        "view_b": torch.zeros(15, 48),
        "channels_last": torch.zeros(2, 3, 5, 7),
        "nested": {"deep": {"w": torch.zeros(3, 4, dtype=torch.long), "list": [torch.zeros(2), torch.ones(3)]}},
        "step": 0,
        "name": "",
        "config": {"lr": 0.0, "betas": None, "tags": None},
        "scalar": torch.tensor(0.0),
    }
    load(target, tmp_path / "c")
    expected = dict(state)
    expected["transposed"] = state["transposed"].contiguous()
    expected["strided"] = state["strided"].contiguous()
    expected["channels_last"] = state["channels_last"].contiguous()
    assert_same(expected, target)


def test_load_into_non_contiguous_and_other_dtype_destinations(tmp_path):
    state = {"w": torch.randn(20, 30), "i": torch.arange(50, dtype=torch.int32)}
    save(state, tmp_path / "c")
    holder = torch.zeros(30, 20)
    target = {"w": holder.t(), "i": torch.zeros(50, dtype=torch.int64)}
    load(target, tmp_path / "c")
    assert torch.equal(holder.t(), state["w"])
    assert torch.equal(target["i"], state["i"].to(torch.int64))


def test_one_data_file_per_rank_and_packing_of_small_tensors(tmp_path):
    state = {f"t{i}": torch.full((16,), float(i)) for i in range(500)}
    state["large"] = torch.randn(1 << 16)
    save(state, tmp_path / "c")
    assert len(data_files(tmp_path / "c")) == 1 and len(index_files(tmp_path / "c")) == 1
    size = os.path.getsize(tmp_path / "c" / data_files(tmp_path / "c")[0])
    # 500 x 64 B packed at 64-byte alignment plus one 256 KiB tensor at a page boundary.
    assert size == 32768 + (1 << 18)
    out = load({k: torch.zeros_like(v) for k, v in state.items()}, tmp_path / "c")
    assert_same(state, out)


def test_tensor_larger_than_host_cache_streams_through_it(tmp_path):
    window = 64 << 10
    state = {"huge": torch.randn(1 << 20), "small": torch.randn(3)}  # 4 MiB through a 128 KiB pool
    save(state, tmp_path / "c", host_cache_bytes=2 * window, window_bytes=window)
    out = load({k: torch.zeros_like(v) for k, v in state.items()}, tmp_path / "c")
    assert_same(state, out)


@pytest.mark.parametrize("direct_io", ["auto", "off"])
def test_direct_io_modes(tmp_path, direct_io):
    state = {"w": torch.randn(1000, 100)}
    w = save(state, tmp_path / "c", direct_io=direct_io)
    if direct_io == "off":
        assert not w.last_save_stats.direct_io
    assert_same(state, load({"w": torch.zeros(1000, 100)}, tmp_path / "c"))


def test_direct_io_on_tmpfs_works_or_falls_back():
    """tmpfs accepts O_DIRECT only on recent kernels; auto mode must work either way."""
    path = "/dev/shm"
    if not os.path.isdir(path):
        pytest.skip("no /dev/shm")
    import tempfile

    with tempfile.TemporaryDirectory(dir=path) as d:
        state = {"w": torch.randn(4096), "o": {"x": 1}}
        save(state, os.path.join(d, "c"))
        assert_same(state, load({"w": torch.zeros(4096), "o": {"x": 0}}, os.path.join(d, "c")))


def test_explicit_planner_and_checkpoint_id(tmp_path):
    state = {"a": torch.randn(5, 5), "b": {"c": torch.arange(7)}, "o": "x"}
    dcp.save(state, checkpoint_id=tmp_path / "c", storage_writer=DataStatesWriter(), planner=DataStatesSavePlanner(), no_dist=True)
    target = {"a": torch.zeros(5, 5), "b": {"c": torch.zeros(7, dtype=torch.long)}, "o": ""}
    dcp.load(target, checkpoint_id=tmp_path / "c", storage_reader=DataStatesReader(), no_dist=True)
    assert_same(state, target)


def test_partial_load_of_some_keys(tmp_path):
    state = {"a": torch.randn(4), "b": torch.randn(6)}
    save(state, tmp_path / "c")
    target = {"b": torch.zeros(6)}
    load(target, tmp_path / "c")
    assert torch.equal(target["b"], state["b"])


def test_writer_reused_for_consecutive_checkpoints(tmp_path):
    w = DataStatesWriter()
    for step in range(3):
        state = {"w": torch.full((100,), float(step)), "step": step}
        dcp.save(state, checkpoint_id=tmp_path / f"step{step}", storage_writer=w, no_dist=True)
    for step in range(3):
        target = {"w": torch.zeros(100), "step": -1}
        load(target, tmp_path / f"step{step}")
        assert target["step"] == step and torch.equal(target["w"], torch.full((100,), float(step)))


def test_metadata_is_serialized_while_data_is_written(tmp_path):
    state = {f"w{i}": torch.randn(1 << 18) for i in range(16)}  # 16 MiB: the engine is still busy
    w = save(state, tmp_path / "c")
    st = w.last_save_stats
    assert st.metadata_serialize_s > 0
    assert st.data_write_s > st.submit_s
    assert st.bytes_written >= 16 << 20


def test_metadata_is_dcp_metadata_with_our_layout(tmp_path):
    from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

    from dcp_datastates.format.checkpoint_layout import CheckpointLayout

    save({"w": torch.randn(3, 4), "s": 1}, tmp_path / "c")
    md = DataStatesReader(tmp_path / "c").read_metadata()
    assert isinstance(md, Metadata)
    assert isinstance(md.state_dict_metadata["w"], TensorStorageMetadata)
    assert md.state_dict_metadata["w"].size == torch.Size([3, 4])
    assert isinstance(md.storage_data, CheckpointLayout) and md.storage_data.version == FORMAT_VERSION
