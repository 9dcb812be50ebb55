"""Where rank 0's torch.distributed store listens: the one address every rank must agree on.

gloo and nccl meet at a TCP store on rank 0 before anything else can be said. Who
says where it is depends on the launcher:

    torchrun (and any env:// launch)   MASTER_ADDR and MASTER_PORT, set for every rank
    mpirun                             nobody: rank 0 picks its address and a free
                                       port and broadcasts them over MPI
    Slurm (srun)                       the first node of SLURM_JOB_NODELIST, a port
                                       from the job id (two jobs on a node differ)

Under an MPI launcher the launcher's world must also be MPI's: a mismatch is the
classic sign of an mpirun from another MPI than mpi4py's.
"""
from __future__ import annotations

import os
import re
import socket
import subprocess
from typing import Tuple

from .environment import LaunchError, LaunchInfo
from .mpi import mpi, mpi_world
from .spawn import free_port


def check_mpi_agrees(info: LaunchInfo, world) -> None:
    """The classic wrong-mpirun symptom: the launcher says N ranks, MPI says 1."""
    if info.launcher != "none" and world.Get_size() != info.world_size:
        library = " ".join(mpi().Get_library_version().split()[:3])
        raise LaunchError(
            f"the launcher ({info.launcher}) says {info.world_size} ranks but MPI reports a "
            f"world of {world.Get_size()}: that mpirun belongs to a different MPI than "
            f"mpi4py's ({library}); start with ./launch_mpi.sh")


def first_slurm_host(nodelist: str) -> str:
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


def rendezvous_address(info: LaunchInfo) -> Tuple[str, int]:
    """(host, port) of rank 0's store: from the environment, over MPI, or from Slurm."""
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
        world = mpi_world()
        check_mpi_agrees(info, world)
        address = None
        if world.Get_rank() == 0:
            single_host = info.local_world_size == info.world_size
            host = "127.0.0.1" if single_host else socket.gethostbyname(socket.gethostname())
            address = (host, free_port())
        return world.bcast(address, root=0)
    if info.launcher == "slurm" and "SLURM_JOB_NODELIST" in env:
        port = 29500 + int(env.get("SLURM_JOB_ID", "0")) % 5000
        return first_slurm_host(env["SLURM_JOB_NODELIST"]), port
    raise LaunchError(f"MASTER_ADDR and MASTER_PORT are not set ({info.launcher} launcher, "
                      f"world of {info.world_size}): set them, or launch with torchrun or mpirun")
