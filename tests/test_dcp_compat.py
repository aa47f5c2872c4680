"""Every private torch/DCP touchpoint (dcp_datastates/_dcp_compat.py), pinned on the torch the
suite runs on: a release that moves or changes one fails here, by name, not in a save."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

from dcp_datastates import DataStatesReader, DataStatesWriter, _dcp_compat

from conftest import load


def test_supported_torch():
    assert _dcp_compat.torch_version() >= _dcp_compat.MIN_TORCH
    _dcp_compat.check_torch_version()


def test_version_counter_counts_in_place_updates_but_not_data_writes():
    t = torch.zeros(4)
    v0 = _dcp_compat.version_counter(t)
    t.add_(1)
    assert _dcp_compat.version_counter(t) == v0 + 1
    t.data.add_(1)  # documented blind spot of the snapshot's check (README)
    assert _dcp_compat.version_counter(t) == v0 + 1


def test_local_shard_of_a_plain_tensor_is_itself():
    t = torch.ones(3)
    assert _dcp_compat.local_shard(t) is t


_DTENSOR_SCRIPT = textwrap.dedent(
    """
    import torch, torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from dcp_datastates import _dcp_compat
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,))
    d = distribute_tensor(torch.arange(12.0).reshape(3, 4), mesh, [Shard(0)])
    shard = _dcp_compat.local_shard(d)
    assert type(shard) is torch.Tensor and shard is _dcp_compat.local_shard(d)  # the object itself
    assert shard.data_ptr() == d.to_local().data_ptr()
    v_shard, v_d = _dcp_compat.version_counter(shard), _dcp_compat.version_counter(d)
    d.add_(1)
    # In-place DTensor ops bump the DTensor's counter and not its shard's (they reach the shard
    # below autograd); an op on the shard bumps only the shard's: the snapshot watches both.
    assert _dcp_compat.version_counter(d) == v_d + 1 and _dcp_compat.version_counter(shard) == v_shard
    shard.add_(1)
    assert _dcp_compat.version_counter(shard) == v_shard + 1
    # the chunk offsets DCP's planner gives this rank's chunk (incremental saves key by them)
    assert _dcp_compat.dtensor_chunk_offsets(d) == (0, 0)
    assert _dcp_compat.dtensor_chunk_offsets(torch.ones(2)) is None
    dist.destroy_process_group()
    print("OK")
    """
)


@pytest.mark.subprocess
@pytest.mark.slow
def test_local_shard_of_a_dtensor_is_its_shard_object():
    out = subprocess.run([sys.executable, "-c", _DTENSOR_SCRIPT], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "OK" in out.stdout, out.stdout + out.stderr[-3000:]


def test_flatten_state_dict_names_items_as_the_default_planner_does(tmp_path):
    state = {"model": {"layer": {"w": torch.ones(2)}}, "opt": [{"m": torch.zeros(1)}], "step": 3, "t": (1, 2)}
    flat = _dcp_compat.flatten_state_dict(state)
    metadata = dcp.save(state, storage_writer=FileSystemWriter(str(tmp_path / "c")), no_dist=True)
    assert set(flat) == set(metadata.state_dict_metadata)
    assert flat["model.layer.w"] is state["model"]["layer"]["w"]


def test_storage_info_and_zstandard_and_legacy_tensor_properties_are_found():
    info = _dcp_compat.storage_info_class()
    assert info is not None and {"relative_path", "offset", "length"} <= set(info.__dataclass_fields__)
    zstd = _dcp_compat.zstandard_extension_class()
    assert zstd is not None and zstd().get_descriptor().startswith("stream.zstd")
    legacy = _dcp_compat.legacy_tensor_properties_class()
    assert legacy is None or {"dtype", "requires_grad"} <= set(legacy.__dataclass_fields__)


def test_load_whole_checkpoint_returns_every_key(tmp_path):
    state = {"a": torch.arange(5), "n": {"b": torch.ones(2, 2)}, "step": 9}
    dcp.save(state, storage_writer=DataStatesWriter(tmp_path / "c"), no_dist=True)
    whole = _dcp_compat.load_whole_checkpoint(DataStatesReader(tmp_path / "c"))
    assert torch.equal(whole["a"], state["a"]) and torch.equal(whole["n"]["b"], state["n"]["b"]) and whole["step"] == 9


def test_fake_tensor_mode_makes_tensors_without_storage():
    with _dcp_compat.fake_tensor_mode():
        t = torch.empty(1 << 30, dtype=torch.float64)  # 8 GiB, allocated by nobody
    assert t.shape == (1 << 30,) and t.dtype == torch.float64


def test_dcp_metadata_version_is_what_filesystem_writer_stamps(tmp_path):
    # torch 2.11 stamps a copy (the returned Metadata keeps None), 2.13 the object itself: read the file.
    from torch.distributed.checkpoint import FileSystemReader

    dcp.save({"x": torch.ones(1)}, storage_writer=FileSystemWriter(str(tmp_path / "c")), no_dist=True)
    written = FileSystemReader(str(tmp_path / "c")).read_metadata()
    assert _dcp_compat.dcp_metadata_version() == written.version is not None


def test_dcp_load_reports_read_metadata_errors_as_documented(tmp_path):
    """Through dcp.load, a metadata error reaches the user: in DCP's AssertionError (2.13) or, where
    DCP replaces it with "metadata is None" (2.11), in the reader's own log record."""
    import logging

    (tmp_path / "empty").mkdir()
    records = []
    handler = logging.Handler(logging.ERROR)
    handler.emit = records.append
    logging.getLogger("dcp_datastates").addHandler(handler)
    try:
        with pytest.raises((Exception, torch.distributed.checkpoint.api.CheckpointException)) as info:
            dcp.load({"x": torch.zeros(1)}, storage_reader=DataStatesReader(tmp_path / "empty"), no_dist=True)
    finally:
        logging.getLogger("dcp_datastates").removeHandler(handler)
    text = str(info.value)
    if _dcp_compat.dcp_load_reports_read_metadata_errors():
        assert "metadata is missing" in text and not records
    else:
        assert "metadata is None" in text
        assert len(records) == 1 and "metadata is missing" in records[0].getMessage()


