"""The backend's own collectives (gloo's, NCCL's, MPICH's), behind our names.

These are the baselines every algorithm here is measured against. The transport only
exposes all-reduce and broadcast natively; reduce-scatter and all-gather are built from
those two here so that "native" exists for every collective in the benchmark.
"""
from __future__ import annotations

import torch

from ..transport import Transport


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
