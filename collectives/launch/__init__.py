"""Starting a job and joining it: everything below the bytes.

Nothing here sends a tensor or knows an algorithm; it answers the questions every
rank has before and after its communication:

    environment.py   who am I? rank, world size and local rank from each launcher's
                     variables (torchrun, mpirun, Slurm, ...), whether the launcher
                     ends every rank when one dies, and --local-rank
    rendezvous.py    where do the ranks meet? rank 0's address: MASTER_ADDR, over
                     MPI, or from Slurm's node list; the store there (torchrun's own)
    exit.py          how does a job end? background threads, then the communicator;
                     one failing rank aborts an MPI job
    lazy_mpi.py      mpi4py, imported on first use (importing it initialises MPI)
    mpirun.py        which mpirun? the one belonging to mpi4py's MPI (launch_mpi.sh)
    spawn.py         N ranks on this machine without a launcher (the benchmarks' --nproc)

Two neighbours start processes too: `collectives.cluster` (jobs on emulated hosts,
a launcher of its own, `python -m collectives.cluster`) and `collectives.world`
(`collectives.init()`, which puts these answers together with a transport).
"""
from .environment import (LaunchError, LaunchInfo, add_local_rank_argument, detect_launch,
                          split_command)

__all__ = ["LaunchError", "LaunchInfo", "add_local_rank_argument", "detect_launch",
           "split_command"]
