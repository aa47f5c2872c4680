"""A rank's data written as stripes: one file and one engine job per stripe.

Buffered writes to one file serialize on its inode lock (tmpfs, ext4, xfs),
so threads writing one file do not add up (benchmarks/probe_file_writes.cc,
docs/benchmarks.md). A synchronous save therefore cuts a rank's data into
stripes at the starts of large tensors (:func:`placement.stripe_starts`;
offsets do not move) and writes each to its own file, while the engine keeps
each I/O thread on a file no other thread is writing. The rank's data stays one range of offsets: entries,
checksum segments and the object table all use it, and only the engine
sees per-file offsets. :class:`StripedWrite` is the one place that
translates; a rank of one file is a :class:`StripedWrite` of one job. The engine's errors
come back through here too, with the keys they concern (:func:`with_key_context`,
:func:`with_reserved_keys`).
"""

from __future__ import annotations

import bisect
import errno
from typing import Any, Callable

import numpy as np

from dcp_datastates.errors import CheckpointError
from dcp_datastates.format.checkpoint_layout import stripe_span
from dcp_datastates.format.rank_index import segment_record
from dcp_datastates.native import engine as _native


def _again(exc: OSError, message: str, offset: int | None) -> OSError:
    """``exc`` again with ``message``: its errno and file name, and the (data) ``offset``."""
    err = OSError(exc.errno, message, exc.filename)
    err.offset = offset
    return err


def with_key_context(exc: OSError, spans: list[tuple[int, int, str]]) -> OSError:
    """An engine error again, with the key stored at the failing offset in its message."""
    offset = getattr(exc, "offset", -1)
    key = None
    if offset is not None and offset >= 0:
        spans = sorted(spans)
        i = bisect.bisect_right([s[0] for s in spans], offset) - 1
        if i >= 0 and spans[i][0] <= offset < max(spans[i][1], spans[i][0] + 1):
            key = spans[i][2]
    what = f"writing {key!r}" if key else "writing checkpoint data"
    return _again(exc, f"{what} failed: {exc.strerror}", offset)


def with_reserved_keys(exc: OSError, keys: list[str]) -> OSError:
    """A failed start of a rank file's write again, with the keys whose bytes it was to hold: a
    file's space is reserved before any byte is written, so a full disk fails there, for the
    whole file rather than at one key's offset. A store's own error names its object already."""
    if isinstance(exc, CheckpointError) or not keys:
        return exc
    named = ", ".join(map(repr, keys[:3])) + (f" and {len(keys) - 3} more" if len(keys) > 3 else "")
    what = "the space" if exc.errno == errno.ENOSPC else "the file"
    return _again(exc, f"{exc.strerror or exc} ({what} of {named})", getattr(exc, "offset", None))


class StripedWrite:
    """The engine jobs of one rank's data files, addressed by data offset.

    ``bases[k]`` is the data offset where stripe ``k`` (``jobs[k]``) begins;
    ``bases[0] == 0``. Objects and compressed frames, appended once the
    tensors are placed, go to the last stripe (:attr:`tail`).
    """

    def __init__(self, jobs: list, bases: list[int]) -> None:
        self.jobs = jobs
        self.bases = bases

    @classmethod
    def of_job(cls, job) -> StripedWrite:
        return cls([job], [0])

    @classmethod
    def start(
        cls, engine, dest, names: list[str], bases: list[int], end: int, placed: list, finish: Callable,
        keys: Callable[[], list[str]] = list, **write_options: Any,
    ) -> StripedWrite:
        """Start one job per stripe file ``names[k]`` of the save's destination ``dest`` (a
        :mod:`destination`) with the ``placed`` sources that fall in it.

        ``placed``: ``(source, data offset)`` pairs; ``finish`` turns a list
        of ``(source, file offset)`` into ``(regions, keep)``
        (:func:`providers.finish_regions`); ``end``: the end of the placed
        tensors (each stripe is preallocated to its share); ``keys``: the
        rank's tensor keys, which a failure to reserve the space names. A
        failure to start any job stops those already started.
        """
        if len(names) > 1:  # each job reserves its own stripe only: together they must fit
            try:
                dest.check_free_space(max(end, bases[-1]))
            except OSError as exc:
                raise with_reserved_keys(exc, keys()) from exc
        per_stripe: list[list] = [[] for _ in names]
        starts = tuple(bases[1:])
        for source, offset in placed:
            k, base, _ = stripe_span(starts, offset)
            per_stripe[k].append((source, offset - base))
        ends = bases[1:] + [max(end, bases[-1])]
        jobs: list = []
        try:
            for name, stripe, base, stripe_end in zip(names, per_stripe, bases, ends):
                regions, keep = finish(stripe)
                stripe.clear()
                jobs.append(dest.start_write(engine, name, regions, keep, preallocate=stripe_end - base, **write_options))
                del regions, keep
        except BaseException as exc:
            for job in jobs:
                _native.stop_write_job(job, "starting another stripe of the rank failed")
            if isinstance(exc, OSError):
                raise with_reserved_keys(exc, keys()) from exc
            raise
        return cls(jobs, list(bases))

    @property
    def tail(self):
        """The job of the last stripe (objects and compressed frames are appended there)."""
        return self.jobs[-1]

    @property
    def tail_base(self) -> int:
        return self.bases[-1]

    def append(self, k: int, regions: list, keep: list) -> None:
        self.jobs[k].append(regions, keep)

    def seal(self) -> None:
        for job in self.jobs:
            job.seal()

    def release_staged(self) -> bool:
        """Every job's staged sources let go of; False if any failed (``wait`` raises its error)."""
        return all([job.release_staged() for job in self.jobs])

    @property
    def done(self) -> bool:
        return all(job.done for job in self.jobs)

    @property
    def direct(self) -> bool:
        return all(job.direct for job in self.jobs)

    @property
    def windows_from_source(self) -> int:
        return sum(job.windows_from_source for job in self.jobs)

    def cancel(self, why: str) -> None:
        """Cancel every stripe (:func:`engine.stop_write_job` takes a striped write too)."""
        for job in self.jobs:
            if not job.done:
                job.cancel(why)

    def wait(self) -> np.ndarray:
        """Wait for every stripe; its checksum segments at data offsets, sorted, as an array of
        ``rank_index.segment_record()`` (small segments make too many for a tuple each).

        A failed stripe's ``OSError`` is raised (its ``offset`` turned into a
        data offset) once the others are stopped: no job is left running.
        """
        parts = []
        for k, (job, base) in enumerate(zip(self.jobs, self.bases)):
            try:
                parts.append(_records_of(job, base))
            except OSError as exc:
                for other in self.jobs[k + 1 :]:
                    _native.stop_write_job(other, "another stripe of the rank failed")
                offset = getattr(exc, "offset", -1)
                if offset is not None and offset >= 0:
                    exc.offset = offset + base
                raise
        segments = np.concatenate(parts) if parts else np.empty(0, segment_record())
        return segments[np.argsort(segments["o"], kind="stable")]


def _records_of(job, base: int) -> np.ndarray:
    """``job.wait()``'s segments as records, ``base`` added to their offsets (an upload's job
    may give Segment objects only)."""
    wait_records = getattr(job, "wait_records", None)
    if wait_records is not None:
        rows = np.frombuffer(wait_records(), dtype=segment_record()).copy()
    else:
        rows = np.array([(s.offset, s.nbytes, s.crc32c, 0) for s in job.wait()], dtype=segment_record())
    rows["o"] += np.uint64(base)
    return rows
