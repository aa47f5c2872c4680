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
from dcp_datastates import CheckpointManagerOptions as Options, DataStatesReader, _dcp_compat
from dcp_datastates.core.incremental import ChangeTracker, content_digest
from dcp_datastates.core.verify import verify
from dcp_datastates.errors import CheckpointError, ChecksumMismatchError, CorruptCheckpointError

pytestmark = [pytest.mark.dist, pytest.mark.subprocess, pytest.mark.slow]

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
        version = _dcp_compat.version_counter(state["frozen"])
        state["frozen"].numpy()[12345] += 1.0  # no bump
        assert _dcp_compat.version_counter(state["frozen"]) == version
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


@pytest.mark.parametrize("n", [0, 1, 63, 64, 65, 1000])
def test_a_digest_taken_in_pieces_equals_the_whole_one(n):
    """The piece loop device tensors are hashed through (two alternating host buffers), run on
    the host: every size against every piece length, boundaries included."""
    xxhash = pytest.importorskip("xxhash")
    from dcp_datastates.core.incremental import digest_in_pieces

    t = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(n))
    for piece in (1, 7, 64, 1 << 20):
        assert digest_in_pieces(t, piece) == xxhash.xxh3_128_hexdigest(t.numpy().tobytes()), piece


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.cuda
def test_a_device_tensor_is_hashed_after_the_callers_kernels_and_like_its_host_copy(monkeypatch):
    from dcp_datastates.core import incremental

    monkeypatch.setattr(incremental, "HASH_PIECE_BYTES", 3 << 20)  # several pieces, a short last one
    t = torch.randn(2_500_000, device="cuda")
    _dcp_compat.cuda_sleep(200_000_000)  # still running when the hashing starts
    t.fill_(7.0)
    [digest] = incremental.hash_all([t], threads=2, ready=incremental.ready_events([t]))
    assert digest == content_digest(t.cpu())
    m = torch.randn(1000, 3000, device="cuda")
    for view in (m.t(), m[:, 7], m[:, ::2], m[3].expand(5, 3000)):  # strided, some flatten to 1-D views
        assert content_digest(view) == content_digest(view.cpu())
    _dcp_compat.cuda_sleep(200_000_000)
    m.fill_(3.0)  # queued on the caller's stream: without a ready event the hash waits for it
    assert content_digest(m) == content_digest(torch.full((1000, 3000), 3.0))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.cuda
def test_hashing_does_not_wait_for_kernels_queued_after_the_save_began():
    """The copies run on a stream of their own, after the save's ready event only: a long
    kernel the loop queues later on its stream is still running when the digests are in."""
    from dcp_datastates.core import incremental

    tensors = [torch.randn(1 << 20, device="cuda") for _ in range(3)]
    expected = [content_digest(t.cpu()) for t in tensors]
    ready = incremental.ready_events(tensors)
    _dcp_compat.cuda_sleep(4_000_000_000)  # about 2 s on any current GPU
    assert incremental.hash_all(tensors, threads=2, ready=ready) == expected
    assert not torch.cuda.current_stream().query(), "the hashing waited for the caller's later kernel"
    torch.cuda.synchronize()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.cuda
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_device_state_is_saved_incrementally(tmp_path, mode):
    state = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in _state().items()}
    tracker = ChangeTracker()
    how = _async_save if mode == "async" else save
    how(state, tmp_path / "a", record_digests=True, change_tracker=tracker)
    state["hot"].add_(1)
    how(state, tmp_path / "b", base=tmp_path / "a", change_tracker=tracker)
    assert _referred(tmp_path / "b") == {"frozen": "a", "frozen_bf16": "a"}
    out = load(zeros_like_state({k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in state.items()}), tmp_path / "b")
    assert_same(out, {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in state.items()})


def test_inspect_names_the_base_of_each_referred_chunk(tmp_path):
    from dcp_datastates.tools.commands.inspect import inspect_checkpoint

    paths, _ = _chain(tmp_path, steps=2)
    info = inspect_checkpoint(str(paths[1]))
    assert info["ranks"] == 1
    assert info["bases"] == [{"base": "step_1", "bytes": 4 * BIG * 4 + 256 * 512 * 2}]
    files = {k["key"]: k["files"] for k in info["keys"]}
    assert files["frozen"][0].startswith("../step_1/rank00000-") and files["hot"][0].startswith("rank00000-")
    layout = DataStatesReader(paths[1])
    layout.load_metadata()
    assert layout.layout.location(MetadataIndex("frozen", torch.Size([0]))).relative_path == files["frozen"][0]


