"""Slurm, the real one, on the emulated hosts: srun and sbatch start the ranks.

One Slurm cluster (munged, slurmctld on node0, a slurmd on each of 2 hosts) serves the
module's tests, which submit from node0 as a user at a login node would. Needs root and
Debian's slurm-wlm and munge; skipped with the reason (naming the packages) without them.
"""
import json
import os
import re
import shutil
import signal
import subprocess
import time

import pytest

from collectives.algorithms import auto
from collectives.cluster import ClusterSpec, Network, rate_bits
from collectives.cluster.job import _cluster_env
from collectives.cluster import slurm as slurm_config
from collectives.cluster.slurm import PROGRAMS, Slurm
from collectives.cluster.network import STATE_ROOT, TOOLS
from launchers import mpirun, run
from test_cluster import (FAST, ROOT, assert_left_nothing, checks, default_stop_signals,
                          host_links, marked_processes, netns_names, read_ranks, run_cli,
                          running_launcher)

MISSING = [program for program in PROGRAMS if shutil.which(program) is None]
needs_slurm = pytest.mark.skipif(bool(MISSING), reason=(
    f"Slurm is not installed ({', '.join(MISSING)} missing): apt-get install slurm-wlm munge"))
pytestmark = [pytest.mark.skipif(os.geteuid() != 0, reason="the emulated cluster needs root"),
              pytest.mark.xdist_group("machine")]  # its daemons and hosts: one at a time
SPEC = ClusterSpec((2, 2), bandwidth=FAST)
TIMEOUT = 240  # seconds any one Slurm command of these tests may take


@pytest.fixture(scope="module")
def slurm():
    network = Network(SPEC).build()
    try:
        yield Slurm(network).start()
    finally:
        network.remove()
    assert_left_nothing(network.run)


def on_login_node(slurm, *command, env=None, timeout=TIMEOUT):
    """Run `command` on node0 with the job's environment, as the cluster's CLI does."""
    full_env = dict(_cluster_env(slurm.network), **slurm.env(), **(env or {}))
    return run(slurm.network.enter(0) + list(command), env=full_env, cwd=ROOT,
               timeout=timeout, check=False)


# The states of a job that has ended (Slurm's JOB_STATE_STRING); COMPLETING has not yet.
ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED",
         "BOOT_FAIL", "DEADLINE", "OUT_OF_MEMORY"}


def sbatch_until_ended(slurm, *args, timeout=TIMEOUT):
    """`sbatch ARGS` on the login node, then wait for the job to end: (its state, its exit
    code as scontrol says, e.g. "0:0"). Asked twice a second: `sbatch --wait` asks at 2,
    10, 42, 74, ... s after submitting, so a job of 15 s would take 42."""
    done = on_login_node(slurm, "sbatch", "--parsable", *args)
    assert done.returncode == 0, done.stderr
    job = done.stdout.strip().split(";")[0]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        shown = on_login_node(slurm, "scontrol", "-o", "show", "job", job).stdout
        state, code = (re.search(rf"\b{key}=(\S+)", shown) for key in ("JobState", "ExitCode"))
        if state and state.group(1) in ENDED:
            return state.group(1), code.group(1)
        time.sleep(0.5)
    raise AssertionError(f"job {job} still not ended after {timeout} s: {shown}")


def assert_placed_by_slurm(results, tasks_per_node):
    """Ranks in order on the nodes Slurm chose, each node's tasks together, every
    algorithm's answer the same on every rank, and auto's pick for a large all-reduce
    the cost model's (no tuning table there): on several hosts of several ranks,
    hierarchical."""
    for rank, result in enumerate(results):
        node = rank // tasks_per_node
        assert result["hostname"] == f"node{node}" and result["node_id"] == node, result
        assert result["local_rank"] == rank % tasks_per_node, result
        assert result["launch"]["local_world_size"] == tasks_per_node, result
        assert result["ranks_on_host"] == tasks_per_node, result
        assert result["digest"] == results[0]["digest"], f"rank {rank} differs"
        assert result["auto_16M"] == results[0]["auto_16M"], f"rank {rank} chose otherwise"
    hosts = len(results) // tasks_per_node  # no tuning table: the cost model's quickest
    assert results[0]["auto_16M"] == auto.model_choice(
        16 << 20, hosts, tasks_per_node, auto.model_constants_path(), rate_bits(FAST) / 8,
        results[0]["transport"])
    if tasks_per_node > 1:
        assert results[0]["auto_16M"] == "hierarchical"
    assert results[0]["checks"] > 20


