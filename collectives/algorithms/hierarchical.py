r"""Hierarchical all-reduce: shared memory inside each host, the network between hosts.

Real clusters have several ranks per host (GPUs on a fast local link) and a slower
network between hosts. A flat ring sends 2(n-1)/n of the buffer over every host's
link; this sends 2(H-1)/H, in three phases (Horovod's hierarchical all-reduce, NCCL's
trees and rings across nodes do the same):

    H = 2 hosts of L = 2 ranks, buffer cut into L slices s0 s1

    host A: ranks 0 1          host B: ranks 2 3
    1. reduce-scatter inside each host (shared memory):
         rank 0 holds s0 summed over A, rank 1 s1 over A; rank 2 s0 over B, rank 3 s1 over B
    2. all-reduce each slice across hosts, among the ranks holding it (the network):
         s0: rank 0 <-> rank 2          s1: rank 1 <-> rank 3      (every NIC busy)
    3. all-gather inside each host (shared memory): every rank holds every slice

Cost for H hosts of L ranks and K bytes (ring in every phase; beta_local, beta_net the
seconds per byte inside a host and over a host's link):

    1 and 3: each rank sends (L-1)/L K inside its host, twice:  2 (L-1)/L K beta_local
    2:       each rank all-reduces K/L over H ranks; its host's link carries
             L x 2(H-1)/H x K/L = 2(H-1)/H K:                  2 (H-1)/H K beta_net
    against the flat ring's 2(n-1)/n K beta_net, n = H L. For 2 x 2: 1.0 K instead of
    1.5 K over each link; 2 x 4: 1.0 K instead of 1.75 K; 4 x 2: 1.5 K instead of 1.75 K.

Hosts of different sizes (1 and 3 ranks, say) work too: the buffer is cut into S slices,
S the most ranks on any host, and on a host of L ranks local rank i holds slices
i*S//L up to (i+1)*S//L (several when L < S). Phase 2 runs one all-reduce per slice
among its holders, in slice order on every rank, so no two ranks wait on each other in
opposite orders.

Every slice's final value is computed by one cross-host ring and copied within each
host, so all ranks end bitwise identical. With one host, or one rank per host, there
is one level only: a ring in host order.

Pipelining. Run one after another, the phases leave the network idle during 1 and 3.
A big buffer is therefore cut into chunks (PIPELINE_CHUNK_BYTES each, at most
MAX_CHUNKS) that go through the phases like cars through a car wash: while the network
carries chunk k across hosts (phase 2, on a thread of its own), the host already
reduce-scatters chunk k+1 and all-gathers chunk k-1 (phases 1 and 3):

    local thread:    1(c0) 1(c1) 1(c2) 1(c3)      3(c0)      3(c1)      3(c2)      3(c3)
    network thread:        2(c0)======== 2(c1)======== 2(c2)======== 2(c3)========

The two threads never talk to the same peer (phases 1 and 3 stay inside the host,
phase 2 only crosses hosts), and phase 2 runs on a duplicate of the communicator, so
their messages cannot mix. Only the first chunk's phase 1 and the last one's phase 3
are not hidden behind the network.

Failures. When either thread fails (a peer died, stalled past the timeout, or a
phase raised), the other is woken and the call waits for the network thread to end
before it raises: no thread of this call is left on the duplicate communicator.
That wait is short: the thread is either waiting for a chunk (woken at once) or
inside one transport call, which ends within the communicator's timeout, at once
when the peer has died. The duplicate is then retired: a peer's network thread may
have sent part of a chunk that ours never received, and a later call would take
that message for its own. Later pipelined calls on the communicator raise PeerError
naming the first failure instead of racing or reading stale data.
"""
from __future__ import annotations

import threading
from dataclasses import replace
from typing import List

import torch

from ..transport import PeerError, Transport
from ..transport.group import Group
from . import ring
from .common import chunk_bounds
from .costs import Constants, Route, Shape


