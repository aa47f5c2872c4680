"""Where every saved item lives: ``CheckpointLayout``, the record in ``Metadata.storage_data``.

The layout holds the format version, the checkpoint's save id, each rank's
files and, for every saved item (a tensor chunk or a pickled object), its
location: raw tensor bytes (row-major, in the dtype recorded in the
metadata) at an offset fixed when the save was planned, or for objects and
compressed chunks an ordinal into the rank index's object table (their
offsets are known only once they are serialized). In memory it is always a
validated :class:`CheckpointLayout`; on disk it is plain data since format 5
(``storage_data.py``). Everything read from a checkpoint is checked here
before anything trusts it: field kinds, file names that cannot leave the
directory, locations in range.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:  # the layout itself needs no torch: the tools read it without importing torch
    from torch.distributed.checkpoint.metadata import MetadataIndex

from dcp_datastates.errors import CorruptCheckpointError, UnsupportedFormatError
from dcp_datastates.format.file_names import BASE_NAME_RE, DATA_FILE_RE, MAX_STRIPES, SAVE_ID_RE, base_file_path, stripe_file_name

FORMAT_NAME = "dcp_datastates"
# 2: RankFiles may carry their own save id (files named by an asynchronous snapshot).
# 3: .metadata ends with a checksum trailer (see metadata_file.py).
# 4: the trailer carries the commit sequence (CheckpointManager's order of commits).
# 5: storage_data is plain data, no class of ours (storage_data.py); the index is unchanged.
# 6: .metadata carries a plain JSON record of the Metadata after the pickle, which our reader
#    decodes instead of unpickling (metadata_record.py); its trailer counts the record.
# 7: a rank's data may be striped over several files (RankFiles.stripes), written in parallel.
# 8: incremental checkpoints: ``ranks`` may list ranks of base checkpoints (RankFiles.base, sibling
#    directories) whose bytes items refer to; entries name a rank by its slot in ``ranks``; the
#    layout records content digests of large chunks (``digests``).
# 9: frames may be DCP stream transforms (``compression == ("stream", block_bytes, descriptors)``),
#    objects included; ``.metadata``'s pickle stores the plain layout in a ``defaultdict`` that
#    makes stock DCP's FileSystemReader fail naming this format (storage_data.py).
FORMAT_VERSION = 9
STRIPES_SINCE = 7  # the first version whose ranks record stripes
BASES_SINCE = 8  # the first version whose layouts may refer to base checkpoints
STREAM_SINCE = 9  # the first version whose frames may be DCP stream transforms


def show(value, limit: int = 100) -> str:
    """``repr`` for error messages about untrusted values (a damaged object's repr may itself fail)."""
    try:
        text = repr(value)
    except Exception:  # noqa: BLE001
        return f"<a damaged {type(value).__name__}>"
    return text if len(text) <= limit else text[:limit] + "..."


def check_format_version(format_name, version, where: str) -> None:
    """Ours (``format``), and a version this code reads: else :class:`UnsupportedFormatError`."""
    if format_name != FORMAT_NAME:
        raise UnsupportedFormatError(f"{where}: storage format {show(format_name)} is not {FORMAT_NAME!r}")
    if not isinstance(version, int) or isinstance(version, bool) or not 1 <= version <= FORMAT_VERSION:
        raise UnsupportedFormatError(
            f"{where}: written with format version {show(version)}; this dcp_datastates "
            f"reads versions 1 to {FORMAT_VERSION}. Upgrade dcp_datastates to load it."
        )


def check_save_id(save_id: str, where: str) -> str:
    if not isinstance(save_id, str) or not SAVE_ID_RE.match(save_id):
        raise UnsupportedFormatError(f"{where}: malformed save id {show(save_id)} in checkpoint metadata")
    return save_id


class ItemLocation(NamedTuple):
    """Where one saved item lives: ``WriteResult.storage_data`` and per-key storage data.

    Tensor chunks: ``length`` raw bytes at ``offset`` of ``relative_path``.
    Objects: ``offset == length == -1`` and ``object_ordinal`` indexes the
    object table of the rank's index. Compressed tensor chunks (see
    :mod:`compression`): ``offset == -1``, ``length`` raw bytes, and
    ``object_ordinal`` is the first of their consecutive blocks in the object
    table. A NamedTuple: built and compared for every item of every save, so
    it must be cheap.
    """

    relative_path: str
    offset: int
    length: int
    object_ordinal: int = -1

    @property
    def is_object(self) -> bool:
        return self.object_ordinal >= 0 and self.length < 0

    @property
    def is_compressed(self) -> bool:
        return self.object_ordinal >= 0 and self.length >= 0


STRIPE_ALIGN = 4096  # a stripe starts at a page boundary of the rank's data (O_DIRECT writes)


@dataclasses.dataclass
class RankFiles:
    """A rank's files. ``save_id`` is the id in their names and index when it is not
    the checkpoint's own (asynchronous saves name their files before the coordinator
    picks the checkpoint's id); empty otherwise.

    ``stripes`` (format 7): where the rank's data continues in another file. A
    rank's data is one range of offsets, as entries and the index record it;
    with stripes ``(s1, s2, ...)`` the bytes ``[0, s1)`` are in ``data_file``,
    ``[s1, s2)`` at the start of ``stripe_file_name(data_file, 1)``, and so on,
    the last stripe running to the end of the data. Writing each stripe from
    its own thread is what lets buffered writes to fast storage run in
    parallel (one file's writes serialize on its inode lock). Empty: one file.

    ``base`` (format 8): empty for the checkpoint's own ranks; for a rank of a
    base checkpoint that items refer to (an incremental save), the name of
    that checkpoint's directory, a sibling of this one. Its files are read as
    ``../<base>/<name>`` and checked against their own index, whose save id
    (``save_id``, always recorded for a base rank) must match.
    """

    rank: int
    data_file: str
    index_file: str
    save_id: str = ""
    stripes: tuple = ()
    base: str = ""

    def __setstate__(self, state):  # in-process copies only: on disk a rank is a plain tuple
        _set_fields_strictly(self, state, RANK_FILES_FIELDS)

    def files_save_id(self, checkpoint_save_id: str) -> str:
        return getattr(self, "save_id", "") or checkpoint_save_id

    def data_files(self) -> list[str]:
        """The rank's data files, stripe by stripe (names in their own directory)."""
        return [stripe_file_name(self.data_file, k) for k in range(len(self.stripes) + 1)]

    def file_names(self) -> list[str]:
        """Every file of the rank: its data files, stripe by stripe, then its index."""
        return [*self.data_files(), self.index_file]

    def path_of(self, name: str) -> str:
        """File ``name`` of this rank relative to the checkpoint that lists it: the name itself
        for its own ranks, ``../<base>/<name>`` for a base checkpoint's rank."""
        return base_file_path(self.base, name)

    def data_paths(self) -> list[str]:
        """:meth:`data_files` relative to the checkpoint that lists the rank."""
        return [self.path_of(n) for n in self.data_files()]

    @property
    def data_path(self) -> str:
        """The first data file relative to the checkpoint that lists the rank: what its
        items' ``ItemLocation.relative_path`` is."""
        return self.path_of(self.data_file)

    @property
    def index_path(self) -> str:
        return self.path_of(self.index_file)

    def stripe_of(self, offset: int) -> tuple[int, int, int | None]:
        """``(stripe, its first offset, its end or None)`` of the stripe holding data offset ``offset``."""
        return stripe_span(self.stripes, offset)


def stripe_span(starts: tuple, offset: int, end: int | None = None) -> tuple[int, int, int | None]:
    """``(stripe, its first data offset, its end)`` of data offset ``offset``, for a rank whose
    stripes 1, 2, ... start at ``starts`` (``RankFiles.stripes``); the last stripe ends at
    ``end``. The one place that maps a data offset to its stripe."""
    k = bisect.bisect_right(starts, offset)
    return k, (starts[k - 1] if k else 0), (starts[k] if k < len(starts) else end)


RANK_FILES_FIELDS = {"rank": int, "data_file": str, "index_file": str, "save_id": str, "stripes": tuple, "base": str}
LAYOUT_FIELDS = {
    "format": str, "version": int, "save_id": str, "ranks": list, "entries": list, "compression": (tuple, type(None)),
    "digests": dict,
}
DIGEST_HEX_CHARS = 32  # a content digest is XXH3-128, as 32 lowercase hex digits


def strict_fields(name: str, state, kinds: dict, defaults: dict) -> dict:
    """The fields of a ``name`` object from its pickled ``state``: exactly ``kinds``' names.

    A state from a damaged or hostile ``.metadata`` fails here with a
    :class:`CorruptCheckpointError` (the metadata reader adds the file's
    name): not a dict, a name that is not a field (``_table``, ``validate``:
    attributes that would shadow ours), a field not of its kind (bools are
    no ints), or a field without a default missing. A field with a default
    that the state lacks was added by a later format version and gets its
    default.
    """

    def bad(why: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"the storage layout is corrupt: a {name} {why}")

    if not isinstance(state, dict):
        raise bad(f"has a {type(state).__name__} state, not a dict of its fields")
    unknown = [k for k in state if k not in kinds]
    if unknown:
        raise bad(f"has fields {show(unknown)}, which it does not have")
    values = {}
    for field_name, kind in kinds.items():
        if field_name in state:
            value = state[field_name]
            if not isinstance(value, kind) or isinstance(value, bool):
                raise bad(f"has a {type(value).__name__} as its {field_name}")
        elif field_name in defaults:
            value = defaults[field_name]
        else:
            raise bad(f"lacks its {field_name}")
        values[field_name] = value
    return values


def _set_fields_strictly(obj, state, kinds: dict) -> None:
    """``__setstate__`` of our dataclasses (in-process copies): :func:`strict_fields` of their
    fields (``kinds`` names every one), with the dataclass's defaults."""
    defaults = {f.name: f.default for f in dataclasses.fields(obj) if f.default is not dataclasses.MISSING}
    obj.__dict__.update(strict_fields(type(obj).__name__, state, kinds, defaults))


def check_stripes(stripes, where: str, bad) -> None:
    """A rank's stripe starts: a tuple of increasing positive multiples of ``STRIPE_ALIGN``."""
    if not isinstance(stripes, tuple) or len(stripes) >= MAX_STRIPES:
        raise bad(f"{where} has stripes {show(stripes)}")
    prev = 0
    for s in stripes:
        if not isinstance(s, int) or isinstance(s, bool) or s <= prev or s % STRIPE_ALIGN or s >= 1 << 63:
            raise bad(f"{where} has stripe starts {show(stripes)}: not increasing multiples of {STRIPE_ALIGN}")
        prev = s


STREAM_CODEC = "stream"  # DCP's stream transforms (format 9): their descriptors follow the block size
COMPRESSION_CODECS = ("zstd", STREAM_CODEC)


def check_compression(compression, where: str, version: int = FORMAT_VERSION) -> None:
    """A layout's ``compression``: None, ``(codec, block_bytes)`` with a codec we can decode, or
    (from version 9) ``("stream", block_bytes, descriptors)``, DCP's transform descriptors as
    FileSystemWriter records them (a non-empty tuple of names)."""
    if compression is None:
        return
    stream = isinstance(compression, tuple) and len(compression) >= 1 and compression[0] == STREAM_CODEC
    if not (isinstance(compression, tuple) and len(compression) == (3 if stream else 2) and isinstance(compression[1], int)):
        raise CorruptCheckpointError(f"{where}: the storage layout is corrupt: compression {show(compression)}")
    if stream:
        descriptors = compression[2]
        if version < STREAM_SINCE or not (
            isinstance(descriptors, tuple) and descriptors and all(isinstance(d, str) and d for d in descriptors)
        ):
            raise CorruptCheckpointError(f"{where}: the storage layout is corrupt: compression {show(compression)}")
    codec, block_bytes = compression[:2]
    if codec not in COMPRESSION_CODECS:
        raise UnsupportedFormatError(
            f"{where}: tensors are compressed with {show(codec)}; this dcp_datastates decodes "
            f"{', '.join(COMPRESSION_CODECS)}. Upgrade dcp_datastates to load it."
        )
    # Blocks split chunks of any dtype (itemsize up to 16) and are read into buffers of their size.
    if not 0 < block_bytes <= MAX_BLOCK_BYTES or block_bytes % BLOCK_ALIGN:
        raise CorruptCheckpointError(f"{where}: the storage layout is corrupt: compression block size {block_bytes}")


BLOCK_ALIGN = 64  # a compression block size is a multiple of every dtype's itemsize
MAX_BLOCK_BYTES = 1 << 30


def compressed_blocks(length: int, block_bytes: int) -> int:
    """How many blocks a compressed chunk of ``length`` raw bytes is stored as."""
    return -(-length // block_bytes)


def location_key(fqn: str, offset) -> tuple:
    """``(fqn, chunk offsets as a tuple or None)``: how ``CheckpointLayout.entries`` name an item."""
    return (fqn, tuple(offset) if offset is not None else None)


@dataclasses.dataclass
class CheckpointLayout:
    """``Metadata.storage_data`` of a dcp_datastates checkpoint, in memory.

    ``entries`` holds one plain tuple per saved item,
    ``(fqn, chunk_offsets or None, slot, offset, length, object_ordinal)``,
    where ``slot`` is the item's rank files' position in ``ranks`` from format 8
    on (the checkpoint's own ranks come first, rank r in slot r, so for them
    slot and rank agree; base ranks follow) and the rank number before:
    plain tuples pickle several times faster than one object per item,
    which matters for states of tens of thousands of tensors. Lookups by
    ``MetadataIndex`` go through a dict built on first use.

    It is never pickled into ``.metadata``: ``encode_metadata`` stores its
    plain form and decoding rebuilds it (``storage_data.py``), so this class
    may move or change without breaking a checkpoint. Its pickling methods
    serve in-process copies only.
    """

    format: str
    version: int
    save_id: str
    ranks: list[RankFiles]
    entries: list[tuple]
    # None, or (codec, block_bytes) when large tensor chunks are stored compressed
    # (see compression.py); layouts pickled by versions 1-3 get None.
    compression: tuple | None = None
    # Format 8: {location_key: XXH3-128 hex digest} of the large raw tensor chunks whose
    # content was hashed when saved (incremental checkpoints compare them; see incremental.py).
    digests: dict = dataclasses.field(default_factory=dict)

    def __getstate__(self):
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def __setstate__(self, state):
        # Strict: a hostile pickle could otherwise set any attribute (a cached ``_table``,
        # a method). Fields added later (with a default, e.g. compression) get the default.
        _set_fields_strictly(self, state, LAYOUT_FIELDS)

    @property
    def objects_transformed(self) -> bool:
        """Whether each saved object is stored as one frame of DCP's stream transforms (format 9),
        to be undone before it is unpickled (zstd leaves objects raw)."""
        return self.compression is not None and self.compression[0] == STREAM_CODEC

    def slots(self) -> dict[int, RankFiles]:
        """``{slot: RankFiles}``: what the third field of an entry names (a position in ``ranks``
        from format 8 on, a rank number before)."""
        if self.version >= BASES_SINCE:
            return dict(enumerate(self.ranks))
        return {r.rank: r for r in self.ranks}

    def slot_paths(self) -> dict[int, str]:
        """``{slot: data path relative to the checkpoint}``: what entries name, as an item's
        ``ItemLocation.relative_path`` (a base rank's: ``../<base>/<file>``)."""
        return {slot: r.data_path for slot, r in self.slots().items()}

    @property
    def own_ranks(self) -> list[RankFiles]:
        """The ranks whose files are this checkpoint's own (not a base checkpoint's)."""
        return [r for r in self.ranks if not r.base]

    @property
    def bases(self) -> list[str]:
        """The base checkpoints (sibling directory names) this one refers to, sorted."""
        return sorted({r.base for r in self.ranks if r.base})

    def _lookup(self) -> dict:
        table = self.__dict__.get("_table")
        if table is None:
            files = self.slot_paths()
            table = {}
            for fqn, off, rank, offset, length, ordinal in self.entries:
                if rank not in files:
                    raise CorruptCheckpointError(f"metadata places {fqn!r} in rank {rank}, which has no files")
                table[(fqn, off)] = ItemLocation(files[rank], offset, length, ordinal)
            self.__dict__["_table"] = table
        return table

    def files_of(self, relative_path: str) -> RankFiles | None:
        """The rank files whose first data file is ``relative_path`` (an ``ItemLocation``'s)."""
        by_path = self.__dict__.get("_by_path")
        if by_path is None:
            by_path = self.__dict__["_by_path"] = {r.data_path: r for r in self.ranks}
        return by_path.get(relative_path)

    def check_covers(self, metadata, where: str) -> None:
        """Every item the metadata lists has a stored location (of the right kind), and every
        tensor chunk's stored length is its shape's bytes (raw bytes, compressed or not)."""
        table = self._lookup()
        for fqn, md in metadata.state_dict_metadata.items():
            chunks = getattr(md, "chunks", None)
            if chunks is None:
                loc = table.get((fqn, None))
                if loc is None or not loc.is_object:
                    raise CorruptCheckpointError(f"{where}: the storage layout is corrupt: {fqn!r} has no stored location")
                continue
            itemsize = md.properties.dtype.itemsize
            for chunk in chunks:
                key = (fqn, tuple(chunk.offsets))
                loc = table.get(key)
                if loc is None or loc.is_object:
                    raise CorruptCheckpointError(
                        f"{where}: the storage layout is corrupt: {fqn!r} (at {key[1]}) has no stored location"
                    )
                if loc.length != math.prod(chunk.sizes) * itemsize:
                    raise CorruptCheckpointError(
                        f"{where}: the storage layout is corrupt: {fqn!r} (at {key[1]}) has {loc.length} stored "
                        f"bytes in {loc.relative_path}, and its {md.properties.dtype} chunk of shape "
                        f"{tuple(chunk.sizes)} needs {math.prod(chunk.sizes) * itemsize}"
                    )

    def location(self, index: MetadataIndex) -> ItemLocation | None:
        return self._lookup().get(location_key(index.fqn, index.offset))

    @property
    def locations(self) -> dict[MetadataIndex, ItemLocation]:
        """Every item's location keyed by ``MetadataIndex`` (for tools; builds a new dict)."""
        from torch.distributed.checkpoint.metadata import MetadataIndex

        return {MetadataIndex(fqn, off): loc for (fqn, off), loc in self._lookup().items()}

    def validate(self, where: str) -> None:
        missing = [f.name for f in dataclasses.fields(self) if f.name not in self.__dict__]
        if missing:
            raise CorruptCheckpointError(f"{where}: the storage layout is corrupt: it lacks {', '.join(missing)}")
        check_format_version(self.format, self.version, where)
        check_save_id(self.save_id, where)
        check_compression(self.compression, where, self.version)
        self._validate_structure(where)

    def _validate_structure(self, where: str) -> None:
        """Types and names a well-formed layout has: nothing later trips on a hostile edit.

        File names must be our plain rank-file names (no directories: a
        checkpoint never makes the reader open a file outside itself).
        """

        def bad(why: str) -> CorruptCheckpointError:
            return CorruptCheckpointError(f"{where}: the storage layout is corrupt: {why}")

        if not isinstance(self.ranks, list) or not isinstance(self.entries, list):
            raise bad("its rank list or item list is not a list")
        ranks = set()
        own = True  # format 8: own ranks first, rank r in slot r; base ranks after them
        for slot, r in enumerate(self.ranks):
            rank = getattr(r, "rank", None)
            if not isinstance(r, RankFiles) or not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
                raise bad(f"rank entry {show(r)}")
            sid = getattr(r, "save_id", "")
            if sid and not (isinstance(sid, str) and SAVE_ID_RE.match(sid)):
                raise bad(f"rank {rank}'s save id {show(sid)}")
            base = getattr(r, "base", "")
            if base:
                if self.version < BASES_SINCE:
                    raise bad(f"rank {rank} is a base checkpoint's in a layout of version {self.version}")
                if not (isinstance(base, str) and BASE_NAME_RE.match(base)):
                    raise bad(f"rank {rank} refers to base checkpoint {show(base)}, which is not a sibling directory's name")
                if not sid:
                    raise bad(f"rank {rank} of base checkpoint {base!r} records no save id")
                own = False
            elif self.version >= BASES_SINCE and (not own or rank != slot):
                raise bad(f"own rank {rank} is in slot {slot}: own ranks come first, rank r in slot r")
            for name, kind in ((getattr(r, "data_file", None), "data"), (getattr(r, "index_file", None), "index")):
                m = DATA_FILE_RE.match(name) if isinstance(name, str) else None
                if m is None or m.group(4) != kind or m.group(3) is not None or int(m.group(1)) != rank:
                    raise bad(f"rank {rank}'s {kind} file name {show(name)} is not a rank file name")
            check_stripes(getattr(r, "stripes", None), f"rank {rank}", bad)
            if r.stripes and self.version < STRIPES_SINCE:
                raise bad(f"rank {rank} is striped in a layout of version {self.version}")
            key = (base, rank)
            if key in ranks:
                raise bad(f"rank {rank}{f' of base {base!r}' if base else ''} is listed twice")
            ranks.add(key)
        slots = self.slots()
        striped = {slot: r.stripes for slot, r in slots.items() if r.stripes}
        for e in self.entries:
            if not (isinstance(e, tuple) and len(e) == 6 and isinstance(e[0], str)):
                raise bad(f"item entry {show(e)}")
            fqn, off, rank, offset, length, ordinal = e
            if off is not None and not (isinstance(off, tuple) and all(isinstance(x, int) for x in off)):
                raise bad(f"{fqn!r} has chunk offsets {show(off)}")
            if not all(isinstance(x, int) for x in (rank, offset, length, ordinal)):
                raise bad(f"{fqn!r} has a non-integer location")
            if not all(-1 <= x < 1 << 63 for x in (rank, offset, length, ordinal)):
                raise bad(f"{fqn!r} has a location out of range: {show(e[2:])}")
            if rank not in slots:
                raise bad(f"{fqn!r} is placed in rank {rank}, which has no files")
            if slots[rank].base and ordinal >= 0:
                raise bad(f"{fqn!r} refers to an object of base checkpoint {slots[rank].base!r}; only raw tensor bytes are referred to")
            if ordinal >= 0 and length >= 0:  # a compressed tensor chunk: its blocks start at ordinal
                if self.compression is None or off is None or offset != -1:
                    raise bad(f"{fqn!r} is stored as compressed blocks, but the layout records no compression")
                continue
            if ordinal >= 0:
                continue
            if offset < 0 or length < 0:
                raise bad(f"{fqn!r} is stored at offset {offset} with length {length}")
            starts = striped.get(rank)
            if starts:
                k, _, next_start = stripe_span(starts, offset)
                if next_start is not None and offset + length > next_start:
                    raise bad(f"{fqn!r} (bytes {offset}..{offset + length}) crosses the start of rank {rank}'s stripe {k + 1} at {next_start}")
        self._validate_digests(bad)

    def _validate_digests(self, bad) -> None:
        digests = self.__dict__.get("digests")
        if not isinstance(digests, dict):
            raise bad(f"its digests are a {type(digests).__name__}")
        if digests and self.version < BASES_SINCE:
            raise bad(f"a layout of version {self.version} records content digests")
        keys = None
        for key, digest in digests.items():
            if not (isinstance(digest, str) and len(digest) == DIGEST_HEX_CHARS and _is_lower_hex(digest)):
                raise bad(f"the content digest of {show(key)} is {show(digest)}")
            if keys is None:
                keys = self._lookup()
            loc = keys.get(key)
            if loc is None or loc.object_ordinal >= 0:
                raise bad(f"it records a content digest of {show(key)}, which is no raw tensor chunk of it")


def _is_lower_hex(text: str) -> bool:
    return all(c in "0123456789abcdef" for c in text)


def object_entries(layout: CheckpointLayout) -> dict[int, int]:
    """``{slot: object-table entries the validated layout refers to}`` (for :class:`IndexLimits`;
    a base rank's are its own checkpoint's business: none are referred to)."""
    objects = {slot: 0 for slot in layout.slots()}
    block = layout.compression[1] if layout.compression is not None else 0
    for _fqn, _off, rank, _offset, length, ordinal in layout.entries:
        if ordinal >= 0:
            span = compressed_blocks(length, block) if length >= 0 and block else 1
            objects[rank] = max(objects.get(rank, 0), ordinal + span)
    return objects
