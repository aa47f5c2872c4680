"""Copying a committed checkpoint to a durable tier, verified, with ``.metadata`` last.

The local tier holds committed checkpoints (``ROOT/step_<N>/``); the durable
tier (:class:`Store`) holds copies under the same names
(``step_<N>/...``). A copy is a checkpoint on the durable tier only once its
``.metadata`` is there, and that object is written last, after every rank's
files are confirmed:

1. Each rank drains its own files (:func:`drain_rank`): its data files, one
   per stripe, streamed from the local tier in blocks, each block checked
   against the rank index's CRC-32C segments before it is handed to the
   store (a corrupt local copy is never uploaded), then its index. Each
   object is read back from the store and its CRC-32C compared with the
   bytes that were read locally (``read_back=True``, the default).
2. Each rank then writes a confirmation, ``step_<N>/.drain/rank<R>.json``:
   its files, their sizes and CRC-32Cs.
3. The coordinator (rank 0, :func:`commit_durable`) waits for every rank's
   confirmation, checks it against the checkpoint's layout and the store's
   object sizes, and writes ``.metadata``: the durable copy is committed.
   The confirmations are removed afterwards (a crash may leave them; they
   are not part of the checkpoint and :meth:`Store.delete_checkpoint` removes
   them with the rest).

A crash at any point leaves the durable tier without that step's
``.metadata``: an incomplete copy, which listing and resume ignore and a
new drain of the step replaces (:func:`clear_incomplete_step`).
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable, Collection, Iterator
from concurrent.futures import ThreadPoolExecutor

from dcp_datastates.errors import CheckpointError
from dcp_datastates.format.checkpoint_layout import CheckpointLayout, RankFiles
from dcp_datastates.format.file_names import METADATA_FILE, step_of, steps_named
from dcp_datastates.format.metadata_envelope import (
    TRAILER_BYTES,
    CommitStamp,
    is_newer_save,
    is_same_save,
    read_commit_stamp,
    stamp_in_tail,
)
from dcp_datastates.native.engine import crc32c
from dcp_datastates.storage.segments import SegmentChecker, rank_index_of
from dcp_datastates.storage.local import LocalStore, StagedFile
from dcp_datastates.storage.store import ObjectExistsError, Store, StoreError, commit_checkpoint, is_committed, metadata_key, run_all

BLOCK_BYTES = 8 << 20  # bytes a fetch or verify reads from the store at a time
# Bytes the drain reads from the local tier, checks and hands to the store at a time: small, so
# that a save starting meanwhile waits for little of it (the drain pauses between blocks while a
# save runs; larger blocks slowed saves measurably, docs/benchmarks.md). The store gathers blocks
# into its own parts (S3: 64 MiB).
DRAIN_BLOCK_BYTES = 1 << 20
CONFIRM_DIR = ".drain"


class DrainError(CheckpointError):
    """A checkpoint could not be copied to the durable tier; the message names the step and the file."""


@dataclasses.dataclass
class DrainedFile:
    name: str
    size: int
    crc32c: int


@dataclasses.dataclass
class RankDrain:
    """What one rank copied: its confirmation's content, and how long it took."""

    rank: int
    files: list[DrainedFile]
    seconds: float = 0.0

    @property
    def bytes(self) -> int:
        return sum(f.size for f in self.files)

    def to_json(self) -> bytes:
        return json.dumps({"rank": self.rank, "files": [dataclasses.asdict(f) for f in self.files]}).encode()

    @classmethod
    def from_json(cls, blob: bytes, where: str) -> RankDrain:
        try:
            doc = json.loads(blob)
            files = [DrainedFile(str(f["name"]), int(f["size"]), int(f["crc32c"])) for f in doc["files"]]
            return cls(int(doc["rank"]), files)
        except (ValueError, KeyError, TypeError) as exc:
            raise DrainError(f"{where}: not a drain confirmation ({exc})") from None


def step_prefix(step_dir: str) -> str:
    return step_dir.rstrip("/") + "/"


