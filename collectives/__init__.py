"""collectives: data-parallel communication built from primitives, in the open.

    import collectives
    comm = collectives.init(backend="gloo")        # gloo | nccl | mpi | auto
    collectives.all_reduce(tensor, op="sum", algorithm="ring")

Layers, each calling only the one below:
    trainer -> sync strategy -> bucketer -> collective algorithm -> transport
"""
from .api import (all_finite, all_gather, all_reduce, all_reduce_coalesced, all_to_all,
                  broadcast, broadcast_coalesced, reduce_scatter)
from .world import BACKENDS, destroy, get_comm, init, set_comm
from .launch.exit import abort
from .launch import LaunchError, LaunchInfo, detect_launch
from .transport import PeerError, Transport
from .ddp import DistributedDataParallel
from . import sync

__all__ = ["all_finite", "all_reduce", "all_to_all", "broadcast", "reduce_scatter", "all_gather", "all_reduce_coalesced",
           "broadcast_coalesced", "DistributedDataParallel", "sync", "init", "abort", "get_comm", "set_comm", "destroy", "BACKENDS", "LaunchError",
           "LaunchInfo", "detect_launch", "PeerError", "Transport"]
