r"""The emulated network: hosts as Linux namespaces, one switch, shaped links.

First declare what the network is (`ClusterSpec`), then bring it up (`Network.build`)
and always tear it down (`Network.remove`), as Mininet does with its Topo and
net.start()/net.stop():

        node0              node1              node2           a host: a network namespace
      [ eth0 ]           [ eth0 ]           [ eth0 ]          (its own interfaces, addresses,
         |  10.200.0.1      |  10.200.0.2      |  10.200.0.3   ports) and a UTS namespace
         |                  |                  |               (its own hostname)
      [ node0 ]----------[ node1 ]---------[ node2 ]          the switch: a bridge in a
      |______________ bridge "switch" ______________|          namespace of its own

Each link is a veth pair, full duplex. A link of rate R is shaped in both directions
with the kernel's token-bucket filter (tc tbf): on the host's eth0 for what the host
sends and on the switch's port for what it receives, so a host can send R and receive
R at the same time, as on a real NIC. `--latency` needs tc's netem qdisc, which not
every kernel has. A host may have a link of its own rate (`ClusterSpec.link`, the
command line's `--link node1=10mbit`): both of its link's ends are shaped to it.

Hosts may also differ in compute: a host given a CPU share computes slower, and a host
given pauses is frozen for a while (`ClusterSpec.cpu_share`, `ClusterSpec.pauses`;
cgroups.py). Their processes then sit in control groups of the host's own, which
`enter()` joins before it enters the namespaces.

What a process run "on" a host sees: `nsenter --uts=<host's UTS ns> ip netns exec
<host's net ns> CMD`. `ip netns exec` also mounts the host's own /sys (so
/sys/class/net/eth0 is the host's NIC and its byte counters) and bind-mounts the files
of /etc/netns/<name>/ over /etc: each host gets an /etc/hosts naming every host, so
hostnames resolve as on a real cluster (MPICH and gloo rely on that).

Names are unique per run (`cc<6 hex digits>-node0`, ...), so two runs, or tests in
parallel, never collide. Everything a run creates is listed in its state folder
(/run/collectives-cluster/<run>/); `remove()` deletes it all, and `remove_leftovers()`
(`python -m collectives.cluster --cleanup`) does so for runs whose launcher has died.
"""
from __future__ import annotations

import json
import os
import re
import secrets
import select
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Mapping, NamedTuple, Optional, Sequence

from ..launch.links import bucket_bytes
from . import cgroups

STATE_ROOT = "/run/collectives-cluster"
SUBNET = "10.200.0"        # host i is SUBNET.(i+1)/24; private to the run's namespaces
SWITCH_ADDRESS = f"{SUBNET}.254"  # the switch's own: --elastic-store and --on-switch serve there
STORE_PORT = 29400
SERVICE_GRACE_SECONDS = 0.5  # an --on-switch command that ends sooner failed to start
STORE_START_SECONDS = 60.0  # for the store's first line (python and torch imported)
IFACE = "eth0"             # each host's NIC
# Every command the cluster runs, and the Debian package that has it.
TOOLS = {"ip": "iproute2", "tc": "iproute2", "nsenter": "util-linux",
         "unshare": "util-linux", "umount": "mount", "hostname": "hostname",
         "sh": "dash", "cat": "coreutils"}
KILL_ROUNDS = 20           # passes of "kill every process on the hosts" until none is left
LATEST_PAUSE_END = 1e6     # seconds after the start by which every pause has ended (11 days)
_RUN_NAME = re.compile(r"^cc[0-9a-f]{6}$")


class ClusterError(RuntimeError):
    """The cluster cannot be built here (privileges, tools, kernel); one line says why."""


class Pause(NamedTuple):
    """A host frozen for a while: every process on it stops, then goes on."""
    host: int          # the host's index
    at: float          # seconds after the job's ranks start
    seconds: float     # how long it stays frozen


def check_tools() -> None:
    """Raise ClusterError naming every command the cluster needs that is not on PATH,
    with the packages that have them: one line up front, not a traceback from the
    middle of build() or remove() (which runs `ip` even when nothing was built)."""
    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    if missing:
        packages = " ".join(sorted({TOOLS[tool] for tool in missing}))
        raise ClusterError(f"the emulated cluster needs {', '.join(missing)}, not found on "
                           f"PATH (Debian: apt-get install {packages})")


