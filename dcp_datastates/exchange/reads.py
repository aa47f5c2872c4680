"""Read-once loads: saved bytes several ranks need are read from storage by one of them.

A load's ranks each hand a round of reads (:class:`storage.RangeRead`: a range of a
checkpoint file into its destination, with the checksum segments that verify it) to
:meth:`ReadSession.read` together. The ranges are gathered and planned
(:func:`plan.plan_reads`): each piece several ranks need is read by one, which passes it
along a chain of the others; a piece only another node holds is read there and sent. Then:

1. every rank reads from storage the pieces planned for it (a read whose pieces are all its
   own is read as it is, verified by the store as always);
2. the messages go round (:func:`transfer.run_ops`), each received straight into its
   destination where it is one range;
3. every read that was not verified whole by the store is verified in place against its
   segments: what a rank received is checked end to end, wherever it was read;
4. the ranks' storage failures are gathered, so that a read fed by a piece another rank
   could not read fails with that rank's error, and every rank agrees.

Rounds repeat while any rank has reads left (a load's batches differ in number between
ranks); :meth:`ReadSession.finish` joins the rounds of the others once this rank is done.
"""

from __future__ import annotations

import errno as _errno
from collections.abc import Sequence

import numpy as np
import torch

from dcp_datastates.exchange.channel import Channel
from dcp_datastates.exchange.plan import Access, Op, ReadPlan, ops_of, plan_reads
from dcp_datastates.exchange.transfer import BufferPool, Endpoint, run_ops
from dcp_datastates.native import engine as _native
from dcp_datastates.storage.store import (
    RangeRead,
    ShortObjectError,
    Store,
    StoreError,
    checks_of,
    memory_at,
    verify_in_place,
)


class ReadSession:
    """The read-once rounds of one load on ``channel`` (every rank of its group takes part).

    ``access(rank, key)``: how near each rank is to each file (lower is nearer; None: it
    cannot read it); without it every rank reads every file alike. ``bytes_read``: what this
    rank read from storage; ``bytes_received``: what it got from the others."""

    def __init__(self, channel: Channel, access: Access | None = None) -> None:
        self.channel = channel
        self.access = access
        self.bytes_read = 0
        self.bytes_received = 0
        self.rounds = 0
        self._others_done = False

    def read(self, store: Store, reads: Sequence[RangeRead], *, last: bool, threads: int | None = None) -> list:
        """One round: carry out ``reads`` (this rank's) with the other ranks' rounds; return the
        failures of the checkpoint's bytes as :meth:`Store.read_batch` does (a store that did
        not answer, here or on the rank that read a piece for this one, raises StoreError)."""
        reads = list(reads)
        checks: list = []
        failures: list = []
        wanted: list[int] = []
        refused: BaseException | None = None
        for i, read in enumerate(reads):
            try:
                checks.append(checks_of(store, read))
                wanted.append(i)
            except Exception as exc:  # noqa: BLE001 - a read its segments do not tile: raised once the round ends
                checks.append(None)
                refused = refused or exc
        names, kidx, offsets, lengths = _needs([reads[i] for i in wanted])
        gathered = self.channel.gather(((names, kidx, offsets, lengths), last))
        self._others_done = all(g[1] for g in gathered)
        self.rounds += 1
        plan = plan_reads([g[0] for g in gathered], chunk_bytes=self.channel.chunk_bytes, access=self.access,
                          nodes=self.channel.nodes)
        mine = [reads[i] for i in wanted]
        round_ = _Round(self.channel, plan, store, mine, [checks[i] for i in wanted], threads)
        got, raised = round_.run()
        self.bytes_read += round_.bytes_read
        self.bytes_received += round_.bytes_received
        failures += [_native.ReadFailure(request=wanted[f.request], kind=f.kind, errno=f.errno, path=f.path,
                                         offset=f.offset, message=f.message) for f in got]
        if raised is not None:
            raise raised
        if refused is not None:
            raise refused
        return sorted(failures, key=lambda f: f.request)

    def finish(self, store: Store, threads: int | None = None) -> None:
        """This rank has no reads left: take part in the others' rounds until they are done too."""
        while not self._others_done:
            self.read(store, [], last=True, threads=threads)

    def leave(self, store: Store) -> None:
        """This rank's load failed between rounds: take part in the others' rounds with nothing
        to read, so that they end instead of waiting for it (a channel that failed is left
        alone: its peers fail too)."""
        if self.channel.broken is not None:
            return
        try:
            self.finish(store)
        except Exception:  # noqa: BLE001 - the error that stopped this rank's load is the one raised
            pass


