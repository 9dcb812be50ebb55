"""`allreduce`: what DDP does. Every bucket of gradients is averaged over all ranks.

Communicates: every gradient, every step, 2(n-1)/n of its bytes per rank with the ring,
overlapped with backward by the bucketer. The result is the gradient of the global
batch, so training equals single-process training on the union of the ranks' batches
(the reference every other strategy is compared against).

The average is a division and a sum. The division is the bucketer's: it divides each
gradient as it copies it into its bucket (`gradient_divisor`), so reduce_bucket only
sums what it is handed (a bucket given to it by hand must be divided first).

overlap="forward" changes when, not what: the buckets are reduced in chunks of
`chunk_mb`, those the next forward needs first (priority.py), backward returns without
waiting for them, and the optimizer steps each layer inside the next forward once its
gradients are in (step_in_forward.py). The same updates of the same sums (each element
summed in the order the algorithm takes for its chunk: with 3 or more ranks the ring
may add in another order than for the whole bucket); the next forward runs while the
last buckets are on the wire.
"""
from __future__ import annotations

from typing import Optional, Union

import torch

from .. import api
from ..priority import chunk_bytes_for
from .base import SyncStrategy, register
from .options import check_algorithm, need, one_of


OVERLAPS = ("backward", "forward")


@register("allreduce")
class AllReduce(SyncStrategy):
    def __init__(self, algorithm: str = "auto", overlap: str = "backward",
                 chunk_mb: Union[float, str] = "auto"):
        check_algorithm(self.name, algorithm)
        one_of(self.name, "overlap", overlap, OVERLAPS)
        need(chunk_mb == "auto" or (not isinstance(chunk_mb, str) and chunk_mb > 0),
             self.name, "chunk_mb", chunk_mb, "megabytes above 0, or auto")
        self.algorithm = algorithm
        # what communication overlaps: the rest of backward (DDP's), or the next forward
        self.overlap = overlap
        self.chunk_mb = chunk_mb  # "auto": sized for the links (priority.chunk_bytes_for)

    def setup(self, model: torch.nn.Module, comm) -> None:
        super().setup(model, comm)
        # overlap="forward": buckets are still being reduced while the training thread
        # runs the next forward (and whatever collectives a loop calls between steps)
        if self.overlap == "forward" and comm.world_size > 1:
            self.channel = comm.duplicate()
        if self.overlap == "forward":
            self.chunk_bytes = (chunk_bytes_for(comm) if self.chunk_mb == "auto"
                                else int(self.chunk_mb * (1 << 20)))

    def gradient_divisor(self) -> Optional[int]:
        # Divide first, then sum (as DDP does): the sum cannot overflow in fp16.
        return self.comm.world_size

    def reduce_bucket(self, flat: torch.Tensor) -> None:
        # The gradients came in divided (gradient_divisor): summing averages them.
        # check=False: the bucket layout was agreed across ranks when the model was wrapped.
        api.all_reduce(flat, op="sum", algorithm=self.algorithm, comm=self.bucket_comm,
                       check=False)
