"""``Metadata.storage_data`` of our checkpoints as stored: plain data since format 5.

Format 5 stores the layout as plain Python data, so the ``.metadata`` pickle
names no class of ours: this package's modules can move and be renamed
without breaking a single checkpoint, and DCP's own ``pickle.load`` reads it
without importing dcp_datastates. :class:`CheckpointLayout` stays the object
the code works with: :func:`layout_to_plain` turns it into plain data when
``.metadata`` is encoded, and :func:`layout_of` turns the stored form back
into a validated layout when it is decoded. The plain form::

    {
        "format": "dcp_datastates",
        "version": 9,
        "save_id": "3f9c2a71b0de",
        "ranks": [(rank, data_file, index_file, files_save_id, stripe_starts, base), ...],
        "entries": [(fqn, chunk_offsets or None, slot, offset, length, object_ordinal), ...],
        "compression": None or (codec, block_bytes) or ("stream", block_bytes, descriptors),
        "digests": [(fqn, chunk_offsets or None, xxh3_128_hex), ...],
    }

``files_save_id`` is ``""`` when the rank's files carry the checkpoint's own
save id; ``stripe_starts`` (from version 7; versions 5 and 6 have 4-tuples)
is a tuple of the data offsets where the rank's further data files begin
(:class:`RankFiles`), ``()`` for one file; ``base`` (from version 8; 5-tuples
before) is ``""`` for the checkpoint's own ranks and a sibling checkpoint's
directory name for a base rank that entries refer to; an entry is what
:class:`CheckpointLayout` documents (its third field a slot in ``ranks`` from
version 8, a rank number before); ``digests`` (from version 8) lists the
content digests of large tensor chunks. Only ``str``, ``int``, ``None``,
tuples, lists and the one dict: exactly these keys (six before version 8).
From version 9 the pickle holds that dict as a ``defaultdict`` that answers
stock DCP's lookups (:func:`storage_data_to_pickle`); the record holds the
plain dict.

Versions 1 to 4 pickled the layout as our classes, under the module path
each had when it was written: ``dcp_datastates.format.CheckpointLayout`` and
``.RankFiles`` (version 1 also ``.ItemLocation``: its layout held a dict of
``MetadataIndex`` to ``ItemLocation`` instead of entries), and
``dcp_datastates.format.rank_index.CheckpointLayout`` and ``.RankFiles``
from the last writers of version 4. The unpicklers resolve those names
(:data:`LEGACY_CLASSES`) to the stand-ins below, which only take the
pickled state, strictly, and are then decoded into a :class:`CheckpointLayout`
by :func:`layout_of`: no module of ours has to stay at an old path.
"""

from __future__ import annotations

import collections
import functools

from dcp_datastates.errors import CorruptCheckpointError
from dcp_datastates.format.checkpoint_layout import BASES_SINCE, FORMAT_NAME, FORMAT_VERSION, LAYOUT_FIELDS, RANK_FILES_FIELDS, STRIPES_SINCE, CheckpointLayout, RankFiles, check_format_version, show, strict_fields

PLAIN_SINCE = 5  # the first format version whose layout is plain data
PLAIN_KEYS = ("format", "version", "save_id", "ranks", "entries", "compression", "digests")
_PLAIN_KINDS = {"save_id": str, "ranks": list, "entries": list, "compression": (tuple, type(None)), "digests": list}


def _corrupt(where: str, why: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"{where}: the storage layout is corrupt: {why}")


# -- format 5: plain data --------------------------------------------------------------


def layout_to_plain(layout: CheckpointLayout) -> dict:
    """``layout`` as format 5 and later store it (see the module docstring); shares its entries list.

    A layout read from a checkpoint of an older version is written as the
    current version: the versions differ only in how the layout was stored
    and in what surrounds it in ``.metadata`` (trailer, record), which is
    always written in its current form.
    """
    return {
        "format": layout.format,
        "version": FORMAT_VERSION,
        "save_id": layout.save_id,
        "ranks": [(r.rank, r.data_file, r.index_file, r.save_id, r.stripes, r.base) for r in layout.ranks],
        "entries": layout.entries,
        "compression": layout.compression,
        "digests": [(fqn, off, digest) for (fqn, off), digest in layout.digests.items()],
    }