def test_dcp_runs_each_async_save_on_a_thread_of_its_own_that_ends_with_it(tmp_path):
    """The order of saves waits for an asynchronous save by joining the thread that ran it; that
    is sound only while DCP's thread executor runs one save per thread and ends the thread
    right after the upload future (runs_one_save recognises those threads)."""
    seen: list[threading.Thread] = []

    class Recording(DataStatesWriter):
        def storage_meta(self):
            seen.append(threading.current_thread())
            return super().storage_meta()

    for i in range(2):
        with Recording(tmp_path / f"c{i}") as writer:
            resp = dcp.async_save({"x": torch.full((4,), float(i))}, storage_writer=writer, no_dist=True)
            resp.upload_completion.result(timeout=60)
    assert len(seen) == 2 and seen[0] is not seen[1]
    for thread in seen:
        assert _dcp_compat.runs_one_save(thread), thread.name
        thread.join(timeout=10)
        assert not thread.is_alive()
    assert not _dcp_compat.runs_one_save(threading.current_thread())
    assert torch.equal(load({"x": torch.zeros(4)}, tmp_path / "c1")["x"], torch.ones(4))


def test_cuda_event_handle_is_the_events_cuda_event():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    ev = torch.cuda.Event()
    ev.record()
    assert _dcp_compat.cuda_event_handle(ev) == ev.cuda_event != 0


_LOGGER_SCRIPT = textwrap.dedent(
    """
    import logging
    from dcp_datastates import _dcp_compat
    dcp_logger = _dcp_compat.dcp_logger()
    assert dcp_logger.getEffectiveLevel() == logging.DEBUG, dcp_logger.getEffectiveLevel()
    {setup}
    print(_dcp_compat.quiet_discarded_dcp_debug_records(), dcp_logger.getEffectiveLevel())
    """
)


