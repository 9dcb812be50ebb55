"""`gossip`: decentralized averaging with ring neighbours, no global collective.

Communicates: after every optimizer step, each rank sends its parameters (and
floating-point buffers) to its two ring neighbours and receives theirs, then keeps the
average of the three: x_i <- (x_{i-1} + x_i + x_{i+1}) / 3 (with two ranks, the
average of the pair). Gradients are never all-reduced. Each rank sends 2x the model
per step whatever the world size, and never waits for anyone but its neighbours.

The mixing matrix is doubly stochastic, so the mean of the parameters over ranks is
unchanged by gossip: the ranks' average follows plain SGD on the average gradient,
while consensus spreads around the ring a hop per step.

Checkpoint: gossip keeps no state between steps; each rank's replica (they differ
until consensus) is the model the trainer saves for every rank.

Literature: Lian et al., "Can Decentralized Algorithms Outperform Centralized
Algorithms?" (D-PSGD, NeurIPS 2017) show the same convergence rate as centralized
SGD; Assran et al., "Stochastic Gradient Push" (ICML 2019) scale it to 256 GPUs.
"""
from __future__ import annotations

import torch

from .base import SyncStrategy, register
from .local_sgd import averaged_tensors
from .options import check_algorithm


@register("gossip")
class Gossip(SyncStrategy):
    uses_buckets = False
    forward_buffer_sync = False
    replicas_differ = True  # the model is the average of the replicas

    def __init__(self, algorithm: str = "auto"):
        # Taken (every strategy takes one) but unused: gossip sends point to point only.
        check_algorithm(self.name, algorithm)

    def after_step(self, model: torch.nn.Module, step: int) -> None:
        comm, n = self.comm, self.comm.world_size
        if n == 1:
            return
        tensors = averaged_tensors(model)
        mine = torch.cat([t.reshape(-1) for t in tensors])
        right, left = (comm.rank + 1) % n, (comm.rank - 1) % n
        from_left, from_right = torch.empty_like(mine), torch.empty_like(mine)
        comm.sendrecv(mine, right, from_left, left)
        if n == 2:
            mixed = (mine + from_left) / 2
        else:
            comm.sendrecv(mine, left, from_right, right)
            mixed = (from_left + mine + from_right) / 3
        offset = 0
        for tensor in tensors:
            tensor.copy_(mixed[offset:offset + tensor.numel()].view_as(tensor))
            offset += tensor.numel()
