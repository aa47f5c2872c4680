"""When the drain to the durable tier may start its next block of I/O.

The drain runs in the training process, in the gaps between checkpoints: a
``save()`` that starts while a block is under way is slowed by it (its memory
traffic, the caches it evicts, the core it takes; docs/benchmarks.md), even
with small blocks and a pause while saves run. So the drain

- waits while a save of the manager runs (its snapshot copies the training
  state the optimizer's fence may wait for, then it writes the fast tier), and
- keeps a quiet *guard* before the next save it expects: training loops save
  at a steady cadence, so the next ``save()`` is due one interval (the median
  of the last few) after the last one started. Within ``guard`` of that time
  the drain waits for the save to come; if it is ``guard`` late, the drain
  goes on (a loop that changed its cadence costs at most one guard of drain
  time, and the intervals it then sees replace the old ones).

The guard is 5% of the interval, between 20 ms and 250 ms: the drain gives
up at most about a tenth of its time between saves.
"""

from __future__ import annotations

import collections
import statistics
import threading
import time
from collections.abc import Callable

GUARD_FRACTION = 0.05
MIN_GUARD_S = 0.02
MAX_GUARD_S = 0.25
INTERVALS_KEPT = 5


class DrainPacer:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._cond = threading.Condition()
        self._saving = False
        self._starts: collections.deque[float] = collections.deque(maxlen=INTERVALS_KEPT + 1)

    def save_started(self) -> None:
        """A ``save()`` call began (its time predicts the next one)."""
        with self._cond:
            self._starts.append(self._clock())
            self._cond.notify_all()

    def set_saving(self, saving: bool) -> None:
        """Whether a save of the manager runs now (the drain waits while it does)."""
        with self._cond:
            self._saving = saving
            self._cond.notify_all()

    def next_save(self) -> tuple[float, float] | None:
        """When the next save is expected, and the guard around it (None: no cadence yet)."""
        with self._cond:
            return self._expected()

    def _expected(self) -> tuple[float, float] | None:
        starts = self._starts
        if len(starts) < 2:
            return None
        interval = statistics.median(b - a for a, b in zip(starts, list(starts)[1:]))
        guard = min(MAX_GUARD_S, max(MIN_GUARD_S, GUARD_FRACTION * interval))
        return starts[-1] + interval, guard

    def wait_for_gap(self) -> None:
        """Return once the drain may start a block: no save runs, and the next expected save
        is more than a guard away (or more than a guard late)."""
        with self._cond:
            while True:
                if self._saving:
                    self._cond.wait()
                    continue
                expected = self._expected()
                if expected is None:
                    return
                due, guard = expected
                now = self._clock()
                if now < due - guard or now >= due + guard:
                    return
                self._cond.wait(due + guard - now)
