"""Slurm on the emulated hosts: munge, a controller on node0, one slurmd per host.

    python -m collectives.cluster --hosts 4 --scheduler slurm -- \\
        srun -N 4 --ntasks-per-node 2 python -m trainer
    python -m collectives.cluster --hosts 2 --scheduler slurm -- sbatch --wait examples/train.sbatch

With `--scheduler slurm` the emulated hosts become a Slurm cluster, and the command runs
on node0 as on a login node: `srun`, `sbatch`, `salloc`, `squeue` and `sinfo` reach
the controller there, and Slurm itself starts the ranks on the hosts it picks.

    node0                           node1 ... nodeN-1
    munged   (the credentials)      slurmd   (starts a job's tasks on this host)
    slurmctld (the controller)
    slurmd

Everything lives in the run's state folder (`<state>/slurm/`): slurm.conf, a fresh
munge key, the controller's state, every daemon's pid and log file. SLURM_CONF points
the commands at it, and munged listens on a socket there, so nothing of the machine's
own Slurm or munge is read or touched. The daemons run inside the hosts' namespaces
and end with them: `Network.remove()` kills every process on the hosts.

A host frozen by `--pause` answers nothing, its slurmd included, and Slurm marks a node
that is silent for SlurmdTimeout DOWN and kills its jobs. With pauses, SlurmdTimeout
and MessageTimeout are the longest pause plus 30 s (`timeout_seconds`; 30 s and
Slurm's default without), and a pause longer than Slurm can wait (MAX_PAUSE) is a
usage error.

One detail decides whether slurmd starts at all. A host is entered with `ip netns exec`
for everything else (job.py), which mounts a fresh /sys for the host's network, and so
hides /sys/fs/cgroup, without which slurmd refuses to start ("No filesystem mounted on
/sys/fs/cgroup"). The daemons enter the host's network and hostname with nsenter
instead, in a mount namespace of their own where the host's /sys is mounted and the
machine's cgroup tree is moved back onto it, and the host's /etc/hosts is bound over
/etc/hosts (hostnames resolve as on a real cluster). The tasks slurmd starts inherit
that view: /sys/class/net/eth0 is their host's NIC.
"""
from __future__ import annotations

import math
import os
import shutil
import subprocess
import time
from typing import Dict, List

from .network import ClusterError, Network

# Every program the Slurm cluster runs, and the Debian package that has it.
PROGRAMS = {"slurmctld": "slurm-wlm", "slurmd": "slurm-wlm", "srun": "slurm-wlm",
            "sinfo": "slurm-wlm", "munged": "munge"}
READY_SECONDS = 60.0  # until every slurmd has registered with the controller
SLURMD_TIMEOUT = 30  # seconds a slurmd may be silent before the controller marks it DOWN
MAX_TIMEOUT = 65533  # Slurm keeps its timeouts in 16 bits
MAX_PAUSE = MAX_TIMEOUT - SLURMD_TIMEOUT  # the longest --pause a Slurm cluster can take


def timeout_seconds(spec) -> int:
    """SlurmdTimeout (and, with pauses, MessageTimeout) for `spec`: a frozen host's
    slurmd answers nothing, and the controller marks a node silent for SlurmdTimeout
    DOWN, killing its jobs. So a cluster with pauses waits the longest pause plus
    SLURMD_TIMEOUT before it gives up on a node, or a message to it."""
    longest = max((pause.seconds for pause in spec.pauses), default=0.0)
    return SLURMD_TIMEOUT + math.ceil(longest)


def check_slurm() -> None:
    """Raise ClusterError naming what is missing and the packages that have it."""
    missing = [program for program in PROGRAMS if shutil.which(program) is None]
    if missing:
        packages = " ".join(sorted({PROGRAMS[program] for program in missing}))
        raise ClusterError(f"--scheduler slurm needs {', '.join(missing)}, not found on PATH "
                           f"(Debian: apt-get install {packages})")


def slurm_conf(network: Network, folder: str) -> str:
    """The text of slurm.conf for `network`: one node per host, reached at its address,
    with as many CPUs as it has ranks or the machine has cores, whichever is more."""
    spec = network.spec
    cpus = os.cpu_count() or 1
    timeout = timeout_seconds(spec)
    nodes = [f"NodeName={spec.hostname(h)} NodeAddr={spec.address(h)} "
             f"CPUs={max(cpus, count)} State=UNKNOWN"
             for h, count in enumerate(spec.ranks_per_host)]
    return "\n".join([
        f"ClusterName={network.run}",
        f"SlurmctldHost={spec.hostname(0)}({spec.address(0)})",
        "SlurmUser=root",
        "SlurmdUser=root",
        "AuthType=auth/munge",
        f"AuthInfo=socket={folder}/munge.socket",
        "CredType=cred/munge",
        f"StateSaveLocation={folder}/state",
        f"SlurmdSpoolDir={folder}/spool/%n",   # %n: the node's name, one folder each
        f"SlurmctldPidFile={folder}/slurmctld.pid",
        f"SlurmdPidFile={folder}/slurmd.%n.pid",
        f"SlurmctldLogFile={folder}/slurmctld.log",
        f"SlurmdLogFile={folder}/slurmd.%n.log",
        # No cgroups for tracking or binding: the hosts share one machine's cgroup tree.
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "JobAcctGatherType=jobacct_gather/none",
        # Jobs take CPUs, not whole nodes or memory: two small jobs share the hosts.
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_CPU",
        "SlurmdParameters=config_overrides",   # trust CPUs= above, not the cores counted
        "ReturnToService=2",                   # a slurmd that comes back is usable again
        f"SlurmdTimeout={timeout}",            # a silent slurmd is marked down after this
        *([f"MessageTimeout={timeout}"] if spec.pauses else []),  # a frozen host's answer
        "MpiDefault=none",                     # Slurm's default; srun --mpi=pmi2 for MPICH
        *nodes,
        "PartitionName=main Nodes=ALL Default=YES MaxTime=INFINITE State=UP",
    ]) + "\n"


