"""Durable file operations for the commit protocol.

A checkpoint is committed by the appearance of ``.metadata``. Everything it
refers to must be on disk before that name exists, so the order is: data and
index files fsynced (by each rank), the directory fsynced (their names are
durable), the metadata written to a temporary name and fsynced, renamed into
place, and the directory fsynced again (the rename is durable).

Each operation passes through the engine's fault-injection rules (armed only
by tests, see :mod:`native.faults`), so crash and disk-full tests reach every step.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os

from dcp_datastates.errors import CheckpointError, CheckpointExistsError
from dcp_datastates.format.metadata_file import read_metadata_file
from dcp_datastates.format.rank_index import METADATA_FILE, CheckpointLayout, metadata_tmp_name
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


# -- committing a save ---------------------------------------------------------------


def refuse_committed(path: str) -> None:
    """Raise :class:`CheckpointExistsError` if ``path`` holds a committed checkpoint."""
    if os.path.exists(os.path.join(path, METADATA_FILE)):
        raise CheckpointExistsError(
            f"{path} already holds a committed checkpoint (.metadata exists), and DataStatesWriter does "
            "not save over one unless asked. DCP's FileSystemWriter replaces it by default (its "
            f"overwrite=True); to do the same, pass DataStatesWriter({path!r}, overwrite=True): the old "
            "checkpoint stays loadable until the new one commits, and its files are removed then"
        )


def write_metadata_tmp(path: str, save_id: str, blob: bytes) -> str:
    """Write a save's encoded ``.metadata`` durably under its temporary name; returns that path."""
    tmp = os.path.join(path, metadata_tmp_name(save_id))
    write_new_file_durably(tmp, blob)
    return tmp


def commit_metadata(path: str, tmp: str, overwrite: bool) -> None:
    """Rename a save's temporary metadata to ``.metadata``: the commit.

    Without ``overwrite`` the rename never replaces a ``.metadata`` that
    appeared since the save began (another save into the same directory,
    in this process or another, committed first): exactly one of two racing
    saves commits, and the other fails with :class:`CheckpointExistsError`
    (its caller removes its files).
    """
    final = os.path.join(path, METADATA_FILE)
    if overwrite:
        rename_into_place(tmp, final, path)
        return
    try:
        rename_without_replacing(tmp, final, path)
    except FileExistsError:
        raise CheckpointExistsError(
            f"{path}: another save committed a checkpoint there while this one was writing; "
            "this save was not committed and its files were removed (pass "
            "DataStatesWriter(..., overwrite=True) to replace a committed checkpoint instead)"
        ) from None


def renamed_into_place(path: str, tmp: str | None) -> bool:
    """Whether a save's temporary metadata ``tmp`` has already become ``.metadata`` (committed).

    The link-then-unlink commit (filesystems without RENAME_NOREPLACE) may be
    interrupted between its two steps: both names then exist and are one file.
    """
    if tmp is None:
        return False
    final = os.path.join(path, METADATA_FILE)
    try:
        if os.path.exists(tmp):
            return os.path.samefile(tmp, final)
    except FileNotFoundError:
        return False
    return os.path.exists(final)


def files_of_committed(path: str) -> list[str]:
    """Our rank files named by the committed checkpoint in ``path`` (to remove once replaced).

    Read in safe mode (never runs code); a checkpoint that is not ours, or
    unreadable or damaged, names nothing: nothing is removed.
    """
    md_path = os.path.join(path, METADATA_FILE)
    try:
        metadata, _ = read_metadata_file(md_path)
        layout = getattr(metadata, "storage_data", None)
        if not isinstance(layout, CheckpointLayout):
            return []
        layout.validate(md_path)  # only our own rank-file names, never a path out of the directory
    except Exception:  # noqa: BLE001 - not ours, unreadable or damaged: remove nothing
        return []
    return [name for r in layout.ranks for name in (r.data_file, r.index_file)]


def make_durable_after_commit(path: str, stale: list[str]) -> None:
    """After the rename: fsync the directory (the commit is durable), then remove ``stale`` files
    (those of a checkpoint this one replaced) and fsync again.

    The checkpoint is committed already, so a failure here must not remove
    anything of it: it is reported as what it is.
    """
    try:
        fsync_dir(path)
        if stale:
            remove_if_present(stale)
            fsync_dir(path)
    except OSError as exc:
        raise CheckpointError(
            f"{path} is committed (.metadata is in place), but making that durable failed: "
            f"{exc}; it may not survive a power loss, and files of the checkpoint it replaced may remain"
        ) from exc
