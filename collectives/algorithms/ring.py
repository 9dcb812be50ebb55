r"""Ring reduce-scatter, ring all-gather, and ring all-reduce made of the two.

Ranks stand in a ring; each only ever sends to its right and receives from its left:

        +--> 0 --> 1 --+
        |              |          send_to   = (rank + 1) % n
        +--- 3 <-- 2 <-+          recv_from = (rank - 1) % n

The buffer is cut into n chunks (sizes differ by at most one element; some may be
empty when the buffer is smaller than the world). With n = 4, rank r at step s:

    reduce-scatter: send chunk r-s-1, receive chunk r-s-2 and reduce it into ours
        step 0: rank 0 sends c3 / adds c2   rank 1 sends c0 / adds c3   ...
        after n-1 steps rank r holds chunk r fully reduced.
    all-gather:     send chunk r-s,   receive chunk r-s-1 and store it
        after n-1 more steps every rank holds every reduced chunk.

    chunk:    c0        c1        c2        c3
    owner:    rank 0    rank 1    rank 2    rank 3     (after reduce-scatter)

Unlike the textbook version that passes the whole buffer around the ring (n-1 full
transfers), this one is chunked and bandwidth-optimal: each rank sends
2(n-1)/n of the buffer in all. With K bytes, latency alpha per message, beta seconds
per byte and gamma seconds per reduced byte:

    reduce-scatter or all-gather:   (n-1) alpha + (n-1)/n K beta  (+ (n-1)/n K gamma)
    all-reduce:                    2(n-1) alpha + 2(n-1)/n K beta + (n-1)/n K gamma

Through shared memory on one host the reduce-scatter's middle n-2 steps move nothing
of their own (see below: each sum is written straight into the next outgoing slot),
so the all-reduce moves n/n K: K beta instead of 2(n-1)/n K beta. This is what puts
the ring ahead of halving-doubling on a host whose ranks each have a core (docs/
benchmarks.md, "auto against the quickest fixed algorithm").

Pipelining: every chunk is cut into segments (the transport's `segment_bytes`, 4 MiB:
every message pays a fixed cost, so smaller segments are slower on one host; on a slow
link between hosts smaller, Transport.segment_for_link, so that the next link of the
ring does not idle while a whole segment arrives). A segment is forwarded to the right
as soon as it has been reduced, and the next step's receives are posted before this
step's are reduced, so reducing one segment overlaps moving the next. Reduce-scatter
receives with `irecv_reduce(..., forward_to=right)`: receive, add our segment, pass
the sum on. Through shared memory that is one pass over memory (the incoming slot
plus our segment, written straight into the outgoing slot, as NCCL's recvReduceSend);
otherwise the message lands in one of two scratch buffers, used on alternate steps
so an early receive never overwrites data still waiting to be reduced, and the sum
is sent from our buffer. Measured: docs/benchmarks.md, "Shared memory: slot and
segment sizes" and "Ring segment size over TCP".

Order: a step posts its receives before its sends wherever it can. Over TCP (gloo)
a message moves only once its receive is posted, and the receiver's "ready" notice
travels in the same stream as its own outgoing data: with the sends posted first,
each side's notice queues behind its own data and the two directions take turns;
with the receives first, both move at once. Measured: docs/cluster.md, "The ring
over TCP: receives before sends". The one exception: a reduce-scatter of more than 2
ranks sends its first chunk before posting step 0's receives, because those pass
their sums on to the same rank, and sends to a rank arrive in the order they were
posted (relays included): posted first, a relay's sum would overtake the chunk the
right neighbour expects first.

Step by step (NCCL, `comm.step_by_step`): NCCL runs a rank's postings one after
another, so nothing may be posted ahead of its step. There each step is one
`exchange` (this step's send and receive, one NCCL group), and the received chunk is
reduced after it: the textbook ring, without segments (NCCL pipelines a message
itself).

Every chunk's final value is computed on one rank and copied to the rest, so all ranks
end bitwise identical.
"""
from __future__ import annotations

from typing import Callable, List, Optional

import torch

from ..transport import Transport
from ..transport.base import Handle, reduce_into
from .. import trace
from ..transport.group import Group
from .common import chunk_bounds, segments
from .costs import Constants, Shape, messages

SEGMENT_BYTES = Transport.segment_bytes  # the default piece of a message (costs only)