# -- asynchronous saves ------------------------------------------------------------------------


def _async_save(state, path, **kw):
    import torch.distributed.checkpoint as dcp

    from dcp_datastates import DataStatesWriter

    writer = DataStatesWriter(path, **kw)
    response = dcp.async_save(state, storage_writer=writer, no_dist=True)
    getattr(response, "upload_completion", response).result()
    writer.close()
    return writer


def test_asynchronous_incremental_saves_hash_in_the_background_and_refer(tmp_path):
    tracker = ChangeTracker()
    state = _state()
    _async_save(state, tmp_path / "a", record_digests=True, change_tracker=tracker)
    state["hot"].add_(1)
    state["step"] = 2
    w = _async_save(state, tmp_path / "b", base=tmp_path / "a", change_tracker=tracker)
    assert _referred(tmp_path / "b") == {"frozen": "a", "frozen_bf16": "a"}
    assert w.last_save_stats.referenced_bytes == 4 * BIG * 4 + 256 * 512 * 2
    assert BIG * 4 <= _own_bytes(tmp_path / "b") < BIG * 4 + 64 * 1024
    assert_same(load(zeros_like_state(state), tmp_path / "b"), state)
    assert verify(tmp_path / "b").ok


def test_an_asynchronous_snapshot_still_fails_on_a_change_during_hashing(tmp_path, monkeypatch):
    """The hashed tensors are the caller's: a change while they are hashed (no fence, no wait)
    fails the save, as a change during a copy does."""
    import threading

    import torch.distributed.checkpoint as dcp

    from dcp_datastates import DataStatesWriter
    from dcp_datastates.core import incremental
    from dcp_datastates.errors import CheckpointError, SnapshotMutatedError

    state = _state()
    _async_save(state, tmp_path / "a", record_digests=True)
    hashing, release = threading.Event(), threading.Event()
    real = incremental.hash_all

    def held(*args, **kwargs):
        hashing.set()
        release.wait(10)
        return real(*args, **kwargs)

    monkeypatch.setattr(incremental, "hash_all", held)
    writer = DataStatesWriter(tmp_path / "b", base=tmp_path / "a")
    response = dcp.async_save(state, storage_writer=writer, no_dist=True)
    assert hashing.wait(10)
    state["frozen"].add_(1)  # while its hash is being taken
    release.set()
    with raises_from_checkpoint(SnapshotMutatedError, match="'frozen'"):
        getattr(response, "upload_completion", response).result()
    with pytest.raises(CheckpointError, match="modified in place"):
        writer.close()
    assert not (tmp_path / "b" / ".metadata").exists()


# -- CheckpointManager -----------------------------------------------------------------------------


def test_the_manager_saves_incrementally_and_keeps_what_is_referred_to(tmp_path):
    from dcp_datastates import CheckpointManager

    root = tmp_path / "run"
    state = _state()
    with CheckpointManager(root, Options(keep_last=1, async_save=True)) as mgr:
        for step in (10, 20, 30):
            state["hot"].add_(1)
            state["step"] = step
            mgr.save(step, state).result()
        names = sorted(os.listdir(root))
        # keep_last=1, but step 30 refers to step 10's frozen chunks (and 20's hot one, if any)
        assert "step_00000010" in names and "step_00000030" in names
        assert _referred(root / "step_00000030")["frozen"] == "step_00000010"
        got = zeros_like_state(state)
        assert mgr.load(got) == 30
        assert_same(got, state)


def test_the_manager_saves_in_full_every_k_saves_and_retention_then_lets_go(tmp_path):
    from dcp_datastates import CheckpointManager

    root = tmp_path / "run"
    state = _state()
    with CheckpointManager(root, Options(keep_last=1, async_save=False, full_every=3)) as mgr:
        for step in range(1, 8):
            state["hot"].add_(1)
            state["step"] = step
            mgr.save(step, state)
            bases = DataStatesReader(mgr.path_of(step))
            bases.load_metadata()
            assert (bases.layout.bases == []) == (step in (1, 4, 7)), (step, bases.layout.bases)
        # step 7 is full: nothing refers to the older steps any more, and keep_last=1 applies
        assert sorted(os.listdir(root)) == ["latest", "step_00000007"] or sorted(
            n for n in os.listdir(root) if n.startswith("step_")
        ) == ["step_00000007"]


