"""A store in S3-compatible object storage, through obstore.

``s3://bucket/prefix`` names the root. Endpoint, region and credentials come
from the usual environment variables (``AWS_ENDPOINT_URL`` or
``AWS_ENDPOINT_URL_S3``, ``AWS_REGION``/``AWS_DEFAULT_REGION``,
``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``) or
from keyword arguments; an ``http://`` endpoint (a server on the loopback,
as in the tests) is allowed explicitly. Keys are path-style.

Why obstore (docs/tiers.md has the comparison): it is a client made for
exactly this (the Rust ``object_store`` crate behind Apache Arrow and
DataFusion), it does its I/O without the GIL, and one small wheel with no
torch, CUDA or botocore behind it gives streamed multipart uploads with
bounded memory, ranged reads, and retries with exponential backoff on 5xx
answers (503 SlowDown included) and broken connections.

An S3 object exists under its key only once its upload completed (a
multipart upload that fails is aborted, and never visible), which is the
property a checkpoint's commit on this tier relies on.
"""

from __future__ import annotations

import os
from datetime import timedelta

from dcp_datastates.errors import CheckpointError
from dcp_datastates.storage.store import ObjectExistsError, Progress, ShortObjectError, Store, StoreError, check_key
from dcp_datastates.storage.upload import StreamUpload
from dcp_datastates.storage.url import parse_s3_url

PART_BYTES = 64 << 20  # multipart part size (S3: 5 MiB to 5 GiB, at most 10,000 parts)
MAX_PARTS = 10_000
UPLOAD_CONCURRENCY = 4  # parts in flight per upload: memory is about (concurrency + 1) parts


# obstore's exception classes that mean the request was refused, not unanswered
_REFUSALS = {
    "PermissionDeniedError", "UnauthenticatedError", "InvalidPathError", "NotSupportedError",
    "UnknownConfigurationKeyError", "NotFoundError", "AlreadyExistsError", "PreconditionError",
}


def _obstore():
    try:
        import obstore
        from obstore.store import S3Store as _S3
    except ImportError as exc:
        raise ImportError(
            "an s3:// durable tier needs obstore: pip install \"dcp_datastates[s3]\" (Python 3.11 or newer)"
        ) from exc
    return obstore, _S3


