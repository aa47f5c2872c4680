"""Compressed checkpoints: ``DataStatesWriter(compression="zstd")`` / ``_extensions=[ZStandard()]``,
their loads (every dtype, resharding, objects), verify and the command-line tools, asynchronous
saves, and stock DCP checkpoints written with ``FileSystemWriter(_extensions=[ZStandard()])``."""

from __future__ import annotations

import contextlib
import copy
import io
import os
import pickle
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp

import cli_checkpoints
import dist_helpers
from conftest import assert_same, load, raises_from_checkpoint, save
from dcp_datastates import (
    ChecksumMismatchError,
    CorruptCheckpointError,
    DataStatesReader,
    DataStatesSavePlanner,
    DataStatesWriter,
    verify,
)
from dcp_datastates.core.compression import codec
from dcp_datastates.tools import cli
from dcp_datastates.tools.checkpoint_view import CheckpointView
from dcp_datastates.format.checkpoint_layout import CheckpointLayout

zstandard = pytest.importorskip("zstandard")
from dcp_datastates._dcp_compat import stream_transform_extension_class, zstandard_extension_class  # noqa: E402

pytestmark = [pytest.mark.dist, pytest.mark.slow]

StreamTransformExtension, ZStandard = stream_transform_extension_class(), zstandard_extension_class()



@pytest.fixture
def small_blocks(monkeypatch):
    """4 KiB blocks: every large tensor of the test states is several frames."""
    monkeypatch.setattr(codec, "DEFAULT_BLOCK_BYTES", 4096)


def zeros_like(state):
    if isinstance(state, torch.Tensor):
        return torch.zeros_like(state)
    if isinstance(state, dict):
        return {k: zeros_like(v) for k, v in state.items()}
    if isinstance(state, list):
        return [zeros_like(v) for v in state]
    if isinstance(state, str):
        return ""
    if isinstance(state, (int, float)):
        return type(state)()
    return state


def compressible_state() -> dict:
    """Every dtype (cli_checkpoints), plus large tensors: structured ones that compress well,
    random ones that barely do, a large object, and a non-contiguous large view."""
    state = cli_checkpoints.dtype_state()
    g = torch.Generator().manual_seed(5)
    state["big"] = {
        "ramp": torch.arange(50_000, dtype=torch.float32).reshape(500, 100),
        "noise_bf16": torch.randn(300, 301, generator=g).to(torch.bfloat16),
        "wide_t": torch.randn(200, 150, generator=g, dtype=torch.float64).t(),
        "sparse_i64": torch.zeros(20_000, dtype=torch.int64).index_fill_(0, torch.arange(0, 20_000, 97), 3),
    }
    state["blob"] = {"text": "x" * 200_000, "list": list(range(5000))}
    return state


def layout_of(path) -> CheckpointLayout:
    return CheckpointView(path).reader.layout


def data_bytes(path) -> int:
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".data"))


@pytest.mark.parametrize("how", ["compression", "extension", "level1"])
def test_every_dtype_round_trip_bit_exact(tmp_path, small_blocks, how):
    state = compressible_state()
    ref = copy.deepcopy(state)
    kwargs = {
        "compression": {"compression": "zstd"},
        "extension": {"_extensions": [ZStandard()]},
        "level1": {"compression": "zstd", "compression_level": 1},
    }[how]
    save(state, tmp_path / "c", **kwargs)
    assert_same(state, ref)  # the caller's state is untouched
    layout = layout_of(tmp_path / "c")
    assert layout.compression == ("zstd", 4096)
    stored = {e[0]: e for e in layout.entries}
    assert stored["big.ramp"][3] == -1 and stored["big.ramp"][5] >= 0  # compressed: blocks in the object table
    assert stored["model.float.f32"][5] == -1  # small tensors stay raw and packed
    target = zeros_like(ref)
    load(target, tmp_path / "c")
    assert_same(target, ref)
    assert verify(tmp_path / "c").ok


def test_compressed_is_smaller_and_reported_by_inspect(tmp_path, small_blocks):
    state = compressible_state()["big"]
    save(state, tmp_path / "raw")
    save(state, tmp_path / "z", compression="zstd")
    assert data_bytes(tmp_path / "z") < 0.75 * data_bytes(tmp_path / "raw")
    view = CheckpointView(tmp_path / "z")
    (chunk,) = view.stored_chunks("ramp")
    assert chunk.offset == -1 and 0 < chunk.length < 200_000  # the frames' bytes, not the raw 200 KB


