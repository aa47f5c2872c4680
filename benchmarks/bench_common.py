"""Helpers shared by the benchmark scripts: scratch directories, statistics, machine facts.

Imports neither dcp_datastates nor DCP at module level, so every script can
use it even when the package under test fails to import (``drop_tree``
imports the probes module when it is called).
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import tempfile


def add_common_args(ap, quick_help: str, reps_help: str = "repetitions (default 3, --quick 1)") -> None:
    """The options every benchmark script takes: --quick, --dir, --reps, --json."""
    ap.add_argument("--quick", action="store_true", help=quick_help)
    ap.add_argument("--dir", default=None, help="directory for checkpoints (a temporary subdirectory "
                    "is created inside and removed at the end; default: ./bench_tmp)")
    ap.add_argument("--reps", type=int, default=None, help=reps_help)
    ap.add_argument("--json", default=None, help="write every figure to this JSON file")


def write_json(path: str, report: dict, announce: bool = True) -> None:
    """Write ``report`` through a temporary file renamed over ``path``: a run killed mid-write
    (a device check's time limit) leaves the previous version whole."""
    tmp = os.path.join(os.path.dirname(os.path.abspath(path)), f".{os.path.basename(path)}.tmp")
    with open(tmp, "w") as f:
        json.dump(report, f, indent=1, default=str)
    os.replace(tmp, path)
    if announce:
        print(f"wrote {path}")


def pick_device(name: str):
    """The ``torch.device`` a benchmark's ``--device`` names; ``cuda`` without a GPU exits with
    a message (before anything is set up)."""
    import torch

    device = torch.device(name)
    if device.type == "cpu":
        return device
    if device.type != "cuda" or not torch.cuda.is_available():
        raise SystemExit(f"--device {name}: torch.cuda.is_available() is False here (torch {torch.__version__}, "
                         f"CUDA build: {torch.version.cuda or 'none'}); run on a machine with a CUDA GPU, "
                         f"or use --device cpu")
    return device if device.index is not None else torch.device("cuda", torch.cuda.current_device())


def device_info(device) -> dict:
    """The device a benchmark ran on (and /dev/shm's size: DCP's shared-memory staging lives there)."""
    import torch

    info = {"type": device.type, "cuda": torch.version.cuda}
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        info.update(name=p.name, total_memory=p.total_memory, capability=f"{p.major}.{p.minor}",
                    count=torch.cuda.device_count())
    try:
        info["dev_shm_bytes"] = shutil.disk_usage("/dev/shm").total
    except OSError:
        pass
    return info


def dcp_staging_options(variant: str, cuda: bool):
    """The ``DefaultStager`` options of a DCP variant that brings its own stager (None: it does
    not). ``dcp_pinned`` is torchtitan's ``async_with_pinned_mem``, ``StagingOptions(True, True,
    True, True)``: without CUDA torch ignores the pinning, and DefaultStager refuses
    non-blocking copies, so those are off there."""
    from torch.distributed.checkpoint.staging import StagingOptions

    if variant == "dcp_stager":
        return StagingOptions(use_pinned_memory=cuda, use_shared_memory=False,
                              use_async_staging=True, use_non_blocking_copy=cuda)
    if variant == "dcp_pinned":
        return StagingOptions(use_pinned_memory=True, use_shared_memory=True,
                              use_async_staging=True, use_non_blocking_copy=cuda)
    if variant == "dcp_process_stager":
        return StagingOptions(use_pinned_memory=False, use_shared_memory=True,
                              use_async_staging=True, use_non_blocking_copy=False)
    return None


def make_scratch(directory: str | None, prefix: str) -> tuple[str, str, bool]:
    """A fresh ``prefix*`` directory inside ``directory`` (default ``./bench_tmp``).

    Returns ``(base, root, created_base)``; pass them to :func:`remove_scratch`.
    """
    base = os.path.abspath(directory or "bench_tmp")
    created_base = not os.path.exists(base)
    os.makedirs(base, exist_ok=True)
    return base, tempfile.mkdtemp(prefix=prefix, dir=base), created_base


def remove_scratch(base: str, root: str, created_base: bool) -> None:
    """Remove ``root``, and ``base`` too when this run created it and it is empty."""
    shutil.rmtree(root, ignore_errors=True)
    if created_base:
        try:
            os.rmdir(base)  # only when empty
        except OSError:
            pass


def drop_tree(path: str) -> None:
    """Evict every file under ``path`` from the page cache (the next read hits the disk)."""
    from dcp_datastates import _probes

    if os.path.isfile(path):
        _probes.drop_page_cache(path)
        return
    for root, _dirs, files in os.walk(path):
        for name in files:
            _probes.drop_page_cache(os.path.join(root, name))


def remove(path: str) -> None:
    """Delete a file or tree, then sync (flush the unlink and ext4's discards before the next timed op)."""
    if os.path.isdir(path):
        shutil.rmtree(path)
    elif os.path.exists(path):
        os.remove(path)
    os.sync()


def median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def fmt(x, spec=".2f", width=8):
    return f"{'-' if x is None else format(x, spec):>{width}}"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_gloo() -> None:
    """A 1-rank gloo group, as a trainer would have (DCP's PROCESS executor needs one)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)


def filesystem_type(path: str) -> str:
    """The type of the filesystem ``path`` is on (``tmpfs``, ``ext4``, ...; ``?`` if unknown)."""
    try:
        out = subprocess.run(["findmnt", "-n", "-o", "FSTYPE", "-T", path], capture_output=True, text=True)
        return out.stdout.strip().splitlines()[0] if out.stdout.strip() else "?"
    except OSError:
        return "?"


def mem_available() -> int:
    with open("/proc/meminfo") as f:
        for ln in f:
            if ln.startswith("MemAvailable:"):
                return int(ln.split()[1]) * 1024
    return 0


def machine_info(root: str | None = None) -> dict:
    """CPU, memory, torch and (given ``root``) the filesystem the benchmark writes to."""
    import torch

    info = {
        "nproc": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "kernel": platform.release(),
    }
    try:
        with open("/proc/cpuinfo") as f:
            info["cpu"] = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "?")
        with open("/proc/meminfo") as f:
            info["mem_total_kib"] = int(f.readline().split()[1])
        with open("/proc/loadavg") as f:
            info["loadavg_start"] = f.read().split()[:3]
    except OSError:
        pass
    if root is not None:
        try:
            info["df"] = subprocess.run(["df", "-h", root], capture_output=True, text=True).stdout.strip()
            info["mount"] = subprocess.run(["findmnt", "-n", "-o", "SOURCE,FSTYPE,OPTIONS", "-T", root],
                                           capture_output=True, text=True).stdout.strip()
        except OSError:
            pass
    return info
