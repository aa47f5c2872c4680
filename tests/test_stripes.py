"""Format 7: a rank's data striped over several files, each written by its own I/O thread."""

from __future__ import annotations

import errno
import os
import re

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from conftest import load, raises_from_checkpoint, save
from dcp_datastates import ChecksumMismatchError, CorruptCheckpointError, DataStatesReader, DataStatesWriter, verify
from dcp_datastates.core.placement import AUTO_STRIPE_MIN_BYTES, PAGE, stripe_starts
from dcp_datastates.format.checkpoint_layout import FORMAT_VERSION, CheckpointLayout
from dcp_datastates.format.file_names import DATA_FILE_RE, stripe_file_name
from dcp_datastates.format.metadata_file import encode_metadata, read_metadata_file
from dcp_datastates.tools.checkpoint_view import CheckpointView

MiB = 1 << 20


def _state(n_big=6, seed=0):
    """Large tensors of several dtypes (one a transposed view: a strided source), small ones, objects."""
    g = torch.Generator().manual_seed(seed)
    state = {f"big{i}": torch.randn(64 + 8 * i, 1024, generator=g) for i in range(n_big)}
    state["half"] = torch.randn(512, 256, generator=g).to(torch.bfloat16)
    state["strided"] = torch.randn(300, 200, generator=g).t()
    state["ints"] = torch.arange(70_000, dtype=torch.int64)
    state["tiny"] = torch.tensor([1.5, 2.5])
    state["step"] = 7
    state["cfg"] = {"lr": 0.1, "name": "run"}
    return state


def _empty_like(state):
    out = {}
    for k, v in state.items():
        if isinstance(v, torch.Tensor):
            out[k] = torch.zeros_like(v.contiguous())
        elif isinstance(v, dict):
            out[k] = {kk: None for kk in v}
        else:
            out[k] = None
    return out


def _assert_equal(got, want):
    for k, v in want.items():
        if isinstance(v, torch.Tensor):
            assert got[k].dtype == v.dtype and torch.equal(got[k], v), k
        else:
            assert got[k] == v, k


def _layout(path) -> CheckpointLayout:
    metadata, _ = read_metadata_file(os.path.join(path, ".metadata"))
    return metadata.storage_data


def test_stripe_starts_cut_at_large_tensors_into_even_parts():
    mb = MiB
    sizes = [100, 200, 4 * mb, 4 * mb, 4 * mb, 4 * mb]
    offsets = [0, 128, 4096, 4096 + 4 * mb, 4096 + 8 * mb, 4096 + 12 * mb]
    end = 4096 + 16 * mb
    assert stripe_starts(sizes, offsets, end, 1, 0) == ()
    assert stripe_starts(sizes, offsets, end, 2, 0) == (4096 + 8 * mb,)
    assert stripe_starts(sizes, offsets, end, 4, 0) == (4096 + 4 * mb, 4096 + 8 * mb, 4096 + 12 * mb)
    assert stripe_starts(sizes, offsets, end, 10, 0) == (4096 + 4 * mb, 4096 + 8 * mb, 4096 + 12 * mb)  # one per large tensor
    assert stripe_starts(sizes, offsets, end, 4, 6 * mb) == (4096 + 8 * mb,)  # at least 6 MiB each
    assert stripe_starts(sizes, offsets, end, 4, 32 * mb) == ()
    assert stripe_starts([100] * 5, [0, 128, 256, 384, 512], 612, 4, 0) == ()  # small tensors are never cut
    # The nearest start to the middle, even where the second tensor is the larger one.
    assert stripe_starts([100, 131072, 160000], [0, 4096, 135168], 295168, 2, 0) == (135168,)
    assert stripe_starts([4 * mb] * 3, [0, 4 * mb, 8 * mb], 12 * mb, 3, 0) == (4 * mb, 8 * mb)
    # Every start is a large tensor's (page-aligned) start, increasing.
    starts = stripe_starts(sizes, offsets, end, 3, 0)
    assert all(s % PAGE == 0 and s in offsets for s in starts) and list(starts) == sorted(set(starts))


