"""Each node's root served to the other nodes, and every node's address.

With node-local roots no node sees another's files; the leader of each node
serves its root (:class:`storage.remote.StoreServer`: ranged reads, listing,
streamed writes into it, each connection authenticated by a token the process
group hands around). Every rank can then open any node's root as a
:class:`storage.remote.RemoteStore`: the node commit reads the coordinator's
``.metadata``, a partner copy is written into the partner's root, a load reads
the files its node lacks.
"""

from __future__ import annotations

import os
import socket

import torch.distributed as dist

from dcp_datastates.errors import CheckpointError
from dcp_datastates.manager.nodes import NodeMap, node_key
from dcp_datastates.storage.local import LocalStore
from dcp_datastates.storage.remote import RemoteStore, StoreServer


def default_peer_host() -> str:
    """The address other nodes reach this one by: the one this host uses to reach the run's
    rendezvous (``MASTER_ADDR``), else the host name's address (which ``/etc/hosts`` may map to
    a loopback address: then give ``peer_host``)."""
    master = os.environ.get("MASTER_ADDR")
    if master:
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.connect((master, int(os.environ.get("MASTER_PORT", "29500"))))  # no packet is sent
                return s.getsockname()[0]
        except OSError:
            pass
    return socket.gethostbyname(socket.gethostname())


class NodePeers:
    """This node's file service (its leader's) and a store for any node's root."""

    def __init__(self, root: str, ranks, host: str | None) -> None:
        """Collective over ``ranks``' group (a :class:`manager.collective.Ranks`): every rank's
        node key, then every leader's address."""
        self.root = root
        self.nodes = _gather_nodes(ranks)
        self.server: StoreServer | None = None
        offer = None
        try:
            if self.nodes.is_leader:
                os.makedirs(root, exist_ok=True)
                self.server = StoreServer(LocalStore(root), host=host or default_peer_host())
                offer = (True, (self.server.address, self.server.token))
        except Exception as exc:  # noqa: BLE001 - raised below on every rank
            offer = (False, f"{type(exc).__name__}: {exc}")
        offers = _all_gather(ranks, offer)
        self.addresses: list[tuple] = []
        for n in range(self.nodes.count):
            ok, value = offers[self.nodes.leader(n)]
            if not ok:
                self.close()
                raise CheckpointError(f"{root}: node {n} (rank {self.nodes.leader(n)}) could not serve its root: {value}")
            self.addresses.append(value)
        self._stores: dict[tuple[int, str], RemoteStore] = {}

    def store(self, node: int, prefix: str = "") -> RemoteStore:
        """``node``'s root (under ``prefix``) as a store (one per node and prefix, kept open)."""
        key = (node, prefix)
        if key not in self._stores:
            (host, port), token = self.addresses[node]
            self._stores[key] = RemoteStore((host, port), token, prefix,
                                            name=f"node {node} ({host}:{port}){'/' + prefix if prefix else ''}")
        return self._stores[key]

    def close(self) -> None:
        stores, self._stores = getattr(self, "_stores", {}), {}
        for s in stores.values():
            s.close()
        server, self.server = self.server, None
        if server is not None:
            server.close()


def _gather_nodes(ranks) -> NodeMap:
    if not ranks.distributed:
        return NodeMap.single(1, 0)
    return NodeMap.of_keys(_all_gather(ranks, node_key()), ranks.rank)


def _all_gather(ranks, value) -> list:
    if not ranks.distributed:
        return [value]
    out = [None] * ranks.world
    dist.all_gather_object(out, value, group=ranks.group)
    return out