class S3Store(Store):
    read_block = 8 << 20  # a ranged GET each: larger than a file system's, to keep requests few

    def __init__(
        self,
        url: str,
        *,
        endpoint: str | None = None,
        region: str | None = None,
        part_bytes: int = PART_BYTES,
        upload_concurrency: int = UPLOAD_CONCURRENCY,
        max_retries: int = 10,
        retry_timeout_s: float = 300.0,
        request_timeout_s: float = 300.0,
    ) -> None:
        self._obs, s3 = _obstore()
        self.url = url.rstrip("/")
        self.bucket, self.prefix = parse_s3_url(url)
        endpoint = endpoint or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        region = region or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
        if not 5 << 20 <= part_bytes <= 5 << 30:
            raise ValueError(f"part_bytes must be between 5 MiB and 5 GiB, got {part_bytes}")
        self.part_bytes = part_bytes
        self.upload_concurrency = upload_concurrency
        options = {"timeout": timedelta(seconds=request_timeout_s), "connect_timeout": timedelta(seconds=30)}
        if endpoint and endpoint.startswith("http://"):
            options["allow_http"] = True
        kwargs = {}
        if endpoint:
            kwargs["endpoint"] = endpoint
        for env, option in (("AWS_ACCESS_KEY_ID", "access_key_id"), ("AWS_SECRET_ACCESS_KEY", "secret_access_key"),
                            ("AWS_SESSION_TOKEN", "session_token")):
            if os.environ.get(env):
                kwargs[option] = os.environ[env]
        self._store = s3(
            self.bucket,
            prefix=self.prefix or None,
            region=region,
            client_options=options,
            retry_config={
                "max_retries": max_retries,
                "retry_timeout": timedelta(seconds=retry_timeout_s),
                "backoff": {"init_backoff": timedelta(milliseconds=100), "max_backoff": timedelta(seconds=15), "base": 2.0},
            },
            **kwargs,
        )
        self.endpoint = endpoint

    def _fail(self, what: str, key: str, exc: Exception) -> StoreError:
        # Refusals (credentials, permissions, a bad key or option) stay refusals; anything else
        # obstore raises after its own retries is the server not answering (connection errors, 5xx).
        refused = type(exc).__name__ in _REFUSALS
        text = str(exc).split("\n\nDebug source:", 1)[0].strip()  # obstore appends its Rust error's dump
        return StoreError(f"{what} {self.where(key)}: {type(exc).__name__}: {text}", transient=not refused)

    def put_stream(self, key: str, blocks, size: int | None, progress: Progress | None = None,
                   size_hint: int | None = None) -> None:
        """One PUT up to a part's size; above it a multipart upload of ``part`` bytes per part
        (at most ``upload_concurrency`` in flight), which obstore aborts if ``blocks`` raises."""
        check_key(key)
        # Unknown size: parts large enough for twice the hint (objects follow a rank's tensors).
        expect = size if size is not None else 2 * (size_hint or 0)
        part = max(self.part_bytes, -(-expect // (MAX_PARTS - 1)))

        def counted():
            total = 0
            for data in blocks:
                total += len(data)
                if progress is not None:
                    progress(len(data))
                yield data
            if size is not None and total != size:
                raise StoreError(f"writing {self.where(key)}: {total} bytes came, {size} were announced")

        try:
            if size is not None and size <= part:
                self._obs.put(self._store, key, b"".join(counted()), use_multipart=False)
            else:
                self._obs.put(self._store, key, counted(), chunk_size=part, max_concurrency=self.upload_concurrency)
        except CheckpointError:
            raise
        except Exception as exc:  # obstore's errors are its own classes
            cause = exc.__cause__ or exc.__context__
            if isinstance(cause, CheckpointError):  # raised by ``blocks`` inside the upload
                raise cause from exc
            raise self._fail("uploading to", key, exc) from exc

    def start_write(self, engine, key: str, regions, keep, **options):
        """The engine job's windows streamed into the object as a multipart upload, in bounded
        memory (``options``: ``verify``, whether it is read back and compared once complete)."""
        return StreamUpload(self, engine, key, regions, keep, verify=options.get("verify", True),
                            size_hint=options.get("preallocate") or None)

    def put_bytes(self, key: str, data: bytes) -> None:
        check_key(key)
        try:
            self._obs.put(self._store, key, bytes(data), use_multipart=False)
        except Exception as exc:
            raise self._fail("writing", key, exc) from exc

    def put_new(self, key: str, data: bytes) -> None:
        check_key(key)
        try:
            self._obs.put(self._store, key, bytes(data), use_multipart=False, mode="create")  # If-None-Match: *
        except Exception as exc:
            if type(exc).__name__ in ("AlreadyExistsError", "PreconditionError"):
                raise ObjectExistsError(f"{self.where(key)}: an object is there already") from exc
            raise self._fail("writing", key, exc) from exc

    def replace_bytes(self, key: str, data: bytes) -> None:
        self.put_bytes(key, data)  # a PUT replaces an object atomically

    def read_range(self, key: str, offset: int, length: int) -> memoryview:
        check_key(key)
        if length == 0:
            return memoryview(b"")
        try:
            # obstore's buffer as it is: a copy into bytes would hold the GIL for the whole block
            data = memoryview(self._obs.get_range(self._store, key, start=offset, length=length))
        except FileNotFoundError as exc:
            raise StoreError(f"{self.where(key)}: no such object") from exc
        except Exception as exc:
            raise self._fail("reading", key, exc) from exc
        if len(data) != length:
            raise ShortObjectError(f"{self.where(key)}: {length} bytes asked at offset {offset}, {len(data)} returned")
        return data

    def identity(self, key: str):
        check_key(key)
        try:
            meta = self._obs.head(self._store, key)
        except FileNotFoundError:
            return None
        except Exception as exc:
            raise self._fail("asking about", key, exc) from exc
        return (self.where(key), int(meta["size"]), meta.get("e_tag"), str(meta.get("last_modified")))

    def size(self, key: str) -> int | None:
        check_key(key)
        try:
            return int(self._obs.head(self._store, key)["size"])
        except FileNotFoundError:
            return None
        except Exception as exc:
            raise self._fail("asking the size of", key, exc) from exc

    def list(self, prefix: str = "") -> list[str]:
        if prefix and not prefix.endswith("/"):
            raise ValueError(f"a list prefix ends with '/': {prefix!r}")
        try:
            keys = [m["path"] for batch in self._obs.list(self._store, prefix=prefix or None) for m in batch]
        except Exception as exc:
            raise self._fail("listing", prefix or ".", exc) from exc
        return sorted(keys)

    def delete(self, keys: list[str]) -> None:
        for key in keys:
            check_key(key)
        if not keys:
            return
        try:
            self._obs.delete(self._store, list(keys))
        except FileNotFoundError:
            pass
        except Exception as exc:
            raise self._fail("deleting", keys[0], exc) from exc
