"""Which step each incremental save of the manager refers to, and what every step refers to.

With ``incremental`` (README, "Options"), a save refers to a *base*:
the newest step this manager committed, or the step it resumed from (every
byte of which the load checked). A save is full instead when there is no such
step, or when ``full_every`` saves have passed since the newest full one
(counted in commit sequences, which the root keeps across restarts), so no
chain of references outlives ``full_every`` saves. Every manager save records
content digests, full ones included, so that the next can refer to it.

What a step refers to is read from its layout (cached by the identity of its
``.metadata``), whatever this manager does: retention (:mod:`retention`) never
deletes a step that a step left on disk refers to.
"""

from __future__ import annotations

import os
import threading

from dcp_datastates.core.incremental import ChangeTracker
from dcp_datastates.core.reader import DataStatesReader
from dcp_datastates.errors import CheckpointError
from dcp_datastates.format.file_names import METADATA_FILE
from dcp_datastates.format.metadata_file import read_commit_sequence
from dcp_datastates.manager.checkpoint_root import is_committed, step_dir_name, step_dirs, step_of


class BaseChoice:
    """One manager's base choice and reference cache (every rank keeps one; rank 0's decides)."""

    def __init__(self, root: str, full_every: int) -> None:
        self.root = root
        self.full_every = full_every
        self.tracker = ChangeTracker()
        self.base_step: int | None = None  # the newest step committed (or loaded) by this manager
        self.full_seq: int | None = None  # commit sequence of the newest full save; None: not known yet
        self._bases: dict[str, tuple] = {}  # dir name -> (identity of its .metadata, bases)
        self._lock = threading.Lock()

    # -- choosing a base -------------------------------------------------------------

    def base_for(self, step: int, seq: int, in_flight: set[int]) -> str | None:
        """The directory of the base for a save of ``step`` with commit sequence ``seq``, or None
        for a full save."""
        with self._lock:
            base = self.base_step
        if base is None or base == step or base in in_flight:
            return None
        path = os.path.join(self.root, step_dir_name(base))
        if not is_committed(path):
            return None
        full_seq = self._full_sequence(base)
        if full_seq is None or seq - full_seq >= self.full_every:
            return None
        return path

    def committed(self, step: int, seq: int, full: bool) -> None:
        """A save of this manager committed (``full``: it referred to nothing)."""
        with self._lock:
            self.base_step = step
            if full:
                self.full_seq = seq

    def loaded(self, step: int) -> None:
        """The manager resumed from ``step``: the next save may refer to it."""
        with self._lock:
            self.base_step = step
            self.full_seq = None  # found again from the layouts on the next save

    def _full_sequence(self, base: int) -> int | None:
        """The commit sequence of the newest full save the chain of ``base`` starts from: ``base``
        itself if it refers to nothing, else the newest full step older than it (None: none, or
        a step without a sequence)."""
        with self._lock:
            if self.full_seq is not None:
                return self.full_seq
        name = step_dir_name(base)
        bases = self.bases_of(name)
        if bases is None:
            return None
        candidates = [name] if not bases else sorted(
            (n for s, n in step_dirs(self.root).items() if s < base), key=step_of, reverse=True
        )
        for candidate in candidates:
            if self.bases_of(candidate) == set():
                seq = read_commit_sequence(os.path.join(self.root, candidate, METADATA_FILE))
                with self._lock:
                    self.full_seq = seq
                return seq
        return None

    # -- what a step refers to -----------------------------------------------------------

    def bases_of(self, name: str) -> set[str] | None:
        """The base directories the checkpoint ``name`` refers to: empty when it is not committed
        (no ``.metadata``: it refers to nothing), None when its ``.metadata`` cannot be read (what
        it refers to is unknown)."""
        path = os.path.join(self.root, name, METADATA_FILE)
        try:
            st = os.stat(path, follow_symlinks=False)
        except FileNotFoundError:
            return set()
        except OSError:
            return None
        identity = (st.st_ino, st.st_size, st.st_mtime_ns)
        with self._lock:
            cached = self._bases.get(name)
        if cached is not None and cached[0] == identity:
            return cached[1]
        try:
            reader = DataStatesReader(os.path.join(self.root, name))
            reader.load_metadata()
            bases = set(reader.require_layout().bases)
        except (CheckpointError, OSError):
            return None
        with self._lock:
            self._bases[name] = (identity, bases)
        return bases

    def referred_steps(self, step: int) -> set[int] | None:
        """:meth:`bases_of` of ``step``'s directory, as steps (what retention takes)."""
        bases = self.bases_of(step_dir_name(step))
        return None if bases is None else {step_of(b) for b in bases}

    def dependents_of(self, name: str, among: list[str]) -> list[str]:
        """The checkpoints among ``among`` that refer to ``name``."""
        return [other for other in among if other != name and name in (self.bases_of(other) or set())]
