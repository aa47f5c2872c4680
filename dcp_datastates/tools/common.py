"""What every ``dcp-datastates`` command shares: its name, how it prints, how ``--keys`` selects.

The commands (:mod:`tools.commands`) import this module, never ``cli``,
which imports them: the entry point sits on top and
nothing reaches back into it. Tables are for people; ``--json`` output
keeps exact numbers.
"""

from __future__ import annotations

import contextlib
import fnmatch
import json
import warnings
from typing import Iterable

PROG = "dcp-datastates"


def one_line(exc: BaseException) -> str:
    """An exception as one line: its message (errors from the library name the file and key)."""
    text = str(exc) if str(exc) else type(exc).__name__
    if isinstance(exc, KeyError) and exc.args:
        text = str(exc.args[0])
    elif isinstance(exc, OSError) and exc.filename and exc.strerror:
        text = f"{exc.filename}: {exc.strerror}"
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return "; ".join(lines) if lines else type(exc).__name__


@contextlib.contextmanager
def quiet_torch_warnings():
    """Hide torch's notices that say nothing about the command's work (complex32 is
    "experimental", DCP runs without a process group), so a tool prints only its own lines."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="ComplexHalf support is experimental")
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        warnings.filterwarnings("ignore", message=".*process group.*not.*initialized", category=UserWarning)
        yield


def print_json(doc) -> None:
    """A command's ``--json`` output, the one way every command writes it: one JSON document on
    stdout (exact numbers, indented), and nothing else there."""
    print(json.dumps(doc, indent=2))


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


def format_fields(fields: list[tuple[str, str]]) -> list[str]:
    """``(name, value)`` pairs as lines with the values aligned: a command's closing summary."""
    width = max(len(name) for name, _ in fields)
    return [f"{name:<{width}}  {value}" for name, value in fields]


def key_selected(key: str, globs: list[str] | None) -> bool:
    """Whether ``key`` matches one of the ``--keys`` globs (``fnmatch``, case-sensitive);
    every key is selected when there are none."""
    return not globs or any(fnmatch.fnmatchcase(key, g) for g in globs)


def select_keys(keys: Iterable[str], globs: list[str] | None) -> list[str]:
    """The keys matching one of the globs (all of them without globs), in the order given."""
    return [k for k in keys if key_selected(k, globs)]
