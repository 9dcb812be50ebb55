"""python -m collectives.cluster: run a command as a job on N emulated hosts.

    python -m collectives.cluster --hosts 2 -- python -m collectives.bench --sizes 16M
    python -m collectives.cluster --hosts 4 --ranks-per-host 2 --bandwidth 100mbit -- \\
        python -m trainer --epochs 1
    python -m collectives.cluster --ranks-per-host 1,3 -- python script.py    (uneven hosts)
    python -m collectives.cluster --hosts 2 --ranks-per-host 2 --launcher mpirun -- \\
        mpirun -np 4 python -m trainer --backend mpi
    python -m collectives.cluster --hosts 4 --scheduler slurm -- \\
        srun -N 4 --ntasks-per-node 2 python -m trainer      (Slurm on the hosts)
    python -m collectives.cluster --hosts 4 --bandwidth 100mbit --cpu-share node3=0.5 \\
        --link node1=10mbit --pause node2@5:10 -- python -m trainer      (hosts not alike)
    python -m collectives.cluster --cleanup        (remove what killed runs left behind)

Hosts that are not alike (each option may be repeated, HOST is node1 or 1):
    --cpu-share HOST=FRACTION   the host gets FRACTION (0 < FRACTION <= 1) of its fair
                                share of this machine's cores, the share it has when every
                                rank is busy: FRACTION * cores * its ranks / world size.
                                Where ranks do not oversubscribe the cores, that is
                                FRACTION of the cores its ranks would use (cgroup v1 cpu).
    --link HOST=RATE            the host's link runs at RATE both ways, not --bandwidth
    --pause HOST@SECONDS:DURATION  SECONDS after the ranks start, every process of the
                                host is frozen for DURATION seconds (cgroup v1 freezer)
The first line (stderr) says what the cluster is:
    collectives.cluster: run cc1f2e3d: 4 hosts x 1 rank, 100mbit; node3 at 0.5 CPU share
    (0.25 cores, of 2); node1 link 10mbit; node2 paused at 5s for 10s

The network exists only while the job runs: it is built before the first rank starts
and removed when the job ends, fails, or is stopped by a signal: Ctrl-C (SIGINT), a
closed terminal or dropped ssh session (SIGHUP), kill (SIGTERM). Exit status: the worst
rank's; 128 + the signal's number when stopped by one (129, 130, 143), as a shell
reports it; 2 when the cluster cannot be built here (one line says why: no root, a
missing tool, Slurm not installed).
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import signal
import sys
from typing import List, Optional, Sequence, Tuple

from ..launch import split_command
from .cgroups import PERIOD_US, PauseSchedule, quota_us
from .job import start_mpirun, start_on_login_node, start_ranks
from .network import (ClusterError, ClusterSpec, Network, Pause, check_tools, rate_bits,
                      remove_leftovers)
from .slurm import Slurm, check_slurm

STOP_SIGNALS = (signal.SIGHUP, signal.SIGINT, signal.SIGTERM)


def _ranks_per_host(hosts: Optional[int], per_host: str) -> List[int]:
    counts = [int(part) for part in per_host.split(",")]
    if len(counts) == 1:
        return counts * (hosts or 1)
    if hosts is not None and hosts != len(counts):
        raise ValueError(f"--hosts {hosts} but --ranks-per-host lists {len(counts)} hosts")
    return counts


def _split(text: str, sign: str, form: str) -> Tuple[str, str]:
    host, found, value = text.partition(sign)
    if not found or not host or not value:
        raise argparse.ArgumentTypeError(f"{text!r}: write {form}")
    return host, value


def cpu_share_arg(text: str) -> Tuple[str, float]:
    """--cpu-share HOST=FRACTION -> (HOST, FRACTION), 0 < FRACTION <= 1."""
    host, value = _split(text, "=", "HOST=FRACTION, e.g. node1=0.5")
    try:
        fraction = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: FRACTION must be a number") from None
    if not 0 < fraction <= 1:
        raise argparse.ArgumentTypeError(f"{text!r}: FRACTION must be in (0, 1]")
    return host, fraction


def link_arg(text: str) -> Tuple[str, str]:
    """--link HOST=RATE -> (HOST, RATE), RATE in tc's units."""
    host, rate = _split(text, "=", "HOST=RATE, e.g. node1=10mbit")
    try:
        rate_bits(rate)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return host, rate


