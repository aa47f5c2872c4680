"""``dcp-datastates diff``: how much every tensor moved between two checkpoints.

:func:`diff_checkpoints` compares two checkpoints key by key and block by
block (memory is bounded by the block size, not the checkpoints): for each
tensor both hold with the same shape and dtype it reports ``||A||``,
``||B||``, ``||B - A||``, the relative change ``||B - A|| / ||A||``, the
largest ``|B - A|`` and how many elements changed at all (bitwise). Keys
present on one side only, tensors whose shape or dtype differ and Python
objects whose values differ are listed too. The two checkpoints may be ours
or stock DCP and may have been saved with different shardings: every box is
taken from A's saved chunks and read from both, and ``read_block`` assembles
any box from whatever shards hold it.

NaNs are counted (``nan_a``, ``nan_b``) and left out of every norm, so that
one NaN does not turn every number of its tensor into NaN and hide how much
the rest moved.

:func:`run` is the command-line glue: a table of the top movers, or
``--json``, and ``--plot`` (matplotlib) of the relative change per layer.
"""

from __future__ import annotations

import dataclasses
import math
import os
import reprlib
import sys
from typing import Any, Callable, Iterable

import torch

from dcp_datastates.format.file_names import step_of
from dcp_datastates.tools.checkpoint_view import DEFAULT_BLOCK_BYTES, CheckpointView
from dcp_datastates.tools.common import dtype_name, format_table, human_bytes, print_json, quiet_torch_warnings, select_keys
from dcp_datastates.tools.progress import ByteCounter, LazyProgress
from dcp_datastates.errors import UnsafeCheckpointError

# Elements widened to float64 at once: bounds the working memory of a block
# to a few times this (32 MiB per float64 copy), whatever the block size.
_SLICE_ELEMS = 1 << 22

PLOT_NEEDS = "diff --plot needs matplotlib: pip install 'dcp_datastates[plot]'"


