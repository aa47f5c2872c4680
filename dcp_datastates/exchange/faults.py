"""Faults the reliability tests arm in the exchange: bytes damaged on their way to a peer.

:func:`corrupt_sends` makes this process flip one byte of each of its next ``count`` sent
messages (in a copy: the sender's own bytes stay intact), which is what a flaky link or a
bad NIC would do; the receiver's checks must name it. Nothing is armed unless a test does.
"""

from __future__ import annotations

import threading

import torch

_lock = threading.Lock()
_corrupt_left = 0


def corrupt_sends(count: int = 1) -> None:
    """Damage the next ``count`` messages this process sends (0 disarms)."""
    global _corrupt_left
    with _lock:
        _corrupt_left = count


def outgoing(data: torch.Tensor) -> torch.Tensor:
    """``data`` as it goes out: itself, or a damaged copy while armed."""
    global _corrupt_left
    if not _corrupt_left:
        return data
    with _lock:
        if _corrupt_left <= 0:
            return data
        _corrupt_left -= 1
    damaged = data.clone()
    damaged[damaged.numel() // 2] ^= 0x5A
    return damaged
