"""The on-disk layout of a run's checkpoint root (docs/manager.md, "The rules").

``ROOT/step_<N>/`` holds the checkpoint of step N (committed once it holds
``.metadata``; N zero-padded to 8 digits); ``ROOT/latest`` is the JSON pointer
to the newest checkpoint known committed and durable, with its *commit
sequence* and the run's rollbacks, only ever replaced by renaming a fsynced
temporary over it. Commit order is that sequence, which each checkpoint also
records in its ``.metadata`` trailer, never a clock; a durable tier, which
holds copies of steps the root has replaced or deleted, is judged by the
pointer mirrored there (:func:`given_up`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re

from dcp_datastates.storage.local import is_committed_directory
from dcp_datastates.storage.fsync_files import fsync_dir, rename_into_place, remove_if_present, write_new_file_durably
from dcp_datastates.format.file_names import METADATA_FILE, step_dir_name, step_of, steps_named  # noqa: F401 - the run's names
from dcp_datastates.format.metadata_envelope import read_commit_sequence

LATEST_FILE = "latest"
LATEST_TMP_RE = re.compile(r"^latest\.[0-9a-f]+\.tmp$")
POINTER_LIMIT = 1 << 20  # a pointer file is a few dozen bytes (a few more per rollback); anything bigger is not one


def step_dirs(root: str) -> dict[int, str]:
    """``{step: directory name}`` of every step directory under ``root`` (committed or not).

    Two names for one step (``step_7`` and ``step_00000007``) are an error,
    because tools could not tell which one is meant.
    """
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return {}
    return steps_named((n for n in names if step_of(n) is not None and os.path.isdir(os.path.join(root, n))), root)


def is_link(root: str, name: str) -> bool:
    """Whether ``root/name`` is a symbolic link (a step directory linked from elsewhere:
    readable like any other, but never cleaned up or deleted through the link)."""
    return os.path.islink(os.path.join(root, name))


def is_committed(path: str) -> bool:
    """Whether the checkpoint directory ``path`` has been committed: the store's rule
    (:func:`storage.local.is_committed_directory`)."""
    return is_committed_directory(path)


@dataclasses.dataclass(frozen=True)
class Pointer:
    """What ``latest`` says: the step, the commit sequence of its checkpoint (None in
    pointers written before sequences existed), and the run's rollbacks: ``(step, sequence)``,
    the step a resume went back to and the sequence of the first save after it."""

    step: int
    sequence: int | None
    rollbacks: tuple[tuple[int, int], ...] = ()

    def encode(self) -> bytes:
        """The pointer's JSON (what ``latest`` holds, on every tier)."""
        fields: dict = {"step": self.step, "dir": step_dir_name(self.step)}
        if self.sequence is not None:
            fields["sequence"] = self.sequence
        if self.rollbacks:
            fields["rollbacks"] = [list(r) for r in self.rollbacks]
        return (json.dumps(fields) + "\n").encode()

    @classmethod
    def decode(cls, blob: bytes, where: str) -> Pointer:
        """Parse what :meth:`encode` writes; anything else is a ValueError naming ``where``."""
        try:
            record = json.loads(blob.decode("utf-8")) if len(blob) <= POINTER_LIMIT else None
            step = record["step"]
            sequence = record.get("sequence")
            rollbacks = record.get("rollbacks", [])
            if not _is_count(step) or record["dir"] != step_dir_name(step):
                raise ValueError
            if sequence is not None and not _is_count(sequence):
                raise ValueError
            if not isinstance(rollbacks, list) or not all(
                isinstance(r, list) and len(r) == 2 and all(_is_count(x) for x in r) for r in rollbacks
            ):
                raise ValueError
        except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError):
            raise ValueError(
                f"{where} is not a checkpoint pointer (expected {{\"step\": N, \"dir\": \"step_...\", \"sequence\": S}})"
            ) from None
        return cls(step, sequence, tuple((r[0], r[1]) for r in rollbacks))


def read_pointer(root: str) -> Pointer | None:
    """The ``latest`` pointer of ``root``, or None when there is none.

    A pointer that is not what :func:`write_latest` writes raises ValueError
    naming the file (it is never silently ignored).
    """
    path = os.path.join(root, LATEST_FILE)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        blob = os.read(fd, POINTER_LIMIT + 1)
    finally:
        os.close(fd)
    return Pointer.decode(blob, path)


def read_pointer_if_valid(root: str) -> Pointer | None:
    """:func:`read_pointer`, or None for a pointer that is not one (the owner's start warns
    about it and rewrites it; otherwise the next commit does)."""
    try:
        return read_pointer(root)
    except ValueError:
        return None


