"""mpi4py, imported on first use: importing it initialises MPI, which only an MPI job wants.

Both the rendezvous (rank 0's address, shared over MPI under mpirun) and the mpi
transport use MPI; this is the one place that loads it, with one line of advice where
mpi4py is missing.

Where another MPI's mpirun started the process (OMPI_COMM_WORLD_SIZE=4 set, mpi4py
built with MPICH), mpi4py warns at import, in three lines, that the environment is
suspicious. Wherever collectives joins a job over MPI, its launch check
(rendezvous.check_mpi_agrees) says the same in one line, with the launcher, both world
sizes and the way out, and ends the rank: that warning is silenced here, and only that
one.

Under srun's PMI-2 plugin across several nodes, MPICH's UCX network module cannot start
reliably, so MPICH is pointed at its libfabric one there (srun_netmod_settings, below).
"""
from __future__ import annotations

import importlib.metadata
import os
import sys
import warnings
from typing import Dict, Mapping

_MPI = None
# The start of the message of mpi4py's warning about another MPI's mpirun (MPI.Init).
_FOREIGN_MPIRUN_WARNING = "suspicious MPI execution environment"


# MPICH's names for its choice of network module, and libfabric's for its provider.
_NETMOD_VARIABLES = ("MPIR_CVAR_CH4_NETMOD", "MPICH_CH4_NETMOD", "MPIR_PARAM_CH4_NETMOD")
_PROVIDER_VARIABLE = "FI_PROVIDER"


def mpich_wheel_installed() -> bool:
    """Whether pip's `mpich` (the `mpi` extra's) is installed: then it is the MPI mpi4py
    loads (the interpreter's own lib/ is searched first), built with both of MPICH's
    network modules, UCX (its default) and libfabric ("ofi")."""
    try:
        importlib.metadata.version("mpich")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def srun_netmod_settings(env: Mapping[str, str], mpich_wheel: bool) -> Dict[str, str]:
    """What MPI's environment needs before MPI starts in a rank of `srun --mpi=pmi2`
    across nodes, with pip's MPICH (`mpich_wheel`): {} anywhere else, or where the user
    chose a network module.

    Why. At start-up each node's first rank of MPICH's UCX module publishes its
    address through the process manager's key-value store, always 4096 bytes (MPICH's
    maximum business card, whatever the address's real length: the rest is whatever
    the heap held), hex-encoded with runs of zeros shortened, in lines of up to 511
    bytes each: 1,077 characters at most on the wire. Slurm's PMI-2 plugin serves
    MPICH's PMI-1 wire protocol with one read() of at most 1,024 bytes per request
    (src/plugins/mpi/pmi2/pmi1.c, "TODO: read until newline"). A segment whose bytes do
    not shorten (text the process had freed, say) arrives cut in two; slurmstepd logs
    "mpi/pmi2: value not properly terminated in client request", never answers, and
    every rank waits in MPI_Init for good. Whether it happens depends on the heap's
    leftovers: rarely, at random. MPICH's libfabric module publishes a 16-byte
    address (a 65-byte line), so that is the one asked for here, over libfabric's tcp
    provider (its default here, "sockets", stalls under the ring's traffic).

    Not touched: jobs mpirun started (Hydra's proxies read whole lines; they mark
    their ranks with HYDI_CONTROL_FD), a step on one node (MPICH skips that exchange
    there), any other MPI (Intel MPI, a cluster's own MPICH: their choice of fabric is
    theirs), and any choice the user made of either variable: MPIR_CVAR_CH4_NETMOD=ucx
    keeps UCX, FI_PROVIDER another provider (an InfiniBand cluster's "verbs;ofi_rxm").
    A script that starts MPI itself (`from mpi4py import MPI`) before collectives does
    must export these itself."""
    if not mpich_wheel:
        return {}
    under_srun_pmi = "PMI_FD" in env and "HYDI_CONTROL_FD" not in env and (
        env.get("SLURM_MPI_TYPE", "").startswith("pmi2"))
    nodes = env.get("SLURM_STEP_NUM_NODES", env.get("SLURM_NNODES", "1"))
    if not under_srun_pmi or not nodes.isdigit() or int(nodes) < 2:
        return {}
    if any(name in env for name in _NETMOD_VARIABLES):
        return {}
    settings = {"MPIR_CVAR_CH4_NETMOD": "ofi"}
    if _PROVIDER_VARIABLE not in env:
        settings[_PROVIDER_VARIABLE] = "tcp"
    return settings


def mpi():
    """The mpi4py MPI module, imported on first use (importing it initialises MPI)."""
    global _MPI
    if _MPI is None:
        settings = srun_netmod_settings(os.environ, mpich_wheel_installed())
        if settings and os.environ.get("SLURM_PROCID") == "0":  # srun's first task
            print("collectives: srun --mpi=pmi2 across nodes: MPICH over libfabric ("
                  + " ".join(f"{k}={v}" for k, v in settings.items()) + "; its UCX "
                  "start-up can hang under Slurm's PMI-2, see docs/slurm.md)", file=sys.stderr)
        os.environ.update(settings)
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=_FOREIGN_MPIRUN_WARNING,
                                        category=RuntimeWarning)
                from mpi4py import MPI
        except ImportError:
            raise RuntimeError("backend 'mpi' needs mpi4py: pip install 'collectives[mpi]'") from None
        _MPI = MPI
    return _MPI


def mpi_world():
    """MPI's COMM_WORLD (initialising MPI if it is not yet)."""
    return mpi().COMM_WORLD
