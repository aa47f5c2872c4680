"""Child side of the crash-consistency tests (tests/test_crash.py).

Run as ``python crash_child.py PLAN_JSON RESULTS_JSONL``. The plan lists
trials; each trial saves step 1 of a deterministic state dict (committed),
then saves step 2 and is killed by SIGKILL somewhere inside that save:

* by an armed fault rule (``action="kill"``) at one chosen I/O operation;
* right after ``dcp.async_save`` returned, while the snapshot is staging;
* by a timer thread after a random delay drawn over a save's duration.

Scenario ``new`` saves step 1 into ``<trial>/A`` and step 2 into ``<trial>/B``;
scenario ``overwrite`` saves both into ``<trial>/X`` (step 2 with
``overwrite=True``). The pytest process then checks the directories.

Importing torch costs seconds, so by default this process imports it once
and forks one grandchild per trial (and per probe); it creates no engine,
writer or tensor itself, so each grandchild starts clean. The grandchild
reports progress through a pipe (markers), and this process reports how it
died. ``"fork": false`` runs the single trial of the plan in this process
instead (it is then this process that dies by SIGKILL; markers go to stdout).

Before the trials, one probe grandchild per mode finds, with
``action="error"`` rules, how many fsyncs whose path contains the checkpoint
directory come before the directory fsync that precedes the rename (file
paths contain the directory path, so a rule naming the directory also
matches every file fsync in it). With ``"time_step2": true`` it then times
a few dry runs (trials without a kill) per mode and scenario: a random delay
is a fraction of step 2's expected duration, estimated in each trial as the
step-1 save it just timed times the dry runs' median step-2/step-1 ratio (so
the delays follow the machine's load when other tests share its cores).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from dcp_datastates import DataStatesWriter
from dcp_datastates.native.faults import arm, clear

KiB = 1 << 10
MiB = 1 << 20
# A small pool and window: several windows per save, back-pressure while staging,
# and an engine that is cheap to create in every grandchild.
WRITER_KW = dict(host_cache_bytes=2 * MiB, window_bytes=1 * MiB)
GRANDCHILD_TIMEOUT_S = 60.0
DRY_RUNS = 3  # default per mode and scenario: trials without a kill, timing steps 1 and 2
# Offset of the targeted mid-data kill: inside the big tensor, 4 KiB aligned (O_DIRECT).
MID_DATA_OFFSET = 1536 * KiB


def make_state(seed: int, step: int) -> dict:
    """The state dict of (seed, step): about 3 MiB; every tensor differs between steps."""
    g = torch.Generator().manual_seed(seed * 1000 + step)
    return {
        "model": {
            "big": torch.randn(640, 1024, generator=g),  # 2.5 MiB float32, spans several windows
            "bf16": torch.randn(300, 700, generator=g).to(torch.bfloat16),  # 410 KiB
            "transposed": torch.randn(257, 129, generator=g).t(),  # non-contiguous view, 130 KiB
            "bias": torch.randn(37, generator=g),  # tiny
        },
        "ids": torch.randint(-(2**62), 2**62, (20000,), generator=g, dtype=torch.int64),  # 156 KiB
        "scale": torch.tensor(float(step) + 0.25),  # 0-d
        "small_i64": torch.arange(5, dtype=torch.int64) * (seed + step),
        "meta": {"step": step, "seed": seed, "name": f"run-{seed}-step-{step}", "tag": "x" * (step + 3)},
    }


def empty_like_state(state):
    """A load target with the same structure (strides included), zeros and placeholders."""
    if isinstance(state, torch.Tensor):
        return torch.zeros_like(state)
    if isinstance(state, dict):
        return {k: empty_like_state(v) for k, v in state.items()}
    return type(state)()


def unwrap(exc: BaseException) -> BaseException:
    if isinstance(exc, CheckpointException):
        return next(iter(exc.failures.values()))[0]
    return exc


def save(state, path, mode: str, **writer_kw) -> None:
    writer = DataStatesWriter(path, **WRITER_KW, **writer_kw)
    if mode == "sync":
        dcp.save(state, storage_writer=writer, no_dist=True)
    else:
        dcp.async_save(state, storage_writer=writer, no_dist=True).upload_completion.result()


def trial_dirs(root: str, trial: dict) -> tuple[str | None, str]:
    """(directory of step 1 if it differs from step 2's, directory of step 2)."""
    base = os.path.join(root, trial["id"])
    if trial["scenario"] == "new":
        return os.path.join(base, "A"), os.path.join(base, "B")
    return None, os.path.join(base, "X")


# -- what a grandchild does -------------------------------------------------------


def run_trial(root: str, trial: dict, probes: dict, emit) -> None:
    """Save step 1, then step 2 and die inside it. Returns only if no kill came."""
    mode, seed = trial["mode"], trial["seed"]
    first, target = trial_dirs(root, trial)
    state1 = make_state(seed, 1)
    t1 = time.perf_counter()
    save(state1, first or target, mode)
    t1 = time.perf_counter() - t1
    emit(f"STEP1_COMMITTED {t1:.6f}")
    state2 = make_state(seed, 2)
    kw = {"overwrite": True} if trial["scenario"] == "overwrite" else {}
    kill = trial["kill"]
    writer = DataStatesWriter(target, **WRITER_KW, **kw)
    if kill["kind"] == "fault":
        skip_base = probes.get(mode, {}).get("dir_fsync_skip", {}).get(trial["scenario"])
        for rule in kill["rules"]:
            rule = dict(rule)
            op = rule.pop("op")
            if rule.get("path") == "<DIR>":
                rule["path"] = target
            if isinstance(rule.get("skip"), str):  # "K+n": n after the calibrated count
                assert skip_base is not None, "no probe calibrated the directory fsync"
                rule["skip"] = skip_base + int(rule["skip"].split("+")[1])
            arm(op, action="kill", **rule)
    elif kill["kind"] == "staging":
        # Backstop: should this process be descheduled between async_save's return and
        # its kill for as long as the rest of the save takes, it still dies before the
        # data is durable (the kill stays inside the save, as planned).
        arm("fsync", path=".data", action="kill")
    elif kill["kind"] == "timer":
        # Step 2 is expected to take step2_ratio x the step-1 save just measured in this
        # process, under the machine's present load (other tests may share its cores).
        delay = kill["frac"] * probes[mode]["step2_ratio"][trial["scenario"]] * t1
        emit(f"DELAY {delay:.6f}")
        timer = threading.Timer(delay, os.kill, (os.getpid(), signal.SIGKILL))
        timer.daemon = True
    emit("STEP2_STARTED")
    t0 = time.perf_counter()
    if kill["kind"] == "timer":
        timer.start()
    if mode == "sync":
        dcp.save(state2, storage_writer=writer, no_dist=True)
    else:
        resp = dcp.async_save(state2, storage_writer=writer, no_dist=True)
        if kill["kind"] == "staging":
            emit(f"STAGING_DONE {int(resp.staging_completion.done())}")
            os.kill(os.getpid(), signal.SIGKILL)
        resp.upload_completion.result()
    emit(f"STEP2_RETURNED {time.perf_counter() - t0:.6f}")
    if kill["kind"] == "timer":  # the delay outlasted the save: the kill lands after the commit
        time.sleep(GRANDCHILD_TIMEOUT_S)
    elif kill["kind"] != "none":
        emit("NOT KILLED")


def run_probe(root: str, mode: str, emit) -> None:
    """Find how many fsyncs in the directory precede the directory's own fsync."""
    base = os.path.join(root, f"probe-{mode}")
    state = make_state(0, 1)
    result = {"mode": mode, "dir_fsync_skip": {}, "calibration": {}}
    for scenario in ("new", "overwrite"):
        seen = []
        for k in range(10):
            d = os.path.join(base, f"{scenario}{k}")
            kw = {}
            if scenario == "overwrite":
                save(state, d, mode)
                kw["overwrite"] = True
            writer = DataStatesWriter(d, **WRITER_KW, **kw)
            arm("fsync", path=d, skip=k, action="error")
            try:
                if mode == "sync":
                    dcp.save(make_state(0, 2), storage_writer=writer, no_dist=True)
                else:
                    dcp.async_save(make_state(0, 2), storage_writer=writer, no_dist=True).upload_completion.result()
                failed_on = None
            except BaseException as exc:  # noqa: BLE001 - reported, judged by the test
                inner = unwrap(exc)
                # A failure after the rename is reported as "committed, not durable",
                # chained to the OSError that names the directory.
                cause = inner.__cause__ if isinstance(inner.__cause__, OSError) else inner
                failed_on = getattr(cause, "filename", None) or f"{type(inner).__name__}: {inner}"
            finally:
                clear()
            try:
                writer.close()  # raises (and so drains) this writer's background error
            except Exception:  # noqa: BLE001
                pass
            committed = os.path.exists(os.path.join(d, ".metadata"))
            where = "DIR" if failed_on == d else (os.path.basename(failed_on) if failed_on else None)
            seen.append([k, where, committed])
            if failed_on is None:
                break
        result["calibration"][scenario] = seen
        dir_hits = [k for k, where, _ in seen if where == "DIR"]
        result["dir_fsync_skip"][scenario] = dir_hits[0] if dir_hits else None
    emit("PROBE " + json.dumps(result))


# -- the process that forks them ----------------------------------------------------


def fork_and_wait(fn, timeout: float) -> dict:
    """Run ``fn(emit)`` in a forked grandchild; return how it ended and what it emitted."""
    r, w = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # grandchild
        os.close(r)
        code = 0
        try:
            def emit(line: str) -> None:
                os.write(w, (line + "\n").encode())

            fn(emit)
        except BaseException:  # noqa: BLE001 - reported to the test
            import traceback

            os.write(w, ("ERROR " + json.dumps(traceback.format_exc())).encode() + b"\n")
            code = 2
        finally:
            os._exit(code)
    os.close(w)
    t0 = time.monotonic()
    chunks = []
    os.set_blocking(r, False)
    hung = False
    while True:
        try:
            data = os.read(r, 65536)
            if data:
                chunks.append(data)
        except BlockingIOError:
            pass
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() - t0 > timeout:
            hung = True
            os.kill(pid, signal.SIGKILL)
            _, status = os.waitpid(pid, 0)
            break
        time.sleep(0.002)
    os.set_blocking(r, True)
    while True:
        data = os.read(r, 65536)
        if not data:
            break
        chunks.append(data)
    os.close(r)
    out = {
        "wall_s": time.monotonic() - t0,
        "hung": hung,
        "signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
        "exitcode": os.WEXITSTATUS(status) if os.WIFEXITED(status) else None,
        "markers": b"".join(chunks).decode(errors="replace").splitlines(),
    }
    return out


def main() -> None:
    plan_path, results_path = sys.argv[1], sys.argv[2]
    with open(plan_path) as f:
        plan = json.load(f)
    root = plan["root"]
    probes: dict = {}
    if not plan.get("fork", True):
        # One trial, in this process: it dies by SIGKILL (markers on stdout).
        def emit(line: str) -> None:
            print(line, flush=True)

        (trial,) = plan["trials"]
        run_trial(root, trial, plan.get("probes", {}), emit)
        sys.exit(3)  # not killed

    # Forking is only safe while this process has started no threads of its own
    # (no engine, no writer, no torch ops: each grandchild creates its own).
    assert threading.active_count() == 1, threading.enumerate()
    with open(results_path, "w") as out:
        for mode in plan.get("probe", []):
            res = fork_and_wait(lambda emit, mode=mode: run_probe(root, mode, emit), GRANDCHILD_TIMEOUT_S)
            line = next((m for m in res["markers"] if m.startswith("PROBE ")), None)
            if line is not None:
                probes[mode] = probe = json.loads(line[len("PROBE "):])
                # The scale of the random delays: in dry runs (no kill), how long step 2
                # takes relative to step 1 (median), and the median step 2 itself.
                probe["step2_ratio"], probe["step2_s"], probe["dry_runs"] = {}, {}, {}
                for scenario in ("new", "overwrite") if plan.get("time_step2") else ():
                    runs = []
                    for i in range(plan.get("dry_runs", DRY_RUNS)):
                        dry = dict(id=f"dry-{mode}-{scenario}-{i}", mode=mode, scenario=scenario, seed=i,
                                   kill=dict(kind="none"))
                        r = fork_and_wait(lambda emit, t=dry: run_trial(root, t, probes, emit), GRANDCHILD_TIMEOUT_S)
                        one = [m for m in r["markers"] if m.startswith("STEP1_COMMITTED ")]
                        two = [m for m in r["markers"] if m.startswith("STEP2_RETURNED ")]
                        if r["exitcode"] != 0 or not one or not two:
                            res["exitcode"], res["markers"] = 4, res["markers"] + [f"DRY RUN FAILED {r}"]
                            break
                        runs.append((float(one[0].split()[1]), float(two[0].split()[1])))
                    probe["dry_runs"][scenario] = runs
                    if runs:
                        probe["step2_ratio"][scenario] = sorted(b / a for a, b in runs)[len(runs) // 2]
                        probe["step2_s"][scenario] = sorted(b for _, b in runs)[len(runs) // 2]
                res["markers"] = [
                    "PROBE " + json.dumps(probe) if m.startswith("PROBE ") else m for m in res["markers"]
                ]
            res["probe"] = mode
            out.write(json.dumps(res) + "\n")
            out.flush()
        for trial in plan["trials"]:
            res = fork_and_wait(lambda emit, trial=trial: run_trial(root, trial, probes, emit), GRANDCHILD_TIMEOUT_S)
            res["trial"] = trial
            out.write(json.dumps(res) + "\n")
            out.flush()


if __name__ == "__main__":
    main()
