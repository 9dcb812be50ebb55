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
"""
from __future__ import annotations

import warnings

_MPI = None
# The start of the message of mpi4py's warning about another MPI's mpirun (MPI.Init).
_FOREIGN_MPIRUN_WARNING = "suspicious MPI execution environment"


def mpi():
    """The mpi4py MPI module, imported on first use (importing it initialises MPI)."""
    global _MPI
    if _MPI is None:
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