def pause_arg(text: str) -> Tuple[str, float, float]:
    """--pause HOST@SECONDS:DURATION -> (HOST, SECONDS, DURATION)."""
    form = "HOST@SECONDS:DURATION, e.g. node1@5:10"
    host, times = _split(text, "@", form)
    at, duration = _split(times, ":", form)
    try:
        at, duration = float(at), float(duration)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: write {form}") from None
    if not (0 <= at < math.inf and 0 < duration < math.inf):
        raise argparse.ArgumentTypeError(f"{text!r}: SECONDS must be 0 or more and "
                                         "DURATION more than 0")
    return host, at, duration


def _host(spec: ClusterSpec, option: str, name: str) -> int:
    try:
        return spec.host_index(name)
    except ValueError as error:
        raise ValueError(f"{option}: {error}") from None


def _per_host(spec: ClusterSpec, option: str, entries) -> dict:
    """{host index: value} from (HOST, value) pairs; a host named twice is an error."""
    out = {}
    for host, value in entries:
        index = _host(spec, option, host)
        if index in out:
            raise ValueError(f"{option} names {spec.hostname(index)} twice")
        out[index] = value
    return out


def describe(network: Network) -> str:
    """The run's first line: what the cluster is, every host that differs included."""
    spec = network.spec
    counts = spec.ranks_per_host
    if len(set(counts)) == 1:
        shape = (f"{spec.hosts} host{'s' * (spec.hosts > 1)} x {counts[0]} "
                 f"rank{'s' * (counts[0] > 1)}")
    else:
        shape = f"{spec.hosts} hosts of {','.join(map(str, counts))} ranks"
    parts = [f"{shape}, {spec.bandwidth or 'unshaped'}"
             + (f", {spec.latency} delay" if spec.latency else "")]
    for host, fraction in sorted(spec.cpu_share.items()):
        cores = quota_us(fraction, counts[host], spec.world_size) / PERIOD_US
        parts.append(f"{spec.hostname(host)} at {fraction:g} CPU share ({cores:.3g} "
                     f"core{'s' * (cores != 1)})")
    for host, rate in sorted(spec.link.items()):
        parts.append(f"{spec.hostname(host)} link {rate}")
    for pause in sorted(spec.pauses, key=lambda p: (p.at, p.host)):
        parts.append(f"{spec.hostname(pause.host)} paused at {pause.at:g}s for "
                     f"{pause.seconds:g}s")
    return f"collectives.cluster: run {network.run}: " + "; ".join(parts)


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
    parser.add_argument("--cpu-share", type=cpu_share_arg, action="append", default=[],
                        metavar="HOST=FRACTION",
                        help="HOST (node1, or 1) computes slower: it gets FRACTION (0 < "
                             "FRACTION <= 1) of its fair share of this machine's cores, "
                             "FRACTION x cores x its ranks / world size (where ranks do not "
                             "oversubscribe the cores: FRACTION of the cores its ranks "
                             "would use); cgroup v1's cpu controller. Repeatable")
    parser.add_argument("--link", type=link_arg, action="append", default=[],
                        metavar="HOST=RATE",
                        help="HOST's link runs at RATE each way (tc's units: 10mbit), "
                             "instead of --bandwidth. Repeatable")
    parser.add_argument("--pause", type=pause_arg, action="append", default=[],
                        metavar="HOST@SECONDS:DURATION",
                        help="SECONDS after the ranks start, freeze every process of HOST "
                             "for DURATION seconds (cgroup v1's freezer). Repeatable")
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
        spec = dataclasses.replace(
            spec, link=_per_host(spec, "--link", args.link),
            cpu_share=_per_host(spec, "--cpu-share", args.cpu_share),
            pauses=tuple(Pause(_host(spec, "--pause", host), at, seconds)
                         for host, at, seconds in args.pause))
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
    job = pauses = None
    try:
        network.build()
        print(describe(network), file=sys.stderr, flush=True)
        if args.scheduler == "slurm":
            job = start_on_login_node(network, command, Slurm(network).start().env())
        elif args.launcher == "mpirun":
            job = start_mpirun(network, command)
        else:
            job = start_ranks(network, command, prefix=not args.no_prefix)
        pauses = PauseSchedule(network, spec.pauses).start()  # counts from the ranks' start
        return job.wait()
    except ClusterError as error:
        return _fail(error)
    finally:
        _on_stop_signals(_ignore)
        if pauses is not None:
            pauses.stop()  # thaws what it froze: a frozen process cannot be killed
        if job is not None:
            job.kill()
        network.remove()


if __name__ == "__main__":
    sys.exit(main())
