"""Every run ends cleanly: jobs that end without destroy(), or with one rank failing,
exit as they should under every launcher (cases and checks: tests/exit_cleanly.py)."""
import concurrent.futures
import threading
import weakref

import pytest

from collectives.launch import exit as launch_exit
from collectives.bucketer import CommWorker
from exit_cleanly import CLEAN_CASES, LAUNCHERS, RANK_TIMEOUT, cases_for, run_job


@pytest.mark.timeout(600)
@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_jobs_that_end_without_destroy_exit_0(launcher):
    """One job of each clean case: three ways of ending without destroy() per launcher.
    How often a rare crash at exit shows is counted by the script's repeated runs
    (`python tests/exit_cleanly.py --runs 100`, the table in docs/reliability.md)."""
    for case in CLEAN_CASES:
        if case == "stall" or case not in cases_for(launcher):
            continue  # stall: the next test
        outcome = run_job(launcher, case)
        assert outcome.ok, outcome.describe()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("launcher", [name for name in LAUNCHERS if name != "single"])
def test_exit_leaves_a_reduction_waiting_on_a_stalled_peer_alone(launcher):
    """Rank 0 ends with a bucket's reduction still waiting for rank 1 after the exit's
    grace: closing the communicator under it would unmap the shared memory it reads
    (a SIGSEGV). The job must exit 0, with rank 0's note that it left it alone."""
    outcome = run_job(launcher, "stall")
    assert outcome.ok, outcome.describe()


# The failing cases whose survivors wait out their whole timeout (RANK_TIMEOUT): under
# mpirun, a rank 1 that ends by sys.exit() is not known to be gone, and one that fails
# inside init() on the mpi backend is not MPI_Aborted. Each runs on a thread of its own,
# started first, so that its wait overlaps the other cases' jobs; those run one after
# another, as before, so that a case whose ranks race to end first (interrupt: rank 1's
# MPI_Abort(130) before its peer's PeerError) runs beside nothing but such a wait.
WAITING_CASES = {"mpirun-gloo": ("sys-exit",), "mpirun-mpi": ("sys-exit", "init-fail")}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_a_failing_rank_fails_the_job_and_nobody_hangs(launcher):
    """Including init-fail, where rank 1 fails while the shared-memory files exist: none
    may be left in /dev/shm."""
    waiting = WAITING_CASES.get(launcher, ())
    cases = [case for case in cases_for(launcher) if case not in CLEAN_CASES]
    with concurrent.futures.ThreadPoolExecutor(max_workers=len(waiting) or 1) as threads:
        waits = [threads.submit(run_job, launcher, case) for case in waiting]
        outcomes = [run_job(launcher, case) for case in cases if case not in waiting]
        outcomes += [wait.result() for wait in waits]
    for outcome in outcomes:
        assert outcome.ok, outcome.describe()  # its exit status, exactly; no crash
        # start-up (a few seconds, more under load) + the survivors' timeout at most
        assert outcome.seconds < RANK_TIMEOUT + 40, outcome.describe()


class _Communicator:
    """Stands in for the default communicator: records whether it was closed."""
    closed = False

    def close(self):
        self.closed = True


@pytest.mark.timeout(30)
def test_the_exit_hook_closes_only_once_no_thread_is_inside(monkeypatch):
    """In one process: a comm thread still inside a job after the grace keeps the
    communicator open; once none is, the hook closes it."""
    monkeypatch.setattr(launch_exit, "EXIT_GRACE_SECONDS", 0.2)
    monkeypatch.setattr(launch_exit, "_background", weakref.WeakSet())
    peer_arrives = threading.Event()
    worker = CommWorker()  # registers itself with the exit hook
    worker.submit(lambda: peer_arrives.wait(20))  # a reduction waiting on its peer
    stalled = _Communicator()
    launch_exit._close_at_exit(stalled.close)
    assert not stalled.closed, "closed under a running thread"
    peer_arrives.set()
    worker.join(10)
    assert not worker.thread.is_alive()
    finished = _Communicator()
    launch_exit._close_at_exit(finished.close)
    assert finished.closed
