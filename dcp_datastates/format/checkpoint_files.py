"""Reading a checkpoint's small files (index, metadata) without trusting the directory.

A checkpoint may come from someone else. Its files must be regular files:
a symlink (to another file, or to /dev/zero), a FIFO or a device in its
place is refused with an error naming it, instead of being followed, read
forever, or blocked on. At most the file's size at open time is read.

Nor is a file's size trusted: a 1 GiB file in place of ``.metadata`` or of a
rank index must be refused without 1 GiB of memory. :class:`CheckpointFile`
gives the readers what they need for that: the size, small reads at given
offsets (a header, a trailer), a CRC-32C streamed in blocks of
``READ_BLOCK_BYTES`` (a checksum is verified before the file is held in
memory), and one read of the whole file into one preallocated buffer (its
size once, never chunks and a join). :func:`read_rank_index` is the one
function that reads a rank index: it refuses it by its header (counts that
do not match the file's size, or exceed what the layout and the data file
can hold) and by its checksum before reading it whole.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat

from dcp_datastates.native.engine import crc32c
from dcp_datastates.errors import CorruptCheckpointError
from dcp_datastates.format.rank_index import INDEX_HEADER, INDEX_TRAILER, IndexLimits, RankIndex, check_index_header, decode_index


READ_BLOCK_BYTES = 1 << 20  # the buffer a streamed checksum reads through


class CheckpointFile:
    """An open regular file of a checkpoint, for bounded reads (use :func:`open_checkpoint_file`)."""

    def __init__(self, path: str, fd: int, size: int) -> None:
        self.path, self.fd, self.size = path, fd, size

    def __enter__(self) -> CheckpointFile:
        return self

    def __exit__(self, *exc) -> None:
        os.close(self.fd)

    def _shrank(self, offset: int, got: int, want: int) -> CorruptCheckpointError:
        return CorruptCheckpointError(
            f"{self.path} is corrupt: it shrank while it was read ({got} of {want} bytes at offset {offset})"
        )

    def pread(self, nbytes: int, offset: int) -> bytes:
        """Exactly ``nbytes`` at ``offset`` (small reads: a header, a trailer)."""
        out = os.pread(self.fd, nbytes, offset)
        while len(out) < nbytes:
            more = os.pread(self.fd, nbytes - len(out), offset + len(out))
            if not more:
                raise self._shrank(offset, len(out), nbytes)
            out += more
        return out

    def _read_into(self, view: memoryview, offset: int) -> None:
        done = 0
        while done < len(view):
            n = os.preadv(self.fd, [view[done:]], offset + done)
            if n == 0:
                raise self._shrank(offset, done, len(view))
            done += n

    def crc32c(self, start: int, end: int, crc: int = 0) -> int:
        """CRC-32C of bytes ``[start, end)``, extending ``crc``, read through one small buffer."""
        buf = memoryview(bytearray(min(READ_BLOCK_BYTES, max(end - start, 0))))
        pos = start
        while pos < end:
            view = buf[: min(len(buf), end - pos)]
            self._read_into(view, pos)
            crc = crc32c(view, crc)
            pos += len(view)
        return crc

    def read(self, nbytes: int, offset: int = 0) -> bytearray:
        """``nbytes`` at ``offset`` in one buffer allocated once (memory: ``nbytes``, not twice)."""
        buf = bytearray(nbytes)
        self._read_into(memoryview(buf), offset)
        return buf


def open_checkpoint_file(path: str) -> CheckpointFile:
    """Open the regular file ``path`` (FileNotFoundError if it does not exist; a symlink, FIFO or
    device is a :class:`CorruptCheckpointError`). Use as a context manager: it closes the file."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise CorruptCheckpointError(
                f"{path} is a symbolic link; checkpoint files must be regular files"
            ) from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CorruptCheckpointError(f"{path} is not a regular file; checkpoint files must be regular files")
    except BaseException:
        os.close(fd)
        raise
    return CheckpointFile(path, fd, st.st_size)


def opened(path_or_file):
    """A context of the checkpoint file to read: ``path_or_file`` opened (a local path, closed at
    the end), or the opened file of any store it already is (``storage.Store.open_file``; left
    open for its owner). The one way every reader here takes either."""
    if isinstance(path_or_file, (str, os.PathLike)):
        return open_checkpoint_file(os.fspath(path_or_file))
    return contextlib.nullcontext(path_or_file)


def read_rank_index(index_path, limits: IndexLimits) -> RankIndex:
    """Read and validate the rank index at ``index_path`` (a local path, or an opened file of any
    store: ``storage.Store.open_file``), refusing a hostile one in bounded memory.

    In order, before the file is held in memory: its 56-byte header must
    describe a file of exactly its size, with counts within ``limits`` (see
    :func:`format.check_index_header`); then its CRC-32C is streamed through
    a ``READ_BLOCK_BYTES`` buffer. Only then is it read whole, once, and
    decoded. Memory for a refused file: the header and one block.
    """
    with opened(index_path) as f:
        index_path = f.path
        if f.size < INDEX_HEADER.size + INDEX_TRAILER.size:
            raise CorruptCheckpointError(f"rank index {index_path} is corrupt: {f.size} bytes is shorter than the header")
        header = INDEX_HEADER.unpack(f.pread(INDEX_HEADER.size, 0))
        check_index_header(header, f.size, index_path, limits)
        body = f.size - INDEX_TRAILER.size
        (stored,) = INDEX_TRAILER.unpack(f.pread(INDEX_TRAILER.size, body))
        actual = f.crc32c(0, body)
        if actual != stored:
            raise CorruptCheckpointError(
                f"rank index {index_path} is corrupt: index checksum {actual:08x} does not match stored {stored:08x}"
            )
        blob = f.read(f.size)
    return decode_index(blob, index_path, limits)
