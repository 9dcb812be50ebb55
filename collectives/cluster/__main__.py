"""python -m collectives.cluster: run a command as a job on N emulated hosts.

    python -m collectives.cluster --hosts 2 -- python -m collectives.bench --sizes 16M
    python -m collectives.cluster --hosts 4 --ranks-per-host 2 --bandwidth 100mbit -- \\
        python -m trainer --epochs 1
    python -m collectives.cluster --ranks-per-host 1,3 -- python script.py    (uneven hosts)
    python -m collectives.cluster --hosts 2 --ranks-per-host 2 --launcher mpirun -- \\
        mpirun -np 4 python -m trainer --backend mpi
    python -m collectives.cluster --hosts 4 --scheduler slurm -- \\
        srun -N 4 --ntasks-per-node 2 python -m trainer      (Slurm on the hosts)
    python -m collectives.cluster --cleanup        (remove what killed runs left behind)

The network exists only while the job runs: it is built before the first rank starts
and removed when the job ends, fails, or is stopped by a signal: Ctrl-C (SIGINT), a
closed terminal or dropped ssh session (SIGHUP), kill (SIGTERM). Exit status: the worst
rank's; 128 + the signal's number when stopped by one (129, 130, 143), as a shell
reports it; 2 when the cluster cannot be built here (one line says why: no root, a
missing tool, Slurm not installed).
"""
from __future__ import annotations

import argparse
import signal
import sys
from typing import List, Optional, Sequence

from ..launch import split_command
from .job import start_mpirun, start_on_login_node, start_ranks
from .network import ClusterError, ClusterSpec, Network, check_tools, remove_leftovers
from .slurm import Slurm, check_slurm

STOP_SIGNALS = (signal.SIGHUP, signal.SIGINT, signal.SIGTERM)


def _ranks_per_host(hosts: Optional[int], per_host: str) -> List[int]:
    counts = [int(part) for part in per_host.split(",")]
    if len(counts) == 1:
        return counts * (hosts or 1)
    if hosts is not None and hosts != len(counts):
        raise ValueError(f"--hosts {hosts} but --ranks-per-host lists {len(counts)} hosts")
    return counts


def parse(argv: Sequence[str]):
    argv, command = split_command(argv)
    parser = argparse.ArgumentParser(
        prog="python -m collectives.cluster",
        usage="%(prog)s [options] -- COMMAND [ARG ...]\n       %(prog)s --cleanup",
        description="Run COMMAND as a job on emulated hosts of this machine: each host a "
                    "network namespace with its own hostname, all joined by one switch, "
                    "every link shaped to --bandwidth both ways. Needs root.",
        epilog="example: python -m collectives.cluster --hosts 4 --bandwidth 100mbit -- "
               "python -m collectives.bench --sizes 16M,64M")
    parser.add_argument("--hosts", type=int, metavar="N", help="number of hosts (default 1, "
                        "or as many as --ranks-per-host lists)")
    parser.add_argument("--ranks-per-host", default="1", metavar="L[,L...]",
                        help="ranks on each host: one number for all, or one per host "
                             "(1,3: uneven). Default 1")
    parser.add_argument("--bandwidth", metavar="RATE", help="each link's rate each way, in "
                        "tc's units: 100mbit, 1gbit (default: unshaped)")
    parser.add_argument("--latency", metavar="DELAY", help="added one-way delay (5ms); needs "
                        "the kernel's netem qdisc")
    parser.add_argument("--launcher", choices=("ranks", "mpirun"), default="ranks",
                        help="ranks (default): start every rank with torchrun's variables; "
                             "mpirun: run COMMAND, an mpirun line, on node0 with ssh "
                             "replaced so it reaches every host")
    parser.add_argument("--scheduler", choices=("none", "slurm"), default="none",
                        help="slurm: run munged, slurmctld on node0 and a slurmd on every "
                             "host, then COMMAND on node0 as at a login node (srun, sbatch, "
                             "salloc); needs Debian's slurm-wlm and munge")
    parser.add_argument("--no-prefix", action="store_true",
                        help="do not prefix each output line with its rank")
    parser.add_argument("--cleanup", action="store_true",
                        help="remove namespaces and files left by runs that were killed")
    args = parser.parse_args(argv)
    if args.cleanup:
        return args, command, None
    if not command:
        parser.error("no command given: put it after --, e.g. -- python -m trainer")
    if args.scheduler == "slurm" and args.launcher != "ranks":
        parser.error("--scheduler slurm runs COMMAND on node0, where srun or sbatch start "
                     "the ranks: drop --launcher")
    try:
        if args.hosts is not None and args.hosts < 1:
            raise ValueError(f"--hosts must be at least 1, got {args.hosts}")
        spec = ClusterSpec(_ranks_per_host(args.hosts, args.ranks_per_host),
                           args.bandwidth, args.latency)
    except ValueError as error:
        parser.error(str(error))
    return args, command, spec


def _stop(signum, frame):
    """A stop signal: unwind through main's `finally`, which kills the ranks and removes
    the network, and exit with 128 + its number. Further signals are ignored from here:
    one arriving before main's `finally` begins must not cut the clean-up short."""
    _on_stop_signals(_ignore)
    raise SystemExit(128 + signum)


def _ignore(signum, frame):
    """Clean-up has begun: a second signal (Ctrl-C twice, SIGHUP then SIGTERM) must not
    cut it short. A handler rather than SIG_IGN: SIG_IGN would pass on to the commands
    the clean-up runs, a Python handler does not survive exec."""


def _on_stop_signals(handler) -> None:
    """Handle every stop signal with `handler`, except one this process was started
    ignoring: under `nohup` (SIGHUP ignored) or as a shell's `&` job (SIGINT ignored)
    the job must outlive those, as any command does."""
    for signum in STOP_SIGNALS:
        if signal.getsignal(signum) is not signal.SIG_IGN:
            signal.signal(signum, handler)


def _fail(error: ClusterError) -> int:
    print(f"collectives.cluster: error: {error}", file=sys.stderr)
    return 2


def main(argv: Optional[Sequence[str]] = None) -> int:
    args, command, spec = parse(sys.argv[1:] if argv is None else argv)
    try:
        check_tools()  # even --cleanup runs ip
        if args.scheduler == "slurm":
            check_slurm()
    except ClusterError as error:
        return _fail(error)
    if args.cleanup:
        try:
            removed = remove_leftovers()
        except ClusterError as error:
            return _fail(error)
        print(f"removed {len(removed)} run(s){': ' + ', '.join(removed) if removed else ''}")
        return 0
    _on_stop_signals(_stop)
    network = Network(spec)
    job = None
    try:
        network.build()
        if args.scheduler == "slurm":
            job = start_on_login_node(network, command, Slurm(network).start().env())
        elif args.launcher == "mpirun":
            job = start_mpirun(network, command)
        else:
            job = start_ranks(network, command, prefix=not args.no_prefix)
        return job.wait()
    except ClusterError as error:
        return _fail(error)
    finally:
        _on_stop_signals(_ignore)
        if job is not None:
            job.kill()
        network.remove()


if __name__ == "__main__":
    sys.exit(main())
