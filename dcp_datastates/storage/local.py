"""A store on a file system: a directory tree (a checkpoint's own directory, a run's root, a
durable tier on a shared file system), files renamed into place.

Loads read through the engine: :meth:`LocalStore.read_batch` hands every range
to its I/O threads, which read in parallel without the GIL and verify each
range against its checksum segments natively. Only regular files are objects:
a symbolic link, FIFO or device under a checkpoint's name is refused, never
followed or blocked on (a checkpoint may come from someone else).

Each object written is written to a temporary name in its directory, fsynced, and
renamed to its key without replacing an existing file (``replace_bytes`` and a
``publish(replace=True)`` alone replace: the mirrored pointer, an overwriting
save's commit); then the directory is fsynced. A crash leaves a temporary file
(``.<name>.part-<pid>``) that :meth:`LocalStore.list` does not report and
:meth:`LocalStore.sweep_partials` removes, never a short file under a key. The
exception is an engine write (:meth:`LocalStore.start_write`): a save's rank
files are written in place, under names of that save's own, which only its
``.metadata``, written last, makes part of a checkpoint.
"""

from __future__ import annotations

import errno
import os
import shutil
import stat

from dcp_datastates.storage import fsync_files
from dcp_datastates.errors import CheckpointError, CorruptCheckpointError
from dcp_datastates.format.checkpoint_files import CheckpointFile, open_checkpoint_file
from dcp_datastates.format.file_names import METADATA_FILE
from dcp_datastates.native import engine as _native
from dcp_datastates.storage.store import ObjectExistsError, Progress, RangeRead, ShortObjectError, Store, StoreError, check_key, holds_bytes, is_committed

_PART_MARK = ".part-"


def _is_partial(name: str) -> bool:
    return name.startswith(".") and _PART_MARK in name


_DIR_RACE_RETRIES = 5


def is_committed_directory(path: str) -> bool:
    """:func:`storage.is_committed` of the checkpoint directory ``path``: its ``.metadata`` is a
    regular file (a link or anything else under that name is refused: CorruptCheckpointError)."""
    return is_committed(LocalStore(path))