def test_a_resumed_manager_refers_to_the_step_it_loaded(tmp_path):
    from dcp_datastates import CheckpointManager

    root = tmp_path / "run"
    state = _state()
    with CheckpointManager(root, Options(async_save=False)) as mgr:
        mgr.save(1, state)
    with CheckpointManager(root, Options(async_save=False)) as mgr:  # a restart
        got = zeros_like_state(state)
        assert mgr.load(got) == 1
        mgr.save(2, got)
        assert set(_referred(root / "step_00000002")) == {"frozen", "frozen_bf16", "hot"}
    with CheckpointManager(root, Options(async_save=False, incremental=False)) as mgr:
        mgr.save(3, state)
        assert _referred(root / "step_00000003") == {}


def test_replacing_a_step_others_refer_to_is_refused(tmp_path):
    from dcp_datastates import CheckpointManager
    from dcp_datastates.errors import CheckpointError

    root = tmp_path / "run"
    state = _state()
    with CheckpointManager(root, Options(async_save=False, keep_last=None)) as mgr:
        mgr.save(1, state)
        mgr.save(2, state)
        with pytest.raises(CheckpointError, match="step_00000002 refer"):
            mgr.save(1, state, overwrite=True)
        assert_same(load(zeros_like_state(state), root / "step_00000002"), state)


def test_a_rollback_deletes_abandoned_steps_that_refer_to_a_replaced_one(tmp_path):
    from dcp_datastates import CheckpointManager

    root = tmp_path / "run"
    state = _state()
    with CheckpointManager(root, Options(async_save=False, keep_last=None)) as mgr:
        for step in (10, 20, 30):
            state["hot"].numpy()[step] += 1  # a change the counter misses: hashed, found, written at 20
            mgr.save(step, state) if step != 30 else None
        state["hot"].numpy()[30] -= 1  # back to step 20's bytes: 30 refers to 20
        mgr.save(30, state)
        assert _referred(root / "step_00000030").get("hot") == "step_00000020"
        assert mgr.load(zeros_like_state(state), step=10) == 10  # roll back: 20 and 30 are abandoned
        with pytest.warns(UserWarning, match="abandoned checkpoint that refers to step 20"):
            mgr.save(20, state)  # replaces 20; 30 refers to it and is abandoned: it goes first
        assert not (root / "step_00000030").exists()
        assert_same(load(zeros_like_state(state), root / "step_00000020"), state)


def test_two_ranks_save_dtensors_incrementally_and_resume(tmp_path):
    from manager_workers import run_ranks

    root = tmp_path / "run"
    run_ranks("manager_incremental_dtensor_saves", 2, tmp_path / "logs", root=str(root))
    referred = _referred(root / "step_00000003")
    assert referred == {"model.frozen": "step_00000001"}, referred
    # each rank wrote its half of the moving tensor (256 KiB each) and its small objects only
    assert 2 * (256 << 10) <= _own_bytes(root / "step_00000003") < 2 * (256 << 10) + 2 * (64 << 10)


def test_the_tools_follow_references(tmp_path):
    """convert reads referred chunks through the base; du counts shared bytes once (in the base)."""
    from dcp_datastates.tools import cli
    from dcp_datastates.tools.commands.du import disk_usage

    paths, state = _chain(tmp_path, steps=2)
    out = tmp_path / "step_2.pt"
    assert cli.run(["convert", str(paths[1]), "--to", "torch", str(out), "--quiet"]) == 0
    converted = torch.load(out, weights_only=True)
    flat = {k: v for k, v in converted.items() if isinstance(v, torch.Tensor)}
    assert torch.equal(flat["frozen"], state["frozen"]) and torch.equal(flat["hot"], state["hot"])
    assert torch.equal(flat["frozen_bf16"], state["frozen_bf16"])
    usage = {os.path.basename(u.path): u for u in disk_usage([str(tmp_path)])}
    assert usage["step_2"].checkpoint_bytes < usage["step_1"].checkpoint_bytes / 2  # the frozen bytes: in step_1 only
    assert usage["step_2"].stray_bytes == 0 and usage["step_2"].other_bytes == 0


def test_a_save_cannot_replace_a_checkpoint_its_base_refers_to(tmp_path):
    """step_2 refers to step_1: saving step_1 again against step_2 would delete, at its commit,
    the very files it refers to through step_2. Refused; both stay loadable."""
    paths, state = _chain(tmp_path, steps=2)
    with raises_from_checkpoint(ValueError, match="refers to step_1 itself"):
        save(state, paths[0], base=paths[1], overwrite=True)
    assert verify(paths[0]).ok and verify(paths[1]).ok