def rate_bits(rate: str) -> int:
    """Bits per second of a tc-style rate: "100mbit", "1gbit", "500kbit", "10gbit"."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(bit|kbit|mbit|gbit|tbit)\s*", rate.lower())
    if not match:
        raise ValueError(f"rate {rate!r}: write a number and kbit, mbit or gbit "
                         "(e.g. 100mbit)")
    scale = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}
    bits = float(match.group(1)) * scale[match.group(2)]
    if bits < 8000:
        raise ValueError(f"rate {rate!r} is too slow to carry a TCP connection")
    return int(bits)


@dataclass(frozen=True)
class ClusterSpec:
    """What the emulated cluster is: hosts, ranks on each, their links and compute."""
    ranks_per_host: Sequence[int]          # one entry per host, e.g. (2, 2) or (1, 3)
    bandwidth: Optional[str] = None        # each link's rate each way ("100mbit"); None: unshaped
    latency: Optional[str] = None          # added one-way delay ("5ms"); needs netem
    # host -> its link's own rate, instead of bandwidth ({1: "10mbit"})
    link: Mapping[int, str] = field(default_factory=dict)
    # host -> the fraction of its fair share of the cores it gets (cgroups.quota_us)
    cpu_share: Mapping[int, float] = field(default_factory=dict)
    pauses: Sequence[Pause] = ()           # hosts frozen for a while

    def __post_init__(self):
        if not self.ranks_per_host or min(self.ranks_per_host) < 1:
            raise ValueError("every host needs at least one rank")
        if self.bandwidth is not None:
            rate_bits(self.bandwidth)
        for host, rate in self.link.items():
            self._check_host(host)
            rate_bits(rate)
        for host, fraction in self.cpu_share.items():
            self._check_host(host)
            if not 0 < fraction <= 1:
                raise ValueError(f"the CPU share of {self.hostname(host)} must be in (0, 1], "
                                 f"got {fraction:g}")
        for pause in self.pauses:
            self._check_host(pause.host)
            if not (0 <= pause.at and 0 < pause.seconds
                    and pause.at + pause.seconds <= LATEST_PAUSE_END):
                raise ValueError(f"a pause of {self.hostname(pause.host)} starts at 0 s or "
                                 f"later, lasts more than 0 s and ends by "
                                 f"{LATEST_PAUSE_END:.0f} s, got {pause.at:g} s for "
                                 f"{pause.seconds:g} s")
        for first, second in zip(sorted(self.pauses), sorted(self.pauses)[1:]):
            if first.host == second.host and second.at < first.at + first.seconds:
                raise ValueError(f"the pauses of {self.hostname(first.host)} overlap")

    def _check_host(self, host: int) -> None:
        if not 0 <= host < self.hosts:
            raise ValueError(f"no host {host}: the hosts are 0..{self.hosts - 1}")

    @property
    def hosts(self) -> int:
        return len(self.ranks_per_host)

    @property
    def world_size(self) -> int:
        return sum(self.ranks_per_host)

    def hostname(self, host: int) -> str:
        return f"node{host}"

    def host_index(self, name: str) -> int:
        """The host called `name`: its hostname (node1) or its index (1)."""
        names = [self.hostname(h) for h in range(self.hosts)]
        if name in names:
            return names.index(name)
        if name.isdigit() and int(name) < self.hosts:
            return int(name)
        raise ValueError(f"no host {name!r}: the hosts are {', '.join(names)} "
                         f"(or 0..{self.hosts - 1})")

    def address(self, host: int) -> str:
        return f"{SUBNET}.{host + 1}"

    def link_rate(self, host: int) -> Optional[str]:
        """The rate of `host`'s link each way: its own, else --bandwidth (None: unshaped)."""
        return self.link.get(host, self.bandwidth)

    def slowest_rate(self) -> Optional[int]:
        """Bits per second of the slowest shaped link (None: no link is shaped)."""
        rates = [rate_bits(r) for r in map(self.link_rate, range(self.hosts)) if r]
        return min(rates) if rates else None

    def links_differ(self) -> bool:
        """Whether the hosts' links are not all alike (a --link of its own, or some
        shaped and some not)."""
        return len({self.link_rate(h) and rate_bits(self.link_rate(h))
                    for h in range(self.hosts)}) > 1

    @property
    def controllers(self) -> List[str]:
        """The cgroup controllers this cluster needs: cpu for CPU shares, freezer for
        pauses. Every host gets a group in each (unlimited, never frozen, unless asked)."""
        return (["cpu"] if self.cpu_share else []) + (["freezer"] if self.pauses else [])


