"""Hosts that are not alike in compute: a CPU share per host, and pauses.

On one machine every emulated host computes on the same cores. To make one host slower,
or stop it for a while (a host that swaps, a garbage-collection pause, a VM migrated),
its processes go into control groups of their own, one per host in each controller
used (cgroup v1, mounted at /sys/fs/cgroup/<controller>):

    /sys/fs/cgroup/cpu/<run>/node1       cpu.cfs_quota_us: the host's CPU time per period
    /sys/fs/cgroup/freezer/<run>/node1   freezer.state: FROZEN stops every process, THAWED
                                         lets them go on where they stopped

A CPU share FRACTION is FRACTION of the host's fair share of this machine's cores: what
its ranks get when every rank of the job is busy and each can have a core of its own,
or an equal part of the cores where the ranks outnumber them:

    quota = FRACTION * ranks on the host * min(1, cores / world size) * period

(cores: those this process may run on). 2 hosts x 1 rank on 2 cores or on 64,
FRACTION 0.25: a quarter of one core; 4 hosts x 1 rank on 2 cores, FRACTION 0.5: each
rank's fair share is half a core, and the host gets a quarter of one. The kernel
enforces it per period of 100 ms: the host's processes run until the quota is spent,
then wait for the next period.

While every host's ranks are busy, the kernel also splits the cores between the
groups, not the processes: each host's group weighs as many ranks as it holds
(cpu.shares 1024 per rank, `cpu_shares`), so a host of 3 ranks is not held to the
share of a host of 1.

A process joins a host's groups by writing its own pid into each group's cgroup.procs;
its children inherit them. So every command that enters a host first does that, then
execs (`join_argv`): the ranks, an mpirun's proxies (rsh.py, `join`), Slurm's daemons,
and through them every task they start.

A frozen process cannot be killed: SIGKILL waits until it is thawed. So clean-up thaws
first, kills what is left in the groups, and only then removes them (rmdir of a group
needs it empty).
"""
from __future__ import annotations

import os
import signal
import time
from typing import List, Optional, Sequence

from .schedule import Schedule, say

CGROUP_ROOT = "/sys/fs/cgroup"
PERIOD_US = 100_000          # cpu.cfs_period_us: the quota is granted per 100 ms
MIN_QUOTA_US = 1_000         # the kernel's smallest quota (1 ms per period)
SHARES_PER_RANK = 1024       # cpu.shares: the weight of one process in the root group
MAX_SHARES = 262_144         # the kernel's largest cpu.shares
FREEZE_SECONDS = 10.0        # until freezer.state reads FROZEN
KILL_ROUNDS = 20             # passes of "kill every process in the group"


class CgroupError(RuntimeError):
    """A controller is missing or a group cannot be made; one line says why."""


def controller_dir(controller: str) -> str:
    return os.path.join(CGROUP_ROOT, controller)


def check_controller(controller: str, option: str) -> None:
    """Raise CgroupError unless cgroup v1's `controller` is mounted and writable."""
    root = controller_dir(controller)
    if not os.path.exists(os.path.join(root, "cgroup.procs")):
        raise CgroupError(f"{option} needs cgroup v1's {controller} controller at {root}, "
                          "which this machine does not have mounted")
    if not os.access(root, os.W_OK):
        if os.geteuid() == 0:  # root, and still no: the cgroup tree is read-only here
            raise CgroupError(f"{option} needs to create groups in {root}, which is "
                              "mounted read-only on this machine")
        raise CgroupError(f"{option} needs root to create groups in {root}")


def usable_cores() -> int:
    """The cores this process (and so every rank it starts) may run on."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def quota_us(fraction: float, ranks_on_host: int, world_size: int,
             cores: Optional[int] = None) -> int:
    """cpu.cfs_quota_us giving a host `fraction` of its fair share of the cores: a core
    per rank, or cores / world size per rank where the ranks outnumber the cores."""
    cores = cores or usable_cores()
    per_rank = min(1.0, cores / world_size)
    return max(MIN_QUOTA_US, round(fraction * ranks_on_host * per_rank * PERIOD_US))


def cpu_shares(ranks: int) -> int:
    """cpu.shares of a group holding `ranks` busy ranks: 1024 (the kernel's weight of
    one process) each, so groups split the cores by ranks, not one part per group."""
    return min(MAX_SHARES, SHARES_PER_RANK * ranks)


def create(path: str, settings: Optional[dict] = None) -> None:
    """Make the group `path` (its parent must exist) and write each setting's file."""
    try:
        os.mkdir(path)
    except OSError as error:
        raise CgroupError(f"cannot create the group {path}: {error.strerror}") from None
    for name, value in (settings or {}).items():
        _write(os.path.join(path, name), value)


