"""Where rank 0's torch.distributed store listens: the one address every rank must agree on.

gloo and nccl meet at a TCP store on rank 0 before anything else can be said. Who
says where it is depends on the launcher:

    torchrun (and any env:// launch)   MASTER_ADDR and MASTER_PORT, set for every rank
    mpirun                             nobody: rank 0 picks its address and a free
                                       port and broadcasts them over MPI
    Slurm (srun)                       the first node of the step's node list, a port
                                       from the job and step ids (two jobs on a node
                                       differ)

Who serves the store there: rank 0, except where the launcher already does. torchrun's
agent serves one at MASTER_ADDR:MASTER_PORT for its workers and says so
(TORCHELASTIC_USE_AGENT_STORE=True); every rank, rank 0 too, then connects to it, as
torch's own env:// rendezvous does (`open_store`). A second server on that port would
fail to bind, which torch prints as an error line before it forgives it. The agent's
store outlives the workers when torchrun restarts them (--max-restarts), so under one
torchrun the keys of each attempt go under a prefix of their own (`attempt_prefix`).

Under an MPI launcher the launcher's world must also be MPI's: a mismatch is the
classic sign of an mpirun from another MPI than mpi4py's.
"""
from __future__ import annotations

import os
import socket
from datetime import timedelta
from typing import Mapping, Optional, Tuple

from .environment import LaunchError, LaunchInfo
from .lazy_mpi import mpi, mpi_world
from .spawn import free_port


def check_mpi_agrees(info: LaunchInfo, world) -> None:
    """The classic wrong-mpirun symptom: the launcher says N ranks, MPI says 1."""
    if info.launcher == "slurm" and world.Get_size() == 1 < info.world_size:
        raise LaunchError(
            f"srun started {info.world_size} tasks but MPI sees a world of 1 in each: srun "
            "gave MPI no process manager to meet through; start with `srun --mpi=pmi2` "
            "(MPICH; `srun --mpi=list` shows what this Slurm has) or run mpirun inside the "
            "allocation")
    if info.launcher != "none" and world.Get_size() != info.world_size:
        library = " ".join(mpi().Get_library_version().split()[:3])
        raise LaunchError(
            f"the launcher ({info.launcher}) says {info.world_size} ranks but MPI reports a "
            f"world of {world.Get_size()}: that mpirun belongs to a different MPI than "
            f"mpi4py's ({library}); start with ./launch_mpi.sh")


SLURM_PORTS = (15000, 16000)  # first port, span: below Linux's ephemeral ports (32768-)


def slurm_rendezvous(env) -> Tuple[str, int]:
    """Rank 0's host and port under srun, worked out alike on every rank.

    Rank 0 runs on the first node of the job step (SLURM_STEP_NODELIST; a batch job's
    SLURM_JOB_NODELIST where srun did not say), in Slurm's compressed form
    ("node[03-07,12],gpu1"), expanded as Slurm does by python-hostlist. The port comes
    from the job and step ids, so two jobs, or two steps of one job, that share a node
    listen on different ports.
    """
    import hostlist  # python-hostlist: Slurm's node-list syntax, maintained for it

    name = "SLURM_STEP_NODELIST" if "SLURM_STEP_NODELIST" in env else "SLURM_JOB_NODELIST"
    try:
        first = hostlist.expand_hostlist(env[name])[0]
    except (hostlist.BadHostlist, IndexError):
        raise LaunchError(f"{name}={env[name]!r} is not a Slurm node list") from None
    ids = []
    for variable in ("SLURM_JOB_ID", "SLURM_STEP_ID"):
        try:
            ids.append(int(env.get(variable, "0")))
        except ValueError:
            raise LaunchError(f"{variable}={env[variable]!r} is not an integer") from None
    job, step = ids
    first_port, span = SLURM_PORTS
    return first, first_port + (job * 16 + step) % span