def confirmation_key(step_dir: str, rank: int) -> str:
    return f"{step_dir}/{CONFIRM_DIR}/rank{rank:05d}.json"


def failure_key(step_dir: str, rank: int) -> str:
    """Where a rank whose drain failed says so, so that the coordinator stops waiting for it."""
    return f"{step_dir}/{CONFIRM_DIR}/rank{rank:05d}.failed"


# -- one rank's files ----------------------------------------------------------------


def _local_blocks(local: Store, key: str, size: int, checker: SegmentChecker | None, crc_box: list, block: int,
                  pace=None) -> Iterator[bytes | bytearray | memoryview]:
    """The ``size`` bytes of the local copy's ``key`` in blocks, each checked (``checker``) before
    it is yielded; the whole file's CRC-32C ends in ``crc_box[0]``. ``pace()`` runs before each
    block. A failure to read it is the local copy's, never taken for an outage of the store."""
    crc = 0
    for at in range(0, size, block):
        if pace is not None:
            pace()
        try:
            data = local.read_range(key, at, min(block, size - at))
        except StoreError as exc:
            raise DrainError(f"{local.where(key)}: reading the local copy at offset {at} to drain it: {exc}") from exc
        view = memoryview(data)
        if checker is not None:
            checker.feed(view, at)
        crc = crc32c(view, crc)
        yield data
    if checker is not None:
        checker.finish(size)
    crc_box[0] = crc


def _local_sizes(local: Store, files: RankFiles) -> list[int]:
    """The sizes of the rank's files in the local copy, index last (a missing one: DrainError)."""
    sizes = []
    for name in files.file_names():
        try:
            size = local.size(name)
        except StoreError as exc:
            raise DrainError(f"{local.url}: reading rank {files.rank}'s files: {exc}") from exc
        if size is None:
            raise DrainError(f"{local.url}: rank {files.rank}'s file {local.where(name)} is missing; the step is not drained")
        sizes.append(size)
    return sizes


def drain_rank(
    local: Store,
    step_dir: str,
    files: RankFiles,
    store: Store,
    *,
    read_back: bool = True,
    progress: Callable[[int], None] | None = None,
    block: int = DRAIN_BLOCK_BYTES,
    pace: Callable[[], None] | None = None,
) -> RankDrain:
    """Copy one rank's files of the committed checkpoint at the root of ``local`` (a step
    directory of the local tier, as a store) to ``step_dir/`` in ``store``, verified (see the
    module docstring); then write the rank's confirmation.

    Files of this rank an interrupted drain left in the store are replaced. ``pace()`` runs
    before every block read (the manager's waits while a snapshot copies the training state,
    so that the drain never slows the copies the training loop may wait for)."""
    t0 = time.perf_counter()
    names = files.data_files()
    local_sizes = _local_sizes(local, files)
    sizes = local_sizes[:len(names)]
    index_where = local.where(files.index_file)
    try:
        with local.open_file(files.index_file) as f:
            index = rank_index_of(f, files, sizes, index_where)
    except OSError as exc:
        raise DrainError(f"{local.url}: reading rank {files.rank}'s files: {exc}") from exc
    keys = [f"{step_dir}/{n}" for n in files.file_names()]
    if is_committed(store, step_dir):
        sizes_there = [store.size(k) for k in keys]
        if sizes_there == local_sizes:
            # A drain repeated after the step committed there with these very files (their names
            # carry the save's id): re-uploading would first delete objects a commit names.
            result = RankDrain(files.rank, [DrainedFile(n, size, 0) for n, size in zip(files.file_names(), local_sizes)])
            result.seconds = time.perf_counter() - t0
            return result
    store.delete(keys + [confirmation_key(step_dir, files.rank), failure_key(step_dir, files.rank)])
    drained = []
    for stripe, (name, size) in enumerate(zip(files.file_names(), local_sizes)):
        path = local.where(name)
        key = f"{step_dir}/{name}"
        checker = SegmentChecker.of_stripe(index, stripe, path) if stripe < len(names) else None
        crc_box = [0]
        store.put_stream(key, _local_blocks(local, name, size, checker, crc_box, block, pace), size, progress)
        if read_back:
            got = store.crc32c(key, 0, size, pace=pace)
            if got != crc_box[0]:
                raise DrainError(
                    f"{store.where(key)}: the copy reads back with CRC-32C {got:08x}, the local file {path} has {crc_box[0]:08x}"
                )
        drained.append(DrainedFile(name, size, crc_box[0]))
    result = RankDrain(files.rank, drained)
    store.put_bytes(confirmation_key(step_dir, files.rank), result.to_json())
    result.seconds = time.perf_counter() - t0
    return result


