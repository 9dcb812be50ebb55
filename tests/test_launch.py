"""Launcher detection from faked environments: every launcher, every bad combination;
which launchers end every rank when one dies, torchrun's store; the --local-rank flag
that torch.distributed.launch passes; the bad settings docs/launching.md shows."""
import argparse
import os

import pytest

from collectives.launch import LaunchError, add_local_rank_argument, detect_launch
from collectives.launch.lazy_mpi import srun_netmod_settings
from collectives.launch.rendezvous import (attempt_prefix, launcher_serves_store,
                                           rendezvous_address, slurm_rendezvous)
from launchers import ROOT, run


@pytest.mark.parametrize("env, expected", [
    ({}, (0, 1, 0, "none")),
    ({"RANK": "2", "WORLD_SIZE": "4", "LOCAL_RANK": "0"}, (2, 4, 0, "torchrun")),
    ({"PMI_RANK": "3", "PMI_SIZE": "4", "MPI_LOCALRANKID": "3"}, (3, 4, 3, "mpich")),
    ({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "8",
      "OMPI_COMM_WORLD_LOCAL_RANK": "1"}, (1, 8, 1, "openmpi")),
    ({"MV2_COMM_WORLD_RANK": "5", "MV2_COMM_WORLD_SIZE": "6",
      "MV2_COMM_WORLD_LOCAL_RANK": "1"}, (5, 6, 1, "mvapich")),
    # srun --mpi=pmix: PMIx names the rank, Slurm the size
    ({"PMIX_RANK": "2", "SLURM_PROCID": "2", "SLURM_NTASKS": "3"}, (2, 3, 0, "pmix")),
    ({"SLURM_PROCID": "7", "SLURM_NTASKS": "16", "SLURM_LOCALID": "3", "SLURM_STEP_ID": "0"},
     (7, 16, 3, "slurm")),
    # a batch script or salloc shell: Slurm's variables are the allocation's, not a rank's
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_JOB_ID": "12"}, (0, 1, 0, "none")),
    # srun --mpi=pmi2 with MPICH: PMI names the rank, Slurm the local rank
    ({"PMI_RANK": "3", "PMI_SIZE": "4", "SLURM_PROCID": "3", "SLURM_NTASKS": "4",
      "SLURM_LOCALID": "1", "SLURM_STEP_ID": "0"}, (3, 4, 1, "mpich")),
    # mpirun inside a Slurm allocation: MPI's variables win over the batch script's
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "PMI_RANK": "2", "PMI_SIZE": "4"},
     (2, 4, 0, "mpich")),
    # torchrun inside Slurm: torchrun's win
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "RANK": "5", "WORLD_SIZE": "8",
      "LOCAL_RANK": "1"}, (5, 8, 1, "torchrun")),
])
def test_detects_each_launcher(env, expected):
    info = detect_launch(env)
    rank, size, local, launcher = expected
    assert (info.rank, info.world_size, info.local_rank) == (rank, size, local)
    assert info.launcher == launcher


