"""The emulated cluster: hosts with their own network and hostname, on fast links.

Needs root (network namespaces), as CI has; skipped with the reason elsewhere. Every
test removes what it built, and checks that nothing of its run is left.
"""
import contextlib
import glob
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest

from collectives.cluster import ClusterError, ClusterSpec, Network, cgroups
from collectives.cluster.__main__ import _clean_up, describe, parse
from collectives.cluster.job import Job, _cluster_env, start_mpirun, start_ranks
from collectives.cluster.network import STATE_ROOT, TOOLS, Pause
from collectives.cluster.slurm import PROGRAMS, slurm_conf
from collectives.launch.mpirun import find_mpirun

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
FAST = "1gbit"

pytestmark = [
    pytest.mark.skipif(
        os.geteuid() != 0 or subprocess.run(["ip", "netns", "list"], capture_output=True).returncode,
        reason="the emulated cluster needs root and iproute2"),
    # namespaces, cgroups and `--cleanup` are the machine's: one such test at a time
    pytest.mark.xdist_group("machine")]


def netns_names():
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


MARK = "COLLECTIVES_TEST_MARK"  # in a launcher's environment, so in all its job starts


def marked_processes(mark):
    """Pids of the live processes whose environment holds MARK=`mark` (a zombie's
    environment reads empty: it holds nothing any more)."""
    wanted, found = f"{MARK}={mark}".encode(), []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as environ:
                if wanted in environ.read().split(b"\0"):
                    found.append(int(pid))
        except OSError:
            pass  # gone meanwhile, or a kernel thread
    return found


def host_links():
    """Names of the veth and bridge devices in this (the machine's own) namespace."""
    names = set()
    for kind in ("veth", "bridge"):
        out = subprocess.run(["ip", "-o", "link", "show", "type", kind], capture_output=True,
                             text=True).stdout
        names |= {line.split(":")[1].strip().split("@")[0] for line in out.splitlines()}
    return names


def assert_left_nothing(run, mark=None, links_before=None):
    """Nothing of cluster run `run` is left: no namespace, no mount (the namespaces' and
    the hostnames'), no /etc/netns folder, no state folder; with `mark`, no process of
    the job (its environment carries the mark); with `links_before`, no veth or bridge
    in this namespace that was not there before."""
    leftovers = {n for n in netns_names() if n.startswith(run + "-")}
    assert not leftovers, f"namespaces left behind: {leftovers}"
    with open("/proc/self/mountinfo") as mounts:
        mounted = [line.split()[4] for line in mounts if run in line]
    assert not mounted, f"mounts left behind: {mounted}"
    etc = os.listdir("/etc/netns") if os.path.isdir("/etc/netns") else []
    assert not [name for name in etc if name.startswith(run + "-")], etc
    assert not os.path.exists(os.path.join(STATE_ROOT, run))
    assert not cgroups.leftover_groups([run]), "cgroups left behind"
    if mark is not None:
        assert not marked_processes(mark), "processes of the job left behind"
    if links_before is not None:
        assert not host_links() - links_before, "links left in this namespace"


def assert_removed(network: Network):
    assert_left_nothing(network.run)


def checks(case, backend="gloo"):
    return [sys.executable, os.path.join(HERE, "checks_cluster.py"), backend, case]


def read_ranks(outdir, world_size):
    results = []
    for rank in range(world_size):
        with open(os.path.join(outdir, f"rank{rank}.json")) as file:
            results.append(json.load(file))
    return results


def expected_bytes(ranks_per_host, host, size):
    """What each algorithm's cost formula says host `host`'s link carries out, and what
    one of its ranks sends by route, for an all-reduce of `size` bytes.

    ring: the ring visits hosts in order, so one stream of 2(n-1)/n K leaves each host.
    naive: ranks off rank 0's host send K to it; rank 0's host sends each of them K back.
    hierarchical: the link carries 2(H-1)/H K; a rank of a host of L sends 2(L-1)/L K
    through shared memory (phases 1 and 3), and 2(H-1)/H K/L over the network when
    every host has L ranks.
    """
    n, hosts, here = sum(ranks_per_host), len(ranks_per_host), ranks_per_host[host]
    link = {"ring": 2 * (n - 1) / n * size,
            "naive": size * (n - here if host == 0 else here),
            "hierarchical": 2 * (hosts - 1) / hosts * size}
    routes = {"shm": 2 * (here - 1) / here * size,
              "network": 2 * (hosts - 1) / hosts * size / here}
    return link, routes