def read_latest(root: str) -> int | None:
    """The step the ``latest`` pointer names, or None when there is no pointer (see :func:`read_pointer`)."""
    pointer = read_pointer(root)
    return pointer.step if pointer is not None else None


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def commit_sequence(root: str, name: str) -> int | None:
    """The commit sequence of the checkpoint in ``root/name`` (None: none recorded, or not committed)."""
    return read_commit_sequence(os.path.join(root, name, METADATA_FILE))


def newest_sequence(root: str) -> int:
    """The largest commit sequence in ``root`` (its pointer's and every checkpoint's), 0 if none.

    A manager numbers its next commit one above it, so commit order never
    depends on clocks.
    """
    newest = 0
    pointer = read_pointer_if_valid(root)
    if pointer is not None and pointer.sequence is not None:
        newest = pointer.sequence
    for name in step_dirs(root).values():
        newest = max(newest, commit_sequence(root, name) or 0)
    return newest


@dataclasses.dataclass
class ResumeOrder:
    """Which committed checkpoints a resume tries, in order, and which it must not.

    ``candidates``: checkpoints committed after the pointer last moved (a crash
    fell between their commit and the pointer update; newest commit first),
    then the step the pointer names, then the steps below it, newest first.
    ``abandoned``: steps above the pointer's that were committed before it
    moved: a run resumed from an older step and went on from there (a
    rollback, or a newer checkpoint skipped as corrupt), so they belong to a
    trajectory that was given up; and steps below it that a rollback the
    pointer records went back past (committed before that rollback's first
    save). They are not resumed from, a new save may replace them, and
    retention leaves them alone.
    """

    candidates: list[int]
    abandoned: list[int]
    pointer: int | None
    pointer_error: str | None = None
    sequences: dict[int, int] = dataclasses.field(default_factory=dict)  # step -> commit sequence (0: none)
    rollbacks: tuple[tuple[int, int], ...] = ()  # the pointer's record of the run's rollbacks


def resume_order(root: str) -> ResumeOrder:
    """Order the committed checkpoints of ``root`` for a resume (see :class:`ResumeOrder`).

    Commits are ordered by the commit sequence each checkpoint records in
    its ``.metadata`` trailer before the rename that commits it, and that
    ``latest`` records with the step: a checkpoint whose sequence is above
    the pointer's was committed after the pointer last moved. Clocks are
    not used: ``st_ctime`` ticks too coarsely (a commit and the pointer
    update a millisecond later can share one value).

    Roots written before sequences existed (a pointer without one) fall
    back, for checkpoints without a sequence, to comparing the ``st_ctime``
    of ``.metadata`` and ``latest``; a checkpoint with a sequence under such
    a pointer was committed after it (its writer wrote sequenced pointers).
    """
    dirs = step_dirs(root)
    times: dict[int, int] = {}  # step -> when its .metadata appeared; a directory deleted meanwhile drops out
    sequences: dict[int, int] = {}  # step -> its commit sequence (0: none recorded)
    for step, name in dirs.items():
        try:
            times[step] = os.stat(os.path.join(root, name, METADATA_FILE)).st_ctime_ns
        except (FileNotFoundError, NotADirectoryError):
            continue
        sequences[step] = commit_sequence(root, name) or 0
    committed = sorted(times)
    try:
        pointer_record = read_pointer(root)
        error = None
        pointer = pointer_record.step if pointer_record is not None else None
        moved = os.stat(os.path.join(root, LATEST_FILE)).st_ctime_ns if pointer is not None else 0
    except ValueError as exc:
        pointer_record, pointer, error = None, None, str(exc)
    except FileNotFoundError:  # replaced between the read and the stat: treat as no pointer
        pointer_record, pointer, error = None, None, None
    rollbacks = pointer_record.rollbacks if pointer_record is not None else ()
    if pointer is None or pointer not in committed:
        # No usable pointer: newest commit first where sequences tell, else the highest step.
        order = sorted(committed, key=lambda s: (sequences[s], s), reverse=True)
        return ResumeOrder(order, [], pointer, error, sequences, rollbacks)

    if pointer_record.sequence is not None:
        pointed = pointer_record.sequence

        def after_pointer(s: int) -> bool:
            return sequences[s] > pointed

        newest_first = lambda s: sequences[s]  # noqa: E731
    else:  # a pointer from before sequences

        def after_pointer(s: int) -> bool:
            return sequences[s] > 0 or times[s] > moved

        newest_first = lambda s: (sequences[s], times[s])  # noqa: E731

    newer = sorted((s for s in committed if s != pointer and after_pointer(s)), key=newest_first, reverse=True)
    # Above the pointer, committed before it moved; below it, older than a rollback past them.
    given = [s for s in committed if s not in newer and (s > pointer or _rolled_back_past(s, sequences[s], rollbacks))]
    below = [s for s in committed[::-1] if s < pointer and s not in newer and s not in given]
    return ResumeOrder(newer + [pointer] + below, given, pointer, error, sequences, rollbacks)


