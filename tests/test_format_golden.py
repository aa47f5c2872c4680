"""Golden bytes of the format: the rank index, the ``.metadata`` trailer and the plain layout.

The expected bytes are written out here field by field, as docs/format.md
describes them, so that a change to the encoders (a field moved, a width or
an endianness changed, the checksum taken over other bytes) fails here even
when the decoders change with it. The CRC-32C values were computed with a
bitwise reference implementation (``_crc32c`` below), not with the engine's.
"""

from __future__ import annotations

import os
import struct
import sys

import pytest
import torch
from torch.distributed.checkpoint.metadata import MetadataIndex

from dcp_datastates.errors import CorruptCheckpointError
from dcp_datastates.format.metadata_file import decode_metadata, encode_metadata, encode_trailer, parse_trailer, split_metadata
from dcp_datastates.format.checkpoint_layout import FORMAT_VERSION, CheckpointLayout, ItemLocation, RankFiles
from dcp_datastates.format.rank_index import decode_index, encode_index
from dcp_datastates.format.storage_data import layout_of, layout_to_plain

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures"))
from pickle_tools import plain_types  # noqa: E402


def _crc32c(data: bytes, crc: int = 0) -> int:
    """CRC-32C (Castagnoli), bit by bit: the reference the golden checksums were computed with."""
    crc ^= 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF


def test_the_reference_crc32c():
    assert _crc32c(b"123456789") == 0xE3069283


# -- the rank index ------------------------------------------------------------------------

INDEX_ARGS = dict(
    rank=3,
    save_id="0123456789ab",
    data_size=8192,
    segments=[(0, 100, 0xE3069283), (128, 4000, 0x89ABCDEF)],
    objects=[(4160, 37), (4224, 0)],
)
INDEX_GOLDEN = bytes.fromhex(
    "4443504453494458"  # magic b"DCPDSIDX"
    "09000000"  # format version 9 (u32)
    "03000000"  # rank 3 (u32)
    "30313233343536373839616200000000"  # save id, ASCII, zero-padded to 16
    "0020000000000000"  # data size 8192 (u64)
    "0200000000000000"  # 2 segments (u64)
    "0200000000000000"  # 2 objects (u64)
    "0000000000000000" "6400000000000000" "839206e3" "00000000"  # segment: offset 0, 100 bytes, crc, 0
    "8000000000000000" "a00f000000000000" "efcdab89" "00000000"  # segment: offset 128, 4000 bytes, crc, 0
    "4010000000000000" "2500000000000000"  # object: offset 4160, 37 bytes
    "8010000000000000" "0000000000000000"  # object: offset 4224, 0 bytes
    "16519fc2"  # CRC-32C of every byte before it
)


def test_rank_index_bytes():
    assert FORMAT_VERSION == 9
    blob = encode_index(**INDEX_ARGS)
    assert blob.hex() == INDEX_GOLDEN.hex()
    assert len(blob) == 56 + 2 * 24 + 2 * 16 + 4
    assert struct.unpack("<I", blob[-4:])[0] == _crc32c(blob[:-4])


def test_rank_index_decodes_from_the_golden_bytes():
    idx = decode_index(INDEX_GOLDEN, "rank00003-0123456789ab.index")
    assert (idx.rank, idx.save_id, idx.data_size) == (3, "0123456789ab", 8192)
    assert list(zip(idx.seg_offsets, idx.seg_lengths, idx.seg_crcs)) == INDEX_ARGS["segments"]
    assert idx.objects == INDEX_ARGS["objects"]


@pytest.mark.parametrize("version", [1, 4])
def test_rank_indexes_of_older_versions_decode(version):
    """The index layout has not changed since version 1; only its version field differs."""
    body = INDEX_GOLDEN[:8] + struct.pack("<I", version) + INDEX_GOLDEN[12:-4]
    idx = decode_index(body + struct.pack("<I", _crc32c(body)), "old.index")
    assert idx.objects == INDEX_ARGS["objects"]


def test_a_rank_index_of_a_newer_version_is_refused_by_name():
    from dcp_datastates.errors import UnsupportedFormatError

    body = INDEX_GOLDEN[:8] + struct.pack("<I", FORMAT_VERSION + 1) + INDEX_GOLDEN[12:-4]
    with pytest.raises(UnsupportedFormatError, match=r"new\.index has format version 10"):
        decode_index(body + struct.pack("<I", _crc32c(body)), "new.index")


# -- the .metadata trailer -------------------------------------------------------------------

