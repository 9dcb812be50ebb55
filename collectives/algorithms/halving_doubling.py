r"""Recursive halving-doubling all-reduce (Rabenseifner's algorithm).

For a power-of-two world p, in log2(p) steps each, with partner = rank XOR distance:

    reduce-scatter by recursive halving      all-gather by recursive doubling
    (distance p/2, p/4, ..., 1)              (distance 1, 2, ..., p/2)

    p = 4, buffer in 4 blocks [b0 b1 b2 b3]:
    step 1, distance 2:  0<->2, 1<->3   ranks 0,1 keep b0 b1; ranks 2,3 keep b2 b3
                         (each sends the half it gives up, reduces the half it keeps)
    step 2, distance 1:  0<->1, 2<->3   rank 0 keeps b0, 1 keeps b1, 2 b2, 3 b3
    then the same exchanges in reverse order, sending what we own and receiving
    what the partner owns, until every rank has all four blocks.

Non-power-of-two worlds, n = p + extra: the first 2*extra ranks pair up first. Each
even one hands its whole buffer to the odd one after it and sits out; the odd one
reduces the two. The remaining p ranks run the algorithm above, and at the end each
odd rank hands the result back to its even partner (as MPICH does).

Cost with K bytes (alpha, beta, gamma as in ring.py):

    power of two:  2 log2(p) alpha + 2 (p-1)/p K beta + (p-1)/p K gamma
    otherwise add: 2 alpha + 2 K beta + K gamma   (the fold and the hand-back)

Same bandwidth as the ring with log2(p) instead of (p-1) latency terms, so it wins
for medium messages on larger worlds. Each block's final value is computed once and
copied, so every rank ends bitwise identical.
"""
from __future__ import annotations

import torch

from ..transport import Transport
from ..transport.base import reduce_into
from .common import chunk_bounds
from .costs import Constants, Shape


def all_reduce(comm: Transport, flat: torch.Tensor, op: str) -> None:
    n, rank = comm.world_size, comm.rank
    if n == 1 or flat.numel() == 0:
        return
    p = 1 << (n.bit_length() - 1)  # largest power of two <= n
    extra = n - p

    # 1. Fold the extra ranks in: even ranks below 2*extra hand over and sit out.
    if rank < 2 * extra:
        if rank % 2 == 0:
            comm.send(flat, rank + 1)
            comm.recv(flat, rank + 1)  # 4. the result comes back at the end
            return
        comm.recv_reduce(flat, rank - 1, op,
                         comm.workspace("halving-doubling scratch", flat, flat.numel()))
        newrank = rank // 2
    else:
        newrank = rank - extra

    def real_rank(new: int) -> int:
        return new * 2 + 1 if new < extra else new + extra

    # 2. Reduce-scatter by recursive halving over p blocks.
    bounds = chunk_bounds(flat.numel(), p)
    # the largest half (bigger blocks come first), kept from call to call
    scratch = comm.workspace("halving-doubling scratch", flat, bounds[p // 2])
    lo, hi = 0, p  # the blocks this rank is still responsible for
    exchanges = []
    distance = p // 2
    while distance >= 1:
        partner = real_rank(newrank ^ distance)
        mid = (lo + hi) // 2
        if newrank & distance:
            keep, give = (mid, hi), (lo, mid)
        else:
            keep, give = (lo, mid), (mid, hi)
        keep_elems = slice(bounds[keep[0]], bounds[keep[1]])
        give_elems = slice(bounds[give[0]], bounds[give[1]])
        incoming = scratch[:keep_elems.stop - keep_elems.start]
        if comm.step_by_step:  # one exchange, then the reduction (ring.py, "Step by step")
            comm.exchange([(flat[give_elems], partner)], [(incoming, partner)])
            reduce_into(flat[keep_elems], incoming, op)
        else:
            receiving = comm.irecv_reduce(flat[keep_elems], partner, op, incoming)
            sending = comm.isend(flat[give_elems], partner)
            receiving.wait()
            sending.wait()
        exchanges.append((partner, keep_elems, give_elems))
        lo, hi = keep
        distance //= 2

    # 3. All-gather by recursive doubling: undo the exchanges in reverse order.
    for partner, keep_elems, give_elems in reversed(exchanges):
        comm.sendrecv(flat[keep_elems], partner, flat[give_elems], partner)

    # 4. Hand the result back to the rank that sat out.
    if rank < 2 * extra:
        comm.send(flat, rank - 1)


def cost(nbytes: float, shape: Shape, c: Constants) -> float:
    """The formula of the module's notes, evaluated (see costs.py): each exchange is a
    step in which every pair swaps its share both ways at once. The links stay busy
    through the call (their bucket counts once, on the first step)."""
    n = shape.world_size
    if n == 1:
        return 0.0
    p = 1 << (n.bit_length() - 1)
    extra = n - p
    real = [new * 2 + 1 if new < extra else new + extra for new in range(p)]
    name = "halving-doubling"
    steps = []  # (pairs, bytes each, bytes reduced)
    if extra:  # the fold and the hand-back: the even ranks' whole buffer, there and back
        fold = [(2 * i, 2 * i + 1) for i in range(extra)]
        steps.append((fold, nbytes, nbytes))
    distance = p // 2
    while distance >= 1:  # halving, then the same exchanges again doubling
        pairs = [(real[v], real[v ^ distance]) for v in range(p)]
        steps.append((pairs, nbytes * distance / p, nbytes * distance / p))
        steps.append((pairs, nbytes * distance / p, 0.0))
        distance //= 2
    if extra:
        steps.append(([(b, a) for a, b in fold], nbytes, 0.0))
    seconds = sum(shape.pairs_step(pairs, size, c, name, idle_link=index == 0)
                  + reduced * c.gamma for index, (pairs, size, reduced) in enumerate(steps))
    return max(seconds, c.link_bound(shape.link_bytes((pairs, size) for pairs, size, _ in steps)))