def _needs(reads: Sequence[RangeRead]):
    """A rank's reads as the plan takes them: key names, and per read its key's number, offset, length."""
    names: list[str] = []
    number: dict[str, int] = {}
    kidx = np.empty(len(reads), np.int32)
    offsets = np.empty(len(reads), np.int64)
    lengths = np.empty(len(reads), np.int64)
    for i, r in enumerate(reads):
        k = number.get(r.key)
        if k is None:
            k = number[r.key] = len(names)
            names.append(r.key)
        kidx[i], offsets[i], lengths[i] = k, r.offset, r.nbytes
    return names, kidx, offsets, lengths


def _failure(request: int, read: RangeRead, store: Store, kind: str, message: str, offset: int | None = None):
    return _native.ReadFailure(request=request, kind=kind, errno=_errno.EIO, path=store.where(read.key),
                               offset=read.offset if offset is None else offset, message=message)


class _Round(Endpoint):
    """One rank's part of a planned round (see the module docstring, steps 1-4)."""

    def __init__(self, channel: Channel, plan: ReadPlan, store: Store, reads: list[RangeRead], checks: list,
                 threads: int | None) -> None:
        self.channel, self.plan, self.store, self.reads, self.checks = channel, plan, store, reads, checks
        self.threads = threads
        self.me = channel.rank
        self.bytes_read = self.bytes_received = 0
        # Where each piece goes on this rank: (read, offset in it) of every read of mine holding it.
        rows = plan.rows_of(self.me)
        read_of_row = {int(r): int(plan.row_read[r]) for r in rows}
        self.dests: dict[int, list[tuple[int, int]]] = {}
        self.pieces_of: list[list[int]] = [[] for _ in reads]
        for p, piece in enumerate(plan.pieces):
            for row in piece.rows:
                i = read_of_row.get(row)
                if i is not None:
                    self.dests.setdefault(p, []).append((i, piece.start - reads[i].offset))
                    self.pieces_of[i].append(p)
        # A read every piece of which this rank reads itself is read whole, verified by the store.
        self.whole = [bool(ps) and all(plan.pieces[p].reader == self.me for p in ps) for ps in self.pieces_of]
        for p, dests in self.dests.items():  # land each piece in a whole-read read if one holds it
            dests.sort(key=lambda d: not self.whole[d[0]])
        self.received_from: dict[int, int] = {}  # piece -> the rank it came from
        self.source_failed: dict[int, tuple] = {}  # piece -> (kind, message, transient or None) of its reader
        self.staged: dict[int, Op] = {}  # message -> the receive whose buffer holds it here, kept to forward
        self.pool = BufferPool(channel.chunk_bytes)
        self.ops = ops_of(plan.messages, self.me)
        self.forwards = {op.message.index for op in self.ops if op.send and op.hop > 0}

    # -- the round ---------------------------------------------------------------------

    def run(self) -> tuple[list, BaseException | None]:
        raised = self._read_own()
        run_ops(self.channel, self.ops, self)
        for p, dests in self.dests.items():  # a piece wanted in two reads of this rank: copied
            (i0, at0), *rest = dests
            for i, at in rest:
                if not self.whole[i]:
                    memory_at(self.reads[i].address + at, self.plan.pieces[p].nbytes)[:] = self._view(i0, at0, p)
        mine = [(p, f) for p, f in self.source_failed.items() if self.plan.pieces[p].reader == self.me]
        everyone = self.channel.gather(mine)
        for got in everyone:
            for p, f in got:
                self.source_failed.setdefault(p, f)
        return self._failures(), raised

    def _read_own(self) -> BaseException | None:
        """Step 1: the pieces planned for this rank that it needs, from storage into place."""
        batch: list[RangeRead] = []
        owners: list[tuple[int | None, int | None]] = []  # (read, piece) of each batch entry
        for i, read in enumerate(self.reads):
            if self.whole[i]:
                batch.append(read)
                owners.append((i, None))
        for p, dests in self.dests.items():
            piece = self.plan.pieces[p]
            i, at = dests[0]
            if piece.reader == self.me and not self.whole[i]:
                batch.append(RangeRead(self.reads[i].key, piece.start, piece.nbytes, self.reads[i].address + at))
                owners.append((None, p))
        if not batch:
            return None
        try:
            found = self.store.read_batch(batch, threads=self.threads)
        except StoreError as exc:  # every piece this rank was to read fails with it, here and where it goes
            for p, piece in enumerate(self.plan.pieces):
                if piece.reader == self.me:
                    self.source_failed[p] = ("store", str(exc), exc.transient)
            return exc
        self.bytes_read += sum(r.nbytes for r in batch)
        for f in found:
            i, p = owners[f.request]
            for q in (self.pieces_of[i] if i is not None else [p]):
                self.source_failed.setdefault(q, (f.kind, f"{f.path}: {f.message}", None))
        return None

    def _failures(self) -> list:
        """Steps 3 and 4: every read's verdict, in request order."""
        out = []
        for i, read in enumerate(self.reads):
            bad = next((p for p in self.pieces_of[i] if p in self.source_failed), None)
            if bad is not None:
                kind, message, transient = self.source_failed[bad]
                if kind == "store":
                    continue  # raised: see _raise_unanswered
                reader = self.plan.pieces[bad].reader
                note = "" if reader == self.me else f" (rank {self.channel.global_rank(reader)} read these bytes for this one)"
                out.append(_failure(i, read, self.store, kind, message + note))
                continue
            if self.whole[i]:
                continue  # verified by the store as it read
            came = sorted({self.channel.global_rank(self.received_from[p]) for p in self.pieces_of[i] if p in self.received_from})
            note = f" (bytes received from rank{'s' if len(came) > 1 else ''} {', '.join(map(str, came))} over the exchange)" if came else ""
            failure = verify_in_place(self.store, read, self.checks[i], i, note)
            if failure is not None:
                out.append(failure)
        self._raise_unanswered()
        return out

    def _raise_unanswered(self) -> None:
        for i, read in enumerate(self.reads):
            for p in self.pieces_of[i]:
                f = self.source_failed.get(p)
                if f is not None and f[0] == "store" and self.plan.pieces[p].reader != self.me:
                    raise StoreError(f"{self.store.where(read.key)}: rank {self.channel.global_rank(self.plan.pieces[p].reader)}, "
                                     f"which reads these bytes for this one, could not: {f[1]}", transient=f[2])

    # -- where messages come from and go to (the Endpoint) ---------------------------------

    def _view(self, i: int, at: int, p: int, seg_at: int = 0, nbytes: int | None = None) -> memoryview:
        n = self.plan.pieces[p].nbytes - seg_at if nbytes is None else nbytes
        return memory_at(self.reads[i].address + at + seg_at, n)

    def _tensor(self, view: memoryview) -> torch.Tensor:
        return torch.frombuffer(view, dtype=torch.uint8)

    def send_bytes(self, op: Op) -> torch.Tensor:
        m = op.message
        if op.hop > 0 and m.index in self.staged:
            return self.pool.held(self.staged[m.index], m.nbytes)
        if len(m.segments) == 1 and m.segments[0].piece in self.dests:
            seg = m.segments[0]
            i, at = self.dests[seg.piece][0]
            return self._tensor(self._view(i, at, seg.piece, seg.at, seg.nbytes))
        buf = self.pool.take(op, m.nbytes)
        view = memoryview(buf.numpy())
        pos = 0
        for seg in m.segments:
            part = view[pos:pos + seg.nbytes]
            if seg.piece in self.dests:
                i, at = self.dests[seg.piece][0]
                part[:] = self._view(i, at, seg.piece, seg.at, seg.nbytes)
            else:
                self._read_for_others(seg, part)
            pos += seg.nbytes
        return buf

    def _read_for_others(self, seg, part: memoryview) -> None:
        """Bytes of a piece this rank reads only to send on (its file is near, its reads elsewhere)."""
        piece = self.plan.pieces[seg.piece]
        if seg.piece in self.source_failed:
            part[:] = bytes(len(part))
            return
        key = self.plan.keys[piece.key]
        try:
            self.store.read_into(key, piece.start + seg.at, part)
            self.bytes_read += len(part)
        except Exception as exc:  # noqa: BLE001 - told to the ranks that need it (step 4); zeros go meanwhile
            transient = exc.transient if isinstance(exc, StoreError) else None
            kind = "store" if transient else "truncated" if isinstance(exc, ShortObjectError) else "io"
            self.source_failed[seg.piece] = (kind, f"{self.store.where(key)}: {exc}", transient)
            part[:] = bytes(len(part))

    def recv_bytes(self, op: Op) -> torch.Tensor:
        m = op.message
        if len(m.segments) == 1:  # straight into place (and forwarded from there)
            seg = m.segments[0]
            i, at = self.dests[seg.piece][0]
            return self._tensor(self._view(i, at, seg.piece, seg.at, seg.nbytes))
        return self.pool.take(op, m.nbytes)

    def received(self, op: Op, data: torch.Tensor) -> None:
        m = op.message
        self.bytes_received += m.nbytes
        direct = len(m.segments) == 1
        view = None if direct else memoryview(data.numpy())
        pos = 0
        for seg in m.segments:
            self.received_from.setdefault(seg.piece, op.peer)
            if not direct:
                i, at = self.dests[seg.piece][0]
                self._view(i, at, seg.piece, seg.at, seg.nbytes)[:] = view[pos:pos + seg.nbytes]
            pos += seg.nbytes
        if not direct and m.index in self.forwards:
            self.staged[m.index] = op  # its buffer goes back once forwarded
        else:
            self.pool.give(op)

    def sent(self, op: Op) -> None:
        self.pool.give(op)
        if op.hop > 0:
            held = self.staged.pop(op.message.index, None)
            if held is not None:
                self.pool.give(held)