# -- the commit on the durable tier ------------------------------------------------------


def commit_durable(
    local: Store,
    step_dir: str,
    store: Store,
    *,
    timeout_s: float = 3600.0,
    poll_s: float = 0.2,
    stop: Callable[[], bool] | None = None,
    ranks: Collection[int] | None = None,
) -> CommitStamp | None:
    """Coordinator: once every rank confirmed its files, write ``step_dir/.metadata``; return
    the stamp of the save committed there (None: its ``.metadata`` has no trailer).

    Every rank of the checkpoint's layout (of ``ranks`` only, when given: a partner copy
    holds one node's files) must have confirmed exactly the files the layout names for it,
    and the store must hold each at the confirmed size."""
    from dcp_datastates.format.metadata_file import decode_metadata  # torch: not for the tools that list steps

    meta_path = local.where(METADATA_FILE)
    try:
        blob = local.read(METADATA_FILE)
    except OSError as exc:
        raise DrainError(f"{meta_path}: {exc}") from exc
    metadata, _ = decode_metadata(blob, meta_path, allow_pickle=False)  # the very bytes committed there
    layout = metadata.storage_data
    meta_key = f"{step_dir}/{METADATA_FILE}"
    stamp = stamp_in_tail(blob[-TRAILER_BYTES:], len(blob), meta_path)
    there_blob = store.read(meta_key) if store.size(meta_key) is not None else None
    committed_there = there_blob is not None
    if there_blob == blob:
        return stamp  # committed already, this very save (a drain repeated after its commit)
    if committed_there:
        there = stamp_in_tail(there_blob[-TRAILER_BYTES:], len(there_blob), store.where(meta_key))
        if is_newer_save(there, stamp):
            raise DrainError(
                f"{store.where(step_dir)} holds a newer save of this step (commit sequence {there.sequence}, "
                f"{local.url}'s is {stamp.sequence}): the run went on from the tier elsewhere; not replaced"
            )
    _check_bases_durable(layout, step_dir, store)
    expected = {r.rank: r.file_names() for r in layout.own_ranks if ranks is None or r.rank in ranks}
    deadline = time.monotonic() + timeout_s
    confirmed: dict[int, RankDrain] = {}
    while True:
        for rank in sorted(set(expected) - set(confirmed)):
            key = confirmation_key(step_dir, rank)
            if store.size(key) is not None:
                confirmed[rank] = RankDrain.from_json(store.read(key), store.where(key))
            elif store.size(failure_key(step_dir, rank)) is not None:
                why = store.read(failure_key(step_dir, rank)).decode(errors="replace")
                raise DrainError(f"{store.where(step_dir)}: rank {rank}'s drain failed ({why}); the copy stays uncommitted")
        if len(confirmed) == len(expected):
            break
        if time.monotonic() > deadline or (stop is not None and stop()):
            missing = sorted(set(expected) - set(confirmed))
            raise DrainError(
                f"{store.where(step_dir)}: ranks {missing} did not confirm their files within {timeout_s:.0f} s; "
                "the durable copy stays uncommitted"
            )
        time.sleep(poll_s)
    for rank, drain in confirmed.items():
        names = [f.name for f in drain.files]
        if names != expected[rank]:
            raise DrainError(f"{store.where(step_dir)}: rank {rank} confirmed {names}, the checkpoint names {expected[rank]}")
        for f in drain.files:
            size = store.size(f"{step_dir}/{f.name}")
            if size != f.size:
                raise DrainError(f"{store.where(step_dir + '/' + f.name)}: {size} bytes in the store, {f.size} confirmed")
    # An earlier save of this step (overwritten locally) committed there is replaced in one step
    # (a reader sees the old checkpoint or the new, whole); its files the new one does not name
    # go below, once it is committed.
    try:
        commit_checkpoint(store, step_dir, blob, replace=committed_there)
    except ObjectExistsError as exc:
        raise DrainError(f"{store.where(step_dir)}: another save of this step committed there meanwhile; not replaced") from exc
    named = {METADATA_FILE, *(n for names in expected.values() for n in names)}
    prefix = step_prefix(step_dir)
    try:
        store.delete([k for k in store.list(prefix) if k[len(prefix):] not in named])  # confirmations, old files
    except StoreError:
        pass  # committed; leftovers are removed with the step
    return stamp


