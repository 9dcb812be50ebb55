"""`allreduce`: what DDP does. Every bucket of gradients is averaged over all ranks.

Communicates: every gradient, every step, 2(n-1)/n of its bytes per rank with the ring,
overlapped with backward by the bucketer. The result is the gradient of the global
batch, so training equals single-process training on the union of the ranks' batches
(the reference every other strategy is compared against).

The average is a division and a sum. The division is the bucketer's: it divides each
gradient as it copies it into its bucket (`gradient_divisor`), so reduce_bucket only
sums what it is handed (a bucket given to it by hand must be divided first).
"""
from __future__ import annotations

from typing import Optional

import torch

from .. import api
from .base import SyncStrategy, register


@register("allreduce")
class AllReduce(SyncStrategy):
    def __init__(self, algorithm: str = "auto"):
        self.algorithm = algorithm

    def gradient_divisor(self) -> Optional[int]:
        # Divide first, then sum (as DDP does): the sum cannot overflow in fp16.
        return self.comm.world_size

    def reduce_bucket(self, flat: torch.Tensor) -> None:
        # The gradients came in divided (gradient_divisor): summing averages them.
        # check=False: the bucket layout was agreed across ranks when the model was wrapped.
        api.all_reduce(flat, op="sum", algorithm=self.algorithm, comm=self.comm, check=False)
