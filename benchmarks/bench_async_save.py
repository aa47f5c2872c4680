#!/usr/bin/env python
"""Asynchronous save benchmark: how long dcp.async_save blocks the caller, when
the state is staged (safe to mutate), when it is durable, and how much host
memory it takes, for DCP's stagers and for dcp_datastates, in one run on the
same in-memory state, in host memory (--device cpu) or in GPU memory
(--device cuda: staging is then a device-to-host copy).

    python benchmarks/bench_async_save.py [--quick] [--dir DIR] [--reps N] [--json OUT]
                                          [--device cpu|cuda] [--budget-s S]
                                          [--cache-mib N] [--state-mib N] [--variants LIST]
                                          [--stage-sizes | --no-stage-sizes]

State: ~2 GiB in ~176 float32/bf16 tensors of 1-32 MiB (make_big_state from
bench_save_load.py; --quick: 256 MiB). With --device cuda it is built on the
host (with every core) and moved to the GPU one tensor at a time, each host
copy dropped as it goes, so host memory holds no copy of the state; the
stage-size states likewise.

Variants (all but the raw ones write to a fresh directory and are durable when
their upload future completes; DCP's FileSystemWriter fsyncs every file,
sync_files=True)
  raw_d2h             the staging limit. cuda: copy_(non_blocking=True) of every
                      tensor into its own pinned host buffer (torch.empty(...,
                      pin_memory=True), allocated once before any timing) on a
                      side stream, then synchronize. cpu: the same copy into
                      preallocated (pre-faulted) pageable memory, a plain memcpy.
                      Its time is both blocked and staged; durable is none
  raw_direct          _probes.probe_sequential_write(direct=True): one thread,
                      8 MiB O_DIRECT pwrites of the same byte count + fsync
  dcp_default         dcp.async_save(state, storage_writer=FileSystemWriter(p)):
                      FileSystemWriter is itself DCP's (BlockingAsyncStager)
                      stager: a full copy into fresh memory inside the call
  dcp_stager          ... async_stager=DefaultStager(StagingOptions(
                      use_pinned_memory, use_shared_memory=False,
                      use_async_staging=True, use_non_blocking_copy)): cuda:
                      pinned memory and non-blocking copies on the stager's
                      stream; cpu: both off, the best configuration a CPU-only
                      host allows (DefaultStager refuses non-blocking copies
                      without an accelerator, and torch ignores pinning without
                      CUDA). One stager for the whole run, so its cached copy is
                      reused (steady state); stager.close() at the end
  dcp_pinned          torchtitan's async_with_pinned_mem: PROCESS +
                      DefaultStager(StagingOptions(True, True, True, True)):
                      pinned shared-memory copy, non-blocking, async; one stager
                      for the run. cpu: non-blocking off (see above) and the
                      pinning is ignored by torch, so it is dcp_process_stager
  dcp_process         ... async_checkpointer_type=AsyncCheckpointerType.PROCESS
                      (DCP's default stager; needs a default process group: a
                      1-rank gloo group is initialized for the whole run and
                      every variant runs under it with no_dist=False)
  dcp_process_stager  PROCESS + DefaultStager(use_shared_memory=True,
                      use_async_staging=True): the staged copy already lives in
                      shared memory, so sending it to the daemon copies nothing
  ours                DataStatesWriter(p, host_cache_bytes=--cache-mib, default
                      the library's DEFAULT_HOST_CACHE_BYTES);
                      resp.staging_completion / resp.upload_completion;
                      writer.close() after each save
  ours_state_cache    the same with a cache that holds the whole state: the
                      state's bytes rounded up to 1 MiB plus one write window
                      (the engine's pool is whole windows)

Per save: blocked = time inside dcp.async_save; staged = until the staging
future completes (when async_save returns a plain Future, staging is complete
when the call returns); durable = until the upload future completes; the
bandwidths are bytes / staged and bytes / durable. With --device cuda the
device is synchronized before every timed call. Peak extra RSS = max VmRSS
sampled every 2 ms from a thread (from just before the call until durable)
minus VmRSS just before the call; for the PROCESS variants the RssAnon growth
of child processes is reported separately (their shared memory pages are the
parent's staged copy, already counted in the parent). "held" is what a
variant keeps resident between saves (stager caches, our pool, raw_d2h's
buffers): RSS after its first save minus RSS before it.

Method: every variant first does one untimed save of the state (the "cold"
first save: imports, daemon spawn, cache/pool allocation; printed for
context) whose checkpoint is loaded back into tensors on the state's device
(dcp.load with FileSystemReader / DataStatesReader, in ~256 MiB groups of
keys) and compared with torch.equal; raw_d2h's buffers are compared with the
state the same way. ours goes first, right after the state is built, so its
first-save RSS is relative to a process that holds nothing else. Then --reps
repetitions in round-robin order (the first variant shifts every
repetition); each save goes to a fresh directory that is deleted and
os.sync()ed right after (ext4 online discard). Figures are medians.

--budget-s S (wall time since the process started) covers every phase: a
variant's first save (and its verification) is not started when the time so
far plus the longest first save + verification so far would pass S; in a
repetition, a save is not started when the time so far plus the longest
save of that variant so far (else of any) would; no repetition is started
when the time so far plus the last repetition's would; the variants left
out are listed ("not measured: budget", JSON "not_run_budget") and
"budget_stopped" is set. A shared-memory variant (dcp_pinned, dcp_process,
dcp_process_stager) whose staged copies would not fit in the free space of
/dev/shm is not run (a full tmpfs kills the process with SIGBUS; JSON
"not_run"). With --json the file is written after the first saves and after
every repetition with the figures so far and "complete": false, and at the
end with "complete": true, so a process killed from outside (a timeout) still
leaves what it measured.

Stage sizes (on by default; --no-stage-sizes to skip): ours' blocking call
for a ~100 MB and a ~4 GB state (--quick: ~100 MB vs ~1 GB) with the same
tensor count, so only bytes differ; the call's cost must not grow with bytes.
dcp_default's blocking call is shown for contrast. Shrunk to fit MemAvailable
(and, with cuda, the free GPU memory); skipped when --budget-s leaves too
little time for it (estimated from the main part's durable bandwidths).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import logging
import os
import sys
import threading
import textwrap
import time
import traceback
import warnings
from concurrent.futures import Future

_T0 = time.perf_counter()  # --budget-s counts from here

if __name__ == "__mp_main__":
    # DCP's checkpoint daemon is spawned and re-imports this file; it logs every
    # request at INFO on stderr.
    logging.disable(logging.INFO)

warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
warnings.filterwarnings("ignore", message=".*assuming the intent is to (save|load) in a single process.*")
warnings.filterwarnings("ignore", message=".*Ignoring pin_memory flag.*")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter  # noqa: E402
from torch.distributed.checkpoint.staging import DefaultStager  # noqa: E402
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType  # noqa: E402

from bench_common import (  # noqa: E402
    add_common_args, dcp_staging_options, device_info, fmt, init_gloo, make_scratch, median, mem_available,
    pick_device, remove, remove_scratch, write_json,
)
from bench_save_load import BLOCK, GB, GiB, MiB, check_equal, machine_info, make_big_state, state_bytes  # noqa: E402
from dcp_datastates import DataStatesReader, DataStatesWriter  # noqa: E402
from dcp_datastates import _probes  # noqa: E402
from dcp_datastates.native.engine import DEFAULT_HOST_CACHE_BYTES, DEFAULT_WINDOW_BYTES  # noqa: E402
from dcp_datastates.native.engine import release_engines  # noqa: E402

VARIANTS = ["raw_d2h", "raw_direct", "dcp_default", "dcp_stager", "dcp_pinned", "dcp_process",
            "dcp_process_stager", "ours", "ours_state_cache"]
DCP_VARIANTS = ["dcp_default", "dcp_stager", "dcp_pinned", "dcp_process", "dcp_process_stager"]
OURS_VARIANTS = ["ours", "ours_state_cache"]
PROCESS_VARIANTS = ["dcp_pinned", "dcp_process", "dcp_process_stager"]
STAGER_VARIANTS = ["dcp_stager", "dcp_pinned", "dcp_process_stager"]  # one DefaultStager each, kept for the run
LABELS = {
    "raw_d2h": "raw memcpy to preallocated",
    "raw_direct": "raw O_DIRECT write+fsync",
    "dcp_default": "DCP async_save (default)",
    "dcp_stager": "DCP + DefaultStager (async)",
    "dcp_pinned": "DCP PROCESS + pinned shm (cpu: no pin)",
    "dcp_process": "DCP PROCESS (default stager)",
    "dcp_process_stager": "DCP PROCESS + DefaultStager shm",
    "ours": "ours DataStates",
    "ours_state_cache": "ours, cache = state",
}
CUDA_LABELS = {
    "raw_d2h": "raw D2H to pinned, side stream",
    "dcp_stager": "DCP + DefaultStager pinned nb",
    "dcp_pinned": "DCP PROCESS + pinned shm nb",
}
TARGETS = {
    "blocked_vs_dcp_default": 30.0,   # dcp_default blocked / ours blocked >=
    "staged_vs_best_dcp": 2.0,        # best DCP staged / ours staged >=
    "durable_vs_raw": 1.2,            # ours durable / (bytes / raw O_DIRECT bandwidth) <=
    "rss_slack_mib": 64,              # ours extra RSS <= cache + this
    "staged_bw_vs_raw_d2h": 0.8,      # ours staged GB/s / raw_d2h GB/s >=
    "blocked_ms": 5.0,                # ours blocked < this many ms
    "durable_vs_best_dcp": 1.0,       # best DCP durable / ours durable >=
}
VERIFY_GROUP = 256 * MiB
# Host copies of the state a variant keeps between saves, and makes during one (for the memory check)
HELD_COPIES = {"raw_d2h": 1, "dcp_stager": 1, "dcp_pinned": 1, "dcp_process_stager": 1}
TRANSIENT_COPIES = {"dcp_default": 1, "dcp_process": 2}  # dcp_process: its copy, moved to shm for the daemon
SHM_COPIES = {"dcp_pinned": 1, "dcp_process_stager": 1, "dcp_process": 1}


def label(variant: str, device: torch.device) -> str:
    return (CUDA_LABELS if device.type == "cuda" else {}).get(variant, LABELS[variant])


# ---------------------------------------------------------------- memory


def _status_kib(buf: bytes, field: bytes) -> int:
    i = buf.find(field)
    if i < 0:
        return 0
    return int(buf[i + len(field): buf.index(b"kB", i)])


try:
    _libc = ctypes.CDLL("libc.so.6")
except OSError:  # not glibc
    _libc = None


def trim() -> None:
    """gc + malloc_trim(0): hand memory freed by earlier saves back to the OS, so that
    RSS before a save does not already hold the previous save's (freed) copy."""
    gc.collect()
    if _libc is not None:
        _libc.malloc_trim(0)


