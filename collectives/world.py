"""`collectives.init()`: join the job and build its communicator, the default for every call.

    comm = collectives.init(backend="auto")   # "auto" | "gloo" | "nccl" | "mpi"

1. Read rank / world size / local rank from the launcher (launch/environment.py).
2. A world of one needs nothing more: no process group, no peers.
3. mpi: mpi4py's world is the job; it must agree with the launcher.
4. gloo / nccl: the ranks meet at rank 0's store (launch/rendezvous.py says where;
   under torchrun at the one its agent serves) and take a census there: each rank's
   host and GPUs (launch/census.py). "auto" is nccl only where every host has a GPU
   for each of its ranks, else gloo, said in one line by rank 0 where GPUs were there.
   Then torch.distributed builds the group over that store: gloo, or for nccl
   "cpu:gloo,cuda:nccl", so that the CPU tensors of bookkeeping go to gloo and only
   CUDA data to NCCL.
5. Routes: which ranks share a host, and shared memory between them (gloo, mpi).

The communicator becomes the default for later calls (`collectives.get_comm()`). A
script that made its own torch.distributed group (every torch DDP tutorial does) is
adopted instead (`adopt_torch_group`). Ending is launch/exit.py's: the communicator is
closed when the interpreter exits, so a script need not call `destroy()`.

This file joins the two halves of the house: launching below it (who, where, how a job
ends) and the transports it builds.
"""
from __future__ import annotations

import os
import sys
from datetime import timedelta
from typing import Dict, Optional, Tuple, Union

import torch

from .algorithms import tuning
from .launch.census import Census, gpu_count, gpu_ids
from .launch.environment import LaunchError, LaunchInfo, detect_launch
from .launch.exit import close_at_exit, install_exit_hooks
from .launch.links import link_rate_bytes
from .launch.lazy_mpi import mpi_world
from .launch.rendezvous import (attempt_prefix, check_mpi_agrees, open_store,
                                 rendezvous_address)
from .transport.base import PeerError, Transport
from .transport.local import LocalTransport
from .transport.shm import ShmTransport, want_shm
from .transport.topology import Topology

BACKENDS = ("auto", "gloo", "nccl", "mpi")
DEFAULT_TIMEOUT = timedelta(seconds=300)

_default: Optional[Transport] = None
# The stores this process met its peers at, by (address, world size, rank), and how many
# times it has (see _meet).
_stores: Dict[tuple, object] = {}
_meetings: Dict[tuple, int] = {}


def _as_timedelta(timeout: Union[None, float, timedelta]) -> timedelta:
    if timeout is None:
        return DEFAULT_TIMEOUT
    if isinstance(timeout, timedelta):
        return timeout
    if timeout <= 0:
        raise ValueError(f"timeout must be positive, got {timeout}")
    return timedelta(seconds=float(timeout))


# The backend of device tensors: the device type it serves and torch's name for it.
# Tests put torch's fake backend on the meta device here, to run the NCCL paths
# (a group that refuses CPU tensors, data on a device) on a machine without a GPU.
DEVICE_BACKEND = ("cuda", "nccl")


def group_backend(backend: str) -> str:
    """torch.distributed's backend string for our backend: nccl beside gloo."""
    if backend == "nccl":
        return "cpu:gloo,{}:{}".format(*DEVICE_BACKEND)
    return backend


def resolve_backend(backend: str) -> str:
    """The backend asked for, checked, with a one-line error for a bad one: "gloo",
    "nccl", "mpi", or "auto" (decided at init by the job's census, choose_backend).

    "auto" takes $COLLECTIVES_BACKEND when it is set (so a script that says nothing can
    be moved to another backend from the launch command). nccl needs a GPU here.
    """
    if backend == "auto" and os.environ.get("COLLECTIVES_BACKEND", "").strip():
        backend = os.environ["COLLECTIVES_BACKEND"].strip().lower()
        if backend not in BACKENDS:
            raise LaunchError(f"COLLECTIVES_BACKEND={backend!r}: choose from "
                              f"{', '.join(BACKENDS)}")
    if backend not in BACKENDS:
        raise LaunchError(f"unknown backend {backend!r}: choose from {', '.join(BACKENDS)}")
    if backend == "nccl" and gpu_count() == 0:
        raise LaunchError("backend 'nccl' needs a CUDA GPU, but torch sees none here: "
                          "use backend 'gloo' or 'mpi'")
    return backend


