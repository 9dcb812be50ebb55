"""`collectives.init()`: join the job and build its communicator, the default for every call.

    comm = collectives.init(backend="auto")   # "auto" | "gloo" | "nccl" | "mpi"

1. Read rank / world size / local rank from the launcher (launch/environment.py).
2. Pick the backend: "auto" is nccl when CUDA is available, else gloo.
3. A world of one needs nothing more: no process group, no peers.
4. mpi: mpi4py's world is the job; it must agree with the launcher.
5. gloo / nccl: torch.distributed meets at rank 0's store (launch/rendezvous.py says
   where), then our transport runs over the process group.
6. Routes: which ranks share a host, and shared memory between them.

The communicator becomes the default for later calls (`collectives.get_comm()`). A
script that made its own torch.distributed group (every torch DDP tutorial does) is
adopted instead (`adopt_torch_group`). Ending is launch/exit.py's: the communicator is
closed when the interpreter exits, so a script need not call `destroy()`.

This file joins the two halves of the house: launching below it (who, where, how a job
ends) and the transports it builds.
"""
from __future__ import annotations

import os
from datetime import timedelta
from typing import Optional, Union

import torch

from .cluster import link_rate_bytes
from .launch.environment import LaunchError, LaunchInfo, detect_launch
from .launch.exit import close_at_exit, install_exit_hooks
from .launch.mpi import mpi_world
from .launch.rendezvous import check_mpi_agrees, rendezvous_address
from .transport.base import PeerError, Transport
from .transport.local import LocalTransport
from .transport.shm import ShmTransport, want_shm
from .transport.topology import Topology

BACKENDS = ("auto", "gloo", "nccl", "mpi")
DEFAULT_TIMEOUT = timedelta(seconds=300)

_default: Optional[Transport] = None


def _as_timedelta(timeout: Union[None, float, timedelta]) -> timedelta:
    if timeout is None:
        return DEFAULT_TIMEOUT
    if isinstance(timeout, timedelta):
        return timeout
    if timeout <= 0:
        raise ValueError(f"timeout must be positive, got {timeout}")
    return timedelta(seconds=float(timeout))


def resolve_backend(backend: str) -> str:
    """The concrete backend for a name, with a one-line error for a bad one.

    "auto" takes $COLLECTIVES_BACKEND when it is set (so a script that says nothing can
    be moved to another backend from the launch command), else nccl with CUDA, else gloo.
    """
    if backend == "auto" and os.environ.get("COLLECTIVES_BACKEND", "").strip():
        backend = os.environ["COLLECTIVES_BACKEND"].strip().lower()
        if backend not in BACKENDS:
            raise LaunchError(f"COLLECTIVES_BACKEND={backend!r}: choose from "
                              f"{', '.join(BACKENDS)}")
    if backend not in BACKENDS:
        raise LaunchError(f"unknown backend {backend!r}: choose from {', '.join(BACKENDS)}")
    if backend == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl" and not torch.cuda.is_available():
        raise LaunchError("backend 'nccl' needs a CUDA GPU, but torch.cuda.is_available() "
                          "is False here: use backend 'gloo' or 'mpi'")
    return backend


def _limit_threads(info: LaunchInfo) -> None:
    """One process per core share: ranks that oversubscribe cores must not each spin N threads."""
    if "OMP_NUM_THREADS" in os.environ or info.world_size == 1:
        return
    ranks_here = info.local_world_size or info.world_size
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // ranks_here))


def _with_shared_memory(comm: Transport, wanted: Optional[bool]) -> Transport:
    """Route point-to-point between ranks of one host through shared memory when asked
    for and possible (the backend still carries what goes between hosts)."""
    if wanted is False or comm.world_size == 1 or comm.backend == "nccl":
        return comm
    connected = ShmTransport.connect(comm)
    if wanted and connected is comm:
        raise LaunchError("shared memory was required (shm on) but no host has two "
                          "ranks, or /dev/shm could not be used")
    return connected


def with_routes(comm: Transport, shm: Union[None, bool, str] = None) -> Transport:
    """Learn which ranks share a host, then take shared memory between them where
    possible (shm: see init). Collective: every rank of `comm` calls it."""
    if comm.world_size == 1:
        return comm
    try:
        shm_wanted = want_shm(shm)
    except ValueError as error:
        raise LaunchError(f"COLLECTIVES_SHM / init(shm=...): {error}") from None
    comm.topology = Topology.exchange(comm)  # which ranks share a host
    comm = _with_shared_memory(comm, shm_wanted)
    rate = link_rate_bytes()  # the emulated cluster's links, where it shaped them
    if rate and len(comm.topology.hosts) > 1:
        comm.segment_bytes = comm.segment_for_link(rate)
    comm.segment_bytes = segment_from_env() or comm.segment_bytes
    return comm


def segment_from_env() -> Optional[int]:
    """COLLECTIVES_SEGMENT_KB, the ring's segment in bytes (as NCCL_BUFFSIZE); None if
    unset. A bad value is a LaunchError."""
    given = os.environ.get("COLLECTIVES_SEGMENT_KB", "").strip()
    if not given:
        return None
    if not given.isdigit() or int(given) < 1:
        raise LaunchError(f"COLLECTIVES_SEGMENT_KB={given!r}: use a whole number of KiB "
                          "above 0")
    return int(given) << 10