class Slurm:
    """The Slurm daemons of one emulated cluster. start() brings them up; they end with
    the hosts, when `Network.remove()` kills every process on them."""

    def __init__(self, network: Network):
        self.network = network
        self.folder = os.path.join(network.state_dir, "slurm")

    @property
    def conf(self) -> str:
        return os.path.join(self.folder, "slurm.conf")

    def env(self) -> Dict[str, str]:
        """What a command on the login node needs to reach this cluster's controller."""
        return {"SLURM_CONF": self.conf}

    def daemon_argv(self, host: int, argv: List[str]) -> List[str]:
        """`argv` run on `host`: in the host's cgroups (the tasks a slurmd starts
        inherit them), its network and hostname, its own /sys with the machine's
        cgroups, its /etc/hosts (see the module's notes)."""
        network = self.network
        cgroups = os.path.join(self.folder, f"cgroup.{network.spec.hostname(host)}")
        hosts = os.path.join(network.etc_dir(host), "hosts")
        script = (f"mkdir -p {cgroups} && mount --rbind /sys/fs/cgroup {cgroups} "
                  f"&& mount -t sysfs sysfs /sys && mount --move {cgroups} /sys/fs/cgroup "
                  f"&& mount --bind {hosts} /etc/hosts && exec \"$@\"")
        return network.join_cgroups(host) + [
            "nsenter", f"--net=/run/netns/{network.netns(host)}",
            f"--uts={network.uts_file(host)}", "unshare", "--mount",
            "--propagation", "private", "sh", "-ec", script, "sh", *argv]

    def start(self) -> "Slurm":
        """Write the configuration and a munge key, start munged, the controller and
        every slurmd, and wait until every node is idle. ClusterError if one fails."""
        check_slurm()
        spec = self.network.spec
        os.makedirs(os.path.join(self.folder, "state"), mode=0o700)
        os.makedirs(os.path.join(self.folder, "spool"))
        os.chmod(self.folder, 0o700)  # munged refuses a key others could read
        with open(os.path.join(self.folder, "munge.key"), "wb") as key:
            os.fchmod(key.fileno(), 0o600)
            key.write(os.urandom(1024))
        with open(self.conf, "w") as conf:
            conf.write(slurm_conf(self.network, self.folder))
        f = self.folder
        self._daemon("munged", self.daemon_argv(0, [
            "munged", f"--socket={f}/munge.socket", f"--key-file={f}/munge.key",
            f"--pid-file={f}/munged.pid", f"--log-file={f}/munged.log",
            f"--seed-file={f}/munged.seed", "--force"]))
        self._daemon("slurmctld", self.daemon_argv(0, ["slurmctld", "-f", self.conf]))
        for host in range(spec.hosts):
            self._daemon(f"slurmd on {spec.hostname(host)}", self.daemon_argv(
                host, ["slurmd", "-f", self.conf, "-N", spec.hostname(host)]))
        self._wait_until_idle()
        return self

    def _daemon(self, name: str, argv: List[str]) -> None:
        """Start a daemon (it forks into the background and returns at once)."""
        try:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=60,
                                  start_new_session=True)
        except subprocess.TimeoutExpired:
            raise ClusterError(f"{name} did not start within 60 s"
                               f"{self._log_tail(name.split()[0])}") from None
        if done.returncode != 0:
            raise ClusterError(f"{name} did not start: {done.stderr.strip() or done.stdout.strip()}"
                               f"{self._log_tail(name.split()[0])}")

    def _wait_until_idle(self) -> None:
        spec = self.network.spec
        names = {spec.hostname(h) for h in range(spec.hosts)}
        env = dict(os.environ, **self.env())
        deadline = time.monotonic() + READY_SECONDS
        states: Dict[str, str] = {}
        while time.monotonic() < deadline:
            try:
                done = subprocess.run(self.network.enter(0) + ["sinfo", "-h", "-N", "-o",
                                                               "%N %T"],
                                      capture_output=True, text=True, env=env, timeout=30)
            except subprocess.TimeoutExpired:
                continue  # the controller is slow to answer: ask again until the deadline
            states = dict(line.split()[:2] for line in done.stdout.splitlines()
                          if len(line.split()) >= 2)
            if all(states.get(name) == "idle" for name in names):
                return
            time.sleep(0.5)
        raise ClusterError(f"Slurm's nodes are not idle after {READY_SECONDS:.0f} s: {states}"
                           f"{self._log_tail('slurmctld')}")

    def _log_tail(self, daemon: str) -> str:
        path = os.path.join(self.folder, f"{daemon}.log")
        if daemon == "slurmd":
            path = os.path.join(self.folder, f"slurmd.{self.network.spec.hostname(0)}.log")
        try:
            with open(path) as log:
                lines = [line.strip() for line in log.readlines()[-3:]]
        except OSError:
            return ""
        return f" (its log, {path}: {' | '.join(lines)})"


__all__ = ["MAX_PAUSE", "Slurm", "check_slurm", "slurm_conf", "timeout_seconds"]