class LocalStore(Store):
    is_file_system = True

    def __init__(self, root: str, *, io_threads: int = _native.DEFAULT_READ_THREADS,
                 window_bytes: int = _native.DEFAULT_WINDOW_BYTES) -> None:
        self.url = os.path.abspath(root)
        self.root = self.url
        self._engine_settings = (2 * window_bytes, io_threads, window_bytes)  # reads go straight into place
        self._engine_ref: _native.ProcessEngine | None = None

    @property
    def engine(self):
        """This process's engine for the store's read settings (made at the first read)."""
        if self._engine_ref is None:
            self._engine_ref = _native.ProcessEngine(*self._engine_settings)
        return self._engine_ref.get()

    def _path(self, key: str) -> str:
        return os.path.join(self.root, *check_key(key).split("/"))

    def _dir(self, prefix: str) -> str:
        """The directory a key prefix (``""``: the root; with or without its ``/``) names."""
        return os.path.join(self.root, *prefix.rstrip("/").split("/")) if prefix else self.root

    def _tmp(self, path: str) -> str:
        head, name = os.path.split(path)
        return os.path.join(head, f".{name}{_PART_MARK}{os.getpid()}")

    def _make_dirs(self, directory: str) -> None:
        """Create ``directory`` and its missing parents, each new entry fsynced in its parent."""
        missing = []
        d = directory
        while not os.path.isdir(d):
            missing.append(d)
            d = os.path.dirname(d)
        for d in reversed(missing):
            try:
                os.mkdir(d)
            except FileExistsError:
                pass
            fsync_files.fsync_dir(os.path.dirname(d))

    def _in_dir(self, directory: str, create):
        """``create()`` a file in ``directory`` (made if missing). Another rank's drain may remove
        the step directory while it is empty (``delete`` takes an emptied one away) between the
        mkdir and the create: the directory is made again, a few times."""
        for attempt in range(_DIR_RACE_RETRIES):
            self._make_dirs(directory)
            try:
                return create()
            except FileNotFoundError:
                if attempt == _DIR_RACE_RETRIES - 1:
                    raise

    def make_prefix(self, prefix: str) -> None:
        try:
            self._make_dirs(self._dir(prefix))
        except OSError as exc:
            raise _failed(f"creating {self.where(prefix)}", exc, self._dir(prefix)) from exc

    def free_space(self, prefix: str) -> int | None:
        st = os.statvfs(self._dir(prefix))
        return st.f_bavail * st.f_frsize

    def open_staged(self, key: str, staging_key: str | None = None) -> StagedFile:
        """A file written in pieces as they come (a copy from another rank, a fetch), visible
        under ``key`` only once :meth:`StagedFile.publish` renamed it into place. Written under
        ``staging_key`` (default ``.<name>.part-<pid>``, which listings skip)."""
        path = self._path(key)
        tmp = self._path(staging_key) if staging_key else self._tmp(path)
        try:
            fsync_files.remove_if_present([tmp])
            fd = self._in_dir(os.path.dirname(path),
                              lambda: os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644))
        except OSError as exc:
            raise _failed(f"writing {self.where(key)}", exc, tmp) from exc
        return StagedFile(self, key, path, tmp, fd)

    def stage_bytes(self, key: str, data: bytes, staging_key: str | None = None) -> StagedFile:
        """:meth:`Store.stage_bytes`: ``data`` written and fsynced under ``staging_key`` now (a
        durable write, through the fault-injection points: crash and disk-full tests reach it)."""
        path = self._path(key)
        tmp = self._path(staging_key) if staging_key else self._tmp(path)
        try:
            fsync_files.remove_if_present([tmp])
            self._in_dir(os.path.dirname(path), lambda: fsync_files.write_new_file_durably(tmp, data))
        except OSError as exc:
            raise _failed(f"writing {self.where(key)}", exc, tmp) from exc
        staged = StagedFile(self, key, path, tmp, None)
        staged.data = data
        return staged

    def put_in_place(self, key: str, data: bytes) -> None:
        path = self._path(key)
        try:
            self._in_dir(os.path.dirname(path), lambda: fsync_files.write_new_file_durably(path, data))
        except OSError as exc:
            raise _failed(f"writing {self.where(key)}", exc, path) from exc

    def put_stream(self, key: str, blocks, size: int | None, progress: Progress | None = None,
                   size_hint: int | None = None) -> None:
        staged = self.open_staged(key)
        try:
            for data in blocks:
                view = memoryview(data)
                staged.write(view)
                if progress is not None:
                    progress(len(view))
            if size is not None and staged.size != size:
                raise StoreError(f"writing {self.where(key)}: {staged.size} bytes came, {size} were announced")
            staged.publish()
        finally:
            staged.abandon()  # nothing, once published

    def put_bytes(self, key: str, data: bytes, replace: bool = False) -> None:
        """Staged, then renamed into place: never over a file unless ``replace``."""
        staged = self.stage_bytes(key, data)
        try:
            staged.publish(replace=replace)
        finally:
            staged.abandon()  # nothing, once published

    def put_new(self, key: str, data: bytes) -> None:
        self.put_bytes(key, data)  # never replaces: ObjectExistsError

    def replace_bytes(self, key: str, data: bytes) -> None:
        self.put_bytes(key, data, replace=True)

    def start_write(self, engine, key: str, regions, keep, **options):
        """An engine job writing the file of ``key`` (its directory exists)."""
        options.pop("verify", None)  # a file is fsynced, not read back
        return engine.write(self._path(key), regions, keep, **options)

    def read_range(self, key: str, offset: int, length: int) -> bytearray:
        out = bytearray(length)  # filled in place by preadv, outside the GIL: no copy under it
        self.read_into(key, offset, memoryview(out))
        return out

    def read_into(self, key: str, offset: int, out: memoryview) -> None:
        path = self._path(key)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError as exc:
            raise StoreError(f"{self.where(key)}: no such object") from exc
        except OSError as exc:
            raise StoreError(f"{self.where(key)}: {exc.strerror or exc}") from exc
        try:
            length = len(out)
            got = 0
            while got < length:
                n = os.preadv(fd, [out[got:]], offset + got)
                if n == 0:
                    raise ShortObjectError(
                        f"{self.where(key)}: {length} bytes asked at offset {offset}, the object ends at {offset + got}"
                    )
                got += n
        except OSError as exc:
            if isinstance(exc, StoreError):
                raise
            raise StoreError(f"reading {self.where(key)} at {offset}: {exc.strerror or exc}") from exc
        finally:
            os.close(fd)

    def _lstat(self, key: str) -> os.stat_result | None:
        """The file's status, None when there is none; anything but a regular file is refused."""
        path = self._path(key)
        try:
            st = os.lstat(path)
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as exc:
            raise StoreError(f"{self.where(key)}: {exc.strerror or exc}") from exc
        if not stat.S_ISREG(st.st_mode):
            what = "a symbolic link" if stat.S_ISLNK(st.st_mode) else "not a regular file"
            raise CorruptCheckpointError(f"{path} is {what}; checkpoint files must be regular files")
        return st

    def size(self, key: str) -> int | None:
        st = self._lstat(key)
        return None if st is None else st.st_size

    def identity(self, key: str):
        st = self._lstat(key)
        return None if st is None else (self._path(key), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)

    def delete_checkpoint(self, prefix: str) -> None:
        """:meth:`Store.delete_checkpoint` for a directory: ``.metadata`` removed and the directory
        fsynced first, then the whole directory and its parent's entry. Never through a symbolic
        link (a step directory linked from elsewhere is not this store's to delete)."""
        path = self._dir(f"{prefix}/")
        if os.path.islink(path):
            raise CheckpointError(f"{path} is a symbolic link; checkpoints are never deleted through a link")
        if not os.path.isdir(path):
            return  # already gone (another cleanup got there first)
        try:
            fsync_files.remove_if_present([os.path.join(path, METADATA_FILE)])
            fsync_files.fsync_dir(path)
            shutil.rmtree(path)
            fsync_files.fsync_dir(os.path.dirname(path))
        except OSError as exc:
            raise StoreError(f"deleting {path}: {exc.strerror or exc}") from exc

    def missing_prefix(self, prefix: str) -> bool:
        return not os.path.isdir(self._dir(prefix))

    def open_file(self, key: str) -> CheckpointFile:
        return open_checkpoint_file(self._path(key))

    def read_batch(self, reads: list[RangeRead], *, threads: int | None = None) -> list:
        """Every read on the engine's I/O threads, verified natively (``threads`` is the engine's)."""
        paths: list[str] = []
        files: dict[str, int] = {}
        requests = []
        for read in reads:
            i = files.get(read.key)
            if i is None:
                i = files[read.key] = len(paths)
                paths.append(self._path(read.key))
            requests.append(_engine_request(read, i, paths[i]))
        if not requests:
            return []
        return self.engine.read(paths, requests, []).wait()

    def list(self, prefix: str = "") -> list[str]:
        if prefix and not prefix.endswith("/"):
            raise ValueError(f"a list prefix ends with '/': {prefix!r}")
        base = self._dir(prefix)
        keys = []
        try:
            for dirpath, dirnames, filenames in os.walk(base, onerror=_raise):
                rel = os.path.relpath(dirpath, self.root)
                for name in filenames:
                    if not _is_partial(name):
                        keys.append(name if rel == "." else f"{rel.replace(os.sep, '/')}/{name}")
        except FileNotFoundError:
            return []
        except OSError as exc:
            raise StoreError(f"listing {self.where(prefix or '.')}: {exc.strerror or exc}") from exc
        return sorted(keys)

    def delete(self, keys: list[str]) -> None:
        dirs, removed_in = set(), set()
        for key in keys:
            path = self._path(key)
            dirs.add(os.path.dirname(path))
            try:
                os.unlink(path)
            except FileNotFoundError:
                continue
            except OSError as exc:
                raise StoreError(f"deleting {self.where(key)}: {exc.strerror or exc}") from exc
            removed_in.add(os.path.dirname(path))
        for d in sorted(dirs, key=len, reverse=True):  # an emptied step directory goes too, never the root
            try:
                if d != self.root:
                    os.rmdir(d)
                    continue
            except OSError as exc:
                if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOENT, errno.EBUSY):
                    raise StoreError(f"removing {d}: {exc.strerror or exc}") from exc
            if d not in removed_in:
                continue  # nothing was removed there: no removal to make durable
            try:
                fsync_files.fsync_dir(d)  # the removals are durable
            except FileNotFoundError:
                pass
            except OSError as exc:
                raise _failed(f"deleting under {d}", exc, d) from exc

    def sweep_partials(self, prefix: str = "") -> list[str]:
        """Remove the temporary files of copies a crash interrupted; return their paths."""
        base = self._dir(prefix)
        removed = []
        for dirpath, _dirs, filenames in os.walk(base):
            for name in filenames:
                if _is_partial(name):
                    removed.append(os.path.join(dirpath, name))
        fsync_files.remove_if_present(removed)
        return removed


