"""`allreduce`: what DDP does. Every bucket of gradients is averaged over all ranks.

Communicates: every gradient, every step, 2(n-1)/n of its bytes per rank with the ring,
overlapped with backward by the bucketer. The result is the gradient of the global
batch, so training equals single-process training on the union of the ranks' batches
(the reference every other strategy is compared against).
"""
from __future__ import annotations

import torch

from .. import api
from .base import SyncStrategy, register


@register("allreduce")
class AllReduce(SyncStrategy):
    def __init__(self, algorithm: str = "auto"):
        self.algorithm = algorithm

    def reduce_bucket(self, flat: torch.Tensor) -> None:
        # Divide first, then sum (as DDP's default hook): the sum cannot overflow in fp16.
        # check=False: the bucket layout was agreed across ranks when the model was wrapped.
        flat.div_(self.comm.world_size)
        api.all_reduce(flat, op="sum", algorithm=self.algorithm, comm=self.comm, check=False)