def check_gpus_for_nccl(info: LaunchInfo, gpus: int) -> None:
    """Before the rendezvous, where the launcher says how many ranks share this host and
    every process sees all of its GPUs (no CUDA_VISIBLE_DEVICES): nccl with fewer GPUs
    than ranks here is one line (NCCL refuses two ranks on one GPU, and would say so
    only once every rank has met). Where processes may see a GPU each, the census
    decides, once the ranks have met at the store."""
    ranks = info.local_world_size
    if os.environ.get("CUDA_VISIBLE_DEVICES") is not None:
        return
    if ranks is not None and ranks > gpus:
        raise LaunchError(f"backend 'nccl' needs a GPU per rank, but this host has "
                          f"{ranks} ranks and {gpus} GPU{'s' if gpus != 1 else ''}: "
                          "use fewer ranks per host, or backend 'gloo'")


def choose_backend(backend: str, census: Census) -> Tuple[str, Optional[str]]:
    """(the backend, the line rank 0 says about auto's choice or None), from the census
    of the whole job: nccl only where every host has a GPU for each of its ranks."""
    short = census.short_of_gpus()
    if backend == "nccl" and short:
        raise LaunchError(f"backend 'nccl' needs a GPU per rank, but {short}: use fewer "
                          "ranks per host, or backend 'gloo'")
    if backend != "auto":
        return backend, None
    if not census.any_gpu:
        return "gloo", None
    if short:
        return "gloo", (f"backend auto: gloo, since {short} (nccl needs a GPU per rank); "
                        "CUDA tensors go through host memory")
    hosts = len(census.hosts)
    return "nccl", (f"backend auto: nccl ({hosts} host{'s' if hosts != 1 else ''}, "
                    "a GPU for every rank)")


def choose_device(device: Union[None, str, torch.device], backend: str,
                  local_rank: int) -> torch.device:
    """Where this rank's tensors live. None: the local rank's GPU for nccl, else the
    CPU; "auto": a GPU where there is one; "cuda": the local rank's GPU (shared by
    several ranks where there are fewer GPUs than ranks, as gloo allows)."""
    gpus = gpu_count()
    if device is None:
        device = "cuda" if backend == "nccl" else "cpu"
    if device == "auto":
        device = "cuda" if gpus else "cpu"
    device = torch.device(device)
    if device.type != "cuda":
        return device
    if gpus == 0:
        raise LaunchError(f"device {device} was asked for, but torch sees no CUDA GPU here: "
                          "use device 'cpu'")
    if device.index is None:
        device = torch.device("cuda", local_rank % gpus)
    if device.index >= gpus:
        raise LaunchError(f"device {device}: this host has {gpus} GPU"
                          f"{'s' if gpus != 1 else ''}")
    return device


def _limit_threads(info: LaunchInfo) -> None:
    """One process per core share: ranks that oversubscribe cores must not each spin N threads."""
    if "OMP_NUM_THREADS" in os.environ or info.world_size == 1:
        return
    ranks_here = info.local_world_size or info.world_size
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // ranks_here))


