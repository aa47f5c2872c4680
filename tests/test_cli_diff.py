"""``dcp-datastates diff``, end to end (``cli.run``, in this process) on real checkpoints.

Expected numbers are computed here with torch from the tensors the fixtures
saved, in float64, and compared with the tool's ``--json`` output.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp

from cli_checkpoints import run_cli
from dcp_datastates import DataStatesWriter
from dcp_datastates.tools.commands.diff import layer_of

pytestmark = pytest.mark.slow

RTOL = 1e-9


def cli(*args, check_rc=0):
    r = run_cli("diff", *args)
    if check_rc is not None:
        assert r.returncode == check_rc, f"rc {r.returncode}\nstdout:\n{r.stdout}\nstderr:\n{r.stderr}"
    return r


def diff_json(a, b, *extra):
    r = cli(a, b, "--json", "--quiet", *extra)
    return json.loads(r.stdout)


def one_line_error(r, *fragments):
    assert r.returncode == 1, r
    assert "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("dcp-datastates diff: error: "), lines[0]
    for f in fragments:
        assert f in lines[0], lines[0]
    assert r.stdout == ""


def num(x):
    """A JSON number, or the strings the tool writes for non-finite values."""
    return {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}.get(x, x) if isinstance(x, str) else x


def expected(a: torch.Tensor, b: torch.Tensor) -> dict:
    """The numbers diff must report for one tensor, computed whole in float64 (NaNs left out)."""
    wide = torch.complex128 if a.is_complex() else torch.float64
    x, y = a.reshape(-1).to(wide), b.reshape(-1).to(wide)
    nx, ny = torch.isnan(x), torch.isnan(y)
    both = ~(nx | ny)
    d = torch.where(x == y, torch.zeros((), dtype=wide), y - x)[both].abs()
    norm_a = float(torch.linalg.vector_norm(x[~nx]))
    delta = float(torch.linalg.vector_norm(d))
    ba = a.reshape(-1).contiguous().view(torch.uint8).reshape(a.numel(), a.element_size())
    bb = b.reshape(-1).contiguous().view(torch.uint8).reshape(b.numel(), b.element_size())
    return {
        "norm_a": norm_a, "norm_b": float(torch.linalg.vector_norm(y[~ny])), "delta": delta,
        "rel": (0.0 if delta == 0 else math.inf) if norm_a == 0 else delta / norm_a,
        "max_abs": float(d.max()) if d.numel() else 0.0,
        "changed": int((ba != bb).any(1).sum()) if a.numel() else 0,
        "nan_a": int(nx.sum()), "nan_b": int(ny.sum()),
    }


def assert_record(rec, exp):
    for field in ("norm_a", "norm_b", "delta", "rel", "max_abs"):
        got, want = num(rec[field]), exp[field]
        if math.isinf(want):
            assert got == want, (rec["key"], field, got, want)
        else:
            assert got == pytest.approx(want, rel=RTOL, abs=1e-300, nan_ok=True), (rec["key"], field, got, want)
    for field in ("changed", "nan_a", "nan_b"):
        assert rec[field] == exp[field], (rec["key"], field, rec[field], exp[field])


def save(state, path):
    dcp.save(state, storage_writer=DataStatesWriter(str(path)), no_dist=True)
    return str(path)


# ---------------------------------------------------------------------------
# numbers
# ---------------------------------------------------------------------------


def test_run_step_10_vs_30_numbers_top_and_objects(run_checkpoints):
    first, last = run_checkpoints.checkpoints[0], run_checkpoints.checkpoints[2]
    doc = diff_json(first.path, last.path, "--top", "5")
    records = {r["key"]: r for r in doc["tensors"]}
    assert list(records) == list(first.tensors)  # every tensor, in checkpoint order
    for key, a in first.tensors.items():
        rec = records[key]
        assert rec["dtype"] == str(a.dtype).removeprefix("torch.") and rec["shape"] == list(a.shape)
        assert rec["numel"] == a.numel()
        assert_record(rec, expected(a, last.tensors[key]))
    # global: sqrt(sum delta^2) / sqrt(sum ||A||^2)
    deltas = [expected(a, last.tensors[k])["delta"] for k, a in first.tensors.items()]
    norms = [float(torch.linalg.vector_norm(a.double())) for a in first.tensors.values()]
    assert num(doc["global_rel"]) == pytest.approx(math.hypot(*deltas) / math.hypot(*norms), rel=RTOL)
    # top-K: the 5 largest relative changes, largest first (ties by delta, then key order)
    order = sorted(doc["tensors"], key=lambda r: (num(r["rel"]), num(r["delta"])), reverse=True)
    assert doc["top"] == [r["key"] for r in order[:5]]
    assert doc["unchanged"] == 0 and doc["compared"] == len(first.tensors)
    assert doc["only_a"] == doc["only_b"] == doc["mismatched"] == []
    assert doc["objects_changed"] == [{"key": "step", "old": "10", "new": "30"}]
    assert doc["objects_same"] == len(first.objects) - 1
    assert doc["step_a"] == 10 and doc["step_b"] == 30
    assert doc["bytes_compared"] == sum(t.numel() * t.element_size() for t in first.tensors.values())

    # the table lists the same top-K in the same order, then the changed object
    r = cli(first.path, last.path, "--top", "5", "--quiet")
    lines = r.stdout.splitlines()
    head = next(i for i, ln in enumerate(lines) if ln.startswith("KEY"))
    assert head > 0 and "REL" in lines[head] and "||B-A||" in lines[head]
    assert [ln.split()[0] for ln in lines[head + 1:head + 6]] == doc["top"]
    top_rec = records[doc["top"][0]]
    assert f"{num(top_rec['rel']):.3e}" in lines[head + 1]
    assert "  step: 10 -> 30" in lines
    assert "unchanged: 0 of 24 tensors bit-identical" in lines
    assert r.stderr == ""


def test_checkpoint_against_itself_is_all_zero(run_checkpoints):
    path = run_checkpoints.checkpoints[1].path
    doc = diff_json(path, path)
    assert doc["tensors"] and all(num(r["rel"]) == 0 and r["changed"] == 0 and num(r["delta"]) == 0
                                  for r in doc["tensors"])
    assert doc["top"] == [] and doc["unchanged"] == doc["compared"] and num(doc["global_rel"]) == 0
    assert doc["objects_changed"] == []
    for r in doc["tensors"]:
        assert num(r["norm_a"]) == num(r["norm_b"])


def test_every_dtype_with_blocks(dtype_checkpoints, tmp_path):
    """Every dtype (bf16, float8 with NaNs, complex32, uint64, bool, 0-d, empty), small blocks,
    against stock DCP: B is each tensor rolled by one element."""
    import cli_checkpoints

    ours, stock = dtype_checkpoints
    state = cli_checkpoints.dtype_state()
    flat = cli_checkpoints.flatten(state)
    rolled = {k: (torch.roll(v.reshape(-1), 1).reshape(v.shape) if isinstance(v, torch.Tensor) else v)
              for k, v in flat.items()}
    b = str(tmp_path / "rolled")
    dcp.save(rolled, storage_writer=dcp.FileSystemWriter(b), no_dist=True)
    doc = diff_json(ours.path, b, "--block-bytes", "64KiB", "--top", "100")
    records = {r["key"]: r for r in doc["tensors"]}
    assert set(records) == set(ours.tensors)
    for key, a in ours.tensors.items():
        assert_record(records[key], expected(a, rolled[key].contiguous()))
    assert doc["format_a"] == "dcp_datastates" and doc["format_b"] == "dcp"
    assert any(r["nan_a"] for r in doc["tensors"])  # the float8 bit patterns include NaNs

    # ours vs stock DCP of the same state: identical bit for bit
    same = diff_json(ours.path, stock.path, "--block-bytes", "64KiB")
    assert same["unchanged"] == same["compared"] == len(ours.tensors)
    assert same["objects_changed"] == [] and same["objects_same"] == len(ours.objects)


def test_different_shardings_compare_box_by_box(sharded_checkpoint, tmp_path):
    """A: 2 ranks' DTensor shards; B: the same full tensors saved by one process."""
    full = save({**sharded_checkpoint.tensors, **sharded_checkpoint.objects}, tmp_path / "one")
    doc = diff_json(sharded_checkpoint.path, full, "--block-bytes", "1KiB")
    assert {r["key"] for r in doc["tensors"]} == set(sharded_checkpoint.tensors)
    assert all(r["changed"] == 0 and num(r["delta"]) == 0 and num(r["rel"]) == 0 for r in doc["tensors"])
    assert doc["only_a"] == doc["only_b"] == doc["mismatched"] == doc["objects_changed"] == []
    assert doc["objects_same"] == len(sharded_checkpoint.objects)
    for r in doc["tensors"]:
        t = sharded_checkpoint.tensors[r["key"]]
        assert num(r["norm_a"]) == pytest.approx(float(torch.linalg.vector_norm(t.double())), rel=RTOL)

    # the other way round (boxes from the 1-process chunks, read from the shards), with
    # one changed element: found, and nothing else reported
    changed = dict(sharded_checkpoint.tensors)
    big = changed["dt_big_s1"].clone()
    big[100, 200] += 1.0
    changed["dt_big_s1"] = big
    a = save({**changed, **sharded_checkpoint.objects}, tmp_path / "changed")
    doc = diff_json(a, sharded_checkpoint.path, "--block-bytes", "4KiB")
    assert {r["key"] for r in doc["tensors"]} == set(sharded_checkpoint.tensors)
    moved = [r for r in doc["tensors"] if r["changed"]]
    assert [r["key"] for r in moved] == ["dt_big_s1"] and doc["top"] == ["dt_big_s1"]
    assert_record(moved[0], expected(big, sharded_checkpoint.tensors["dt_big_s1"]))
    assert num(moved[0]["delta"]) == pytest.approx(1.0, rel=1e-6) and moved[0]["changed"] == 1


