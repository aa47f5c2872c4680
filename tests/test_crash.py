"""Crash consistency: a save killed by SIGKILL anywhere never costs the last committed checkpoint.

A child process (tests/support/crash_child.py) saves step 1 of a deterministic state
dict (committed), then saves step 2 and is killed inside that save: at chosen
I/O operations of the data write, the index and metadata writes, the fsyncs,
the rename that commits, the directory fsyncs around it and (asynchronous
saves) while staging, or by a timer at a random point of the save. Two
scenarios: step 2 into a new directory, and step 2 over step 1 in the same
directory (``overwrite=True``). Then, in this process:

* step 1 loads bit-exactly (from its own directory, or from the overwritten
  one while the overwrite had not committed);
* the interrupted directory is either committed and loads step 2 bit-exactly
  (the kill came after the rename), or is refused with
  ``IncompleteCheckpointError`` saying "incomplete" (new directory), or still
  loads step 1 (overwrite) -- never a mixture;
* a new save into the interrupted directory succeeds and loads: leftovers of
  the killed save confuse nothing.

The child imports torch once and forks one grandchild per kill (see
crash_child.py), which keeps a kill at about 0.1 s. CI runs every targeted
point once for sync and async saves and a dozen random kills; the long
version (``-m long``) runs 200 random kills (``CRASH_SEED`` picks the seed).
"""

from __future__ import annotations

import collections
import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest
import torch.distributed.checkpoint as dcp

from conftest import assert_same, load, raises_from_checkpoint, unwrap
from crash_child import MID_DATA_OFFSET, WRITER_KW, empty_like_state, make_state, trial_dirs
from dcp_datastates import CheckpointNotFoundError, DataStatesReader, DataStatesWriter, IncompleteCheckpointError
from dcp_datastates.format.file_names import DATA_FILE_RE, METADATA_FILE

pytestmark = [pytest.mark.subprocess, pytest.mark.slow]

CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "support", "crash_child.py")
CI_RANDOM_KILLS = 12
SLOW_RANDOM_KILLS = 200
RANDOM_SPAN = 1.3  # random delays are drawn in [0, 1.3 x step 2's expected duration]

# Targeted kill points: (name, rules, when). Rules are armed with action="kill" in the
# child; "<DIR>" is the directory of step 2, and skip "K+n" is n fsyncs after the K
# file fsyncs the probe counted before the directory fsync that precedes the rename.
# ``when`` says whether the kill comes before or after the rename that commits.
TARGETED = [
    ("data_write", [dict(op="write", path=".data", offset=MID_DATA_OFFSET)], "before"),
    ("data_fsync", [dict(op="fsync", path=".data")], "before"),
    ("index_write", [dict(op="write", path=".index", offset=24)], "before"),
    ("index_fsync", [dict(op="fsync", path=".index")], "before"),
    ("metadata_tmp_write", [dict(op="write", path=".metadata.", offset=64)], "before"),
    ("metadata_tmp_fsync", [dict(op="fsync", path=".metadata.")], "before"),
    ("dir_fsync_before_rename", [dict(op="fsync", path="<DIR>", skip="K+0")], "before"),
    ("rename", [dict(op="rename", path=".metadata")], "before"),
    ("dir_fsync_after_rename", [dict(op="fsync", path="<DIR>", skip="K+1")], "after"),
]
# Overwrite only: the directory fsync after the old checkpoint's files were removed.
OVERWRITE_ONLY = [("dir_fsync_after_removing_old", [dict(op="fsync", path="<DIR>", skip="K+2")], "after")]


# -- running the child ------------------------------------------------------------


def run_child(tmp_path, trials, probe=(), fork=True, timeout=240, time_step2=False, dry_runs=3):
    """Run crash_child.py on a plan; returns (probes by mode, trial results, root)."""
    root = str(tmp_path / "runs")
    plan = dict(root=root, fork=fork, probe=list(probe), trials=trials, time_step2=time_step2, dry_runs=dry_runs)
    plan_path, results_path = tmp_path / "plan.json", tmp_path / "results.jsonl"
    plan_path.write_text(json.dumps(plan))
    proc = subprocess.run(
        [sys.executable, CHILD, str(plan_path), str(results_path)],
        capture_output=True, text=True, timeout=timeout, cwd=os.path.dirname(CHILD),
    )
    if not fork:
        return proc, root
    assert proc.returncode == 0, f"crash child failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}"
    lines = [json.loads(line) for line in results_path.read_text().splitlines()]
    probes, results = {}, []
    for res in lines:
        if "probe" in res:
            assert res["exitcode"] == 0 and not res["hung"], f"probe {res['probe']} failed: {res['markers']}"
            marker = next(m for m in res["markers"] if m.startswith("PROBE "))
            probes[res["probe"]] = json.loads(marker[len("PROBE "):])
        else:
            results.append(res)
    assert len(results) == len(trials), f"the child reported {len(results)} of {len(trials)} trials"
    return probes, results, root


