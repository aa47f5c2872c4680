"""Host memory of this process: current RSS, peak RSS, and resetting the peak.

The demo reports the peak host RSS of every checkpoint, so the peak must be
reset before each save (Linux's ``clear_refs``); where that is impossible
the report says the numbers are the process peak so far.
"""

from __future__ import annotations

import sys


def _status_kb(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def rss_mb() -> float:
    kb = _status_kb("VmRSS")
    return kb / 1024 if kb is not None else float("nan")


def peak_rss_mb() -> float:
    kb = _status_kb("VmHWM")
    if kb is None:  # not Linux: getrusage reports the lifetime peak (KiB on Linux, bytes on macOS)
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak / (1024 * 1024) if sys.platform == "darwin" else peak / 1024
    return kb / 1024


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0) so a peak can be taken per checkpoint."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False