class StagedFile:
    """A file of a :class:`LocalStore` being written under a temporary name: written to (in
    order, or at offsets from several threads), then fsynced and renamed into place by
    :meth:`publish`, or removed by :meth:`abandon`."""

    def __init__(self, store: LocalStore, key: str, path: str, tmp: str, fd: int | None) -> None:
        self.store, self.key, self.path, self.tmp, self._fd = store, key, path, tmp, fd
        self.size = 0
        self.data = None  # the bytes, when staged whole (stage_bytes): a retry is told by them
        self._refused = self._published = False

    def write(self, data) -> None:
        """Append ``data``."""
        view = memoryview(data).cast("B")
        self.write_at(self.size, view)

    def write_at(self, offset: int, data) -> None:
        """Write ``data`` at ``offset`` (safe from several threads, each its own range)."""
        view = memoryview(data).cast("B")
        done = 0
        try:
            while done < len(view):
                done += os.pwrite(self._fd, view[done:], offset + done)
        except OSError as exc:
            raise _failed(f"writing {self.store.where(self.key)} at offset {offset + done}", exc, self.tmp, offset + done) from exc
        self.size = max(self.size, offset + len(view))

    def sync(self) -> None:
        """fsync and close the file: what was written is durable under the temporary name."""
        if self._fd is None:
            return
        try:
            os.fsync(self._fd)
        except OSError as exc:
            raise _failed(f"writing {self.store.where(self.key)}: fsync", exc, self.tmp) from exc
        self._close()

    def publish(self, replace: bool = False) -> None:
        """Rename the file to its key once durable, then fsync the directory: never over another
        file (:class:`ObjectExistsError`) unless ``replace``; a file staged whole that finds its
        very bytes there is published already (a retried commit, as :class:`StagedBytes` tells)."""
        self.sync()
        directory = os.path.dirname(self.path)
        try:
            if replace:
                fsync_files.rename_into_place(self.tmp, self.path, directory)
            else:
                fsync_files.rename_without_replacing(self.tmp, self.path, directory)
        except FileExistsError as exc:
            if self.data is not None and self._holds_its_bytes():  # a retried commit, as StagedBytes tells one
                self.abandon()
                self._published = True
                return
            self._refused = True
            raise ObjectExistsError(f"{self.store.where(self.key)}: already exists (a committed file is never replaced)") from exc
        except OSError as exc:
            raise _failed(f"publishing {self.store.where(self.key)}", exc, self.path) from exc
        self._published = True
        try:
            fsync_files.fsync_dir(directory)
        except OSError as exc:
            raise _failed(f"publishing {self.store.where(self.key)}", exc, self.path) from exc
        self.tmp = None

    def _holds_its_bytes(self) -> bool:
        try:
            return holds_bytes(self.store, self.key, self.data)
        except (StoreError, CorruptCheckpointError):
            return False

    def landed(self) -> bool:
        """Whether the file is in place under its key: published, or a rename interrupted after
        its link (filesystems without RENAME_NOREPLACE link, then unlink: both names, one file)."""
        if self._published or self._refused:
            return self._published
        try:
            if self.tmp is not None and os.path.exists(self.tmp):
                return os.path.samefile(self.tmp, self.path)
        except FileNotFoundError:
            return False
        return os.path.exists(self.path)

    def abandon(self) -> None:
        """Remove what was written (nothing once published)."""
        self._close()
        if self.tmp is not None:
            fsync_files.remove_if_present([self.tmp])
            self.tmp = None

    def _close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _engine_request(read: RangeRead, file_index: int, path: str):
    if read.index is None and read.checks is None:  # the common unverified case, kept cheap (row-runs)
        return _native.ReadRequest(file_index=file_index, offset=read.offset, nbytes=read.nbytes, address=read.address)
    where = dict(file_index=file_index, offset=read.offset, nbytes=read.nbytes, address=read.address)
    if read.checks is not None:
        return _native.ReadRequest(**where, checks=_native.segment_checks(read.checks))
    # The engine takes the range's checks from the index's table: they must tile it, since
    # every stored byte has a segment (a gap: the index or the metadata is damaged).
    try:
        return _native.ReadRequest(**where, verify_with=read.index.segment_table(read.stripe))
    except ValueError:
        read.index.check_tiled(read.data_offset, read.nbytes, path, read.key)  # names the untiled bytes
        raise


def _failed(what: str, exc: OSError, path: str, offset: int | None = None) -> StoreError:
    """A write's :class:`StoreError` as the engine's write errors are: the errno (a full disk
    stays ENOSPC), the file (``.filename``: the one the error names, else ``path``, the name it
    is written under) and ``.offset``."""
    error = StoreError(exc.errno, f"{what}: {exc.strerror or exc}", exc.filename or path)
    error.offset = getattr(exc, "offset", -1) if offset is None else offset
    return error


def _raise(exc: OSError) -> None:
    raise exc