def await_commit(local: Store, step_dir: str, store: Store, *, timeout_s: float = 3600.0, poll_s: float = 0.2,
                 stop: Callable[[], bool] | None = None) -> CommitStamp | None:
    """A rank that does not commit (a leader of another node): wait until the coordinator
    committed this very save of the step on the store (its commit stamp there equals the
    local ``.metadata``'s); return that stamp. A newer save of the step there, or the wait
    running out, is a :class:`DrainError`."""
    from dcp_datastates.format.metadata_file import read_commit_stamp

    if not is_committed(local):
        raise DrainError(f"{local.url} has no {METADATA_FILE} (this node's copy of the commit is missing): "
                         "which save to wait for is unknown")
    with local.open_file(METADATA_FILE) as f:
        mine = read_commit_stamp(f)
    deadline = time.monotonic() + timeout_s
    while True:
        there = durable_commit_stamp(store, step_dir)
        if is_same_save(there, mine):
            return there
        if is_newer_save(there, mine):
            raise DrainError(f"{store.where(step_dir)} holds a newer save of this step than {local.url}")
        if time.monotonic() > deadline or (stop is not None and stop()):
            raise DrainError(f"{store.where(step_dir)}: the copy was not committed within {timeout_s:.0f} s")
        time.sleep(poll_s)


# -- the durable tier's steps ------------------------------------------------------------


def _check_bases_durable(layout, step_dir: str, store: Store) -> None:
    """An incremental checkpoint commits on the durable tier only after its bases did: each one's
    ``.metadata``, and every rank file it refers to there, the same files (names carry the save
    id). Drains run in commit order, so a base is normally durable first; one that is not (its
    drain failed, or its durable copy is of another save) fails this one too, to be retried."""
    for base in layout.bases:
        missing = [] if is_committed(store, base) else [METADATA_FILE]
        for files in layout.ranks:
            if files.base == base:
                missing += [n for n in files.file_names() if store.size(f"{base}/{n}") is None]
        if missing:
            raise DrainError(
                f"{store.where(step_dir)} refers to {store.where(base)}, which is not durable (yet) with the "
                f"files it refers to (missing: {', '.join(missing[:3])}); the copy stays uncommitted and is retried"
            )


def step_bases(store: Store, step_dir: str) -> set[str] | None:
    """The base directories a committed durable copy refers to (None: not committed, unreadable,
    or not ours): its ``.metadata`` decoded, nothing else read."""
    from dcp_datastates.format.metadata_file import read_metadata_file

    try:
        with store.open_file(f"{step_dir}/{METADATA_FILE}") as f:
            metadata, _ = read_metadata_file(f)
    except (CheckpointError, OSError):
        return None
    layout = metadata.storage_data
    return set(layout.bases) if isinstance(layout, CheckpointLayout) else None


