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

from typing import List

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
                incoming = comm.workspace("tree scratch", flat, flat.numel())
            comm.recv_reduce(flat, (child + root) % n, op, incoming)
        mask <<= 1


def all_reduce(comm: Transport, flat: torch.Tensor, op: str) -> None:
    """Reduce to rank 0 along the tree, then broadcast back down it."""
    if comm.world_size == 1 or flat.numel() == 0:
        return
    reduce(comm, flat, op, root=0)
    broadcast(comm, flat, root=0)


# The formulas of the module's notes, evaluated (see costs.py). Reduce, level by
# level: at each level every pair moves the whole buffer at once (a child sends only
# once its subtree is done); a level lasts as long as its slowest message, streams
# leaving one host sharing its link, and starts on a rested link. Broadcast as it runs:
# a parent posts its sends to every child at once, so its sends that cross hosts share
# its link; each rank has the data at its parent's time plus its own message.

def _levels(n: int):
    """The (child, parent) pairs of each level of reduce(), leaves first."""
    mask = 1
    while mask < n:
        yield [(v + mask, v) for v in range(0, n, 2 * mask) if v + mask < n]
        mask <<= 1


def _children(v: int, n: int) -> List[int]:
    """Whom rank v (counted from the root) sends to in broadcast(), farthest first."""
    mask = 1
    while mask < n and not v & mask:  # v's lowest set bit (the root: past n)
        mask <<= 1
    children = []
    mask >>= 1
    while mask > 0:
        if v + mask < n:
            children.append(v + mask)
        mask >>= 1
    return children


def _broadcast_time(nbytes: float, shape: Shape, c: Constants, algorithm: str) -> float:
    n = shape.world_size
    arrival = [0.0] * n
    for parent in range(n):  # every child has a higher rank than its parent
        children = _children(parent, n)
        crossing = sum(shape.host(child) != shape.host(parent) for child in children)
        busy = 1 + len(children)
        for child in children:
            if shape.host(child) != shape.host(parent):
                message = c.step(c.network.alpha + c.per_message(algorithm, network=True),
                                 crossing * nbytes * c.network.beta
                                 - c.burst_saving(crossing * nbytes), busy)
            else:
                message = c.step(c.local.alpha + c.per_message(algorithm),
                                 nbytes * c.local.beta, busy)
            arrival[child] = arrival[parent] + message
    return max(arrival)


def _down_bytes(nbytes: float, shape: Shape) -> list:
    n = shape.world_size
    return [([(parent, child) for child in _children(parent, n)], nbytes) for parent in range(n)]


def _reduce_time(nbytes: float, shape: Shape, c: Constants) -> float:
    return sum(shape.pairs_step(pairs, nbytes, c, "tree", idle_link=True) + nbytes * c.gamma
               for pairs in _levels(shape.world_size))


def broadcast_cost(nbytes: float, shape: Shape, c: Constants, algorithm: str = "tree") -> float:
    """ceil(log2 n) (alpha + K beta), from rank 0"""
    return max(_broadcast_time(nbytes, shape, c, algorithm),
               c.link_bound(shape.link_bytes(_down_bytes(nbytes, shape))))


def cost(nbytes: float, shape: Shape, c: Constants) -> float:
    """All-reduce: 2 ceil(log2 n) (alpha + K beta) + ceil(log2 n) K gamma"""
    up = [(pairs, nbytes) for pairs in _levels(shape.world_size)]
    steps = _reduce_time(nbytes, shape, c) + _broadcast_time(nbytes, shape, c, "tree")
    return max(steps, c.link_bound(shape.link_bytes(up + _down_bytes(nbytes, shape))))
