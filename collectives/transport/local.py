"""A world of one: no launcher, no process group, no peers.

Every collective over one rank is the identity (average of one value is itself), so
this transport lets the same training script run as one plain process. Point-to-point
calls have no peer to talk to and raise.
"""
from __future__ import annotations

from datetime import timedelta

import torch

from .base import Transport


class LocalTransport(Transport):
    backend = "local"

    def __init__(self, device: torch.device, timeout: timedelta, backend: str = "local"):
        super().__init__(0, 1, 0, device, timeout)
        self.backend = backend

    def barrier(self) -> None:
        return None

    def _duplicate(self) -> "LocalTransport":
        return LocalTransport(self.device, self.timeout, self.backend)

    def _native_all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> None:
        return None  # sum, avg, max and min of a single contribution are all the identity

    def _native_broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        if src != 0:
            raise ValueError(f"broadcast: src={src} but the world has one rank")
