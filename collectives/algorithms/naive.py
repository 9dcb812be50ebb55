r"""The teaching baseline: gather everything to one rank, reduce there, send it back.

    step 1: ranks 1..n-1 each send the whole buffer to rank 0
    step 2: rank 0 reduces them, in rank order
    step 3: rank 0 sends the result to ranks 1..n-1

Cost with K bytes (alpha, beta, gamma as in ring.py), counting rank 0's link, which
carries everything:

    all-reduce:  2 (n-1) (alpha + K beta) + (n-1) K gamma

Rank 0 moves 2(n-1)K bytes while the ring moves 2(n-1)/n K per rank: this is why the
other algorithms exist. Broadcast is the same idea: the root sends to each rank in turn.
"""
from __future__ import annotations

import torch

from ..transport import Transport
from .costs import Constants, Shape


def broadcast(comm: Transport, flat: torch.Tensor, root: int) -> None:
    if comm.rank == root:
        sends = [comm.isend(flat, peer) for peer in range(comm.world_size) if peer != root]
        for send in sends:
            send.wait()
    else:
        comm.recv(flat, root)


def all_reduce(comm: Transport, flat: torch.Tensor, op: str) -> None:
    if comm.world_size == 1 or flat.numel() == 0:
        return
    if comm.rank == 0:
        incoming = comm.workspace("naive scratch", flat, flat.numel())
        for peer in range(1, comm.world_size):
            comm.recv_reduce(flat, peer, op, incoming)
    else:
        comm.send(flat, 0)
    broadcast(comm, flat, root=0)


# The formulas of the module's notes, evaluated (see costs.py).

def broadcast_cost(nbytes: float, shape: Shape, c: Constants) -> float:
    """Rank 0 sends to every rank at once: the other hosts' ranks share its link."""
    n, local = shape.world_size, shape.ranks_per_host
    if n == 1:
        return 0.0
    inside = c.local.message(nbytes, local - 1) if local > 1 else 0.0
    across = 0.0
    if shape.hosts > 1:  # rank 0's link, idle before: its bucket counts once
        across = c.network.message(nbytes, n - local) - c.burst_saving((n - local) * nbytes)
    seconds = (n - 1) * c.per_message("naive", shape.hosts > 1) + max(inside, across)
    return max(seconds, c.link_bound((n - local) * nbytes if shape.hosts > 1 else 0.0))


def cost(nbytes: float, shape: Shape, c: Constants) -> float:
    """All-reduce: 2 (n-1) (alpha + K beta) + (n-1) K gamma, rank 0 receiving one by one"""
    gather = sum(c.per_message("naive", shape.host(peer) != 0)
                 + shape.route(shape.host(peer) != 0, c).message(nbytes)
                 + nbytes * c.gamma for peer in range(1, shape.world_size))
    if shape.hosts > 1:  # rank 0's link, idle before the first message from afar
        afar = (shape.world_size - shape.ranks_per_host) * nbytes
        gather = max(gather - c.burst_saving(afar), c.link_bound(afar))
    return gather + broadcast_cost(nbytes, shape, c)