def test_mismatches_and_keys_on_one_side(tmp_path):
    import fractions  # not plain data: safe mode does not unpickle it

    a = save({"w": torch.ones(4, 3), "x": torch.ones(3), "gone": torch.ones(2), "k": torch.ones(1),
              "same": torch.arange(5.0), "cfg": {"lr": 0.1}, "when": fractions.Fraction(1, 3)}, tmp_path / "a")
    b = save({"w": torch.ones(5, 3), "x": torch.ones(3, dtype=torch.float64), "new": torch.ones(2), "k": 5,
              "same": torch.arange(5.0), "cfg": {"lr": 0.2}, "when": fractions.Fraction(2, 3)}, tmp_path / "b")
    doc = diff_json(a, b, "--keys", "[wxk]", "--keys", "gone", "--keys", "new", "--keys", "cfg.*")
    assert doc["keys"] == ["[wxk]", "gone", "new", "cfg.*"]
    assert doc["only_a"] == ["gone"] and doc["only_b"] == ["new"]
    assert doc["mismatched"] == [
        {"key": "w", "a": "float32 (4, 3)", "b": "float32 (5, 3)"},
        {"key": "x", "a": "float32 (3,)", "b": "float64 (3,)"},
        {"key": "k", "a": "float32 (1,)", "b": "object"},
    ]
    assert doc["tensors"] == []  # "same" is not selected by --keys
    assert doc["objects_changed"] == [{"key": "cfg.lr", "old": "0.1", "new": "0.2"}]
    assert doc["objects_skipped"] == []  # "when" is not selected either
    text = cli(a, b, "--quiet").stdout.splitlines()
    for line in ("only in A: 1", "  gone", "only in B: 1", "  new", "mismatched (not compared): 3",
                 "  w: float32 (4, 3) -> float32 (5, 3)", "  x: float32 (3,) -> float64 (3,)",
                 "  k: float32 (1,) -> object", "changed objects: 1", "  cfg.lr: 0.1 -> 0.2",
                 "unchanged: 1 of 1 tensors bit-identical", "objects not compared: 1",
                 "  when: not plain data: compare with --allow-pickle (trusted checkpoints only)"):
        assert line in text, (line, text)


