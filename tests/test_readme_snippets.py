"""README's snippets that are not the training script, run as written: the plain
``dcp.async_save`` block with its fence (the checkpoint holds the parameters as they were when
the save was called, although the optimizer step right after it changes them), and the errors
section's way of catching a load's errors, and the two tiers' example (what it prints, and
that it leaves no folder behind)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import pytest
from dist_helpers import free_port

pytestmark = [pytest.mark.subprocess]

README = os.path.join(os.path.dirname(__file__), "..", "README.md")


def readme_block(first_line: str) -> str:
    blocks = re.findall(r"```python\n(.*?)```", open(README, encoding="utf-8").read(), flags=re.S)
    found = [b for b in blocks if b.startswith(first_line)]
    assert len(found) == 1, f"README.md has no (or more than one) python block starting with {first_line!r}"
    return found[0]


PRELUDE = """
import sys
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from dcp_datastates import DataStatesReader, DataStatesWriter

dist.init_process_group("gloo")
torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(8)])  # 32 MiB: copies take a while
optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
run, step = sys.argv[1], 7
model(torch.randn(32, 1024)).square().sum().backward()
optimizer.step()                                   # the moments exist before the save
model(torch.randn(32, 1024)).square().sum().backward()
state = {"model": model.state_dict(), "optim": optimizer.state_dict()}
expected = {k: v.clone() for k, v in model.state_dict().items()}
"""

CHECK = """
changed = [k for k, v in model.state_dict().items() if not torch.equal(v, expected[k])]
assert changed, "the optimizer step after the save changed nothing: the fence was not tested"
loaded = {"model": {k: torch.zeros_like(v) for k, v in expected.items()}}
dcp.load(loaded, storage_reader=DataStatesReader(f"{run}/step_{step}"))
wrong = [k for k, v in loaded["model"].items() if not torch.equal(v, expected[k])]
assert not wrong, f"the checkpoint holds parameters changed after the save: {wrong}"
print("checkpoint holds the state at the save;", len(changed), "tensors changed after it")
dist.destroy_process_group()
"""


def test_readme_async_save_block_with_the_fence(tmp_path):
    script = tmp_path / "async_save.py"
    script.write_text(PRELUDE + textwrap.dedent(readme_block("# plain dcp.async_save")) + CHECK)
    env = dict(os.environ, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, str(script), str(tmp_path / "run")], capture_output=True, text=True,
                          timeout=120, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "checkpoint holds the state at the save;" in proc.stdout


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_readme_catching_a_loads_errors(tmp_path):
    import torch
    import torch.distributed.checkpoint as dcp

    from dcp_datastates import ChecksumMismatchError, DataStatesWriter

    block = readme_block("# catching a load's errors")
    state = {"w": torch.arange(4096, dtype=torch.float32)}
    missing = {"state": dict(state), "path": str(tmp_path / "nope"), "dcp": dcp}
    exec(block, missing)  # the first except takes it: nothing escapes
    assert "errors" not in missing

    path = tmp_path / "ckpt"
    dcp.save(state, storage_writer=DataStatesWriter(path), no_dist=True)
    data = next(p for p in path.iterdir() if p.name.endswith(".data"))
    raw = bytearray(data.read_bytes())
    raw[100] ^= 0xFF
    data.write_bytes(bytes(raw))
    damaged = {"state": {"w": torch.zeros(4096)}, "path": str(path), "dcp": dcp}
    exec(block, damaged)
    assert isinstance(damaged["errors"][0], ChecksumMismatchError), damaged["errors"]


def test_readme_tiers_example_prints_what_it_says_and_cleans_up(tmp_path):
    block = readme_block("# a local tier and a durable one")
    env = dict(os.environ, TMPDIR=str(tmp_path), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, "-c", block], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[0] == "[5] [3, 4, 5]", proc.stdout
    assert lines[1] == "{1: 'deleted', 2: 'deleted', 3: 'durable', 4: 'durable', 5: 'durable'}", proc.stdout
    assert os.listdir(tmp_path) == []  # the shared tier's folder (TMPDIR) is gone, as is the local one
