"""The names of a checkpoint's files, and which files in a directory are strays.

A checkpoint is one directory::

    .metadata                      DCP Metadata (pickle + checksum trailer), written last, atomically
    rank00000-<sid>.data           raw bytes of rank 0's items at planned offsets
    rank00000-<sid>.index          rank 0's checksums and object table (binary)
    rank00000-<sid>.s1.data        rank 0's second stripe (format 7; only for ranks written as several files)
    ...                            one .data/.index pair per rank, and a .s<k>.data per further stripe

``<sid>`` is the save id, 12 hex digits, new for every save: files of a new
save never overwrite those of the committed one it replaces, so an
interrupted overwrite leaves the old checkpoint loadable.

A save that did not finish can leave more: rank files of an interrupted save
into the same directory (a killed overwrite) and a ``.metadata.<save id>.tmp``
whose rename never happened. Those are *strays*: written by a save, named by
no committed layout, harmless to the checkpoint and safe to delete. The
manager deletes them when it starts, ``verify`` lists them as notes, ``du``
counts them as reclaimable, and the reader tells an interrupted save from an
empty directory by them; all of them ask the functions here, so the rule is
written once.
"""

from __future__ import annotations

import re
from typing import Collection, Iterable

METADATA_FILE = ".metadata"
SAVE_ID_RE = re.compile(r"^[0-9a-f]{12}$")
# Groups: rank, save id, stripe (None for a rank's first data file, and for its index), kind.
DATA_FILE_RE = re.compile(r"^rank(\d{5,})-([0-9a-f]{12})(?:\.s([1-9]\d{0,2}))?\.(data|index)$")
MAX_STRIPES = 256  # stripe numbers have at most three digits


def data_file_name(rank: int, save_id: str) -> str:
    return f"rank{rank:05d}-{save_id}.data"


def stripe_file_name(data_file: str, stripe: int) -> str:
    """The file of stripe ``stripe`` of a rank whose first data file is ``data_file``
    (stripe 0 is ``data_file`` itself; format 7, see docs/format.md)."""
    if stripe == 0:
        return data_file
    if not 0 < stripe < MAX_STRIPES:
        raise ValueError(f"stripe {stripe} is out of range (0 to {MAX_STRIPES - 1})")
    return data_file[: -len(".data")] + f".s{stripe}.data"


def index_file_name(rank: int, save_id: str) -> str:
    return f"rank{rank:05d}-{save_id}.index"


def metadata_tmp_name(save_id: str) -> str:
    return f"{METADATA_FILE}.{save_id}.tmp"



# ``.metadata.<save id>.tmp``: cut around a save id that cannot occur in the name itself.
_TMP_PREFIX, _TMP_SUFFIX = metadata_tmp_name("\0").split("\0")
# Stock DCP's (FileSystemWriter) data files: ``__0_0.distcp``.
_STOCK_DCP_DATA_RE = re.compile(r"\.distcp$")


def is_metadata_temporary(name: str) -> bool:
    """Whether ``name`` is a ``.metadata`` temporary (written, then renamed to commit)."""
    return name.startswith(_TMP_PREFIX) and name.endswith(_TMP_SUFFIX)


def is_save_file(name: str, *, stock_dcp: bool = False) -> bool:
    """Whether a checkpoint save writes files named ``name``: ``.metadata``, its
    temporaries and our rank data and index files; with ``stock_dcp`` also DCP's
    ``.distcp`` data files. A directory holding none of them is no checkpoint."""
    return (
        name == METADATA_FILE
        or bool(DATA_FILE_RE.match(name))
        or is_metadata_temporary(name)
        or (stock_dcp and bool(_STOCK_DCP_DATA_RE.search(name)))
    )


def stray_files(names: Iterable[str], named: Collection[str], *, stock_dcp: bool = False) -> list[str]:
    """The names among ``names`` (a checkpoint directory's entries) that a save wrote
    but the committed checkpoint, which names ``named``, does not: sorted.

    ``.metadata`` itself is never a stray: it is what makes the directory a checkpoint.
    """
    return sorted(
        n for n in names
        if n != METADATA_FILE and n not in named and is_save_file(n, stock_dcp=stock_dcp)
    )


def layout_files(layout) -> list[str]:
    """The checkpoint's own rank files a ``CheckpointLayout`` names (data files, then index, rank
    by rank), without ``.metadata``; the files of base checkpoints it refers to (format 8) are
    theirs, not its own."""
    return [name for r in layout.ranks if not r.base for name in r.file_names()]


# -- a run's step directories (a CheckpointManager root, and its copies on a durable tier) --

STEP_DIR_RE = re.compile(r"^step_(\d+)$")


def step_dir_name(step: int) -> str:
    """``step_`` and the step, zero-padded to 8 digits (longer numbers get more)."""
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"a checkpoint step must be a non-negative int, got {step!r}")
    return f"step_{step:08d}"


def step_of(name: str) -> int | None:
    """The step a directory named ``name`` holds (``step_00000042`` -> 42), or None for another name."""
    m = STEP_DIR_RE.match(name)
    return int(m.group(1)) if m else None


# torchtitan's CheckpointManager names its folders ``step-<N>`` (integrations/torchtitan.py keeps
# its names): the tools show their steps; the manager never takes one for its own.
TORCHTITAN_STEP_DIR_RE = re.compile(r"^step-(\d+)$")


def listed_step_of(name: str) -> int | None:
    """The step a listed directory holds: ours (``step_00000042``) or torchtitan's (``step-42``)."""
    step = step_of(name)
    if step is None and (m := TORCHTITAN_STEP_DIR_RE.match(name)):
        step = int(m.group(1))
    return step


def steps_named(names: Iterable[str], where: str) -> dict[int, str]:
    """``{step: name}`` of the step directories among ``names`` (a directory's entries, or the
    first part of a store's keys). Two names for one step (``step_7`` and ``step_00000007``) are
    a ValueError naming ``where``: tools could not tell which one is meant."""
    out: dict[int, str] = {}
    for name in names:
        step = step_of(name)
        if step is None:
            continue
        if step in out and out[step] != name:
            raise ValueError(f"{where}: two directories for step {step}: {out[step]} and {name}")
        out[step] = name
    return out


# A base checkpoint (format 8) is a sibling directory named by one plain path component.
BASE_NAME_RE = re.compile(r"^(?!\.{1,2}$)[A-Za-z0-9._+=@-]{1,255}$")


def base_file_path(base: str, name: str) -> str:
    """The path of file ``name`` of the sibling checkpoint ``base``, relative to a checkpoint
    directory (``../<base>/<name>``): how references of an incremental checkpoint name it."""
    return f"../{base}/{name}" if base else name