def keys_by_step(store: Store) -> dict[int, tuple[str, list[str]]]:
    """``{step: (directory, names under it)}`` of every step under the store's root (one listing;
    the step names' rule is a local root's, ``file_names.steps_named``)."""
    under: dict[str, list[str]] = {}
    for key in store.list():
        head, _, rest = key.partition("/")
        if rest and step_of(head) is not None:
            under.setdefault(head, []).append(rest)
    return {step: (name, under[name]) for step, name in steps_named(under, store.url).items()}


def durable_steps(store: Store) -> dict[int, tuple[str, bool]]:
    """``{step: (directory, committed)}`` of every step under the store's root."""
    return {step: (name, METADATA_FILE in rests) for step, (name, rests) in keys_by_step(store).items()}


def durable_commit_stamp(store: Store, step_dir: str) -> CommitStamp | None:
    """Which save a durable copy holds: the :class:`CommitStamp` of its ``.metadata`` (one
    ranged read of its tail; unverified, as a local root's ordering reads it); None: not
    committed, or no trailer to tell."""
    try:
        f = store.open_file(f"{step_dir}/{METADATA_FILE}")
    except FileNotFoundError:
        return None
    return read_commit_stamp(f)


def clear_incomplete_step(store: Store, step_dir: str) -> bool:
    """Remove what an interrupted drain left of an uncommitted step; False if it is committed."""
    if is_committed(store, step_dir):
        return False
    store.delete(store.list(step_prefix(step_dir)))
    return True


FETCH_CONCURRENCY = 8  # ranged reads in flight while fetching a file (an object store serves each slowly)


def fetch_step(store: Store, step_dir: str, into: LocalStore, *, block: int = BLOCK_BYTES,
               concurrency: int = FETCH_CONCURRENCY) -> int:
    """Copy a committed step from the durable tier to the root of ``into`` (a step directory of
    the local tier, as a store: created; it must not hold a ``.metadata``), ``.metadata`` last,
    each file staged, fsynced and renamed into place; return the bytes copied. Each file is
    read in ``block``-byte ranges, ``concurrency`` of them in flight, each written at its
    offset. The load that follows verifies every byte it reads against the checksums."""
    meta_key = metadata_key(step_dir)
    if not is_committed(store, step_dir):
        raise DrainError(f"{store.where(step_dir)}: not a committed checkpoint on the durable tier (no {METADATA_FILE})")
    if is_committed(into):
        raise DrainError(f"{into.url} holds a committed checkpoint already; it is not replaced by a fetch")
    keys = [k for k in store.list(step_prefix(step_dir)) if k != meta_key and f"/{CONFIRM_DIR}/" not in k]
    into.make_prefix("")
    total = 0
    with ThreadPoolExecutor(max(1, concurrency), thread_name_prefix="dcp_datastates-fetch") as pool:
        for key in [*keys, meta_key]:
            name = key[len(step_prefix(step_dir)):]
            if "/" in name:
                raise DrainError(f"{store.where(key)}: a checkpoint holds no subdirectories")
            size = store.size(key)
            if size is None:
                raise DrainError(f"{store.where(key)}: vanished during the fetch")
            staged = into.open_staged(name)
            try:
                _fetch_ranges(store, key, size, staged, block, pool)
                # a file an interrupted fetch of this step left is these very bytes (its name
                # carries the save's id); .metadata, the commit, never replaces one
                staged.publish(replace=name != METADATA_FILE)
            finally:
                staged.abandon()  # nothing, once published
            total += size
    return total


def _fetch_ranges(store: Store, key: str, size: int, staged: StagedFile, block: int, pool: ThreadPoolExecutor) -> None:
    """Read ``key``'s ``size`` bytes in ``block``-byte ranges on ``pool`` and write each at its offset
    of ``staged``; the first failure cancels the ranges not begun and is raised."""

    def one(at: int) -> None:
        staged.write_at(at, store.read_range(key, at, min(block, size - at)))

    run_all(pool, one, range(0, size, block))