PICKLE = b"\x80\x05N."  # pickle.dumps(None, protocol=5): any pickle; the trailer only counts and sums it
TRAILER_GOLDEN = bytes.fromhex(
    "44435044534d4434"  # magic b"DCPDSMD4"
    "0400000000000000"  # the body's length, 4 (u64): here a pickle alone
    "0700000000000000"  # commit sequence 7 (u64)
    "3dd2db73"  # CRC-32C of the body, then of the 8 sequence bytes (u32)
    "00000000"  # reserved
)
# Version 3's trailer, still read: no sequence, the CRC-32C covers the pickle only.
TRAILER_V3_GOLDEN = bytes.fromhex("44435044534d44430400000000000000" "ebd151a6" "00000000")
# Version 6: the plain record after the pickle, and the footer that finds it, inside the body.
RECORD = b'{"x":1}'  # any record; the footer only counts it
FOOTER_GOLDEN = bytes.fromhex(
    "4443504453524336"  # magic b"DCPDSRC6"
    "0400000000000000"  # the pickle's length, 4 (u64)
    "0700000000000000"  # the record's length, 7 (u64)
)


def test_metadata_trailer_bytes():
    trailer = encode_trailer(PICKLE, 7)
    assert trailer.hex() == TRAILER_GOLDEN.hex()
    assert struct.unpack_from("<I", trailer, 24)[0] == _crc32c(PICKLE + struct.pack("<Q", 7))


@pytest.mark.parametrize("golden,sequence,size", [(TRAILER_GOLDEN, 7, 32), (TRAILER_V3_GOLDEN, 0, 24)])
def test_metadata_trailers_decode_from_the_golden_bytes(golden, sequence, size):
    blob = PICKLE + golden
    trailer = parse_trailer(blob[-32:], len(blob), "m")
    assert (trailer.body_length, trailer.sequence, trailer.size) == (len(PICKLE), sequence, size)
    pickled, record, checked = split_metadata(blob, "m")
    assert checked and bytes(pickled) == PICKLE and len(record) == 0
    flipped = bytearray(blob)
    flipped[2] ^= 1  # a byte of the pickle
    with pytest.raises(CorruptCheckpointError, match="checksum"):
        split_metadata(bytes(flipped), "m")


def test_a_record_and_its_footer_sit_in_the_checksummed_body():
    body = PICKLE + RECORD + FOOTER_GOLDEN
    blob = body + encode_trailer(body, 7)
    assert parse_trailer(blob[-32:], len(blob), "m").body_length == len(body)
    pickled, record, checked = split_metadata(blob, "m")
    assert checked and bytes(pickled) == PICKLE and bytes(record) == RECORD
    for at in (len(PICKLE), len(body) - 1):  # the record's first byte, the footer's last
        flipped = bytearray(blob)
        flipped[at] ^= 1
        with pytest.raises(CorruptCheckpointError, match="checksum"):
            split_metadata(bytes(flipped), "m")
    # A footer whose lengths do not add up to the body is named, checksum or not.
    bad = PICKLE + RECORD + FOOTER_GOLDEN[:8] + struct.pack("<QQ", 5, 7)
    with pytest.raises(CorruptCheckpointError, match="record footer"):
        split_metadata(bad + encode_trailer(bad), "m")


def test_a_trailer_sequence_out_of_range_is_refused():
    with pytest.raises(ValueError, match="commit sequence"):
        encode_trailer(PICKLE, 1 << 64)


# -- the plain storage data ------------------------------------------------------------------