def test_a_striped_save_round_trips_bit_exact_and_verifies(tmp_path):
    state = _state()
    path = tmp_path / "c"
    writer = save(state, path, stripes=3)
    layout = _layout(path)
    (rank,) = layout.ranks
    assert len(rank.stripes) == 2 and layout.version == FORMAT_VERSION
    names = sorted(os.listdir(path))
    assert set(rank.data_files()) | {rank.index_file, ".metadata"} == set(names)
    assert rank.data_files()[1:] == [stripe_file_name(rank.data_file, 1), stripe_file_name(rank.data_file, 2)]
    assert all(DATA_FILE_RE.match(n) for n in names if n != ".metadata")
    # Each stripe file holds its share, from offset 0; the last one also holds the objects.
    sizes = [os.path.getsize(path / n) for n in rank.data_files()]
    bounds = [0, *rank.stripes]
    assert sizes[:2] == [bounds[1] - bounds[0], bounds[2] - bounds[1]]
    assert writer.last_save_stats.bytes_written == sum(sizes)
    out = load(_empty_like(state), path)
    _assert_equal(out, {k: (v.contiguous() if isinstance(v, torch.Tensor) else v) for k, v in state.items()})
    report = verify(path)
    assert report.ok and not report.notes, report.problems
    tensor_bytes = sum(v.nbytes for v in state.values() if isinstance(v, torch.Tensor))
    assert tensor_bytes < report.bytes_checked < tensor_bytes + 4096  # every tensor and object byte


def test_inspect_names_each_chunks_stripe_file_and_offset_in_it(tmp_path):
    state = _state()
    save(state, tmp_path / "c", stripes=3)
    rank = _layout(tmp_path / "c").ranks[0]
    view = CheckpointView(str(tmp_path / "c"))
    assert view.files()[1:] == [*rank.data_files(), rank.index_file]
    seen = set()
    for key in (k for k, v in state.items() if isinstance(v, torch.Tensor)):
        (chunk,) = view.stored_chunks(key)
        seen.add(chunk.file)
        # The bytes at that place of that file are the tensor's.
        with open(tmp_path / "c" / chunk.file, "rb") as f:
            f.seek(chunk.offset)
            assert f.read(chunk.length) == state[key].contiguous().view(torch.uint8).numpy().tobytes(), key
    assert seen == set(rank.data_files())
    assert view.stored_chunks("tiny")[0].file == rank.data_file  # small tensors are packed in stripe 0
    assert view.object_location("step")[0] == rank.data_files()[-1]  # objects follow the tensors


def test_automatic_stripes_follow_io_threads_and_a_minimum_size(tmp_path):
    per = AUTO_STRIPE_MIN_BYTES // 4 // 4096  # rows of 1024 float32: a quarter of the minimum each
    state = {f"t{i}": torch.full((per, 1024), float(i)) for i in range(8)}  # two minimums in all
    save(state, tmp_path / "auto")
    assert len(_layout(tmp_path / "auto").ranks[0].stripes) == 1  # io_threads=2: two stripes
    save(state, tmp_path / "one_thread", io_threads=1)
    assert _layout(tmp_path / "one_thread").ranks[0].stripes == ()
    save(state, tmp_path / "off", stripes=1)
    assert _layout(tmp_path / "off").ranks[0].stripes == ()
    save({k: state[k] for k in ("t0", "t1", "t2")}, tmp_path / "small")  # under two minimums
    assert _layout(tmp_path / "small").ranks[0].stripes == ()
    _assert_equal(load({k: torch.zeros_like(v) for k, v in state.items()}, tmp_path / "auto"), state)


@pytest.mark.parametrize("bad", [0, 256, -1, 2.0, True, "2"])
def test_a_bad_stripes_option_is_refused(tmp_path, bad):
    with pytest.raises(ValueError, match="stripes must be None or an integer from 1 to 255"):
        DataStatesWriter(tmp_path, stripes=bad)


def test_a_partial_read_in_a_later_stripe_is_verified(tmp_path):
    """A reshard-like slice of a tensor in stripe 2 is widened to whole segments of that file."""
    from test_reshard_verify import _SliceLoadPlanner

    full = torch.randn(4096, 64)  # 1 MiB: 16 segments of 64 KiB windows
    state = {"a": torch.randn(512, 512), "b": torch.randn(512, 512), "w": full}
    path = tmp_path / "c"
    save(state, path, stripes=3, window_bytes=64 << 10, host_cache_bytes=256 << 10)
    rank = _layout(path).ranks[0]
    assert len(rank.stripes) == 2
    dest = {"w": torch.zeros(100, 64)}
    dcp.load(dest, storage_reader=DataStatesReader(path), planner=_SliceLoadPlanner(1000), no_dist=True)
    assert torch.equal(dest["w"], full[1000:1100])
    # A byte outside the rows read, inside a segment they touch, in stripe 2's file.
    with open(path / rank.data_files()[2], "r+b") as f:
        pos = (1000 * 64 * 4) // (64 << 10) * (64 << 10)
        f.seek(pos)
        b = f.read(1)
        f.seek(pos)
        f.write(bytes([b[0] ^ 1]))
    with raises_from_checkpoint(ChecksumMismatchError, match=rank.data_files()[2]):
        dcp.load({"w": torch.zeros(100, 64)}, storage_reader=DataStatesReader(path),
                 planner=_SliceLoadPlanner(1000), no_dist=True)


def _flip(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x40]))


