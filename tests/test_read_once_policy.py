"""Which loads read once: the coordinator's rule on the plans, without ranks. A load shares
reads when the tensor bytes read after each chunk's first reader reach the threshold, any
shared chunk with a threshold of 0, never when only one rank loads or a rank did not ask."""

from __future__ import annotations

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

from dcp_datastates.core.read_once import LoadExchange, RankTag, tag_global_plans


def _metadata() -> Metadata:
    def tensor(dtype, n):
        size = torch.Size([n])
        return TensorStorageMetadata(TensorProperties(dtype), size, [ChunkStorageMetadata(torch.Size([0]), size)])

    return Metadata({"w": tensor(torch.float32, 1000), "step": tensor(torch.int64, 1), "obj": BytesStorageMetadata()})


def _read(fqn: str, n: int) -> ReadItem:
    kind = LoadItemType.BYTE_IO if fqn == "obj" else LoadItemType.TENSOR
    index = MetadataIndex(fqn, None if kind == LoadItemType.BYTE_IO else torch.Size([0]))
    zero = torch.Size([0])
    return ReadItem(kind, index, zero, index, zero, torch.Size([n]))


def _plans(*per_rank) -> list[LoadPlan]:
    return [LoadPlan([_read(f, n) for f, n in reads], storage_data=RankTag(r)) for r, reads in enumerate(per_rank)]


def _shared(plans, min_bytes) -> bool:
    out = tag_global_plans(plans, _metadata(), min_bytes)
    assert all(isinstance(p.storage_data, LoadExchange) and p.storage_data.members == (0, 1, 2) for p in out)
    return out[0].storage_data.shared


def test_the_bytes_read_again_decide():
    replicated_step = _plans([("step", 1), ("obj", 0)], [("step", 1), ("obj", 0)], [("step", 1)])
    assert not _shared(replicated_step, 64 << 20)
    assert _shared(replicated_step, 0)  # any shared chunk
    assert _shared(replicated_step, 16) and not _shared(replicated_step, 17)  # two int64 reads after the first
    whole = _plans([("w", 1000)], [("w", 1000)], [("w", 500)])
    assert _shared(whole, 6000) and not _shared(whole, 6001)  # 4,000 + 2,000 bytes after rank 0's
    apart = _plans([("w", 1000)], [("step", 1)], [("obj", 0)])
    assert not _shared(apart, 0)  # nothing read twice


def test_objects_are_not_counted():
    objects = _plans([("obj", 0)], [("obj", 0)], [("obj", 0)])
    assert _shared(objects, 0) and not _shared(objects, 1)


def test_no_exchange_unless_every_rank_asked():
    plans = _plans([("w", 1000)], [("w", 1000)], [("w", 1000)])
    plans[1] = LoadPlan(plans[1].items)  # its reader does not read once
    assert all(p.storage_data is None for p in tag_global_plans(plans, _metadata(), 0))
    single = _plans([("w", 1000)])
    assert tag_global_plans(single, _metadata(), 0)[0].storage_data is None