def _rolled_back_past(step: int, sequence: int, rollbacks) -> bool:
    """Whether a rollback on record went back before ``step`` after its commit ``sequence``."""
    return bool(sequence) and any(step > r and sequence < q for r, q in rollbacks)


def newest_pointer(*pointers: Pointer | None, rollbacks=()) -> Pointer | None:
    """Of the run's pointers on several tiers (None where a tier has none), the one naming the
    newest commit, with every rollback any of them (or ``rollbacks``) records: the run's one view
    of where it stands and which trajectories it gave up."""
    found = [p for p in pointers if p is not None]
    if not found:
        return None
    newest = max(found, key=lambda p: p.sequence or 0)
    merged = set(rollbacks).union(*(p.rollbacks for p in found))
    return dataclasses.replace(newest, rollbacks=tuple(sorted(merged)))


def given_up(sequences: dict[int, int | None], pointer: Pointer | None) -> list[int]:
    """The steps of ``sequences`` (``{step: commit sequence}`` of the copies on a tier without a
    pointer of its own, such as a durable tier) whose copies belong to a trajectory the run gave
    up, told by the run's pointer mirrored there (None: not mirrored yet, sequences alone):

    * a copy of a step after the pointer's, committed before it; or another, older save of the
      pointer's step (a rollback, then saves up to the pointer);
    * a copy of a step after a recorded rollback's step, committed before that rollback's first
      save (the rollback is visible before any save after it reaches the tier);
    * :func:`abandoned_among`'s rule (a commit of a smaller step with a larger sequence).

    A copy with no recorded sequence is never judged given up."""
    out = set(abandoned_among(sequences, sequences))
    if pointer is not None:
        marks = list(pointer.rollbacks)
        if pointer.sequence is not None:
            marks.append((pointer.step, pointer.sequence))
        for s, seq in sequences.items():
            if not seq:
                continue
            if _rolled_back_past(s, seq, marks):
                out.add(s)
            elif pointer.sequence is not None and s == pointer.step and seq < pointer.sequence:
                out.add(s)
    return sorted(out)


def abandoned_among(sequences: dict[int, int | None], steps) -> list[int]:
    """Those of ``steps`` a run gave up, told by commit sequences alone (``{step: sequence}`` of
    every commit known, on any tier): a step is abandoned when a commit of a smaller step
    carries a larger sequence, i.e. the run resumed from an older step and saved after it
    (the rule :func:`resume_order` applies through the pointer, for a tier without one).
    A step without a recorded sequence is never judged abandoned."""
    out = []
    for s in steps:
        seq = sequences.get(s)
        if seq and any(c < s and (q or 0) > seq for c, q in sequences.items()):
            out.append(s)
    return sorted(out)


def point_latest_at(root: str, step: int, sequence: int | None = None, rollbacks=()) -> Pointer:
    """Move ``latest`` to the committed checkpoint of ``step`` once nothing can take it back:
    fsync its directory and ``root`` (the step directory's own entry), then :func:`write_latest`.
    A pointer written first could name a checkpoint that a power loss removes."""
    durable_dir(os.path.join(root, step_dir_name(step)))
    return write_latest(root, step, sequence, rollbacks)


def write_latest(root: str, step: int, sequence: int | None = None, rollbacks=()) -> Pointer:
    """Point ``latest`` at ``step``, whose checkpoint has commit ``sequence`` (read from its
    ``.metadata`` when not given), recording ``rollbacks``: write a temporary, fsync it, rename
    it over, fsync ``root``. Returns the pointer written."""
    if sequence is None:
        sequence = commit_sequence(root, step_dir_name(step))
    pointer = Pointer(step, sequence, tuple(rollbacks))
    tmp = os.path.join(root, f"{LATEST_FILE}.{os.getpid():x}.tmp")
    remove_if_present([tmp])
    write_new_file_durably(tmp, pointer.encode())
    try:
        rename_into_place(tmp, os.path.join(root, LATEST_FILE), root)
    except BaseException:
        remove_if_present([tmp])
        raise
    fsync_dir(root)
    return pointer


def durable_dir(path: str) -> None:
    """fsync a checkpoint directory and its parent, so its commit survives a power loss."""
    fsync_dir(path)
    fsync_dir(os.path.dirname(os.path.abspath(path)))