def slices_held(local_size: int, slices: int, local_rank: int) -> range:
    """The slices local rank `local_rank` of a host of `local_size` ranks holds."""
    return range(local_rank * slices // local_size, (local_rank + 1) * slices // local_size)


PIPELINE_CHUNK_BYTES = 4 << 20  # a chunk of the pipeline (see the module's notes)
MAX_CHUNKS = 16


def all_reduce(comm: Transport, flat: torch.Tensor, op: str) -> None:
    topology = comm.topology
    if len(topology.hosts) == 1 or topology.one_rank_per_host:
        return ring.all_reduce(comm, flat, op)  # one level: the ring visits hosts in order
    host = Group(comm, topology.local_ranks(comm.rank))
    chunks = min(MAX_CHUNKS, flat.numel() * flat.element_size() // PIPELINE_CHUNK_BYTES)
    # NCCL (step_by_step): the phases one after another on this thread. A second thread's
    # NCCL calls would wait on this one's through the GPU's stream they share, and with
    # peers that post the two threads' steps in another order, wait forever.
    if chunks <= 1 or comm.step_by_step:
        _inside_host(host, flat, op)
        _across_hosts(comm, flat, op)
        _gather_inside_host(host, flat)
        return
    edges = chunk_bounds(flat.numel(), chunks)
    _pipelined(comm, host, [flat[edges[i]:edges[i + 1]] for i in range(chunks)], op)


def _slice_bounds(comm: Transport, flat: torch.Tensor) -> List[int]:
    """Element offsets of the S slices of `flat` (S: the most ranks on any host)."""
    return chunk_bounds(flat.numel(), max(len(h) for h in comm.topology.hosts))


def _element_bounds(host: Transport, bounds: List[int], numel: int) -> List[int]:
    """Where each local rank's run of slices starts, for a ring over the host."""
    slices, size = len(bounds) - 1, host.world_size
    return [bounds[i * slices // size] for i in range(size)] + [numel]


def _inside_host(host: Group, flat: torch.Tensor, op: str) -> None:
    """Phase 1: reduce-scatter among the ranks of this host (shared memory)."""
    bounds = _slice_bounds(host.parent, flat)
    ring.reduce_scatter(host, flat, op, _element_bounds(host, bounds, flat.numel()))


def _across_hosts(network: Transport, flat: torch.Tensor, op: str) -> None:
    """Phase 2: all-reduce each slice this rank holds among its holders on every host."""
    hosts, slices = network.topology.hosts, max(len(h) for h in network.topology.hosts)
    bounds = _slice_bounds(network, flat)
    local = network.topology.local_ranks(network.rank)
    for piece in slices_held(len(local), slices, local.index(network.rank)):
        holders = [_holder(h, piece, slices) for h in hosts]
        ring.all_reduce(Group(network, holders), flat[bounds[piece]:bounds[piece + 1]], op)


def _gather_inside_host(host: Group, flat: torch.Tensor) -> None:
    """Phase 3: all-gather among the ranks of this host (shared memory)."""
    bounds = _slice_bounds(host.parent, flat)
    ring.all_gather(host, flat, _element_bounds(host, bounds, flat.numel()))


def _network_twin(comm: Transport) -> Transport:
    """A duplicate of `comm` for phase 2 on its own thread (made once, collectively:
    every rank reaches its first pipelined all-reduce in the same call).

    Refused once a pipelined call on `comm` has failed (see the notes on failures)."""
    failure = getattr(comm, "_hierarchical_network_failure", None)
    if failure is not None:
        raise PeerError(f"hierarchical all-reduce: the pipeline's network communicator "
                        f"failed earlier ({type(failure).__name__}: {failure}) and may "
                        f"hold messages of that call; it is not used again") from failure
    twin = getattr(comm, "_hierarchical_network", None)
    if twin is None:
        twin = comm._hierarchical_network = comm.duplicate()
    return twin


def _retire_network_twin(comm: Transport, failure: BaseException) -> None:
    """After a failed pipelined call (its network thread has ended): close the
    duplicate and remember why, so that no later call uses it."""
    comm._hierarchical_network_failure = failure
    twin, comm._hierarchical_network = getattr(comm, "_hierarchical_network", None), None
    if twin is not None:
        twin.close()


def _pipelined(comm: Transport, host: Group, chunks: List[torch.Tensor], op: str) -> None:
    """The three phases over chunks, phase 2 on a thread of its own (see the notes)."""
    network = _network_twin(comm)
    inside_done = [threading.Event() for _ in chunks]
    across_done = [threading.Event() for _ in chunks]
    failures: List[BaseException] = []

    def fail(error: BaseException) -> None:
        failures.append(error)
        for event in inside_done + across_done:
            event.set()  # wake whoever waits: the error is theirs too

    def network_thread() -> None:
        try:
            network.enter_thread()
            for chunk, ready, done in zip(chunks, inside_done, across_done):
                ready.wait()
                if failures:
                    return
                _across_hosts(network, chunk, op)
                done.set()
        except BaseException as error:
            fail(error)

    thread = threading.Thread(target=network_thread, name="collectives-hierarchical",
                              daemon=True)
    thread.start()
    try:
        for chunk, done in zip(chunks, inside_done):
            _inside_host(host, chunk, op)
            done.set()
        for chunk, done in zip(chunks, across_done):
            done.wait()
            if failures:
                raise failures[0]
            _gather_inside_host(host, chunk)
    except BaseException as error:
        if not failures:
            fail(error)
        # Wake-up sent (fail): it ends at its next chunk, or when the transport call
        # it is in returns or raises. Then nothing of ours is left on the duplicate.
        thread.join()
        _retire_network_twin(comm, failures[0])
        raise
    thread.join()  # it has finished its last chunk: the last across_done was set


def _holder(host: List[int], piece: int, slices: int) -> int:
    """The rank of `host` that holds slice `piece` after phase 1."""
    for local_rank, rank in enumerate(host):
        if piece in slices_held(len(host), slices, local_rank):
            return rank
    raise AssertionError(f"slice {piece} has no holder on host {host}")


def cost(nbytes: float, shape: Shape, c: Constants) -> float:
    """The formula of the module's notes, evaluated (see costs.py), with its pipeline.

    Per chunk of k bytes: phase 1 a ring reduce-scatter inside a host (t1), phase 2 L
    rings of k/L bytes across hosts at once, sharing each host's link (t2), phase 3 a
    ring all-gather inside the host (t3). The local thread runs phases 1 and 3 of every
    chunk, the network thread phase 2, so with c chunks the slower of the two sets the
    pace: t1 + t2 + t3 + (c - 1) max(t2, t1 + t3). The phases are the ring's code, with
    its per-message costs; the hierarchy's own (groups, the second thread, handing
    chunks over) is paid once per call: the "hierarchical" overhead."""
    hosts, local = shape.hosts, shape.ranks_per_host
    if hosts == 1 or local == 1:
        return ring.cost(nbytes, shape, c)
    chunks = max(1, min(MAX_CHUNKS, int(nbytes) // PIPELINE_CHUNK_BYTES))
    chunk = nbytes / chunks
    inside = Shape(1, local)
    t1 = ring.reduce_scatter_cost(chunk, inside, c)
    t3 = ring.all_gather_cost(chunk, inside, c)
    shared_link = replace(c, network=Route(c.network.alpha, c.network.beta * local))
    t2 = ring.cost(chunk / local, Shape(hosts, 1), shared_link, idle_link=False)
    link_bytes = 2 * (hosts - 1) / hosts * nbytes  # the whole call's, each way
    pipeline = t1 + t2 + t3 + (chunks - 1) * max(t2, t1 + t3) - c.burst_saving(link_bytes)
    return max(c.per_message("hierarchical", network=True) + pipeline,
               c.link_bound(link_bytes))