def test_retention_keeps_bases_even_with_incremental_off(tmp_path):
    """A root an incremental run wrote, reopened with incremental=False: retention still never
    deletes a step a remaining one refers to."""
    from dcp_datastates import CheckpointManager

    root = tmp_path / "run"
    state = _state()
    with CheckpointManager(root, Options(async_save=False, keep_last=None)) as mgr:
        for step in (1, 2, 3):
            state["hot"].add_(1)
            mgr.save(step, state)
    assert _referred(root / "step_00000003")["frozen"] == "step_00000001"
    with CheckpointManager(root, Options(async_save=False, keep_last=2, incremental=False)) as mgr:
        state["hot"].add_(1)
        mgr.save(4, state)
        assert mgr.steps() == [1, 3, 4]  # 2 went; 1 stays for 3
        got = zeros_like_state(state)
        assert mgr.load(got, step=3) == 3


@pytest.mark.parametrize("how", ["load", "fetch"])
def test_incremental_steps_drain_after_their_bases_and_resume_on_a_new_node(tmp_path, durable_url, how):
    """A directory tier and S3: each step commits there after its bases; durable retention keeps
    the bases of what it keeps; a new node (empty local root) resumes the newest step in place or
    by fetching it together with its bases; verify of the durable copy follows the references."""
    from dcp_datastates import CheckpointManager
    from dcp_datastates.tools.commands.verify import verify_location

    root = tmp_path / "run"
    state = _state()
    with CheckpointManager(root, Options(keep_last=1, durable=durable_url, durable_keep_last=1, async_save=False)) as mgr:
        for step in (1, 2, 3):
            state["hot"].add_(1)
            state["step"] = step
            mgr.save(step, state)
        mgr.wait_durable()
        # step 3 refers to step 1 (frozen) on both tiers: keep_last=1 keeps 1 for it, 2 goes
        assert mgr.steps() == [1, 3] and mgr.durable_steps() == [1, 3]
        assert _referred(root / "step_00000003")["frozen"] == "step_00000001"
    results = list(verify_location(f"{durable_url}/step_00000003")) if durable_url.startswith("s3://") else None
    if results is not None:
        assert all(o.ok for o in results), [o.text for o in results]
    node2 = tmp_path / "node2"
    with CheckpointManager(node2, Options(durable=durable_url, durable_resume=how, async_save=False)) as mgr:
        got = zeros_like_state(state)
        assert mgr.load(got) == 3
        assert_same(got, state)
        if how == "fetch":  # the step and its base, both loadable on their own
            assert sorted(n for n in os.listdir(node2) if n.startswith("step_")) == ["step_00000001", "step_00000003"]
            assert verify(node2 / "step_00000003").ok and verify(node2 / "step_00000001").ok


