"""Find the mpirun that belongs to the MPI mpi4py loaded, and start a job with it.

The classic MPI failure: `mpirun` on PATH comes from one MPI (say Open MPI) while
mpi4py was built against another (say MPICH). Every rank then starts as a singleton
and believes it is rank 0 of 1. This module asks mpi4py which library it loaded, then
picks an `mpirun` whose `--version` names the same implementation, looking first next
to the running Python (where the `mpich` wheel puts it), then on PATH.

    python -m collectives.launch.mpirun -np 4 -- python -m trainer
    ./launch_mpi.sh -np 4 -- python -m trainer          (the same, as a script)
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import sysconfig
from typing import List, Optional, Sequence, Tuple

from .environment import split_command


def mpi_library_flavor() -> Tuple[str, str]:
    """("mpich" | "openmpi" | "other", first line of the version) of mpi4py's MPI library."""
    import mpi4py
    mpi4py.rc.initialize = False  # reading the version needs no MPI_Init
    from mpi4py import MPI
    version = MPI.Get_library_version().strip()
    return _flavor_of(version), version.splitlines()[0]


def _flavor_of(version_text: str) -> str:
    text = version_text.lower()
    if "open mpi" in text or "openrte" in text or "open-mpi" in text:
        return "openmpi"
    if "mpich" in text or "hydra" in text or "mvapich" in text:
        return "mpich"
    return "other"


def _candidates() -> List[str]:
    found = []
    for folder in (sysconfig.get_path("scripts"), os.path.dirname(sys.executable)):
        for name in ("mpirun", "mpiexec"):
            path = os.path.join(folder, name)
            if os.access(path, os.X_OK):
                found.append(path)
    for name in ("mpirun", "mpiexec"):
        path = shutil.which(name)
        if path:
            found.append(path)
    return list(dict.fromkeys(found))  # in order, without repeats


def find_mpirun() -> Tuple[str, str]:
    """(path, flavor) of an mpirun matching mpi4py's MPI library; RuntimeError if none."""
    flavor, library = mpi_library_flavor()
    seen = []
    for path in _candidates():
        try:
            out = subprocess.run([path, "--version"], capture_output=True, text=True,
                                 timeout=20)
            launcher_flavor = _flavor_of(out.stdout + out.stderr)
        except (OSError, subprocess.TimeoutExpired):
            launcher_flavor = "unusable"
        if launcher_flavor == flavor or flavor == "other":
            return path, launcher_flavor
        seen.append(f"{path} ({launcher_flavor})")
    raise RuntimeError(f"no mpirun matches mpi4py's MPI ({library}); found: "
                       f"{', '.join(seen) or 'none'}. Install one: pip install mpich")


def mpirun_command(nprocs: int, command: Sequence[str], hosts: Optional[str] = None,
                   threads_per_rank: Optional[int] = 1) -> Tuple[List[str], dict]:
    """The argv and environment that start `command` on `nprocs` ranks."""
    path, flavor = find_mpirun()
    argv = [path, "-np", str(nprocs)]
    env = dict(os.environ)
    if threads_per_rank is not None and "OMP_NUM_THREADS" not in env:
        env["OMP_NUM_THREADS"] = str(threads_per_rank)
    if flavor == "openmpi":
        argv.append("--oversubscribe")  # more ranks than cores is fine for us
        if os.geteuid() == 0:
            argv.append("--allow-run-as-root")
        if hosts:
            argv += ["--host", hosts]
        if "OMP_NUM_THREADS" in env:
            argv += ["-x", "OMP_NUM_THREADS"]
    elif hosts:
        argv += ["-hosts", hosts]
    return argv + list(command), env


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv, command = split_command(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        prog="launch_mpi.sh",
        description="Start COMMAND on N ranks with the mpirun that belongs to mpi4py's MPI. "
                    "Adds Open MPI's --oversubscribe (and --allow-run-as-root as root) when "
                    "that is the MPI, and sets OMP_NUM_THREADS per rank unless already set.",
        epilog="example: ./launch_mpi.sh -np 4 -- python -m trainer --epochs 1")
    parser.add_argument("-np", "--nprocs", type=int, required=True, metavar="N",
                        help="number of ranks to start")
    parser.add_argument("--hosts", metavar="A,B",
                        help="comma-separated hosts to place ranks on (default: this one)")
    parser.add_argument("--threads", type=int, default=1, metavar="T",
                        help="OMP_NUM_THREADS for each rank when it is not set (default 1)")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the mpirun command instead of running it")
    args = parser.parse_args(argv)
    if args.nprocs < 1:
        parser.error(f"-np must be at least 1, got {args.nprocs}")
    if args.threads < 1:
        parser.error(f"--threads must be at least 1, got {args.threads}")
    if not command:
        parser.error("no command given: put it after --, e.g. -- python -m trainer")
    try:
        full, env = mpirun_command(args.nprocs, command, args.hosts, args.threads)
    except RuntimeError as error:
        print(f"launch_mpi.sh: {error}", file=sys.stderr)
        return 2
    if args.dry_run:
        print(" ".join(full))
        return 0
    os.execvpe(full[0], full, env)
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
