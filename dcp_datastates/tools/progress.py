"""Progress bars for the command-line tool: tqdm on stderr, silent when not a terminal."""

from __future__ import annotations

import sys
from typing import Callable


def progress_bar(total: int, desc: str, *, unit: str = "B", quiet: bool = False):
    """A tqdm bar counting ``total`` units (bytes by default, scaled as KiB/MiB/GiB).

    Disabled with ``quiet`` and whenever stderr is not a terminal (tqdm's
    ``disable=None``), so piped and scripted runs print only their results.
    """
    try:
        from tqdm import tqdm
    except ImportError:  # installed with --no-deps on a machine without tqdm: no bar, same results
        return _NoBar()

    scaled = unit == "B"
    return tqdm(
        total=total, desc=desc, unit=unit, unit_scale=scaled, unit_divisor=1024 if scaled else 1000,
        file=sys.stderr, disable=True if quiet else None, dynamic_ncols=True,
    )


class _NoBar:
    """What ``progress_bar`` returns without tqdm: counts, draws nothing."""

    n = 0

    def update(self, k: int) -> None:
        self.n += k

    def close(self) -> None:
        pass


class LazyProgress:
    """A ``progress(done, total)`` callback for the library functions, drawing a bar.

    The bar opens on the first call, when the total is known; ``close()``
    (also as a context manager) ends it.
    """

    def __init__(self, desc: str, quiet: bool = False) -> None:
        self.desc, self.quiet, self.bar = desc, quiet, None

    def __call__(self, done: int, total: int) -> None:
        if self.bar is None:
            self.bar = progress_bar(total, self.desc, quiet=self.quiet)
        self.bar.update(done - self.bar.n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()

    def __enter__(self) -> "LazyProgress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class ByteCounter:
    """Counts the bytes a library function has moved and reports ``(done, total)`` to its callback."""

    def __init__(self, total: int, callback: Callable[[int, int], None] | None) -> None:
        self.total, self.done, self.callback = total, 0, callback

    def add(self, nbytes: int) -> None:
        self.done += nbytes
        if self.callback is not None:
            self.callback(self.done, self.total)
