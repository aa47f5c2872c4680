"""A durable tier on a (shared) file system: a directory tree, files renamed into place.

Each object is written to a temporary name in its directory, fsynced, and
renamed to its key without replacing an existing file (``replace_bytes``
alone replaces, for the mirrored pointer); then the directory is fsynced. A crash leaves a temporary file (``.<name>.part-<pid>``) that
:meth:`PosixStore.list` does not report and :meth:`PosixStore.sweep_partials`
removes, never a short file under a key.
"""

from __future__ import annotations

import errno
import os

from dcp_datastates.core import durable
from dcp_datastates.tiers.store import DurableStore, Progress, StoreError, check_key

_PART_MARK = ".part-"


def _is_partial(name: str) -> bool:
    return name.startswith(".") and _PART_MARK in name


_DIR_RACE_RETRIES = 5


class PosixStore(DurableStore):
    def __init__(self, root: str) -> None:
        self.url = os.path.abspath(root)
        self.root = self.url

    def _path(self, key: str) -> str:
        return os.path.join(self.root, *check_key(key).split("/"))

    def _dir(self, prefix: str) -> str:
        """The directory a key prefix (``""`` or ending in ``/``) names."""
        return os.path.join(self.root, *prefix.rstrip("/").split("/")) if prefix else self.root

    def _tmp(self, path: str) -> str:
        head, name = os.path.split(path)
        return os.path.join(head, f".{name}{_PART_MARK}{os.getpid()}")

    def _publish(self, tmp: str, path: str, key: str) -> None:
        directory = os.path.dirname(path)
        try:
            durable.rename_without_replacing(tmp, path, directory)
            durable.fsync_dir(directory)
        except FileExistsError as exc:
            durable.remove_if_present([tmp])
            raise StoreError(f"{self.where(key)}: already exists (a durable object is never replaced)") from exc
        except OSError as exc:
            raise StoreError(f"publishing {self.where(key)}: {exc.strerror or exc}") from exc

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
            durable.fsync_dir(os.path.dirname(d))

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

    def put_stream(self, key: str, blocks, size: int, progress: Progress | None = None) -> None:
        path = self._path(key)
        tmp = self._tmp(path)
        total = 0
        try:
            durable.remove_if_present([tmp])
            with self._in_dir(os.path.dirname(path), lambda: open(tmp, "xb", buffering=0)) as dst:
                for data in blocks:
                    view = memoryview(data)
                    done = 0
                    while done < len(view):
                        done += dst.write(view[done:])
                    total += len(view)
                    if progress is not None:
                        progress(len(view))
                os.fsync(dst.fileno())
        except OSError as exc:
            durable.remove_if_present([tmp])
            if isinstance(exc, StoreError):
                raise
            raise StoreError(f"writing {self.where(key)}: {exc.strerror or exc}") from exc
        except BaseException:
            durable.remove_if_present([tmp])
            raise
        if total != size:
            durable.remove_if_present([tmp])
            raise StoreError(f"writing {self.where(key)}: {total} bytes came, {size} were announced")
        self._publish(tmp, path, key)

    def put_bytes(self, key: str, data: bytes) -> None:
        path = self._path(key)
        tmp = self._tmp(path)
        try:
            durable.remove_if_present([tmp])
            self._in_dir(os.path.dirname(path), lambda: durable.write_new_file_durably(tmp, data))
        except OSError as exc:
            durable.remove_if_present([tmp])
            raise StoreError(f"writing {self.where(key)}: {exc.strerror or exc}") from exc
        self._publish(tmp, path, key)

    def replace_bytes(self, key: str, data: bytes) -> None:
        path = self._path(key)
        tmp = self._tmp(path)
        directory = os.path.dirname(path)
        try:
            durable.remove_if_present([tmp])
            self._in_dir(directory, lambda: durable.write_new_file_durably(tmp, data))
            durable.rename_into_place(tmp, path, directory)
            durable.fsync_dir(directory)
        except OSError as exc:
            durable.remove_if_present([tmp])
            raise StoreError(f"writing {self.where(key)}: {exc.strerror or exc}") from exc

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
                    raise StoreError(
                        f"{self.where(key)}: {length} bytes asked at offset {offset}, the object ends at {offset + got}"
                    )
                got += n
        except OSError as exc:
            if isinstance(exc, StoreError):
                raise
            raise StoreError(f"reading {self.where(key)} at {offset}: {exc.strerror or exc}") from exc
        finally:
            os.close(fd)

    def size(self, key: str) -> int | None:
        try:
            return os.stat(self._path(key)).st_size
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise StoreError(f"{self.where(key)}: {exc.strerror or exc}") from exc

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
        dirs = set()
        for key in keys:
            path = self._path(key)
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
            except OSError as exc:
                raise StoreError(f"deleting {self.where(key)}: {exc.strerror or exc}") from exc
            dirs.add(os.path.dirname(path))
        for d in sorted(dirs, key=len, reverse=True):  # an emptied step directory goes too
            try:
                os.rmdir(d)
            except OSError as exc:
                if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOENT, errno.EBUSY):
                    raise StoreError(f"removing {d}: {exc.strerror or exc}") from exc

    def sweep_partials(self, prefix: str = "") -> list[str]:
        """Remove the temporary files of copies a crash interrupted; return their paths."""
        base = self._dir(prefix)
        removed = []
        for dirpath, _dirs, filenames in os.walk(base):
            for name in filenames:
                if _is_partial(name):
                    removed.append(os.path.join(dirpath, name))
        durable.remove_if_present(removed)
        return removed


def _raise(exc: OSError) -> None:
    raise exc
