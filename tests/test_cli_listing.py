"""``dcp-datastates ls / inspect / verify / du``, end to end.

Each test runs the real command (``cli.run``, in this process; a few through
``python -m dcp_datastates``, as a user does) on the session's real
checkpoints (or on a copy it damages) and checks exit codes, tables and JSON
against what the checkpoint holds.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import shutil

import pytest

from cli_checkpoints import run_cli as cli, run_program
from dcp_datastates.manager.checkpoint_root import write_latest
from dcp_datastates.tools.checkpoint_view import CheckpointView
from dcp_datastates.tools.commands.inspect import rank_numbers
from dcp_datastates.tools.common import human_bytes
from dcp_datastates.format.checkpoint_layout import FORMAT_VERSION


FAKE_RANK_FILE = "rank00000-0123456789ab.data"


def cli_all(*argvs: list[str]):
    """Run several commands (results in the order given)."""
    return [cli(*argv) for argv in argvs]


def assert_one_line_error(r, *fragments: str) -> None:
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert "Traceback" not in r.stderr + r.stdout
    lines = (r.stdout + r.stderr).strip().splitlines()
    assert len(lines) == 1, lines
    for f in fragments:
        assert f in lines[0], lines[0]


def file_sizes(path: str) -> dict[str, os.stat_result]:
    return {name: os.lstat(os.path.join(path, name)) for name in os.listdir(path)}


def row_of(stdout: str, name: str) -> str:
    rows = [ln for ln in stdout.splitlines() if re.search(rf"(^|\s){re.escape(name)}(\s|$)", ln)]
    assert len(rows) == 1, (name, stdout)
    return rows[0]


def test_helpers_render_sizes_and_rank_lists():
    assert human_bytes(0) == "0 B"
    assert human_bytes(1023) == "1023 B"
    assert human_bytes(1536) == "1.5 KiB"
    assert human_bytes(5 << 30) == "5.0 GiB"
    names = [f"rank{r:05d}-0123456789ab.data" for r in (3, 0, 1, 2, 7)]
    assert rank_numbers(names) == "0-3,7"
    assert rank_numbers(["__0_0.distcp"]) == "__0_0.distcp"


@pytest.mark.subprocess
def test_help_of_each_command_exits_0():
    for cmd in ("ls", "inspect", "verify", "du"):
        r = run_program(cmd, "--help") if cmd == "ls" else cli(cmd, "--help")  # one as the user runs it
        assert r.returncode == 0, r.stderr
        assert f"dcp-datastates {cmd}" in r.stdout


@pytest.mark.subprocess
@pytest.mark.slow
def test_the_program_lists_and_fails_verify_with_status_1(run_checkpoints, tmp_path):
    """``python -m dcp_datastates``: the same table and exit status as the in-process entry."""
    listed = run_program("ls", run_checkpoints.root)
    assert listed.returncode == 0 and listed.stdout == cli("ls", run_checkpoints.root).stdout, listed.stderr
    failed = run_program("verify", tmp_path / "missing")
    assert failed.returncode == 1 and failed.stdout.startswith(f"NOT FOUND: {tmp_path / 'missing'}"), failed


# ---------------------------------------------------------------------------
# ls
# ---------------------------------------------------------------------------


@pytest.fixture
def run_root(run_checkpoints, tmp_path):
    """A copy of the run root with a ``latest`` pointer, an uncommitted and a corrupt step."""
    root = str(tmp_path / "run")
    shutil.copytree(run_checkpoints.root, root)
    write_latest(root, 30)
    os.makedirs(os.path.join(root, "step_00000040"))
    with open(os.path.join(root, "step_00000040", FAKE_RANK_FILE), "wb") as f:
        f.write(b"x" * 1000)
    os.makedirs(os.path.join(root, "step_00000050"))
    with open(os.path.join(root, "step_00000050", ".metadata"), "wb") as f:
        f.write(b"garbage, not a pickle")
    os.makedirs(os.path.join(root, "notes"))  # not a checkpoint: not listed
    return root


def test_ls_run_root_states_latest_and_json(run_root, run_checkpoints):
    table, js = cli_all(["ls", run_root], ["ls", run_root, "--json"])
    assert table.returncode == 0 and js.returncode == 0, (table.stderr, js.stderr)
    assert "Traceback" not in table.stderr

    expect = {10: "committed", 20: "committed", 30: "committed", 40: "incomplete", 50: "corrupt"}
    for step, state in expect.items():
        row = row_of(table.stdout, f"step_{step:08d}")
        cells = row.lstrip("* ").split()
        assert cells[0] == str(step) and cells[2] == state, row
        assert row.startswith("*") == (step == 30), row
    assert "notes" not in table.stdout
    footer = table.stdout.strip().splitlines()[-1]
    assert footer.startswith("5 checkpoints") and "3 committed" in footer and "latest (step 30)" in footer
    # The corrupt one says why, naming its file.
    assert os.path.join(run_root, "step_00000050", ".metadata") in table.stdout

    doc = json.loads(js.stdout)
    assert doc["root"] == run_root and doc["latest"] == 30
    rows = doc["checkpoints"]
    assert [r["step"] for r in rows] == [10, 20, 30, 40, 50]
    assert [r["state"] for r in rows] == [expect[s] for s in (10, 20, 30, 40, 50)]
    assert [r["latest"] for r in rows] == [False, False, True, False, False]
    for r in rows:
        assert r["path"] == os.path.join(run_root, r["name"])
        assert r["bytes"] == sum(st.st_size for st in file_sizes(r["path"]).values())
    for r, saved in zip(rows[:3], run_checkpoints.checkpoints):
        assert r["ranks"] == 1
        assert r["keys"] == len(CheckpointView(saved.path).keys()) == len(saved.tensors) + len(saved.objects)
        mtime = os.stat(os.path.join(r["path"], ".metadata")).st_mtime
        assert r["modified"] == datetime.datetime.fromtimestamp(mtime).isoformat(timespec="seconds")
    assert rows[3]["ranks"] is None and rows[3]["keys"] is None and rows[3]["bytes"] == 1000
    assert rows[4]["error"] and ".metadata" in rows[4]["error"]


def test_ls_edge_cases(tmp_path, sharded_checkpoint):
    empty = tmp_path / "empty"
    empty.mkdir()
    bad_pointer = tmp_path / "bad_pointer"
    shutil.copytree(sharded_checkpoint.path, bad_pointer / "step_00000001")
    (bad_pointer / "latest").write_text("not json")
    missing, nothing, pointer, single = cli_all(
        ["ls", str(tmp_path / "nope")], ["ls", str(empty)], ["ls", str(bad_pointer)], ["ls", sharded_checkpoint.path],
    )
    assert_one_line_error(missing, "nope", "no such file or directory")
    assert nothing.returncode == 0 and nothing.stdout.strip() == f"no checkpoints under {empty}"
    # A malformed pointer is a warning; the listing is still printed.
    assert pointer.returncode == 0, pointer.stderr
    assert "warning" in pointer.stderr and str(bad_pointer / "latest") in pointer.stderr
    assert "Traceback" not in pointer.stderr
    assert row_of(pointer.stdout, "step_00000001").split()[2] == "committed"
    # One checkpoint directory lists just itself: 2 ranks, no step.
    cells = row_of(single.stdout, "sharded").split()
    assert cells[:3] == ["-", "sharded", "committed"] and cells[5] == "2"  # SIZE is two cells: "296.0 KiB"


def test_ls_shows_the_steps_of_a_torchtitan_run(tmp_path, sharded_checkpoint):
    """torchtitan's checkpointer (ours included) names its folders step-N: ls shows N."""
    run = tmp_path / "outputs" / "checkpoint"
    for step in (10, 200):
        shutil.copytree(sharded_checkpoint.path, run / f"step-{step}")
    table = cli("ls", str(run))
    assert table.returncode == 0, table.stderr
    for step in (10, 200):
        cells = row_of(table.stdout, f"step-{step}").split()
        assert cells[:3] == [str(step), f"step-{step}", "committed"], cells


