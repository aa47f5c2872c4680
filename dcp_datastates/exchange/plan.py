"""Who sends which bytes to whom: the exchange's plans, pure functions every rank computes alike.

A plan is a list of :class:`Message` s, each a route (the rank that has the bytes, then the
ranks that receive them, each forwarding to the next: a chain, so that no rank sends a
byte more than once) and the :class:`Segment` s of pieces it carries (at most
``chunk_bytes`` in all). Every rank derives its own operations from the same plan
(:func:`ops_of`), in one total order, so that each send meets its receive: messages
round-robin over the routes, and within a message hop after hop.

:func:`plan_reads` plans a read-once load round: every rank's ranges, gathered, cut into
pieces at every range's ends; each piece needed by several ranks (or by a rank that cannot
read its file) is read from storage by one rank and passed on to the others.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class Segment:
    """Bytes ``[at, at + nbytes)`` of piece ``piece`` (offsets in the piece)."""

    piece: int
    at: int
    nbytes: int


@dataclasses.dataclass(frozen=True)
class Message:
    """One transfer unit: its route (the sender first) and what it carries."""

    index: int  # its place in the plan's order
    route: tuple[int, ...]
    segments: tuple[Segment, ...]
    nbytes: int


@dataclasses.dataclass(frozen=True)
class Op:
    """One send or receive of a rank: ``message`` at ``hop`` (sender ``route[hop]``, receiver
    ``route[hop + 1]``). A send at a hop past the first forwards what this rank received at the
    hop before: ``after`` is that receive's place in the rank's list."""

    send: bool
    peer: int
    message: Message
    hop: int
    after: int | None = None


def pack(routes: Sequence[tuple[tuple[int, ...], Sequence[tuple[int, int]]]], chunk_bytes: int) -> list[Message]:
    """Messages of at most ``chunk_bytes`` for each ``(route, [(piece, nbytes), ...])`` (a piece
    larger than a message is split; small ones share one), ordered round-robin over the routes
    (the k-th message of every route before any route's (k+1)-th), so that every sender starts
    at once."""
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
    per_route: list[list[tuple[tuple[int, ...], tuple[Segment, ...], int]]] = []
    for route, pieces in routes:
        out: list = []
        current: list[Segment] = []
        filled = 0
        for piece, nbytes in pieces:
            at = 0
            while at < nbytes:
                take = min(nbytes - at, chunk_bytes - filled)
                current.append(Segment(piece, at, take))
                at += take
                filled += take
                if filled == chunk_bytes:
                    out.append((route, tuple(current), filled))
                    current, filled = [], 0
        if current:
            out.append((route, tuple(current), filled))
        per_route.append(out)
    messages: list[Message] = []
    for k in range(max((len(m) for m in per_route), default=0)):
        for msgs in per_route:
            if k < len(msgs):
                route, segments, nbytes = msgs[k]
                messages.append(Message(len(messages), route, segments, nbytes))
    return messages


def ops_of(messages: Sequence[Message], rank: int) -> list[Op]:
    """``rank``'s sends and receives, in the plan's total order (message, then hop)."""
    ops: list[Op] = []
    for m in messages:
        route = m.route
        if rank not in route:
            continue
        received_at = None
        for hop in range(len(route) - 1):
            if route[hop + 1] == rank:
                received_at = len(ops)
                ops.append(Op(False, route[hop], m, hop))
            elif route[hop] == rank:
                ops.append(Op(True, route[hop + 1], m, hop, None if hop == 0 else received_at))
    return ops


def chain(first: int, others, nodes: Sequence[int] | None) -> tuple[int, ...]:
    """The route of bytes ``first`` has and ``others`` need: the ranks of ``first``'s node
    first, then node by node, so that the bytes cross each node boundary once."""
    if nodes is None:
        return (first, *sorted(others))
    home = nodes[first]
    return (first, *sorted(others, key=lambda r: (nodes[r] != home, nodes[r], r)))


# -- read-once rounds ------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Piece:
    """Bytes ``[start, end)`` of ``keys[key]``, read from storage by ``reader`` (None: no rank
    can) and wanted by the reads ``rows`` (global row numbers, see :class:`ReadPlan`), every
    one of which holds it whole."""

    key: int
    start: int
    end: int
    reader: int | None
    rows: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return self.end - self.start


@dataclasses.dataclass
class ReadPlan:
    """One round of a read-once load: the ranks' reads (row ``i`` is read ``row_read[i]`` of
    rank ``row_rank[i]``), the pieces they are cut into, and the messages that carry pieces
    to the ranks that need them and did not read them."""

    keys: list[str]
    row_rank: np.ndarray
    row_read: np.ndarray
    pieces: list[Piece]
    messages: list[Message]

    def rows_of(self, rank: int) -> np.ndarray:
        return np.flatnonzero(self.row_rank == rank)


Access = Callable[[int, str], "int | None"]  # (rank, key) -> the cost of reading it there (lower is nearer), None: cannot


def plan_reads(needs: Sequence[tuple[Sequence[str], np.ndarray, np.ndarray, np.ndarray]], *, chunk_bytes: int,
               access: Access | None = None, nodes: Sequence[int] | None = None) -> ReadPlan:
    """Plan one read-once round from every rank's reads (``needs[r]``: rank ``r``'s key names,
    and per read the key's number in them, its offset and its length).

    The reads are cut at every read's ends into pieces, each covered by the same reads
    throughout. A piece one rank needs and can read is read by it; any other is read by one
    of the ranks nearest its file (``access``: uniform without it), a rank that needs it if
    one is, the least loaded so far, and chained on to the ranks that need it."""
    keys = sorted({k for names, *_ in needs for k in names})
    number = {k: i for i, k in enumerate(keys)}
    parts = []
    for rank, (names, kidx, offsets, lengths) in enumerate(needs):
        if len(kidx) == 0:
            continue
        remap = np.array([number[k] for k in names], dtype=np.int64)
        parts.append((np.full(len(kidx), rank, np.int64), np.arange(len(kidx), dtype=np.int64),
                      remap[np.asarray(kidx, np.int64)], np.asarray(offsets, np.int64),
                      np.asarray(offsets, np.int64) + np.asarray(lengths, np.int64)))
    if not parts:
        empty = np.zeros(0, np.int64)
        return ReadPlan(keys, empty, empty, [], [])
    row_rank, row_read, key, start, end = (np.concatenate(c) for c in zip(*parts))
    keep = end > start  # empty reads need nothing
    covered = _cover(key[keep], start[keep], end[keep], np.flatnonzero(keep))
    levels = _levels(keys, len(needs), access)
    cut = _split(covered, row_rank, chunk_bytes, len(needs))
    wanted = [sorted({int(row_rank[r]) for r in rows}) for _k, _lo, _hi, rows in cut]
    readers: list[int | None] = [None] * len(cut)
    load = [0] * len(needs)
    # Largest first, each to the least loaded rank that may read it: the readers' shares even out.
    for i in sorted(range(len(cut)), key=lambda i: (-(cut[i][2] - cut[i][1]), i)):
        k, lo, hi, _rows = cut[i]
        readers[i] = _reader(wanted[i], levels[k], load)
        if readers[i] is not None:
            load[readers[i]] += hi - lo
    pieces: list[Piece] = []
    by_route: dict[tuple[int, ...], list[tuple[int, int]]] = {}
    for i, (k, lo, hi, rows) in enumerate(cut):
        others = [r for r in wanted[i] if r != readers[i]]
        if readers[i] is not None and others:
            by_route.setdefault(chain(readers[i], others, nodes), []).append((len(pieces), hi - lo))
        pieces.append(Piece(k, lo, hi, readers[i], rows))
    messages = pack(sorted(by_route.items()), chunk_bytes)
    return ReadPlan(keys, row_rank, row_read, pieces, messages)


SPLIT_MIN_BYTES = 64 << 20  # a piece several ranks need is read in parts of at most this (or a fair share)


def _split(covered: list, row_rank: np.ndarray, chunk_bytes: int, ranks: int) -> list:
    """Pieces several ranks need cut into parts of at most a fair share of all such bytes (and at
    least a message, at most :data:`SPLIT_MIN_BYTES`), so that no one rank reads a large
    replicated tensor alone while the others wait for it."""
    shared = [c for c in covered if len({int(row_rank[r]) for r in c[3]}) > 1]
    if not shared:
        return covered
    total = sum(hi - lo for _k, lo, hi, _r in shared)
    part = max(chunk_bytes, min(SPLIT_MIN_BYTES, -(-total // ranks)))
    out = []
    for k, lo, hi, rows in covered:
        if hi - lo > part and len({int(row_rank[r]) for r in rows}) > 1:
            out.extend((k, at, min(at + part, hi), rows) for at in range(lo, hi, part))
        else:
            out.append((k, lo, hi, rows))
    return out


def _levels(keys: list[str], ranks: int, access: Access | None) -> list[list[int | None]]:
    if access is None:
        return [[0] * ranks for _ in keys]
    return [[access(r, k) for r in range(ranks)] for k in keys]


def _reader(wanted: list[int], levels: list[int | None], load: list[int]) -> int | None:
    """The rank that reads a piece: among the ranks nearest its file, one that needs it if any
    does, the least loaded (then the lowest)."""
    reachable = [lv for lv in levels if lv is not None]
    if not reachable:
        return None
    best = min(reachable)
    near = [r for r, lv in enumerate(levels) if lv == best]
    pool = [r for r in wanted if levels[r] == best] or near
    return min(pool, key=lambda r: (load[r], r))


def _cover(key: np.ndarray, start: np.ndarray, end: np.ndarray, row: np.ndarray) -> list[tuple[int, int, int, tuple]]:
    """``(key, start, end, rows)`` of every piece: the reads' ranges cut at every range's ends,
    neighbours covered by the same rows joined again, sorted by key and offset."""
    if len(key) == 0:
        return []
    # Fast path: ranges that are either identical or disjoint (replicated items, or every rank
    # reading its own bytes) are the pieces themselves.
    order = np.lexsort((end, start, key))
    k, s, e, r = key[order], start[order], end[order], row[order]
    new = np.ones(len(k), bool)
    new[1:] = (k[1:] != k[:-1]) | (s[1:] != s[:-1]) | (e[1:] != e[:-1])
    heads = np.flatnonzero(new)
    uk, us, ue = k[heads], s[heads], e[heads]
    if not any(_overlap(us[a:b], ue[a:b]) for a, b in _runs(uk)):
        bounds = np.append(heads, len(k))
        rows = r.tolist()
        return [(int(uk[i]), int(us[i]), int(ue[i]), tuple(sorted(rows[bounds[i]:bounds[i + 1]])))
                for i in range(len(heads))]
    return _cover_overlapping(k, s, e, r)


def _runs(sorted_keys: np.ndarray) -> list[tuple[int, int]]:
    """``[start, end)`` of each run of equal values in a sorted array."""
    cut = np.flatnonzero(np.diff(sorted_keys)) + 1
    edges = [0, *cut.tolist(), len(sorted_keys)]
    return list(zip(edges[:-1], edges[1:]))


def _overlap(starts: np.ndarray, ends: np.ndarray) -> bool:
    """Whether any of the ranges (sorted by start, none equal) overlaps one before it."""
    return len(starts) > 1 and bool(np.any(starts[1:] < np.maximum.accumulate(ends)[:-1]))


def _cover_overlapping(key: np.ndarray, start: np.ndarray, end: np.ndarray, row: np.ndarray) -> list:
    """The general case of :func:`_cover` (ranges that overlap without being equal: reads of a
    resharded chunk widened to the checksum segments they cut through)."""
    out: list = []
    for kv in np.unique(key):
        sel = key == kv
        s, e, r = start[sel], end[sel], row[sel]
        points = np.unique(np.concatenate((s, e)))
        first = np.searchsorted(points, s)
        last = np.searchsorted(points, e)  # the elementary ranges first..last-1 of each read
        span = last - first
        elem = np.repeat(first, span) + (np.arange(span.sum()) - np.repeat(np.cumsum(span) - span, span))
        who = np.repeat(r, span)
        o = np.lexsort((who, elem))
        elem, who = elem[o], who[o]
        cut = np.flatnonzero(np.diff(elem)) + 1
        prev = None
        for idx, rows in zip(np.split(elem, cut), np.split(who, cut)):
            j = int(idx[0])
            lo, hi, rows = int(points[j]), int(points[j + 1]), tuple(int(x) for x in rows)
            if prev is not None and prev[2] == lo and prev[3] == rows:
                prev[2] = hi
                continue
            prev = [int(kv), lo, hi, rows]
            out.append(prev)
    return [tuple(p) for p in out]