def rss_bytes() -> int:
    with open("/proc/self/status", "rb") as f:
        return _status_kib(f.read(), b"VmRSS:") * 1024


def child_pids() -> list[int]:
    pids = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/children") as f:
                pids += [int(p) for p in f.read().split()]
        except OSError:
            pass
    return pids


def children_anon() -> dict[int, int]:
    out = {}
    for pid in child_pids():
        try:
            with open(f"/proc/{pid}/status", "rb") as f:
                out[pid] = _status_kib(f.read(), b"RssAnon:") * 1024
        except OSError:
            pass
    return out


class RssSampler:
    """Peak VmRSS of this process (every `interval` s) and peak RssAnon growth of
    its child processes (every 10th sample), in a background thread."""

    def __init__(self, children: bool = False, interval: float = 0.002) -> None:
        self.children = children
        self.interval = interval
        self._stop = threading.Event()
        self._fd = os.open("/proc/self/status", os.O_RDONLY)
        self.before = self._rss()
        self.peak = self.before
        self.child_before = children_anon() if children else {}
        self.child_peak = 0
        self.samples = 0
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _rss(self) -> int:
        return _status_kib(os.pread(self._fd, 4096, 0), b"VmRSS:") * 1024

    def _sample_children(self) -> None:
        now = children_anon()
        extra = sum(v - self.child_before.get(pid, 0) for pid, v in now.items())
        self.child_peak = max(self.child_peak, extra)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.peak = max(self.peak, self._rss())
            self.samples += 1
            if self.children and self.samples % 10 == 0:
                self._sample_children()

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._rss())
        if self.children:
            self._sample_children()
        os.close(self._fd)
        return {"rss_before": self.before, "rss_extra": self.peak - self.before,
                "child_extra": self.child_peak if self.children else None, "samples": self.samples}


# ---------------------------------------------------------------- helpers


