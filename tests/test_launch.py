"""Launcher detection from faked environments: every launcher, every bad combination."""
import pytest

from collectives.launch import LaunchError, detect_launch


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
    ({"SLURM_PROCID": "7", "SLURM_NTASKS": "16", "SLURM_LOCALID": "3"}, (7, 16, 3, "slurm")),
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
    ({"SLURM_PROCID": "3", "SLURM_NTASKS": "2"}, "SLURM_PROCID=3 must be below SLURM_NTASKS=2"),
    ({"PMIX_RANK": "0"}, "PMIX_RANK is set but no world size is known"),
])
def test_bad_settings_name_the_variable(env, message):
    with pytest.raises(LaunchError, match=message.replace("(", r"\(").replace(")", r"\)")):
        detect_launch(env)