@dataclass
class Network:
    """One run's namespaces, links and files; build() makes them, remove() deletes them."""
    spec: ClusterSpec
    run: str = field(default_factory=lambda: f"cc{secrets.token_hex(3)}")
    owner: int = field(default_factory=os.getpid)
    # the elastic membership store on the switch, once serve_store() started it
    store: Optional[subprocess.Popen] = field(default=None, init=False, repr=False,
                                              compare=False)
    # the commands serve_command() started on the switch
    services: List[subprocess.Popen] = field(default_factory=list, init=False, repr=False,
                                             compare=False)

    # --- names ----------------------------------------------------------------------
    @property
    def state_dir(self) -> str:
        return os.path.join(STATE_ROOT, self.run)

    def netns(self, host: int) -> str:
        return f"{self.run}-{self.spec.hostname(host)}"

    @property
    def switch(self) -> str:
        return f"{self.run}-switch"

    @property
    def namespaces(self) -> List[str]:
        """Every network namespace of the run: the hosts', then the switch's."""
        return [self.netns(h) for h in range(self.spec.hosts)] + [self.switch]

    def uts_file(self, host: int) -> str:
        return os.path.join(self.state_dir, f"{self.spec.hostname(host)}.uts")

    def etc_dir(self, host: int) -> str:
        return os.path.join("/etc/netns", self.netns(host))

    def cgroup(self, controller: str, host: Optional[int] = None) -> str:
        """The run's group in `controller`, or with `host`, that host's group in it."""
        folder = os.path.join(cgroups.controller_dir(controller), self.run)
        return folder if host is None else os.path.join(folder, self.spec.hostname(host))

    def host_cgroups(self, host: int) -> List[str]:
        """Every group `host`'s processes belong to (none unless a host has a CPU share
        or a pause)."""
        return [self.cgroup(controller, host) for controller in self.spec.controllers]

    @property
    def all_cgroups(self) -> List[str]:
        """Every group of the run, each run folder before the hosts' groups in it."""
        return [group for controller in self.spec.controllers
                for group in [self.cgroup(controller)] + [self.cgroup(controller, h)
                                                          for h in range(self.spec.hosts)]]

    def join_cgroups(self, host: int) -> List[str]:
        """The argv prefix that moves a command into `host`'s groups, if it has any."""
        return cgroups.join_argv(self.host_cgroups(host))

    def enter(self, host: int) -> List[str]:
        """The argv prefix that runs a command on `host` (its cgroups, hostname, network,
        /etc). The groups are joined first: inside the host, /sys/fs/cgroup is hidden."""
        return self.join_cgroups(host) + [
            "nsenter", f"--uts={self.uts_file(host)}", "ip", "netns", "exec", self.netns(host)]

    # --- bringing it up -------------------------------------------------------------------
    def build(self) -> "Network":
        """Create every namespace, link, group and file; on any failure remove what was
        made."""
        check_tools()
        check_cgroups(self.spec)
        try:
            os.makedirs(STATE_ROOT, exist_ok=True)
            os.makedirs(self.state_dir)
        except PermissionError as error:
            raise ClusterError(f"needs root to build the emulated cluster: cannot create "
                               f"{self.state_dir} ({error.strerror})") from None
        self._save_state()
        try:
            self._build()
        except BaseException:
            self.remove()
            raise
        return self

    def _build(self) -> None:
        spec = self.spec
        try:
            self._make_cgroups()
        except cgroups.CgroupError as error:
            raise ClusterError(str(error)) from None
        first = _run(["ip", "netns", "add", self.switch], check=False)
        if first.returncode != 0:
            raise ClusterError("needs root (CAP_SYS_ADMIN and CAP_NET_ADMIN) to create "
                               f"network namespaces: ip netns add said: {first.stderr.strip()}")
        commands = [f"netns add {self.netns(h)}" for h in range(spec.hosts)]
        _run(["ip", "-batch", "-"], stdin="\n".join(commands) + "\n")
        _in(self.switch, "ip link add switch type bridge && ip link set switch up "
                         f"&& ip link set lo up && ip addr add {SWITCH_ADDRESS}/24 dev switch")
        for host in range(spec.hosts):
            port = spec.hostname(host)  # the switch's port towards this host
            _run(["ip", "link", "add", IFACE, "netns", self.netns(host), "type", "veth",
                  "peer", "name", port, "netns", self.switch])
            _in(self.switch, f"ip link set {port} master switch && ip link set {port} up")
            _in(self.netns(host), f"ip addr add {spec.address(host)}/24 dev {IFACE} "
                                  f"&& ip link set {IFACE} up && ip link set lo up")
            self._shape(self.netns(host), IFACE, spec.link_rate(host))
            self._shape(self.switch, port, spec.link_rate(host))
            self._name_host(host)

    def _make_cgroups(self) -> None:
        """A group per host in each controller the spec needs. In cpu, each group weighs
        as many ranks as it holds (cgroups.cpu_shares: the kernel splits the cores per
        group), the run's folder all of them; a host with a CPU share gets its quota
        (cgroups.quota_us), the others none (-1: unlimited)."""
        spec = self.spec
        for controller in spec.controllers:
            cpu = controller == "cpu"
            cgroups.create(self.cgroup(controller),
                           {"cpu.shares": cgroups.cpu_shares(spec.world_size)} if cpu else {})
            for host in range(spec.hosts):
                settings = {}
                if cpu:
                    settings["cpu.shares"] = cgroups.cpu_shares(spec.ranks_per_host[host])
                if cpu and host in spec.cpu_share:
                    settings["cpu.cfs_period_us"] = cgroups.PERIOD_US
                    settings["cpu.cfs_quota_us"] = cgroups.quota_us(
                        spec.cpu_share[host], spec.ranks_per_host[host], spec.world_size)
                cgroups.create(self.cgroup(controller, host), settings)

    def _shape(self, namespace: str, device: str, rate: Optional[str]) -> None:
        """Limit what leaves `device` to `rate` (and delay, with netem)."""
        spec = self.spec
        if rate is None and spec.latency is None:
            return
        if spec.latency is not None:
            rate = f" rate {rate}" if rate else ""
            done = _run(["ip", "netns", "exec", namespace, "tc", "qdisc", "add", "dev", device,
                         "root", "netem", "delay", spec.latency, *rate.split(),
                         "limit", "100000"], check=False)
            if done.returncode != 0:
                raise ClusterError(f"--latency needs tc's netem qdisc, which this kernel "
                                   f"does not have ({done.stderr.strip()}); use --bandwidth "
                                   "alone")
            return
        burst = bucket_bytes(rate_bits(rate) // 8)
        _in(namespace, f"tc qdisc add dev {device} root tbf rate {rate} "
                       f"burst {burst} latency 100ms")

    def _name_host(self, host: int) -> None:
        """A UTS namespace holding the host's name, and its /etc/hosts."""
        uts = self.uts_file(host)
        open(uts, "w").close()
        _run(["unshare", f"--uts={uts}", "hostname", self.spec.hostname(host)])
        os.makedirs(self.etc_dir(host), exist_ok=True)
        # Each address also as IPv6 sees it (::ffff:a.b.c.d): torch's store accepts on a
        # dual-stack socket and looks its clients' names up by that form; without it the
        # lookup goes on to DNS, which no host here can reach, and c10d warns on every rank.
        names = [(self.spec.address(h), self.spec.hostname(h)) for h in range(self.spec.hosts)]
        names.append((SWITCH_ADDRESS, "switch"))  # where --elastic-store and --on-switch serve
        lines = ["127.0.0.1 localhost"] + [
            f"{address} {name}" for ip, name in names for address in (ip, f"::ffff:{ip}")]
        with open(os.path.join(self.etc_dir(host), "hosts"), "w") as hosts:
            hosts.write("\n".join(lines) + "\n")

    def _save_state(self) -> None:
        """Write state.json whole or not at all (a temporary file, then renamed): a
        launcher killed while writing must not leave a folder --cleanup cannot read."""
        path = os.path.join(self.state_dir, "state.json")
        with open(path + ".tmp", "w") as state:
            json.dump({"run": self.run, "owner": self.owner, "spec": asdict(self.spec),
                       "cgroups": self.all_cgroups,
                       "hosts": {self.spec.hostname(h): {"netns": self.netns(h),
                                                         "uts": self.uts_file(h),
                                                         "address": self.spec.address(h),
                                                         "cgroups": self.host_cgroups(h)}
                                 for h in range(self.spec.hosts)}}, state)
        os.replace(path + ".tmp", path)

    # --- while it runs ----------------------------------------------------------------------
    def set_link(self, host: int, up: bool) -> None:
        """Plug or unplug a host's cable (its NIC goes down: nothing in or out)."""
        _in(self.netns(host), f"ip link set {IFACE} {'up' if up else 'down'}")

    def link_bytes(self, host: int) -> Dict[str, int]:
        """Bytes a host's NIC has sent and received so far, as the kernel counts them."""
        out = _run(["ip", "netns", "exec", self.netns(host), "cat",
                    f"/sys/class/net/{IFACE}/statistics/tx_bytes",
                    f"/sys/class/net/{IFACE}/statistics/rx_bytes"]).stdout.split()
        return {"sent": int(out[0]), "received": int(out[1])}

    def freeze(self, host: int) -> bool:
        """Stop every process on `host` (needs a spec with pauses); True once frozen."""
        return cgroups.freeze(self.cgroup("freezer", host))

    def thaw(self, host: int) -> None:
        """Let every process on `host` go on where it stopped."""
        cgroups.thaw(self.cgroup("freezer", host))

    def kill_host(self, host: int) -> None:
        """SIGKILL every process on `host`, as when a machine dies (a frozen host is
        thawed first: SIGKILL reaches a frozen process only once it is thawed)."""
        cgroups.thaw_all([group for group in self.host_cgroups(host) if "freezer" in group])
        _kill_processes([self.netns(host)])

    def serve_store(self) -> str:
        """Run the elastic membership store (`python -m collectives.elastic.store`) on
        the switch, which no host's failure takes down. Returns HOST:PORT, for the
        ranks' $COLLECTIVES_ELASTIC_STORE; the store goes with the run's processes."""
        log = os.path.join(self.state_dir, "store.log")  # goes with the run's state
        with open(log, "w") as errors:
            self.store = subprocess.Popen(
                ["ip", "netns", "exec", self.switch, sys.executable, "-m",
                 "collectives.elastic.store", "--port", str(STORE_PORT)],
                stdout=subprocess.PIPE, stderr=errors, text=True)
        ready, _, _ = select.select([self.store.stdout], [], [], STORE_START_SECONDS)
        if not ready or "listening" not in self.store.stdout.readline():  # its first line
            self.store.kill()
            self.store.wait()
            with open(log) as errors:
                raise ClusterError(f"the membership store did not start on the switch "
                                   f"within {STORE_START_SECONDS:g} s: "
                                   f"{errors.read().strip()[-500:]}")
        return f"{SWITCH_ADDRESS}:{STORE_PORT}"

    def serve_command(self, command: str) -> None:
        """Run a shell command on the switch, which no host's failure takes down: a
        service the job's ranks reach at `switch` (SWITCH_ADDRESS), such as torchft's
        lighthouse. Its output goes to this launcher's stderr; it goes with the run's
        processes."""
        service = subprocess.Popen(["ip", "netns", "exec", self.switch, "sh", "-c", command],
                                   stdin=subprocess.DEVNULL, stdout=sys.stderr,
                                   stderr=sys.stderr)
        self.services.append(service)
        try:  # one that fails at once (not found, its port taken) says so before the job
            status = service.wait(timeout=SERVICE_GRACE_SECONDS)
        except subprocess.TimeoutExpired:
            return
        raise ClusterError(f"--on-switch {command!r} exited at once (status {status}); "
                           "its output is above")

    # --- tearing it down --------------------------------------------------------------------
    def kill_processes(self) -> None:
        """Kill every process still running on a host: what a job's ranks left behind
        (`cmd &` outlives its shell) may hold their output pipes open. Frozen hosts are
        thawed first: SIGKILL reaches a frozen process only once it is thawed."""
        cgroups.thaw_all(self.all_cgroups)
        _kill_processes(self.namespaces)
        for served in [self.store] + self.services:  # killed with the switch's: reap them
            if served is not None:
                try:
                    served.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    pass  # not reaped (a zombie until the launcher exits): the rest still is

    def remove(self) -> None:
        """Kill what still runs on the hosts, then delete every namespace, link, group
        and file."""
        _remove_run(self.run, self.namespaces,
                    [self.uts_file(h) for h in range(self.spec.hosts)],
                    [self.etc_dir(h) for h in range(self.spec.hosts)], self.state_dir,
                    self.all_cgroups)

    def __enter__(self) -> "Network":
        return self.build()

    def __exit__(self, *exc) -> None:
        self.remove()


def _kill_processes(namespaces: List[str]) -> None:
    """SIGKILL every process inside `namespaces`, pass after pass until none is left: a
    process that forks while a pass kills its parent leaves a child that pass missed.
    (A killed process stops being listed once it has exited, even before it is reaped.)"""
    existing = set(_list_netns())
    namespaces = [namespace for namespace in namespaces if namespace in existing]
    for _ in range(KILL_ROUNDS):
        listings = [_run(["ip", "netns", "pids", namespace], check=False)
                    for namespace in namespaces]
        pids = [pid for listing in listings for pid in listing.stdout.split()]
        if not pids and all(listing.returncode == 0 for listing in listings):
            return  # none left (a listing that failed says nothing: look again)
        for pid in pids:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
        time.sleep(0.05)  # let them exit before looking again


def check_cgroups(spec: ClusterSpec) -> None:
    """Raise ClusterError unless every cgroup controller `spec` needs is here."""
    options = {"cpu": "--cpu-share", "freezer": "--pause"}
    for controller in spec.controllers:
        try:
            cgroups.check_controller(controller, options[controller])
        except cgroups.CgroupError as error:
            raise ClusterError(str(error)) from None


def _remove_run(run: str, namespaces: List[str], uts_files: List[str], etc_dirs: List[str],
                state_dir: str, groups: Sequence[str] = ()) -> None:
    cgroups.thaw_all(groups)     # a frozen process cannot die: thaw before killing
    _kill_processes(namespaces)  # every process still inside a host dies first
    cgroups.remove(groups)       # and every one still in a host's groups
    existing = set(_list_netns())
    for namespace in namespaces:
        if namespace in existing:
            _run(["ip", "netns", "del", namespace], check=False)  # its links go with it
    for uts in uts_files:
        if os.path.exists(uts):
            _run(["umount", uts], check=False)
    for folder in etc_dirs:
        shutil.rmtree(folder, ignore_errors=True)
    shutil.rmtree(state_dir, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_leftovers() -> List[str]:
    """Remove what runs whose launcher has died left behind; return their names.

    A run's folder names its owner's pid; runs whose owner still lives are left alone,
    so this is safe while other clusters are running. Namespaces of our naming with no
    folder at all (a run killed before it wrote one) are removed too.
    """
    removed, live = [], set()
    folders = sorted(os.listdir(STATE_ROOT)) if os.path.isdir(STATE_ROOT) else []
    for run in folders:
        folder = os.path.join(STATE_ROOT, run)
        try:
            with open(os.path.join(folder, "state.json")) as file:
                state = json.load(file)
        except (OSError, ValueError):
            state = None
        if state is not None and _alive(state["owner"]):
            live.add(run)
            continue
        hosts = state["hosts"].values() if state else []
        _remove_run(run, [h["netns"] for h in hosts] + [f"{run}-switch"],
                    [h["uts"] for h in hosts],
                    [os.path.join("/etc/netns", h["netns"]) for h in hosts], folder,
                    cgroups.leftover_groups([run]))
        removed.append(run)
    for namespace in _list_netns():
        run = namespace.split("-")[0]
        if _RUN_NAME.match(run) and run not in live:
            _remove_run(run, [namespace], [], [os.path.join("/etc/netns", namespace)],
                        os.path.join(STATE_ROOT, run), cgroups.leftover_groups([run]))
            if run not in removed:
                removed.append(run)
    for controller in ("cpu", "freezer"):  # groups of runs killed before their folder
        root = cgroups.controller_dir(controller)
        runs = os.listdir(root) if os.path.isdir(root) else []
        for run in runs:
            if _RUN_NAME.match(run) and run not in live:
                _remove_run(run, [], [], [], os.path.join(STATE_ROOT, run),
                            cgroups.leftover_groups([run]))
                if run not in removed:
                    removed.append(run)
    return removed


def _list_netns() -> List[str]:
    out = _run(["ip", "netns", "list"], check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _run(argv: List[str], check: bool = True, stdin: Optional[str] = None):
    try:
        # In a session of its own: a Ctrl-C at the terminal reaches the launcher (which
        # finishes its clean-up), never the ip/tc/umount commands that clean-up runs.
        done = subprocess.run(argv, capture_output=True, text=True, input=stdin,
                              start_new_session=True)
    except FileNotFoundError:  # check_tools() says so up front; this is the last guard
        raise ClusterError(f"{argv[0]} not found on PATH: the emulated cluster needs it "
                           f"(Debian: apt-get install {TOOLS.get(argv[0], argv[0])})") from None
    if check and done.returncode != 0:
        raise ClusterError(f"{' '.join(argv)} failed: {done.stderr.strip()}")
    return done


def _in(namespace: str, script: str) -> None:
    """Run a short shell script inside a namespace (several ip/tc commands in one go)."""
    _run(["ip", "netns", "exec", namespace, "sh", "-ec", script])
