"""A few small files held in memory, read as a store: a checkpoint's ``.metadata`` or rank index
that another rank read and sent this one (its node keeps no copy)."""

from __future__ import annotations

from dcp_datastates.storage.store import ShortObjectError, Store, StoreError, check_key


class MemoryStore(Store):
    """Read-only ``{key: bytes}``; ``url`` names where the files are from, for errors."""

    def __init__(self, files: dict[str, bytes], url: str) -> None:
        self.files = {check_key(k): bytes(v) for k, v in files.items()}
        self.url = url

    def _blob(self, key: str) -> bytes:
        blob = self.files.get(key)
        if blob is None:
            raise StoreError(f"{self.where(key)}: no such object", transient=False)
        return blob

    def read_range(self, key: str, offset: int, length: int) -> memoryview:
        blob = self._blob(key)
        if offset + length > len(blob):
            raise ShortObjectError(f"{self.where(key)}: {length} bytes asked at offset {offset}, the object ends at {len(blob)}")
        return memoryview(blob)[offset:offset + length]

    def size(self, key: str) -> int | None:
        blob = self.files.get(key)
        return None if blob is None else len(blob)

    def identity(self, key: str):
        blob = self.files.get(key)
        return None if blob is None else (self.url, key, id(blob), len(blob))

    def list(self, prefix: str = "") -> list[str]:
        return sorted(k for k in self.files if k.startswith(prefix))

    def _refuse(self, key: str, *_args, **_kwargs):
        raise StoreError(f"{self.where(key)}: files held in memory are read-only", transient=False)

    put_stream = put_bytes = put_new = replace_bytes = _refuse

    def delete(self, keys: list[str]) -> None:
        self._refuse(keys[0] if keys else "")