def check_probe(probe):
    """The calibrated skip reaches the directory fsyncs around the rename, nothing else."""
    k = probe["dir_fsync_skip"]["new"]
    assert k is not None and k == probe["dir_fsync_skip"]["overwrite"], probe
    new, over = probe["calibration"]["new"], probe["calibration"]["overwrite"]
    # new directory: K -> directory fsync, not committed; K+1 -> directory fsync, committed; then none
    assert new[k][1:] == ["DIR", False] and new[k + 1][1:] == ["DIR", True], new
    assert new[k + 2][1] is None and all(e[1] != "DIR" for e in new[:k]), new
    # overwrite: three directory fsyncs (before, after the rename, after removing old files)
    assert [e[1] for e in over[k : k + 4]] == ["DIR", "DIR", "DIR", None], over


# -- checking one killed trial ------------------------------------------------------


def our_files(path):
    """Kinds of dcp_datastates files in ``path`` (data, index, tmp, metadata) by name."""
    if not os.path.isdir(path):
        return {}
    out = {}
    for name in os.listdir(path):
        m = DATA_FILE_RE.match(name)
        if m:
            out[name] = m.group(4)
        elif name == METADATA_FILE:
            out[name] = "metadata"
        elif name.startswith(METADATA_FILE + "."):
            out[name] = "tmp"
    return out


def load_or_fail(state, path, label):
    """``load``, turning any error into an assertion that names the trial."""
    try:
        return load(state, path)
    except BaseException as exc:  # noqa: BLE001 - CheckpointException is a BaseException
        inner = unwrap(exc)
        raise AssertionError(
            f"{label}: {path} does not load: {type(inner).__name__}: {inner}; files {sorted(os.listdir(path))}"
        ) from exc


def describe(res):
    t = res["trial"]
    return f"trial {t['id']} ({t['mode']}, {t['scenario']}, seed {t['seed']}, kill {t['kill']})"


def check_killed_trial(res, root):
    """Check one trial's directories after the kill; returns its outcome.

    Outcomes: "committed" (step 2 committed and loads bit-exactly), "incomplete"
    (new directory refused as incomplete), "nothing" (new directory killed before
    it held any file of the save), "old" (overwrite not committed: step 1 loads).
    """
    t, label = res["trial"], describe(res)
    markers = res["markers"]
    errors = [m for m in markers if m.startswith("ERROR ")]
    assert not errors, f"{label}: the child raised:\n{json.loads(errors[0][6:])}"
    assert not res["hung"], f"{label}: not killed within the timeout; markers {markers}"
    assert res["signal"] == signal.SIGKILL, (
        f"{label}: expected death by SIGKILL, got signal {res['signal']} / exit code {res['exitcode']}; "
        f"markers {markers}"
    )
    started = any(m.startswith("STEP1_COMMITTED") for m in markers) and "STEP2_STARTED" in markers
    assert started, f"{label}: killed before step 2 began: {markers}"
    seed = t["seed"]
    step1, step2 = make_state(seed, 1), make_state(seed, 2)
    first, target = trial_dirs(root, t)
    if first is not None:
        loaded = load_or_fail(empty_like_state(step1), first, label)
        assert_same(loaded, step1, f"{label}: step 1 in {first}")
    committed = os.path.exists(os.path.join(target, METADATA_FILE))
    if t["scenario"] == "new":
        if committed:
            assert_same(load_or_fail(empty_like_state(step2), target, label), step2, f"{label}: committed step 2")
            outcome = "committed"
        else:
            files = our_files(target)
            # A kill before the save created any file leaves nothing to call incomplete.
            outcome = "incomplete" if files else "nothing"
            expected, match = {
                "incomplete": (IncompleteCheckpointError, "incomplete"),
                "nothing": (CheckpointNotFoundError, "no checkpoint"),
            }[outcome]
            try:
                DataStatesReader(target).read_metadata()
            except expected as exc:
                assert match in str(exc), f"{label}: {match!r} not in {exc}"
            except Exception as exc:  # noqa: BLE001
                raise AssertionError(f"{label}: expected {expected.__name__}, got {type(exc).__name__}: {exc}") from exc
            else:
                raise AssertionError(f"{label}: the interrupted checkpoint was read as committed; files {files}")
            with raises_from_checkpoint((expected, AssertionError), match=match):
                load(empty_like_state(step2), target)
            assert not DataStatesReader.validate_checkpoint_id(target), label
    else:
        assert committed, f"{label}: the overwrite lost the committed checkpoint: {sorted(os.listdir(target))}"
        loaded = load_or_fail(empty_like_state(step2), target, label)
        step = loaded["meta"]["step"]
        assert step in (1, 2), f"{label}: loaded step {step}"
        assert_same(loaded, make_state(seed, step), f"{label}: {target} (step {step})")
        outcome = "committed" if step == 2 else "old"
    if any(m.startswith("STEP2_RETURNED") for m in markers):
        assert outcome == "committed", f"{label}: the save returned but the checkpoint reads as {outcome}"
    return outcome


