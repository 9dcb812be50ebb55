r"""Binomial-tree broadcast and reduce, and tree all-reduce (reduce, then broadcast).

Ranks are renumbered relative to the root (v = (rank - root) mod n). In a binomial
tree, v receives from v - mask where mask is v's lowest set bit, and sends to
v + mask for every smaller power of two. Broadcast, n = 8, root 0:

    step 1:  0 -> 4
    step 2:  0 -> 2          4 -> 6
    step 3:  0 -> 1   2 -> 3   4 -> 5   6 -> 7

Reduce runs the same tree bottom-up: each rank reduces what its children send,
then sends the partial result to its parent.

Cost with K bytes (alpha, beta, gamma as in ring.py):

    broadcast:   ceil(log2 n) (alpha + K beta)
    reduce:      ceil(log2 n) (alpha + K beta + K gamma)
    all-reduce:  2 ceil(log2 n) (alpha + K beta) + ceil(log2 n) K gamma

Few messages (good for small buffers) but every hop carries the whole buffer
(poor for large ones, where the ring's 2(n-1)/n K beta wins). The root computes the
result and broadcasts it, so every rank ends bitwise identical.
"""
from __future__ import annotations

import torch

from ..transport import Transport
from .costs import Constants, Shape


def broadcast(comm: Transport, flat: torch.Tensor, root: int) -> None:
    """Copy the root's `flat` to every rank, in place."""
    n = comm.world_size
    v = (comm.rank - root) % n
    mask = 1
    while mask < n:  # find our parent: the rank that differs in our lowest set bit
        if v & mask:
            comm.recv(flat, (v - mask + root) % n)
            break
        mask <<= 1
    sends = []
    mask >>= 1
    while mask > 0:  # pass it on to our children, farthest first
        if v + mask < n:
            sends.append(comm.isend(flat, (v + mask + root) % n))
        mask >>= 1
    for send in sends:
        send.wait()


def reduce(comm: Transport, flat: torch.Tensor, op: str, root: int) -> None:
    """Reduce every rank's `flat` into the root's. Other ranks' `flat` end partial."""
    n = comm.world_size
    v = (comm.rank - root) % n
    incoming = None
    mask = 1
    while mask < n:
        if v & mask:  # our subtree is done: hand it to the parent
            comm.send(flat, (v - mask + root) % n)
            return
        child = v + mask
        if child < n:
            if incoming is None:  # scratch, for transports that need one
                incoming = torch.empty_like(flat)
            comm.recv_reduce(flat, (child + root) % n, op, incoming)
        mask <<= 1


def all_reduce(comm: Transport, flat: torch.Tensor, op: str) -> None:
    """Reduce to rank 0 along the tree, then broadcast back down it."""
    if comm.world_size == 1 or flat.numel() == 0:
        return
    reduce(comm, flat, op, root=0)
    broadcast(comm, flat, root=0)


# The formulas of the module's notes, evaluated (see costs.py). Level by level: at
# each level every pair moves the whole buffer at once; a level lasts as long as its
# slowest message (streams leaving one host share its link). Links rest between the
# levels that cross hosts, so each such level starts on an idle link.

def _levels(n: int):
    """The (child, parent) pairs of each level, leaves first."""
    mask = 1
    while mask < n:
        yield [(v + mask, v) for v in range(0, n, 2 * mask) if v + mask < n]
        mask <<= 1


def _down(shape: Shape):
    return [[(parent, child) for child, parent in pairs] for pairs in _levels(shape.world_size)]


def _steps(nbytes: float, shape: Shape, c: Constants, levels, algorithm: str,
           reduce: bool) -> float:
    return sum(shape.pairs_step(pairs, nbytes, c, algorithm, idle_link=True)
               + (nbytes * c.gamma if reduce else 0.0) for pairs in levels)


def broadcast_cost(nbytes: float, shape: Shape, c: Constants, algorithm: str = "tree") -> float:
    """ceil(log2 n) (alpha + K beta), from rank 0"""
    down = _down(shape)
    return max(_steps(nbytes, shape, c, down, algorithm, reduce=False),
               c.link_bound(shape.link_bytes((pairs, nbytes) for pairs in down)))


def reduce_cost(nbytes: float, shape: Shape, c: Constants) -> float:
    """ceil(log2 n) (alpha + K beta + K gamma), to rank 0"""
    up = list(_levels(shape.world_size))
    return max(_steps(nbytes, shape, c, up, "tree", reduce=True),
               c.link_bound(shape.link_bytes((pairs, nbytes) for pairs in up)))


def cost(nbytes: float, shape: Shape, c: Constants) -> float:
    """All-reduce: 2 ceil(log2 n) (alpha + K beta) + ceil(log2 n) K gamma"""
    up, down = list(_levels(shape.world_size)), _down(shape)
    steps = (_steps(nbytes, shape, c, up, "tree", reduce=True)
             + _steps(nbytes, shape, c, down, "tree", reduce=False))
    return max(steps, c.link_bound(shape.link_bytes((pairs, nbytes) for pairs in up + down)))