def join_argv(groups: Sequence[str]) -> List[str]:
    """An argv prefix: a shell that moves itself into `groups`, then execs the rest.
    A group it cannot join is one line on stderr and exit status 2, not a shell's
    error about a redirection."""
    if not groups:
        return []
    moves = "; ".join(
        f'{{ echo $$ > {group}/cgroup.procs; }} 2>/dev/null || {{ echo "collectives.cluster: '
        f'error: cannot join the group {group} (writing its cgroup.procs failed)" >&2; '
        f'exit 2; }}' for group in groups)
    return ["sh", "-c", f'{moves}; exec "$@"', "sh"]


def join(groups: Sequence[str], through_pid: Optional[int] = None) -> None:
    """Move this process into `groups`. Inside a host (where `ip netns exec` mounted a
    /sys of its own, hiding /sys/fs/cgroup) the groups are reached through another
    process's view of the files: /proc/<through_pid>/root/sys/fs/cgroup/..."""
    for group in groups:
        if not os.path.isdir(group) and through_pid is not None:
            group = f"/proc/{through_pid}/root{group}"
        _write(os.path.join(group, "cgroup.procs"), str(os.getpid()))


def freeze(group: str, wait: float = FREEZE_SECONDS) -> bool:
    """Stop every process of freezer group `group`; True once the kernel says FROZEN
    (it reads FREEZING while a process is in the middle of a system call)."""
    _write(os.path.join(group, "freezer.state"), "FROZEN")
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        if _read(os.path.join(group, "freezer.state")) == "FROZEN":
            return True
        time.sleep(0.01)
    return False


def thaw(group: str) -> None:
    """Let every process of freezer group `group` go on (nothing if it is gone)."""
    state = os.path.join(group, "freezer.state")
    if os.path.exists(state):
        _write(state, "THAWED")


def thaw_all(groups: Sequence[str]) -> None:
    """Thaw every freezer group of `groups` that can be: clean-up goes on regardless."""
    for group in groups:
        try:
            thaw(group)
        except CgroupError:
            pass


def remove(groups: Sequence[str]) -> None:
    """Thaw, empty and remove `groups` (deepest first; missing ones are skipped)."""
    thaw_all(groups)
    for group in sorted(groups, key=len, reverse=True):
        if not os.path.isdir(group):
            continue
        _kill_members(group)
        for _ in range(KILL_ROUNDS):  # a killed process leaves its group when it exits
            try:
                os.rmdir(group)
                break
            except FileNotFoundError:
                break
            except OSError:
                time.sleep(0.05)


def leftover_groups(run_names) -> List[str]:
    """Every group under a run folder of these names, in every controller, sub-groups
    first: what a killed run left behind."""
    found = []
    for controller in ("cpu", "freezer"):
        for run in run_names:
            folder = os.path.join(controller_dir(controller), run)
            if os.path.isdir(folder):
                found += [os.path.join(folder, name) for name in sorted(os.listdir(folder))
                          if os.path.isdir(os.path.join(folder, name))] + [folder]
    return found


def _kill_members(group: str) -> None:
    """SIGKILL every process in `group`, pass after pass until none is left."""
    for _ in range(KILL_ROUNDS):
        try:
            pids = _read(os.path.join(group, "cgroup.procs")).split()
        except OSError:
            return
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
        time.sleep(0.05)


def _write(path: str, value) -> None:
    try:
        with open(path, "w") as file:
            file.write(str(value))
    except OSError as error:
        raise CgroupError(f"cannot write {value} to {path}: {error.strerror}") from None


def _read(path: str) -> str:
    with open(path) as file:
        return file.read().strip()


class PauseSchedule(Schedule):
    """Freezes hosts and thaws them on time (schedule.py): each pause is (host, seconds
    after start(), duration). stop() ends the schedule early and thaws every host it
    froze, so a job that ends first never leaves a host frozen; the thread itself thaws
    them too if anything stops it (an error, a closed stderr)."""
    what = "pauses"
    join_seconds = FREEZE_SECONDS + 1

    def __init__(self, network, pauses):
        # at one time, thaw (0) before freeze (1)
        super().__init__(network, [(p.at, 1, "freeze", p.host) for p in pauses]
                         + [(p.at + p.seconds, 0, "thaw", p.host) for p in pauses])
        self.frozen = set()

    def apply(self, action: str, host: int, now: str) -> None:
        name = self.network.spec.hostname(host)
        if action == "freeze":
            self.frozen.add(host)  # before freezing: a failed freeze is thawed too
            done = self.network.freeze(host)
            say(f"{name} paused at {now}"
                + ("" if done else " (not all of its processes froze in time)"))
        else:
            self.network.thaw(host)
            self.frozen.discard(host)
            say(f"{name} resumed at {now}")

    def undo(self) -> None:
        """Thaw every host the schedule froze, each one whatever happens to another."""
        for host in sorted(self.frozen):
            try:
                self.network.thaw(host)
            except Exception as error:
                say(f"cannot thaw {self.network.spec.hostname(host)}: {error}")
            self.frozen.discard(host)
