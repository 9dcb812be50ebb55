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
    python -m collectives.cluster --hosts 4 --elastic-store --kill node3@60 \
        --cut node2@90:30 -- python -m trainer --elastic     (hosts that fail; trainer goes on)
    python -m collectives.cluster --cleanup        (remove what killed runs left behind)

Hosts that are not alike (each option may be repeated, HOST is node1 or 1):
    --cpu-share HOST=FRACTION   the host gets FRACTION (0 < FRACTION <= 1) of its fair
                                share of this machine's cores: a core per rank, or where
                                the ranks outnumber the cores, cores / world size each;
                                FRACTION * its ranks * min(1, cores / world size) cores
                                (cgroup v1 cpu)
    --link HOST=RATE            the host's link runs at RATE both ways, not --bandwidth
    --pause HOST@SECONDS:DURATION  SECONDS after the ranks start, every process of the
                                host is frozen for DURATION seconds (cgroup v1 freezer);
                                it ends by 1e6 s. Under --scheduler slurm, Slurm waits
                                for a silent host the longest pause + 30 s
Hosts that fail (collectives/cluster/faults.py):
    --kill HOST@SECONDS         every process of the host is SIGKILLed; its ranks' exit
                                status does not count in the job's
    --cut HOST@SECONDS:DURATION the host's link is down for DURATION seconds, then up
    --elastic-store             the membership store of an elastic job, on the switch;
                                the ranks find it in $COLLECTIVES_ELASTIC_STORE
    --on-switch COMMAND         run COMMAND (a shell line) on the switch, which no
                                host's failure takes down, for the job's lifetime: a
                                service the ranks reach at the name `switch`, such as
                                torchft's lighthouse (`torchft_lighthouse --min_replicas 2`)
The first line (stderr) says what the cluster is (here on 2 cores):
    collectives.cluster: run cc1f2e3d: 4 hosts x 1 rank, 100mbit; node3 at 0.5 CPU share
    (0.25 cores); node1 link 10mbit; node2 paused at 5s for 10s

