"""mpi4py, imported on first use: importing it initialises MPI, which only an MPI job wants.

Both the rendezvous (rank 0's address, shared over MPI under mpirun) and the mpi
transport use MPI; this is the one place that loads it, with one line of advice where
mpi4py is missing.
"""
from __future__ import annotations

_MPI = None


def mpi():
    """The mpi4py MPI module, imported on first use (importing it initialises MPI)."""
    global _MPI
    if _MPI is None:
        try:
            from mpi4py import MPI
        except ImportError:
            raise RuntimeError("backend 'mpi' needs mpi4py: pip install 'collectives[mpi]'") from None
        _MPI = MPI
    return _MPI


def mpi_world():
    """MPI's COMM_WORLD (initialising MPI if it is not yet)."""
    return mpi().COMM_WORLD