@pytest.mark.timeout(400)
@pytest.mark.parametrize("ranks_per_host,placement,case", [
    # every op x dtype once across hosts, where both routes (shm, network) carry the
    # algorithms; each op and dtype once on the other clusters (checks_cluster's PAIRS)
    ((2, 2), "consecutive", "algorithms"),
    ((1, 1), "consecutive", "paired"), ((2, 2, 2), "consecutive", "paired"),
    ((1, 3), "consecutive", "paired"),
    ((2, 2), "round robin", "paired"),  # mpirun -hosts node0,node1 deals ranks 0 2 | 1 3
])
def test_every_algorithm_is_right_across_hosts_and_the_bytes_follow_the_formulas(
        ranks_per_host, placement, case, tmp_path):
    spec = ClusterSpec(ranks_per_host, bandwidth=FAST)
    with Network(spec) as network:
        if placement == "consecutive":
            job = start_ranks(network, checks(case) + [str(tmp_path)], prefix=False)
            host_of = [h for h, count in enumerate(ranks_per_host) for _ in range(count)]
        else:
            hosts = ",".join(spec.hostname(h) for h in range(spec.hosts))
            job = start_mpirun(network, [find_mpirun()[0], "-np", str(spec.world_size),
                                         "-hosts", hosts, *checks(case), str(tmp_path)])
            host_of = [rank % spec.hosts for rank in range(spec.world_size)]
        assert job.wait(timeout=360) == 0
    assert_removed(network)
    results = read_ranks(tmp_path, spec.world_size)
    for rank, (result, host) in enumerate(zip(results, host_of)):
        assert result["hostname"] == f"node{host}"   # each host its own name
        assert result["local_rank"] == host_of[:rank].count(host), result  # and its place
        # shared memory only inside a host that has two ranks; the backend between hosts
        assert result["transport"] == ("gloo" if max(ranks_per_host) == 1 else "gloo+shm")
        assert result["digest"] == results[0]["digest"], "ranks differ bitwise"
    assert results[0]["checks"] > 100
    size = 4 << 20
    for host in range(spec.hosts):
        link, routes = expected_bytes(ranks_per_host, host, size)
        mine = [r for r, h in zip(results, host_of) if h == host]
        # the ring visits each host's ranks together however they were placed: one
        # stream out of each host (round robin by rank number would cross every hop)
        for algorithm, payload in link.items():
            # The NIC counts headers too: up to ~5 % for 1514-byte frames carrying 1448
            # bytes each, less where the kernel counts bigger (offloaded) frames.
            nic = mine[0]["sent"][algorithm]["nic"]
            assert 0.995 < nic / payload < 1.07, (
                f"host {host} {algorithm}: NIC sent {nic} bytes, the formula says {payload}")
            # what the transport counted leaving this host agrees with the formula
            network = sum(r["sent"][algorithm]["network"] for r in mine)
            assert abs(network / payload - 1) < 0.01, (host, algorithm, network, payload)
        if len(set(ranks_per_host)) == 1:  # even hosts: each rank's share by route
            for result in mine:
                for route, payload in routes.items():
                    counted = result["sent"]["hierarchical"][route]
                    assert abs(counted - payload) <= 0.01 * size, (route, counted, payload)


@pytest.mark.timeout(400)
def test_our_ddp_equals_torch_ddp_on_2_hosts_of_2_ranks(tmp_path):
    spec = ClusterSpec((2, 2), bandwidth=FAST)
    with Network(spec) as network:
        job = start_ranks(network, checks("ddp") + [str(tmp_path)], prefix=False)
        assert job.wait(timeout=360) == 0  # each rank asserts equality with torch's DDP
    assert_removed(network)
    results = read_ranks(tmp_path, 4)
    assert len({r["digest"] for r in results}) == 1, "ranks ended with different parameters"
    assert {r["transport"] for r in results} == {"gloo+shm"}


