"""The CLI's view of a run's root in object storage (``s3://bucket/prefix``): the steps there,
their state and size, without copying anything to the local disk. A checkpoint there is verified
by :func:`core.verify.verify` itself, through the store, with every check it makes locally.
"""

from __future__ import annotations

import dataclasses

from dcp_datastates.core.reader import DataStatesReader
from dcp_datastates.core.verify import verify
from dcp_datastates.format.file_names import METADATA_FILE
from dcp_datastates.manager.checkpoint_root import step_of
from dcp_datastates.storage import Store, open_store
from dcp_datastates.storage.url import split_parent
from dcp_datastates.tiers.drain import CONFIRM_DIR, keys_by_step

COMMITTED, INCOMPLETE, DRAINING = "committed", "incomplete", "draining"


@dataclasses.dataclass
class DurableStep:
    step: int
    name: str
    state: str  # committed, incomplete (no .metadata), draining (confirmations present, no .metadata)
    objects: int
    bytes: int


def split_step_url(url: str) -> tuple[str, str | None]:
    """``(root URL, step directory or None)``: ``s3://b/run/step_00000010`` -> ``(s3://b/run, step_00000010)``."""
    root, name = split_parent(url)
    if step_of(name) is not None:
        return root, name
    return url.rstrip("/"), None


def list_durable(store: Store) -> list[DurableStep]:
    """Every step under the store's root, with its state and size (one listing, plus sizes)."""
    out = []
    for step, (name, rests) in sorted(keys_by_step(store).items()):
        if METADATA_FILE in rests:
            state = COMMITTED
        elif any(r.startswith(CONFIRM_DIR + "/") for r in rests):
            state = DRAINING
        else:
            state = INCOMPLETE
        size = sum(store.size(f"{name}/{r}") or 0 for r in rests)
        out.append(DurableStep(step, name, state, len(rests), size))
    return out


def verify_url(url: str, allow_pickle: bool = False, digests: bool = False) -> list[tuple[bool, str]]:
    """``(ok, text)`` for a step URL, or for every committed step under a root URL."""
    root, step_dir = split_step_url(url)
    store = open_store(root)
    try:
        dirs = [step_dir] if step_dir else [s.name for s in list_durable(store) if s.state == COMMITTED]
        if not dirs:
            return [(False, f"NOT FOUND: {url}: no committed checkpoint there")]
        out = []
        for d in dirs:
            reader = DataStatesReader(d, store=store, allow_pickle=allow_pickle)
            report = verify(d, reader=reader, digests=digests)
            out.append((report.ok, report.summary()))
        return out
    finally:
        store.close()
