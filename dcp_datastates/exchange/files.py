"""Whole checkpoint files from one rank's store into another's: partner copies, a wiped node's
files coming back, a commit passed to the nodes that lack it.

:func:`copy_files` carries out a list of :class:`FileCopy` (the same list on every rank): each
file is read on its ``src`` rank in messages (:mod:`transfer`), each checked there against the
rank index's segments as it is read (a damaged local copy is never sent), and written on its
``dst`` rank into a temporary file of the destination store, each message checked again
against the segments on arrival, then fsynced and renamed into place once whole and right
(:meth:`storage.local.LocalStore.open_staged`). A copy whose ``src`` is its ``dst`` reads a
store of that rank (the durable tier) through the same checks. Index files go first (their
own checksum is checked, and they check the data that follows), data files next; a file
marked ``hold`` (``.metadata``) is checked and kept in memory, not published: the caller
commits it once every file is in place. Every rank learns every copy's outcome.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch

from dcp_datastates.exchange.channel import Channel
from dcp_datastates.exchange.plan import Op, ops_of, pack
from dcp_datastates.exchange.transfer import BufferPool, Endpoint, run_ops
from dcp_datastates.format.checkpoint_layout import RankFiles
from dcp_datastates.format.file_names import METADATA_FILE
from dcp_datastates.format.metadata_envelope import split_metadata
from dcp_datastates.native.engine import crc32c
from dcp_datastates.storage.segments import SegmentChecker, rank_index_of
from dcp_datastates.storage.store import Store

INDEX, DATA, OTHER = 0, 1, 2  # the order files go in


@dataclasses.dataclass(frozen=True)
class FileCopy:
    """Copy file ``name`` (``size`` bytes) of rank ``src``'s store to rank ``dst``'s.
    ``files``: the saved rank the file belongs to (its index checks its data files); ``hold``:
    kept in the destination's memory (the caller commits it), not published."""

    src: int
    dst: int
    name: str
    size: int  # -1: not known to the plan (the rank that reads it asks its store; src == dst only)
    files: RankFiles | None = None
    hold: bool = False
    tag: str = ""  # where the sending rank finds the file (the caller's ``source`` reads it)

    @property
    def kind(self) -> int:
        if self.files is None:
            return OTHER
        return INDEX if self.name == self.files.index_file else DATA


@dataclasses.dataclass
class Outcome:
    """What became of one copy: ``error`` (None: whole and verified on both sides) and, on the
    destination of a held file, its bytes."""

    error: str | None = None
    data: bytes | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


Where = Callable[[FileCopy], "tuple[Store, str]"]  # a copy -> the store and key of its file on this rank


def copy_files(channel: Channel, copies: Sequence[FileCopy], *, source: Where, dest: Where,
               pace: Callable[[], None] | None = None) -> list[Outcome]:
    """Carry out ``copies`` (module docstring); ``source``/``dest`` locate a file on this rank
    for the copies it sends or receives; ``pace()`` runs before each message read from disk.
    Returns every copy's outcome, the same on every rank. A failure of the group itself is an
    :class:`ExchangeError` (nothing half-received is published)."""
    copies = list(copies)
    state = _Copies(channel.rank, copies, source, dest, pace, BufferPool(channel.chunk_bytes))
    for phase in (INDEX, DATA):  # indexes first: they check the data files that follow
        chosen = [i for i, c in enumerate(copies) if (c.kind == DATA) == (phase == DATA)]
        chosen.sort(key=lambda i: (copies[i].kind, copies[i].hold, i))
        routes: dict[tuple[int, int], list[tuple[int, int]]] = {}
        for i in chosen:
            c = copies[i]
            if c.src != c.dst:
                routes.setdefault((c.src, c.dst), []).append((i, c.size))
        run_ops(channel, ops_of(pack(sorted(routes.items()), channel.chunk_bytes), channel.rank), state)
        for i in chosen:
            c = copies[i]
            if c.src == c.dst == channel.rank:
                state.copy_here(i, channel.chunk_bytes)
            elif c.size == 0:  # no message carries it
                state.empty(i)
        state.close_all()
    verdicts = channel.gather(state.verdicts())
    out = [Outcome() for _ in copies]
    ends = sorted((side != "src", i, error, crc, side) for got in verdicts for i, side, error, crc in got)
    for _dst, i, error, crc, side in ends:  # a source's failure explains its destination's
        if error is not None and out[i].error is None:
            who = copies[i].src if side == "src" else copies[i].dst
            out[i].error = f"{'reading' if side == 'src' else 'writing'} it on rank {channel.global_rank(who)}: {error}"
        state.crcs.setdefault(i, {})[side] = crc
    for i, sides in state.crcs.items():
        if out[i].error is None and sides.get("src") is not None and sides.get("dst") is not None \
                and sides["src"] != sides["dst"]:
            out[i].error = f"the copy has CRC-32C {sides['dst']:08x}, the file {sides['src']:08x}"
    for i, data in state.held.items():
        if out[i].ok:
            out[i].data = data
    return out