def _layout_from_plain(data: dict, where: str) -> CheckpointLayout:
    """The layout stored as ``data`` (a dict with a ``"format"`` key); checked by kinds here,
    by contents in :meth:`CheckpointLayout.validate`."""
    version = data.get("version")
    check_format_version(data.get("format"), version, where)  # a newer version may have other keys
    if version < PLAIN_SINCE:
        raise _corrupt(where, f"it is plain data of version {version}; before {PLAIN_SINCE} it was pickled as a class")
    keys = PLAIN_KEYS if version >= BASES_SINCE else PLAIN_KEYS[:-1]
    unknown = [k for k in data if k not in keys]
    missing = [k for k in keys if k not in data]
    if unknown or missing:
        raise _corrupt(where, f"it has keys {show(unknown)} it may not have and lacks {show(missing)}")
    for key, kind in _PLAIN_KINDS.items():
        if key in keys and not isinstance(data[key], kind):
            raise _corrupt(where, f"its {key} is a {type(data[key]).__name__}")
    ranks = []
    if version >= BASES_SINCE:
        width, what = 6, "(rank, data file, index file, save id, stripe starts, base)"
    elif version >= STRIPES_SINCE:
        width, what = 5, "(rank, data file, index file, save id, stripe starts)"
    else:
        width, what = 4, "(rank, data file, index file, save id)"
    for r in data["ranks"]:
        if not (isinstance(r, tuple) and len(r) == width and all(isinstance(x, str) for x in (*r[1:4], *r[5:]))):
            raise _corrupt(where, f"rank entry {show(r)} is not {what}")
        ranks.append(RankFiles(*r))  # the rank's kind and range, its stripes and base are checked by validate
    digests = {}
    for d in data.get("digests", ()):
        if not (isinstance(d, tuple) and len(d) == 3 and isinstance(d[0], str) and isinstance(d[1], (tuple, type(None)))):
            raise _corrupt(where, f"digest entry {show(d)} is not (fqn, chunk offsets, digest)")
        if (d[0], d[1]) in digests:
            raise _corrupt(where, f"{d[0]!r} (at {show(d[1])}) has two content digests")
        digests[(d[0], d[1])] = d[2]  # the digest's form, and that it names a chunk, are checked by validate
    return CheckpointLayout(
        FORMAT_NAME, version, data["save_id"], ranks, data["entries"], data["compression"], digests
    )


# -- formats 1 to 4: our classes, pickled ---------------------------------------------------


class _Pickled:
    """A stand-in for one of our classes as formats 1-4 pickled it: it only takes the state
    a pickle's BUILD gives it, strictly (:func:`strict_fields`), for :func:`layout_of`."""

    __slots__ = ("state",)
    NAME = ""
    KINDS: dict = {}
    DEFAULTS: dict = {}

    def __init__(self, *_args, **_kwargs) -> None:
        # Pickles restore these with NEWOBJ and BUILD; a REDUCE calling the class is hostile.
        raise CorruptCheckpointError(f"the storage layout is corrupt: a {self.NAME} is called, not restored")

    def __setstate__(self, state) -> None:
        self.state = strict_fields(self.NAME, state, self.KINDS, self.DEFAULTS)


class PickledLayout(_Pickled):
    """``CheckpointLayout`` of formats 1-4 (version 1: ``locations``; 2-4: ``entries``)."""

    __slots__ = ()
    NAME = "CheckpointLayout"
    KINDS = {**{k: v for k, v in LAYOUT_FIELDS.items() if k != "digests"}, "locations": dict}  # digests: version 8
    DEFAULTS = {"entries": None, "locations": None, "compression": None}