@pytest.mark.timeout(200)
@pytest.mark.parametrize("fault", ["link cut", "SIGKILL"])
def test_a_cut_link_or_a_killed_rank_is_a_peer_error_on_every_survivor(fault, tmp_path):
    spec = ClusterSpec((2, 2), bandwidth=FAST)
    timeout = 5
    with Network(spec) as network:
        job = start_ranks(network, checks("loop") + [str(tmp_path)],
                          extra_env={"CHECK_TIMEOUT": str(timeout)})
        deadline = time.monotonic() + 120  # until every rank is inside its loop
        while (len(list(tmp_path.glob("looping-*"))) < spec.world_size
               and time.monotonic() < deadline and job.processes[0].poll() is None):
            time.sleep(0.2)
        assert len(list(tmp_path.glob("looping-*"))) == spec.world_size
        victim = 2  # the first rank of node1
        cut_at = time.monotonic()
        if fault == "link cut":
            network.set_link(1, up=False)
        else:
            job.processes[victim].send_signal(signal.SIGKILL)
        status = job.wait(timeout=timeout + 60)
    assert_removed(network)
    assert status != 0
    survivors = [r for r in range(spec.world_size) if fault == "link cut" or r != victim]
    results = {}
    for rank in survivors:
        with open(tmp_path / f"rank{rank}.json") as file:
            results[rank] = json.load(file)
        assert results[rank]["raised"] and results[rank]["raised"].startswith("PeerError"), (
            results[rank])
        assert results[rank]["failed_at"] - cut_at < timeout + 10, results[rank]
    host_of = {rank: rank // 2 for rank in range(spec.world_size)}  # node0: 0 1, node1: 2 3
    # Who can have failed a rank: the killed rank, or across the cut link any rank of
    # the other host.
    culprits = {rank: ({victim} if fault == "SIGKILL" else
                       {r for r in host_of if host_of[r] != host_of[rank]})
                for rank in survivors}
    if fault == "SIGKILL":
        assert_each_names_the_peer_that_failed_it(results, culprits)
    else:
        assert_a_cut_is_named_across_it(results, culprits)


def named_peer(raised: str) -> int:
    """The rank a PeerError says it was waiting for ("receive from rank 2 failed: ...")."""
    found = re.search(r"(?:receive from|send to) rank (\d+)", raised)
    assert found, f"the error names no peer: {raised}"
    return int(found.group(1))


def assert_each_names_the_peer_that_failed_it(results, culprits):
    """Each survivor's PeerError names the peer it waited for. That peer is one of its
    culprits (the killed rank; the other host, across a cut link), or a survivor that
    had given up before it (and left the collective, so its peers gave up in turn).
    The first survivor to fail can only name a culprit: nobody had given up yet.
    failed_at is each rank's monotonic clock, one machine's: a rank that left is
    noticed only after it left (in well under the timeout: a closed connection, or its
    pid gone), so the order is causal, not a race."""
    order = sorted(results, key=lambda rank: results[rank]["failed_at"])
    first = order[0]
    assert named_peer(results[first]["raised"]) in culprits[first], (first, results[first])
    for position, rank in enumerate(order):
        gave_up_before = set(order[:position])
        peer = named_peer(results[rank]["raised"])
        assert peer in culprits[rank] | gave_up_before, (
            f"rank {rank} names rank {peer}: neither {sorted(culprits[rank])} nor a rank that "
            f"had failed before it ({sorted(gave_up_before)})", results[rank])


def assert_a_cut_is_named_across_it(results, culprits):
    """A cut link kills nobody: every survivor times out, and one that waits on a peer of
    its own host (itself stuck behind the cut, not yet failed) may time out first and
    name that peer. So: each names another rank, and some survivor names a rank across
    the cut."""
    named = {rank: named_peer(result["raised"]) for rank, result in results.items()}
    assert all(peer != rank for rank, peer in named.items()), named
    assert any(named[rank] in culprits[rank] for rank in named), (
        f"no survivor names a rank across the cut link: {named}", results)


@pytest.mark.timeout(200)
def test_mpirun_runs_across_the_emulated_hosts(tmp_path):
    """mpirun, with no host list, fills each host in turn; the mpi backend's ranks find
    their place and every algorithm, op and dtype agrees (its native all-reduce maps
    each dtype and op to MPI's). gloo's ranks under mpirun: test_every_algorithm's
    round robin."""
    spec = ClusterSpec((2, 2), bandwidth=FAST)
    with Network(spec) as network:
        job = start_mpirun(network, [find_mpirun()[0], "-np", "4", *checks("algorithms", "mpi"),
                                     str(tmp_path)])
        assert job.wait(timeout=180) == 0
    assert_removed(network)
    results = read_ranks(tmp_path, 4)
    assert [r["hostname"] for r in results] == ["node0", "node0", "node1", "node1"]
    assert [r["local_rank"] for r in results] == [0, 1, 0, 1]
    assert {r["transport"] for r in results} == {"mpi+shm"}  # shm inside a host
    assert len({r["digest"] for r in results}) == 1


def run_cli(*args, timeout=120, **kwargs):
    return subprocess.run([sys.executable, "-m", "collectives.cluster", *args],
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT, **kwargs)


@pytest.mark.timeout(120)
def test_cli_one_host_prefixes_output_and_returns_the_worst_status():
    done = run_cli("--hosts", "1", "--ranks-per-host", "2", "--", "sh", "-c",
                   'hostname; echo "rank $RANK of $WORLD_SIZE"; exit $((RANK * 3))')
    assert done.returncode == 3, done.stderr
    lines = sorted(done.stdout.splitlines())
    assert lines == ["[rank 0 node0]: node0", "[rank 0 node0]: rank 0 of 2",
                     "[rank 1 node0]: node0", "[rank 1 node0]: rank 1 of 2"], done.stdout


SERVICE = """
import socket, sys
server = socket.create_server(("", 29655))
print("serving", flush=True)
while True:
    peer, _ = server.accept()
    peer.sendall(socket.gethostname().encode())
    peer.close()
"""

CLIENT = """
import socket, time
for _ in range(200):
    try:
        with socket.create_connection(("switch", 29655), timeout=2) as service:
            print("the switch says", service.recv(100).decode())
            break
    except OSError:
        time.sleep(0.05)
"""


@pytest.mark.timeout(120)
def test_on_switch_runs_a_service_every_host_reaches_and_removes_it_with_the_run():
    """--on-switch: the command runs in the switch's namespace (so a host's cut or kill
    cannot take it down), every rank reaches it at the name `switch`, its output goes
    to the launcher's stderr, and it is gone when the job ends."""
    mark = secrets.token_hex(4)
    done = run_cli("--hosts", "2", "--on-switch", f"{sys.executable} -c '{SERVICE}'", "--",
                   sys.executable, "-c", CLIENT, env={**os.environ, MARK: mark})
    assert done.returncode == 0, done.stderr
    switch_name = socket.gethostname()  # the switch's namespace keeps this machine's name
    assert sorted(done.stdout.splitlines()) == [
        f"[rank 0 node0]: the switch says {switch_name}",
        f"[rank 1 node1]: the switch says {switch_name}"], done.stdout + done.stderr
    assert "on the switch: " in done.stderr.splitlines()[0]
    assert "serving" in done.stderr
    assert marked_processes(mark) == []


@pytest.mark.timeout(60)
def test_an_on_switch_command_that_fails_at_once_is_one_line_and_exit_2():
    mark = secrets.token_hex(4)
    done = run_cli("--hosts", "1", "--on-switch", "exit 3", "--", "true",
                   env={**os.environ, MARK: mark})
    assert done.returncode == 2, done.stderr
    assert "--on-switch 'exit 3' exited at once (status 3)" in done.stderr
    assert marked_processes(mark) == []


def runs_owned_by(pid):
    """The names of the cluster runs whose launcher is `pid` (from their state files)."""
    runs = []
    for state in glob.glob(os.path.join(STATE_ROOT, "*", "state.json")):
        try:
            with open(state) as file:
                if json.load(file)["owner"] == pid:
                    runs.append(os.path.basename(os.path.dirname(state)))
        except (OSError, ValueError):
            pass  # a run being built or removed right now
    return runs


def remove_run(run):
    """Remove what cluster run `run` left (a test's own run, after its launcher died)."""
    try:
        with open(os.path.join(STATE_ROOT, run, "state.json")) as file:
            ranks_per_host = json.load(file)["spec"]["ranks_per_host"]
    except (OSError, ValueError):
        ranks_per_host = [1] * sum(n.startswith(run + "-node") for n in netns_names())
    Network(ClusterSpec(ranks_per_host or [1]), run=run).remove()
    cgroups.remove(cgroups.leftover_groups([run]))


def stop_launcher(launcher):
    """Stop a launcher that is still running (SIGTERM, which every version handles;
    SIGKILL if that is not enough) and remove its runs."""
    runs = runs_owned_by(launcher.pid)
    if launcher.poll() is None:
        launcher.terminate()
        try:
            launcher.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            launcher.kill()
            launcher.communicate()
    for run in runs:
        remove_run(run)


def start_launcher(*args, **popen):
    """`python -m collectives.cluster ARGS` in the background, its environment marked:
    (the process, the mark)."""
    mark = secrets.token_hex(4)
    launcher = subprocess.Popen([sys.executable, "-m", "collectives.cluster", *args],
                                cwd=ROOT, env=dict(os.environ, **{MARK: mark}), **popen)
    return launcher, mark


def default_stop_signals() -> None:
    """In the launcher's process before it starts: SIGHUP and SIGINT as a terminal's
    foreground job has them. A test run in the background (a CI runner, `cmd &`) passes
    SIGINT on ignored, and the launcher rightly keeps ignoring a signal it was started
    ignoring (as `nohup` needs): the test would then check nothing."""
    for signum in (signal.SIGHUP, signal.SIGINT):
        signal.signal(signum, signal.SIG_DFL)


@contextlib.contextmanager
def running_launcher(*args, hosts, **popen):
    """A launcher running ARGS, once its network of `hosts` hosts is up: (the process,
    its run's name, its mark). Whatever happens, it is stopped and its run removed."""
    launcher, mark = start_launcher(*args, **popen)
    try:
        deadline, run = time.monotonic() + 60, None
        while run is None and time.monotonic() < deadline and launcher.poll() is None:
            time.sleep(0.2)
            for candidate in runs_owned_by(launcher.pid):
                up = {n for n in netns_names() if n.startswith(candidate + "-")}
                run = candidate if len(up) == hosts + 1 else None  # and the switch
        assert run is not None, "the launcher built no network"
        yield launcher, run, mark
    finally:
        stop_launcher(launcher)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stop", [signal.SIGHUP, signal.SIGINT, signal.SIGTERM],
                         ids=["SIGHUP", "SIGINT", "SIGTERM"])
