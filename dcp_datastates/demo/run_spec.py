"""RunSpec: everything one run of the demo needs, handed from the launcher to each spawned rank.

A run is a fresh set of processes; the spec is pickled to them, so it holds
plain values only (the model's configuration, paths, options), never
objects that live in one process.
"""

from __future__ import annotations

import dataclasses

from dcp_datastates.demo.model import ModelConfig


@dataclasses.dataclass
class RunSpec:
    """Everything a worker needs for one run (pickled to the spawned ranks)."""

    name: str
    world: int
    device: str  # "cpu" or "cuda"
    model: ModelConfig
    seed: int
    steps: int  # last step to train (inclusive)
    steps_total: int  # horizon of the learning-rate schedule (the same in every run)
    ckpt_every: int
    ckpt_root: str  # step_<N> directories go here
    writer: str  # "datastates" or "dcp"
    log_path: str  # rank 0 appends JSON lines (survives the simulated crash)
    global_batch: int
    data_shards: int
    lr: float
    warmup: int
    fail_at: int | None = None
    resume: bool = False  # start from the newest good checkpoint under ckpt_root
    keep_last: int | None = None  # CheckpointManager retention (ours)
    store_port: int = 0
    pg_timeout_s: float = 120.0
    host_cache_bytes: int = 32 << 20
    io_threads: int = 2
    direct_io: str = "auto"
    threads: int = 1
    progress_every: int = 25