@dataclasses.dataclass
class TensorDiff:
    """How one tensor moved from A to B (NaNs excluded from every norm, see the module doc)."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    numel: int
    norm_a: float  # ||A||_2
    norm_b: float  # ||B||_2
    delta: float  # ||B - A||_2
    rel: float  # delta / norm_a (inf when norm_a is 0 and delta is not)
    max_abs: float  # max |B - A|
    changed: int  # elements whose bits differ
    nan_a: int
    nan_b: int


@dataclasses.dataclass
class Mismatch:
    """A key both checkpoints hold, as different kinds, shapes or dtypes: listed, not compared."""

    key: str
    a: str  # "float32 (4, 3)", or "object"
    b: str


@dataclasses.dataclass
class ObjectChange:
    """A saved Python object whose value differs: short reprs of both."""

    key: str
    old: str
    new: str


@dataclasses.dataclass
class DiffReport:
    """Everything :func:`diff_checkpoints` found; :meth:`to_json` is the ``--json`` document."""

    a: str
    b: str
    format_a: str
    format_b: str
    step_a: int | None
    step_b: int | None
    keys: list[str] | None  # the --keys globs, None for every key
    tensors: list[TensorDiff]  # in A's key order
    only_a: list[str]
    only_b: list[str]
    mismatched: list[Mismatch]
    objects_changed: list[ObjectChange]
    objects_same: int
    objects_skipped: list[tuple[str, str]]  # (key, why): objects that could not be read safely
    bytes_compared: int  # bytes of each side's compared tensors

    @property
    def global_rel(self) -> float:
        """sqrt(sum delta^2) / sqrt(sum norm_a^2) over every compared tensor."""
        return _relative(_hypot(t.delta for t in self.tensors), _hypot(t.norm_a for t in self.tensors))

    @property
    def unchanged(self) -> int:
        """Compared tensors that are bit-identical in A and B."""
        return sum(1 for t in self.tensors if t.changed == 0)

    def top(self, k: int) -> list[TensorDiff]:
        """The ``k`` changed tensors with the largest relative change (then the largest delta)."""
        moved = [t for t in self.tensors if t.changed > 0]
        moved.sort(key=lambda t: (_sortable(t.rel), _sortable(t.delta)), reverse=True)
        return moved[:k]

    def to_json(self, top: int = 10, plot: str | None = None) -> dict:
        """A JSON-ready dict; non-finite floats become the strings "inf", "-inf", "nan"."""
        doc = {
            "a": self.a, "b": self.b, "format_a": self.format_a, "format_b": self.format_b,
            "step_a": self.step_a, "step_b": self.step_b, "keys": self.keys,
            "bytes_compared": self.bytes_compared, "global_rel": self.global_rel,
            "compared": len(self.tensors), "unchanged": self.unchanged,
            "top": [t.key for t in self.top(top)],
            "tensors": [dataclasses.asdict(t) | {"shape": list(t.shape)} for t in self.tensors],
            "only_a": self.only_a, "only_b": self.only_b,
            "mismatched": [dataclasses.asdict(m) for m in self.mismatched],
            "objects_changed": [dataclasses.asdict(o) for o in self.objects_changed],
            "objects_same": self.objects_same,
            "objects_skipped": [{"key": k, "why": why} for k, why in self.objects_skipped],
            "plot": plot,
        }
        return _json_safe(doc)


def _sortable(x: float) -> float:
    """NaN sorts below everything (a NaN relative change says nothing about the size of a move)."""
    return -math.inf if math.isnan(x) else x


def _json_safe(value: Any) -> Any:
    """Strict JSON has no Infinity/NaN: write them as strings."""
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def _hypot(values: Iterable[float]) -> float:
    """sqrt(sum x^2) without overflowing on the way (math.hypot scales)."""
    return math.hypot(*values)


def _relative(delta: float, base: float) -> float:
    """delta / base, with 0/0 = 0 and x/0 = inf (a tensor that was all zeros and moved)."""
    if base == 0.0:
        return 0.0 if delta == 0.0 else math.inf
    return delta / base


def diff_checkpoints(
    a: str | os.PathLike,
    b: str | os.PathLike,
    keys: list[str] | None = None,
    block_bytes: int = DEFAULT_BLOCK_BYTES,
    progress: Callable[[int, int], None] | None = None,
    allow_pickle: bool = False,
) -> DiffReport:
    """Compare checkpoint ``b`` against ``a`` (see the module doc for what is reported).

    Args:
        a, b: checkpoint directories (ours or stock DCP, any sharding).
        keys: fnmatch globs; only keys matching one of them are looked at.
        block_bytes: the largest block of one tensor read at once (per side).
        progress: called as ``progress(bytes_done, bytes_total)`` after each block.
        allow_pickle: unpickle saved objects without restriction (trusted checkpoints only).
    """
    view_a = CheckpointView(a, allow_pickle=allow_pickle)
    view_b = CheckpointView(b, allow_pickle=allow_pickle)
    keys_a = select_keys(view_a.keys(), keys)
    keys_b = select_keys(view_b.keys(), keys)
    if keys and not keys_a and not keys_b:
        raise ValueError(f"--keys {' '.join(keys)}: no key of {view_a.path} or {view_b.path} matches")
    in_b = set(keys_b)
    common = [k for k in keys_a if k in in_b]
    compared, mismatched, objects = _classify(view_a, view_b, common)

    counter = ByteCounter(sum(view_a.nbytes(k) for k in compared), progress)
    counter.add(0)
    tensors = [compare_tensor(view_a, view_b, k, block_bytes, counter.add) for k in compared]
    changed, same, skipped = _compare_objects(view_a, view_b, objects)
    in_a = set(keys_a)
    return DiffReport(
        a=view_a.path, b=view_b.path, format_a=view_a.format, format_b=view_b.format,
        step_a=view_a.training_step(), step_b=view_b.training_step(), keys=list(keys) if keys else None,
        tensors=tensors,
        only_a=[k for k in keys_a if k not in in_b], only_b=[k for k in keys_b if k not in in_a],
        mismatched=mismatched, objects_changed=changed, objects_same=same, objects_skipped=skipped,
        bytes_compared=counter.total,
    )


def _classify(view_a: CheckpointView, view_b: CheckpointView, common: list[str]):
    """Split the common keys into comparable tensors, mismatches, and objects."""
    compared, mismatched, objects = [], [], []
    for key in common:
        ta, tb = view_a.tensors.get(key), view_b.tensors.get(key)
        if ta is None and tb is None:
            objects.append(key)
        elif ta is None or tb is None or ta.size != tb.size or ta.properties.dtype != tb.properties.dtype:
            mismatched.append(Mismatch(key, _describe(ta), _describe(tb)))
        else:
            compared.append(key)
    return compared, mismatched, objects


def _describe(md) -> str:
    if md is None:
        return "object"
    return f"{dtype_name(md.properties.dtype)} {tuple(md.size)}"


def compare_tensor(
    view_a: CheckpointView, view_b: CheckpointView, key: str,
    block_bytes: int = DEFAULT_BLOCK_BYTES, advance: Callable[[int], None] | None = None,
) -> TensorDiff:
    """Stream one tensor of A and B box by box (boxes from A's chunks) into a :class:`TensorDiff`."""
    md = view_a.tensors[key]
    itemsize = md.properties.dtype.itemsize
    acc = _Accumulator()
    for offsets, sizes in view_a.block_boxes(key, block_bytes):
        x = view_a.read_block(key, offsets, sizes).reshape(-1)
        y = view_b.read_block(key, offsets, sizes).reshape(-1)
        for start in range(0, x.numel(), _SLICE_ELEMS):
            acc.add(x[start:start + _SLICE_ELEMS], y[start:start + _SLICE_ELEMS])
        if advance is not None:
            advance(x.numel() * itemsize)
    return TensorDiff(
        key=key, dtype=dtype_name(md.properties.dtype), shape=tuple(md.size), numel=math.prod(md.size),
        norm_a=acc.norm_a, norm_b=acc.norm_b, delta=acc.delta, rel=_relative(acc.delta, acc.norm_a),
        max_abs=acc.max_abs, changed=acc.changed, nan_a=acc.nan_a, nan_b=acc.nan_b,
    )


class _Accumulator:
    """Running norms of A, B and B - A over the slices of one tensor, in float64.

    Norms are combined with hypot so that partial sums of squares cannot
    overflow where the final norm would not.
    """

    def __init__(self) -> None:
        self.norm_a = self.norm_b = self.delta = self.max_abs = 0.0
        self.changed = self.nan_a = self.nan_b = 0

    def add(self, x: torch.Tensor, y: torch.Tensor) -> None:
        if x.numel() == 0:
            return
        changed = _bits_differ(x, y)
        self.changed += changed
        wx = _widen(x)
        nan_x = torch.isnan(wx)
        nx = int(nan_x.sum())
        if nx:
            wx = wx.masked_fill(nan_x, 0)
        norm_x = float(torch.linalg.vector_norm(wx))
        self.norm_a = math.hypot(self.norm_a, norm_x)
        self.nan_a += nx
        if changed == 0:  # bit-identical: B's numbers are A's, and B - A is 0
            self.norm_b = math.hypot(self.norm_b, norm_x)
            self.nan_b += nx
            return
        wy = _widen(y)
        nan_y = torch.isnan(wy)
        ny = int(nan_y.sum())
        if ny:
            wy = wy.masked_fill(nan_y, 0)
        self.norm_b = math.hypot(self.norm_b, float(torch.linalg.vector_norm(wy)))
        self.nan_b += ny
        # Equal values differ by 0 even where they are infinite (inf - inf would be NaN);
        # positions where either side is NaN are left out.
        d = torch.where(wx == wy, torch.zeros((), dtype=wx.dtype), wy - wx)
        if nx or ny:
            d = d.masked_fill(nan_x | nan_y, 0)
        d = d.abs()
        self.delta = math.hypot(self.delta, float(torch.linalg.vector_norm(d)))
        self.max_abs = max(self.max_abs, float(d.max()))


def _widen(t: torch.Tensor) -> torch.Tensor:
    """float64 (complex128 for complex) copy: exact for every float, bool and 32-bit int dtype."""
    return t.to(torch.complex128 if t.is_complex() else torch.float64)


_SAME_SIZE_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits_differ(x: torch.Tensor, y: torch.Tensor) -> int:
    """How many elements of two flat tensors of one dtype differ in any bit (NaN payloads, -0.0)."""
    size = x.dtype.itemsize
    if size in _SAME_SIZE_INT:
        as_int = _SAME_SIZE_INT[size]
        return int((x.view(as_int) != y.view(as_int)).sum())
    words = size // 8  # complex128: two int64 per element
    return int((x.view(torch.int64).reshape(-1, words) != y.view(torch.int64).reshape(-1, words)).any(1).sum())


def _compare_objects(view_a: CheckpointView, view_b: CheckpointView, keys: list[str]):
    """(changed objects, number unchanged, skipped (key, why)) for the common object keys."""
    changed, same, skipped = [], 0, []
    for key in keys:
        try:
            old, new = view_a.read_object(key), view_b.read_object(key)
        except UnsafeCheckpointError:
            skipped.append((key, "not plain data: compare with --allow-pickle (trusted checkpoints only)"))
            continue
        if _same_value(old, new):
            same += 1
        else:
            changed.append(ObjectChange(key, short_repr(old), short_repr(new)))
    return changed, same, skipped


def _same_value(x: Any, y: Any) -> bool:
    """Equal values of the same types; NaN equals NaN; tensors bit by bit."""
    if type(x) is not type(y):
        return False
    if isinstance(x, torch.Tensor):
        return x.dtype == y.dtype and x.shape == y.shape and (
            x.numel() == 0 or _bits_differ(x.reshape(-1).contiguous(), y.reshape(-1).contiguous()) == 0
        )
    if isinstance(x, float):
        return x == y or (math.isnan(x) and math.isnan(y))
    if isinstance(x, dict):
        return list(x) == list(y) and all(_same_value(x[k], y[k]) for k in x)
    if isinstance(x, (list, tuple)):
        return len(x) == len(y) and all(_same_value(p, q) for p, q in zip(x, y))
    try:
        return bool(x == y)
    except Exception:  # noqa: BLE001 - an object whose == does not give a truth value
        return repr(x) == repr(y)


_REPR = reprlib.Repr()
_REPR.maxstring = 40
_REPR.maxother = 40
_REPR.maxlist = _REPR.maxtuple = _REPR.maxdict = 6


def short_repr(value: Any) -> str:
    """A one-line repr of at most a few dozen characters (``10``, ``'run-a'``, ``[0.9, 0.95]``)."""
    return " ".join(_REPR.repr(value).split())


def checkpoint_label(path: str, step: int | None) -> str:
    """The directory name, with the step when the name does not already say it."""
    base = os.path.basename(os.path.normpath(path))
    if step is not None and step_of(base) != step:
        base += f" (step {step})"
    return base


def layer_of(key: str) -> str:
    """The layer a key belongs to: up to its first numeric component, else the key minus its last.

    ``model.layers.3.attn.wq.weight`` -> ``model.layers.3``; ``model.2.weight``
    -> ``model.2``; ``model.embed.weight`` -> ``model.embed``; ``w`` -> ``w``.
    """
    parts = key.split(".")
    for i, part in enumerate(parts[:-1]):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return ".".join(parts[:-1]) or key


def plot_tensors(report: DiffReport) -> list[TensorDiff]:
    """The tensors the plot shows: with --keys all selected ones; otherwise the model's.

    The model is the keys under the top-level name ``model`` when there is
    one, else under the top-level name (or the keys without a dot) holding
    the most tensors, leaving out ``optim*`` names: with Adam the optimizer
    state outnumbers the parameters two to one.
    """
    if report.keys or not report.tensors:
        return list(report.tensors)

    def top_name(key: str) -> str:
        return key.split(".", 1)[0] if "." in key else ""

    counts: dict[str, int] = {}
    for t in report.tensors:
        name = top_name(t.key)
        if not name.startswith("optim"):
            counts[name] = counts.get(name, 0) + 1
    if not counts:
        return list(report.tensors)
    chosen = "model" if "model" in counts else max(counts, key=lambda n: counts[n])  # first of the largest
    return [t for t in report.tensors if top_name(t.key) == chosen]


def per_layer(tensors: list[TensorDiff]) -> list[tuple[str, float]]:
    """(layer, sqrt(sum delta^2) / sqrt(sum norm_a^2)) in order of first appearance."""
    groups: dict[str, list[TensorDiff]] = {}
    for t in tensors:
        groups.setdefault(layer_of(t.key), []).append(t)
    return [
        (layer, _relative(_hypot(t.delta for t in ts), _hypot(t.norm_a for t in ts)))
        for layer, ts in groups.items()
    ]


def require_matplotlib() -> None:
    """Fail before the (long) comparison when --plot cannot be drawn."""
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:
        raise RuntimeError(PLOT_NEEDS)


def plot_change_per_layer(report: DiffReport, out: str) -> list[tuple[str, float]]:
    """Write a bar chart of the relative change per layer to the PNG ``out``; returns the bars."""
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")  # no display needed, and never a GUI window from a command-line tool
    import matplotlib.pyplot as plt

    layers = per_layer(plot_tensors(report))
    if not layers:
        raise ValueError(f"{out}: nothing to plot: no tensor was compared")
    names = [name for name, _ in layers]
    values = [v if math.isfinite(v) else math.nan for _, v in layers]  # inf (moved from all zeros): no bar
    labels = [n if math.isfinite(v) else f"{n} (inf)" for n, v in layers]
    positive = [v for v in values if v > 0]
    width = min(40.0, max(6.0, 0.4 * len(names) + 2.0))
    fig, ax = plt.subplots(figsize=(width, 4.8), dpi=100)
    try:
        ax.bar(range(len(names)), [0.0 if math.isnan(v) else v for v in values], color="tab:blue")
        if positive and max(positive) / min(positive) > 100.0:
            ax.set_yscale("log")
        ax.set_xticks(range(len(names)))
        ax.set_xticklabels(labels, rotation=60, ha="right", fontsize=8)
        ax.set_ylabel("||B - A|| / ||A||")
        title_a = checkpoint_label(report.a, report.step_a)
        title_b = checkpoint_label(report.b, report.step_b)
        ax.set_title(f"relative change per layer: {title_a} \u2192 {title_b}", fontsize=10)
        ax.grid(axis="y", alpha=0.3)
        fig.tight_layout()
        fig.savefig(out, format="png")
    finally:
        plt.close(fig)
    return layers


def run(args) -> int:
    """``dcp-datastates diff``: the report as a table (or JSON), and the plot; exit status 0."""
    if args.plot:
        require_matplotlib()
    with LazyProgress("diff", quiet=args.quiet) as progress, quiet_torch_warnings():
        report = diff_checkpoints(
            args.a, args.b, keys=args.keys, block_bytes=args.block_bytes, progress=progress,
            allow_pickle=args.allow_pickle,
        )
    if args.plot:
        plot_change_per_layer(report, args.plot)
    if args.json:
        print_json(report.to_json(top=args.top, plot=args.plot))
    else:
        sys.stdout.write(format_report(report, args.top, args.plot))
    return 0


def _fmt(x: float) -> str:
    return f"{x:.3e}"


def _delta_sign() -> str:
    """Δ, or D where stdout cannot encode it."""
    try:
        "\u0394".encode(sys.stdout.encoding or "utf-8")  # no encoding: a text buffer
        return "\u0394"
    except (UnicodeEncodeError, LookupError):
        return "D"


def format_report(report: DiffReport, top: int, plot: str | None = None) -> str:
    """The human-readable report: header, top movers, then everything that was not a plain move."""
    n = len(report.tensors)
    objects = report.objects_same + len(report.objects_changed) + len(report.objects_skipped)
    out = [
        f"A: {report.a}  [{report.format_a}{_step_note(report.step_a)}]",
        f"B: {report.b}  [{report.format_b}{_step_note(report.step_b)}]",
        f"compared: {n} tensors ({human_bytes(report.bytes_compared)} each side), {objects} objects"
        + (f"; keys {' '.join(report.keys)}" if report.keys else ""),
        f"global relative change ||B-A||/||A||: {_fmt(report.global_rel)}",
        "",
    ]
    movers = report.top(top)
    moved = n - report.unchanged
    if movers:
        out.append(f"top {len(movers)} of {moved} changed tensors by relative change:")
        rows = [
            [t.key, str(t.shape), t.dtype, _fmt(t.norm_a), _fmt(t.delta), _fmt(t.rel), _fmt(t.max_abs)]
            for t in movers
        ]
        out += format_table(["KEY", "SHAPE", "DTYPE", "||A||", "||B-A||", "REL", f"MAX|{_delta_sign()}|"], rows, {3, 4, 5, 6})
        out.append("")
    out.append(f"unchanged: {report.unchanged} of {n} tensors bit-identical")
    with_nan = [t for t in report.tensors if t.nan_a or t.nan_b]
    if with_nan:
        out.append("NaNs (left out of the norms):")
        out += [f"  {t.key}: {t.nan_a} in A, {t.nan_b} in B" for t in with_nan]
    out += _listing("only in A", report.only_a)
    out += _listing("only in B", report.only_b)
    out += _listing("mismatched (not compared)", [f"{m.key}: {m.a} -> {m.b}" for m in report.mismatched])
    out += _listing("changed objects", [f"{o.key}: {o.old} -> {o.new}" for o in report.objects_changed])
    out += _listing("objects not compared", [f"{k}: {why}" for k, why in report.objects_skipped])
    if plot:
        out.append(f"plot: {plot}")
    return "\n".join(out) + "\n"


def _step_note(step: int | None) -> str:
    return "" if step is None else f", step {step}"


def _listing(title: str, items: list[str]) -> list[str]:
    if not items:
        return []
    return [f"{title}: {len(items)}"] + [f"  {item}" for item in items]
