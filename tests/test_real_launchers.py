"""Real launchers: the test starts mpirun (the one matching mpi4py), launch_mpi.sh, torchrun;
and the mpi backend's transport and algorithms as mpirun starts them. A clean run under
each prints nothing that looks like an error."""
import os
import sys

import pytest

from launchers import (ROOT, TESTS, error_looking_lines, launch_mpi_sh, mpirun, python,
                       rank_env, run, torchrun)

PRINT_RANK = ("import os, collectives; c = collectives.init(backend={backend!r}, timeout=60); "
              "os.write(1, f'rank {{c.rank}} of {{c.world_size}} {{c.backend}}\\n'.encode())")


def printed(argv, shm="auto"):
    """What `argv` printed, run from tests/ with COLLECTIVES_SHM=shm."""
    return run(argv, cwd=TESTS, env=rank_env(COLLECTIVES_SHM=shm)).stdout


def printed_cleanly(argv, shm="auto"):
    """What `argv` printed on stdout; the test fails if its stderr has a line that looks
    like an error or a warning (a clean run must not alarm its reader)."""
    done = run(argv, cwd=TESTS, env=rank_env(COLLECTIVES_SHM=shm))
    assert not error_looking_lines(done.stderr), done.stderr
    return done.stdout


def ranks_printed(stdout, world_size, backend):
    return sorted(line for line in stdout.splitlines() if line.startswith("rank")) == sorted(
        f"rank {r} of {world_size} {backend}" for r in range(world_size))


@pytest.mark.timeout(300)
def test_mpirun_init_finds_every_rank():
    # gloo here; the mpi backend's init under mpirun: the mpi jobs below (every rank
    # prints, nothing on stderr looks like an error) and test_launch_mpi_script
    out = printed_cleanly(mpirun(4, sys.executable, "-c", PRINT_RANK.format(backend="gloo")))
    assert ranks_printed(out, 4, "gloo"), out


@pytest.mark.timeout(300)
def test_torchrun_init_finds_every_rank():
    # torchrun's agent serves the store at MASTER_PORT: every rank is its client (rank 0
    # serving one there too printed torch's "[E...] The server socket ... failed to bind")
    out = printed_cleanly(torchrun(4, "--no-python", sys.executable, "-c",
                                   PRINT_RANK.format(backend="gloo")))
    assert ranks_printed(out, 4, "gloo"), out


@pytest.mark.timeout(120)
def test_one_plain_process_prints_no_error_line():
    out = printed_cleanly(python("-c", PRINT_RANK.format(backend="gloo")))
    assert ranks_printed(out, 1, "gloo"), out


# Under one torchrun, attempt 1 (TORCHELASTIC_RESTART_COUNT=0): rank 1 ends after the
# first all-reduce; torchrun starts both again, and they meet in the same store. Rank 1
# comes 2 s late to the second, so that rank 0 would find the first's keys, not its.
RESTARTED = """
import os, time, torch, collectives
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"]) + 1
if attempt == 2 and os.environ["RANK"] == "1":
    time.sleep(2)
comm = collectives.init(backend="gloo", timeout=20)
total = torch.ones(1)
collectives.all_reduce(total)
if attempt == 1 and comm.rank == 1:
    os._exit(3)
# one write of the whole line: print() with PYTHONUNBUFFERED writes the newline apart,
# and the other rank's line can land between the two
os.write(1, f"attempt {attempt} rank {comm.rank} sum {total.item():g}\\n".encode())
"""


@pytest.mark.timeout(300)
def test_torchrun_restarted_workers_meet_apart_from_the_attempt_before():
    """The agent's store still holds the first attempt's keys (gloo's addresses of
    workers now dead): the restarted ones meet under keys of their own."""
    out = run(torchrun(2, "--max-restarts", "1", "--no-python", sys.executable, "-c",
                       RESTARTED), cwd=TESTS).stdout
    assert sorted(line for line in out.splitlines() if line.startswith("attempt 2")) == [
        "attempt 2 rank 0 sum 2", "attempt 2 rank 1 sum 2"], out


@pytest.mark.timeout(300)
def test_launch_mpi_script():
    out = printed(launch_mpi_sh(3, sys.executable, "-c", PRINT_RANK.format(backend="mpi")))
    assert ranks_printed(out, 3, "mpi"), out
    assert "usage: launch_mpi.sh" in printed([os.path.join(ROOT, "launch_mpi.sh"), "--help"])


# The mpi backend under mpirun, one job per row: the transport's checks
# (checks_transport.py) and a subset of the algorithms' (checks_algorithms.py). shm off:
# MPI's own point-to-point (2 ranks: each sends to and receives from the same peer; 3:
# odd, uneven chunks); on: our shared memory, MPI for the rest, both sets of checks in
# one start-up of the ranks.
MPI_JOBS = [(2, "off", ["transport"]), (3, "off", ["algorithms"]),
            (4, "on", ["transport", "algorithms"])]


@pytest.mark.timeout(400)
@pytest.mark.parametrize("world_size,shm,checks", MPI_JOBS,
                         ids=[f"{n}-{shm}-{'+'.join(checks)}" for n, shm, checks in MPI_JOBS])
def test_mpi_transport_and_algorithms(world_size, shm, checks):
    out = printed_cleanly(mpirun(world_size, sys.executable, "checks_algorithms.py", *checks),
                          shm=shm)
    name = "mpi+shm" if shm == "on" else "mpi"
    assert out.count(f"of {world_size} ({name}): ok") == world_size * ("transport" in checks), out
    assert out.count(f"({name}): ") == world_size * len(checks), out
    assert out.count("checks ok") == world_size * ("algorithms" in checks), out
