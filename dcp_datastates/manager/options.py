"""The settings of a :class:`CheckpointManager`, in one object checked once."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from dcp_datastates.exchange.channel import DEFAULT_TIMEOUT_S, check_settings
from dcp_datastates.manager.durable_tier import RETRY_S
from dcp_datastates.native import engine as _native


@dataclasses.dataclass(frozen=True)
class CheckpointManagerOptions:
    """How a :class:`CheckpointManager` saves, keeps, drains and resumes.

    Each field is described once, in README ("Options"). Invalid
    values raise ValueError here, naming the field, before any file is touched.
    """

    keep_last: int | None = 3
    keep_every: int | None = None
    async_save: bool = True
    fence: bool = True
    host_cache_bytes: int = _native.DEFAULT_HOST_CACHE_BYTES
    io_threads: int = _native.DEFAULT_IO_THREADS
    direct_io: str = "auto"
    checksum_bytes: int | None = None
    allow_pickle: bool = False
    cleanup: bool = True
    incremental: bool = True
    full_every: int = 10
    durable: str | os.PathLike | None = None
    durable_keep_last: int | None = None
    durable_keep_every: int | None = None
    delete_undrained: bool = False
    durable_read_back: bool = True
    durable_options: dict[str, Any] | None = None
    durable_resume: str = "load"
    durable_retry_s: float = RETRY_S
    durable_close_timeout_s: float | None = None
    init_from_huggingface: str | os.PathLike | None = None
    init_prefix: str = "model"
    node_local: bool = False
    partner: bool = False
    partner_keep_last: int = 2
    exchange_timeout_s: float = DEFAULT_TIMEOUT_S
    exchange_backend: str = "gloo"

    def __post_init__(self) -> None:
        if self.keep_last is not None and (not isinstance(self.keep_last, int) or self.keep_last < 1):
            raise ValueError(f"keep_last must be a positive int or None (keep all), got {self.keep_last!r}")
        if self.keep_every is not None and (not isinstance(self.keep_every, int) or self.keep_every < 1):
            raise ValueError(f"keep_every must be a positive int or None, got {self.keep_every!r}")
        if self.durable_resume not in ("load", "fetch"):
            raise ValueError(f"durable_resume must be 'load' or 'fetch', got {self.durable_resume!r}")
        if not _is_count(self.full_every) or self.full_every < 1:
            raise ValueError(f"full_every must be a positive int, got {self.full_every!r}")
        for name in ("durable_keep_last", "durable_keep_every"):
            value = getattr(self, name)
            if value is not None and (not _is_count(value) or value < 1):
                raise ValueError(f"{name} must be a positive int or None, got {value!r}")
        if not _is_seconds(self.durable_retry_s):
            raise ValueError(f"durable_retry_s must be a number of seconds >= 0, got {self.durable_retry_s!r}")
        if self.init_from_huggingface is not None and not isinstance(self.init_from_huggingface, (str, os.PathLike)):
            raise ValueError(f"init_from_huggingface must be a directory path or None, got {self.init_from_huggingface!r}")
        if not isinstance(self.init_prefix, str) or not self.init_prefix:
            raise ValueError(f"init_prefix must be a non-empty str (the state's model entry), got {self.init_prefix!r}")
        if self.checksum_bytes is not None:
            _native.check_checksum_bytes(self.checksum_bytes, _native.DEFAULT_WINDOW_BYTES)
        if self.partner and not self.node_local:
            raise ValueError("partner=True copies each node's files to another node's root: it needs node_local=True")
        if self.node_local and self.incremental:
            raise ValueError(
                "node_local=True needs incremental=False: an incremental step refers to files of earlier steps, "
                "which node-local roots do not share yet"
            )
        if not _is_count(self.partner_keep_last) or self.partner_keep_last < 1:
            raise ValueError(f"partner_keep_last must be a positive int, got {self.partner_keep_last!r}")
        check_settings(self.exchange_backend, self.exchange_timeout_s)
        if self.durable_close_timeout_s is not None and not _is_seconds(self.durable_close_timeout_s):
            raise ValueError(
                f"durable_close_timeout_s must be seconds >= 0 or None, got {self.durable_close_timeout_s!r}"
            )


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_seconds(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0
