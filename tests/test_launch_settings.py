"""Bad launch settings: one clear line naming the variable, exit non-zero, no hang."""
import os

import pytest

from launchers import mpirun, python, run, trainer

INIT = "import collectives; collectives.init(backend={backend!r})"
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "PMI_RANK",
               "PMI_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK",
               "SLURM_PROCID", "SLURM_NTASKS", "MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE")


def run_init(backend, extra_env, code=INIT):
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    env.update(extra_env)
    env["CUDA_VISIBLE_DEVICES"] = ""  # as on a machine without a GPU
    return run(python("-c", code.format(backend=backend)), env=env, timeout=60, check=False)


# One process per case: how an uncaught LaunchError ends a script (one line, exit
# non-zero) is the same for all, so each case is a different place that raises one.
# The launcher's variables read wrong (RANK without WORLD_SIZE, PMI_SIZE without
# PMI_RANK, ...) all raise in detect_launch, whose every message test_launch.py checks:
# one of them stands for the rest here.
@pytest.mark.timeout(90)
@pytest.mark.parametrize("backend, env, line", [
    ("gloo", {"RANK": "4", "WORLD_SIZE": "4"}, "RANK=4 must be below WORLD_SIZE=4"),
    ("tcp", {}, "unknown backend 'tcp': choose from auto, gloo, nccl, mpi"),
    ("nccl", {}, "backend 'nccl' needs a CUDA GPU"),
    ("gloo", {"RANK": "0", "WORLD_SIZE": "2"}, "MASTER_ADDR and MASTER_PORT are not set"),
    ("gloo", {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"},
     "MASTER_PORT is not set but its partner is"),
    # An mpirun from another MPI: its variables say 4 ranks, mpi4py's MPI sees a world of 1.
    ("mpi", {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "4"},
     "the launcher (openmpi) says 4 ranks but MPI reports a world of 1"),
    ("gloo", {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "4"},
     "the launcher (openmpi) says 4 ranks but MPI reports a world of 1"),
])
def test_bad_launch_prints_one_clear_line(backend, env, line):
    result = run_init(backend, env)
    assert result.returncode != 0
    # mpi4py may add its own warning about the environment; ours is one line, no traceback
    assert "Traceback" not in result.stderr, result.stderr
    ours = [text for text in result.stderr.splitlines() if text.startswith("collectives: error: ")]
    assert len(ours) == 1, result.stderr
    assert line in ours[0]


def test_errors_from_code_are_still_exceptions():
    # a script that catches the error gets it: the one line is only for one uncaught
    # (in this process: init() raises it before anything is set up)
    import collectives
    with pytest.raises(collectives.LaunchError, match="^unknown backend 'bogus'"):
        collectives.init(backend="bogus")


@pytest.mark.timeout(120)
def test_bench_nproc_that_disagrees_with_the_launcher(tmp_path):
    result = run(mpirun(2, *python("-m", "collectives.bench", "--nproc", "3", "--json",
                                   "out.jsonl")), cwd=tmp_path, timeout=100, check=False)
    assert result.returncode != 0
    assert "--nproc 3 but the launcher (mpich) started 2 ranks" in result.stderr
    assert os.listdir(tmp_path) == []


@pytest.mark.timeout(120)
@pytest.mark.parametrize("env, line", [
    ({"RANK": "3", "WORLD_SIZE": "2"}, "trainer: error: RANK=3 must be below WORLD_SIZE=2"),
    ({"RANK": "0", "WORLD_SIZE": "2"}, "trainer: error: MASTER_ADDR and MASTER_PORT are not set"),
])
def test_trainer_launch_errors_exit_2_with_one_line(env, line, tmp_path):
    clean = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    result = run(trainer("--metrics", "m.jsonl", "--checkpoint-dir", "ckpt"),
                 env={**clean, **env}, cwd=tmp_path, timeout=100, check=False)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].startswith(line), result.stderr
    assert os.listdir(tmp_path) == []
