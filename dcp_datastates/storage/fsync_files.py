"""Durable file primitives: files created and fsynced, directories fsynced, renames that never replace.

A file is durable once its bytes and its name are: the file fsynced, then
its directory. Every checkpoint file, ``.metadata``, the manager's
``latest`` pointer and the tools' outputs go through these, and every error
names the file (Python's ``os.write`` and ``os.fsync`` raise without one).
Each operation also passes through the engine's fault-injection rules
(armed only by tests, see :mod:`native.faults`), so crash and disk-full
tests reach every step.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os

from dcp_datastates.native.faults import fault_point as _fault_point

_WRITE, _FSYNC, _RENAME = "write", "fsync", "rename"


def _named(exc: OSError, path: str, what: str, offset: int = -1, nbytes: int = 0) -> OSError:
    """``exc`` as the engine raises its I/O errors: the errno, what failed and where, the file
    (``.filename``) and ``.offset`` (-1: none). ``os.write`` and ``os.fsync`` raise without a
    file name: on a full disk the caller would read a bare "[Errno 28] No space left on device"."""
    where = f" at offset {offset} ({nbytes} bytes)" if offset >= 0 else ""
    named = OSError(exc.errno, f"{what} failed{where}: {exc.strerror or exc}", path)
    named.offset = offset
    return named


def fsync_dir(path: str) -> None:
    """fsync the directory ``path`` (its entries become durable); errors name it."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        _fault_point(_FSYNC, path)
        try:
            os.fsync(fd)
        except OSError as exc:
            raise _named(exc, path, "fsync of the directory") from None
    finally:
        os.close(fd)


def write_new_file_durably(path: str, data: bytes | memoryview) -> None:
    """Create ``path`` (it must not exist), write ``data`` and fsync it.

    On failure (a full disk, an I/O error) the partial file is removed, and
    the OSError names ``path`` (and the offset of a failed write).
    """
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        view = memoryview(data).cast("B")
        done = 0
        while done < len(view):
            want = _fault_point(_WRITE, path, done, len(view) - done)
            try:
                done += os.write(fd, view[done : done + want])
            except OSError as exc:
                raise _named(exc, path, "write", done, len(view) - done) from None
        _fault_point(_FSYNC, path)
        try:
            os.fsync(fd)
        except OSError as exc:
            raise _named(exc, path, "fsync") from None
    except BaseException:
        os.close(fd)
        remove_if_present([path])
        raise
    os.close(fd)


def rename_into_place(tmp_path: str, final_path: str, directory: str) -> None:
    """Atomically rename ``tmp_path`` to ``final_path`` once the directory's entries are durable.

    The caller fsyncs the directory again afterwards (the rename itself is
    durable then). Once the rename has happened the checkpoint is committed:
    an error after it must never remove the files ``final_path`` refers to.
    """
    fsync_dir(directory)
    _fault_point(_RENAME, final_path)
    os.replace(tmp_path, final_path)


def rename_without_replacing(tmp_path: str, final_path: str, directory: str) -> None:
    """Like :func:`rename_into_place`, but never replace an existing ``final_path``.

    Two saves may race into one directory; the commit is the step that
    decides which one wins, so it must be atomic with the check: exactly one
    rename succeeds and the other raises ``FileExistsError`` naming
    ``final_path`` (its temporary is left for the caller to remove). In order
    of preference:

    1. ``renameat2(RENAME_NOREPLACE)`` (Linux 3.15+: ext4, xfs, btrfs, tmpfs, ...);
    2. ``link()`` then ``unlink()`` of the temporary (filesystems without
       RENAME_NOREPLACE, such as many network filesystems: ``link`` fails
       with EEXIST atomically);
    3. under an exclusive ``flock`` of the directory, a check and a rename
       (filesystems that support neither; atomic against every writer of this
       package, which all commit through this function).
    """
    fsync_dir(directory)
    _fault_point(_RENAME, final_path)
    if _rename_noreplace(tmp_path, final_path):
        return
    try:
        os.link(tmp_path, final_path)
    except FileExistsError:
        raise _exists(final_path) from None
    except OSError as exc:
        if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK, errno.ENOSYS):
            raise
    else:
        os.unlink(tmp_path)
        return
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        if os.path.lexists(final_path):
            raise _exists(final_path)
        os.rename(tmp_path, final_path)
    finally:
        os.close(fd)  # releases the lock


def _exists(final_path: str) -> FileExistsError:
    return FileExistsError(errno.EEXIST, "another save committed first", final_path)


_RENAME_NOREPLACE = 1
_AT_FDCWD = -100
_renameat2 = None  # None: not looked up yet; False: this libc has none


def _rename_noreplace(src: str, dst: str) -> bool:
    """renameat2(RENAME_NOREPLACE); False where the libc or the filesystem lacks it."""
    global _renameat2
    if _renameat2 is None:
        try:
            fn = ctypes.CDLL(None, use_errno=True).renameat2
            fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
            fn.restype = ctypes.c_int
            _renameat2 = fn
        except (AttributeError, OSError):
            _renameat2 = False
    if _renameat2 is False:
        return False
    if _renameat2(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), _RENAME_NOREPLACE) == 0:
        return True
    err = ctypes.get_errno()
    if err == errno.EEXIST:
        raise _exists(dst)
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False  # the filesystem (or kernel) has no RENAME_NOREPLACE
    raise OSError(err, os.strerror(err), src, None, dst)


def remove_if_present(paths) -> None:
    """Unlink each of ``paths`` that exists (an error other than "not there" names its file)."""
    for p in paths:
        try:
            os.unlink(p)
        except FileNotFoundError:
            pass