def test_a_step_whose_base_is_not_durable_stays_uncommitted_there(tmp_path, shared_mount):
    """A root whose base step never reached the durable tier: the incremental step's drain fails
    (naming the base) and its local copy is kept; nothing refers to bytes that are not there."""
    from dcp_datastates import CheckpointManager
    from dcp_datastates.tiers.drain import DrainError

    root, shared = tmp_path / "run", os.path.join(shared_mount, "no_base")
    state = _state()
    with CheckpointManager(root, Options(async_save=False)) as mgr:  # no tier: 1 and 2 only local
        mgr.save(1, state)
        mgr.save(2, state)
    mgr = CheckpointManager(root, Options(async_save=False, durable=shared))  # drains 1 and 2 on start
    mgr.wait_durable()
    assert mgr.durable_steps() == [1, 2]  # 1 first, then 2 after it
    mgr.close()
    from dcp_datastates.storage import open_store
    with CheckpointManager(root, Options(async_save=False, durable=shared, keep_last=None)) as mgr:
        mgr.wait_durable()  # nothing to drain: both are there (a step missing there at start is drained again)
        open_store(shared).delete_checkpoint("step_00000001")  # then the base goes from the tier
        assert mgr.load(zeros_like_state(state)) == 2  # the next save refers to 2 (and through it to 1)
        state["step"] = 3
        with pytest.warns(UserWarning, match="which is not durable"):
            mgr.save(3, state)
            with pytest.raises(DrainError, match="step_00000001"):
                mgr.wait_durable()
        assert 3 not in mgr.durable_steps() and 3 in mgr.steps()
        with pytest.raises(CheckpointError):
            mgr.close()


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_a_crash_during_retention_leaves_no_step_without_its_base(tmp_path, mode):
    """Retention deletes newest first: killed while deleting step 20 (which refers to step 10),
    step 10 is still whole, and every committed step left loads."""
    import signal
    import subprocess
    import sys

    from dcp_datastates import CheckpointManager
    from dcp_datastates.manager.checkpoint_root import is_committed
    from manager_workers import frozen_state

    root = tmp_path / "run"
    here = os.path.dirname(os.path.abspath(__file__))
    proc = subprocess.run(
        [sys.executable, os.path.join(here, "support", "manager_workers.py"), "crash", str(root), "incremental_retention", mode],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == -signal.SIGKILL, (proc.returncode, proc.stdout, proc.stderr)
    assert _referred(root / "step_00000030") == {}  # the full save (full_every=2)
    assert not is_committed(str(root / "step_00000020"))  # being deleted: its .metadata went first
    assert is_committed(str(root / "step_00000010"))
    expected = frozen_state()
    for step in (10, 30):
        expected["step"] = step
        assert_same(load(zeros_like_state(expected), root / f"step_{step:08d}"), expected)
    with pytest.warns(UserWarning):
        mgr = CheckpointManager(root, Options(keep_last=1))  # cleans the half-deleted step 20 up
    assert sorted(n for n in os.listdir(root) if n.startswith("step_")) == ["step_00000010", "step_00000030"]
    mgr.close()



def test_verify_digests_recomputes_what_later_saves_trust(tmp_path):
    """A recorded digest that is not its bytes' (here: edited into .metadata) passes the checksums,
    and a later save would refer to those bytes for other ones: verify(digests=True) says so."""
    from dcp_datastates.format.metadata_file import encode_metadata, read_metadata_file
    from dcp_datastates.tools import cli

    paths, state = _chain(tmp_path, steps=2)
    report = verify(paths[1], digests=True)
    assert report.ok and report.digests_checked == 3, report  # frozen (in step_1), frozen_bf16, hot
    md_path = paths[0] / ".metadata"
    metadata, _ = read_metadata_file(str(md_path))
    key = ("frozen", (0,))
    metadata.storage_data.digests[key] = "0" * 32
    md_path.write_bytes(encode_metadata(metadata, 0))
    assert verify(paths[0]).ok  # the checksums say nothing about it
    bad = verify(paths[0], digests=True)
    assert not bad.ok and any("'frozen'" in p and "content digest" in p for p in bad.problems), bad
    assert cli.run(["verify", "--digests", "--quiet", str(paths[0])]) == 1
    assert cli.run(["verify", "--digests", "--quiet", str(paths[1])]) == 0


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_save_never_refers_to_a_base_file_that_is_gone(tmp_path, mode):
    """step_3 against step_2 would refer (one hop) to step_1's file for the frozen chunks; that
    file was deleted: the save fails naming it, instead of committing a checkpoint that cannot load."""
    paths, state = _chain(tmp_path, steps=2)
    data = next(n for n in os.listdir(paths[0]) if n.endswith(".data"))
    os.remove(paths[0] / data)
    if mode == "sync":
        with raises_from_checkpoint(CorruptCheckpointError, match=data):
            save(state, tmp_path / "step_3", base=paths[1])
    else:
        import torch.distributed.checkpoint as dcp

        from dcp_datastates import DataStatesWriter

        writer = DataStatesWriter(tmp_path / "step_3", base=paths[1])
        response = dcp.async_save(state, storage_writer=writer, no_dist=True)
        with raises_from_checkpoint(CorruptCheckpointError, match=data):
            getattr(response, "upload_completion", response).result()
        with pytest.raises(CheckpointError, match=data):
            writer.close()  # the background error, raised once more by the writer
    assert not (tmp_path / "step_3" / ".metadata").exists()


def test_references_and_digests_refuse_compression(tmp_path):
    from dcp_datastates import DataStatesWriter

    pytest.importorskip("zstandard")
    with pytest.raises(ValueError, match="incremental saves .* cannot be combined with compression"):
        DataStatesWriter(tmp_path / "b", base=tmp_path / "a", compression="zstd")
    with pytest.raises(ValueError, match="record_digests=True needs raw chunks"):
        DataStatesWriter(tmp_path / "b", record_digests=True, compression="zstd")