def test_cli_stopped_by_a_signal_removes_everything_and_exits_128_plus_it(stop):
    """A closed terminal or dropped ssh session (SIGHUP), Ctrl-C, kill: the ranks stop,
    the network goes, and the status says which signal, as a shell reports it."""
    links = host_links()
    with running_launcher("--hosts", "2", "--", "sleep", "60", hosts=2,
                          preexec_fn=default_stop_signals) as (launcher, run, mark):
        launcher.send_signal(stop)
        assert launcher.wait(timeout=30) == 128 + stop
    assert_left_nothing(run, mark, links)


@pytest.mark.timeout(120)
def test_cli_killed_leaves_its_run_to_cleanup():
    """SIGKILL leaves the launcher no chance: its run stays until --cleanup removes it."""
    links = host_links()
    with running_launcher("--hosts", "2", "--", "sleep", "60", hosts=2) as (launcher, run,
                                                                            mark):
        launcher.kill()
        launcher.wait(timeout=30)
        assert any(n.startswith(run + "-") for n in netns_names())
        done = run_cli("--cleanup")
        assert done.returncode == 0 and run in done.stdout, done.stdout
    assert_left_nothing(run, mark, links)


@pytest.mark.timeout(120)
def test_cli_ends_with_its_ranks_though_a_child_they_left_holds_their_output():
    """Each rank's shell starts `sleep 1000 &` and ends: the sleep still holds the pipe
    its output is prefixed from. The launcher ends with the ranks all the same, kills
    the sleeps and removes everything."""
    links = host_links()
    launcher, mark = start_launcher("--hosts", "2", "--", "sh", "-c",
                                    "sleep 1000 & ip netns identify", stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True)
    try:
        out, err = launcher.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        stop_launcher(launcher)
        pytest.fail("the launcher still runs 30 s after its ranks ended")
    assert launcher.returncode == 0, err
    lines = sorted(out.splitlines())
    assert [line.split(": ")[0] for line in lines] == ["[rank 0 node0]", "[rank 1 node1]"], out
    run = lines[0].split(": ")[1].split("-")[0]  # the rank's namespace: <run>-node0
    assert_left_nothing(run, mark, links)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("args", [("--hosts", "2", "--", "true"), ("--cleanup",)],
                         ids=["job", "cleanup"])
