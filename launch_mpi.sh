#!/usr/bin/env bash
# Start a command on N ranks with the mpirun that belongs to mpi4py's MPI.
#
#   ./launch_mpi.sh -np 4 [--hosts a,b] [--threads T] [--dry-run] -- python -m trainer ...
#   ./launch_mpi.sh --help
#
# The work is done by collectives/launch/mpirun.py, run with the Python that has
# collectives installed ($PYTHON, else python3 on PATH).
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
exec env PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}" "${PYTHON:-python3}" -m collectives.launch.mpirun "$@"
