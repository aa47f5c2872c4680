"""Copies of committed checkpoints beyond the local checkpoint directory.

A checkpoint commits on a fast local tier (a directory, as every save does);
a durable tier (a shared file system, or S3-compatible object storage: any
:class:`storage.Store`) takes copies of committed checkpoints. :mod:`drain`
copies a checkpoint there, verified, ``.metadata`` last, and fetches it back.
"""