def test_a_missing_tool_is_one_line_and_exit_2(args, tmp_path):
    """PATH has every tool the cluster runs but `ip`: one line names it and its package."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in TOOLS:
        if tool != "ip":
            os.symlink(shutil.which(tool), bin_dir / tool)
    before = netns_names()
    done = subprocess.run([sys.executable, "-m", "collectives.cluster", *args], cwd=ROOT,
                          env=dict(os.environ, PATH=str(bin_dir)), capture_output=True,
                          text=True, timeout=50)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "needs ip," in lines[0] and "iproute2" in lines[0], done.stderr
    assert not netns_names() - before


@pytest.mark.timeout(60)
def test_without_privileges_one_line_and_exit_2():
    before = netns_names()
    done = subprocess.run(["unshare", "--user", sys.executable, "-m", "collectives.cluster",
                           "--hosts", "2", "--", "true"], capture_output=True, text=True,
                          timeout=50, cwd=ROOT)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "needs root" in lines[0], done.stderr
    assert netns_names() == before


def test_latency_works_or_says_in_one_line_that_netem_is_missing():
    """With netem, every host's NIC delays what it sends by the latency asked for (tc
    lists the qdisc in the host's namespace). Without it (this kernel's case: the
    kernel has no sch_netem), one line naming netem and exit status 2, nothing built."""
    before = netns_names()
    done = run_cli("--hosts", "2", "--latency", "5ms", "--", "sh", "-c",
                   'tc qdisc show dev "$COLLECTIVES_CLUSTER_IFACE"')
    if done.returncode == 0:
        for host in ("node0", "node1"):
            shown = [line for line in done.stdout.splitlines() if f" {host}]:" in line]
            assert any("netem" in line and "delay 5ms" in line for line in shown), (
                host, done.stdout)
    else:
        assert done.returncode == 2, done.stderr
        assert done.stderr.strip().count("\n") == 0 and "netem" in done.stderr, done.stderr
    assert netns_names() == before


# --- hosts that are not alike: --cpu-share, --link, --pause ----------------------------

def rank_lines(stdout):
    """{hostname: [words of each line its rank printed]}, from lines `nodeH WORD ...`
    (under --no-prefix: each rank writes its line in one write, whole)."""
    out = {}
    for line in stdout.splitlines():
        host, *words = line.split()
        out.setdefault(host, []).append(words)
    return out


SPIN = """
import os, time
end = time.monotonic() + 1.5
cpu = time.process_time()
n = 0
while time.monotonic() < end:
    n += 1
os.write(1, f"{os.uname().nodename} {n} {time.process_time() - cpu}\\n".encode())
"""


@pytest.mark.timeout(60)
def test_cpu_share_slows_that_host_down():
    """2 hosts x 1 rank, each counting loop iterations for 1.5 s (and the CPU time that
    took); node1 gets a quarter of its fair share, a quarter of one core on 2 cores or
    more (--cpu-share node1=0.25). Its CPU time is capped by the kernel, whatever else
    runs; node0's is not: on a machine busy with other work it got as little as 0.35 s,
    and then counted fewer than node1 (so the two counts are not compared directly).
    Compared with what node0's pace gives a whole core in 1.5 s, node1 counted
    0.03-0.33 of it in 10 runs."""
    cores = cgroups.quota_us(0.25, 1, 2) / cgroups.PERIOD_US  # 0.25 on 2 cores or more
    done = run_cli("--hosts", "2", "--no-prefix", "--cpu-share", "node1=0.25",
                   "--", sys.executable, "-S", "-c", SPIN, timeout=50)
    assert done.returncode == 0, done.stderr
    first = done.stderr.splitlines()[0]
    assert first.startswith("collectives.cluster: run cc") and (
        f"node1 at 0.25 CPU share ({cores:.3g} cores)" in first), first
    (count0, cpu0), (count1, cpu1) = [(int(lines[0][0]), float(lines[0][1])) for _, lines
                                      in sorted(rank_lines(done.stdout).items())]
    # the quota: 25 ms per 100 ms period, over at most 16 periods of the 1.5 s loop
    assert cpu1 < cores * 1.6 + 0.05, (cpu1, done.stdout)
    whole_core = count0 / cpu0 * 1.5  # node0's pace, for 1.5 s of one core
    assert count1 < 0.6 * whole_core, (count1, whole_core, done.stdout)
    assert_left_nothing(first.split()[2].rstrip(":"))


TICKS = """
import os, time
ticks = [time.time()]
while ticks[-1] < ticks[0] + 7:
    time.sleep(0.05)
    ticks.append(time.time())