def test_objects_round_trip_with_and_without_compression(tmp_path):
    state = {"w": torch.randn(300, 300), "obj": {"a": [1, 2, 3], "s": "y" * 100_000}, "n": 7}
    for name, kwargs in (("raw", {}), ("z", {"compression": "zstd"})):
        save(copy.deepcopy(state), tmp_path / name, **kwargs)
        target = {"w": torch.zeros(300, 300), "obj": {"a": [], "s": ""}, "n": 0}
        load(target, tmp_path / name)
        assert_same(target, state)


def test_planner_layout_is_replaced_by_a_compressed_one(tmp_path):
    state = {"w": torch.zeros(100_000).index_fill_(0, torch.arange(0, 100_000, 7), 2.5), "b": torch.ones(3)}
    writer = DataStatesWriter(tmp_path / "c", compression="zstd")
    dcp.save(state, storage_writer=writer, planner=DataStatesSavePlanner(), no_dist=True)
    assert layout_of(tmp_path / "c").compression is not None
    assert data_bytes(tmp_path / "c") < 100_000
    target = {"w": torch.zeros(100_000), "b": torch.zeros(3)}
    load(target, tmp_path / "c")
    assert_same(target, state)


class _Rot13(StreamTransformExtension):
    @staticmethod
    def registry_name() -> str:
        return "stream.rot13"

    @staticmethod
    def from_descriptor(version: str):
        return _Rot13()

    def get_descriptor(self) -> str:
        return "stream.rot13/1"

    def transform_to(self, output):
        return output

    def transform_from(self, input):
        return input


def _extension_base_class():
    """DCP's base ``_extension.Extension`` (a kind of extension that is not a stream transform)."""
    return StreamTransformExtension.__mro__[1]


def test_unknown_extension_and_bad_arguments_are_refused():
    """Any DCP stream transform is accepted (tests/test_stream_transforms.py); another kind of
    extension is refused by name, and so is zstd asked for twice over a transform."""

    class _Layout(_extension_base_class()):
        registry_name = staticmethod(lambda: "layout.x")
        from_descriptor = staticmethod(lambda version: _Layout())
        get_descriptor = lambda self: "layout.x/1"  # noqa: E731

    with pytest.raises(ValueError, match="extension _Layout: only stream transforms"):
        DataStatesWriter("/nonexistent", _extensions=[_Layout()])
    with pytest.raises(ValueError, match="list ZStandard"):
        DataStatesWriter("/nonexistent", compression="zstd", _extensions=[_Rot13()])
    with pytest.raises(ValueError, match="compression must be"):
        DataStatesWriter("/nonexistent", compression="lz4")
    with pytest.raises(ValueError, match="compression_level"):
        DataStatesWriter("/nonexistent", compression_level=3)
    with pytest.raises(ValueError, match="compression_level"):
        DataStatesWriter("/nonexistent", compression="zstd", compression_level=99)


def test_without_zstandard_a_clear_import_error(tmp_path, monkeypatch):
    save({"w": torch.arange(30_000.0)}, tmp_path / "c", compression="zstd")
    monkeypatch.setitem(sys.modules, "zstandard", None)  # import zstandard now fails
    with pytest.raises(ImportError, match=r"dcp_datastates\[zstd\]"):
        DataStatesWriter(tmp_path / "d", compression="zstd")
    with raises_from_checkpoint(ImportError, match="dcp_datastates[zstd]"):
        load({"w": torch.zeros(30_000)}, tmp_path / "c")
    report = verify(tmp_path / "c")
    assert report.ok and any("not decompressed" in n for n in report.notes)


def test_old_layout_pickles_get_no_compression():
    layout = CheckpointLayout("dcp_datastates", 3, "0123456789ab", [], [])
    state = layout.__getstate__()
    del state["compression"]  # what versions 1-3 pickled
    restored = CheckpointLayout.__new__(CheckpointLayout)
    restored.__setstate__(state)
    assert restored.compression is None
    restored.validate("x")
    assert pickle.loads(pickle.dumps(layout)).compression is None