def _with_shared_memory(comm: Transport, wanted: Optional[bool]) -> Transport:
    """Route point-to-point between ranks of one host through shared memory when asked
    for and possible (the backend still carries what goes between hosts). Not on
    nccl: NCCL moves GPU memory between a host's GPUs itself."""
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
    if comm.backend != "nccl":  # auto's rules, measured here (algorithms/tuning.py)
        key = tuning.key_for(comm.name, comm.world_size, comm.topology)
        comm.tuning, comm.tuning_source = tuning.agree(comm, *tuning.find(key))
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

    backend: "auto" (nccl where every host has a GPU for each of its ranks, else gloo),
             "gloo", "nccl" or "mpi".
    timeout: seconds (or a timedelta) after which a silent peer is an error; default 300.
    device:  where this rank's tensors live: None (the local rank's GPU for nccl, else
             the CPU), "auto" (a GPU where there is one), "cpu", "cuda" or "cuda:N".
             On gloo and mpi, CUDA tensors go through host memory.
    shm:     point-to-point through shared memory when all ranks share this host
             (gloo and mpi; see transport/shm/): "auto" (default: when possible),
             True (required), False (never). Default from $COLLECTIVES_SHM.
    """
    global _default
    timeout = _as_timedelta(timeout)
    backend = resolve_backend(backend)
    segment_from_env()  # a bad setting fails here, before any rendezvous
    try:
        shm_wanted = want_shm(shm)  # a bad setting fails here, before any rendezvous
    except ValueError as error:
        raise LaunchError(f"COLLECTIVES_SHM / init(shm=...): {error}") from None
    if backend == "nccl" and shm_wanted:
        raise LaunchError("shared memory (shm on) carries host memory, for gloo and mpi; "
                          "with nccl the GPUs of a host talk through NCCL")
    mpi_size = mpi_world().Get_size() if backend == "mpi" else None
    info = detect_launch(mpi_world_size=mpi_size)
    if backend == "nccl":
        check_gpus_for_nccl(info, gpu_count())
    _limit_threads(info)
    _install_exit_hooks()  # before any rendezvous: a rank failing in init() ends well too

    if backend == "mpi":
        device = _set_device(choose_device(device, backend, info.local_rank))
        world = mpi_world()
        check_mpi_agrees(info, world)
        if world.Get_size() == 1:
            comm: Transport = LocalTransport(device, timeout, backend)
        else:
            from .transport.mpi import MpiTransport
            comm = MpiTransport(info.local_rank, device, timeout)
    elif info.world_size == 1:
        backend, _ = choose_backend(backend, Census((0,), (tuple(gpu_ids()),), ("",)))
        device = _set_device(choose_device(device, backend, info.local_rank))
        comm = LocalTransport(device, timeout, backend)
    else:
        comm = _over_torch_distributed(backend, device, info, timeout)
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


def _set_device(device: torch.device) -> torch.device:
    """Make `device` this process's current GPU (NCCL and CUDA's caching use it)."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device


def _over_torch_distributed(backend: str, device, info: LaunchInfo,
                            timeout: timedelta) -> Transport:
    """gloo or nccl: meet at rank 0's store, take the census, choose, build the group."""
    import torch.distributed as dist
    from .transport.torch_dist import TorchDistTransport
    store = _meet(info, timeout)
    census = Census.take(store, info.rank, info.world_size, gpu_ids(), timeout)
    backend, said = choose_backend(backend, census)
    if said and info.rank == 0:
        print(f"collectives: {said}", file=sys.stderr, flush=True)
    local_rank = census.local_rank(info.rank)  # the launcher's may be missing
    device = _set_device(choose_device(device, backend, local_rank))
    dist.init_process_group(group_backend(backend), store=store, rank=info.rank,
                            world_size=info.world_size, timeout=timeout)
    return TorchDistTransport(backend, info.rank, info.world_size, local_rank, device,
                              timeout)


def _meet(info: LaunchInfo, timeout: timedelta):
    """The store where the ranks meet (rank 0's, or torchrun's agent's: launch/
    rendezvous.py's open_store), under a fresh prefix for this init().

    A process keeps its store for its life, and each init() of the job uses keys of its
    own ("init2/..."): every rank calls init() as many times (Horovod's shutdown() then
    init(), say). A new store on the same port instead could reach the old one, still
    up on a rank slower to close, whose keys from the last init() send the ranks to a
    group being torn down ("Connection reset by peer"). torchrun's store outlives its
    workers: a restarted attempt's keys go under one more prefix ("attempt2/init1/")."""
    import torch.distributed as dist
    host, port = rendezvous_address(info)
    key = (host, port, info.world_size, info.rank)
    store = _stores.get(key)
    if store is None:
        store = _stores[key] = open_store(host, port, info.world_size, info.rank, timeout)
    else:
        store.set_timeout(timeout)
    _meetings[key] = _meetings.get(key, 0) + 1
    return dist.PrefixStore(f"{attempt_prefix()}init{_meetings[key]}/", store)


