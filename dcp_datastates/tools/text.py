"""How the command-line tool prints: byte sizes, dtype names, aligned tables.

Tables are for people; ``--json`` output keeps exact numbers.
"""

from __future__ import annotations


def human_bytes(n: int | None) -> str:
    """``1536`` -> ``1.5 KiB``: binary units, one decimal (``-`` for an unknown size)."""
    if n is None:
        return "-"
    if n < 1024:
        return f"{n} B"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB", "PiB"):
        value /= 1024
        if value < 1024 or unit == "PiB":
            return f"{value:.1f} {unit}"
    raise AssertionError


def dtype_name(dtype) -> str:
    """torch's name without the module: ``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def format_table(headers: list[str], rows: list[list[str]], right: set[int] = frozenset()) -> list[str]:
    """Rows as aligned text lines, two spaces apart; columns in ``right`` are right-aligned (numbers)."""
    widths = [max(len(str(r[i])) for r in [headers] + rows) for i in range(len(headers))]

    def line(cells):
        parts = [str(c).rjust(w) if i in right else str(c).ljust(w) for i, (c, w) in enumerate(zip(cells, widths))]
        return "  ".join(parts).rstrip()

    return [line(headers)] + [line(r) for r in rows]
