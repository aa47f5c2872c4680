"""``convert --to datastates``: our format, through :class:`DataStatesWriter` (a stock DCP checkpoint into ours)."""

from __future__ import annotations

import os

from dcp_datastates.tools.formats.dcp_save import dcp_save

# The writer's host cache: a few engine windows keep the disk busy; a bigger
# pool would only add resident memory.
HOST_CACHE_BYTES = 16 << 20


def write(view, tmp: str, summary, tracker, _shard: int) -> None:
    """Our format, through DataStatesWriter (which commits with its own fsyncs)."""
    from dcp_datastates.core.writer import DataStatesWriter

    with DataStatesWriter(tmp, host_cache_bytes=HOST_CACHE_BYTES) as writer:
        dcp_save(view, writer, tracker, summary, release_previous=False)
    summary.files = sorted(os.listdir(tmp))