@pytest.mark.parametrize(
    "setup,expected",
    [
        ("", "True 20"),  # only DCP's NullHandler: its DEBUG records reach nobody, so they stop
        ("dcp_logger.addHandler(logging.StreamHandler())", "False 10"),  # somebody listens: untouched
        ("dcp_logger.propagate = True", "False 10"),
    ],
)
@pytest.mark.subprocess
@pytest.mark.slow
def test_dcps_discarded_debug_records_are_quieted_only_where_nobody_can_see_them(setup, expected):
    """DCP builds two DEBUG records per top-level key of every save (1.1 s for 20,000 keys) on a
    logger whose only handler is a NullHandler; a fresh interpreter, since the level is global."""
    out = subprocess.run(
        [sys.executable, "-c", _LOGGER_SCRIPT.format(setup=setup)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == expected.split()


def _plan(fqn, chunk_offsets, chunk_sizes, size):
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

    return SavePlan([WriteItem(
        index=MetadataIndex(fqn, torch.Size(chunk_offsets)), type=WriteItemType.SHARD,
        tensor_data=TensorWriteData(
            chunk=ChunkStorageMetadata(offsets=torch.Size(chunk_offsets), sizes=torch.Size(chunk_sizes)),
            properties=TensorProperties(dtype=torch.float32), size=torch.Size(size),
        ),
    )])


def test_dedup_save_plans_keeps_one_copy_of_a_replicated_item():
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner, create_default_local_save_plan

    state = {"w": torch.ones(3), "step": 4}
    plans = [create_default_local_save_plan(state, True) for _ in range(2)]
    deduped = _dcp_compat.dedup_save_plans(DefaultSavePlanner(), plans)
    assert sorted(i.index.fqn for p in deduped for i in p.items) == ["step", "w"]


def test_validate_global_save_plan_lists_problems_on_every_torch():
    from torch.distributed.checkpoint.default_planner import create_default_global_save_plan

    good = [_plan("w", (0,), (2,), (4,)), _plan("w", (2,), (2,), (4,))]
    plans, md = create_default_global_save_plan(good)
    assert _dcp_compat.validate_global_save_plan(plans, md) == []
    bad = [_plan("w", (0,), (3,), (4,)), _plan("w", (2,), (3,), (4,))]  # overlapping, out of bounds
    plans, md = create_default_global_save_plan(bad)
    problems = _dcp_compat.validate_global_save_plan(plans, md)
    assert problems and all(isinstance(p, str) for p in problems)


def test_plan_caching_enabled_reads_the_planners_argument():
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    assert _dcp_compat.plan_caching_enabled(DefaultSavePlanner(enable_plan_caching=True))
    assert not _dcp_compat.plan_caching_enabled(DefaultSavePlanner())


def test_dcp_calls_the_global_plan_step_by_its_private_name():
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    calls = []

    class Own(DefaultSavePlanner):
        pass

    def step(self, all_plans):
        calls.append(len(all_plans))
        return DefaultSavePlanner.__dict__[_dcp_compat.GLOBAL_PLAN_STEP](self, all_plans)

    setattr(Own, _dcp_compat.GLOBAL_PLAN_STEP, step)
    for caching in (False, True):
        planner = Own(enable_plan_caching=caching)
        planner._cached_plans_key = f"compat-step-{caching}"
        planner.set_up_planner({"w": torch.ones(2)}, None, True)
        planner.create_global_plan([planner.create_local_plan()])
    assert calls == [1, 1]


def test_local_plan_unchanged_follows_dcps_plan_cache():
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    class Cached(DefaultSavePlanner):
        pass

    def plan_of(state):
        planner = Cached(enable_plan_caching=True)
        planner.set_up_planner(state, None, True)
        sent = planner.create_local_plan()
        return planner, planner.plan, sent  # the plan made, and what is sent (empty if cached)

    # DCP's own planner fills the cache (at once on 2.11, at finish_plan later).
    planner, local, sent = plan_of({"w": torch.ones(2)})
    assert sent is local
    global_plans, _ = planner.create_global_plan([local])
    planner.finish_plan(global_plans[0])
    probe = Cached(enable_plan_caching=True)
    _, same, sent = plan_of({"w": torch.zeros(2)})
    assert not sent.usable and _dcp_compat.local_plan_unchanged(probe, same)
    other = Cached()  # without caching: making the plan leaves DCP's cache alone (2.11 fills it at once)
    other.set_up_planner({"w": torch.zeros(3)}, None, True)
    changed = other.create_local_plan()
    assert not _dcp_compat.local_plan_unchanged(probe, changed)


def test_flattening_is_legacy_only_for_torch_2_3_checkpoints():
    assert _dcp_compat.flattening_is_legacy() is False


def test_extension_registry_turns_descriptors_into_stream_transforms():
    """``ExtensionRegistry``: a new default one knows ZStandard by the descriptor FileSystemWriter
    records, refuses a name it was not given, and builds a registered one."""
    registry = _dcp_compat.extension_registry()
    zstd_cls = _dcp_compat.zstandard_extension_class()
    (ext,) = registry.from_descriptor_list(["stream.zstd/1"])
    assert type(ext) is zstd_cls and isinstance(ext, _dcp_compat.stream_transform_extension_class())
    with pytest.raises(ValueError, match="test.other"):
        registry.from_descriptor_list(["test.other/1"])

    class Other(_dcp_compat.stream_transform_extension_class()):
        registry_name = staticmethod(lambda: "test.other")
        from_descriptor = staticmethod(lambda version: Other())
        get_descriptor = lambda self: "test.other/1"  # noqa: E731
        transform_to = transform_from = lambda self, stream: stream  # noqa: E731

    registry.register(Other)
    assert type(registry.from_descriptor_list(["test.other/1"])[0]) is Other
    assert _dcp_compat.extension_registry() is not registry  # a new one each time: nothing shared
