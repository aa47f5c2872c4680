"""Writing a tool's output so that it is never seen half-written.

``convert`` and ``export`` build their output under a temporary name next to
OUT and only then move it into place. A failure or an interrupt (Ctrl-C, and
SIGTERM or SIGHUP, which :func:`signals_interrupt` turns into one) therefore
leaves no OUT (the caller removes the temporary), and an existing OUT that
``--overwrite`` replaces is moved aside only once the new output is complete,
and is put back if the final rename fails.

Those temporaries have one form, ``.OUT.<what>-<12 hex digits>``
(:func:`temporary_path`), so that what a killed tool could not remove
(SIGKILL, a crash of the machine) is recognized: ``du`` reports it as a
partial output (:func:`partial_output_of`).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import threading
import uuid

from dcp_datastates.storage.fsync_files import fsync_dir
from dcp_datastates.storage.url import is_store_url


PARTIAL_KINDS = ("convert", "export", "replaced")  # an output being built, or an old one moved aside
_PARTIAL_RE = re.compile(r"^\.(?P<out>.+)\.(?:" + "|".join(PARTIAL_KINDS) + r")-[0-9a-f]{12}$")


def temporary_path(out: str, what: str) -> str:
    """A new hidden name beside ``out`` for the ``what`` (one of :data:`PARTIAL_KINDS`) of it:
    where a tool builds it, or moves the OUT it replaces aside."""
    if what not in PARTIAL_KINDS:
        raise ValueError(f"unknown temporary kind {what!r}; one of {', '.join(PARTIAL_KINDS)}")
    return os.path.join(os.path.dirname(out), f".{os.path.basename(out)}.{what}-{uuid.uuid4().hex[:12]}")


def partial_output_of(name: str) -> str | None:
    """The OUT whose temporary (:func:`temporary_path`) the file or directory ``name`` is, else None."""
    m = _PARTIAL_RE.match(name)
    return m.group("out") if m else None


@contextlib.contextmanager
def signals_interrupt():
    """SIGTERM (a scheduler's kill) and SIGHUP (the terminal closed) unwind like Ctrl-C, so
    the temporary output is removed. Only in the main thread, where signals are delivered;
    the previous handlers are restored at the end."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise KeyboardInterrupt

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def check_output_apart(out: str, sources: list[str]) -> None:
    """Refuse an output path that is, contains, or lies inside a checkpoint being read.

    Paths are compared resolved (symbolic links followed), so ``--overwrite``
    can never replace a source or a file inside one (``CKPT/.metadata``).
    """
    target = os.path.realpath(out)
    for src in sources:
        if is_store_url(src):
            continue  # in object storage: no local output can overlap it
        real = os.path.realpath(src)
        if target == real or target.startswith(real.rstrip(os.sep) + os.sep) or real.startswith(target.rstrip(os.sep) + os.sep):
            raise ValueError(f"{out}: the output would overlap the checkpoint {src} being read; choose another output")


@contextlib.contextmanager
def naming_output_errors(tmp: str, out: str):
    """Give an OSError raised without a file name while the output is written (Python's
    ``write`` and ``os.fsync`` on a full disk: a bare "[Errno 28] No space left on
    device") the file it was about: the temporary ``tmp`` being built for ``out``."""
    try:
        yield
    except OSError as exc:
        if exc.filename is not None:
            raise
        raise OSError(exc.errno, f"writing {out} (built as {tmp}) failed: {exc.strerror or exc}", tmp) from exc


def remove_output(path: str) -> None:
    """Delete a file or directory tree the tool created, if it is there (never through a link)."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def move_into_place(tmp: str, out: str, overwrite: bool) -> None:
    """Rename the finished ``tmp`` to ``out``; an existing ``out`` is replaced only with ``overwrite``.

    A file over a file is one atomic ``rename``. Otherwise the old ``out`` is
    renamed aside, the new one renamed in (the old one restored if that
    fails), and the old one deleted. The parent directory is fsynced.
    """
    parent = os.path.dirname(out)
    if not os.path.lexists(out):
        os.rename(tmp, out)
    elif not overwrite:
        raise FileExistsError(f"{out} appeared while writing it; pass --overwrite to replace it")
    elif os.path.isfile(tmp) and os.path.isfile(out) and not os.path.islink(out):
        os.replace(tmp, out)  # atomic: readers see the old file or the new one
    else:
        old = temporary_path(out, "replaced")
        with _signals_held():  # an interrupt between the two renames would leave no OUT
            os.rename(out, old)
            try:
                os.rename(tmp, out)
            except BaseException:
                os.rename(old, out)
                raise
        fsync_dir(parent)
        remove_output(old)
    fsync_dir(parent)


@contextlib.contextmanager
def _signals_held():
    """Hold SIGINT, SIGTERM and SIGHUP for this thread until the block ends (then they arrive)."""
    held = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