def _segment_elems(comm: Transport, flat: torch.Tensor, segment_bytes: Optional[int]) -> int:
    return max(1, (segment_bytes or comm.segment_bytes) // flat.element_size())


def reduce_scatter(comm: Transport, flat: torch.Tensor, op: str,
                   bounds: Optional[List[int]] = None,
                   segment_bytes: Optional[int] = None,
                   post_next: Optional[Callable[[], List[Handle]]] = None) -> List[Handle]:
    """Reduce over ranks so that rank r ends with chunk r of `flat` fully reduced.

    `bounds` are the chunk offsets (default: n nearly equal chunks). Other chunks of
    `flat` are left holding partial results.

    post_next: posts the receives of what comes next (all_reduce's all-gather) and
    returns them; it is called as the last step begins, once the first chunk this rank
    sent (chunk r-1) has gone, so that the left neighbour may send the moment it is
    ready, with no round trip between the two phases. What it posts may write chunk
    r-1 only: the other chunks are still in use. Returns what it returned (nothing
    without it, or alone in the world: then nothing follows).
    """
    n, rank = comm.world_size, comm.rank
    if n == 1:
        return []
    bounds = bounds or chunk_bounds(flat.numel(), n)
    if comm.step_by_step:  # nothing may be posted ahead there: no post_next
        if post_next is not None:
            raise ValueError("reduce_scatter: post_next posts ahead, which a step-by-step "
                             "transport (NCCL) cannot take")
        _reduce_scatter_by_steps(comm, flat, op, bounds)
        return []
    send_to, recv_from = (rank + 1) % n, (rank - 1) % n
    seg = _segment_elems(comm, flat, segment_bytes)

    def pieces(step: int):  # the segments of the chunk this rank receives at `step`
        chunk = (rank - step - 2) % n
        return segments(bounds[chunk], bounds[chunk + 1], seg)

    largest = max(b - a for a, b in zip(bounds, bounds[1:]))
    # alternate steps; kept by the communicator from call to call (Transport.workspace)
    scratch = [comm.workspace(f"ring scratch {i}", flat, largest) for i in (0, 1)]

    def post_receives(step: int):  # each adds our segment and, but at the end, passes it on
        base = bounds[(rank - step - 2) % n]
        buffer = scratch[step % 2]
        forward = None if step == n - 2 else send_to
        return [comm.irecv_reduce(flat[lo:hi], recv_from, op, buffer[lo - base:hi - base],
                                  forward_to=forward)
                for lo, hi in pieces(step)]

    def send_first_chunk():
        first = (rank - 1) % n
        return [comm.isend(flat[lo:hi], send_to)
                for lo, hi in segments(bounds[first], bounds[first + 1], seg)]

    if n == 2:  # receives first (see "Order" above): step 0 passes nothing on
        receives = post_receives(0)
        first_sends = send_first_chunk()
    else:  # step 0's receives pass their sums on: our own chunk must go out before them
        first_sends = send_first_chunk()
        receives = post_receives(0)
    forwards: List[Handle] = []
    for step in range(n - 1):
        last = step == n - 2
        if not last:
            next_receives = post_receives(step + 1)  # use the other scratch
        elif post_next:
            for send in first_sends:  # chunk r-1 is read out before anything may land there
                send.wait()
            first_sends = []
            next_receives = post_next()
        else:
            next_receives = []
        with trace.span(f"ring reduce-scatter step {step}", cat="comm.step", level=2,
                        send_to=send_to, recv_from=recv_from):
            for receive in receives:
                receive.wait()  # reduced, and on its way to the right unless this is the end
                forwards.append(receive.forward)
        receives = next_receives
    for send in first_sends + forwards:
        send.wait()
    return receives  # post_next's


def all_gather(comm: Transport, flat: torch.Tensor, bounds: Optional[List[int]] = None,
               segment_bytes: Optional[int] = None,
               first_receives: Optional[List[Handle]] = None) -> None:
    """Given rank r holding chunk r of `flat`, leave every rank holding every chunk.

    first_receives: step 0's receives, already posted by all_gather_receives."""
    n, rank = comm.world_size, comm.rank
    if n == 1:
        return
    bounds = bounds or chunk_bounds(flat.numel(), n)
    if comm.step_by_step:
        if first_receives is not None:
            raise ValueError("all_gather: receives posted ahead cannot be taken on a "
                             "step-by-step transport (NCCL)")
        return _all_gather_by_steps(comm, flat, bounds)
    send_to, recv_from = (rank + 1) % n, (rank - 1) % n
    seg = _segment_elems(comm, flat, segment_bytes)

    def pieces(step: int):  # the segments of the chunk this rank receives at `step`
        return _gathered_pieces(n, rank, step, bounds, seg)

    def post_receives(step: int):
        return [comm.irecv(flat[lo:hi], recv_from) for lo, hi in pieces(step)]

    # receives first: see "Order" above
    receives = post_receives(0) if first_receives is None else first_receives
    sends = [comm.isend(flat[lo:hi], send_to)
             for lo, hi in segments(bounds[rank], bounds[rank + 1], seg)]
    for step in range(n - 1):
        last = step == n - 2
        next_receives = [] if last else post_receives(step + 1)
        with trace.span(f"ring all-gather step {step}", cat="comm.step", level=2,
                        send_to=send_to, recv_from=recv_from):
            for (lo, hi), receive in zip(pieces(step), receives):
                receive.wait()
                if not last:  # forward what just arrived: it is the next step's send
                    sends.append(comm.isend(flat[lo:hi], send_to))
        receives = next_receives
    for send in sends:
        send.wait()


def _ring_step(comm: Transport, flat: torch.Tensor, bounds: List[int], send_chunk: int,
               incoming: torch.Tensor, recv_chunk: int) -> torch.Tensor:
    """One step by itself: chunk `send_chunk` of `flat` to the right, chunk `recv_chunk`
    from the left into `incoming` (its first elements), as one exchange. An empty
    chunk is not sent: both sides know its size. Returns what was received."""
    n = comm.world_size
    outgoing = flat[bounds[send_chunk]:bounds[send_chunk + 1]]
    incoming = incoming[:bounds[recv_chunk + 1] - bounds[recv_chunk]]
    comm.exchange([(outgoing, (comm.rank + 1) % n)] if outgoing.numel() else [],
                  [(incoming, (comm.rank - 1) % n)] if incoming.numel() else [])
    return incoming


def _reduce_scatter_by_steps(comm: Transport, flat: torch.Tensor, op: str,
                             bounds: List[int]) -> None:
    """reduce_scatter one exchange a step (see "Step by step"): at step s rank r sends
    chunk r-s-1 (its own, then the sum it reduced last step) and reduces chunk r-s-2."""
    n, rank = comm.world_size, comm.rank
    largest = max(b - a for a, b in zip(bounds, bounds[1:]))
    scratch = comm.workspace("ring scratch 0", flat, largest)
    for step in range(n - 1):
        chunk = (rank - step - 2) % n
        with trace.span(f"ring reduce-scatter step {step}", cat="comm.step", level=2):
            incoming = _ring_step(comm, flat, bounds, (rank - step - 1) % n, scratch, chunk)
            reduce_into(flat[bounds[chunk]:bounds[chunk + 1]], incoming, op)


def _all_gather_by_steps(comm: Transport, flat: torch.Tensor, bounds: List[int]) -> None:
    """all_gather one exchange a step: at step s rank r passes chunk r-s on and
    receives chunk r-s-1 in place."""
    n, rank = comm.world_size, comm.rank
    for step in range(n - 1):
        chunk = (rank - step - 1) % n
        with trace.span(f"ring all-gather step {step}", cat="comm.step", level=2):
            _ring_step(comm, flat, bounds, (rank - step) % n,
                       flat[bounds[chunk]:bounds[chunk + 1]], chunk)


def _gathered_pieces(n: int, rank: int, step: int, bounds: List[int], seg: int):
    """The segments of the chunk `rank` receives at all-gather step `step`."""
    chunk = (rank - step - 1) % n
    return segments(bounds[chunk], bounds[chunk + 1], seg)


def all_gather_receives(comm: Transport, flat: torch.Tensor, bounds: List[int],
                        segment_bytes: Optional[int] = None) -> List[Handle]:
    """Post all_gather's step 0 receives: chunk r-1, from the left neighbour."""
    seg = _segment_elems(comm, flat, segment_bytes)
    return [comm.irecv(flat[lo:hi], (comm.rank - 1) % comm.world_size)
            for lo, hi in _gathered_pieces(comm.world_size, comm.rank, 0, bounds, seg)]


def all_reduce(comm: Transport, flat: torch.Tensor, op: str,
               segment_bytes: Optional[int] = None) -> None:
    """Ring all-reduce in place: reduce-scatter, then all-gather.

    The ring visits ranks host by host (comm.topology.ring_order()), so that however a
    launcher placed the ranks, only one stream leaves and one enters each host.

    The all-gather's first receives are posted as the reduce-scatter's last step
    begins. They write chunk r-1, which the reduce-scatter reads only for its first
    send, waited before they are posted (a formality: the sum the left neighbour sends
    in the all-gather includes what that send carried, so it was delivered long since).
    """
    order = comm.topology.ring_order()
    if order != list(range(comm.world_size)):
        comm = Group(comm, order)
    bounds = chunk_bounds(flat.numel(), comm.world_size)
    if comm.step_by_step:  # nothing posted ahead (see "Step by step")
        reduce_scatter(comm, flat, op, bounds)
        all_gather(comm, flat, bounds)
        return
    first_receives = reduce_scatter(
        comm, flat, op, bounds, segment_bytes,
        post_next=lambda: all_gather_receives(comm, flat, bounds, segment_bytes))
    all_gather(comm, flat, bounds, segment_bytes, first_receives)


# The formulas of the module's notes, evaluated (see costs.py). The ring visits the
# ranks host by host, so with several hosts every step has one stream leaving each
# host: each step lasts as long as its network message. `algorithm` names whose
# per-message overhead is paid (hierarchical and native run this ring as theirs).

def _step_cost(chunk: float, shape: Shape, c: Constants, segment_bytes: int,
               algorithm: str, moved: Optional[float] = None) -> float:
    """One step: the messages of a `chunk`, moving `moved` bytes of it (all by default)."""
    network = shape.hosts > 1
    route = shape.route(crosses_hosts=network, c=c)
    per_message = route.alpha + c.per_message(algorithm, network)
    moved = chunk if moved is None else moved
    return c.step(messages(chunk, segment_bytes) * per_message, moved * route.beta,
                  shape.world_size)


def _relayed(shape: Shape, c: Constants) -> int:
    """How many reduce-scatter steps move no bytes of their own: through shared memory
    on one host, a step's receive adds straight out of its slot into the next step's
    outgoing slot (irecv_reduce with forward_to), so steps 1 to n-2 send what the step
    before already wrote, and the last step's receive is that same pass. Elsewhere a
    relay's sum is a send of its own."""
    return max(shape.world_size - 2, 0) if shape.hosts == 1 and c.shared_memory else 0


def _steps_cost(nbytes: float, shape: Shape, c: Constants, segment_bytes: int,
                algorithm: str, steps_per_rank: int, relayed: int = 0) -> float:
    """`steps_per_rank` ring steps of one chunk each, links busy from first to last;
    `relayed` of them move no bytes of their own (_relayed)."""
    chunk = nbytes / shape.world_size
    moving = _step_cost(chunk, shape, c, segment_bytes, algorithm)
    relaying = _step_cost(chunk, shape, c, segment_bytes, algorithm, moved=0.0)
    return (steps_per_rank - relayed) * moving + relayed * relaying


def _link_bytes(nbytes: float, shape: Shape, steps: int) -> float:
    """What each link carries each way in `steps` steps (none on one host)."""
    return steps * nbytes / shape.world_size if shape.hosts > 1 else 0.0


def reduce_scatter_cost(nbytes: float, shape: Shape, c: Constants,
                        segment_bytes: int = SEGMENT_BYTES, algorithm: str = "ring") -> float:
    """(n-1) alpha + (n-1)/n K beta + (n-1)/n K gamma"""
    n = shape.world_size
    link = _link_bytes(nbytes, shape, n - 1)
    steps = _steps_cost(nbytes, shape, c, segment_bytes, algorithm, n - 1, _relayed(shape, c))
    return max(steps + (n - 1) / n * nbytes * c.gamma - c.burst_saving(link),
               c.link_bound(link))


def all_gather_cost(nbytes: float, shape: Shape, c: Constants,
                    segment_bytes: int = SEGMENT_BYTES, algorithm: str = "ring") -> float:
    """(n-1) alpha + (n-1)/n K beta"""
    n = shape.world_size
    link = _link_bytes(nbytes, shape, n - 1)
    return max(_steps_cost(nbytes, shape, c, segment_bytes, algorithm, n - 1)
               - c.burst_saving(link), c.link_bound(link))


def cost(nbytes: float, shape: Shape, c: Constants, segment_bytes: int = SEGMENT_BYTES,
         algorithm: str = "ring", idle_link: bool = True) -> float:
    """All-reduce: 2(n-1) alpha + 2(n-1)/n K beta + (n-1)/n K gamma

    (`idle_link`: the links rested before this call; a pipeline's later chunks find
    them busy.)"""
    n = shape.world_size
    link = _link_bytes(nbytes, shape, 2 * (n - 1))
    saving = c.burst_saving(link) if idle_link else 0.0
    steps = _steps_cost(nbytes, shape, c, segment_bytes, algorithm, 2 * (n - 1),
                        _relayed(shape, c))
    return max(steps + (n - 1) / n * nbytes * c.gamma - saving, c.link_bound(link))