class PickledRankFiles(_Pickled):
    __slots__ = ()
    NAME = "RankFiles"
    KINDS = {k: v for k, v in RANK_FILES_FIELDS.items() if k not in ("stripes", "base")}  # versions 7, 8
    DEFAULTS = {"save_id": ""}  # version 1 had no per-rank save id


class PickledItemLocation(_Pickled):
    """Version 1's ``ItemLocation`` (a frozen dataclass then), the values of its ``locations``."""

    __slots__ = ()
    NAME = "ItemLocation"
    KINDS = {"relative_path": str, "offset": int, "length": int, "object_ordinal": int}
    DEFAULTS = {"object_ordinal": -1}


# Every class path a format 1-4 .metadata names for our records, and its stand-in.
LEGACY_CLASSES = {
    ("dcp_datastates.format", "CheckpointLayout"): PickledLayout,
    ("dcp_datastates.format", "RankFiles"): PickledRankFiles,
    ("dcp_datastates.format", "ItemLocation"): PickledItemLocation,
    ("dcp_datastates.format.rank_index", "CheckpointLayout"): PickledLayout,
    ("dcp_datastates.format.rank_index", "RankFiles"): PickledRankFiles,
}


def _state_of(obj, kind: type, where: str) -> dict:
    state = getattr(obj, "state", None) if type(obj) is kind else None
    if state is None:
        raise _corrupt(where, f"{show(obj)} is not a {kind.NAME} restored from its fields")
    return state


def _layout_from_pickled(obj: PickledLayout, where: str) -> CheckpointLayout:
    s = _state_of(obj, PickledLayout, where)
    version = s["version"]
    check_format_version(s["format"], version, where)
    if version >= PLAIN_SINCE:
        raise _corrupt(where, f"a layout of version {version} pickled as a class; from {PLAIN_SINCE} on it is plain data")
    field, other = ("locations", "entries") if version == 1 else ("entries", "locations")
    if s[field] is None or s[other] is not None:
        raise _corrupt(where, f"a version {version} layout has {other} instead of {field}")
    if s["compression"] is not None and version < 4:
        raise _corrupt(where, f"a version {version} layout records compression, which came with version 4")
    ranks = []
    for r in s["ranks"]:
        rs = _state_of(r, PickledRankFiles, where)
        ranks.append(RankFiles(rs["rank"], rs["data_file"], rs["index_file"], rs["save_id"]))
    entries = _entries_of_locations(s["locations"], ranks, where) if version == 1 else s["entries"]
    return CheckpointLayout(FORMAT_NAME, version, s["save_id"], ranks, entries, s["compression"])


def _entries_of_locations(locations: dict, ranks: list[RankFiles], where: str) -> list[tuple]:
    """Version 1's ``{MetadataIndex: ItemLocation(data file, offset, length, ordinal)}`` as entries."""
    from torch.distributed.checkpoint.metadata import MetadataIndex  # only pickles of version 1 hold one

    rank_of = {r.data_file: r.rank for r in ranks}
    entries = []
    for index, loc in locations.items():
        fqn, off = getattr(index, "fqn", None), getattr(index, "offset", None)
        if type(index) is not MetadataIndex or not isinstance(fqn, str) or not isinstance(off, (tuple, type(None))):
            raise _corrupt(where, f"item key {show(index)} is not a MetadataIndex")
        ls = _state_of(loc, PickledItemLocation, where)
        rank = rank_of.get(ls["relative_path"])
        if rank is None:
            raise _corrupt(where, f"{fqn!r} is stored in {show(ls['relative_path'])}, which is no rank's data file")
        entries.append((fqn, None if off is None else tuple(off), rank, ls["offset"], ls["length"], ls["object_ordinal"]))
    return entries


# -- format 9: what stock DCP's FileSystemReader finds in our storage data ---------------------