# ---------------------------------------------------------------------------
# inspect
# ---------------------------------------------------------------------------


def test_inspect_sharded_matches_metadata(sharded_checkpoint):
    path = sharded_checkpoint.path
    chunks_out, js = cli_all(["inspect", path, "--chunks"], ["inspect", path, "--json"])
    assert chunks_out.returncode == 0 and js.returncode == 0, (chunks_out.stderr, js.stderr)
    view = CheckpointView(path)
    doc = json.loads(js.stdout)
    assert doc["format"] == "dcp_datastates" and doc["ranks"] == 2
    assert doc["save_id"] == view.reader.layout.save_id
    assert [k["key"] for k in doc["keys"]] == view.keys()
    assert doc["tensors"] == len(sharded_checkpoint.tensors) and doc["objects"] == len(sharded_checkpoint.objects)
    assert {f["name"]: f["bytes"] for f in doc["files"]} == {
        n: st.st_size for n, st in file_sizes(path).items()
    }
    sharded_keys = 0
    for k in doc["keys"]:
        if k["kind"] == "object":
            assert k["key"] in sharded_checkpoint.objects and k["bytes"] > 0
            continue
        ref = sharded_checkpoint.tensors[k["key"]]
        md = view.tensors[k["key"]]
        assert k["shape"] == list(ref.shape) == list(md.size)
        assert k["dtype"] == str(ref.dtype).removeprefix("torch.")
        assert k["bytes"] == ref.numel() * ref.element_size()
        assert [(c["offsets"], c["sizes"]) for c in k["chunks"]] == [
            (list(c.offsets), list(c.sizes)) for c in md.chunks
        ]
        assert [(c["file"], c["offset"], c["length"]) for c in k["chunks"]] == [
            (c.file, c.offset, c.length) for c in view.stored_chunks(k["key"])
        ]
        sharded_keys += len({c["file"] for c in k["chunks"]}) == 2
        # The table row: kind, dtype, global shape, chunk count, ranks holding it.
        row = row_of(chunks_out.stdout, k["key"])
        ranks = sorted({int(c["file"][4:9]) for c in k["chunks"]})
        ranks_text = "0-1" if ranks == [0, 1] else str(ranks[0])
        assert re.search(
            rf"^{re.escape(k['key'])}\s+tensor\s+{k['dtype']}\s+{re.escape(str(k['shape']))}\s+{len(md.chunks)}\s+.*\s"
            rf"{ranks_text}$", row,
        ), row
    assert sharded_keys >= 4  # the Shard(0)/Shard(1) tensors live in both rank files
    chunk_lines = [ln for ln in chunks_out.stdout.splitlines() if ln.startswith("    offsets ")]
    assert len(chunk_lines) == sum(len(md.chunks) for md in view.tensors.values())
    assert f"dcp_datastates version {FORMAT_VERSION}" in chunks_out.stdout


