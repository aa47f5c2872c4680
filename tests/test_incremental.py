"""Incremental saves (format 8): chunks identical to a base checkpoint's are referred to, not written.

Every case checks real files: what was written (bytes on disk), what the
layout refers to, bit-exact loads through the references, and named errors
when a reference cannot be trusted.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from torch.distributed.checkpoint.metadata import MetadataIndex

from conftest import assert_same, load, raises_from_checkpoint, save, zeros_like_state
from dcp_datastates import DataStatesReader
from dcp_datastates.core.incremental import ChangeTracker, content_digest
from dcp_datastates.core.verify import verify
from dcp_datastates.errors import ChecksumMismatchError, CorruptCheckpointError

BIG = 1 << 16  # float32 elements: 256 KiB, a chunk an incremental save may refer to


def _state():
    g = torch.Generator().manual_seed(0)
    return {
        "frozen": torch.randn(4 * BIG, generator=g),
        "frozen_bf16": torch.randn(256, 512, generator=g).bfloat16(),
        "hot": torch.randn(BIG, generator=g),
        "bias": torch.randn(16, generator=g),  # small: always written
        "step": 1,
    }


def _own_bytes(path) -> int:
    return sum(os.path.getsize(os.path.join(path, n)) for n in os.listdir(path) if n.endswith(".data"))


def _referred(path) -> dict:
    """``{fqn: base}`` of the chunks the checkpoint refers to."""
    reader = DataStatesReader(path)
    reader.load_metadata()
    layout = reader.layout
    out = {}
    for fqn, _off, slot, *_ in layout.entries:
        if layout.ranks[slot].base:
            out[fqn] = layout.ranks[slot].base
    return out


def _chain(tmp_path, steps=3):
    """Saves step_1 (full, digests recorded) and step_2.. (each against the previous), changing
    ``hot`` and ``step`` every time; returns the paths and the last state."""
    state = _state()
    paths = [tmp_path / "step_1"]
    save(state, paths[0], record_digests=True)
    for n in range(2, steps + 1):
        state["hot"].add_(1.0)
        state["step"] = n
        paths.append(tmp_path / f"step_{n}")
        save(state, paths[-1], base=paths[-2])
    return paths, state


def test_a_chain_of_incremental_saves_loads_bit_exactly_and_writes_only_changes(tmp_path):
    paths, state = _chain(tmp_path)
    full = _own_bytes(paths[0])
    assert full >= 4 * BIG * 4 + BIG * 4 + 256 * 512 * 2
    for p in paths[1:]:
        # hot (256 KiB) and the small bias, packed: everything else is referred to
        assert BIG * 4 <= _own_bytes(p) < BIG * 4 + 64 * 1024
    # one hop: step_3 refers to step_1 directly for chunks unchanged since then
    assert _referred(paths[2]) == {"frozen": "step_1", "frozen_bf16": "step_1"}
    got = load(zeros_like_state(state), paths[2])
    assert_same(got, state)
    report = verify(paths[2])
    assert report.ok, report
    assert report.bases == ["step_1"]


def test_the_writer_reports_hashed_referenced_and_written_bytes(tmp_path):
    state = _state()
    save(state, tmp_path / "a", record_digests=True)
    state["hot"].mul_(2)
    w = save(state, tmp_path / "b", base=tmp_path / "a")
    s = w.last_save_stats
    assert s.referenced_bytes == 4 * BIG * 4 + 256 * 512 * 2
    assert s.hashed_bytes == s.referenced_bytes + BIG * 4
    assert s.bytes_written == _own_bytes(tmp_path / "b")


def test_a_change_that_bypasses_the_version_counter_is_still_written(tmp_path):
    """Version counters are no proof: a write through a NumPy alias does not bump it, and the
    digest still tells the chunk changed (with and without a change tracker)."""
    for tracker in (None, ChangeTracker()):
        root = tmp_path / ("tracked" if tracker else "plain")
        state = _state()
        save(state, root / "a", record_digests=True, change_tracker=tracker)
        version = state["frozen"]._version
        state["frozen"].numpy()[12345] += 1.0  # no bump
        assert state["frozen"]._version == version
        save(state, root / "b", base=root / "a", change_tracker=tracker)
        assert "frozen" not in _referred(root / "b")
        assert_same(load(zeros_like_state(state), root / "b"), state)


def test_a_tracker_skips_hashing_what_changed_since_its_last_save(tmp_path):
    tracker = ChangeTracker()
    state = _state()
    save(state, tmp_path / "a", record_digests=True, change_tracker=tracker)
    state["hot"].add_(1)  # bumps its counter: written without hashing, and without a digest
    w = save(state, tmp_path / "b", base=tmp_path / "a", change_tracker=tracker)
    assert w.last_save_stats.hashed_bytes == 4 * BIG * 4 + 256 * 512 * 2
    reader = DataStatesReader(tmp_path / "b")
    reader.load_metadata()
    assert ("hot", (0,)) not in reader.layout.digests and ("frozen", (0,)) in reader.layout.digests
    # hot stops changing: the next save hashes it again (records its digest), the one after refers to it
    save(state, tmp_path / "c", base=tmp_path / "b", change_tracker=tracker)
    assert "hot" not in _referred(tmp_path / "c")
    save(state, tmp_path / "d", base=tmp_path / "c", change_tracker=tracker)
    assert _referred(tmp_path / "d") == {"frozen": "a", "frozen_bf16": "a", "hot": "c"}


def test_same_bytes_under_another_dtype_or_shape_are_not_referred_to(tmp_path):
    state = {"w": torch.randn(BIG)}
    save(state, tmp_path / "a", record_digests=True)
    same_bytes = {"w": state["w"].view(torch.int32)}  # identical bytes, another dtype
    save(same_bytes, tmp_path / "b", base=tmp_path / "a")
    assert _referred(tmp_path / "b") == {}
    reshaped = {"w": state["w"].view(256, 256)}
    save(reshaped, tmp_path / "c", base=tmp_path / "a")
    assert _referred(tmp_path / "c") == {}
    assert_same(load({"w": torch.zeros(256, 256)}, tmp_path / "c"), reshaped)


def test_a_base_without_digests_refers_to_nothing(tmp_path):
    state = _state()
    save(state, tmp_path / "a")  # a plain full save records no digests
    save(state, tmp_path / "b", base=tmp_path / "a")
    assert _referred(tmp_path / "b") == {}
    save(state, tmp_path / "c", base=tmp_path / "b")  # b recorded digests: c refers to it
    assert set(_referred(tmp_path / "c")) == {"frozen", "frozen_bf16", "hot"}


def test_a_deleted_base_is_a_named_error(tmp_path):
    paths, state = _chain(tmp_path, steps=2)
    shutil.rmtree(paths[0])
    with raises_from_checkpoint(CorruptCheckpointError, match="refers to base checkpoint 'step_1', but rank 0's data file"):
        load(zeros_like_state(state), paths[1])
    report = verify(paths[1])
    assert not report.ok and any("step_1" in p for p in report.problems)


def test_a_base_saved_again_is_a_named_error(tmp_path):
    paths, state = _chain(tmp_path, steps=2)
    save(_state(), paths[0], overwrite=True, record_digests=True)  # same name, new files
    with raises_from_checkpoint(CorruptCheckpointError, match="(was the base deleted?)"):
        load(zeros_like_state(state), paths[1])  # the overwrite removed the old files


def test_damaged_bytes_in_the_base_fail_the_load_and_verify(tmp_path):
    paths, state = _chain(tmp_path, steps=2)
    data = next(n for n in os.listdir(paths[0]) if n.endswith(".data"))
    with open(paths[0] / data, "r+b") as f:
        f.seek(100_000)
        b = f.read(1)
        f.seek(100_000)
        f.write(bytes([b[0] ^ 0x40]))
    with raises_from_checkpoint(ChecksumMismatchError, match=".data while reading 'frozen'"):
        load(zeros_like_state(state), paths[1])
    report = verify(paths[1])
    assert not report.ok and any("'frozen'" in p and "step_1" in p for p in report.problems)


def test_a_base_must_be_a_sibling(tmp_path):
    state = _state()
    save(state, tmp_path / "x" / "a", record_digests=True)
    with pytest.raises(ValueError, match="must be a sibling"):
        save(state, tmp_path / "y" / "b", base=tmp_path / "x" / "a")
    with pytest.raises(ValueError, match="compression"):
        save(state, tmp_path / "x" / "c", base=tmp_path / "x" / "a", compression="zstd")


def test_a_reference_leaving_the_parent_is_refused_when_read(tmp_path):
    """A hand-edited layout naming ``..`` as its base: refused by name before any file is opened."""
    from conftest import zeros_like_state as _z  # noqa: F401
    from dcp_datastates.format.checkpoint_layout import CheckpointLayout, RankFiles

    layout = CheckpointLayout(
        "dcp_datastates", 8, "0123456789ab",
        [RankFiles(0, "rank00000-0123456789ab.data", "rank00000-0123456789ab.index"),
         RankFiles(0, "rank00000-00000000beef.data", "rank00000-00000000beef.index", "00000000beef", (), "..")],
        [("w", (0,), 1, 0, 4096, -1)],
    )
    with pytest.raises(CorruptCheckpointError, match="not a sibling directory's name"):
        layout.validate("ckpt/.metadata")


def test_the_digest_is_xxh3_128_of_the_row_major_bytes():
    xxhash = pytest.importorskip("xxhash")
    t = torch.arange(12, dtype=torch.int16).reshape(3, 4)
    assert content_digest(t) == xxhash.xxh3_128_hexdigest(t.numpy().tobytes())
    assert content_digest(t.t()) == xxhash.xxh3_128_hexdigest(t.t().contiguous().numpy().tobytes())
    assert content_digest(t.bfloat16()) == xxhash.xxh3_128_hexdigest(t.bfloat16().view(torch.int16).numpy().tobytes())


def test_inspect_names_the_base_of_each_referred_chunk(tmp_path):
    from dcp_datastates.tools.listing import inspect_checkpoint

    paths, _ = _chain(tmp_path, steps=2)
    info = inspect_checkpoint(str(paths[1]))
    assert info["ranks"] == 1
    assert info["bases"] == [{"base": "step_1", "bytes": 4 * BIG * 4 + 256 * 512 * 2}]
    files = {k["key"]: k["files"] for k in info["keys"]}
    assert files["frozen"][0].startswith("../step_1/rank00000-") and files["hot"][0].startswith("rank00000-")
    layout = DataStatesReader(paths[1])
    layout.load_metadata()
    assert layout.layout.location(MetadataIndex("frozen", torch.Size([0]))).relative_path == files["frozen"][0]
