"""A run's log: JSON lines rank 0 appends while it trains, which the launcher reads afterwards.

The log is how results cross from the spawned ranks to the parent, and it
must survive the simulated crash (every rank leaves with ``os._exit``), so
each record is written and flushed as it happens. Records carry a ``kind``:

- ``loss``: ``step``, ``loss``, ``world``, one per finished step;
- ``ckpt``: one per checkpoint, its cost merged over the ranks (see checkpointer.py);
- ``resumed``: ``from_step``, ``path``, ``load_s``, ``world``, when a run resumed;
- ``crash``: ``step``, written just before the simulated failure;
- ``done``: ``step``, ``lifetime_peak_rss_mb``, at the end of a run.
"""

from __future__ import annotations

import json
import os


class RunLog:
    """Appends records to ``path`` as JSON lines; a log without a path (ranks other than 0) drops them."""

    def __init__(self, path: str | None) -> None:
        self._file = open(path, "a") if path is not None else None

    def __call__(self, record: dict) -> None:
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


def read_log(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def losses_of(records: list[dict]) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in records if r["kind"] == "loss"}


def ckpts_of(records: list[dict]) -> dict[int, dict]:
    return {r["step"]: r for r in records if r["kind"] == "ckpt"}


def first_of(records: list[dict], kind: str) -> dict | None:
    """The first record of ``kind`` (``crash``, ``resumed``), or None if the run never wrote one."""
    return next((r for r in records if r["kind"] == kind), None)
