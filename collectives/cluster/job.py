"""Starting a job's ranks on the emulated hosts, the way a multi-node launcher does.

Three ways, as on a real cluster:

- `start_ranks` (torchrun-style): this process starts every rank itself, each inside
  its host's namespaces, with the variables torchrun sets on a multi-node job:

      RANK  WORLD_SIZE  LOCAL_RANK  LOCAL_WORLD_SIZE  GROUP_RANK (the host's index)
      GROUP_WORLD_SIZE  MASTER_ADDR (node0's address)  MASTER_PORT
      GLOO_SOCKET_IFNAME=eth0 (the NIC gloo binds to)

- `start_mpirun`: the user's own `mpirun ...` runs on node0, and MPICH's mpiexec
  starts its proxy on every other host through `collectives.cluster.rsh`, a stand-in
  for ssh that enters that host's namespaces (HYDRA_LAUNCHER_EXEC). A host file lists
  every host with its number of ranks, so a plain `mpirun -np N` fills them in order.

- `start_on_login_node`: the user's command runs once on node0, as at a cluster's
  login node, and a launcher of its own starts the ranks: under `--scheduler slurm`
  (slurm.py) that is `srun` or `sbatch`, and Slurm's daemons start the tasks.

Every way, every process also gets COLLECTIVES_CLUSTER_IFACE (its NIC, whose byte
counters `collectives.cluster.link_bytes()` reads) and COLLECTIVES_CLUSTER_RATE (the
link's bits per second), so benchmarks can report what really crossed the wire. Where
hosts have links of their own rates (`--link`), it is the slowest link's, the same on
every rank: ranks that size their messages by it must agree. COLLECTIVES_CLUSTER_LINKS
then lists every host's rate in host order, 0 for a link left unshaped
("100000000,10000000,100000000"), so a report can say the links are not alike.

Output: each rank's lines are prefixed with `[rank R node H]: ` (as torchrun's --tee
and --role do), and the job's exit status is the worst rank's.

The job ends when its processes end. Whatever they left running on the hosts (a
`server &` that outlived its shell) is killed then: it may hold the pipes the prefixes
are read from, and waiting for their end of file would wait for it.
"""
from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import threading
import time
from typing import Callable, Dict, List, Optional, Sequence, Set

from .network import IFACE, Network, rate_bits

MASTER_PORT = 29500  # node0's namespace is new: nothing else listens there
DRAIN_SECONDS = 5.0  # once the job has ended, how long its output may take to be copied


def _cluster_env(network: Network) -> Dict[str, str]:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    # The emulated hosts have TCP over their veth and nothing else: MPICH's UCX is told
    # to use shared memory, TCP and self only. (Under srun --mpi=pmi2 across hosts
    # MPICH runs over libfabric instead: launch/lazy_mpi.py says why.)
    env.setdefault("UCX_TLS", "sm,tcp,self")
    env["COLLECTIVES_CLUSTER_IFACE"] = IFACE
    env["GLOO_SOCKET_IFNAME"] = IFACE
    spec = network.spec
    if spec.slowest_rate():
        env["COLLECTIVES_CLUSTER_RATE"] = str(spec.slowest_rate())
        env["COLLECTIVES_CLUSTER_LINKS"] = ",".join(
            str(rate_bits(spec.link_rate(h)) if spec.link_rate(h) else 0)
            for h in range(spec.hosts))
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                 "MASTER_ADDR", "MASTER_PORT", "PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_RANK",
                 "OMPI_COMM_WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS", "PMIX_RANK"):
        env.pop(name, None)  # we are the launcher now
    return env


def placement(ranks_per_host: Sequence[int]) -> List[tuple]:
    """(rank, host, local rank) for every rank: each host's ranks are consecutive."""
    out, rank = [], 0
    for host, count in enumerate(ranks_per_host):
        for local in range(count):
            out.append((rank, host, local))
            rank += 1
    return out


class _Prefixer(threading.Thread):
    """Copies a rank's output to ours, with its name at the start of every line.

    Only whole lines go out (ended by \\n, or \\r as a progress bar ends its updates),
    each in one write under a lock shared by every pump: a line one rank writes in two
    pieces is never cut by another rank's line. A line left unfinished for PARTIAL_WAIT
    seconds (a prompt, a bar that has not redrawn) goes out as it is."""

    PARTIAL_WAIT = 0.2
    _writing = threading.Lock()  # one line at a time onto our stdout and stderr

    def __init__(self, source, target, prefix: str):
        super().__init__(daemon=True)
        self.source, self.target, self.prefix = source, target, prefix.encode()
        self.at_line_start = True

    def run(self) -> None:
        fd = self.source.fileno()
        pending = b""  # the start of a line whose end has not come yet
        while True:
            ready, _, _ = select.select([fd], [], [], self.PARTIAL_WAIT if pending else None)
            if not ready:  # nothing more for a while: show the line as far as it goes
                self._write([pending])
                pending = b""
                continue
            chunk = os.read(fd, 65536)
            if not chunk:
                if pending:
                    self._write([pending])
                return
            pieces = (pending + chunk).splitlines(keepends=True)
            pending = b"" if pieces[-1].endswith((b"\n", b"\r")) else pieces.pop()
            if pieces:
                self._write(pieces)

    def _write(self, pieces) -> None:
        out = bytearray()
        for piece in pieces:
            if self.at_line_start:
                out += self.prefix
            out += piece
            self.at_line_start = piece.endswith((b"\n", b"\r"))
        with self._writing:
            self.target.write(bytes(out))
            self.target.flush()


