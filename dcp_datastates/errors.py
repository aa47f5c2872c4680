"""Errors raised by dcp_datastates.

Each says what is wrong and where (directory, file, key), so that a failed
load or save can be acted on without reading our source. They subclass the
builtin a caller would already catch (``FileNotFoundError`` for a missing
checkpoint, ``FileExistsError`` for a refused overwrite, ``ValueError`` for
data that does not match what the checkpoint promises).
"""

from __future__ import annotations


class CheckpointError(Exception):
    """Base class of every error dcp_datastates raises about a checkpoint."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """The path holds no checkpoint at all."""


class IncompleteCheckpointError(CheckpointError, FileNotFoundError):
    """The directory holds checkpoint files but was never committed (no ``.metadata``).

    Usually a save that was interrupted or failed; its data must not be trusted.
    """


class CheckpointExistsError(CheckpointError, FileExistsError):
    """A save was pointed at a directory that already holds a committed checkpoint."""


class CorruptCheckpointError(CheckpointError, ValueError):
    """A file of the checkpoint does not hold what its metadata and index promise."""


class ChecksumMismatchError(CorruptCheckpointError):
    """Bytes read back do not match the CRC32C recorded when they were written."""


class UnsupportedFormatError(CheckpointError, ValueError):
    """The checkpoint was written by a newer or different storage format."""


class SnapshotMutatedError(CheckpointError, RuntimeError):
    """A tensor was modified in place before its asynchronous snapshot was complete.

    The bytes on their way to the checkpoint may mix old and new values, so
    the save is failed instead of committing a torn checkpoint. Wait for the
    staging future (or install the fence, :func:`dcp_datastates.install_fence`)
    before the optimizer step.
    """


class UnsafeCheckpointError(CheckpointError, ValueError):
    """Loading would unpickle something that could run code, and that was not allowed.

    Raised for a ``.metadata`` that names classes outside DCP's metadata types,
    and for saved Python objects that need more than plain data types
    (``torch.load(..., weights_only=True)``), unless the reader was created
    with ``allow_pickle=True`` (only for checkpoints you trust).
    """


class ModelMismatchError(CheckpointError, ValueError):
    """A checkpoint's tensors do not match the model they are exported for or loaded into.

    Raised, naming the key, for a tensor the model's config expects that the
    checkpoint lacks, one the model has no place for, or a shape that differs,
    instead of writing or loading a model that would start from random weights.
    """
