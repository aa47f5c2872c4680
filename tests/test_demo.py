"""End-to-end test of the demo: train on 2 ranks, crash, resume on 1 rank, compare.

The full scenario runs in a subprocess (it spawns its own ranks) with a tiny
model, so it takes well under a minute on 2 CPU cores.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from dcp_datastates.demo.__main__ import parse_args
from dcp_datastates.demo.model import global_batch, lr_at
from dcp_datastates.demo.report import check_continuation, check_replica, latest_committed_checkpoint

pytestmark = [pytest.mark.subprocess, pytest.mark.dist, pytest.mark.slow]

FAIL_AT = 26  # a few steps after the step-20 save, which is usually committed by then
TINY = ["--vocab", "128", "--seq-len", "32", "--d-model", "64", "--layers", "2", "--heads", "2", "--batch", "8"]


def _run_demo(tmp_path, *extra: str, timeout: float = 180) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "dcp_datastates.demo", "--steps", "30", "--ckpt-every", "10", "--fail-at", str(FAIL_AT),
           "--dir", str(tmp_path / "demo"), "--timeout", "150", *TINY, *extra]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        print(proc.stdout[-6000:])
        print(proc.stderr[-6000:], file=sys.stderr)
    return proc


def _summary(out: str) -> str:
    assert "SUMMARY" in out, out[-3000:]
    return out[out.index("SUMMARY"):]


def test_demo_crash_and_resume_on_fewer_ranks(tmp_path):
    proc = _run_demo(tmp_path)  # P=2 before the failure, M=1 after
    assert proc.returncode == 0
    summary = _summary(proc.stdout)
    assert "RESULT: PASS" in summary
    assert "loss curve: CONTINUOUS" in summary
    # Step 20's async save may still be in flight when every rank dies (a loaded
    # machine): then it is lost, as in a real crash, and the run resumes from step 10.
    committed = re.search(r"last committed checkpoint: step (\d+) \((\d+) finished step\(s\) lost", summary)
    assert committed, summary
    resume_step, lost = int(committed[1]), int(committed[2])
    assert resume_step in (10, 20), summary
    assert lost == FAIL_AT - 1 - resume_step
    assert f"resumed run: 1 rank(s) from {tmp_path / 'demo'}/datastates/step_{resume_step:08d}" in proc.stdout
    assert "loaded 2-rank checkpoint on 1 rank(s)" in summary
    assert "failing run matched the reference: bit-exact" in summary
    assert "ours vs DCP's: " in summary and "identical" in summary
    # the CheckpointManager kept the newest 3 (10 and 20, of the failed run or saved again after the resume; 30)
    assert "keep_last=3): steps [10, 20, 30], latest -> 30" in summary
    assert "nan MB" not in proc.stdout  # one checkpoint paired with DCP's: no "at most +nan MB after"
    # --dir was removed at the end (no --keep)
    assert not (tmp_path / "demo").exists()


@pytest.mark.long
def test_demo_resume_on_same_world_size_is_bit_exact(tmp_path):
    proc = _run_demo(tmp_path, "--resume-procs", "2", "--keep")
    assert proc.returncode == 0
    summary = _summary(proc.stdout)
    assert "RESULT: PASS" in summary
    assert "bit-exact: yes; checked with exact equality (M == P)" in summary
    assert (tmp_path / "demo" / "datastates" / "step_00000030" / ".metadata").is_file()


def test_latest_committed_checkpoint_skips_uncommitted(tmp_path):
    for step, committed in [(10, True), (20, True), (30, False)]:
        d = tmp_path / f"step_{step:06d}"
        d.mkdir()
        (d / "rank00000-abc.data").write_bytes(b"x")
        if committed:
            (d / ".metadata").write_bytes(b"m")
    (tmp_path / "step_junk").mkdir()
    assert latest_committed_checkpoint(str(tmp_path)) == (20, str(tmp_path / "step_000020"))
    assert latest_committed_checkpoint(str(tmp_path / "missing")) is None


def test_global_batch_depends_only_on_seed_and_step():
    a = global_batch(7, 3, 8, 16, 64)
    b = global_batch(7, 3, 8, 16, 64)
    c = global_batch(7, 4, 8, 16, 64)
    assert all(x.equal(y) for x, y in zip(a, b))
    assert not a[0].equal(c[0])
    assert a[0][:, 1:].equal(a[1][:, :-1])  # targets are the inputs shifted by one


@pytest.mark.parametrize(
    "argv",
    [
        ["--fail-at", "10", "--ckpt-every", "10"],  # no checkpoint before the failure
        ["--steps", "20", "--fail-at", "30"],
        ["--nprocs", "2", "--resume-procs", "3", "--batch", "8"],  # 8 rows cannot form 6 shards
    ],
)
def test_demo_rejects_bad_arguments(argv):
    with pytest.raises(SystemExit) as exc:
        parse_args(argv)
    assert exc.value.code == 2


def test_lr_schedule_warms_up_then_decays_to_a_tenth():
    assert lr_at(5, 1.0, 10, 100) == 0.5
    assert lr_at(10, 1.0, 10, 100) == 1.0
    assert lr_at(11, 1.0, 10, 100) < 1.0
    assert lr_at(100, 1.0, 10, 100) == pytest.approx(0.1)
    assert lr_at(150, 1.0, 10, 100) == pytest.approx(0.1)  # flat after the horizon


def test_demo_help_exits_cleanly(capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args(["--help"])
    assert exc.value.code == 0
    assert "--resume-procs" in capsys.readouterr().out


def test_checks_name_the_first_diverging_step():
    reference = {s: 1.0 for s in range(1, 11)}
    resumed = {s: 1.0 for s in range(6, 11)}
    resumed[8] = 1.001
    exact = check_continuation(reference, resumed, 5, 10, same_world=True, rtol=1e-5)
    assert not exact.continuous and not exact.bit_exact and exact.first_bad == 8
    assert exact.problems == [
        "the resumed loss curve diverges from the reference (first at step 8, max |diff| 1.000e-03, "
        "max rel 1.000e-03; exact equality (M == P))"
    ]
    loose = check_continuation(reference, resumed, 5, 10, same_world=False, rtol=1e-2)
    assert loose.continuous and not loose.bit_exact and loose.problems == []
    del resumed[9]
    assert "did not log steps [9]" in check_continuation(reference, resumed, 5, 10, same_world=False,
                                                         rtol=1e-2).problems[0]


def test_replica_check_before_the_failure():
    reference = {s: float(s) for s in range(1, 11)}
    assert check_replica(reference, dict(reference), 6, "cpu").problems == []
    off = {**reference, 3: 3.5}
    assert check_replica(off, reference, 6, "cpu").max_diff == 0.5
    assert check_replica(off, reference, 6, "cuda").problems == []  # reported, not failed, off CPU
    assert "did not log steps [4, 5]" in check_replica(reference, {1: 1.0, 2: 2.0, 3: 3.0}, 6, "cpu").problems[0]
