#!/usr/bin/env python
"""What DCP's discarded DEBUG records cost a save: dcp.save of 20,000 small tensors (one
top-level key each) to tmpfs with DCP's logger at DEBUG (as torch leaves it) and at INFO (as
DataStatesWriter sets it where only NullHandlers listen), alternating.

    python benchmarks/bench_dcp_logging.py
"""

import logging, shutil, sys, tempfile, time, warnings
warnings.filterwarnings("ignore")
sys.path.insert(0, __import__("os").path.dirname(__file__))
import torch.distributed.checkpoint as dcp
from bench_save_load import make_small_state
from dcp_datastates import DataStatesWriter
state = make_small_state(20000)
log = logging.getLogger("c10d-NullHandler-dcp_logger")
for level in (logging.DEBUG, logging.INFO) * 2:
    d = tempfile.mkdtemp(dir="/dev/shm")
    writer = DataStatesWriter(d)
    log.setLevel(level)
    t = time.perf_counter()
    dcp.save(state, storage_writer=writer, no_dist=True)
    print(logging.getLevelName(level), f"{time.perf_counter() - t:.2f} s")
    shutil.rmtree(d)