def test_inspect_stock_dcp(dtype_checkpoints):
    _, stock = dtype_checkpoints
    table, js = cli_all(["inspect", stock.path], ["inspect", stock.path, "--json"])
    assert table.returncode == 0 and js.returncode == 0, (table.stderr, js.stderr)
    doc = json.loads(js.stdout)
    assert doc["format"] == "dcp" and doc["ranks"] == 1
    tensors = {k["key"]: k for k in doc["keys"] if k["kind"] == "tensor"}
    assert set(tensors) == set(stock.tensors)
    for key, ref in stock.tensors.items():
        assert tensors[key]["shape"] == list(ref.shape), key
        assert tensors[key]["dtype"] == str(ref.dtype).removeprefix("torch."), key
        assert [c["file"] for c in tensors[key]["chunks"]] == ["__0_0.distcp"]
    assert tensors["model.shape.scalar"]["shape"] == [] and tensors["model.shape.empty"]["shape"] == [0, 4]
    assert {k["key"] for k in doc["keys"] if k["kind"] == "object"} == set(stock.objects)
    assert "stock DCP" in table.stdout
    row = row_of(table.stdout, "model.float8.e5m2fnuz")
    assert row.split()[1:4] == ["tensor", "float8_e5m2fnuz", "[33,"] and row.endswith("__0_0.distcp")


