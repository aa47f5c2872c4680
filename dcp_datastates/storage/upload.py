"""An engine write job streamed into an object of a store, in bounded memory.

The engine stages and checksums the job's windows into its host pool as for
a file (``Engine.write(..., stream=True)``); instead of ``pwrite``, each
window is handed here in file order (``WriteJob.next_chunk``), copied out of
its pool slot into the store's upload (an S3 multipart upload: parts of
``part_bytes``, a few in flight), and its slot goes back to the pool when the
next one is taken. So host memory is the pool plus the upload's parts in
flight, whatever the rank's size, and a slow store slows the staging (the
back-pressure the pool gives a slow disk). The object holds exactly the bytes
the file would: the windows, zeros between them.

With ``verify`` the object is read back once complete and its CRC-32C compared
with the bytes sent (the bytes sent are the ones the engine checksummed into
the rank index): a store that kept other bytes fails the save, which then
never commits.
"""

from __future__ import annotations

import threading

from dcp_datastates.native import engine as _native
from dcp_datastates.storage.store import Store, StoreError

_ZEROS = bytes(1 << 20)


class _JobFailed(Exception):
    """Raised into the upload when the engine job failed or was cancelled: the upload is
    abandoned (never completed), and the job's error is the save's."""


def _caused_by_job(exc: BaseException) -> bool:
    """Whether ``exc`` (as the store raised it, perhaps wrapped) came from a failed job."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, _JobFailed):
            return True
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return False


class StreamUpload:
    """The engine job of one object (``store``'s ``key``), with the engine job's interface
    (``append``, ``seal``, ``wait``, ``cancel``, ...): ``wait`` returns once the object is
    complete in the store (and read back, with ``verify``)."""

    def __init__(self, store: Store, engine, key: str, regions, keep, *, verify: bool = True,
                 size_hint: int | None = None) -> None:
        self.store, self.key, self.verify = store, key, verify
        self.size = 0  # bytes sent
        self.crc = 0  # CRC-32C of the bytes sent
        self.size_hint = size_hint
        self.job = engine.write(store.where(key), regions, keep, stream=True)
        self._error: BaseException | None = None  # the upload's own failure (not the job's)
        self._cancelled: str | None = None
        self._thread = threading.Thread(target=self._upload, name="dcp_datastates-upload", daemon=True)
        self._thread.start()

    def _blocks(self):
        """The object's bytes: each window copied out of its slot (the next ``next_chunk`` gives
        the slot back), zeros where the file would have a gap."""
        while True:
            if self._cancelled is not None:  # never complete the object with what came so far
                raise _JobFailed(self._cancelled)
            try:
                chunk = self.job.next_chunk()
            except OSError as exc:  # the job failed (a copy, a cancel): not the upload
                raise _JobFailed(str(exc)) from exc
            if chunk is None:
                return
            offset, view = chunk
            while self.size < offset:
                zeros = memoryview(_ZEROS)[: min(len(_ZEROS), offset - self.size)]
                self.crc = _native.crc32c(zeros, self.crc)
                self.size += len(zeros)
                yield bytes(zeros)
            data = bytes(view)
            del view
            self.crc = _native.crc32c(data, self.crc)
            self.size += len(data)
            yield data

    def _upload(self) -> None:
        try:
            self.store.put_stream(self.key, self._blocks(), None, size_hint=self.size_hint)
            if self.verify:
                with self.store.open_file(self.key) as f:
                    if f.size != self.size:
                        raise StoreError(f"{self.store.where(self.key)}: {f.size} bytes stored, {self.size} sent")
                    got = f.crc32c(0, f.size)
                if got != self.crc:
                    raise StoreError(
                        f"{self.store.where(self.key)}: the object reads back with CRC-32C {got:08x}, "
                        f"the bytes sent have {self.crc:08x}", transient=False,
                    )
        except BaseException as exc:  # noqa: BLE001 - handed to wait(), in the save's thread
            if _caused_by_job(exc):
                return  # the job's own error is what wait() raises; the upload was abandoned
            if not isinstance(exc, OSError):  # a save's cleanup expects OSError from a job
                wrapped = StoreError(f"uploading {self.store.where(self.key)} failed: {type(exc).__name__}: {exc}")
                wrapped.__cause__ = exc
                exc = wrapped
            self._error = exc
            self.job.cancel(f"uploading {self.store.where(self.key)} failed: {exc}")

    # -- the engine job's interface ---------------------------------------------------

    @property
    def path(self) -> str:
        return self.job.path

    def append(self, regions, keep=()) -> None:
        self.job.append(regions, list(keep))

    def seal(self) -> None:
        self.job.seal()

    def wait_staged(self) -> bool:
        return self.job.wait_staged()

    def release_staged(self) -> bool:
        return self.job.release_staged()

    def cancel(self, why: str) -> None:
        self._cancelled = why
        self.job.cancel(why)

    @property
    def done(self) -> bool:
        return self.job.done and not self._thread.is_alive()

    @property
    def direct(self) -> bool:
        return False

    @property
    def borrows(self) -> bool:
        return False

    @property
    def windows_from_source(self) -> int:
        return 0

    def wait(self) -> list:
        """The job's checksum segments once the object is complete; the upload's error (a
        :class:`StoreError` naming the object) if the upload failed, else the job's own (a
        failed copy names its file offset, which the save turns into the key)."""
        try:
            segments = self.job.wait()
        except OSError:
            self._thread.join()
            if self._error is not None:  # the job was cancelled because the upload failed
                raise self._error from None
            raise
        self._thread.join()
        if self._error is not None:
            raise self._error
        return segments
