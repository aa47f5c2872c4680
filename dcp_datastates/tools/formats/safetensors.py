"""``convert --to safetensors``: Hugging Face's sharded layout, written byte by byte.

``model-0000i-of-0000N.safetensors`` shards of at most ``max_shard_bytes``
plus ``model.safetensors.index.json``; the format is a JSON header and raw
little-endian bytes, so each shard is written block by block in the tensor's
row-major order. Saved Python objects have no place there: they are skipped
(and listed).
"""

from __future__ import annotations

import json
import math
import os
import struct
import sys
from typing import Any, Iterator

import torch

from dcp_datastates.storage.fsync_files import fsync_dir
from dcp_datastates.errors import CheckpointError
from dcp_datastates.tools.checkpoint_view import read_ahead, split_box
from dcp_datastates.tools.formats import block_bytes

INDEX = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"  # what save_pretrained names a model that fits one shard

# torch dtype -> safetensors dtype name (safetensors.torch._TYPES, reversed).
DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
    torch.float8_e4m3fnuz: "F8_E4M3FNUZ", torch.float8_e5m2fnuz: "F8_E5M2FNUZ",
    torch.complex64: "C64", torch.uint64: "U64", torch.uint32: "U32", torch.uint16: "U16",
}


def check_dtypes(view) -> None:
    """Refuse, before anything is written, tensors whose dtype safetensors has no name for."""
    bad = [(fqn, md.properties.dtype) for fqn, md in view.tensors.items() if md.properties.dtype not in DTYPES]
    if bad:
        listed = ", ".join(f"{fqn!r} ({str(dtype).replace('torch.', '')})" for fqn, dtype in bad)
        raise ValueError(
            f"{view.path}: safetensors cannot hold dtype {str(bad[0][1]).replace('torch.', '')} "
            f"of key {bad[0][0]!r}; keys it cannot store: {listed} (convert --to torch, dcp or datastates instead)"
        )


def plan_shards(sizes: list[tuple[str, int]], max_shard_bytes: int) -> list[list[str]]:
    """Group keys, in order, into shards of at most ``max_shard_bytes`` (a larger tensor alone)."""
    shards: list[list[str]] = []
    used = 0
    for key, nbytes in sizes:
        if not shards or (shards[-1] and used + nbytes > max_shard_bytes):
            shards.append([])
            used = 0
        shards[-1].append(key)
        used += nbytes
    return shards or [[]]


def shard_header(view, keys: list[str]) -> bytes:
    """A shard's header: 8-byte little-endian length, then JSON padded with spaces to 8 bytes."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for fqn in keys:
        md = view.tensors[fqn]
        end = offset + view.nbytes(fqn)
        header[fqn] = {
            "dtype": DTYPES[md.properties.dtype],
            "shape": list(md.size),
            "data_offsets": [offset, end],
        }
        offset = end
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def write(view, tmp: str, summary, tracker, max_shard_bytes: int, *, single_file: bool = False) -> None:
    """HF-style shards plus ``model.safetensors.index.json``; objects are skipped (listed).

    With ``single_file``, a model that fits one shard is written as
    ``model.safetensors`` alone, without an index, as ``save_pretrained`` does.
    """
    if sys.byteorder != "little":  # pragma: no cover - safetensors stores little-endian bytes
        raise CheckpointError("converting to safetensors needs a little-endian machine")
    keys = list(view.tensors)
    shards = plan_shards([(k, view.nbytes(k)) for k in keys], max_shard_bytes)
    os.mkdir(tmp)
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    if single_file and len(shards) == 1:
        names = [SINGLE_FILE]
    weight_map: dict[str, str] = {}
    for name, shard in zip(names, shards):
        path = os.path.join(tmp, name)
        with open(path, "xb") as f:
            f.write(shard_header(view, shard))
            done = set()
            for fqn, block in read_ahead(_with_empty(view, shard)):  # the next block is read meanwhile
                if block is not None:
                    f.write(_raw_bytes(block))
                    tracker.add(block.numel() * block.element_size())
                    del block
                if fqn not in done:
                    done.add(fqn)
                    weight_map[fqn] = name
                    summary.tensors += 1
                    summary.bytes += view.nbytes(fqn)
            f.flush()
            os.fsync(f.fileno())
    summary.skipped = list(view.objects)
    summary.files = list(names)
    if names != [SINGLE_FILE]:
        index = {"metadata": {"total_size": summary.bytes}, "weight_map": weight_map}
        with open(os.path.join(tmp, INDEX), "x") as f:
            json.dump(index, f, indent=2)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        summary.files.append(INDEX)
    fsync_dir(tmp)


def _row_major_blocks(view, fqn: str) -> Iterator[torch.Tensor]:
    """Blocks of ``fqn`` whose bytes follow one another in the tensor's row-major order.

    ``view.blocks`` follows the saved chunks, which for a tensor sharded along
    an inner dimension are not contiguous in the unsharded tensor; here boxes
    are slabs of the global shape instead, assembled from whatever chunks
    they cross.
    """
    md = view.tensors[fqn]
    shape = tuple(md.size)
    if math.prod(shape) == 0:
        return
    if not shape:
        yield view.read_block(fqn, (), ())
        return
    itemsize = md.properties.dtype.itemsize
    for offsets, sizes in split_box((0,) * len(shape), shape, itemsize, block_bytes(view)):
        yield view.read_block(fqn, offsets, sizes)


def _with_empty(view, keys: list[str]) -> Iterator[tuple[str, torch.Tensor | None]]:
    """``(key, block)`` for every block of every key, in order; ``(key, None)`` for an empty tensor."""
    for fqn in keys:
        yielded = False
        for block in _row_major_blocks(view, fqn):
            yielded = True
            yield fqn, block
        if not yielded:
            yield fqn, None


def _raw_bytes(block: torch.Tensor) -> memoryview:
    """The little-endian bytes of a contiguous CPU tensor, without a copy."""
    return memoryview(block.reshape(-1).view(torch.uint8).numpy())