# ---------------------------------------------------------------------------
# verify
# ---------------------------------------------------------------------------


def test_verify_ok_and_every_kind_of_failure(sharded_checkpoint, dtype_checkpoints, tmp_path):
    good = sharded_checkpoint.path
    damaged = str(tmp_path / "damaged")
    shutil.copytree(good, damaged)
    chunk = next(c for c in CheckpointView(damaged).stored_chunks("dt_s0") if c.file.startswith("rank00001"))
    with open(os.path.join(damaged, chunk.file), "r+b") as f:
        f.seek(chunk.offset + 5)
        byte = f.read(1)
        f.seek(chunk.offset + 5)
        f.write(bytes([byte[0] ^ 0x40]))
    uncommitted = tmp_path / "uncommitted"
    uncommitted.mkdir()
    (uncommitted / FAKE_RANK_FILE).write_bytes(b"\0" * 64)
    missing = str(tmp_path / "missing")

    ok, bad, inspect_bad, unc, several, nope, stock = cli_all(
        ["verify", good], ["verify", damaged], ["inspect", damaged], ["verify", str(uncommitted)],
        ["verify", good, damaged, missing], ["verify", missing], ["verify", dtype_checkpoints[1].path],
    )
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert ok.stdout.startswith(f"OK: {good}: 2 rank file(s)")

    assert bad.returncode == 1 and "Traceback" not in bad.stderr
    assert bad.stdout.startswith(f"CORRUPT: {damaged}")
    assert os.path.join(damaged, chunk.file) in bad.stdout and "'dt_s0'" in bad.stdout
    # inspect reads metadata and indexes only: a damaged data byte does not concern it.
    assert inspect_bad.returncode == 0, inspect_bad.stderr

    assert unc.returncode == 1 and "Traceback" not in unc.stderr
    assert unc.stdout.startswith(f"NOT COMMITTED: {uncommitted}") and "incomplete" in unc.stdout

    assert several.returncode == 1
    assert f"OK: {good}:" in several.stdout and f"CORRUPT: {damaged}" in several.stdout
    assert f"NOT FOUND: {missing}" in several.stdout
    assert several.stdout.strip().splitlines()[-1] == "3 checkpoints: 1 OK, 2 failed"

    assert_one_line_error(nope, missing, "no such file or directory")

    assert stock.returncode == 1 and "Traceback" not in stock.stderr
    assert "not a dcp_datastates checkpoint (stock DCP has no checksums to verify)" in stock.stdout


# ---------------------------------------------------------------------------
# du
# ---------------------------------------------------------------------------