def test_corrupt_frame_fails_load_and_verify(tmp_path, small_blocks):
    state = {"w": torch.arange(40_000, dtype=torch.float32)}
    save(state, tmp_path / "c", compression="zstd")
    view = CheckpointView(tmp_path / "c")
    layout = view.reader.layout
    (_, _, _, _, _, first), = layout.entries
    rel = layout.ranks[0].data_file
    offset, length = view.reader.rank_index(rel).objects[first + 2]
    with open(tmp_path / "c" / rel, "r+b") as f:
        f.seek(offset + length // 2)
        byte = f.read(1)
        f.seek(offset + length // 2)
        f.write(bytes([byte[0] ^ 0x40]))
    report = verify(tmp_path / "c")
    assert not report.ok and any("'w'" in p for p in report.problems)
    with raises_from_checkpoint(ChecksumMismatchError, match="'w'"):
        load({"w": torch.zeros(40_000)}, tmp_path / "c")


def test_decompress_checks_the_frame_size():
    blob = zstandard.ZstdCompressor().compress(b"a" * 1000)
    assert codec.decompress_block(blob, 1000, "here") == b"a" * 1000
    with pytest.raises(CorruptCheckpointError, match="holds 1000 bytes, 999 expected"):
        codec.decompress_block(blob, 999, "here")
    with pytest.raises(CorruptCheckpointError, match="not a zstd frame"):
        codec.decompress_block(b"garbage!" * 4, 1000, "here")


def test_resharded_slices_from_compressed_blocks(tmp_path, small_blocks):
    """Dim-1 slices of a multi-frame chunk (bounding ranges that start and end inside frames)."""
    full = torch.randn(64, 48, dtype=torch.float64)
    save({"m": full.clone()}, tmp_path / "c", compression="zstd")
    view = CheckpointView(tmp_path / "c")
    for offsets, sizes in (((3, 5), (40, 17)), ((0, 0), (64, 48)), ((63, 47), (1, 1)), ((10, 0), (9, 48))):
        got = view.read_block("m", offsets, sizes)
        want = full[offsets[0] : offsets[0] + sizes[0], offsets[1] : offsets[1] + sizes[1]]
        assert torch.equal(got, want), (offsets, sizes)


def test_block_span_and_chunk_frames():
    from dcp_datastates.core.compression.read import block_span, chunk_frames, frames_past_table

    assert block_span(0, 10_000, 10_000, 4096) == (0, 10_000)
    assert block_span(4096, 8192, 10_000, 4096) == (4096, 8192)
    assert block_span(5000, 5001, 10_000, 4096) == (4096, 8192)
    assert block_span(8200, 9000, 10_000, 4096) == (8192, 10_000)  # the last block is short
    objects = [(0, 1), (64, 10), (128, 20), (192, 30), (256, 40)]  # an object, then 3 frames, then one more
    assert list(chunk_frames(objects, 1, 10_000, 4096)) == [(0, 64, 10, 4096), (1, 128, 20, 4096), (2, 192, 30, 1808)]
    assert list(chunk_frames(objects, 1, 10_000, 4096, 4096, 8192)) == [(1, 128, 20, 4096)]
    assert frames_past_table("w", 1, 10_000, 4096, 5) is None
    assert frames_past_table("w", 3, 10_000, 4096, 5) == "'w' is stored as blocks 3..5 of an object table with 5 entries"


def test_block_aligned_slices_decompress_in_place(tmp_path, small_blocks, monkeypatch):
    """A slice of whole blocks (or up to the chunk's end) is decompressed straight into its
    destination; any other slice goes through a temporary."""
    from dcp_datastates.core import read_batch

    copies = []
    copy_box_out = read_batch.copy_box_out
    monkeypatch.setattr(read_batch, "copy_box_out", lambda *a: copies.append(a) or copy_box_out(*a))
    full = torch.randn(40_000)  # 160,000 bytes: 40 blocks of 4 KiB
    save({"v": full.clone()}, tmp_path / "c", compression="zstd")
    view = CheckpointView(tmp_path / "c")
    for offset, size, in_place in ((2048, 4096, True), (37_888, 2112, True), (0, 40_000, True), (1000, 3000, False)):
        copies.clear()
        assert torch.equal(view.read_block("v", (offset,), (size,)), full[offset : offset + size]), (offset, size)
        assert not copies if in_place else copies, (offset, size)


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_two_ranks_save_compressed_loads_on_one_and_two(tmp_path, asynchronous):
    path = tmp_path / "c"
    _worker_cases().run_ranks("save_compressed", 2, tmp_path / "logs", path=str(path), asynchronous=asynchronous)
    assert layout_of(path).compression == ("zstd", 4096)
    assert not [f for f in os.listdir(path) if f.endswith(".data") and f.split(".")[0] not in _named(path)]
    targets = dist_helpers.full_targets()
    dcp.load(targets, storage_reader=DataStatesReader(path), no_dist=True)  # 2 ranks -> 1 process
    dist_helpers.assert_equal_exact(targets, dist_helpers.reference_state())
    _worker_cases().run_ranks("load_compressed_resharded", 2, tmp_path / "logs", path=str(path))
    assert verify(path).ok


def _worker_cases():
    import compression_workers

    return compression_workers.CASES


def _named(path) -> set:
    layout = layout_of(path)
    return {r.data_file.split(".")[0] for r in layout.ranks}


def test_async_save_compresses_after_staging_and_removes_the_staging_file(tmp_path, small_blocks):
    state = compressible_state()
    ref = copy.deepcopy(state)
    with DataStatesWriter(tmp_path / "c", compression="zstd", host_cache_bytes=1 << 20, window_bytes=256 << 10) as w:
        resp = dcp.async_save(state, storage_writer=w, no_dist=True)
        resp.staging_completion.result()
        for t in cli_checkpoints.flatten(state).values():  # the snapshot has been taken: mutate freely
            if isinstance(t, torch.Tensor) and t.dtype in (torch.float32, torch.float64, torch.bfloat16):
                t.add_(1)
        resp.upload_completion.result()
    files = sorted(os.listdir(tmp_path / "c"))
    assert len([f for f in files if f.endswith(".data")]) == 1, files  # the staging file is gone
    assert layout_of(tmp_path / "c").compression == ("zstd", 4096)
    target = zeros_like(ref)
    load(target, tmp_path / "c")
    assert_same(target, ref)
    assert verify(tmp_path / "c").ok


def test_async_save_failure_removes_the_staging_file(tmp_path):
    state = {"w": torch.arange(100_000, dtype=torch.float32)}
    w = DataStatesWriter(tmp_path / "c", compression="zstd")
    resp = dcp.async_save(state, storage_writer=w, no_dist=True)
    state["w"].add_(1)  # mutated before the staging completed: the save must fail, leaving nothing
    with contextlib.suppress(BaseException):
        resp.upload_completion.result()
    with contextlib.suppress(Exception):
        w.close()
    if not os.path.exists(tmp_path / "c" / ".metadata"):
        assert [f for f in os.listdir(tmp_path / "c") if f.endswith((".data", ".index"))] == []


def run_cli(*argv) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        rc = cli.run([str(a) for a in argv])
    return rc, out.getvalue()


def test_cli_tools_on_a_compressed_checkpoint(tmp_path, small_blocks):
    state = compressible_state()
    ref = copy.deepcopy(state)
    save(state, tmp_path / "c", compression="zstd")
    rc, text = run_cli("inspect", tmp_path / "c", "--chunks")
    assert rc == 0 and "big.ramp" in text
    rc, text = run_cli("verify", tmp_path / "c")
    assert rc == 0 and text.startswith("OK"), text
    rc, text = run_cli("convert", tmp_path / "c", "--to", "datastates", tmp_path / "ours", "--quiet")
    assert rc == 0, text
    target = zeros_like(ref)
    load(target, tmp_path / "ours")
    assert_same(target, ref)
    rc, text = run_cli("convert", tmp_path / "c", "--to", "dcp", tmp_path / "stock", "--quiet")
    assert rc == 0, text
    target = zeros_like(ref)
    dcp.load(target, storage_reader=dcp.FileSystemReader(tmp_path / "stock"), no_dist=True)
    assert_same(target, ref)
    pytest.importorskip("h5py")
    rc, text = run_cli("export", tmp_path / "c", "--format", "hdf5", "-o", tmp_path / "x.h5", "--quiet")
    assert rc == 0, text
    import h5py

    with h5py.File(tmp_path / "x.h5") as f:
        names = []
        f.visit(names.append)
        ramp = next(n for n in names if n.endswith("ramp") and isinstance(f[n], h5py.Dataset))
        assert (f[ramp][...].reshape(-1)[-50_000:] == ref["big"]["ramp"].numpy().reshape(-1)).all()


def test_stock_dcp_zstd_checkpoint_through_our_tools(tmp_path):
    """A real stock checkpoint: FileSystemWriter(_extensions=[ZStandard()])."""
    state = compressible_state()
    ref = copy.deepcopy(state)
    dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp_path / "stock", _extensions=[ZStandard()]), no_dist=True)
    md = dcp.FileSystemReader(tmp_path / "stock").read_metadata()
    assert all(info.transform_descriptors == ["stream.zstd/1"] for info in md.storage_data.values())
    view = CheckpointView(tmp_path / "stock")
    assert torch.equal(view.read_block("big.ramp", (7, 3), (20, 50)), ref["big"]["ramp"][7:27, 3:53])
    rc, text = run_cli("inspect", tmp_path / "stock")
    assert rc == 0 and "stock DCP" in text
    rc, text = run_cli("verify", tmp_path / "stock")
    assert rc == 1 and "NOT VERIFIED" in text  # stock DCP has no checksums, but it is read and recognised
    rc, text = run_cli("convert", tmp_path / "stock", "--to", "datastates", tmp_path / "ours", "--quiet")
    assert rc == 0, text
    target = zeros_like(ref)
    load(target, tmp_path / "ours")
    assert_same(target, ref)
    pytest.importorskip("h5py")
    rc, text = run_cli("export", tmp_path / "stock", "--format", "hdf5", "-o", tmp_path / "x.h5", "--quiet")
    assert rc == 0, text


