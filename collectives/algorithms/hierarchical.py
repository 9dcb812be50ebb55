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
"""
from __future__ import annotations

from typing import List

import torch

from ..transport import Transport
from ..transport.group import Group
from . import ring
from .common import chunk_bounds


def slices_held(local_size: int, slices: int, local_rank: int) -> range:
    """The slices local rank `local_rank` of a host of `local_size` ranks holds."""
    return range(local_rank * slices // local_size, (local_rank + 1) * slices // local_size)


def all_reduce(comm: Transport, flat: torch.Tensor, op: str) -> None:
    topology = comm.topology
    hosts = topology.hosts
    if len(hosts) == 1 or topology.one_rank_per_host:
        return ring.all_reduce(comm, flat, op)  # one level: the ring visits hosts in order
    me = comm.rank
    local = topology.local_ranks(me)
    slices = max(len(host) for host in hosts)
    bounds = chunk_bounds(flat.numel(), slices)  # element offsets of the slices

    def element_bounds(host: List[int]) -> List[int]:
        """Where each local rank's run of slices starts, for a ring over the host."""
        return [bounds[i * slices // len(host)] for i in range(len(host))] + [flat.numel()]

    host = Group(comm, local)
    ring.reduce_scatter(host, flat, op, element_bounds(local))          # 1. inside the host
    for piece in slices_held(len(local), slices, local.index(me)):      # 2. across hosts
        holders = [_holder(h, piece, slices) for h in hosts]
        ring.all_reduce(Group(comm, holders), flat[bounds[piece]:bounds[piece + 1]], op)
    ring.all_gather(host, flat, element_bounds(local))                  # 3. inside the host


def _holder(host: List[int], piece: int, slices: int) -> int:
    """The rank of `host` that holds slice `piece` after phase 1."""
    for local_rank, rank in enumerate(host):
        if piece in slices_held(len(host), slices, local_rank):
            return rank
    raise AssertionError(f"slice {piece} has no holder on host {host}")
