"""`collectives.init()`: find our place in the job and build the transport.

    comm = collectives.init(backend="auto")   # "auto" | "gloo" | "nccl" | "mpi"

1. Read rank / world size / local rank from the launcher (see launch.py).
2. Pick the backend: "auto" is nccl when CUDA is available, else gloo.
3. A world of one needs nothing more: no process group, no peers.
4. mpi: mpi4py's world is the job; we check it agrees with the launcher.
5. gloo / nccl: torch.distributed needs a rendezvous address. torchrun provides
   MASTER_ADDR / MASTER_PORT; under mpirun nobody has to: rank 0 picks its address
   and a free port and shares them over MPI; under Slurm the first node of the job
   is the master.

The communicator becomes the default for later calls (`collectives.get_comm()`).

Ending: a script need not call `destroy()`. init() closes the communicator when the
interpreter exits (see `_close_at_exit`), and under MPI an exception that escapes on
one rank ends the whole job at once instead of leaving its peers waiting.
"""
from __future__ import annotations

import atexit
import os
import time
import weakref
import re
import socket
import subprocess
import sys
from datetime import timedelta
from typing import Optional, Union

import torch

from .launch import LaunchError, LaunchInfo, detect_launch
from .spawn import free_port
from .transport.base import Transport
from .transport.local import LocalTransport
from .transport.shm import ShmTransport, want_shm
from .transport.topology import Topology

BACKENDS = ("auto", "gloo", "nccl", "mpi")
DEFAULT_TIMEOUT = timedelta(seconds=300)
EXIT_GRACE_SECONDS = 5.0  # at exit, the longest wait for background threads to finish
ABORT_GRACE_SECONDS = 0.5  # before MPI_Abort, time for the traceback to reach mpiexec

_default: Optional[Transport] = None
_exit_hooks_installed = False
_background = weakref.WeakSet()  # threads of ours to stop before the communicator closes


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


def _mpi_world():
    from .transport.mpi import mpi
    return mpi().COMM_WORLD


def _check_mpi_agrees(info: LaunchInfo, world) -> None:
    """The classic wrong-mpirun symptom: the launcher says N ranks, MPI says 1."""
    if info.launcher != "none" and world.Get_size() != info.world_size:
        from .transport.mpi import mpi
        library = " ".join(mpi().Get_library_version().split()[:3])
        raise LaunchError(
            f"the launcher ({info.launcher}) says {info.world_size} ranks but MPI reports a "
            f"world of {world.Get_size()}: that mpirun belongs to a different MPI than "
            f"mpi4py's ({library}); start with ./launch_mpi.sh")


def _first_slurm_host(nodelist: str) -> str:
    """The first host of a Slurm node list such as "node[03-07,12],gpu1"."""
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist],
                             capture_output=True, text=True, timeout=10)
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.split()[0]
    except (OSError, subprocess.TimeoutExpired):
        pass
    match = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist)
    if not match:
        raise LaunchError(f"SLURM_JOB_NODELIST={nodelist!r} could not be read")
    prefix, ranges = match.groups()
    return prefix + (ranges.split(",")[0].split("-")[0] if ranges else "")


def _rendezvous_address(info: LaunchInfo) -> tuple[str, int]:
    """Where rank 0's torch.distributed store listens: from the env, MPI or Slurm."""
    env = os.environ
    has_addr, has_port = "MASTER_ADDR" in env, "MASTER_PORT" in env
    if has_addr and has_port:
        try:
            return env["MASTER_ADDR"], int(env["MASTER_PORT"])
        except ValueError:
            raise LaunchError(f"MASTER_PORT={env['MASTER_PORT']!r} is not an integer") from None
    if has_addr != has_port:
        missing = "MASTER_PORT" if has_addr else "MASTER_ADDR"
        raise LaunchError(f"{missing} is not set but its partner is: set both or neither")
    if info.is_mpi_launcher:
        world = _mpi_world()
        _check_mpi_agrees(info, world)
        address = None
        if world.Get_rank() == 0:
            single_host = info.local_world_size == info.world_size
            host = "127.0.0.1" if single_host else socket.gethostbyname(socket.gethostname())
            address = (host, free_port())
        return world.bcast(address, root=0)
    if info.launcher == "slurm" and "SLURM_JOB_NODELIST" in env:
        port = 29500 + int(env.get("SLURM_JOB_ID", "0")) % 5000
        return _first_slurm_host(env["SLURM_JOB_NODELIST"]), port
    raise LaunchError(f"MASTER_ADDR and MASTER_PORT are not set ({info.launcher} launcher, "
                      f"world of {info.world_size}): set them, or launch with torchrun or mpirun")


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
    return _with_shared_memory(comm, shm_wanted)


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
    try:
        want_shm(shm)  # a bad setting fails here, before any rendezvous
    except ValueError as error:
        raise LaunchError(f"COLLECTIVES_SHM / init(shm=...): {error}") from None
    mpi_size = _mpi_world().Get_size() if backend == "mpi" else None
    info = detect_launch(mpi_world_size=mpi_size)
    if device is None:
        device = "cuda" if backend == "nccl" else "cpu"
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:  # "cuda": the local rank's GPU
        device = torch.device("cuda", info.local_rank % torch.cuda.device_count())
    if device.type == "cuda":
        torch.cuda.set_device(device)
    _limit_threads(info)

    if backend == "mpi":
        world = _mpi_world()
        _check_mpi_agrees(info, world)
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
        host, port = _rendezvous_address(info)
        dist.init_process_group(backend, init_method=f"tcp://{host}:{port}", rank=info.rank,
                                world_size=info.world_size, timeout=timeout)
        comm = TorchDistTransport(backend, info.rank, info.world_size, info.local_rank,
                                  device, timeout)
    comm = with_routes(comm, shm)
    _default = comm
    _install_exit_hooks()
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