def test_nan_and_inf_handling(tmp_path):
    nan, inf = math.nan, math.inf
    a = save({"v": torch.tensor([1.0, nan, 3.0, 4.0]), "i": torch.tensor([inf, 1.0]),
              "z": torch.zeros(3), "n": torch.tensor([nan, nan])}, tmp_path / "a")
    b = save({"v": torch.tensor([1.0, 2.0, nan, 5.0]), "i": torch.tensor([inf, 2.0]),
              "z": torch.tensor([0.0, 0.0, 2.0]), "n": torch.tensor([nan, 1.0])}, tmp_path / "b")
    doc = diff_json(a, b)
    r = {x["key"]: x for x in doc["tensors"]}
    # v: NaNs counted, left out; the rest still measured (only index 3 moved among non-NaN pairs)
    assert (r["v"]["nan_a"], r["v"]["nan_b"], r["v"]["changed"]) == (1, 1, 3)
    assert num(r["v"]["norm_a"]) == pytest.approx(math.sqrt(1 + 9 + 16), rel=RTOL)
    assert num(r["v"]["norm_b"]) == pytest.approx(math.sqrt(1 + 4 + 25), rel=RTOL)
    assert num(r["v"]["delta"]) == 1.0 and num(r["v"]["max_abs"]) == 1.0
    assert num(r["v"]["rel"]) == pytest.approx(1 / math.sqrt(26), rel=RTOL)
    # inf == inf moved by nothing; ||A|| is inf, so rel is 0
    assert r["i"]["norm_a"] == "inf" and num(r["i"]["delta"]) == 1.0 and num(r["i"]["rel"]) == 0.0
    # from all zeros: rel is inf (JSON string), listed first among the movers
    assert r["z"]["rel"] == "inf" and num(r["z"]["delta"]) == 2.0 and doc["top"][0] == "z"
    # all-NaN A: norm 0, nothing comparable
    assert (r["n"]["nan_a"], r["n"]["nan_b"], num(r["n"]["norm_a"]), num(r["n"]["delta"])) == (2, 1, 0.0, 0.0)
    assert num(doc["global_rel"]) == 0.0 or math.isfinite(num(doc["global_rel"]))
    text = cli(a, b, "--quiet").stdout
    assert "NaNs (left out of the norms):" in text and "  v: 1 in A, 1 in B" in text
    assert "inf" in text


