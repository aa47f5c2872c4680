"""README's training loop, run as written with torchrun: FSDP2 on 2 ranks, then a resume on 1
rank from the 2-rank checkpoint, which must reach the same loss bit for bit as a run that was
never interrupted (every rank trains on the same batch, so 1 and 2 ranks compute the same)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from dist_helpers import free_port

pytestmark = [pytest.mark.slow, pytest.mark.dist, pytest.mark.subprocess]

README = os.path.join(os.path.dirname(__file__), "..", "README.md")


def readme_training_script() -> str:
    blocks = re.findall(r"```python\n(.*?)```", open(README, encoding="utf-8").read(), flags=re.S)
    scripts = [b for b in blocks if b.startswith("# train.py")]
    assert len(scripts) == 1, "README.md has no (or more than one) python block starting with '# train.py'"
    return scripts[0]


def _run(script: str, procs: int, root: str, steps: int) -> str:
    """torchrun for 2 ranks; 1 rank as one plain process (what torchrun would set, without its agent)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    if procs == 1:
        env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        cmd = [sys.executable, script, root, str(steps)]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={procs}", script, root, str(steps)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [line for line in proc.stdout.splitlines() if line.startswith("started after step ")][-1]


def test_readme_loop_resumes_on_fewer_ranks_bit_exact(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(readme_training_script())
    first = _run(str(script), 2, str(tmp_path / "run"), 60)
    assert first.startswith("started after step 0; at step 60 ") and first.endswith("checkpoints [20, 40, 60]"), first
    resumed = _run(str(script), 1, str(tmp_path / "run"), 100)
    uninterrupted = _run(str(script), 1, str(tmp_path / "reference"), 100)
    assert resumed.startswith("started after step 60; at step 100 loss "), resumed
    assert resumed.split("; ", 1)[1] == uninterrupted.split("; ", 1)[1], (resumed, uninterrupted)
    assert resumed.endswith("checkpoints [60, 80, 100]")
