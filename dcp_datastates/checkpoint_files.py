"""Reading a checkpoint's small files (index, metadata) without trusting the directory.

A checkpoint may come from someone else. Its files must be regular files:
a symlink (to another file, or to /dev/zero), a FIFO or a device in its
place is refused with an error naming it, instead of being followed, read
forever, or blocked on. At most the file's size at open time is read.
"""

from __future__ import annotations

import errno
import os
import stat

from .errors import CorruptCheckpointError


def read_checkpoint_file(path: str) -> bytes:
    """The bytes of the regular file ``path``; FileNotFoundError if it does not exist."""
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
        chunks, left = [], st.st_size
        while left > 0:
            chunk = os.read(fd, min(left, 64 << 20))
            if not chunk:
                break  # shrank while we read: the decoders report the short file
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)
