r"""All-to-all by pairwise exchange: every rank sends a different piece to every other.

Rank r holds n pieces, piece p meant for rank p (pieces may differ in size). In step
s = 1..n-1 every rank sends to the rank s ahead and receives from the rank s behind,
so each step is a permutation and no link carries two messages at once:

    step 1:  0 -> 1, 1 -> 2, 2 -> 3, 3 -> 0
    step 2:  0 -> 2, 1 -> 3, 2 -> 0, 3 -> 1
    step 3:  0 -> 3, 1 -> 0, 2 -> 1, 3 -> 2

Piece r stays at rank r (a local copy). Cost with K bytes per piece (alpha, beta as
in ring.py): (n-1)(alpha + K beta), and each rank sends (n-1)K bytes: everything it
holds for others, once, which no algorithm can beat.
"""
from __future__ import annotations

from typing import List

import torch

from ..transport import Transport
from .costs import Constants, Shape


def all_to_all(comm: Transport, outputs: List[torch.Tensor],
               inputs: List[torch.Tensor]) -> None:
    """outputs[p] <- rank p's inputs[r] (this is rank r). Sizes must match pairwise."""
    n, me = comm.world_size, comm.rank
    outputs[me].copy_(inputs[me])
    for step in range(1, n):
        dst, src = (me + step) % n, (me - step) % n
        # One exchange a step (on NCCL one group); an empty piece is not sent (both
        # sides know it).
        comm.exchange([(inputs[dst], dst)] if inputs[dst].numel() else [],
                      [(outputs[src], src)] if outputs[src].numel() else [])


def cost(nbytes: float, shape: Shape, c: Constants) -> float:
    """All-to-all of `nbytes` per piece: (n-1)(alpha + K beta), step by step (costs.py)."""
    n = shape.world_size
    steps = [([(r, (r + step) % n) for r in range(n)], nbytes) for step in range(1, n)]
    seconds = sum(shape.pairs_step(pairs, size, c, "pairwise", idle_link=index == 0)
                  for index, (pairs, size) in enumerate(steps))
    return max(seconds, c.link_bound(shape.link_bytes(steps)))
