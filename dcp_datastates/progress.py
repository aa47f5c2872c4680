"""Progress bars for the command-line tool: tqdm on stderr, silent when not a terminal."""

from __future__ import annotations

import sys


def progress_bar(total: int, desc: str, *, unit: str = "B", quiet: bool = False):
    """A tqdm bar counting ``total`` units (bytes by default, scaled as KiB/MiB/GiB).

    Disabled with ``quiet`` and whenever stderr is not a terminal (tqdm's
    ``disable=None``), so piped and scripted runs print only their results.
    """
    from tqdm import tqdm

    scaled = unit == "B"
    return tqdm(
        total=total, desc=desc, unit=unit, unit_scale=scaled, unit_divisor=1024 if scaled else 1000,
        file=sys.stderr, disable=True if quiet else None, dynamic_ncols=True,
    )