class Job:
    """The processes of one job on `network`; wait() returns the worst exit status."""

    def __init__(self, processes: List[subprocess.Popen], names: List[str], prefix: bool,
                 network: Optional[Network] = None, hosts: Optional[List[int]] = None):
        self.processes, self.names, self.network = processes, names, network
        self.hosts = hosts  # each process's host, where each runs on one
        self.pumps: List[_Prefixer] = []
        if prefix:
            for process, name in zip(processes, names):
                for source, target in ((process.stdout, sys.stdout.buffer),
                                       (process.stderr, sys.stderr.buffer)):
                    pump = _Prefixer(source, target, f"[{name}]: ")
                    pump.start()
                    self.pumps.append(pump)

    def wait(self, timeout: Optional[float] = None,
             ended: Optional[Callable[[], None]] = None,
             killed: Callable[[], Set[int]] = set) -> int:
        """Wait until every process of the job has ended (at most `timeout` seconds in
        all: subprocess.TimeoutExpired after that), call `ended` (the job's processes
        are gone, what they left behind still runs: the place to stop whatever acts on
        the hosts, such as a pause schedule), end what they left behind, and return
        the worst exit status, not counting the processes that died of SIGKILL on hosts
        `killed()` names (killed on purpose; one that had failed before counts)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        codes = [process.wait(None if deadline is None else
                              max(0.0, deadline - time.monotonic()))
                 for process in self.processes]
        if ended is not None:
            ended()
        self._end_leftovers()
        dead = killed()
        counted = [code for index, code in enumerate(codes)
                   if self.hosts is None or self.hosts[index] not in dead
                   or code != -signal.SIGKILL]
        return worst_status(counted or codes)  # every rank killed: the job did not end

    def _end_leftovers(self) -> None:
        """Kill what the job left running on the hosts, then let the pumps copy the
        last of its output: with every writer of a pipe gone, they reach its end. A
        pump still reading after DRAIN_SECONDS (a writer that left the hosts'
        namespaces) is abandoned: it is a daemon thread."""
        if self.network is not None:
            self.network.kill_processes()
        drain_until = time.monotonic() + DRAIN_SECONDS
        for pump in self.pumps:
            pump.join(max(0.0, drain_until - time.monotonic()))

    def kill(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.kill()


def worst_status(codes: Sequence[int]) -> int:
    """The job's exit status: 0 if all ranks succeeded, else the worst one's (a rank
    killed by signal S counts as 128 + S, as a shell reports it)."""
    statuses = [128 - code if code < 0 else code for code in codes]
    failed = [status for status in statuses if status != 0]
    return max(failed) if failed else 0


def start_ranks(network: Network, command: Sequence[str], prefix: bool = True,
                extra_env: Optional[Dict[str, str]] = None) -> Job:
    """Start `command` once per rank, each in its host's namespaces (torchrun-style)."""
    spec = network.spec
    base = _cluster_env(network)
    base.update(extra_env or {})
    processes, names, hosts = [], [], []
    for rank, host, local in placement(spec.ranks_per_host):
        env = dict(base, RANK=str(rank), WORLD_SIZE=str(spec.world_size),
                   LOCAL_RANK=str(local), LOCAL_WORLD_SIZE=str(spec.ranks_per_host[host]),
                   GROUP_RANK=str(host), GROUP_WORLD_SIZE=str(spec.hosts),
                   MASTER_ADDR=spec.address(0), MASTER_PORT=str(MASTER_PORT))
        pipe = subprocess.PIPE if prefix else None
        processes.append(subprocess.Popen(network.enter(host) + list(command), env=env,
                                          stdout=pipe, stderr=pipe))
        names.append(f"rank {rank} {spec.hostname(host)}")
        hosts.append(host)
    return Job(processes, names, prefix, network, hosts)


def rsh_script(network: Network) -> str:
    """Write the executable that mpiexec calls instead of ssh, and return its path."""
    path = os.path.join(network.state_dir, "rsh")
    with open(path, "w") as script:
        script.write(f"#!/bin/sh\nexec {sys.executable} -m collectives.cluster.rsh "
                     f"{network.state_dir} \"$@\"\n")
    os.chmod(path, 0o755)
    return path


def start_on_login_node(network: Network, command: Sequence[str],
                        extra_env: Optional[Dict[str, str]] = None) -> Job:
    """Run `command` once, on node0, as a user at a cluster's login node would: a
    launcher (mpirun, srun, sbatch) that starts the ranks itself."""
    env = _cluster_env(network)
    env.update(extra_env or {})
    process = subprocess.Popen(network.enter(0) + list(command), env=env)
    return Job([process], [command[0]], prefix=False, network=network)


def start_mpirun(network: Network, command: Sequence[str],
                 extra_env: Optional[Dict[str, str]] = None) -> Job:
    """Run `command` (an mpirun/mpiexec line) on node0, with ssh replaced by our rsh."""
    spec = network.spec
    host_file = os.path.join(network.state_dir, "hosts")
    with open(host_file, "w") as hosts:
        hosts.writelines(f"{spec.hostname(h)}:{n}\n" for h, n in enumerate(spec.ranks_per_host))
    env = dict(HYDRA_LAUNCHER="ssh", HYDRA_LAUNCHER_EXEC=rsh_script(network),
               HYDRA_HOST_FILE=host_file, HYDRA_IFACE=IFACE)
    env.update(extra_env or {})
    return start_on_login_node(network, command, env)