def test_du_counts_every_file_and_strays(run_checkpoints, tmp_path):
    root = str(tmp_path / "run")
    shutil.copytree(run_checkpoints.root, root)
    step10 = os.path.join(root, "step_00000010")
    with open(os.path.join(step10, FAKE_RANK_FILE), "wb") as f:  # a killed save's rank file
        f.write(b"s" * 3000)
    with open(os.path.join(step10, ".metadata.0123456789ab.tmp"), "wb") as f:  # an interrupted commit
        f.write(b"t" * 200)
    with open(os.path.join(step10, "README"), "w") as f:  # not ours to call stray
        f.write("hello\n")
    step40 = os.path.join(root, "step_00000040")
    os.makedirs(step40)
    with open(os.path.join(step40, FAKE_RANK_FILE), "wb") as f:
        f.write(b"u" * 500)

    js, table, missing = cli_all(["du", root, step10, "--json"], ["du", root], ["du", str(tmp_path / "nope")])
    assert js.returncode == 0 and table.returncode == 0, (js.stderr, table.stderr)
    doc = json.loads(js.stdout)
    rows = {os.path.basename(u["path"]): u for u in doc["checkpoints"]}
    assert list(rows) == ["step_00000010", "step_00000020", "step_00000030", "step_00000040"]  # step10 once
    for name, u in rows.items():
        stats = file_sizes(os.path.join(root, name))
        assert u["files"] == len(stats)
        assert u["apparent_bytes"] == sum(st.st_size for st in stats.values())
        assert u["allocated_bytes"] == sum(st.st_blocks * 512 for st in stats.values())
        assert u["apparent_bytes"] == u["checkpoint_bytes"] + u["stray_bytes"] + u["other_bytes"]
    named = set(CheckpointView(step10).files())
    u10 = rows["step_00000010"]
    assert u10["checkpoint_bytes"] == sum(os.path.getsize(os.path.join(step10, n)) for n in named)
    assert u10["stray_bytes"] == 3200 and u10["other_bytes"] == 6
    assert sorted(u10["stray_files"]) == sorted([FAKE_RANK_FILE, ".metadata.0123456789ab.tmp"])
    assert rows["step_00000020"]["stray_bytes"] == 0
    assert rows["step_00000040"]["state"] == "incomplete" and rows["step_00000040"]["stray_bytes"] == 500
    for key, value in doc["total"].items():
        assert value == sum(u[key] for u in doc["checkpoints"]), key

    last = table.stdout.strip().splitlines()
    assert last[-2].startswith("TOTAL (4 checkpoints)")
    assert last[-1].startswith(f"{human_bytes(3700)} reclaimable")
    assert row_of(table.stdout, os.path.join(root, "step_00000040")).split()[1] == "incomplete"
    assert_one_line_error(missing, "nope")


def test_usage_sorts_a_checkpoints_files_by_one_rule():
    """du's rule, the same for a directory and a durable tier: named files are the checkpoint's,
    what a save leaves behind (a drain's confirmations too) is stray, the rest is other; all of an
    uncommitted checkpoint is stray; of a corrupt one only the .metadata temporaries are sure."""
    from dcp_datastates.tools.commands.du import usage

    stray_rank = "rank00001-0123456789ab.data"
    files = [(".metadata", 10, 4096), (FAKE_RANK_FILE, 100, 4096), (stray_rank, 1000, 4096),
             (".metadata.0123456789ab.tmp", 7, 0), (".drain/rank00000.json", 20, 0), ("README", 3, 4096)]
    u = usage("ckpt", 5, "committed", files, [".metadata", FAKE_RANK_FILE])
    assert (u.checkpoint_bytes, u.stray_bytes, u.other_bytes) == (110, 1027, 3)
    assert u.stray_files == [stray_rank, ".metadata.0123456789ab.tmp", ".drain/rank00000.json"]
    assert (u.files, u.apparent_bytes, u.allocated_bytes) == (6, 1140, 4 * 4096)
    for state in ("incomplete", "draining"):
        u = usage("ckpt", 5, state, files, None)
        assert (u.checkpoint_bytes, u.stray_bytes, u.other_bytes) == (0, 1140, 0)
    u = usage("ckpt", 5, "corrupt", files, None)
    assert (u.checkpoint_bytes, u.stray_bytes, u.other_bytes) == (0, 7, 1133)


def test_a_step_url_and_a_root_url(tmp_path):
    from dcp_datastates.tools.checkpoints import split_step_url
    from dcp_datastates.tools.commands.verify import locations

    assert split_step_url("s3://b/run/step_00000010") == ("s3://b/run", "step_00000010")
    assert split_step_url("s3://b/run/") == ("s3://b/run", None)
    assert locations("s3://b/run/step_00000010") == ["s3://b/run/step_00000010"]  # no request made
    assert locations(str(tmp_path)) == [str(tmp_path)]  # a directory is verified as it is
