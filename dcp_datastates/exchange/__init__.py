"""Bytes between ranks and nodes, over torch.distributed: the job's own engine is the transport.

Every byte that crosses ranks or nodes (a read-once load's pieces, a partner copy, a wiped
node's files coming back, the node commit) moves here, on a process group of the exchange's
own (:mod:`channel`), as point-to-point messages of a bounded size (:mod:`transfer`), planned
by pure functions every rank computes alike (:mod:`plan`), so that sends and receives pair
up. The receiver checks what it got against the checkpoint's checksum segments before
anything is used or published: :mod:`reads` (read-once loads), :mod:`files` (whole files
from one rank's store into another's). The package opens no socket or service of its own.
"""

from __future__ import annotations

from dcp_datastates.exchange.channel import Channel, ExchangeError

__all__ = ["Channel", "ExchangeError"]