def test_damage_to_a_stripe_is_found_and_named(tmp_path):
    state = _state()
    path = tmp_path / "c"
    save(state, path, stripes=3)
    rank = _layout(path).ranks[0]
    view = CheckpointView(str(path))
    key, chunk = next(
        (k, c) for k, v in state.items() if isinstance(v, torch.Tensor)
        for c in view.stored_chunks(k) if c.file == rank.data_files()[2]
    )
    _flip(path / chunk.file, chunk.offset + 100)
    with raises_from_checkpoint(ChecksumMismatchError, match=chunk.file):
        load(_empty_like(state), path)
    report = verify(path)
    assert any(chunk.file in p and repr(key) in p for p in report.problems), report.problems
    _flip(path / chunk.file, chunk.offset + 100)  # repaired
    assert verify(path).ok
    # Padding of stripe 1 (after its last tensor, before the stripe ends) must stay zero.
    middle = path / rank.data_files()[1]
    ends = [c.offset + c.length for k in state if isinstance(state[k], torch.Tensor)
            for c in view.stored_chunks(k) if c.file == rank.data_files()[1]]
    if max(ends) < os.path.getsize(middle):
        _flip(middle, max(ends))
        assert any(rank.data_files()[1] in p and "padding" in p for p in verify(path).problems)
        _flip(middle, max(ends))
    # Bytes appended to a middle stripe are found.
    with open(middle, "ab") as f:
        f.write(b"\0" * 10)
    assert any("bytes were appended" in p and rank.data_files()[1] in p for p in verify(path).problems)


def test_a_missing_or_truncated_stripe_is_a_named_error(tmp_path):
    state = _state()
    path = tmp_path / "c"
    save(state, path, stripes=3)
    rank = _layout(path).ranks[0]
    middle = path / rank.data_files()[1]
    os.truncate(middle, os.path.getsize(middle) - 4096)
    with raises_from_checkpoint(CorruptCheckpointError, match=f"{middle} is truncated"):
        load(_empty_like(state), path)
    assert any("truncated" in p for p in verify(path).problems)
    os.unlink(middle)
    with raises_from_checkpoint(CorruptCheckpointError, match=f"data file {middle} is missing"):
        load(_empty_like(state), path)
    assert not verify(path).ok


def _rewrite_layout(path, edit):
    """Re-encode ``.metadata`` with ``edit(layout)`` applied (a hostile or damaged layout)."""
    md_path = os.path.join(path, ".metadata")
    metadata, _ = read_metadata_file(md_path)
    edit(metadata.storage_data)
    blob = encode_metadata(metadata)
    os.chmod(md_path, 0o644)
    with open(md_path, "wb") as f:
        f.write(blob)


@pytest.mark.parametrize(
    "stripes,match",
    [
        ((4096, 4096), "not increasing multiples of 4096"),
        ((100,), "not increasing multiples of 4096"),
        ((0,), "not increasing multiples of 4096"),
        ("x", "has stripes"),
    ],
)
def test_malformed_stripes_in_the_metadata_are_refused(tmp_path, stripes, match):
    save(_state(), tmp_path / "c", stripes=3)

    def edit(layout):
        layout.ranks[0].stripes = stripes

    _rewrite_layout(tmp_path / "c", edit)
    with pytest.raises(CorruptCheckpointError, match=match):
        DataStatesReader(tmp_path / "c").read_metadata()


def test_an_item_crossing_a_stripe_start_is_refused(tmp_path):
    save(_state(), tmp_path / "c", stripes=3)

    def edit(layout):
        r = layout.ranks[0]
        r.stripes = (r.stripes[0] + PAGE, r.stripes[1])  # now inside the tensor that starts stripe 1

    _rewrite_layout(tmp_path / "c", edit)
    with pytest.raises(CorruptCheckpointError, match="crosses the start of rank 0's stripe 1"):
        DataStatesReader(tmp_path / "c").read_metadata()


def test_a_version_6_layout_cannot_be_striped(tmp_path):
    save(_state(), tmp_path / "c", stripes=3)
    layout = _layout(tmp_path / "c")
    layout.version = 6
    with pytest.raises(CorruptCheckpointError, match="striped in a layout of version 6"):
        layout.validate("here")


def test_overwrite_removes_the_replaced_checkpoints_stripes(tmp_path):
    path = tmp_path / "c"
    save(_state(seed=1), path, stripes=3)
    old = set(os.listdir(path))
    state = _state(seed=2)
    save(state, path, stripes=2, overwrite=True)
    now = set(os.listdir(path))
    assert not (old - {".metadata"}) & now
    assert len(_layout(path).ranks[0].stripes) == 1
    _assert_equal(load(_empty_like(state), path), {k: (v.contiguous() if isinstance(v, torch.Tensor) else v) for k, v in state.items()})


