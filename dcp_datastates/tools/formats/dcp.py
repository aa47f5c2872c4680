"""``convert --to dcp``: DCP's stock ``FileSystemWriter`` format (one ``__0_0.distcp`` file plus ``.metadata``)."""

from __future__ import annotations

import os

from dcp_datastates.storage.fsync_files import fsync_dir
from dcp_datastates.errors import CheckpointError
from dcp_datastates.tools.checkpoint_view import CheckpointView
from dcp_datastates.tools.formats.dcp_save import dcp_save


def write(view, tmp: str, summary, tracker, _shard: int) -> None:
    from torch.distributed.checkpoint import FileSystemWriter

    os.mkdir(tmp)
    # One thread and no copy-ahead: the serial loader resolves a tensor only
    # after the previous one was written (what release_previous relies on).
    writer = FileSystemWriter(tmp, single_file_per_rank=True, thread_count=1, per_thread_copy_ahead=0, overwrite=False)
    dcp_save(view, writer, tracker, summary, release_previous=True)
    _check_output(view, tmp)
    fsync_dir(tmp)
    summary.files = sorted(os.listdir(tmp))


def _check_output(view, tmp: str) -> None:
    """Each tensor's record must hold at least its bytes: a guard for release_previous, which
    would otherwise turn a change in FileSystemWriter's loading order into silently empty records."""
    written = CheckpointView(tmp, allow_pickle=view.allow_pickle)
    for fqn in view.tensors:
        stored = written.stored_chunks(fqn)
        if sum(c.length for c in stored) < view.nbytes(fqn):
            raise CheckpointError(
                f"{tmp}: the record of {fqn!r} is shorter than its {view.nbytes(fqn)} bytes; this torch's "
                "FileSystemWriter resolves tensors ahead of writing them, which the converter does not support"
            )