LAYOUT = CheckpointLayout(
    "dcp_datastates",
    FORMAT_VERSION,
    "0123456789ab",
    [
        RankFiles(0, "rank00000-0123456789ab.data", "rank00000-0123456789ab.index", "", (8192,)),  # two stripes
        RankFiles(1, "rank00001-cafef00d0042.data", "rank00001-cafef00d0042.index", "cafef00d0042"),
        # slot 2: rank 0 of the base checkpoint step_10, a sibling directory (format 8)
        RankFiles(0, "rank00000-00000000beef.data", "rank00000-00000000beef.index", "00000000beef", (), "step_10"),
    ],
    [
        ("model.w", (0, 0), 0, 0, 4096, -1),  # a raw tensor chunk
        ("model.w", (4, 0), 1, 4096, 4096, -1),
        ("big", (0,), 1, -1, 262144, 1),  # a compressed chunk: raw length, blocks from ordinal 1
        ("step", None, 0, -1, -1, 0),  # an object: its ordinal in rank 0's object table
        ("frozen", (0,), 2, 8192, 65536, -1),  # bytes of step_10's rank 0 (slot 2), referred to
    ],
    ("zstd", 4 << 20),
    {("model.w", (0, 0)): "00112233445566778899aabbccddeeff", ("frozen", (0,)): "0f1e2d3c4b5a69788796a5b4c3d2e1f0"},
)
PLAIN_GOLDEN = {
    "format": "dcp_datastates",
    "version": 9,
    "save_id": "0123456789ab",
    "ranks": [
        (0, "rank00000-0123456789ab.data", "rank00000-0123456789ab.index", "", (8192,), ""),
        (1, "rank00001-cafef00d0042.data", "rank00001-cafef00d0042.index", "cafef00d0042", (), ""),
        (0, "rank00000-00000000beef.data", "rank00000-00000000beef.index", "00000000beef", (), "step_10"),
    ],
    "entries": [
        ("model.w", (0, 0), 0, 0, 4096, -1),
        ("model.w", (4, 0), 1, 4096, 4096, -1),
        ("big", (0,), 1, -1, 262144, 1),
        ("step", None, 0, -1, -1, 0),
        ("frozen", (0,), 2, 8192, 65536, -1),
    ],
    "compression": ("zstd", 4194304),
    "digests": [
        ("model.w", (0, 0), "00112233445566778899aabbccddeeff"),
        ("frozen", (0,), "0f1e2d3c4b5a69788796a5b4c3d2e1f0"),
    ],
}


def test_plain_storage_data_of_a_fixed_layout():
    plain = layout_to_plain(LAYOUT)
    assert plain == PLAIN_GOLDEN
    assert list(plain) == list(PLAIN_GOLDEN)  # the keys in their documented order
    assert plain_types(plain) <= {dict, list, tuple, str, int, type(None)}


def test_plain_storage_data_decodes_to_the_layout():
    layout = layout_of(PLAIN_GOLDEN, "m")
    assert layout == LAYOUT
    assert layout.location(MetadataIndex("model.w", torch.Size([4, 0]))) == ItemLocation(
        "rank00001-cafef00d0042.data", 4096, 4096, -1
    )
    assert layout.location(MetadataIndex("step")).is_object
    assert layout.ranks[1].files_save_id(layout.save_id) == "cafef00d0042"
    # a reference: the base's file, relative to the checkpoint directory
    assert layout.location(MetadataIndex("frozen", torch.Size([0]))) == ItemLocation(
        "../step_10/rank00000-00000000beef.data", 8192, 65536, -1
    )
    assert layout.bases == ["step_10"] and [r.rank for r in layout.own_ranks] == [0, 1]


def test_layouts_read_from_older_versions_are_written_as_the_current_version():
    """They differ from it only in how the layout and the .metadata around it were stored."""
    old = CheckpointLayout("dcp_datastates", 3, "0123456789ab", LAYOUT.ranks[:2], LAYOUT.entries[:2])
    assert layout_to_plain(old)["version"] == FORMAT_VERSION and layout_to_plain(old)["compression"] is None


def test_a_metadata_file_decodes_its_plain_layout():
    """decode_metadata hands back a CheckpointLayout, validated, in storage_data."""
    import pickle

    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        TensorProperties,
        TensorStorageMetadata,
    )

    md = Metadata(
        {
            "model.w": TensorStorageMetadata(
                TensorProperties(dtype=torch.float32),
                torch.Size([8, 256]),
                [ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([4, 256])),
                 ChunkStorageMetadata(torch.Size([4, 0]), torch.Size([4, 256]))],
            ),
            "big": TensorStorageMetadata(
                TensorProperties(dtype=torch.float32), torch.Size([65536]),
                [ChunkStorageMetadata(torch.Size([0]), torch.Size([65536]))],
            ),
            "step": BytesStorageMetadata(),
            "frozen": TensorStorageMetadata(
                TensorProperties(dtype=torch.float32), torch.Size([16384]),
                [ChunkStorageMetadata(torch.Size([0]), torch.Size([16384]))],
            ),
        },
        storage_data=PLAIN_GOLDEN,
    )
    blob = pickle.dumps(md, protocol=pickle.HIGHEST_PROTOCOL)
    decoded, checked = decode_metadata(blob + encode_trailer(blob, 7), "ckpt/.metadata")
    assert checked and decoded.storage_data == LAYOUT