The network exists only while the job runs: it is built before the first rank starts
and removed when the job ends, fails, or is stopped by a signal: Ctrl-C (SIGINT), a
closed terminal or dropped ssh session (SIGHUP), kill (SIGTERM). Exit status: the worst
rank's; 128 + the signal's number when stopped by one (129, 130, 143), as a shell
reports it; 2 when the cluster cannot be built here (one line says why: no root, a
missing tool, Slurm not installed), or when the job succeeded but a step of removing
the cluster failed (one line each; every other step still runs).
"""
from __future__ import annotations

import argparse
import signal
import sys
from typing import Callable, List, Optional, Sequence

from ..launch import split_command
from .cgroups import PERIOD_US, PauseSchedule, quota_us
from .job import start_mpirun, start_on_login_node, start_ranks
from .network import ClusterError, ClusterSpec, Network, check_tools, remove_leftovers
from . import faults
from .faults import FaultSchedule
from .options import (cpu_share_arg, host_faults, kill_arg, link_arg, pause_arg,
                      with_hosts_that_differ)
from .slurm import MAX_PAUSE, Slurm, check_slurm

STOP_SIGNALS = (signal.SIGHUP, signal.SIGINT, signal.SIGTERM)


def _ranks_per_host(hosts: Optional[int], per_host: str) -> List[int]:
    counts = [int(part) for part in per_host.split(",")]
    if len(counts) == 1:
        return counts * (hosts or 1)
    if hosts is not None and hosts != len(counts):
        raise ValueError(f"--hosts {hosts} but --ranks-per-host lists {len(counts)} hosts")
    return counts


def describe(network: Network, kills=(), cuts=(), on_switch=()) -> str:
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
    parts += faults.describe(spec, list(kills), list(cuts))
    parts += [f"on the switch: {command}" for command in on_switch]
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
                             "FRACTION <= 1) of its fair share of this machine's cores (a "
                             "core per rank, or cores / world size each where the ranks "
                             "outnumber the cores): FRACTION x its ranks x min(1, cores / "
                             "world size) cores; cgroup v1's cpu controller. Repeatable")
    parser.add_argument("--link", type=link_arg, action="append", default=[],
                        metavar="HOST=RATE",
                        help="HOST's link runs at RATE each way (tc's units: 10mbit), "
                             "instead of --bandwidth. Repeatable")
    parser.add_argument("--pause", type=pause_arg, action="append", default=[],
                        metavar="HOST@SECONDS:DURATION",
                        help="SECONDS after the ranks start, freeze every process of HOST "
                             "for DURATION seconds (cgroup v1's freezer); it must end by "
                             "1e6 s. Under --scheduler slurm, Slurm then waits the longest "
                             "pause + 30 s before it marks a silent host down. Repeatable")
    parser.add_argument("--kill", type=kill_arg, action="append", default=[],
                        metavar="HOST@SECONDS",
                        help="SECONDS after the ranks start, SIGKILL every process of HOST "
                             "(a host that dies); its ranks' exit status does not count in "
                             "the job's. Repeatable")
    parser.add_argument("--cut", type=pause_arg, action="append", default=[],
                        metavar="HOST@SECONDS:DURATION",
                        help="SECONDS after the ranks start, take HOST's link down for "
                             "DURATION seconds (nothing in or out), then up. Repeatable")
    parser.add_argument("--elastic-store", action="store_true",
                        help="run an elastic job's membership store on the switch, which "
                             "no host's failure takes down, and give every rank its address "
                             "in $COLLECTIVES_ELASTIC_STORE (python -m trainer --elastic)")
    parser.add_argument("--on-switch", action="append", default=[], metavar="COMMAND",
                        help="run COMMAND (a shell line) on the switch, which no host's "
                             "failure takes down, while the job runs: a service the ranks "
                             "reach at the name `switch`. Repeatable")
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
        spec = with_hosts_that_differ(spec, args.cpu_share, args.link, args.pause)
        args.kill, args.cut = host_faults(spec, args.kill, args.cut)
    except ValueError as error:
        parser.error(str(error))
    if args.kill and (args.launcher != "ranks" or args.scheduler != "none"):
        parser.error("--kill: only with the ranks launcher (the default); mpirun and Slurm "
                     "end the job when a host dies")
    longest = max((pause.seconds for pause in spec.pauses), default=0.0)
    if args.scheduler == "slurm" and longest > MAX_PAUSE:
        parser.error(f"--pause: under --scheduler slurm a pause lasts at most {MAX_PAUSE} s "
                     f"(Slurm waits for a silent host at most {MAX_PAUSE + 30} s), got "
                     f"{longest:g} s")
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


def _clean_up(steps: Sequence[Callable[[], None]]) -> bool:
    """Run every clean-up step, in order, even when one before it fails (that one's
    error is one line on stderr); True if all succeeded."""
    clean = True
    for step in steps:
        try:
            step()
        except Exception as error:
            clean = False
            try:
                print(f"collectives.cluster: error: clean-up: {error}", file=sys.stderr)
            except (OSError, ValueError):  # stderr gone: the next steps still run
                pass
    return clean


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
    network = Network(spec)
    # Made before anything can fail or be stopped, so `finally` always stops it: a
    # schedule left running could freeze a host while it is being torn down.
    pauses = PauseSchedule(network, spec.pauses)
    failures = FaultSchedule(network, args.kill, args.cut)
    job = None
    status = 2
    _on_stop_signals(_stop)
    try:
        network.build()
        print(describe(network, args.kill, args.cut, args.on_switch), file=sys.stderr,
              flush=True)
        env = ({"COLLECTIVES_ELASTIC_STORE": network.serve_store()}
               if args.elastic_store else {})
        for command_line in args.on_switch:
            network.serve_command(command_line)
        if args.scheduler == "slurm":
            job = start_on_login_node(network, command, {**Slurm(network).start().env(), **env})
        elif args.launcher == "mpirun":
            job = start_mpirun(network, command, env)
        else:
            job = start_ranks(network, command, prefix=not args.no_prefix, extra_env=env)
        pauses.start()  # both count from the ranks' start
        failures.start()
        # The schedules stop as soon as the job's processes are gone, before what they
        # left on the hosts is thawed and killed.
        status = job.wait(ended=lambda: (pauses.stop(), failures.stop()),
                          killed=lambda: failures.killed)
    except ClusterError as error:
        status = _fail(error)
    finally:
        _on_stop_signals(_ignore)
        # The schedule first: it thaws what it froze, and a frozen process cannot die.
        clean = _clean_up([pauses.stop, failures.stop] + ([job.kill] if job is not None else [])
                          + [network.remove])
    return status if clean or status != 0 else 2


if __name__ == "__main__":
    sys.exit(main())