# Stock DCP's FileSystemReader looks every item up in ``storage_data`` (``storage_data[index]``,
# a bare ``KeyError: MetadataIndex(...)`` in our plain dict) and opens the file the record names.
# From format 9 the pickle stores the plain layout in a ``defaultdict`` whose factory makes that
# record (DCP's own ``_StorageInfo``): a stock reader then fails opening this file, whose name
# says what the checkpoint is. No such file is ever written; nothing of ours is named in the
# pickle (``collections.defaultdict``, ``functools.partial`` and DCP's class only).
STOCK_READER_FILE = "dcp_datastates-checkpoint--load-it-with-storage_reader=dcp_datastates.DataStatesReader(path)"


def _storage_info_class():
    from dcp_datastates._dcp_compat import storage_info_class  # torch: only where a pickle is made or read

    return storage_info_class()


def storage_data_to_pickle(layout: CheckpointLayout) -> collections.defaultdict:
    """The plain form of ``layout`` (:func:`layout_to_plain`) as ``.metadata``'s pickle stores it
    from format 9: in a ``defaultdict`` that answers stock DCP's lookups (above)."""
    record = functools.partial(_storage_info_class(), STOCK_READER_FILE, 0, 0)
    return collections.defaultdict(record, layout_to_plain(layout))


class StockReaderRecord:
    """The stand-in both unpicklers use for ``functools.partial`` in a ``.metadata``: it takes
    exactly the factory :func:`storage_data_to_pickle` pickles (DCP's ``_StorageInfo`` of
    :data:`STOCK_READER_FILE`) and nothing else, so no partial of anything is ever built."""

    __slots__ = ("checked",)

    def __new__(cls, func=None, *args):
        if func is not _storage_info_class() or args:
            raise CorruptCheckpointError(f"the storage data is corrupt: it makes a partial of {show(func)}")
        return super().__new__(cls)

    def __setstate__(self, state) -> None:
        expected = (_storage_info_class(), (STOCK_READER_FILE, 0, 0))
        if not (isinstance(state, tuple) and len(state) == 4 and state[:2] == expected and not state[2] and state[3] is None):
            raise CorruptCheckpointError(f"the storage data is corrupt: its stock-reader record is {show(state)}")
        self.checked = True


def _plain_dict_of(factory=None) -> dict:
    """The stand-in of ``collections.defaultdict`` in a ``.metadata``: the plain dict our layout
    is, once its factory is exactly the one :func:`storage_data_to_pickle` pickles."""
    if type(factory) is not StockReaderRecord or not getattr(factory, "checked", False):
        raise CorruptCheckpointError(f"the storage data is corrupt: a defaultdict of {show(factory)}")
    return {}


# -- decoding either ------------------------------------------------------------------------


def layout_of(storage_data, where: str) -> CheckpointLayout | None:
    """The validated layout that ``storage_data`` of a decoded ``.metadata`` stores, or None when
    it is not ours (a stock DCP checkpoint's ``{MetadataIndex: _StorageInfo}``, for instance).

    Ours is the plain form (a dict with a ``"format"`` key) or a format 1-4
    :class:`PickledLayout`; anything wrong with it is a
    :class:`CorruptCheckpointError` (or :class:`UnsupportedFormatError` for
    another format or a newer version) naming ``where``.
    """
    if type(storage_data) is PickledLayout:
        layout = _layout_from_pickled(storage_data, where)
    elif isinstance(storage_data, dict) and "format" in storage_data:
        layout = _layout_from_plain(storage_data, where)
    else:
        return None
    layout.validate(where)
    return layout



# Every global a .metadata may name whose unpickling resolves to a stand-in of ours (in both
# unpicklers): the class paths of formats 1-4, and format 9's defaultdict and its factory.
STAND_INS = {
    **LEGACY_CLASSES,
    ("functools", "partial"): StockReaderRecord,
    ("collections", "defaultdict"): _plain_dict_of,
}