@needs_slurm
@pytest.mark.timeout(2 * TIMEOUT)
@pytest.mark.parametrize("backend", ["gloo", "mpi"])
def test_srun_starts_the_ranks_where_slurm_places_them(slurm, backend, tmp_path):
    srun = ["srun", "-N", "2", "--ntasks-per-node", "2"]
    env = {}
    if backend == "mpi":
        srun.append("--mpi=pmi2")  # MPICH meets through Slurm's PMI-2
        env["MPIR_CVAR_DEBUG_SUMMARY"] = "1"  # MPICH says which network module it runs
    done = on_login_node(slurm, *srun, *checks("slurm", backend), str(tmp_path), env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    results = read_ranks(tmp_path, 4)
    assert_placed_by_slurm(results, 2)
    assert {r["launch"]["launcher"] for r in results} == {
        "slurm" if backend == "gloo" else "mpich"}
    assert {r["transport"] for r in results} == {f"{backend}+shm"}
    # MPICH over libfabric's tcp, whose address fits one line of Slurm's PMI-1 server
    # (launch/lazy_mpi.py): asked for, and what MPICH itself reports
    assert {r["netmod"] for r in results} == {"ofi" if backend == "mpi" else None}
    if backend == "mpi":
        summary = done.stdout + done.stderr
        assert "OFI dynamic settings" in summary and "provider: tcp" in summary, summary[-2000:]
        assert "UCX netmod" not in summary
        assert "collectives: srun --mpi=pmi2 across nodes: MPICH over libfabric" in summary, summary[:3000]
    assert "socket.cpp" not in done.stderr, "c10d's warnings: a name did not resolve"


@needs_slurm
@pytest.mark.timeout(2 * TIMEOUT)
def test_sbatch_runs_the_example_script_and_mpirun_inside_an_allocation(slurm, tmp_path):
    log = tmp_path / "train-%j.out"
    ended = sbatch_until_ended(slurm, "-N", "2", "--ntasks-per-node", "2", f"--output={log}",
                               "examples/train.sbatch", "--epochs", "1", "--train-samples",
                               "64", "--test-samples", "32", "--batch-size", "16")
    [output] = tmp_path.glob("train-*.out")
    text = output.read_text()
    assert ended == ("COMPLETED", "0:0"), (ended, text[-3000:])
    assert "with 4 rank(s)" in text and "epoch 1/1: train loss" in text, text[-3000:]
    assert "\r" not in text, "the progress bar redrew itself in a log file"
    assert "epoch 1/1: 100%" in text, text[-3000:]  # its lines instead

    wrapped = " ".join(mpirun(4, *checks("slurm", "mpi"), str(tmp_path)))
    ended = sbatch_until_ended(slurm, "-N", "2", "--ntasks-per-node", "2",
                               f"--output={tmp_path}/mpirun.out", f"--wrap={wrapped}")
    assert ended == ("COMPLETED", "0:0"), (ended, (tmp_path / "mpirun.out").read_text()[-3000:])
    results = read_ranks(tmp_path, 4)
    assert_placed_by_slurm(results, 2)
    assert {r["launch"]["launcher"] for r in results} == {"mpich"}  # Hydra, through srun


@needs_slurm
@pytest.mark.timeout(2 * TIMEOUT)
def test_two_jobs_at_once_on_the_same_nodes_meet_on_different_ports(slurm, tmp_path):
    meet = tmp_path / "meet"
    meet.mkdir()
    env = {"CHECK_MEET_DIR": str(meet), "CHECK_MEET_JOBS": "2"}
    outs = [tmp_path / "a", tmp_path / "b"]
    jobs = []
    for out in outs:
        out.mkdir()
        command = ["srun", "-N", "2", "--ntasks-per-node", "1", *checks("slurm"), str(out)]
        jobs.append(subprocess.Popen(
            slurm.network.enter(0) + command, cwd=ROOT, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True,
            env=dict(_cluster_env(slurm.network), **slurm.env(), **env)))
    outputs = [job.communicate(timeout=TIMEOUT)[0] for job in jobs]
    assert [job.returncode for job in jobs] == [0, 0], outputs
    first, second = (read_ranks(out, 2) for out in outs)
    assert first[0]["job"] != second[0]["job"]
    assert first[0]["port"] != second[0]["port"]
    assert_placed_by_slurm(first, 1)
    assert_placed_by_slurm(second, 1)


def host_pids(network, host):
    out = subprocess.run(["ip", "netns", "pids", network.netns(host)], capture_output=True,
                         text=True).stdout
    return [int(pid) for pid in out.split()]


def slurm_queue(slurm):
    return on_login_node(slurm, "squeue", "-h", "-o", "%i %T").stdout.split("\n")


def ranks_running(network):
    """Pids of the test's rank programs still running on any host."""
    pids = []
    for host in range(network.spec.hosts):
        for pid in host_pids(network, host):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
                    if b"checks_cluster" in cmdline.read():
                        pids.append(pid)
            except OSError:
                pass  # gone meanwhile
    return pids


@needs_slurm
@pytest.mark.timeout(2 * TIMEOUT)
@pytest.mark.parametrize("loss", ["killed", "set down"])
def test_a_node_lost_mid_job_fails_the_step_and_leaves_nothing_running(loss, tmp_path,
                                                                        monkeypatch):
    """Its own cluster: the node is lost for good. Killed (its slurmd and its ranks,
    SIGKILL): the survivors raise PeerError within the timeout, srun ends once Slurm
    declares the node failed, when its slurmd has been silent for SlurmdTimeout (12 s
    here, where nothing pauses a host: the cluster's 30 s would be most of the test).
    Set down by an administrator: Slurm cancels the step on every node at once."""
    timeout = 5
    monkeypatch.setattr(slurm_config, "SLURMD_TIMEOUT", 12)
    with Network(SPEC) as network:
        slurm = Slurm(network).start()
        env = dict(_cluster_env(network), **slurm.env(), CHECK_TIMEOUT=str(timeout))
        srun = subprocess.Popen(
            network.enter(0) + ["srun", "-N", "2", "--ntasks-per-node", "2",
                                *checks("loop"), str(tmp_path)],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + 120  # until every rank is inside its loop
        while len(list(tmp_path.glob("looping-*"))) < 4 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert len(list(tmp_path.glob("looping-*"))) == 4, srun.poll()
        lost_at = time.monotonic()
        if loss == "killed":
            for pid in host_pids(network, 1):  # node1: its slurmd and its two ranks
                os.kill(pid, signal.SIGKILL)
        else:
            done = on_login_node(slurm, "scontrol", "update", "NodeName=node1", "State=DOWN",
                                 "Reason=lost")
            assert done.returncode == 0, done.stderr
        output = srun.communicate(timeout=timeout + 90)[0]
        assert srun.returncode != 0, output
        assert "Node failure on node1" in output, output
        if loss == "killed":
            for rank in (0, 1):  # node0's ranks
                with open(tmp_path / f"rank{rank}.json") as file:
                    result = json.load(file)
                assert result["raised"] and result["raised"].startswith("PeerError"), result
                assert result["failed_at"] - lost_at < timeout + 10, result
        else:
            assert "CANCELLED" in output and "DUE TO NODE FAILURE" in output, output
        deadline = time.monotonic() + 60
        while (ranks_running(network) or "RUNNING" in " ".join(slurm_queue(slurm))) \
                and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not ranks_running(network), "ranks left running"
        assert "RUNNING" not in " ".join(slurm_queue(slurm))
    assert_left_nothing(network.run)


@needs_slurm
@pytest.mark.timeout(300)
def test_the_cli_runs_srun_on_node0_and_removes_everything():
    before = set(os.listdir(STATE_ROOT)), netns_names()
    done = run_cli("--hosts", "2", "--scheduler", "slurm", "--", "srun", "-N", "2",
                   "--ntasks-per-node", "2", "sh", "-c", 'echo "$(hostname) $SLURM_PROCID"',
                   timeout=240)
    assert done.returncode == 0, done.stderr
    assert sorted(done.stdout.splitlines()) == ["node0 0", "node0 1", "node1 2", "node1 3"]
    assert (set(os.listdir(STATE_ROOT)), netns_names()) == before, "the run left something"


def marked_commands(mark):
    """The command names of the live processes that carry the launcher's mark."""
    names = []
    for pid in marked_processes(mark):
        try:
            with open(f"/proc/{pid}/comm") as comm:
                names.append(comm.read().strip())
        except OSError:
            pass  # gone meanwhile
    return names


@needs_slurm
@pytest.mark.timeout(240)
@pytest.mark.parametrize("stop", ["Ctrl-C", "SIGKILL, then --cleanup"])
def test_the_cli_stopped_mid_job_leaves_no_daemon_and_no_rank(stop):
    """Slurm's daemons and the tasks they started carry the launcher's environment mark
    (srun passes the login node's environment on), so none can escape the check."""
    links = host_links()
    with running_launcher("--hosts", "2", "--scheduler", "slurm", "--", "srun", "-N", "2",
                          "sleep", "120", hosts=2, preexec_fn=default_stop_signals) as (
            launcher, run, mark):
        deadline = time.monotonic() + 120
        while marked_commands(mark).count("sleep") < 2 and time.monotonic() < deadline:
            time.sleep(0.5)
        running = marked_commands(mark)
        assert running.count("sleep") == 2 and "slurmd" in running, running
        if stop == "Ctrl-C":
            launcher.send_signal(signal.SIGINT)
            assert launcher.wait(timeout=60) == 130
        else:
            launcher.kill()
            launcher.wait(timeout=30)
            assert "slurmctld" in marked_commands(mark)  # left for --cleanup
            done = run_cli("--cleanup")
            assert done.returncode == 0 and run in done.stdout, done.stdout
    assert_left_nothing(run, mark, links)


@pytest.mark.timeout(60)
def test_a_missing_slurm_is_one_line_naming_the_packages_and_exit_2(tmp_path):
    """PATH holding the cluster's tools but not Slurm's (even where Slurm is installed)."""
    for tool in TOOLS:
        os.symlink(shutil.which(tool), tmp_path / tool)
    done = run_cli("--hosts", "2", "--scheduler", "slurm", "--", "srun", "hostname",
                   env=dict(os.environ, PATH=str(tmp_path)))
    assert done.returncode == 2
    assert done.stderr.strip().count("\n") == 0, done.stderr
    assert "apt-get install munge slurm-wlm" in done.stderr, done.stderr
