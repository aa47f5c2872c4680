"""Which loads read once, decided in DCP's planning so that every rank agrees.

Each rank's local plan says who it is (its global rank) and that its reader reads once; the
coordinator, which sees every plan, tells every rank the load's ranks and whether enough saved
bytes are wanted by more than one of them (replicated state, HSDP replicas, neighbouring
shards of one resharded chunk) to be worth the exchange. Only then does the load's reading go
through the exchange (:mod:`exchange.reads`): when every rank asked for it, more than one rank
loads, and either that many bytes are shared or some rank cannot read some file itself
(node-local roots). A planner that drops the plans' storage data turns it off for every rank
alike.

The exchange costs every rank a gather of every rank's reads and a plan of them per round, and
the transfers: for a few replicated step counters and scalars beside sharded parameters that
is far more than each rank reading them again. So a load shares reads only when the bytes read
more than once (every read of a saved tensor chunk after its first reader's, counted from the
metadata's sizes and dtypes) reach ``min_bytes`` (``DataStatesReader(read_once_min_bytes=)``;
:data:`READ_ONCE_MIN_BYTES` by default). Python objects are not counted: their sizes are in the
rank files' indexes, not in the metadata the coordinator holds, and they are small.
"""

from __future__ import annotations

import dataclasses
import math
import threading

import torch.distributed as dist
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan

from dcp_datastates.exchange.channel import Channel
from dcp_datastates.exchange.reads import ReadSession
from dcp_datastates.format.checkpoint_layout import location_key


# Bytes read more than once below which a load reads without the exchange (see the module).
READ_ONCE_MIN_BYTES = 64 << 20


@dataclasses.dataclass(frozen=True)
class RankTag:
    """A rank's local plan: its global rank (its reader reads once)."""

    global_rank: int


@dataclasses.dataclass(frozen=True)
class LoadExchange:
    """The global plan of a read-once load: its ranks (global, in the load group's order) and
    whether some saved chunk is read by more than one of them."""

    members: tuple[int, ...]
    shared: bool


def tag_local_plan(plan: LoadPlan, read_once: bool) -> LoadPlan:
    if not read_once or not (dist.is_available() and dist.is_initialized()):
        return plan
    return dataclasses.replace(plan, storage_data=RankTag(dist.get_rank()))


def tag_global_plans(plans: list[LoadPlan], metadata, min_bytes: int) -> list[LoadPlan]:
    """The coordinator: every plan told the load's ranks and whether enough bytes are shared
    (no plan told anything unless every rank asked to read once). ``metadata``: the load's."""
    if len(plans) < 2 or not all(isinstance(p.storage_data, RankTag) for p in plans):
        return [dataclasses.replace(p, storage_data=None) for p in plans]
    info = LoadExchange(tuple(p.storage_data.global_rank for p in plans), _shared(plans, metadata, min_bytes))
    return [dataclasses.replace(p, storage_data=info) for p in plans]


def _shared(plans: list[LoadPlan], metadata, min_bytes: int) -> bool:
    """Whether some saved chunk (or object) is read by more than one plan, and the tensor bytes
    read after a chunk's first reader reach ``min_bytes``."""
    first: dict = {}
    described = metadata.state_dict_metadata
    itemsizes: dict = {}
    again = 0
    for rank, plan in enumerate(plans):
        for item in plan.items:
            index = item.storage_index
            if first.setdefault(location_key(index.fqn, index.offset), rank) == rank:
                continue
            if item.type == LoadItemType.TENSOR:
                itemsize = itemsizes.get(index.fqn)
                if itemsize is None:
                    md = described.get(index.fqn)  # a key it lacks fails in the read, by name
                    itemsize = itemsizes[index.fqn] = md.properties.dtype.itemsize if md is not None else 0
                again += math.prod(item.lengths) * itemsize
            if again >= min_bytes:
                return True
    return False


def session_for(plan: LoadPlan, channel: Channel | None, access, timeout_s: float, backend: str) -> ReadSession | None:
    """The read-once session of this rank's load, or None (each rank reads what it needs).
    ``channel``: the exchange a manager gave its reader (its ranks must be the load's); without
    one, the job's own (made on first use: every rank of the job must be loading then)."""
    info = plan.storage_data
    if not isinstance(info, LoadExchange) or len(info.members) < 2 or not (info.shared or access is not None):
        return None
    if channel is None:
        if list(info.members) != list(range(dist.get_world_size())):
            return None  # a load on part of the job: its group of its own is not known here
        channel = world_channel(timeout_s, backend)
    if sorted(channel.ranks) != sorted(info.members):
        return None
    return ReadSession(channel, access)


_world: dict = {}
_world_lock = threading.Lock()


def world_channel(timeout_s: float, backend: str) -> Channel:
    """The exchange over every rank of the job for readers no manager gave one: made once per
    process group and setting (a collective: every rank reaches it in its first such load)."""
    key = (id(dist.group.WORLD), float(timeout_s), backend)
    with _world_lock:
        channel = _world.get(key)
        if channel is None:
            _world.clear()  # channels of a process group destroyed since
            channel = _world[key] = Channel.create(backend=backend, timeout_s=timeout_s, desc="read-once loads")
        return channel