class _Copies(Endpoint):
    """This rank's ends of the copies: files read and checked, files written and checked."""

    def __init__(self, rank: int, copies: list[FileCopy], source: Where, dest: Where, pace, pool: BufferPool) -> None:
        self.rank, self.copies, self.source, self.dest, self.pace = rank, copies, source, dest, pace
        self.pool = pool
        self.failed: dict[tuple[int, str], str] = {}
        self.crcs: dict[int, dict[str, int | None]] = {}
        self.done_side: dict[tuple[int, str], int] = {}  # (copy, side) -> CRC of a finished end
        self.readers: dict[int, _Checked] = {}
        self.writers: dict[int, _Checked] = {}
        self.indexes: dict[tuple[str, str], object] = {}  # (index file, side) -> its RankIndex, once read
        self.held: dict[int, bytes] = {}

    # the checks both ends apply to a file's bytes, in order

    def _checked(self, i: int, side: str) -> _Checked | None:
        table = self.readers if side == "src" else self.writers
        if i not in table and (i, side) not in self.failed:
            c = self.copies[i]
            store, key = (self.source if side == "src" else self.dest)(c)
            try:
                table[i] = _Checked(c, store, key, self._index_for(c, store, key, side), side,
                                    staged=side == "dst" and not c.hold,
                                    data_sizes=self._sizes(c.files) if c.kind == INDEX else None)
            except Exception as exc:  # noqa: BLE001 - this copy fails; the others go on
                self.failed[(i, side)] = str(exc)
        return table.get(i)

    def _index_for(self, c: FileCopy, store: Store, key: str, side: str):
        """The index that checks a data file: received or read earlier in this job, else (the
        sending end) read from its own store."""
        if c.kind != DATA:
            return None
        ident = (c.files.index_file, side)
        mate = next((j for j, o in enumerate(self.copies) if o.name == c.files.index_file and o.files == c.files), None)
        if mate is not None and (mate, side) in self.failed:
            raise ValueError(f"its rank index {c.files.index_file} did not copy intact: {self.failed[(mate, side)]}")
        if ident not in self.indexes:
            index_key = f"{key.rsplit('/', 1)[0]}/{c.files.index_file}" if "/" in key else c.files.index_file
            with store.open_file(index_key) as f:
                self.indexes[ident] = rank_index_of(f, c.files, self._sizes(c.files), store.where(index_key))
        return self.indexes[ident]

    def _sizes(self, files: RankFiles) -> list[int] | None:
        """The sizes of the rank's data files, when this job copies them (None otherwise)."""
        by_name = {c.name: c.size for c in self.copies if c.files == files and c.size >= 0}
        sizes = [by_name.get(n) for n in files.data_files()]
        return None if None in sizes else sizes

    def _finish(self, i: int, side: str) -> None:
        table = self.readers if side == "src" else self.writers
        end = table.pop(i, None)
        if end is None:
            return
        try:
            crc, blob = end.finish()
        except Exception as exc:  # noqa: BLE001
            self.failed[(i, side)] = str(exc)
            return
        self.done_side[(i, side)] = crc
        c = self.copies[i]
        if c.kind == INDEX:
            self.indexes[(c.files.index_file, side)] = end.index
        if side == "dst" and c.hold:
            self.held[i] = blob

    def _feed(self, i: int, side: str, at: int, view: memoryview) -> None:
        end = self._checked(i, side)
        if end is None:
            return
        try:
            end.feed(at, view)
        except Exception as exc:  # noqa: BLE001 - the copy fails; its remaining bytes are dropped
            self.failed[(i, side)] = str(exc)
            end.abandon()
            (self.readers if side == "src" else self.writers).pop(i, None)
            return
        if at + len(view) == self.copies[i].size:
            self._finish(i, side)

    # the Endpoint

    def send_bytes(self, op: Op) -> torch.Tensor:
        if self.pace is not None:
            self.pace()
        buf = self.pool.take(op, op.message.nbytes)
        view = memoryview(buf.numpy())
        pos = 0
        for seg in op.message.segments:
            part = view[pos:pos + seg.nbytes]
            end = self._checked(seg.piece, "src")
            if end is None:
                part[:] = bytes(len(part))  # the copy failed here: zeros keep the pairing, the verdict says so
            else:
                try:
                    end.read(seg.at, part)
                except Exception as exc:  # noqa: BLE001
                    self.failed[(seg.piece, "src")] = str(exc)
                    self.readers.pop(seg.piece, None)
                    part[:] = bytes(len(part))
                else:
                    self._feed(seg.piece, "src", seg.at, part)
            pos += seg.nbytes
        return buf

    def recv_bytes(self, op: Op) -> torch.Tensor:
        return self.pool.take(op, op.message.nbytes)

    def received(self, op: Op, data: torch.Tensor) -> None:
        view = memoryview(data.numpy())
        pos = 0
        for seg in op.message.segments:
            self._feed(seg.piece, "dst", seg.at, view[pos:pos + seg.nbytes])
            pos += seg.nbytes
        self.pool.give(op)

    def sent(self, op: Op) -> None:
        self.pool.give(op)

    def copy_here(self, i: int, block: int) -> None:
        """A copy whose source is a store of this rank (the durable tier): the same checks."""
        c = self.copies[i]
        if c.size < 0:
            store, key = self.source(c)
            try:
                size = store.size(key)
                if size is None:
                    raise FileNotFoundError(f"{store.where(key)}: no such object")
            except Exception as exc:  # noqa: BLE001
                self.failed[(i, "src")] = str(exc)
                return
            c = self.copies[i] = dataclasses.replace(c, size=size)
        buf = bytearray(min(block, max(c.size, 1)))
        for at in range(0, c.size, block):
            part = memoryview(buf)[: min(block, c.size - at)]
            end = self._checked(i, "src")
            if end is None or (i, "dst") in self.failed:
                return
            try:
                end.read(at, part)
            except Exception as exc:  # noqa: BLE001
                self.failed[(i, "src")] = str(exc)
                return
            self._feed(i, "src", at, part)
            self._feed(i, "dst", at, part)
        if c.size == 0:
            self.empty(i)

    def empty(self, i: int) -> None:
        """A file of no bytes: this rank's ends open and finish at once."""
        c = self.copies[i]
        for side, rank in (("src", c.src), ("dst", c.dst)):
            if rank == self.rank and self._checked(i, side) is not None:
                self._finish(i, side)

    def close_all(self) -> None:
        """Ends still open after a phase (a file shorter than announced, a failed sender): abandoned."""
        for table, side in ((self.readers, "src"), (self.writers, "dst")):
            for i, end in list(table.items()):
                end.abandon()
                self.failed.setdefault((i, side), "the transfer ended before the whole file")
            table.clear()

    def verdicts(self) -> list:
        out = []
        for i, c in enumerate(self.copies):
            for side, rank in (("src", c.src), ("dst", c.dst)):
                if rank == self.rank:
                    out.append((i, side, self.failed.get((i, side)), self.done_side.get((i, side))))
        return out