# ---------------------------------------------------------------------------
# the plot
# ---------------------------------------------------------------------------


def test_plot_writes_a_png(run_checkpoints, tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.image

    out = tmp_path / "change.png"
    first, last = run_checkpoints.checkpoints[0], run_checkpoints.checkpoints[2]
    doc = diff_json(first.path, last.path, "--plot", out)
    assert doc["plot"] == str(out)
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    img = matplotlib.image.imread(str(out))
    assert img.ndim == 3 and img.shape[0] >= 200 and img.shape[1] >= 300
    assert float(img[..., :3].std()) > 0.05  # not a blank canvas


def test_layer_grouping():
    assert layer_of("model.layers.3.attn.wq.weight") == "model.layers.3"
    assert layer_of("model.2.weight") == "model.2"
    assert layer_of("model.embed.weight") == "model.embed"
    assert layer_of("w") == "w"


def test_plot_without_matplotlib(run_checkpoints, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    first = run_checkpoints.checkpoints[0].path
    r = cli(first, first, "--plot", tmp_path / "x.png", check_rc=None)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert r.stderr.strip() == ("dcp-datastates diff: error: diff --plot needs matplotlib: "
                                "pip install 'dcp_datastates[plot]'")
    assert not (tmp_path / "x.png").exists()


# ---------------------------------------------------------------------------
# bad input
# ---------------------------------------------------------------------------


def test_bad_checkpoints(run_checkpoints, tmp_path):
    good = run_checkpoints.checkpoints[0].path
    missing = tmp_path / "nope"
    one_line_error(cli(good, missing, check_rc=None), str(missing))

    empty = tmp_path / "empty"
    empty.mkdir()
    one_line_error(cli(good, empty, check_rc=None), str(empty))

    uncommitted = tmp_path / "uncommitted"
    uncommitted.mkdir()
    (uncommitted / "rank00000-0123456789ab.data").write_bytes(b"\0" * 64)
    one_line_error(cli(uncommitted, good, check_rc=None), str(uncommitted))

    one_line_error(cli(good, good, "--keys", "no.such.*", check_rc=None), "no.such.*")


def test_corrupted_byte_is_an_error(run_checkpoints, tmp_path):
    src = run_checkpoints.checkpoints[2].path
    copy = tmp_path / "corrupt"
    shutil.copytree(src, copy)
    data = sorted(p for p in os.listdir(copy) if p.startswith("rank") and p.endswith(".data"))[0]
    with open(copy / data, "r+b") as f:
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0xFF]))
    r = cli(run_checkpoints.checkpoints[0].path, copy, "--quiet", check_rc=None)
    one_line_error(r, str(copy))


def test_help():
    r = cli("--help")
    assert r.returncode == 0
    for opt in ("CKPT_A", "CKPT_B", "--top", "--keys", "--plot", "--json", "--block-bytes", "--quiet"):
        assert opt in r.stdout
