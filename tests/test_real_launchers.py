"""Real launchers: the test starts mpirun (the one matching mpi4py), launch_mpi.sh, torchrun;
and the mpi backend's transport and algorithms as mpirun starts them."""
import os
import sys

import pytest

from launchers import ROOT, TESTS, launch_mpi_sh, mpirun, rank_env, run, torchrun

PRINT_RANK = ("import os, collectives; c = collectives.init(backend={backend!r}, timeout=60); "
              "os.write(1, f'rank {{c.rank}} of {{c.world_size}} {{c.backend}}\\n'.encode())")


def printed(argv, shm="auto"):
    """What `argv` printed, run from tests/ with COLLECTIVES_SHM=shm."""
    return run(argv, cwd=TESTS, env=rank_env(COLLECTIVES_SHM=shm)).stdout


def ranks_printed(stdout, world_size, backend):
    return sorted(line for line in stdout.splitlines() if line.startswith("rank")) == sorted(
        f"rank {r} of {world_size} {backend}" for r in range(world_size))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", ["gloo", "mpi"])
def test_mpirun_init_finds_every_rank(backend):
    out = printed(mpirun(4, sys.executable, "-c", PRINT_RANK.format(backend=backend)))
    assert ranks_printed(out, 4, backend), out


@pytest.mark.timeout(300)
def test_torchrun_init_finds_every_rank():
    out = printed(torchrun(4, "--no-python", sys.executable, "-c",
                           PRINT_RANK.format(backend="gloo")))
    assert ranks_printed(out, 4, "gloo"), out


@pytest.mark.timeout(300)
def test_launch_mpi_script():
    out = printed(launch_mpi_sh(3, sys.executable, "-c", PRINT_RANK.format(backend="mpi")))
    assert ranks_printed(out, 3, "mpi"), out
    assert "usage: launch_mpi.sh" in printed([os.path.join(ROOT, "launch_mpi.sh"), "--help"])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world_size,shm", [(2, "off"), (4, "on")])
def test_mpi_transport(world_size, shm):
    # off: MPI's own point-to-point; on: our shared memory, MPI for the rest
    out = printed(mpirun(world_size, sys.executable, "checks_transport.py", "mpi"), shm=shm)
    name = "mpi+shm" if shm == "on" else "mpi"
    assert out.count(f"({name}): ok") == world_size, out


@pytest.mark.timeout(400)
@pytest.mark.parametrize("world_size,shm", [(3, "off"), (4, "on")])
def test_mpi_algorithms_subset(world_size, shm):
    out = printed(mpirun(world_size, sys.executable, "checks_algorithms.py"), shm=shm)
    name = "mpi+shm" if shm == "on" else "mpi"
    assert out.count("checks ok") == out.count(f"({name})") == world_size, out