class _Checked:
    """One end of a file copy: its bytes read from (``src``) or written to (``dst``) a store,
    checked in order: a data file against its index's segments, an index by its own checksum
    once whole, a ``.metadata`` by its trailer once whole; the whole file's CRC-32C."""

    def __init__(self, copy: FileCopy, store: Store, key: str, index, side: str, staged: bool,
                 data_sizes: list[int] | None) -> None:
        self.copy, self.store, self.key, self.side = copy, store, key, side
        self.data_sizes = data_sizes  # an index's data files (None: not copied with it)
        self.where = store.where(key)
        self.crc = 0
        self.size = 0
        self.index = None
        self.checker = None
        if index is not None:
            stripe = copy.files.data_files().index(copy.name)
            self.checker = SegmentChecker.of_stripe(index, stripe, self.where, "the copy is refused")
        # the small files checked once whole: an index, a .metadata, a file held in memory
        self.keep = bytearray() if copy.kind == INDEX or copy.hold or copy.name.rsplit("/", 1)[-1] == METADATA_FILE else None
        self.staged = store.open_staged(key) if staged else None

    def read(self, at: int, out: memoryview) -> None:
        self.store.read_into(self.key, at, out)

    def feed(self, at: int, view: memoryview) -> None:
        if at != self.size:
            raise ValueError(f"{self.where}: bytes at {at} came after {self.size}")
        if self.checker is not None:
            self.checker.feed(view, at)
        self.crc = crc32c(view, self.crc)
        self.size += len(view)
        if self.keep is not None:
            self.keep += view
        if self.staged is not None:
            self.staged.write(view)

    def finish(self) -> tuple[int, bytes | None]:
        """The file is whole: its last checks, then (a written file) published."""
        c = self.copy
        if self.size != c.size:
            raise ValueError(f"{self.where}: {self.size} bytes, {c.size} expected")
        if self.checker is not None:
            self.checker.finish(self.size)
        blob = bytes(self.keep) if self.keep is not None else None
        if c.kind == INDEX:
            self.index = rank_index_of(blob, c.files, self.data_sizes, self.where)  # its own checksum, its fit
        elif c.name.rsplit("/", 1)[-1] == METADATA_FILE:
            split_metadata(blob, self.where)  # its trailer's checksum
        if self.staged is not None:
            self.staged.publish()
            self.staged = None
        return self.crc, blob

    def abandon(self) -> None:
        if self.staged is not None:
            self.staged.abandon()
            self.staged = None