def test_stock_zstd_checkpoint_without_zstandard_names_the_extra(tmp_path, monkeypatch):
    dcp.save({"w": torch.arange(1000.0)}, storage_writer=dcp.FileSystemWriter(tmp_path / "s", _extensions=[ZStandard()]),
             no_dist=True)
    from dcp_datastates import UnsupportedFormatError

    extension = sys.modules["torch.distributed.checkpoint._extension"]  # where DCP's ZStandard looks
    monkeypatch.setattr(extension, "zstandard", None)
    monkeypatch.setattr(extension, "pyzstd", None)
    with pytest.raises(UnsupportedFormatError, match=r"'stream.zstd/1'.*dcp_datastates\[zstd\]"):
        CheckpointView(tmp_path / "s")


def test_unknown_codec_in_a_layout_is_refused():
    from dcp_datastates import UnsupportedFormatError

    layout = CheckpointLayout("dcp_datastates", 4, "0123456789ab", [], [], ("lz77", 4096))
    with pytest.raises(UnsupportedFormatError, match="'lz77'"):
        layout.validate("ckpt/.metadata")


@pytest.mark.parametrize("block_bytes", [4100, 4096 + 8, 0, 2 << 30])
def test_block_sizes_that_would_split_elements_are_refused(block_bytes):
    """A block size that is not a multiple of 64 would cut elements of wider dtypes in two,
    and a slice read through such blocks would fail (or be misread) far from the cause."""
    from dcp_datastates.errors import CorruptCheckpointError

    with pytest.raises(ValueError, match="multiple of 64"):
        codec.resolve_compression("zstd", None, None, block_bytes=block_bytes)
    layout = CheckpointLayout("dcp_datastates", 4, "0123456789ab", [], [], ("zstd", block_bytes))
    with pytest.raises(CorruptCheckpointError, match="compression block size"):
        layout.validate("ckpt/.metadata")


