"""The durable tier under faults, against a real S3 server of the test's own (on a free port, so
the session's server is untouched): the server killed mid-upload, a 503 storm, a slow link,
and a full local tier. Nothing committed is lost; nothing is reported durable before it is."""

from __future__ import annotations

import time
import warnings

import pytest

from conftest import assert_resumes, mounted_tmpfs
from dcp_datastates import CheckpointError
from dcp_datastates.manager import CheckpointManagerOptions as Options
from dcp_datastates.manager.checkpoint_manager import CheckpointManager, CheckpointManagerWarning
from dcp_datastates.manager.durable_tier import DURABLE, FAILED
from dcp_datastates.storage import open_store
from dcp_datastates.tiers.drain import DrainError, durable_steps
from manager_workers import state_at

pytestmark = [pytest.mark.s3, pytest.mark.slow]

pytest.importorskip("obstore", reason="the s3 extra (obstore) is not installed")

@pytest.fixture
def server():
    from s3_server import WeedServer, running

    with running(WeedServer(bucket="faults")) as srv:
        yield srv


@pytest.fixture
def proxy(server):
    from s3_proxy import S3Proxy

    p = S3Proxy(server.port)
    yield p
    p.close()


def _options(endpoint, **kw):
    return {"endpoint": endpoint, "part_bytes": 5 << 20, **kw}


def _committed(url, endpoint):
    return {s for s, (_n, c) in durable_steps(open_store(url, endpoint=endpoint)).items() if c}


def _wait_for(cond, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.02)


def test_a_slow_link_never_blocks_the_save_and_the_copy_is_durable_only_when_done(tmp_path, server, proxy):
    url = f"s3://{server.bucket}/slow"
    proxy.throttle(4e6)  # 4 MB/s: the 4.3 MB step takes a second or more to leave
    with CheckpointManager(tmp_path / "run", Options(durable=url, async_save=False, durable_options=_options(proxy.endpoint))) as mgr:
        t0 = time.perf_counter()
        mgr.save(10, state_at(10))
        blocked = time.perf_counter() - t0
        assert mgr.durable_status()[10].state != DURABLE  # the save returned; the copy goes on
        assert 10 not in _committed(url, server.endpoint)
        mgr.wait_durable()
        drained = mgr.durable_status()[10].seconds
        assert mgr.durable_status()[10].state == DURABLE and 10 in _committed(url, server.endpoint)
    assert drained > 1.0 and blocked < drained, (blocked, drained)


def test_a_503_storm_is_ridden_out_by_retries(tmp_path, server, proxy):
    url = f"s3://{server.bucket}/storm"
    with CheckpointManager(tmp_path / "run", Options(durable=url, async_save=False, durable_options=_options(proxy.endpoint))) as mgr:
        proxy.storm(5)
        mgr.save(10, state_at(10))
        mgr.wait_durable()
        assert mgr.durable_status()[10].state == DURABLE
    assert proxy.rejected == 5
    assert _committed(url, server.endpoint) == {10}


def test_the_server_killed_mid_upload_commits_nothing_and_the_drain_resumes(tmp_path, server, proxy):
    url = f"s3://{server.bucket}/killed"
    root = tmp_path / "run"
    options = _options(proxy.endpoint, max_retries=2, retry_timeout_s=10, request_timeout_s=10)  # 3 s timed out once on a restarted server under a loaded suite
    proxy.throttle(2e6)
    # durable_retry_s=0: the drain fails once the client's own retries are spent (the outage
    # ridden out in the background is test_tier_trajectories.py's)
    mgr = CheckpointManager(root, Options(keep_last=1, durable=url, async_save=False, durable_options=options, durable_retry_s=0))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CheckpointManagerWarning)
        mgr.save(10, state_at(10))
        _wait_for(lambda: mgr.durable_status()[10].bytes_done > 0)
        server.kill()
        with pytest.raises(DrainError, match="step 10"):
            mgr.wait_durable()
    assert mgr.durable_status()[10].state == FAILED
    server.start()  # the same data: whatever the killed upload left
    proxy.throttle(None)
    assert 10 not in _committed(url, server.endpoint)  # never reported durable
    mgr.save(20, state_at(20))  # retries step 10 first
    mgr.wait_durable()
    assert {s: st.state for s, st in mgr.durable_status().items()} == {10: DURABLE, 20: DURABLE}
    assert mgr.steps() == [20]  # step 10's local copy went only once its durable copy committed
    mgr.close()
    assert _committed(url, server.endpoint) == {10, 20}


def test_a_full_local_tier_fails_the_save_and_loses_nothing(tmp_path, server):
    url = f"s3://{server.bucket}/full"
    with mounted_tmpfs(tmp_path / "local", "size=10m") as local:
        root = local / "run"
        with CheckpointManager(root, Options(keep_last=3, durable=url, async_save=False,
                                             durable_options=_options(server.endpoint))) as mgr:
            mgr.save(10, state_at(10))
            mgr.save(20, state_at(20))
            with pytest.raises(CheckpointError):
                mgr.save(30, state_at(30))  # 3 x 4.3 MB do not fit in 10 MiB
            mgr.wait_durable()
            assert mgr.durable_steps() == [10, 20]
            assert_resumes(mgr, 20)


# -- a save straight into object storage (DataStatesWriter("s3://...")) under the same faults --


def _direct_state(seed):
    import torch

    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(3 << 20, generator=g), "b": torch.randn(1000, generator=g), "step": seed}


def test_a_direct_save_rides_out_a_503_storm(server, proxy):
    import torch.distributed.checkpoint as dcp

    from conftest import assert_same, zeros_like_state
    from dcp_datastates import DataStatesReader, DataStatesWriter

    url = f"s3://{server.bucket}/direct-storm/step_00000001"
    state = _direct_state(1)
    proxy.storm(5)
    dcp.save(state, storage_writer=DataStatesWriter(url, store_options=_options(proxy.endpoint)), no_dist=True)
    assert proxy.rejected == 5
    out = zeros_like_state(state)
    dcp.load(out, storage_reader=DataStatesReader(url, store_options={"endpoint": server.endpoint}), no_dist=True)
    assert_same(out, state)


def test_the_server_killed_mid_direct_save_commits_nothing_and_a_new_save_does(server, proxy):
    import threading

    import torch.distributed.checkpoint as dcp

    from conftest import assert_same, raises_from_checkpoint, zeros_like_state
    from dcp_datastates import DataStatesReader, DataStatesWriter
    from dcp_datastates.storage import StoreError

    url = f"s3://{server.bucket}/direct-killed/step_00000001"
    options = _options(proxy.endpoint, max_retries=1, retry_timeout_s=3, request_timeout_s=5)
    proxy.throttle(2e6)  # 12 MiB at 2 MB/s: the kill lands mid-upload
    killer = threading.Timer(1.0, server.kill)
    killer.start()
    with raises_from_checkpoint(StoreError, match="direct-killed/step_00000001/rank00000-"):
        dcp.save(_direct_state(2), storage_writer=DataStatesWriter(url, store_options=options), no_dist=True)
    killer.join()
    server.start()
    proxy.throttle(None)
    store = open_store(f"s3://{server.bucket}/direct-killed", endpoint=server.endpoint)
    assert "step_00000001/.metadata" not in store.list()  # never committed
    state = _direct_state(3)
    dcp.save(state, storage_writer=DataStatesWriter(url, store_options=_options(server.endpoint)), no_dist=True)
    out = zeros_like_state(state)
    dcp.load(out, storage_reader=DataStatesReader(url, store_options={"endpoint": server.endpoint}), no_dist=True)
    assert_same(out, state)
