"""Horovod's PyTorch API on our engine: `import collectives.horovod as hvd`.

A Horovod training script runs with that one import changed. Underneath:

    hvd.init()                        collectives.init() (idempotent, as Horovod's),
                                      and the face's engine thread (engine.py)
    hvd.allreduce / allgather /       submitted to the engine under a name; it runs
      broadcast / alltoall /          once every rank has submitted that name, in any
      reducescatter (+ _async,        order (negotiation.py); the same name with other
      in-place _ and grouped_)        arguments is an error on every rank; the
                                      synchronous forms are differentiable (ops.py)
    hvd.sparse_allreduce_async        an allgather of indices and one of values
    hvd.add_process_set /             some ranks that run collectives among themselves
      remove_process_set,               (process_set= on every collective): names
      hvd.ProcessSet                    negotiated per set, run on a group of its ranks
                                        (process_sets.py)
    hvd.join()                        stand in for the others' allreduces with zeros
    hvd.DistributedOptimizer          the Bucketer of our DDP, each bucket an allreduce
                                      named after its parameters (optimizer.py)
    hvd.broadcast_parameters /        one broadcast per dtype / rank root's state_dict,
      broadcast_optimizer_state /       pickled and broadcast
      broadcast_object / allgather_object
    hvd.shutdown(), or the end of     every rank's engine stops with it: what waits
      the process                       there raises HorovodInternalError at once

Differences from Horovod: CPU tensors only; see docs/faces.md.

Not provided (each raises NotImplementedError): Adasum, process sets made from an MPI
communicator, SyncBatchNorm, the timeline, elastic training; the TensorFlow / Keras /
MXNet APIs are not here at all.
"""
from __future__ import annotations

import torch

from .. import world
from ..launch.lazy_mpi import mpi as _mpi
from ..world import get_comm
from .optimizer import (Compression, DistributedOptimizer, broadcast_object,
                        broadcast_optimizer_state, broadcast_parameters, allgather_object)
from .ops import (Adasum, Average, Max, Min, Product, Sum, allgather, allgather_async,
                  allreduce, allreduce_, allreduce_async, allreduce_async_, alltoall,
                  alltoall_async, barrier, broadcast, broadcast_, broadcast_async,
                  broadcast_async_, global_process_set, grouped_allgather,
                  grouped_allgather_async, grouped_allreduce, grouped_allreduce_,
                  grouped_allreduce_async, grouped_allreduce_async_, grouped_reducescatter,
                  grouped_reducescatter_async, join, poll, reducescatter,
                  reducescatter_async, sparse_allreduce_async, synchronize)
from .engine import HorovodInternalError, engine as _engine, forget_engines
from .process_sets import ProcessSet, add_process_set, remove_process_set
from . import process_sets as _process_sets


# --- the process ----------------------------------------------------------------------
def init(comm=None, process_sets=None, *, backend: str = "auto", timeout=None) -> None:
    """Join the job. Calling it again is harmless, as in Horovod.

    comm: None, or mpi4py's COMM_WORLD (then the mpi backend is used).
    process_sets: hvd.ProcessSet objects to add (every rank passes the same list), or
        "dynamic" or None: none now (hvd.add_process_set works either way here).
    """
    if comm is not None:
        MPI = _mpi()  # the script's: it has started MPI to pass its COMM_WORLD
        if comm != MPI.COMM_WORLD:
            raise NotImplementedError("hvd.init(comm=...) takes only MPI.COMM_WORLD")
        backend = "mpi"
    if not is_initialized():
        import torch.distributed as dist
        if dist.is_available() and dist.is_initialized():
            get_comm()  # the script's own torch.distributed group is adopted
        else:
            world.init(backend=backend, timeout=timeout)
    _engine()  # every rank makes its engine here, at the same point
    _process_sets.add_at_init(process_sets)


def is_initialized() -> bool:
    return world._default is not None


def shutdown() -> None:
    """Stop the engine, which tells every rank's engine to stop too (what waits there
    raises HorovodInternalError), and close the communicator; init() may be called
    again (on every rank)."""
    forget_engines()
    world.destroy()


def rank() -> int:
    return get_comm().rank


def size() -> int:
    return get_comm().world_size


def local_rank() -> int:
    comm = get_comm()
    return comm.topology.local_rank(comm.rank) if comm.world_size > 1 else 0


def local_size() -> int:
    comm = get_comm()
    return len(comm.topology.local_ranks(comm.rank)) if comm.world_size > 1 else 1


def cross_rank() -> int:
    """Which host this rank is on (hosts numbered by their lowest rank)."""
    comm = get_comm()
    return comm.topology.host_of[comm.rank] if comm.world_size > 1 else 0


def cross_size() -> int:
    """How many hosts the job spans."""
    comm = get_comm()
    return len(comm.topology.hosts) if comm.world_size > 1 else 1


def is_homogeneous() -> bool:
    """Whether every host runs the same number of ranks."""
    comm = get_comm()
    return comm.world_size == 1 or len({len(h) for h in comm.topology.hosts}) == 1


def mpi_enabled() -> bool:
    return get_comm().backend == "mpi"


def mpi_built() -> bool:
    try:
        import mpi4py  # noqa: F401
        return True
    except ImportError:
        return False


def gloo_enabled() -> bool:
    return get_comm().backend == "gloo"


def gloo_built() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_gloo_available()


def nccl_built() -> int:
    """0: this face runs on CPU tensors and has no NCCL operations of its own (Horovod
    returns the NCCL version it was built with, or 0)."""
    return 0


def ddl_built() -> bool:
    return False


def ccl_built() -> bool:
    return False


def cuda_built() -> bool:
    return False


def rocm_built() -> bool:
    return False


def mpi_threads_supported() -> bool:
    """Whether MPI allows calls from several threads (the engine thread makes them)."""
    if get_comm().backend != "mpi":
        return False
    MPI = _mpi()
    return MPI.Query_thread() == MPI.THREAD_MULTIPLE


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    raise NotImplementedError("Horovod's timeline is not provided")


def stop_timeline() -> None:
    raise NotImplementedError("Horovod's timeline is not provided")


class SyncBatchNorm(torch.nn.Module):
    def __init__(self, *args, **kwargs):
        raise NotImplementedError("hvd.SyncBatchNorm is not provided")


__all__ = [name for name in dir() if not name.startswith("_")]
