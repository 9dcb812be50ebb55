"""The backend's own collectives (gloo's, NCCL's, MPICH's), behind our names.

These are the baselines every algorithm here is measured against. The transport only
exposes all-reduce and broadcast natively; reduce-scatter and all-gather are built from
those two here so that "native" exists for every collective in the benchmark.
"""
from __future__ import annotations

from dataclasses import replace

import torch

from ..transport import Transport
from . import ring, tree
from .costs import Constants, Shape


def all_reduce(comm: Transport, flat: torch.Tensor, op: str) -> None:
    comm.native_all_reduce(flat, op)


def broadcast(comm: Transport, flat: torch.Tensor, root: int) -> None:
    comm.native_broadcast(flat, root)


def reduce_scatter(comm: Transport, flat: torch.Tensor, op: str) -> None:
    """Rank r ends with chunk r reduced: a native all-reduce of the whole buffer."""
    comm.native_all_reduce(flat, op)


def all_gather(comm: Transport, flat: torch.Tensor) -> None:
    """Every rank's chunk broadcast from its owner: n native broadcasts, bitwise exact."""
    chunk = flat.numel() // comm.world_size
    for owner in range(comm.world_size):
        comm.native_broadcast(flat[owner * chunk:(owner + 1) * chunk], owner)


# Costs (see costs.py). What the backend runs inside is its own affair; modelled here
# as a ring in rank order with one message per step (gloo's all-reduce is a ring),
# inside a host on the backend's own route (c.native), with its own per-message cost,
# and none of our shared memory's relays (the backend's collectives go over its own
# transport: transport "").

def cost(nbytes: float, shape: Shape, c: Constants) -> float:
    n = shape.world_size
    if n == 1:
        return 0.0
    return ring.cost(nbytes, shape, replace(c, local=c.native, transport=""),
                     segment_bytes=0, algorithm="native")


def broadcast_cost(nbytes: float, shape: Shape, c: Constants) -> float:
    return tree.broadcast_cost(nbytes, shape, replace(c, local=c.native, transport=""),
                               algorithm="native")
