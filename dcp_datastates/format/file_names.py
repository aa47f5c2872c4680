"""Which files in a checkpoint directory a save writes, and which of them are strays.

A checkpoint directory holds ``.metadata`` (the commit point) and the rank
files its layout names. A save that did not finish can leave more: rank
files of an interrupted save into the same directory (a killed overwrite)
and a ``.metadata.<save id>.tmp`` whose rename never happened. Those are
*strays*: written by a save, named by no committed layout, harmless to the
checkpoint and safe to delete. The manager deletes them when it starts,
``verify`` lists them as notes, ``du`` counts them as reclaimable, and the
reader tells an interrupted save from an empty directory by them; all of
them ask the two functions here, so the rule is written once.
"""

from __future__ import annotations

import re
from typing import Collection, Iterable

from dcp_datastates.format.rank_index import DATA_FILE_RE, METADATA_FILE, metadata_tmp_name

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
    """The rank files a ``CheckpointLayout`` names (data, then index, rank by rank), without ``.metadata``."""
    return [name for r in layout.ranks for name in (r.data_file, r.index_file)]