def _backend_of_group(group) -> Tuple[str, bool]:
    """(gloo or nccl: which of a torch process group's backends our transport uses,
    whether the group moves CPU tensors itself), from its backend config, e.g. "gloo",
    "nccl" (CUDA only), "cpu:gloo,cuda:nccl" (torch's default, also for
    `init_process_group()` with no backend named)."""
    import torch.distributed as dist
    config = str(dist.get_backend_config(group)).lower()
    parts = dict(part.split(":", 1) if ":" in part else ("", part)
                 for part in config.split(","))
    device_type, name = DEVICE_BACKEND
    has_cpu = parts.get("cpu") == "gloo" or parts.get("") == "gloo"
    has_nccl = parts.get(device_type) == name or parts.get("") == name
    ranks_here = detect_launch().local_world_size or 1
    if has_nccl and has_cpu and gpu_count() < ranks_here:
        return "gloo", True  # NCCL would refuse: ranks share a GPU, CUDA tensors staged
    if has_nccl:
        return resolve_backend("nccl"), has_cpu
    if has_cpu:
        return "gloo", True
    raise LaunchError(f"the torch.distributed group uses backend {config!r}; collectives "
                      "can run over gloo or nccl groups (or use collectives.init())")


def _device_of_group(group, local_rank: Optional[int]) -> torch.device:
    """An nccl group's GPU for this rank: the one the default group is bound to, else
    the one the script made current (torch's DDP scripts set it), else the local
    rank's."""
    import torch.distributed as dist
    bound = dist.distributed_c10d._get_default_group().bound_device_id
    if bound is not None:
        return bound
    if DEVICE_BACKEND[0] != "cuda":  # the tests' stand-in
        return torch.device(DEVICE_BACKEND[0])
    if torch.cuda.is_initialized() or local_rank is None or local_rank >= gpu_count():
        return torch.device("cuda", torch.cuda.current_device())  # the script's choice
    return torch.device("cuda", local_rank)


def adopt_torch_group(group=None, timeout: Union[None, float, timedelta] = None,
                      shm: Union[None, bool, str] = None) -> Transport:
    """A communicator over a torch.distributed process group the script already made.

    A torch DDP script has called `dist.init_process_group(...)` before it wraps its
    model; our DDP face (and `get_comm()`) adopt that group instead of asking for
    `collectives.init()`. `group` None means torch's default group; a subgroup gives a
    communicator whose ranks are the group's ranks. Collective over the group's members.
    The group stays the script's: closing the communicator leaves it to
    `dist.destroy_process_group()`. A group with NCCL alone gets a gloo group of its
    members beside it, for the CPU tensors of bookkeeping.
    """
    import torch.distributed as dist
    from .transport.torch_dist import TorchDistTransport, _members_only_group
    if not dist.is_initialized():
        raise LaunchError("torch.distributed has no process group: call "
                          "dist.init_process_group() or collectives.init() first")
    backend, has_cpu = _backend_of_group(group)
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    info = detect_launch()
    timeout = _as_timedelta(timeout)
    cpu_group = None
    if backend == "nccl" and not has_cpu:
        ranks = (list(range(dist.get_world_size())) if group is None
                 else dist.get_process_group_ranks(group))
        cpu_group = _members_only_group(ranks, "gloo", timeout)
    device = (_device_of_group(group, info.local_rank if info.world_size > 1 else None)
              if backend == "nccl" else torch.device("cpu"))
    comm: Transport = TorchDistTransport(backend, rank, size, info.local_rank, device,
                                         timeout, group, owns_group=False,
                                         cpu_group=cpu_group)
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
    """Make `comm` the default communicator (None forgets it); it is closed at exit as
    init()'s is."""
    global _default
    _default = comm
    if comm is not None:
        _install_exit_hooks()


def destroy() -> None:
    """Close the default communicator and forget it."""
    global _default
    if _default is not None:
        _default.close()
    _default = None