class _MaterialisingPlanner(DefaultSavePlanner):
    """A planner whose resolve_data makes a new tensor each call (as the converter's does)."""

    resolve_creates_tensors = True

    def resolve_data(self, write_item):
        value = super().resolve_data(write_item)
        return value.clone() if isinstance(value, torch.Tensor) else value


def test_batched_submission_writes_every_stripe(tmp_path):
    state = _state(n_big=8)
    path = tmp_path / "c"
    writer = DataStatesWriter(path, stripes=3, window_bytes=128 << 10, host_cache_bytes=512 << 10)
    dcp.save(state, storage_writer=writer, planner=_MaterialisingPlanner(), no_dist=True)
    assert len(_layout(path).ranks[0].stripes) == 2
    _assert_equal(load(_empty_like(state), path), {k: (v.contiguous() if isinstance(v, torch.Tensor) else v) for k, v in state.items()})
    assert verify(path).ok


def test_dcp_plan_caching_keeps_the_stripes(tmp_path):
    state = _state()
    for i in range(2):
        writer = DataStatesWriter(tmp_path / f"s{i}", stripes=3)
        dcp.save(state, storage_writer=writer, planner=DefaultSavePlanner(enable_plan_caching=True), no_dist=True)
        assert len(_layout(tmp_path / f"s{i}").ranks[0].stripes) == 2
        _assert_equal(load(_empty_like(state), tmp_path / f"s{i}"),
                      {k: (v.contiguous() if isinstance(v, torch.Tensor) else v) for k, v in state.items()})


def test_stripes_that_fit_one_by_one_but_not_together_are_refused_up_front(small_tmpfs):
    state = {f"t{i}": torch.randn(192, 1024) for i in range(3)}  # 3 x 768 KiB: each fits in 2 MiB, not all
    with raises_from_checkpoint(OSError, match="the rank's stripes need") as info:
        save(state, small_tmpfs / "c", stripes=3)
    assert info.value.errno == errno.ENOSPC
    assert not [n for n in os.listdir(small_tmpfs / "c") if n.endswith((".data", ".index"))]


def test_a_failed_stripe_write_names_the_key_and_leaves_no_files(small_tmpfs):
    state = {f"t{i}": torch.randn(128, 1024) for i in range(3)}  # 1.5 MiB of tensors: the reservation fits
    state["blob"] = bytes(1 << 20)  # 1 MiB object appended to the last stripe: the tmpfs fills up
    with raises_from_checkpoint(OSError) as info:
        save(state, small_tmpfs / "c", stripes=3)
    assert info.value.errno == errno.ENOSPC, info.value
    # Whichever write meets the full tmpfs first fails: mostly the object's, in the last stripe;
    # under load a tensor's window written after it; or the metadata's temporary (written meanwhile).
    if info.value.filename.endswith(".data"):
        named = re.search(r"writing '([^']+)'", str(info.value))
        assert named and named.group(1) in state, info.value
    else:
        assert ".metadata." in info.value.filename, info.value
    assert not [n for n in os.listdir(small_tmpfs / "c") if n.endswith((".data", ".index"))]


def test_async_snapshots_and_compression_write_one_file(tmp_path):
    state = _state()
    writer = DataStatesWriter(tmp_path / "a", stripes=3)
    resp = dcp.async_save(state, storage_writer=writer, no_dist=True)
    resp.staging_completion.result()
    resp.upload_completion.result()
    writer.close()
    assert _layout(tmp_path / "a").ranks[0].stripes == ()
    pytest.importorskip("zstandard")
    save(state, tmp_path / "z", stripes=3, compression="zstd")
    assert _layout(tmp_path / "z").ranks[0].stripes == ()
    _assert_equal(load(_empty_like(state), tmp_path / "z"),
                  {k: (v.contiguous() if isinstance(v, torch.Tensor) else v) for k, v in state.items()})


def test_stripe_files_of_an_interrupted_save_are_strays(tmp_path):
    """A save killed while writing its stripes leaves files no layout names: verify notes them,
    du counts them as stray, and they never touch the committed checkpoint."""
    from dcp_datastates.format.file_names import stray_files
    from dcp_datastates.tools.commands.du import disk_usage

    state = _state()
    path = tmp_path / "c"
    save(state, path, stripes=3)
    left = ["rank00000-00000000abcd.data", "rank00000-00000000abcd.s1.data", "rank00000-00000000abcd.s2.data"]
    for name in left:
        (path / name).write_bytes(b"\0" * 4096)
    rank = _layout(path).ranks[0]
    assert stray_files(os.listdir(path), [*rank.data_files(), rank.index_file]) == sorted(left)
    report = verify(path)
    assert report.ok and sorted(n.split()[0] for n in report.notes) == sorted(left)
    (usage,) = disk_usage([str(path)])
    assert usage.stray_bytes == 3 * 4096 and sorted(usage.stray_files) == sorted(left)
