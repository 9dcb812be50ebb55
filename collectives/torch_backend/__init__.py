"""`init_process_group("collectives")`: our algorithms under torch.distributed.

    import torch.distributed as dist
    dist.init_process_group("collectives")   # under torchrun (or any env:// launch)
    dist.all_reduce(tensor)                   # runs our all-reduce (auto: ring, ...)
    model = torch.nn.parallel.DistributedDataParallel(model)   # torch's own DDP, on ours

No import is needed: this package declares an entry point in torch's
`torch.distributed.backends` group, where torch looks up a backend name it does not
know. `register()` does the same by hand (e.g. when the package is on sys.path but not
installed).

torch creates one backend object per process group (`new_group` too) and calls it with
torch's argument shapes; backend.py maps each call to ours and work.py runs them, in
order, on one thread per group. Tensors on the CPU only (devices=["cpu"]).

An `mpi` for PyPI torch. torch's wheels are built without MPI, so a script that says
`dist.init_process_group("mpi")` fails on them. Opting in makes that name run on this
project's mpi4py transport under mpirun:

    COLLECTIVES_TORCH_MPI=1 mpirun -np 4 python script.py      # no change to the script
    collectives.torch_backend.use_for_mpi()                    # or this, before init

What differs from torch built with MPI: CPU tensors only; collectives run our
algorithms over MPI point-to-point (MPI's own all-reduce is the `native` algorithm:
COLLECTIVES_ALGORITHM=native); ranks on one host talk through shared memory
(COLLECTIVES_SHM=off to stop it); rank and world size come from MPI, as with torch's.

Settings (environment, read when a group is made): COLLECTIVES_ALGORITHM (an
all-reduce algorithm, used by the other collectives where they have one of that name),
COLLECTIVES_SHM (auto, on, off).
"""
from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from .backend import CollectivesBackend, chosen_algorithms
from .routes import gloo_channels, mpi_channels

NAME = "collectives"
MPI_OPT_IN = "COLLECTIVES_TORCH_MPI"


def _create(options, backend_options=None, name: str = NAME) -> CollectivesBackend:
    """torch's call for each new group of "collectives": gloo route (routes.py).
    `name`: what the backend calls itself (tests/torch_suite.py --as-gloo: "gloo")."""
    algorithm = chosen_algorithms()  # a bad setting fails before anything is built
    comm, p2p = gloo_channels(options.store, options.group_rank, options.group_size,
                              options.timeout)
    backend = CollectivesBackend(options.group_rank, options.group_size, comm, p2p,
                                 options.timeout, algorithm, name=name)
    if dist.get_debug_level() == dist.DebugLevel.DETAIL:
        # torch would wrap the backend in its debug wrapper, which asks the backend's
        # name from C++, a question torch 2.14 does not pass on to a backend written
        # in Python. A group of our own is not wrapped; every call is still checked
        # across ranks, by our handshake.
        return _group_of(backend, options.store, options.group_rank, options.group_size)
    return backend


def _group_of(backend: CollectivesBackend, store, rank: int, size: int) -> dist.ProcessGroup:
    """A torch ProcessGroup whose CPU backend is `backend`."""
    group = dist.ProcessGroup(store, rank, size)
    kind = dist.ProcessGroup.BackendType.CUSTOM
    group._register_backend(torch.device("cpu"), kind, backend)
    group._set_default_backend(kind)
    return group


def _require_python_backends() -> None:
    """A clear error where this torch cannot run a backend written in Python.

    Older torch cannot construct a Python subclass of its C++ Backend (2.14 can; 2.11
    cannot): it would fail deep inside init_process_group with "No constructor
    defined!"."""
    try:
        dist._Backend(0, 1)
    except TypeError as error:
        raise RuntimeError(
            "the collectives torch.distributed backend needs a torch whose Backend can be "
            f"written in Python (2.14 can); torch {torch.__version__} cannot ({error}). "
            "collectives.init() and our DistributedDataParallel work on it.") from None


def register() -> None:
    """Make "collectives" a torch.distributed backend (the entry point calls this)."""
    _require_python_backends()
    dist.Backend.register_backend(NAME, _create, extended_api=True, devices=["cpu"])


def _default_mpi_group(timeout: timedelta) -> dist.ProcessGroup:
    """The default group of init_process_group("mpi"): torch passes rank = size = -1
    and no store (MPI knows them), so the group is built here from MPI's world, with
    a TCP store of its own for whatever in torch needs one."""
    from ..launch.rendezvous import rendezvous_address
    from ..launch import detect_launch
    from ..transport.mpi import mpi
    algorithm = chosen_algorithms()
    world = mpi().COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    host, port = rendezvous_address(detect_launch(mpi_world_size=size))
    store = dist.TCPStore(host, port, size, rank == 0, timeout)
    comm, p2p = mpi_channels([], timeout)
    return _group_of(CollectivesBackend(rank, size, comm, p2p, timeout, algorithm, name="mpi"),
                     store, rank, size)


def _create_mpi(options, backend_options=None):
    if options.group_size == -1:
        return _default_mpi_group(options.timeout)
    algorithm = chosen_algorithms()
    comm, p2p = mpi_channels(list(options.global_ranks_in_group), options.timeout)
    return CollectivesBackend(options.group_rank, options.group_size, comm, p2p,
                              options.timeout, algorithm, name="mpi")


def use_for_mpi() -> None:
    """Run `init_process_group("mpi")` on this project's mpi4py transport (explicit
    opt-in: a torch built with MPI keeps its own unless this is called)."""
    _require_python_backends()
    dist.Backend.register_backend("mpi", _create_mpi, extended_api=True, devices=["cpu"])


def _mpi_entry_point() -> None:
    """torch asks for "mpi" here only when it was built without MPI."""
    if os.environ.get(MPI_OPT_IN, "").strip().lower() not in ("1", "on", "true", "yes"):
        raise RuntimeError(
            "this torch was built without MPI. collectives can run init_process_group"
            f"(\"mpi\") on mpi4py: set {MPI_OPT_IN}=1 (e.g. {MPI_OPT_IN}=1 mpirun -np 4 "
            "python script.py), or call collectives.torch_backend.use_for_mpi() first")
    use_for_mpi()


__all__ = ["CollectivesBackend", "NAME", "register", "use_for_mpi"]