# -- format 9: the pickle's storage data, and DCP's stream transforms --------------------------


def test_the_pickled_storage_data_answers_stock_dcp_with_the_named_file():
    """The pickle stores the plain layout in a defaultdict whose factory is DCP's _StorageInfo of
    one documented file name: stock DCP's FileSystemReader opens it, and fails naming it."""
    import pickle
    import pickletools

    from dcp_datastates._dcp_compat import storage_info_class
    from dcp_datastates.format.storage_data import STOCK_READER_FILE, storage_data_to_pickle

    assert STOCK_READER_FILE == "dcp_datastates-checkpoint--load-it-with-storage_reader=dcp_datastates.DataStatesReader(path)"
    blob = pickle.dumps(storage_data_to_pickle(LAYOUT), protocol=pickle.HIGHEST_PROTOCOL)
    names = [arg for op, arg, _ in pickletools.genops(blob) if op.name == "SHORT_BINUNICODE"]
    assert ["collections", "defaultdict", "functools", "partial", "torch.distributed.checkpoint.filesystem",
            "_StorageInfo"] == names[:6]  # nothing of ours is named
    stock = pickle.loads(blob)
    assert dict(stock) == PLAIN_GOLDEN
    assert stock[MetadataIndex("model.w", torch.Size([0, 0]))] == storage_info_class()(STOCK_READER_FILE, 0, 0)


@pytest.mark.parametrize("allow_pickle", [False, True])
def test_the_pickled_storage_data_decodes_to_the_layout_in_both_unpicklers(allow_pickle):
    from torch.distributed.checkpoint.metadata import Metadata

    md = Metadata({}, storage_data=LAYOUT)
    blob = encode_metadata(md)
    body, _record, _ = split_metadata(blob, "m")
    pickled_only = bytes(body) + encode_trailer(bytes(body))  # decoded from the pickle, not the record
    decoded, _ = decode_metadata(pickled_only, "m", allow_pickle=allow_pickle)
    assert decoded.storage_data == LAYOUT


def test_a_defaultdict_with_another_factory_is_refused():
    """The unpicklers admit exactly the factory the writer pickles: no partial of anything else."""
    import collections
    import functools
    import pickle

    from torch.distributed.checkpoint.metadata import Metadata

    from dcp_datastates._dcp_compat import storage_info_class
    from dcp_datastates.errors import UnsafeCheckpointError

    for factory in (functools.partial(storage_info_class(), "../elsewhere", 0, 0), functools.partial(dict)):
        md = Metadata({}, storage_data=collections.defaultdict(factory, layout_to_plain(LAYOUT)))
        blob = pickle.dumps(md, protocol=pickle.HIGHEST_PROTOCOL)
        with pytest.raises((CorruptCheckpointError, UnsafeCheckpointError), match="stock-reader record|builtins.dict"):
            decode_metadata(blob + encode_trailer(blob), "m")


STREAM = ("stream", 4 << 20, ("test.rot/1", "stream.zstd/1"))


def test_stream_transform_compression_round_trips_through_plain_data_and_the_record():
    """Format 9: frames of DCP's stream transforms record the descriptors as DCP would."""
    from torch.distributed.checkpoint.metadata import Metadata

    layout = CheckpointLayout("dcp_datastates", FORMAT_VERSION, "0123456789ab", LAYOUT.ranks[:2], LAYOUT.entries[:4], STREAM)
    plain = layout_to_plain(layout)
    assert plain["compression"] == ("stream", 4194304, ("test.rot/1", "stream.zstd/1"))
    assert layout_of(plain, "m") == layout and layout.objects_transformed
    decoded, _ = decode_metadata(encode_metadata(Metadata({}, storage_data=layout)), "m")  # through the record
    assert decoded.storage_data == layout


@pytest.mark.parametrize("compression", [("stream", 4 << 20, ()), ("stream", 4 << 20, ("",)), ("stream", 4 << 20)])
def test_a_malformed_stream_codec_is_refused(compression):
    plain = dict(PLAIN_GOLDEN, compression=compression, entries=PLAIN_GOLDEN["entries"][:2], digests=[])
    with pytest.raises(CorruptCheckpointError, match="compression"):
        layout_of(plain, "m")


def test_a_stream_codec_in_a_layout_before_version_9_is_refused():
    plain = dict(PLAIN_GOLDEN, version=8, compression=STREAM)
    with pytest.raises(CorruptCheckpointError, match="compression"):
        layout_of(plain, "m")