MEMORY_SCRIPT = r"""
import json, sys, warnings
warnings.filterwarnings("ignore")
import torch, torch.distributed.checkpoint as dcp
from dcp_datastates import DataStatesReader, DataStatesWriter
path, n, cache = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
def status(field):
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith(field + ":"))
state = {f"t{i}": torch.arange(n // 8 // 4, dtype=torch.float32).remainder_(97).add_(i) for i in range(8)}
writer = DataStatesWriter(path, host_cache_bytes=cache, compression="zstd", compression_level=1)
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
before = status("VmRSS")
resp = dcp.async_save(state, storage_writer=writer, no_dist=True)
resp.staging_completion.result(); resp.upload_completion.result(); writer.close()
peak = status("VmHWM")
ref = {k: v.clone() for k, v in state.items()}
for t in state.values():
    t.zero_()
dcp.load(state, storage_reader=DataStatesReader(path), no_dist=True)
print(json.dumps({"before": before, "peak": peak, "exact": all(torch.equal(state[k], ref[k]) for k in ref)}))
"""


def test_async_compressed_save_memory_stays_within_the_cache(tmp_path):
    import json
    import subprocess

    if not os.path.exists("/proc/self/clear_refs"):
        pytest.skip("needs Linux /proc to reset the peak RSS")
    MiB = 1 << 20
    out = subprocess.run([sys.executable, "-c", MEMORY_SCRIPT, str(tmp_path / "c"), str(1024 * MiB), str(64 * MiB)],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["exact"]
    extra = r["peak"] - r["before"]
    # The pool is mapped before; the staging copy, the read-back and the frames in flight are bounded.
    assert extra <= 96 * MiB, f"peak RSS grew by {extra / MiB:.0f} MiB during a compressed save of 1 GiB"