def save_again_and_check(res, root, outcome):
    """A new save into the interrupted directory succeeds and loads; leftovers confuse nothing."""
    t, label = res["trial"], describe(res)
    seed = t["seed"]
    _, target = trial_dirs(root, t)
    step3 = make_state(seed, 3)
    # A directory whose save never committed takes a plain save (overwrite=False).
    overwrite = t["scenario"] == "overwrite" or outcome == "committed"
    writer = DataStatesWriter(target, overwrite=overwrite, **WRITER_KW)
    if t["mode"] == "sync":
        dcp.save(step3, storage_writer=writer, no_dist=True)
    else:
        dcp.async_save(step3, storage_writer=writer, no_dist=True).upload_completion.result(timeout=60)
        writer.close()
    loaded = load_or_fail(empty_like_state(step3), target, label)
    assert_same(loaded, step3, f"{label}: new save after the crash")
    # The new save removed the checkpoint it replaced (if any); what is left beside it
    # can only be the killed save's own files (not referenced by .metadata).
    names = set(our_files(target))
    return len(names) - 3  # orphaned files (beyond .metadata + data + index)


def check_expected_files(res, root, name):
    """The targeted kill landed where it was aimed (judged by the files it left)."""
    t, label = res["trial"], describe(res)
    _, target = trial_dirs(root, t)
    files = our_files(target)
    sizes = {n: os.path.getsize(os.path.join(target, n)) for n in files}
    kinds = collections.Counter(files.values())  # overwrite: the step-1 files are counted too
    msg = f"{label}: kill point {name} left {sorted(files.items())} ({sizes})"
    if name == "index_write":
        torn = [n for n, k in files.items() if k == "index" and sizes[n] == 24]
        assert torn, f"{msg}: expected an index torn at 24 bytes"
    elif name == "metadata_tmp_write":
        assert any(k == "tmp" and sizes[n] == 64 for n, k in files.items()), f"{msg}: expected a tmp torn at 64 bytes"
    elif name in ("data_fsync", "staging", "data_write"):
        if t["scenario"] == "new":
            assert kinds["index"] == 0, f"{msg}: no index is written before the data is durable"
    elif name in ("dir_fsync_before_rename", "rename"):
        assert kinds["tmp"] == 1, f"{msg}: the metadata is written before the commit"
    elif name in ("dir_fsync_after_rename", "dir_fsync_after_removing_old"):
        assert kinds["tmp"] == 0 and METADATA_FILE in files, msg
        if name == "dir_fsync_after_removing_old":
            assert kinds["data"] == 1 and kinds["index"] == 1, f"{msg}: the old files should be gone"
        elif t["scenario"] == "overwrite":
            assert kinds["data"] == 2 and kinds["index"] == 2, f"{msg}: the old files are removed after this fsync"


# -- targeted kills -------------------------------------------------------------------


def targeted_trials(mode):
    trials = []
    for scenario in ("new", "overwrite"):
        points = TARGETED + (OVERWRITE_ONLY if scenario == "overwrite" else [])
        for i, (name, rules, when) in enumerate(points):
            trials.append(dict(id=f"{mode}-{scenario}-{name}", mode=mode, scenario=scenario, seed=100 + i,
                               kill=dict(kind="fault", rules=rules), point=name, when=when))
        if mode == "async":
            trials.append(dict(id=f"{mode}-{scenario}-staging", mode=mode, scenario=scenario, seed=150,
                               kill=dict(kind="staging"), point="staging", when="before"))
    return trials


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_targeted_kills_keep_the_committed_checkpoint(tmp_path, mode):
    """Every targeted kill point, in a new directory and over a committed one."""
    trials = targeted_trials(mode)
    probes, results, root = run_child(tmp_path, trials, probe=[mode])
    check_probe(probes[mode])
    outcomes = collections.Counter()
    for res in results:
        t = res["trial"]
        outcome = check_killed_trial(res, root)
        expected = "committed" if t["when"] == "after" else ("incomplete" if t["scenario"] == "new" else "old")
        assert outcome == expected, f"{describe(res)}: killed {t['when']} the rename, read as {outcome}"
        check_expected_files(res, root, t["point"])
        save_again_and_check(res, root, outcome)
        outcomes[(t["scenario"], outcome)] += 1
    # Both sides of the commit were reached in both scenarios, as planned.
    planned = collections.Counter(
        (t["scenario"], "committed" if t["when"] == "after" else ("incomplete" if t["scenario"] == "new" else "old"))
        for t in trials
    )
    assert outcomes == planned, outcomes
    assert outcomes[("new", "committed")] == 1 and outcomes[("overwrite", "committed")] == 2, outcomes