def _close_at_exit() -> None:
    """Close the default communicator while the interpreter is still whole.

    Left to the interpreter's own shutdown, gloo's threads are destroyed while they
    still run and the C++ runtime aborts the process ("terminate called without an
    active exception", SIGABRT) after the script has finished: a job that did its work
    reports failure. Closing is local to this rank (nothing is sent), so it never waits
    on a peer, alive or gone. Runs after a normal end, sys.exit(), an uncaught
    exception and KeyboardInterrupt alike; not after os._exit().

    Background communication threads (the bucketer's, async strategies') are stopped
    first, so none is inside a transport that is being closed. Each gets a few seconds
    to finish the round it is in with peers that are exiting too. One still running
    after that waits on a peer that has not come (a stalled rank, a slow link): then the
    communicator is left open. Closing it would free what that thread is using (with
    shared memory, unmap the segments it is reading: a SIGSEGV instead of the script's
    exit status). The thread is a daemon, so the process still exits, and the kernel
    frees the rest; nothing is left in /dev/shm, whose files are removed as soon as
    every rank has mapped them (ShmTransport.connect).
    """
    try:
        if _stop_background(EXIT_GRACE_SECONDS):
            print(f"collectives: at exit, communication is still waiting on a peer after "
                  f"{EXIT_GRACE_SECONDS:g} s; the communicator is left open under it and "
                  "goes with the process", file=sys.stderr)
            return
        destroy()
    except Exception as error:  # exiting anyway: say so, never turn an exit into a crash
        print(f"collectives: closing the communicator at exit failed: {error}",
              file=sys.stderr)


def stop_at_exit(worker) -> None:
    """Have `worker` (with stop(), join(seconds) and its `thread`) stopped before the
    exit closes the communicator. Background communication threads register here."""
    _background.add(worker)


def _stop_background(seconds: float) -> bool:
    """Stop every registered worker, give them `seconds` in all to finish, and say
    whether any is still running.

    A job still running after that talks to a peer that has not come; it is left to its
    daemon thread (its own timeout ends it), since exiting must not wait on a peer.
    """
    workers = list(_background)
    for worker in workers:
        worker.stop()
    deadline = time.monotonic() + seconds
    for worker in workers:
        worker.join(max(0.0, deadline - time.monotonic()))
    return any(worker.thread.is_alive() for worker in workers)


def _abort_mpi_job_on_uncaught(previous_hook):
    """Under mpirun, an exception that escapes on one rank ends the whole job at once.

    Once MPI is initialised (the mpi backend, or gloo whose rendezvous went over MPI),
    MPI_Finalize at exit can wait for the other ranks while they wait for this one
    until their timeout. So, as `python -m mpi4py` does, print the error and call
    MPI_Abort: mpirun ends every rank and fails the job with this rank's error on
    screen. (torchrun needs nothing: it ends the other workers when one fails.)
    """
    def hook(kind, error, trace):
        previous_hook(kind, error, trace)
        mpi = sys.modules.get("mpi4py.MPI")
        comm = _default
        if (comm is not None and comm.world_size > 1 and mpi is not None
                and mpi.Is_initialized() and not mpi.Is_finalized()):
            sys.stderr.flush()
            # mpiexec forwards output through its proxies and may drop what is still on
            # the way when an abort tears the job down: give the traceback a moment.
            time.sleep(ABORT_GRACE_SECONDS)
            abort(130 if issubclass(kind, KeyboardInterrupt) else 1)
    return hook


def _install_exit_hooks() -> None:
    global _exit_hooks_installed
    if not _exit_hooks_installed:
        atexit.register(_close_at_exit)
        sys.excepthook = _abort_mpi_job_on_uncaught(sys.excepthook)
        _exit_hooks_installed = True


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


def abort(code: int = 1) -> None:
    """End the job now, after a fatal communication error.

    Under MPI this is MPI_Abort: mpirun then ends every rank, a hung one included (a
    plain non-zero exit would leave mpirun waiting for it). Otherwise this process exits;
    torchrun ends the other workers when one fails.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        mpi.COMM_WORLD.Abort(code)
    os._exit(code)
