"""What the package logs (``logging.getLogger("dcp_datastates...")``): a line per save, commit,
retention deletion, resume choice and durable copy at INFO, and nothing on stderr unless the
application configures logging."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_datastates import CheckpointManager, CheckpointManagerOptions, DataStatesReader, DataStatesWriter


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(256, 64, generator=g), "step": seed}


def _messages(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name.startswith("dcp_datastates")]


def test_a_save_and_a_load_log_bytes_seconds_and_the_commit(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="dcp_datastates")
    path = str(tmp_path / "ckpt")
    dcp.save(_state(1), storage_writer=DataStatesWriter(path), no_dist=True)
    dcp.load(_state(2), storage_reader=DataStatesReader(path), no_dist=True)
    wrote, committed, read = (
        [m for m in _messages(caplog) if m.startswith(prefix)] for prefix in ("rank 0 wrote ", "committed ", "read ")
    )
    assert len(wrote) == 1 and f" to {path} in " in wrote[0] and " GB/s)" in wrote[0], wrote
    assert int(wrote[0].split()[3]) >= 256 * 64 * 4  # bytes, the tensor's at least
    assert committed == [f"committed {path}: 1 rank file(s), commit " + committed[0].rsplit("commit ", 1)[1]]
    assert len(read) == 1 and f"from {path} in " in read[0], read
    assert {r.name for r in caplog.records if r.name.startswith("dcp_datastates")} == {
        "dcp_datastates.core.writer", "dcp_datastates.core.reader"}


def test_the_manager_logs_commits_retention_and_the_resume_choice(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="dcp_datastates")
    root = tmp_path / "run"
    with CheckpointManager(root, CheckpointManagerOptions(keep_last=2, durable=str(tmp_path / "durable"))) as mgr:
        assert mgr.load(_state(0)) is None
        assert f"resume: {root} did not exist before this run: starting from scratch" in _messages(caplog)
        for step in (1, 2, 3):
            mgr.save(step, _state(step)).result()
        mgr.wait_durable()
    messages = _messages(caplog)
    asynchronous = [m for m in messages if m.startswith("rank 0 wrote ")]
    assert len(asynchronous) == 3 and all("async: the caller was blocked " in m for m in asynchronous), asynchronous
    for step in (1, 2, 3):
        assert f"step {step} committed in {root / f'step_{step:08d}'}; latest -> step {step}" in messages
    assert f"retention (keep_last=2, keep_every=None): deleted {root / 'step_00000001'}" in messages
    copied = [m for m in messages if m.startswith("step 3: rank 0 copied ")]
    assert len(copied) == 1 and copied[0].endswith("; the durable copy is committed"), copied

    # A resume names the step it chose and where from; a bad step is skipped with the reason, at INFO.
    (root / "step_00000003" / ".metadata").write_bytes(b"not a checkpoint")
    caplog.clear()
    with CheckpointManager(root, CheckpointManagerOptions(keep_last=2)) as mgr:
        with pytest.warns(UserWarning, match="skipping the checkpoint of step 3 "):
            assert mgr.load(_state(0)) == 2
    messages = _messages(caplog)
    assert any(m.startswith("skipping the checkpoint of step 3 ") for m in messages), messages
    resumed = [m for m in messages if m.startswith("resumed from step 2 ")]
    assert resumed == [f"resumed from step 2 from {root / 'step_00000002'} in " + resumed[0].split(" in ")[1]], messages
    assert resumed[0].endswith("s (newest known: step 3)"), resumed


def test_an_empty_root_and_a_resumed_step_are_named(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="dcp_datastates")
    root = tmp_path / "run"
    root.mkdir()
    with CheckpointManager(root, CheckpointManagerOptions(async_save=False)) as mgr:
        assert mgr.load(_state(0)) is None
        mgr.save(5, _state(5))
    assert f"resume: {root} holds no committed checkpoint: starting from scratch" in _messages(caplog)
    caplog.clear()
    with CheckpointManager(root) as mgr:
        assert mgr.load(_state(0)) == 5
    resumed = [m for m in _messages(caplog) if m.startswith("resumed from step 5 ")]
    assert len(resumed) == 1 and resumed[0].startswith(f"resumed from step 5 from {root / 'step_00000005'} in "), resumed


@pytest.mark.subprocess
@pytest.mark.slow
def test_nothing_reaches_stderr_unless_logging_is_configured(tmp_path):
    script = textwrap.dedent("""
        import logging, sys, torch, torch.distributed.checkpoint as dcp
        from dcp_datastates import CheckpointManager, CheckpointManagerOptions
        state = {"w": torch.ones(64, 64)}
        with CheckpointManager(sys.argv[1], CheckpointManagerOptions(keep_last=1)) as mgr:
            mgr.load(state)
            for step in (1, 2):
                mgr.save(step, state).result()
        if len(sys.argv) > 2:
            logging.basicConfig(level=logging.INFO, format="%(name)s %(message)s")
            with CheckpointManager(sys.argv[1]) as mgr:
                mgr.load(state)
    """)
    # Every warning is an error (DCP's own about running without a process group aside).
    env = dict(os.environ, PYTHONWARNINGS="error,ignore:torch.distributed is disabled:UserWarning")
    quiet = subprocess.run([sys.executable, "-c", script, str(tmp_path / "a")], capture_output=True, text=True, env=env)
    assert quiet.returncode == 0 and quiet.stderr == "", quiet.stderr
    told = subprocess.run([sys.executable, "-c", script, str(tmp_path / "b"), "log"], capture_output=True, text=True, env=env)
    assert told.returncode == 0, told.stderr
    assert "dcp_datastates.manager.checkpoint_manager resumed from step 2 from " in told.stderr, told.stderr