gap = max(b - a for a, b in zip(ticks, ticks[1:]))
os.write(1, f"{os.uname().nodename} {gap} {ticks[0]}\\n".encode())
"""


@pytest.mark.timeout(60)
def test_pause_freezes_every_process_of_that_host_for_its_duration():
    """node1 is frozen 3 s after the ranks start, for 2 s: its rank, stamping the time
    every 0.05 s for 7 s, sees one gap of about 2 s; node0's rank goes on as before
    (gaps of 0.05 s; under load, longer, but far from the pause's). The freeze counts
    from the ranks' start, not from their first stamp: on a loaded machine a rank may
    not have stamped yet when it is frozen, and then its first stamp comes after the
    pause instead."""
    at, duration = 3.0, 2.0
    launched = time.time()
    done = run_cli("--hosts", "2", "--no-prefix", "--pause", f"node1@{at:g}:{duration:g}",
                   "--", sys.executable, "-S", "-c", TICKS, timeout=50)
    assert done.returncode == 0, done.stderr
    first = done.stderr.splitlines()[0]
    assert "node1 paused at 3s for 2s" in first, first
    ranks = {host: (float(lines[0][0]), float(lines[0][1]))
             for host, lines in rank_lines(done.stdout).items()}
    (gap0, _), (gap1, first_tick1) = ranks["node0"], ranks["node1"]
    # Frozen while stamping, it sees the gap; frozen before its first stamp (a loaded
    # machine starts it late), its first stamp comes after the pause ends.
    assert gap1 >= 0.8 * duration or first_tick1 >= launched + at + 0.8 * duration, ranks
    assert gap0 < 0.5 * duration, ranks
    assert "node1 resumed at" in done.stderr, done.stderr
    assert_left_nothing(first.split()[2].rstrip(":"))


SEND = """
import socket, sys, time
if sys.argv[1] == "receive":
    server = socket.create_server(("0.0.0.0", 5000))
    print("listening", flush=True)
    connection, _ = server.accept()
    received = started = 0
    while chunk := connection.recv(1 << 16):
        started = started or time.monotonic()
        received += len(chunk)
    print(received, time.monotonic() - started, flush=True)
else:
    for _ in range(200):
        try:
            connection = socket.create_connection((sys.argv[2], 5000))
            break
        except OSError:
            time.sleep(0.05)
    connection.sendall(bytes(1 << 20))
"""


def transfer_seconds(network, sender, receiver):
    """Seconds 1 MiB takes from host `sender` to host `receiver` over TCP."""
    receive = subprocess.Popen(network.enter(receiver) + [
        sys.executable, "-S", "-c", SEND, "receive"], stdout=subprocess.PIPE, text=True)
    assert receive.stdout.readline().strip() == "listening"
    subprocess.run(network.enter(sender) + [sys.executable, "-S", "-c", SEND, "send",
                                            network.spec.address(receiver)],
                   check=True, timeout=30)
    received, seconds = receive.communicate(timeout=30)[0].split()
    assert int(received) == 1 << 20
    return float(seconds)


@pytest.mark.timeout(60)
def test_link_gives_that_host_its_own_rate_both_ways():
    """node1's link at 10 Mbit/s, the others' at 1 Gbit/s: both ends of node1's link
    (its eth0, the switch's port towards it) are shaped to 10 Mbit/s, and 1 MiB takes
    about 0.75 s each way (0.8 s less the bucket's 128 KiB head start), not 8 ms.
    Ranks are told the slowest rate: they size their messages by it and must agree."""
    spec = ClusterSpec((1, 1), bandwidth="1gbit", link={1: "10mbit"})
    with Network(spec) as network:
        def qdisc(namespace, device):
            return subprocess.run(["ip", "netns", "exec", namespace, "tc", "qdisc", "show",
                                   "dev", device], capture_output=True, text=True).stdout
        assert "rate 10Mbit" in qdisc(network.netns(1), "eth0")
        assert "rate 10Mbit" in qdisc(network.switch, "node1")
        assert "rate 1Gbit" in qdisc(network.netns(0), "eth0")
        assert "rate 1Gbit" in qdisc(network.switch, "node0")
        assert _cluster_env(network)["COLLECTIVES_CLUSTER_RATE"] == str(10**7)
        assert transfer_seconds(network, 1, 0) > 0.5   # out of node1: its eth0
        assert transfer_seconds(network, 0, 1) > 0.5   # into node1: the switch's port
    assert_removed(network)


@pytest.mark.timeout(60)
def test_cli_killed_while_a_host_is_frozen_leaves_its_cgroups_to_cleanup():
    """A launcher SIGKILLed while node1 is frozen: its cgroups stay (with a frozen
    process in them) until --cleanup thaws them, kills what is in them and removes them."""
    links = host_links()
    with running_launcher("--hosts", "2", "--cpu-share", "0=0.5", "--pause", "node1@0:60",
                          "--", "sleep", "60", hosts=2,
                          stderr=subprocess.DEVNULL) as (launcher, run, mark):
        freezer = os.path.join(cgroups.CGROUP_ROOT, "freezer", run, "node1")
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not (
                os.path.exists(freezer + "/freezer.state")
                and open(freezer + "/freezer.state").read().strip() == "FROZEN"
                and open(freezer + "/cgroup.procs").read().split()):
            time.sleep(0.1)
        assert open(freezer + "/freezer.state").read().strip() == "FROZEN"
        launcher.kill()
        launcher.wait(timeout=30)
        assert len(cgroups.leftover_groups([run])) == 6  # 2 controllers x (run + 2 hosts)
        done = run_cli("--cleanup")
        assert done.returncode == 0 and run in done.stdout, done.stdout
    assert_left_nothing(run, mark, links)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("launcher", ["ranks", "mpirun", "slurm"])
def test_every_process_of_a_host_is_in_its_groups_however_it_started(launcher):
    """Ranks started by the launcher, by mpirun (its proxy reaches node1 through rsh.py),
    or by srun (through the slurmd of each host): each is in its own host's groups."""
    # a line of /proc/self/cgroup: ID:CONTROLLERS:PATH, the controllers a comma list
    # ("4:cpu,cpuacct:/cc1f2e3d/node1", "7:freezer:/cc1f2e3d/node1")
    show = ["sh", "-c", 'echo "$(hostname) $(grep -E ":([a-z_]+,)*(cpu|freezer)(,[a-z_]+)*:" '
                        '/proc/self/cgroup | cut -d: -f3 | sort | tr "\\n" " ")"']
    missing = [program for program in PROGRAMS if shutil.which(program) is None]
    if launcher == "slurm" and missing:
        pytest.skip(f"--scheduler slurm needs {', '.join(missing)}")
    options = ["--hosts", "2", "--no-prefix", "--cpu-share", "node1=1",
               "--pause", "node0@600:1"]
    command = {"ranks": ["--", *show],
               "mpirun": ["--launcher", "mpirun", "--", find_mpirun()[0], "-np", "2", *show],
               "slurm": ["--scheduler", "slurm", "--", "srun", "-N", "2",
                         "--ntasks-per-node", "1", *show]}[launcher]
    done = run_cli(*options, *command, timeout=100)
    assert done.returncode == 0, done.stderr
    run = done.stderr.split()[2].rstrip(":")
    seen = {host: groups for host, *groups in map(str.split, done.stdout.splitlines())}
    assert seen == {f"node{h}": [f"/{run}/node{h}", f"/{run}/node{h}"] for h in (0, 1)}, (
        done.stdout)
    assert_left_nothing(run)


@pytest.mark.parametrize("args,message", [
    (["--cpu-share", "node2=0.5"], "--cpu-share: no host 'node2'"),
    (["--cpu-share", "1=0"], "FRACTION must be in (0, 1]"),
    (["--cpu-share", "1=1.5"], "FRACTION must be in (0, 1]"),
    (["--cpu-share", "1=0.5", "--cpu-share", "node1=0.2"], "names node1 twice"),
    (["--link", "node1=fast"], "rate 'fast'"),
    (["--link", "7=10mbit"], "--link: no host '7'"),
    (["--pause", "node1@-1:2"], "SECONDS must be 0 or more"),
    (["--pause", "node1@1:0"], "DURATION more than 0"),
    (["--pause", "node1@nan:1"], "SECONDS must be 0 or more"),
    (["--pause", "node1@1"], "write HOST@SECONDS:DURATION"),
    (["--pause", "node1@1:5", "--pause", "node1@3:1"], "the pauses of node1 overlap"),
    (["--pause", "node1@1:1e7"], "the pause must end by 1000000 s"),
    (["--pause", "node1@1:inf"], "the pause must end by 1000000 s"),
    (["--scheduler", "slurm", "--pause", "node1@0:70000"], "a pause lasts at most 65503 s"),
    (["--kill", "node2@5"], "--kill: no host 'node2'"),
    (["--kill", "node1@-1"], "SECONDS must be in [0, 1000000]"),
    (["--kill", "node1"], "write HOST@SECONDS"),
    (["--cut", "node1@5:0"], "DURATION more than 0"),
    (["--cut", "3@5:1"], "--cut: no host '3'"),
])
def test_bad_host_options_are_usage_errors_before_anything_is_built(args, message, capsys):
    with pytest.raises(SystemExit) as stopped:
        parse(["--hosts", "2", *args, "--", "true"])
    assert stopped.value.code == 2
    assert message in capsys.readouterr().err


def test_the_first_line_names_every_host_that_differs():
    args, _, spec = parse(["--hosts", "4", "--bandwidth", "100mbit", "--cpu-share", "node3=0.5",
                           "--link", "1=10mbit", "--pause", "node2@5:10", "--kill", "node3@60",
                           "--cut", "1@90:30", "--on-switch", "torchft_lighthouse --min_replicas 2",
                           "--", "true"])
    line = describe(Network(spec, run="cc000000"), args.kill, args.cut, args.on_switch)
    cores = 0.5 * min(1, cgroups.usable_cores() / 4)  # 0.25 on 2 cores, 0.5 on 4 or more
    assert line == (f"collectives.cluster: run cc000000: 4 hosts x 1 rank, 100mbit; node3 at "
                    f"0.5 CPU share ({cores:.3g} core{'s' * (cores != 1)}); node1 link 10mbit; "
                    "node2 paused at 5s for 10s; node3 killed at 60s; node1 cut at 90s for 30s; "
                    "on the switch: torchft_lighthouse --min_replicas 2")


@pytest.mark.parametrize("option,spec", [
    ("--cpu-share", ClusterSpec((1, 1), cpu_share={1: 0.5})),
    ("--pause", ClusterSpec((1, 1), pauses=(Pause(1, 1.0, 1.0),))),
])
def test_a_missing_cgroup_controller_is_one_line_before_anything_is_built(
        option, spec, tmp_path, monkeypatch):
    """Where the controller an option needs is not mounted: a ClusterError naming the
    option and the controller, and nothing built."""
    monkeypatch.setattr(cgroups, "CGROUP_ROOT", str(tmp_path))  # no controller there
    before = netns_names()
    network = Network(spec)
    with pytest.raises(ClusterError) as error:
        network.build()
    assert str(error.value).startswith(f"{option} needs cgroup v1's ")
    assert "\n" not in str(error.value)
    assert netns_names() == before and not os.path.exists(network.state_dir)


@pytest.mark.parametrize("fraction,ranks,world,cores,expected", [
    (0.5, 1, 4, 2, 0.25),     # 4 ranks on 2 cores: a rank's fair share is half a core
    (0.25, 1, 2, 2, 0.25),    # a core per rank
    (0.25, 1, 2, 64, 0.25),   # many cores: still a core per rank, not 0.25 x 32
    (0.5, 3, 4, 2, 0.75),     # 3 ranks of half a core each, at half of it
    (1, 2, 4, 64, 2.0),
])
def test_a_cpu_share_is_a_fraction_of_the_hosts_fair_share(fraction, ranks, world, cores,
                                                           expected):
    """quota = FRACTION x ranks on the host x min(1, cores / world size) cores."""
    assert cgroups.quota_us(fraction, ranks, world, cores) == expected * cgroups.PERIOD_US


def test_host_groups_weigh_as_many_ranks_as_they_hold(tmp_path, monkeypatch):
    """The kernel splits the cores between groups: cpu.shares 1024 per rank, so a host
    of 3 ranks weighs 3 of 1; the run's folder weighs them all."""
    monkeypatch.setattr(cgroups, "CGROUP_ROOT", str(tmp_path))  # plain folders stand in
    os.mkdir(tmp_path / "cpu")
    network = Network(ClusterSpec((1, 3), cpu_share={0: 0.5}), run="cc000000")
    network._make_cgroups()

    def read(host, name):
        with open(os.path.join(network.cgroup("cpu", host), name)) as file:
            return int(file.read())
    assert read(None, "cpu.shares") == 4 * 1024
    assert (read(0, "cpu.shares"), read(1, "cpu.shares")) == (1024, 3 * 1024)
    assert read(0, "cpu.cfs_quota_us") == cgroups.quota_us(0.5, 1, 4)
    assert not os.path.exists(os.path.join(network.cgroup("cpu", 1), "cpu.cfs_quota_us"))


def test_a_group_a_command_cannot_join_is_one_line_and_exit_2(tmp_path):
    done = subprocess.run(cgroups.join_argv([str(tmp_path / "missing")]) + ["true"],
                          capture_output=True, text=True)
    assert done.returncode == 2
    assert done.stderr == (f"collectives.cluster: error: cannot join the group "
                           f"{tmp_path / 'missing'} (writing its cgroup.procs failed)\n")


class RecordingHosts:
    """Stands in for a Network under a PauseSchedule: records freezes and thaws, and
    fails the way it is told to."""

    def __init__(self, freeze_error=None, thaw_error=None):
        self.spec = ClusterSpec((1, 1))
        self.freeze_error, self.thaw_error = freeze_error, thaw_error
        self.frozen, self.thawed = [], []

    def freeze(self, host):
        self.frozen.append(host)
        if self.freeze_error:
            raise self.freeze_error
        return True

    def thaw(self, host):
        self.thawed.append(host)
        if self.thaw_error:
            raise self.thaw_error


@pytest.mark.timeout(30)
@pytest.mark.parametrize("error", [OSError("a read failed"), OverflowError("timeout"),
                                   cgroups.CgroupError("the group is gone")])
def test_the_pause_thread_thaws_what_it_froze_whatever_stops_it(error, monkeypatch):
    """An error after a freeze (here: the freeze itself), with stderr closed too: the
    thread ends, and the host it froze is thawed."""
    stderr = open(os.devnull, "w")
    stderr.close()
    monkeypatch.setattr(sys, "stderr", stderr)  # writing to it raises ValueError
    hosts = RecordingHosts(freeze_error=error)
    schedule = cgroups.PauseSchedule(hosts, [Pause(1, 0.0, 600.0)]).start()
    schedule.thread.join(10)
    assert not schedule.thread.is_alive()
    assert hosts.frozen == [1] and hosts.thawed == [1] and not schedule.frozen


@pytest.mark.timeout(30)
def test_stopping_the_pauses_never_raises_and_thaws_each_host(capsys):
    hosts = RecordingHosts(thaw_error=cgroups.CgroupError("cannot write THAWED"))
    schedule = cgroups.PauseSchedule(hosts, [Pause(0, 0.0, 600.0), Pause(1, 0.0, 600.0)])
    schedule.start()
    deadline = time.monotonic() + 10
    while len(hosts.frozen) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    schedule.stop()
    assert sorted(hosts.thawed) == [0, 1] and not schedule.frozen
    assert not schedule.thread.is_alive()
    assert "cannot thaw node0" in capsys.readouterr().err


def test_every_clean_up_step_runs_though_one_before_it_fails(capsys):
    done = []

    def fail():
        raise RuntimeError("cannot thaw")
    assert not _clean_up([fail, lambda: done.append("kill"), fail,
                          lambda: done.append("remove")])
    assert done == ["kill", "remove"]
    assert capsys.readouterr().err.count("collectives.cluster: error: clean-up: ") == 2
    assert _clean_up([lambda: None])


def test_the_job_says_it_ended_before_its_leftovers_are_killed():
    """Job.wait(ended=...) runs `ended` (the launcher stops its pauses there) once the
    job's processes are gone, before what they left on the hosts is thawed and killed."""
    seen = []

    class Hosts:
        def kill_processes(self):
            seen.append("leftovers killed")
    job = Job([subprocess.Popen(["true"])], ["true"], prefix=False, network=Hosts())
    assert job.wait(timeout=30, ended=lambda: seen.append("ended")) == 0
    assert seen == ["ended", "leftovers killed"]


def test_slurm_waits_for_a_paused_host_longer_than_its_longest_pause():
    """A frozen host's slurmd is silent: SlurmdTimeout (after which Slurm marks the node
    DOWN) and MessageTimeout are the longest pause + 30 s; 30 s and Slurm's own without."""
    def timeouts(spec):
        conf = slurm_conf(Network(spec, run="cc000000"), "/nowhere")
        return [line for line in conf.splitlines() if "Timeout=" in line]
    assert timeouts(ClusterSpec((1, 1))) == ["SlurmdTimeout=30"]
    paused = ClusterSpec((1, 1), pauses=(Pause(1, 5.0, 10.0), Pause(0, 1.0, 44.5)))
    assert timeouts(paused) == ["SlurmdTimeout=75", "MessageTimeout=75"]


@pytest.mark.parametrize("spec,rate,links,differ", [
    (ClusterSpec((1, 1), bandwidth="100mbit"), "100000000", "100000000,100000000", False),
    (ClusterSpec((1, 1, 1), bandwidth="1gbit", link={1: "10mbit"}), "10000000",
     "1000000000,10000000,1000000000", True),
    (ClusterSpec((1, 1, 1), link={1: "10mbit"}), "10000000", "0,10000000,0", True),
    (ClusterSpec((1, 1)), None, None, False),
])
def test_ranks_are_told_every_hosts_link_and_whether_they_differ(spec, rate, links, differ,
                                                                   monkeypatch):
    """COLLECTIVES_CLUSTER_RATE is the slowest link; COLLECTIVES_CLUSTER_LINKS each
    host's (0: unshaped), so a report can tell a mixed cluster from an even one."""
    from collectives import cluster
    monkeypatch.delenv("COLLECTIVES_CLUSTER_RATE", raising=False)
    monkeypatch.delenv("COLLECTIVES_CLUSTER_LINKS", raising=False)
    env = _cluster_env(Network(spec, run="cc000000"))
    assert (env.get("COLLECTIVES_CLUSTER_RATE"), env.get("COLLECTIVES_CLUSTER_LINKS")) == (
        rate, links)
    for name in ("COLLECTIVES_CLUSTER_RATE", "COLLECTIVES_CLUSTER_LINKS"):
        if name in env:
            monkeypatch.setenv(name, env[name])
    assert cluster.links_differ() == spec.links_differ() == differ