def test_kill_in_a_plain_subprocess_without_fork(tmp_path):
    """The same check without the fork machinery: the child itself dies at the rename."""
    trial = dict(id="plain", mode="sync", scenario="new", seed=7,
                 kill=dict(kind="fault", rules=[dict(op="rename", path=".metadata")]))
    proc, root = run_child(tmp_path, [trial], fork=False, timeout=120)
    assert proc.returncode == -signal.SIGKILL, f"rc {proc.returncode}\n{proc.stdout}\n{proc.stderr[-3000:]}"
    markers = proc.stdout.splitlines()
    res = {"trial": trial, "markers": markers, "hung": False, "signal": signal.SIGKILL, "exitcode": None}
    assert check_killed_trial(res, root) == "incomplete"
    save_again_and_check(res, root, "incomplete")


# -- random kills ---------------------------------------------------------------------


def random_trials(n, seed):
    rng = random.Random(seed)
    trials = []
    for i in range(n):
        mode = ("sync", "async")[i % 2]
        scenario = ("new", "overwrite")[(i // 2) % 2]
        trials.append(dict(id=f"r{i:04d}-{mode}-{scenario}", mode=mode, scenario=scenario, seed=1000 + i,
                           kill=dict(kind="timer", frac=rng.uniform(0, RANDOM_SPAN))))
    return trials


def run_random_kills(tmp_path, n, seed, dry_runs):
    t0 = time.perf_counter()
    probes, results, root = run_child(tmp_path, random_trials(n, seed), probe=["sync", "async"],
                                      timeout=max(240, 3 * n), time_step2=True, dry_runs=dry_runs)
    t_child = time.perf_counter() - t0
    outcomes, files_left, orphans = collections.Counter(), collections.Counter(), collections.Counter()
    for res in results:
        t = res["trial"]
        try:
            outcome = check_killed_trial(res, root)
            _, target = trial_dirs(root, t)
            kinds = collections.Counter(our_files(target).values())
            files_left[(t["scenario"], outcome, tuple(sorted(kinds.items())))] += 1
            returned = any(m.startswith("STEP2_RETURNED") for m in res["markers"])
            outcomes[(t["mode"], t["scenario"], outcome, "after save returned" if returned else "during save")] += 1
            orphans[(t["scenario"], outcome)] += save_again_and_check(res, root, outcome)
        except AssertionError as exc:
            where = f"random kills, CRASH_SEED={seed}, dry runs {probes[t['mode']]['dry_runs']}"
            raise AssertionError(f"[{where}] {exc}") from exc
    elapsed = time.perf_counter() - t0
    summary = {
        "seed": seed,
        "kills": len(results),
        "dry_run_step2_s": {m: {k: round(v, 4) for k, v in p["step2_s"].items()} for m, p in probes.items()},
        "step2_over_step1": {m: {k: round(v, 2) for k, v in p["step2_ratio"].items()} for m, p in probes.items()},
        "child_s": round(t_child, 1),
        "total_s": round(elapsed, 1),
        "outcomes": {" / ".join(k): v for k, v in sorted(outcomes.items())},
        "files_left": {f"{s} {o} {dict(k)}": v for (s, o, k), v in sorted(files_left.items())},
        "orphans_after_resave": {" ".join(k): v for k, v in sorted(orphans.items())},
    }
    print("\ncrash summary: " + json.dumps(summary, indent=1))
    return outcomes, summary


def test_random_kills_keep_the_committed_checkpoint(tmp_path):
    """A dozen kills at random points of sync and async saves (both scenarios)."""
    outcomes, _ = run_random_kills(tmp_path, CI_RANDOM_KILLS, seed=20240601, dry_runs=3)
    assert sum(outcomes.values()) == CI_RANDOM_KILLS


@pytest.mark.long
def test_random_kills_long(tmp_path):
    """200 random kills; prints a summary (outcomes, files left, time). Run with -m long -s."""
    seed = int(os.environ.get("CRASH_SEED", time.time_ns() % 1_000_000))
    outcomes, summary = run_random_kills(tmp_path, SLOW_RANDOM_KILLS, seed, dry_runs=5)
    by = collections.Counter()
    for (_, _, outcome, _), n in outcomes.items():
        by["committed" if outcome == "committed" else "not committed"] += n
    # With delays up to 1.3 x a save, kills land on both sides of the commit.
    assert by["committed"] > 0 and by["not committed"] > 0, summary
