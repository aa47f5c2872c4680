"""What the manager tells the run: its warning classes and its one logger.

The manager's warnings go through ``warnings`` (what a user sees without configuring anything);
each is also logged at INFO on the manager's logger, so that a log alone tells why a step was
skipped or what failed. Every part of the manager logs as ``dcp_datastates.manager.checkpoint_manager``
(README names it)."""

from __future__ import annotations

import logging
import warnings


class CheckpointManagerWarning(UserWarning):
    """Something the manager did or could not do that the run should know about."""


class SkippedCheckpointWarning(CheckpointManagerWarning):
    """A checkpoint was passed over on resume (incomplete, corrupt, abandoned) or removed as a crash leftover."""


log = logging.getLogger("dcp_datastates.manager.checkpoint_manager")


def warn_skipped(message: str, stacklevel: int = 3) -> None:
    """``stacklevel``: as ``warnings.warn``'s, counted from the caller of this function (3: its caller's caller)."""
    log.info("%s", message)
    warnings.warn(message, SkippedCheckpointWarning, stacklevel=stacklevel)


def warn_manager(message: str, stacklevel: int = 3) -> None:
    log.info("%s", message)
    warnings.warn(message, CheckpointManagerWarning, stacklevel=stacklevel)