@pytest.mark.parametrize("env, ends_all", [
    ({"PMI_RANK": "1", "PMI_SIZE": "2", "HYDI_CONTROL_FD": "7"}, True),  # MPICH's mpirun
    ({"PMI_RANK": "1", "PMI_SIZE": "2"}, True),          # an mpiexec of MPICH's kind
    ({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2"}, True),
    ({"MV2_COMM_WORLD_RANK": "1", "MV2_COMM_WORLD_SIZE": "2"}, True),
    ({"PMIX_RANK": "1", "SLURM_PROCID": "1", "SLURM_NTASKS": "2"}, True),  # prterun's
    # srun started them, whichever variables name the rank: srun --mpi=pmi2, --mpi=pmix
    ({"PMI_RANK": "1", "PMI_SIZE": "2", "SLURM_STEP_ID": "0"}, False),
    ({"PMIX_RANK": "1", "SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_STEP_ID": "0"},
     False),
    # mpirun inside an allocation, its proxies started by srun: still mpirun's ranks
    ({"PMI_RANK": "1", "PMI_SIZE": "2", "SLURM_STEP_ID": "1", "HYDI_CONTROL_FD": "7"}, True),
    ({"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_STEP_ID": "0"}, False),
    ({"RANK": "1", "WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "x"}, False),
    ({}, False),
])
def test_which_launchers_end_every_rank_when_one_dies(env, ends_all):
    assert detect_launch(env).ends_every_rank_when_one_dies is ends_all


SRUN_PMI2 = {"PMI_FD": "11", "PMI_RANK": "0", "SLURM_MPI_TYPE": "pmi2", "SLURM_STEP_ID": "0",
             "SLURM_STEP_NUM_NODES": "2"}


@pytest.mark.parametrize("env, settings", [
    (SRUN_PMI2, {"MPIR_CVAR_CH4_NETMOD": "ofi", "FI_PROVIDER": "tcp"}),
    (dict(SRUN_PMI2, FI_PROVIDER="verbs;ofi_rxm"), {"MPIR_CVAR_CH4_NETMOD": "ofi"}),
    (dict(SRUN_PMI2, MPIR_CVAR_CH4_NETMOD="ucx"), {}),     # the user's choice stands
    (dict(SRUN_PMI2, MPICH_CH4_NETMOD="ucx"), {}),
    (dict(SRUN_PMI2, SLURM_STEP_NUM_NODES="1"), {}),      # one node: no such exchange
    (dict(SRUN_PMI2, HYDI_CONTROL_FD="7"), {}),           # mpirun's proxies read lines whole
    (dict(SRUN_PMI2, SLURM_MPI_TYPE="none"), {}),
    (dict(SRUN_PMI2, MPIR_PARAM_CH4_NETMOD="ucx"), {}),
    ({**{k: v for k, v in SRUN_PMI2.items() if k != "SLURM_STEP_NUM_NODES"},
      "SLURM_NNODES": "3"}, {"MPIR_CVAR_CH4_NETMOD": "ofi", "FI_PROVIDER": "tcp"}),
    ({"PMI_RANK": "1", "PMI_SIZE": "2", "PMI_FD": "5"}, {}),   # mpirun, no Slurm
    ({}, {}),
])
def test_mpich_leaves_ucx_only_under_sruns_pmi_across_nodes(env, settings):
    assert srun_netmod_settings(env, mpich_wheel=True) == settings
    assert srun_netmod_settings(env, mpich_wheel=False) == {}  # another MPI: its own choice


AGENT = {"TORCHELASTIC_USE_AGENT_STORE": "True", "MASTER_ADDR": "10.0.0.1",
         "MASTER_PORT": "29500"}


@pytest.mark.parametrize("env, host, port, serves", [
    (AGENT, "10.0.0.1", 29500, True),
    (dict(AGENT, TORCHELASTIC_USE_AGENT_STORE="False"), "10.0.0.1", 29500, False),
    (AGENT, "10.0.0.1", 29501, False),    # another address: not the agent's store
    ({"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}, "10.0.0.1", 29500, False),
])
def test_only_torchruns_agent_store_is_joined_as_a_client(env, host, port, serves):
    assert launcher_serves_store(host, port, env) is serves


@pytest.mark.parametrize("env, prefix", [
    ({}, ""),
    ({"TORCHELASTIC_RESTART_COUNT": "0", "GROUP_WORLD_SIZE": "1"}, ""),
    ({"TORCHELASTIC_RESTART_COUNT": "2", "GROUP_WORLD_SIZE": "1"}, "attempt3/"),
    # agents on several hosts count their restarts apart: no prefix they could agree on
    ({"TORCHELASTIC_RESTART_COUNT": "1", "GROUP_WORLD_SIZE": "2"}, ""),
])
def test_a_restarted_attempt_of_one_torchrun_has_keys_of_its_own(env, prefix):
    assert attempt_prefix(env) == prefix


@pytest.mark.parametrize("tasks_per_node, node, expected", [
    ("2(x2)", "1", 2), ("3,1", "1", 1), ("2(x3),1", "3", 1), ("4", "0", 4),
    ("2(x2)", "5", None),   # a node the step does not list: unknown, not a guess
])
def test_slurm_tasks_on_this_node_from_the_step(tasks_per_node, node, expected):
    env = {"SLURM_PROCID": "0", "SLURM_NTASKS": "8", "SLURM_STEP_ID": "0",
           "SLURM_NTASKS_PER_NODE": "9",  # the allocation's: never the step's answer
           "SLURM_STEP_TASKS_PER_NODE": tasks_per_node, "SLURM_NODEID": node}
    assert detect_launch(env).local_world_size == expected


def test_slurm_rendezvous_is_the_steps_first_node_on_a_port_of_job_and_step():
    step = {"SLURM_JOB_NODELIST": "gpu[07-09,11],login1", "SLURM_STEP_NODELIST": "gpu[09,11]",
            "SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0"}
    host, port = slurm_rendezvous(step)
    assert host == "gpu09"
    batch = dict(step, SLURM_STEP_ID="1")
    batch.pop("SLURM_STEP_NODELIST")
    other_host, other_port = slurm_rendezvous(batch)
    assert other_host == "gpu07"
    next_job = slurm_rendezvous(dict(step, SLURM_JOB_ID="4243"))[1]
    assert len({port, other_port, next_job}) == 3  # two steps, two jobs: three ports
    assert all(15000 <= p < 31000 for p in (port, other_port, next_job))


@pytest.mark.parametrize("env, message", [
    ({"SLURM_JOB_NODELIST": "node[0-"}, "SLURM_JOB_NODELIST='node\\[0-' is not a Slurm node list"),
    ({"SLURM_JOB_NODELIST": "n1", "SLURM_JOB_ID": "x"}, "SLURM_JOB_ID='x' is not an integer"),
])
def test_bad_slurm_settings_name_the_variable(env, message):
    with pytest.raises(LaunchError, match=message):
        slurm_rendezvous(env)


def test_a_master_that_does_not_resolve_is_one_line_naming_it(monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "no-such-host.invalid")
    monkeypatch.setenv("MASTER_PORT", "29500")
    with pytest.raises(LaunchError, match="'no-such-host.invalid' \\(MASTER_ADDR\\) does not "
                                          "resolve on"):
        rendezvous_address(detect_launch({"RANK": "1", "WORLD_SIZE": "2"}))


def test_pmix_rank_with_world_size_from_mpi():
    info = detect_launch({"PMIX_RANK": "1"}, mpi_world_size=2)
    assert (info.rank, info.world_size, info.launcher) == (1, 2, "pmix")


@pytest.mark.parametrize("env, message", [
    ({"RANK": "4", "WORLD_SIZE": "4"}, "RANK=4 must be below WORLD_SIZE=4"),
    ({"RANK": "1"}, "RANK is set but WORLD_SIZE is not"),
    ({"WORLD_SIZE": "2"}, "WORLD_SIZE is set but RANK is not"),
    ({"PMI_SIZE": "2"}, "PMI_SIZE is set but PMI_RANK is not"),
    ({"RANK": "x", "WORLD_SIZE": "2"}, "RANK='x' is not an integer"),
    ({"RANK": "0", "WORLD_SIZE": "0"}, "WORLD_SIZE=0 must be at least 1"),
    ({"SLURM_PROCID": "3", "SLURM_NTASKS": "2", "SLURM_STEP_ID": "0"},
     "SLURM_PROCID=3 must be below SLURM_NTASKS=2"),
    ({"PMIX_RANK": "0"}, "PMIX_RANK is set but no world size is known"),
])
def test_bad_settings_name_the_variable(env, message):
    with pytest.raises(LaunchError, match=message.replace("(", r"\(").replace(")", r"\)")):
        detect_launch(env)


def parse_with_local_rank(argv, env):
    parser = argparse.ArgumentParser(prog="script")
    parser.add_argument("--epochs", type=int, default=1)
    add_local_rank_argument(parser, environ=env)
    return parser.parse_args(argv)


@pytest.mark.parametrize("argv", [
    ["--local-rank=1"], ["--local-rank", "1"],    # torch 2.x's launcher: the first form
    ["--local_rank=1"], ["--local_rank", "1"],    # older launchers and hand-written ones
])
def test_local_rank_flag_in_each_spelling_and_form_is_exported(argv):
    env = {}
    args = parse_with_local_rank([*argv, "--epochs", "2"], env)
    assert (args.local_rank, args.epochs) == (1, 2)
    assert env == {"LOCAL_RANK": "1"}


def test_exported_local_rank_is_the_one_detect_launch_reads():
    env = {"RANK": "3", "WORLD_SIZE": "4"}  # a launcher that gives the local rank only as a flag
    parse_with_local_rank(["--local-rank=1"], env)
    assert detect_launch(env).local_rank == 1


def test_local_rank_in_the_environment_wins_over_the_flag():
    env = {"LOCAL_RANK": "0"}
    args = parse_with_local_rank(["--local-rank=1"], env)
    assert args.local_rank == 1
    assert env == {"LOCAL_RANK": "0"}


def test_without_the_flag_nothing_is_exported():
    env = {}
    assert parse_with_local_rank([], env).local_rank is None
    assert env == {}


@pytest.mark.parametrize("value, message", [
    ("-1", "argument --local-rank: must be 0 or more, got -1"),
    ("one", "argument --local-rank: expected a local rank (0 or more), got 'one'"),
])
def test_bad_local_rank_is_argparse_error(value, message, capsys):
    env = {}
    with pytest.raises(SystemExit) as exit:
        parse_with_local_rank([f"--local-rank={value}"], env)
    assert exit.value.code == 2
    assert message in capsys.readouterr().err
    assert env == {}


def test_help_lists_one_spelling():
    parser = argparse.ArgumentParser(prog="script")
    add_local_rank_argument(parser, environ={})
    text = parser.format_help()
    assert "--local-rank N" in text and "--local_rank" not in text


def commands_shown(doc, heading):
    """[(command, the lines shown after it)] of the `$ command` lines in the first code
    block under `heading` in docs/`doc`."""
    with open(os.path.join(ROOT, "docs", doc)) as text:
        section = text.read().split(heading, 1)[1]
    block = section.split("```\n", 2)[1]
    shown = []
    for line in block.splitlines():
        if line.startswith("$ "):
            shown.append((line[2:], []))
        else:
            shown[-1][1].append(line)
    return shown


@pytest.mark.timeout(120)
def test_the_bad_settings_launching_md_shows_print_that_line_alone():
    """Each command prints the one line the docs show and nothing else: mpi4py's warning
    about another MPI's mpirun (three lines before ours) included."""
    shown = commands_shown("launching.md", "## Bad settings, dead peers, ending")
    assert len(shown) == 2
    for command, lines in shown:
        done = run(["bash", "-c", command], timeout=100, check=False)
        assert done.returncode != 0, command
        assert (done.stdout + done.stderr).splitlines() == lines, done.stderr