def init(backend: str = "auto", timeout: Union[None, float, timedelta] = None,
         device: Optional[Union[str, torch.device]] = None,
         shm: Union[None, bool, str] = None) -> Transport:
    """Join the job and return its communicator (also the default for later calls).

    backend: "auto" (nccl with CUDA, else gloo), "gloo", "nccl" or "mpi".
    timeout: seconds (or a timedelta) after which a silent peer is an error; default 300.
    device:  where this rank's tensors live; default the local rank's GPU for nccl, else CPU.
    shm:     point-to-point through shared memory when all ranks share this host
             (gloo and mpi; see transport/shm.py): "auto" (default: when possible),
             True (required), False (never). Default from $COLLECTIVES_SHM.
    """
    global _default
    timeout = _as_timedelta(timeout)
    backend = resolve_backend(backend)
    segment_from_env()  # a bad setting fails here, before any rendezvous
    try:
        want_shm(shm)  # a bad setting fails here, before any rendezvous
    except ValueError as error:
        raise LaunchError(f"COLLECTIVES_SHM / init(shm=...): {error}") from None
    mpi_size = mpi_world().Get_size() if backend == "mpi" else None
    info = detect_launch(mpi_world_size=mpi_size)
    if device is None:
        device = "cuda" if backend == "nccl" else "cpu"
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:  # "cuda": the local rank's GPU
        device = torch.device("cuda", info.local_rank % torch.cuda.device_count())
    if device.type == "cuda":
        torch.cuda.set_device(device)
    _limit_threads(info)
    _install_exit_hooks()  # before any rendezvous: a rank failing in init() ends well too

    if backend == "mpi":
        world = mpi_world()
        check_mpi_agrees(info, world)
        if world.Get_size() == 1:
            comm: Transport = LocalTransport(device, timeout, backend)
        else:
            from .transport.mpi import MpiTransport
            comm = MpiTransport(info.local_rank, device, timeout)
    elif info.world_size == 1:
        comm = LocalTransport(device, timeout, backend)
    else:
        import torch.distributed as dist
        from .transport.torch_dist import TorchDistTransport
        host, port = rendezvous_address(info)
        dist.init_process_group(backend, init_method=f"tcp://{host}:{port}", rank=info.rank,
                                world_size=info.world_size, timeout=timeout)
        comm = TorchDistTransport(backend, info.rank, info.world_size, info.local_rank,
                                  device, timeout)
    try:
        comm = with_routes(comm, shm)
    except BaseException:
        # Close the unfinished communicator at exit, as a finished one is: left to the
        # interpreter's teardown, gloo's threads abort the rank (SIGABRT) instead of its
        # error ending it. Not now: the peers would fail on the closed connection before
        # this rank has reported the error that is the job's real cause.
        close_at_exit(comm.close)
        raise
    _default = comm
    return comm


def _backend_of_group(group) -> str:
    """gloo or nccl: which of a torch process group's backends our transport will use."""
    import torch.distributed as dist
    name = str(dist.get_backend(group)).lower()  # e.g. "gloo", "nccl", "cpu:gloo,cuda:nccl"
    if "nccl" in name and (name == "nccl" or "gloo" not in name):
        return resolve_backend("nccl")
    if "gloo" in name:
        return "gloo"
    raise LaunchError(f"the torch.distributed group uses backend {name!r}; collectives "
                      "can run over gloo or nccl groups (or use collectives.init())")


def adopt_torch_group(group=None, timeout: Union[None, float, timedelta] = None,
                      shm: Union[None, bool, str] = None) -> Transport:
    """A communicator over a torch.distributed process group the script already made.

    A torch DDP script has called `dist.init_process_group(...)` before it wraps its
    model; our DDP face (and `get_comm()`) adopt that group instead of asking for
    `collectives.init()`. `group` None means torch's default group; a subgroup gives a
    communicator whose ranks are the group's ranks. Collective over the group's members.
    The group stays the script's: closing the communicator leaves it to
    `dist.destroy_process_group()`.
    """
    import torch.distributed as dist
    from .transport.torch_dist import TorchDistTransport
    if not dist.is_initialized():
        raise LaunchError("torch.distributed has no process group: call "
                          "dist.init_process_group() or collectives.init() first")
    backend = _backend_of_group(group)
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    info = detect_launch()
    device = (torch.device("cuda", torch.cuda.current_device()) if backend == "nccl"
              else torch.device("cpu"))
    comm: Transport = TorchDistTransport(backend, rank, size, info.local_rank, device,
                                         _as_timedelta(timeout), group, owns_group=False)
    return with_routes(comm, shm)


def _install_exit_hooks() -> None:
    """The default communicator is closed at exit, a rank that fails because another did
    lets that one end first, and an MPI job of several ranks is aborted on an uncaught
    exception (launch/exit.py)."""
    install_exit_hooks(destroy, lambda: _default is not None and _default.world_size > 1,
                       lambda error: isinstance(error, PeerError))


def get_comm() -> Transport:
    """The communicator from init(); else one over torch.distributed's default group if
    the script made one (see adopt_torch_group); in a plain single process, a world of
    one."""
    global _default
    if _default is None:
        import torch.distributed as dist
        if dist.is_available() and dist.is_initialized():
            _default = adopt_torch_group()  # a torch script's own process group
            _install_exit_hooks()
            return _default
        info = detect_launch()
        if info.world_size > 1:
            raise RuntimeError(f"this is rank {info.rank} of {info.world_size} "
                               f"({info.launcher}): call collectives.init() (or "
                               "torch.distributed.init_process_group()) first")
        _default = LocalTransport(torch.device("cpu"), DEFAULT_TIMEOUT)
    return _default


def set_comm(comm: Optional[Transport]) -> None:
    """Make `comm` the default communicator (None forgets it)."""
    global _default
    _default = comm


def destroy() -> None:
    """Close the default communicator and forget it."""
    global _default
    if _default is not None:
        _default.close()
    _default = None