def make_sized_state(total_bytes: int, count: int, seed: int = 7) -> dict[str, torch.Tensor]:
    """`count` 2-D tensors of about total_bytes/count each, alternating float32/bf16:
    two calls with the same count differ only in bytes."""
    gen = torch.Generator().manual_seed(seed)
    per = max(total_bytes // count, 4096)
    cols = 1024
    state = {}
    for i in range(count):
        dtype = torch.float32 if i % 2 == 0 else torch.bfloat16
        rows = max(1, per // (cols * dtype.itemsize))
        t = torch.empty(rows, cols, dtype=dtype)
        t.view(-1)[: min(t.numel(), 1 << 16)].normal_(generator=gen)  # a little entropy, cheap
        t.view(-1)[1 << 16:].fill_(float(i))
        state[f"blocks.{i // 4}.w{i % 4}"] = t
    return state


def verify(state: dict, path: str, ours: bool, what: str) -> None:
    """Load the checkpoint back, into tensors on the state's device, in ~256 MiB groups
    of keys and compare bit-exactly."""
    keys = list(state)
    i = 0
    while i < len(keys):
        group, size = [], 0
        while i < len(keys) and (not group or size + state[keys[i]].nbytes <= VERIFY_GROUP):
            group.append(keys[i])
            size += state[keys[i]].nbytes
            i += 1
        dst = {k: torch.zeros_like(state[k]) for k in group}
        reader = DataStatesReader(path) if ours else FileSystemReader(path)
        dcp.load(dst, storage_reader=reader)
        check_equal({k: state[k] for k in group}, dst, what)
        del dst


def verify_copy(state: dict, bufs: dict, what: str) -> None:
    """raw_d2h's buffers against the state, one tensor at a time on the state's device."""
    for k, t in state.items():
        check_equal({k: t}, {k: bufs[k].to(t.device)}, what)


def close_writer(writer) -> None:
    close = getattr(writer, "close", None)
    if callable(close):
        close()


# ---------------------------------------------------------------- device, state, budget


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build_state(make, device: torch.device, *args) -> dict[str, torch.Tensor]:
    """make(*args) on the host with every core, then moved to `device` one tensor at a
    time (each host copy is dropped as its device copy is made)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(os.cpu_count() or threads)
    try:
        state = make(*args)
    finally:
        torch.set_num_threads(threads)
    if device.type == "cuda":
        for k in list(state):
            state[k] = state[k].to(device)
        torch.cuda.synchronize(device)
        trim()
    return state


def free_device_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def state_cache_bytes(nbytes: int) -> int:
    """ours_state_cache's host_cache_bytes: the state rounded up to 1 MiB plus one window,
    since the engine's pool is whole windows (it rounds the rest down)."""
    return -(-nbytes // MiB) * MiB + DEFAULT_WINDOW_BYTES


def pinned_bytes(state: dict) -> int:
    """Host bytes of raw_d2h's pinned buffers: torch's pinned allocator rounds each up to a power of two."""
    return sum(1 << max(t.nbytes - 1, 0).bit_length() for t in state.values())


class Budget:
    """--budget-s: wall time since the script started, and whether a step of `cost` s still fits."""

    def __init__(self, seconds: float | None) -> None:
        self.seconds = seconds
        self.longest: dict[str, float] = {}  # what one step took, at most (see note)

    def elapsed(self) -> float:
        return time.perf_counter() - _T0

    def left(self) -> float:
        return float("inf") if self.seconds is None else self.seconds - self.elapsed()

    def allows(self, cost: float) -> bool:
        return self.seconds is None or self.elapsed() + cost <= self.seconds

    def note(self, key: str, seconds: float) -> None:
        """Record how long one step of `key` took (its estimate is the longest so far)."""
        self.longest[key] = max(self.longest.get(key, 0.0), seconds)

    def refuses(self, key: str, fallback: list[str] | None = None) -> str | None:
        """Why a step of `key` must not start (None: it may): the time so far plus the longest step of
        `key` so far (else the longest of the keys in `fallback`; no estimate, no refusal) passes the budget."""
        if self.seconds is None:
            return None
        known = [self.longest[k] for k in ([key] if key in self.longest else fallback or []) if k in self.longest]
        est = max(known, default=0.0)
        if self.elapsed() + est <= self.seconds:
            return None
        return f"--budget-s {self.seconds:g}: {self.elapsed():.0f}s elapsed + ~{est:.0f}s for it would pass it"


# ---------------------------------------------------------------- runner


class Runner:
    def __init__(self, root: str, cache_bytes: int, device: torch.device) -> None:
        self.root = root
        self.cache_bytes = cache_bytes
        self.state_cache_bytes: int | None = None  # ours_state_cache's, set once the state is built
        self.device = device
        self.counter = 0
        self.stagers: dict[str, DefaultStager] = {}  # one per stager variant, kept for the whole run
        self.bufs: dict[str, torch.Tensor] | None = None  # raw_d2h's destination, one per tensor
        self.stream = None  # raw_d2h's side stream (cuda)
        self.notes: set[str] = set()

    def fresh(self, tag: str) -> str:
        self.counter += 1
        return os.path.join(self.root, f"{tag}-{self.counter:04d}")

    def close(self) -> None:
        for s in self.stagers.values():
            s.close()
        self.stagers = {}
        self.bufs = None

    def _stager(self, variant: str) -> DefaultStager:
        if variant not in self.stagers:
            self.stagers[variant] = DefaultStager(dcp_staging_options(variant, self.device.type == "cuda"))
            if variant == "dcp_pinned" and self.device.type != "cuda":
                self.notes.add("dcp_pinned on cpu: torch ignores use_pinned_memory without CUDA and "
                               "DefaultStager refuses use_non_blocking_copy without an accelerator (it is "
                               "off), so it stages like dcp_process_stager")
        return self.stagers[variant]

    def _setup(self, variant: str, path: str):
        if variant == "ours":
            return DataStatesWriter(path, host_cache_bytes=self.cache_bytes), {}
        if variant == "ours_state_cache":
            if self.state_cache_bytes is None:
                raise RuntimeError("ours_state_cache: the state's size is not known yet")
            return DataStatesWriter(path, host_cache_bytes=self.state_cache_bytes), {}
        writer = FileSystemWriter(path)
        kwargs = {}
        if variant in STAGER_VARIANTS:
            kwargs["async_stager"] = self._stager(variant)
        if variant in PROCESS_VARIANTS:
            kwargs["async_checkpointer_type"] = AsyncCheckpointerType.PROCESS
        if variant not in STAGER_VARIANTS + PROCESS_VARIANTS + ["dcp_default"]:
            raise ValueError(variant)
        return writer, kwargs

    def _buffers(self, state: dict) -> dict[str, torch.Tensor]:
        """raw_d2h's destination: one buffer per tensor, allocated (and faulted in) once."""
        if self.bufs is None or any(self.bufs.get(k) is None or self.bufs[k].shape != t.shape
                                    or self.bufs[k].dtype != t.dtype for k, t in state.items()):
            pin = self.device.type == "cuda"
            self.bufs = {k: torch.empty(t.shape, dtype=t.dtype, pin_memory=pin).zero_() for k, t in state.items()}
            if self.device.type == "cuda":
                self.stream = torch.cuda.Stream(self.device)
        return self.bufs

    def copy(self, state: dict) -> dict:
        """raw_d2h: one timed copy of every tensor into its preallocated buffer."""
        bufs = self._buffers(state)
        trim()
        sync(self.device)
        sampler = RssSampler()
        t0 = time.perf_counter()
        if self.device.type == "cuda":
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.stream):
                for k, t in state.items():
                    bufs[k].copy_(t, non_blocking=True)
            self.stream.synchronize()
        else:
            for k, t in state.items():
                bufs[k].copy_(t)
        t1 = time.perf_counter()
        mem = sampler.stop()
        return {"blocked_s": t1 - t0, "staged_s": t1 - t0, "durable_s": None, "bytes": state_bytes(state),
                "api": "copy", "pinned": self.device.type == "cuda", **mem}

    def raw(self, nbytes: int) -> dict:
        path = self.fresh("raw_direct") + ".bin"
        s = _probes.probe_sequential_write(path, nbytes, BLOCK, True)
        written = os.path.getsize(path)
        remove(path)
        return {"durable_s": s, "bytes": written}

    def async_save(self, variant: str, state: dict, keep: bool = False) -> dict:
        """One timed dcp.async_save, waited until durable. Returns its figures
        (and the checkpoint path when keep=True, for verification)."""
        path = self.fresh(variant)
        writer, kwargs = self._setup(variant, path)
        trim()
        sync(self.device)  # nothing queued on the device counts against the save
        sampler = RssSampler(children=variant in PROCESS_VARIANTS)
        marks = {}

        def mark(name):
            return lambda _f: marks.setdefault(name, time.perf_counter())

        t0 = time.perf_counter()
        resp = dcp.async_save(state, storage_writer=writer, **kwargs)
        t1 = time.perf_counter()
        if isinstance(resp, Future):
            api = "future"  # staged when the call returned
            staging, upload = None, resp
            marks["staged"] = t1
        else:
            api = "response"
            staging, upload = resp.staging_completion, resp.upload_completion
            staging.add_done_callback(mark("staged"))
        upload.add_done_callback(mark("durable"))
        upload.result()
        if staging is not None:
            staging.result()
        mem = sampler.stop()
        if variant in OURS_VARIANTS:
            close_writer(writer)  # drains; the save is already durable
        rec = {"blocked_s": t1 - t0, "staged_s": marks["staged"] - t0,
               "durable_s": marks["durable"] - t0, "api": api, **mem}
        if variant in OURS_VARIANTS and api == "future":
            self.notes.add(f"{variant}: dcp.async_save returned a plain Future (DataStatesWriter is not an "
                           "AsyncStager yet), so DCP's default stager copied the state inside the call")
        if keep:
            rec["path"] = path
        else:
            remove(path)
        return rec


# ---------------------------------------------------------------- phases


def first_save(runner: Runner, v: str, state: dict) -> tuple[dict, str | None]:
    """A variant's first save, and where to verify it (a checkpoint path; None for raw_d2h,
    whose buffers are compared directly)."""
    if v == "raw_d2h":
        return runner.copy(state), None
    rec = runner.async_save(v, state, keep=True)
    return rec, rec.pop("path")


def prime_and_verify(runner: Runner, variants: list[str], state: dict, results: dict, budget: Budget,
                     progress) -> None:
    """First (cold) save of every variant, untimed for the medians, loaded back and checked; a variant
    whose first save and verification would pass --budget-s is left out (not_run_budget).
    progress() after each (it writes the partial JSON)."""
    for v in variants:
        if v == "raw_direct":
            continue
        why = budget.refuses("first")
        if why:
            results["not_run_budget"][v] = f"first save: {why}"
            print(f"  {v}: not measured: budget: {results['not_run_budget'][v]}", flush=True)
            continue
        t_first = time.perf_counter()
        trim()
        before = rss_bytes()
        try:
            rec, path = first_save(runner, v, state)
        except Exception as e:  # noqa: BLE001 - report and go on with the others
            results["failed"][v] = f"{type(e).__name__}: {e}"
            print(f"  {v}: FAILED on first save: {results['failed'][v]}", flush=True)
            continue
        budget.note(v, time.perf_counter() - t_first)  # a cold save: a generous estimate of the timed ones
        time.sleep(0.25)  # let DCP's executor threads drop their references to the staged copy
        trim()
        rec["held"] = rss_bytes() - before
        rec["peak_over_start"] = rec["rss_before"] + rec["rss_extra"] - before
        try:
            if path is None:
                verify_copy(state, runner.bufs, f"{v} on the big state")
            else:
                verify(state, path, v in OURS_VARIANTS, f"{v} on the big state")
            rec["verified"] = True
        except Exception as e:  # noqa: BLE001
            results["failed"][v] = f"verification: {type(e).__name__}: {e}"
            print(f"  {v}: FAILED verification: {results['failed'][v]}", flush=True)
        if path is not None:
            remove(path)
        budget.note("first", time.perf_counter() - t_first)
        results["first"][v] = rec
        print(f"  first save {v:<20} blocked {rec['blocked_s']:.3f}s staged {rec['staged_s']:.3f}s "
              f"durable {fmt(rec['durable_s'], '.3f', 0)}s extra RSS {rec['rss_extra'] / MiB:.0f} MiB "
              f"held {rec['held'] / MiB:.0f} MiB verified={rec.get('verified', False)} ({rec['api']})",
              flush=True)
        progress()


def rep_cell(v: str, rec: dict) -> str:
    if v == "raw_direct":
        return f"{v}={rec['durable_s']:.2f}"
    if v == "raw_d2h":
        return f"{v}={rec['staged_s']:.3f}"
    return f"{v}={rec['blocked_s']:.3f}/{rec['staged_s']:.2f}/{rec['durable_s']:.2f}"


def run_reps(runner: Runner, active: list[str], state: dict, nbytes: int, reps: int, budget: Budget,
             results: dict, progress) -> None:
    """--reps timed repetitions, round-robin, stopping early when --budget-s would be passed;
    progress() after each (it writes the partial JSON)."""
    for rep in range(reps):
        t_rep = time.perf_counter()
        order = active[rep % len(active):] + active[:rep % len(active)]
        recs = {}
        for v in order:
            why = budget.refuses(v, fallback=active)
            if why:
                results["not_run_budget"].setdefault(v, f"repetition {rep + 1}: {why}")
                results["budget_stopped"] = True
                print(f"  {v}: not measured in repetition {rep + 1}: budget: {why}", flush=True)
                continue
            t_save = time.perf_counter()
            try:
                if v == "raw_direct":
                    recs[v] = runner.raw(nbytes)
                elif v == "raw_d2h":
                    recs[v] = runner.copy(state)
                else:
                    recs[v] = runner.async_save(v, state)
            except Exception as e:  # noqa: BLE001
                first = v not in results["failed"]
                results["failed"][v] = f"{type(e).__name__}: {e}"
                print(f"  {v}: FAILED: {results['failed'][v]}", flush=True)
                if first:  # where it failed (DCP's own code, often): the last frames, once per variant
                    print(textwrap.indent(traceback.format_exc(limit=-8), "    "), flush=True)
            budget.note(v, time.perf_counter() - t_save)
        if not recs:  # nothing measured: the budget is spent (or every save failed)
            break
        results["reps"].append(recs)
        results["reps_done"] = len(results["reps"])
        progress()
        rep_s = time.perf_counter() - t_rep
        line = " ".join(rep_cell(v, recs[v]) for v in active if v in recs)
        print(f"rep {rep + 1}/{reps} in {rep_s:.1f}s (blocked/staged/durable s, order {','.join(order)}): {line}",
              flush=True)
        if rep + 1 < reps and not budget.allows(rep_s):
            print(f"--budget-s {budget.seconds:g}: stopping after {rep + 1} of {reps} repetition(s): "
                  f"{budget.elapsed():.0f}s elapsed + {rep_s:.0f}s for another would pass it", flush=True)
            results["budget_stopped"] = True
            break
    results["reps_done"] = len(results["reps"])


def memory_check(variants: list[str], state: dict, cache: int, state_cache: int, device: torch.device) -> dict:
    """Host memory (beyond the state, already allocated) and /dev/shm this run needs; warn when short."""
    nb = state_bytes(state)
    held = {v: HELD_COPIES[v] * nb for v in variants if v in HELD_COPIES}
    if "raw_d2h" in held and device.type == "cuda":
        held["raw_d2h"] = pinned_bytes(state)
    for v, b in (("ours", cache), ("ours_state_cache", state_cache)):
        if v in variants:
            held[v] = b
    transient = max([TRANSIENT_COPIES.get(v, 0) for v in variants] + [0]) * nb
    need = sum(held.values()) + transient
    shm_need = sum(SHM_COPIES.get(v, 0) for v in variants) * nb
    avail = mem_available()
    try:
        st = os.statvfs("/dev/shm")
        shm_free = st.f_bavail * st.f_frsize
    except OSError:
        shm_free = None
    if avail < need + GiB:
        print(f"warning: MemAvailable {avail / GiB:.1f} GiB < ~{(need + GiB) / GiB:.1f} GiB this run may need "
              f"(kept between saves: {sum(held.values()) / GiB:.1f} GiB, during a save: {transient / GiB:.1f} GiB)")
    if shm_need and shm_free is not None and shm_free < shm_need:
        print(f"warning: /dev/shm has {shm_free / GiB:.1f} GiB free < {shm_need / GiB:.1f} GiB the shared-memory "
              f"variants ({', '.join(v for v in variants if v in SHM_COPIES)}) may need")
    return {"mem_available": avail, "host_need": need, "held": held, "transient": transient,
            "shm_need": shm_need, "shm_free": shm_free}


def shm_refusals(variants: list[str], nbytes: int) -> dict[str, str]:
    """The shared-memory variants whose staged copies would not fit in /dev/shm's free space, counting the
    copies of those before them (a stager keeps its copy for the whole run): variant -> why. They are not
    run, since a tmpfs that runs full kills the process (SIGBUS) and every figure with it."""
    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        return {}
    free = st.f_bavail * st.f_frsize
    out, need = {}, 0
    for v in variants:
        want = SHM_COPIES.get(v, 0) * nbytes
        if not want:
            continue
        if need + want > 0.95 * free:
            out[v] = (f"needs {want / GiB:.1f} GiB of /dev/shm, {max(free - need, 0) / GiB:.1f} GiB free there "
                      f"(a full tmpfs kills the process)")
        else:
            need += want
    return out


def stage_plan(quick: bool, big_override: int | None, device: torch.device) -> dict:
    small = 100 * 1000 * 1000
    big = big_override or (1000 if quick else 4000) * 1000 * 1000
    plan = {"small": small, "large": big, "requested_big": big}
    avail = mem_available()
    why = f"MemAvailable {avail / GiB:.1f} GiB"
    if device.type == "cuda":
        # the state lives on the device: the host holds dcp_default's copy (and the state while it is built)
        fit = int((avail - 2 * GiB) / 1.2)
        dev_free = torch.cuda.mem_get_info(device)[0]
        fit = min(fit, int(dev_free * 0.9) - small)
        why += f", GPU free {dev_free / GiB:.1f} GiB"
    else:
        fit = int((avail - 2 * GiB) / 2.2)  # the state + dcp_default's copy, with some slack
    if big > fit:
        print(f"  {why}: shrinking the large state from {big / GB:.1f} GB to {fit / GB:.1f} GB")
        plan["large"] = max(fit, 2 * small)
    return plan


def stage_estimate(plan: dict, reps: int, summary: dict, build_rate: float | None) -> float | None:
    """Seconds the stage-size part takes with `reps` repetitions (a first save and the reps of ours
    and dcp_default at each size, and building both states), from the main part's durable
    bandwidths and build rate; None: unknown."""
    rates = [s["bytes"] / s["durable_s"] for v, s in summary.items()
             if v in ("ours", "dcp_default", "raw_direct") and s.get("durable_s") and s.get("bytes")]
    if not rates or not build_rate:
        return None
    nbytes = plan["small"] + plan["large"]
    return 2 * (1 + reps) * nbytes / min(rates) + nbytes / build_rate


def stage_sizes(runner: Runner, plan: dict, reps: int, count: int, budget: Budget) -> dict:
    device = runner.device
    out = {"requested_big": plan["requested_big"], "sizes": {}}
    for label_, nbytes in (("small", plan["small"]), ("large", plan["large"])):
        state = build_state(make_sized_state, device, nbytes, count)
        nb = state_bytes(state)
        recs = {"ours": [], "dcp_default": []}
        # untimed first save of this layout (plans, pool)
        for v in ("ours", "dcp_default"):
            first = runner.async_save(v, state, keep=(label_ == "small" and v == "ours"))
            if "path" in first:
                verify(state, first["path"], True, "ours on the stage-size state")
                remove(first["path"])
        for rep in range(reps):
            t_rep = time.perf_counter()
            order = ["ours", "dcp_default"] if rep % 2 == 0 else ["dcp_default", "ours"]
            for v in order:
                recs[v].append(runner.async_save(v, state))
            rep_s = time.perf_counter() - t_rep
            if rep + 1 < reps and not budget.allows(rep_s):
                print(f"  --budget-s {budget.seconds:g}: {label_} state: stopping after {rep + 1} of {reps} "
                      f"repetition(s)")
                break
        out["sizes"][label_] = {
            "bytes": nb, "tensors": len(state), "reps_done": len(recs["ours"]),
            **{v: {k: median([r[k] for r in recs[v]]) for k in ("blocked_s", "staged_s", "durable_s")}
               for v in recs},
            "ours_blocked_reps": [r["blocked_s"] for r in recs["ours"]],
        }
        s = out["sizes"][label_]
        print(f"  {label_}: {len(state)} tensors, {nb / GB:.3f} GB: ours blocked {s['ours']['blocked_s'] * 1e3:.1f} ms "
              f"(staged {s['ours']['staged_s']:.3f}s, durable {s['ours']['durable_s']:.3f}s); "
              f"dcp_default blocked {s['dcp_default']['blocked_s'] * 1e3:.1f} ms", flush=True)
        del state
        free_device_memory(device)
    sm, lg = out["sizes"]["small"], out["sizes"]["large"]
    out["bytes_ratio"] = lg["bytes"] / sm["bytes"]
    out["ours_blocked_ratio"] = lg["ours"]["blocked_s"] / sm["ours"]["blocked_s"]
    out["dcp_blocked_ratio"] = lg["dcp_default"]["blocked_s"] / sm["dcp_default"]["blocked_s"]
    return out


# ---------------------------------------------------------------- reporting


def gbps(nbytes: int | None, seconds: float | None) -> float | None:
    return nbytes / seconds / GB if nbytes and seconds else None


def summarize(reps: list[dict], variants: list[str], nbytes: int) -> dict:
    out = {}
    for v in variants:
        recs = [r[v] for r in reps if v in r]
        if not recs:
            continue
        keys = ["blocked_s", "staged_s", "durable_s", "rss_extra", "child_extra"]
        out[v] = {k: median([r.get(k) for r in recs]) for k in keys}
        out[v]["durable_reps"] = [r["durable_s"] for r in recs]
        out[v]["staged_reps"] = [r.get("staged_s") for r in recs]
        out[v]["bytes"] = recs[0].get("bytes") or nbytes
        out[v]["staged_gbps"] = gbps(out[v]["bytes"], out[v]["staged_s"])
        out[v]["durable_gbps"] = gbps(out[v]["bytes"], out[v]["durable_s"])
    return out


def best(summary: dict, variants: list[str], key: str) -> str | None:
    have = [v for v in variants if summary.get(v, {}).get(key)]
    return min(have, key=lambda v: summary[v][key]) if have else None


def ratios(summary: dict, first: dict, nbytes: int, caches: dict) -> list[dict]:
    rows = []

    def add(name, value, target, ok, unit="x"):
        rows.append({"name": name, "value": value, "target": target, "unit": unit,
                     "pass": None if value is None or target is None else ok(value)})

    d, raw, d2h = summary.get("dcp_default"), summary.get("raw_direct"), summary.get("raw_d2h")
    best_staged, best_durable = best(summary, DCP_VARIANTS, "staged_s"), best(summary, DCP_VARIANTS, "durable_s")
    for v in OURS_VARIANTS:
        ours = summary.get(v)
        if ours is None:
            continue
        add(f"dcp_default blocked / {v} blocked",
            d["blocked_s"] / ours["blocked_s"] if d else None, f">= {TARGETS['blocked_vs_dcp_default']:.0f}x",
            lambda x: x >= TARGETS["blocked_vs_dcp_default"])
        add(f"{v} blocked", ours["blocked_s"] * 1e3, f"< {TARGETS['blocked_ms']:.0f} ms",
            lambda x: x < TARGETS["blocked_ms"], unit="ms")
        if d2h:
            add(f"{v} staged GB/s / raw_d2h GB/s", d2h["staged_s"] / ours["staged_s"],
                f">= {TARGETS['staged_bw_vs_raw_d2h']:.2f}x", lambda x: x >= TARGETS["staged_bw_vs_raw_d2h"])
        if best_staged:
            add(f"best DCP staged ({best_staged}) / {v} staged", summary[best_staged]["staged_s"] / ours["staged_s"],
                f">= {TARGETS['staged_vs_best_dcp']:.0f}x", lambda x: x >= TARGETS["staged_vs_best_dcp"])
        if best_durable:
            add(f"best DCP durable ({best_durable}) / {v} durable",
                summary[best_durable]["durable_s"] / ours["durable_s"],
                f">= {TARGETS['durable_vs_best_dcp']:.1f}x", lambda x: x >= TARGETS["durable_vs_best_dcp"])
        if raw:
            ideal = nbytes / (raw["bytes"] / raw["durable_s"])
            add(f"{v} durable / (bytes / raw O_DIRECT bandwidth)", ours["durable_s"] / ideal,
                f"<= {TARGETS['durable_vs_raw']:.1f}x", lambda x: x <= TARGETS["durable_vs_raw"])
        rows.append(rss_row(v, ours, first.get(v, {}), caches[v]))
    return rows


def rss_row(v: str, ours: dict, first: dict, cache: int) -> dict:
    held = first.get("held", 0)
    steady = held + ours["rss_extra"]
    first_peak = first.get("peak_over_start", 0)
    worst = max(steady, first_peak)
    limit = cache + TARGETS["rss_slack_mib"] * MiB
    return {"name": f"{v} extra RSS (max of first, held+steady), cache {cache / MiB:.0f} MiB",
            "value": worst / MiB, "target": f"<= {limit / MiB:.0f} MiB", "pass": worst <= limit,
            "unit": "MiB", "first_peak_mib": first_peak / MiB, "held_mib": held / MiB,
            "steady_extra_mib": ours["rss_extra"] / MiB}


def print_report(meta: dict, summary: dict, first: dict, rat: list[dict], reps: int, failed: dict,
                 device: torch.device) -> None:
    print()
    print(f"=== async save of {meta['tensors']} tensors, {meta['bytes'] / GiB:.3f} GiB "
          f"({meta['bytes'] / GB:.3f} GB) on {device}, median of {reps} rep(s) ===")
    print(f"{'variant':<40}{'blocked s':>10}{'staged s':>9}{'durable s':>10}{'stg GB/s':>9}{'dur GB/s':>9}"
          f"{'+RSS MiB':>9}{'child MiB':>10}{'held MiB':>9}   staged/durable s per rep")
    for v in VARIANTS:
        if v in failed and v not in summary:
            print(f"{label(v, device) + ' (' + v + ')':<40}  FAILED: {failed[v][:90]}")
            continue
        if v not in summary:
            continue
        s = summary[v]
        child = s["child_extra"] / MiB if s["child_extra"] is not None else None
        held = first.get(v, {}).get("held")
        per_rep = " ".join(f"{fmt(a, '.2f', 0)}/{fmt(b, '.2f', 0)}" for a, b in zip(s["staged_reps"], s["durable_reps"]))
        print(f"{label(v, device):<40}{fmt(s['blocked_s'], '.4f', 10)}{fmt(s['staged_s'], '.3f', 9)}"
              f"{fmt(s['durable_s'], '.3f', 10)}{fmt(s['staged_gbps'], '.2f', 9)}{fmt(s['durable_gbps'], '.2f', 9)}"
              f"{fmt(s['rss_extra'] / MiB if s['rss_extra'] is not None else None, '.0f', 9)}"
              f"{fmt(child, '.0f', 10)}{fmt(held / MiB if held is not None else None, '.0f', 9)}   {per_rep}")
    print("targets:")
    for r in rat:
        unit = r.get("unit", "x")
        verdict = "" if r["pass"] is None else ("PASS" if r["pass"] else "FAIL")
        val = fmt(r["value"], ".0f" if unit == "MiB" else ".2f", 8)
        print(f"  {r['name']:<72}{val} {unit:<3}  target {r['target']}  {verdict}")
        if unit == "MiB":
            print(f"    (first save peak over the bare process {r['first_peak_mib']:.0f} MiB; held between saves "
                  f"{r['held_mib']:.0f} MiB + steady-state peak extra {r['steady_extra_mib']:.0f} MiB)")


# ---------------------------------------------------------------- main


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(ap, "256 MiB state, 1 rep, stage sizes 100 MB vs 1 GB")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                    help="where the state lives (default cpu; cuda: the current CUDA device)")
    ap.add_argument("--budget-s", type=float, default=None, help="start no first save, timed save or repetition "
                    "that would (by the longest one so far) end past this many seconds since the process started; "
                    "skip the stage sizes if they would")
    ap.add_argument("--state-mib", type=int, default=None, help="state size in MiB (default 2048, --quick 256)")
    ap.add_argument("--cache-mib", type=int, default=DEFAULT_HOST_CACHE_BYTES // MiB,
                    help=f"ours: host_cache_bytes in MiB (default {DEFAULT_HOST_CACHE_BYTES // MiB}, the library's "
                    "DEFAULT_HOST_CACHE_BYTES)")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset of " + ",".join(VARIANTS))
    ap.add_argument("--stage-sizes", dest="stage_sizes", action="store_true", default=True,
                    help="also time ours' blocking call on a ~100 MB and a ~4 GB state (default)")
    ap.add_argument("--no-stage-sizes", dest="stage_sizes", action="store_false")
    ap.add_argument("--stage-sizes-only", action="store_true", help="only the stage-size measurement")
    ap.add_argument("--stage-tensors", type=int, default=128, help="tensor count of both stage-size states")
    ap.add_argument("--stage-big-mb", type=int, default=None, help="large stage-size state in MB "
                    "(default 4000, --quick 1000)")
    return ap.parse_args()


def fill_report(report: dict, meta: dict, results: dict, active: list[str], runner: Runner) -> None:
    """The main part's figures so far into `report` (medians of the repetitions done)."""
    summary = summarize(results["reps"], active, meta["bytes"])
    report.update({"state": meta, "median": summary, "first": results["first"], "reps": results["reps"],
                   "reps_done": len(results["reps"]), "budget_stopped": results.get("budget_stopped", False),
                   "failed": results["failed"], "not_run": results["not_run"],
                   "not_run_budget": results["not_run_budget"],
                   "verified": sorted(v for v, r in results["first"].items() if r.get("verified")),
                   "notes": sorted(runner.notes)})


def main_part(runner: Runner, variants: list[str], nbytes_target: int, reps: int, budget: Budget,
              report: dict, progress) -> None:
    """The big state: first saves (verified), timed repetitions, the table and targets; progress()
    whenever `report` has new figures (it writes the partial JSON)."""
    device = runner.device
    t = time.perf_counter()
    state = build_state(make_big_state, device, nbytes_target)
    build_s = time.perf_counter() - t
    meta = {"tensors": len(state), "bytes": state_bytes(state), "build_s": build_s}
    runner.state_cache_bytes = state_cache_bytes(meta["bytes"])
    report["config"]["state_cache_bytes"] = runner.state_cache_bytes
    report["memory_check"] = memory_check(variants, state, runner.cache_bytes, runner.state_cache_bytes, device)
    print(f"state built in {build_s:.1f}s on {device}: {meta['tensors']} tensors, {meta['bytes'] / MiB:.0f} MiB; "
          f"ours_state_cache host_cache_bytes {runner.state_cache_bytes / MiB:.0f} MiB", flush=True)

    results = {"first": {}, "failed": {}, "reps": [], "not_run": shm_refusals(variants, meta["bytes"]),
               "not_run_budget": {}}
    for v, why in results["not_run"].items():
        print(f"  {v}: not run: {why}", flush=True)
    print("first (cold) save of each variant, loaded back and checked:")
    active: list[str] = []  # the variants of the repetitions, once the first saves are done

    def new_figures() -> None:
        fill_report(report, meta, results, active, runner)
        progress()

    order = ["ours"] + [v for v in variants if v != "ours"] if "ours" in variants else variants
    prime_and_verify(runner, [v for v in order if v not in results["not_run"]], state, results, budget, new_figures)
    active += [v for v in variants if v not in results["failed"] and v not in results["not_run"]
               and v not in results["not_run_budget"]]
    new_figures()
    if active:
        run_reps(runner, active, state, meta["bytes"], reps, budget, results, new_figures)
    runner.close()  # stager.close(): drops the DefaultStagers' cached copies and raw_d2h's buffers

    summary = summarize(results["reps"], active, meta["bytes"])
    caches = {"ours": runner.cache_bytes, "ours_state_cache": runner.state_cache_bytes}
    rat = ratios(summary, results["first"], meta["bytes"], caches)
    print_report(meta, summary, results["first"], rat, results.get("reps_done", 0), results["failed"], device)
    for v, why in results["not_run"].items():
        print(f"not measured: {v}: {why}")
    for v, why in results["not_run_budget"].items():
        print(f"not measured: budget: {v}: {why}")
    for n in sorted(runner.notes):
        print(f"note: {n}")
    fill_report(report, meta, results, active, runner)
    report["ratios"] = rat
    print(f"bit-exact round trips verified: {', '.join(report['verified']) or '-'}")
    del state
    free_device_memory(device)
    try:
        release_engines()  # ours_state_cache's pool is as large as the state: hand it back
    except Exception as e:  # noqa: BLE001
        print(f"note: release_engines(): {type(e).__name__}: {e}")


def stage_part(runner: Runner, args: argparse.Namespace, reps: int, budget: Budget, report: dict) -> None:
    big = args.stage_big_mb * 1000 * 1000 if args.stage_big_mb else None
    print(f"\n=== stage sizes: ours' blocking call vs bytes ({args.stage_tensors} tensors each, "
          f"median of up to {reps} rep(s)) ===")
    try:
        plan = stage_plan(args.quick, big, runner.device)
        meta = report.get("state", {})
        build_rate = meta["bytes"] / meta["build_s"] if meta.get("build_s") else None
        # its repetitions stop at the budget too, so it is skipped only when one would not fit
        est = stage_estimate(plan, 1, report.get("median", {}), build_rate)
        if budget.seconds is not None and (budget.left() <= 0 or (est is not None and est > budget.left())):
            why = (f"--budget-s {budget.seconds:g} leaves {max(budget.left(), 0):.0f}s, this part needs ~"
                   f"{'?' if est is None else f'{est:.0f}'}s with one repetition "
                   f"({(plan['small'] + plan['large']) / GB:.1f} GB x 2 saves x 2 variants)")
            print(f"  skipped: {why}")
            report["stage_sizes"] = {"skipped": why}
            return
        ss = stage_sizes(runner, plan, reps, args.stage_tensors, budget)
        print(f"  bytes x{ss['bytes_ratio']:.1f}: ours blocked x{ss['ours_blocked_ratio']:.2f}, "
              f"dcp_default blocked x{ss['dcp_blocked_ratio']:.2f}  "
              f"(target: ours does not grow with bytes, ~x1)")
        ss["estimate_one_rep_s"] = est
        report["stage_sizes"] = ss
    except Exception as e:  # noqa: BLE001
        print(f"  FAILED: {type(e).__name__}: {e}")
        report["stage_sizes"] = {"failed": f"{type(e).__name__}: {e}"}


def main() -> int:
    args = parse_args()
    device = pick_device(args.device)  # before anything is set up: cuda refuses here without a GPU
    torch.set_num_threads(2)
    reps = args.reps if args.reps is not None else (1 if args.quick else 3)
    nbytes_target = (args.state_mib or (256 if args.quick else 2048)) * MiB
    cache = args.cache_mib * MiB
    variants = [v for v in args.variants.split(",") if v]
    for v in variants:
        if v not in VARIANTS:
            raise SystemExit(f"unknown variant {v!r}")
    variants = [v for v in VARIANTS if v in variants]
    budget = Budget(args.budget_s)
    base, root, created_base = make_scratch(args.dir, "run-")
    info = machine_info(base)
    info["mem_available_start"] = mem_available()
    dev = device_info(device)
    t_start = time.perf_counter()
    default = "the library default" if cache == DEFAULT_HOST_CACHE_BYTES else "not the library default"
    print(f"dcp_datastates async save benchmark: dir={root} reps={reps} quick={args.quick} device={device} "
          f"budget={'-' if args.budget_s is None else f'{args.budget_s:g}s'}")
    print(f"ours cache={args.cache_mib} MiB ({default}: dcp_datastates.native.engine.DEFAULT_HOST_CACHE_BYTES = "
          f"{DEFAULT_HOST_CACHE_BYTES / MiB:.0f} MiB)")
    print(f"nproc={info['nproc']} cpu={info.get('cpu', '?')} RAM={info.get('mem_total_kib', 0) / 2**20:.1f} GiB "
          f"(available {info['mem_available_start'] / GiB:.1f}) torch={info['torch']} threads={info['torch_threads']} "
          f"mount: {info.get('mount', '?')}")
    if device.type == "cuda":
        print(f"GPU: {dev['name']} ({dev['total_memory'] / GiB:.0f} GiB, capability {dev['capability']}), "
              f"torch CUDA {dev['cuda']}")

    init_gloo()  # DCP's PROCESS executor needs a default process group; all variants run under it
    runner = Runner(root, cache, device)
    report = {"config": {"reps": reps, "quick": args.quick, "dir": root, "cache_bytes": cache,
                         "default_cache_bytes": DEFAULT_HOST_CACHE_BYTES, "window_bytes": DEFAULT_WINDOW_BYTES,
                         "device": str(device), "budget_s": args.budget_s, "state_target_bytes": nbytes_target,
                         "stage_tensors": args.stage_tensors, "stage_big_mb": args.stage_big_mb,
                         "stager_options": {v: vars(dcp_staging_options(v, device.type == "cuda")) for v in STAGER_VARIANTS},
                         "variants": variants, "argv": sys.argv, "block": BLOCK},
              "machine": info, "device": dev, "targets": TARGETS}
    def progress(complete: bool = False) -> None:
        if args.json:  # the figures so far, in case the process is killed before the end
            report.update(complete=complete, wall_s=time.perf_counter() - t_start, process_wall_s=budget.elapsed())
            write_json(args.json, report, announce=False)

    try:
        if not args.stage_sizes_only:
            main_part(runner, variants, nbytes_target, reps, budget, report, progress)
        if args.stage_sizes or args.stage_sizes_only:
            stage_part(runner, args, reps, budget, report)
        report["wall_s"] = time.perf_counter() - t_start
        report["process_wall_s"] = budget.elapsed()
        print(f"total wall time {report['wall_s']:.0f}s ({report['process_wall_s']:.0f}s since start)")
        if args.json:
            progress(complete=True)
            print(f"wrote {args.json}")
    finally:
        runner.close()
        remove_scratch(base, root, created_base)
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
