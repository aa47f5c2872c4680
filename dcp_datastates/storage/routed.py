"""One checkpoint whose files lie in several stores, read as one store.

On node-local storage a checkpoint is spread over the nodes: each node's root
holds its own ranks' files, a partner node may hold a copy of them, the durable
tier may hold all of them. A load reads through :class:`RoutedStore`, which
sends each key to the store that holds it where this rank runs (its node's own
root first, then the partner copies its node holds, then the durable tier), so
the reader, its planner and its checksum verification stay exactly what they are
for one directory. A file only another node holds has a size here but no store:
the read-once load has a rank of that node read it and send it
(:mod:`exchange.reads`); a small one (a rank index) this rank then keeps in
memory (:meth:`RoutedStore.adopt`). Nothing is ever written through it.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from dcp_datastates.native import engine as _native
from dcp_datastates.storage.memory import MemoryStore
from dcp_datastates.storage.store import RangeRead, Store, StoreError, check_key


class RoutedStore(Store):
    """Keys routed to stores: ``routes`` maps each key (``step_<N>/<file>``) to the store that
    serves it under the same key; ``elsewhere`` gives the size of each key only another node
    holds. A key in neither does not exist here."""

    def __init__(self, routes: dict[str, Store], url: str, elsewhere: dict[str, int] | None = None) -> None:
        self.routes = {check_key(k): s for k, s in routes.items()}
        self.elsewhere = {check_key(k): n for k, n in (elsewhere or {}).items() if k not in self.routes}
        self.url = url

    def _store(self, key: str) -> Store:
        try:
            return self.routes[key]
        except KeyError:
            if key in self.elsewhere:
                raise StoreError(f"{self.where(key)}: only another node holds this file (a load reads it through "
                                 "the exchange)", transient=False) from None
            raise StoreError(f"{self.where(key)}: no node holds this file (nor does the durable tier)",
                             transient=False) from None

    def adopt(self, key: str, blob: bytes) -> None:
        """Hold ``key``, which another rank read and sent, in memory from now on."""
        self.routes[check_key(key)] = MemoryStore({key: blob}, f"{self.url} (received)")
        self.elsewhere.pop(key, None)

    def _refuse(self, key: str, *_args, **_kwargs):
        raise StoreError(f"{self.where(key)}: a routed checkpoint is read-only", transient=False)

    put_stream = put_bytes = put_new = replace_bytes = _refuse

    def delete(self, keys: list[str]) -> None:
        self._refuse(keys[0] if keys else "")

    def read_range(self, key: str, offset: int, length: int):
        return self._store(key).read_range(key, offset, length)

    def read_into(self, key: str, offset: int, out: memoryview) -> None:
        self._store(key).read_into(key, offset, out)

    def size(self, key: str) -> int | None:
        store = self.routes.get(key)
        return store.size(key) if store is not None else self.elsewhere.get(key)

    def identity(self, key: str):
        store = self.routes.get(key)
        return None if store is None else (id(store), store.identity(key))

    def open_file(self, key: str):
        return self._store(key).open_file(key)

    def list(self, prefix: str = "") -> list[str]:
        if prefix and not prefix.endswith("/"):
            raise ValueError(f"a list prefix ends with '/': {prefix!r}")
        return sorted(k for k in (*self.routes, *self.elsewhere) if k.startswith(prefix))

    def where(self, key: str) -> str:
        store = self.routes.get(key)
        return store.where(key) if store is not None and key else super().where(key)

    def read_batch(self, reads: list[RangeRead], *, threads: int | None = None) -> list:
        """Each store's reads as one batch of its own (all stores at once); failures in request order."""
        if not reads:
            return []
        groups: dict[int, tuple[Store, list[int]]] = {}
        for i, read in enumerate(reads):
            store = self._store(read.key)
            groups.setdefault(id(store), (store, []))[1].append(i)

        def run(group: tuple[Store, list[int]]) -> list:
            store, numbers = group
            found = store.read_batch([reads[i] for i in numbers], threads=threads)
            return [_native.ReadFailure(request=numbers[f.request], kind=f.kind, errno=f.errno, path=f.path,
                                        offset=f.offset, message=f.message) for f in found]

        if len(groups) == 1:
            failures = run(next(iter(groups.values())))
        else:
            with ThreadPoolExecutor(len(groups), thread_name_prefix="dcp_datastates-routed") as pool:
                failures = [f for found in pool.map(run, groups.values()) for f in found]
        return sorted(failures, key=lambda f: f.request)

    def close(self) -> None:
        pass  # the stores are the manager's, closed with it