def check_resolves(host: str, port: int, source: str) -> None:
    """One line naming the host, where it came from and where it does not resolve,
    instead of torch's store retrying an unknown name with a warning, for ever."""
    try:
        socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as error:
        raise LaunchError(f"the rendezvous host {host!r} ({source}) does not resolve on "
                          f"{socket.gethostname()}: {error.strerror}; every rank must reach "
                          "it by that name (check /etc/hosts or DNS)") from None


def rendezvous_address(info: LaunchInfo) -> Tuple[str, int]:
    """(host, port) of rank 0's store: from the environment, over MPI, or from Slurm.
    A host that does not resolve here is a LaunchError naming it."""
    env = os.environ
    has_addr, has_port = "MASTER_ADDR" in env, "MASTER_PORT" in env
    if has_addr and has_port:
        try:
            host, port = env["MASTER_ADDR"], int(env["MASTER_PORT"])
        except ValueError:
            raise LaunchError(f"MASTER_PORT={env['MASTER_PORT']!r} is not an integer") from None
        check_resolves(host, port, "MASTER_ADDR")
        return host, port
    if has_addr != has_port:
        missing = "MASTER_PORT" if has_addr else "MASTER_ADDR"
        raise LaunchError(f"{missing} is not set but its partner is: set both or neither")
    if info.is_mpi_launcher:
        world = mpi_world()
        check_mpi_agrees(info, world)
        address = None
        if world.Get_rank() == 0:
            single_host = info.local_world_size == info.world_size
            host = "127.0.0.1" if single_host else socket.gethostbyname(socket.gethostname())
            address = (host, free_port())
        return world.bcast(address, root=0)
    if info.launcher == "slurm" and ("SLURM_STEP_NODELIST" in env
                                     or "SLURM_JOB_NODELIST" in env):
        host, port = slurm_rendezvous(env)
        check_resolves(host, port, "the first node Slurm lists for this job step")
        return host, port
    raise LaunchError(f"MASTER_ADDR and MASTER_PORT are not set ({info.launcher} launcher, "
                      f"world of {info.world_size}): set them, or launch with torchrun or mpirun")


def launcher_serves_store(host: str, port: int,
                          env: Optional[Mapping[str, str]] = None) -> bool:
    """True when the launcher itself serves the store at host:port: torchrun's agent,
    which says so with TORCHELASTIC_USE_AGENT_STORE=True, at the MASTER_ADDR and
    MASTER_PORT it gave its workers (torch asks the same of an address, in
    torch.distributed.rendezvous, before it connects every rank as a client)."""
    env = os.environ if env is None else env
    return (env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
            and env.get("MASTER_ADDR") == host and env.get("MASTER_PORT") == str(port))


def attempt_prefix(env: Optional[Mapping[str, str]] = None) -> str:
    """The keys' prefix of this attempt of a job that one torchrun started: "" for the
    first, "attempt2/" after its first restart (TORCHELASTIC_RESTART_COUNT=1), and so on.

    Its agent's store outlives the workers it restarts (--max-restarts) and holds what
    the workers before them wrote, gloo's addresses of processes now dead among it.
    Only where that one torchrun started every rank (GROUP_WORLD_SIZE=1) is the count
    the same on every rank: across hosts each agent counts its own failures (one that
    restarts its workers because another host's failed does not count), so the ranks
    would not meet under it. There, TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 gives each
    attempt a store of its own (docs/launching.md)."""
    env = os.environ if env is None else env
    restarts = env.get("TORCHELASTIC_RESTART_COUNT", "0").strip()
    if env.get("GROUP_WORLD_SIZE") != "1" or not restarts.isdigit() or int(restarts) == 0:
        return ""
    return f"attempt{int(restarts) + 1}/"


def open_store(host: str, port: int, world_size: int, rank: int, timeout: timedelta):
    """The torch TCPStore at host:port where the ranks meet: served by rank 0 (which
    waits for the others to connect), or, where the launcher serves it already
    (`launcher_serves_store`), a client on every rank."""
    import torch.distributed as dist
    serves = rank == 0 and not launcher_serves_store(host, port)
    return dist.TCPStore(host, port, world_size, is_master=serves, timeout=timeout)
