"""The CLI's view of a durable tier (``s3://bucket/prefix``, or any store URL): ``ls``,
``verify`` and ``du`` without copying a checkpoint to the local disk first.

``verify`` reads each object through ranged reads in blocks: ``.metadata``
(checksum trailer, layout), every rank index (its checksum), then every data
file block by block against the index's CRC-32C segments, the same checks a
load makes, in memory bounded by a block.
"""

from __future__ import annotations

import dataclasses

from dcp_datastates.errors import CheckpointError
from dcp_datastates.format.file_names import METADATA_FILE
from dcp_datastates.manager.checkpoint_root import step_of
from dcp_datastates.tiers import DurableStore, StoreError, open_store
from dcp_datastates.tiers.drain import BLOCK_BYTES, CONFIRM_DIR, SegmentChecker, keys_by_step, step_prefix
from dcp_datastates.tiers.store import is_object_store_url
from dcp_datastates.tiers.store_reader import StoreReader, split_checkpoint_url

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
    if is_object_store_url(url):
        root, name = split_checkpoint_url(url)
        if step_of(name) is not None:
            return root, name
    return url.rstrip("/"), None


def list_durable(store: DurableStore) -> list[DurableStep]:
    """Every step under the store's root, with its state and size (one listing, plus sizes)."""
    out = []
    for step, (name, rests) in sorted(keys_by_step(store, step_of).items()):
        if METADATA_FILE in rests:
            state = COMMITTED
        elif any(r.startswith(CONFIRM_DIR + "/") for r in rests):
            state = DRAINING
        else:
            state = INCOMPLETE
        size = sum(store.size(f"{name}/{r}") or 0 for r in rests)
        out.append(DurableStep(step, name, state, len(rests), size))
    return out


@dataclasses.dataclass
class DurableVerifyReport:
    where: str
    committed: bool = False
    ranks: int = 0
    bytes_checked: int = 0
    problems: list[str] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)  # not faults of the checkpoint

    @property
    def ok(self) -> bool:
        return self.committed and not self.problems

    def summary(self) -> str:
        if self.ok:
            text = f"OK: {self.where}: {self.ranks} rank(s), {self.bytes_checked} bytes checked against their checksums"
            return text + "".join(f"\n  note: {n}" for n in self.notes)
        head = "NOT COMMITTED" if not self.committed else "CORRUPT"
        return f"{head}: {self.where}: " + "; ".join(self.problems[:5])


def verify_durable(store: DurableStore, step_dir: str, *, allow_pickle: bool = False, block: int = BLOCK_BYTES,
                   progress=None) -> DurableVerifyReport:
    """Check a durable copy (see the module docstring); never raises for a damaged copy. A
    :class:`StoreError` (the store did not answer) is raised: it says nothing about the copy."""
    where = store.where(step_dir)
    report = DurableVerifyReport(where)
    meta_key = f"{step_dir}/{METADATA_FILE}"
    # .metadata and the rank indexes get the checks a load makes (the reader's own code)
    reader = StoreReader(step_dir, store=store, allow_pickle=allow_pickle)
    try:
        if store.size(meta_key) is None:
            report.problems.append(f"no {METADATA_FILE}: not a committed checkpoint (an incomplete or draining copy)")
            return report
        report.committed = True
        layout = reader.load_metadata().storage_data
    except StoreError:
        raise  # the store failed to answer: nothing is known about the copy
    except CheckpointError as exc:  # stock DCP's metadata too: it has no checksums to verify
        report.problems.append(str(exc))
        return report
    report.ranks = len(layout.own_ranks)
    named = {METADATA_FILE}
    # Own ranks, then the base ranks an incremental copy refers to (their whole files, in the
    # base's directory under the same root: verify of the base checks them the same way).
    for files in layout.ranks:
        names = files.data_files()
        if not files.base:
            named.update((*names, files.index_file))
        try:
            index = reader.rank_index(files.data_path)
            for stripe, (name, size) in enumerate(zip(names, reader.data_file_sizes(files))):
                key = reader.key(files.path_of(name))
                checker = SegmentChecker(index, stripe, store.where(key), "the durable copy is damaged")
                for at, data in store.read_blocks(key, size, block):
                    checker.feed(memoryview(data), at)
                    report.bytes_checked += len(data)
                    if progress is not None:
                        progress(report.bytes_checked)
                checker.finish(size)
        except StoreError:
            raise
        except CheckpointError as exc:
            report.problems.append(str(exc))
    strays = [k for k in store.list(step_prefix(step_dir)) if k[len(step_prefix(step_dir)):] not in named
              and f"/{CONFIRM_DIR}/" not in k]
    if strays:
        report.notes.append(f"objects the checkpoint does not name (safe to delete): {', '.join(strays[:5])}")
    return report


def is_url(path: str) -> bool:
    """A durable tier's URL (``s3://...``) rather than a local path."""
    return is_object_store_url(path)


def verify_url(url: str, allow_pickle: bool = False) -> list[tuple[bool, str]]:
    """``(ok, text)`` for a step URL, or for every committed step under a root URL."""
    root, step_dir = split_step_url(url)
    store = open_store(root)
    dirs = [step_dir] if step_dir else [s.name for s in list_durable(store) if s.state == COMMITTED]
    if not dirs:
        return [(False, f"NOT FOUND: {url}: no committed checkpoint there")]
    out = []
    for d in dirs:
        report = verify_durable(store, d, allow_pickle=allow_pickle)
        out.append((report.ok, report.summary()))
    return out
