"""What a checkpoint location names: a local directory, or an object store's ``s3://bucket/prefix``.

The one place that tells a URL from a path and takes a URL apart, so that a
URL is never taken for a folder whose name holds ``:`` (``./s3:/bucket/...``)
and every caller refuses the same unsupported schemes with the same words.
"""

from __future__ import annotations

import os
import re

SUPPORTED_SCHEMES = ("s3",)  # what open_store serves besides a directory path

_URL_RE = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


def url_scheme(path) -> str | None:
    """The scheme of ``path`` when it is a URL (``"s3"`` for ``s3://bucket/run``), else None."""
    try:
        path = os.fspath(path)
    except TypeError:
        return None
    m = _URL_RE.match(path) if isinstance(path, str) else None
    return m.group(1) if m else None


def is_store_url(location) -> bool:
    """Whether ``location`` is the URL of an object store this package serves (``s3://``)."""
    return url_scheme(location) in SUPPORTED_SCHEMES


def check_location(location, what: str = "a checkpoint location") -> None:
    """A ValueError for a URL of a scheme no store serves (``gs://``, ``S3://``, ``file://``),
    naming the supported ones: such a URL is never taken for a directory."""
    scheme = url_scheme(location)
    if scheme is not None and scheme not in SUPPORTED_SCHEMES:
        supported = ", ".join(f"{s}://bucket/prefix" for s in SUPPORTED_SCHEMES)
        raise ValueError(
            f"unsupported URL {os.fspath(location)!r} for {what}: use a directory path or {supported}"
        )


def check_save_target(path, compression, base) -> None:
    """:func:`check_location` for a writer's path, and a ValueError for what a save straight into
    object storage does not do (``compression``, a ``base``: given or not), naming what to use instead."""
    if path is None:
        return
    check_location(path, "DataStatesWriter")
    if not is_store_url(path):
        return
    unsupported = [what for what, given in (("compression", compression is not None), ("base", base is not None)) if given]
    if unsupported:
        raise ValueError(
            f"DataStatesWriter({os.fspath(path)!r}, {', '.join(unsupported)}=...): a save straight into object "
            "storage writes raw, full checkpoints; for compressed or incremental checkpoints there, save them "
            "to a local directory and have them copied in the background: CheckpointManager(local_root, "
            "CheckpointManagerOptions(durable=URL, ...)) (docs/tiers.md)"
        )


def refuse_url(path, who: str, instead: str) -> None:
    """A ValueError when ``path`` is a URL: ``who`` works on local directories only, and nothing
    may be written (or looked for) in a folder named after the URL. ``instead``: what to use."""
    scheme = url_scheme(path)
    if scheme is not None:
        raise ValueError(
            f"{who} takes a local directory, and {os.fspath(path)!r} is a {scheme}:// URL (it is never "
            f"taken for a folder of that name). {instead}"
        )


def parse_s3_url(url: str) -> tuple[str, str]:
    """``(bucket, prefix)`` of ``s3://bucket/prefix``; a ValueError for no bucket or a prefix
    with empty, ``.`` or ``..`` parts (a key would not mean what the URL says)."""
    if url_scheme(url) != "s3":
        raise ValueError(f"{url!r} is not an s3:// URL")
    rest = url[len("s3://"):]
    bucket, _, prefix = rest.partition("/")
    if not bucket:
        raise ValueError(f"{url!r} names no bucket: use s3://bucket/prefix")
    prefix = prefix.strip("/")
    if prefix and any(part in ("", ".", "..") for part in prefix.split("/")):
        raise ValueError(f"{url!r}: the prefix may not hold empty, '.' or '..' parts")
    return bucket, prefix


def split_parent(location: str | os.PathLike) -> tuple[str, str]:
    """``(parent, name)`` of a checkpoint's URL or directory: a store is opened at a checkpoint's
    parent, so that an incremental checkpoint's references to its siblings (``../<base>/<name>``)
    stay inside it, as a local reader resolves them in the parent directory. A checkpoint at a
    bucket's root (or ``/``) is its own parent (name ``""``). A URL no store serves, or one
    without a bucket or with empty, ``.`` or ``..`` parts, is a ValueError naming it."""
    check_location(location)
    if is_store_url(location):
        bucket, prefix = parse_s3_url(os.fspath(location))
        parent, _, name = prefix.rpartition("/")
        return f"s3://{bucket}" + (f"/{parent}" if parent else ""), name
    path = os.path.abspath(os.fspath(location))
    parent, name = os.path.split(path)
    return (parent, name) if name else (path, "")


def absolute(location) -> str:
    """A directory made absolute; a URL as it is (how summaries and reports name a source)."""
    location = os.fspath(location)
    return location if url_scheme(location) is not None else os.path.abspath(location)
