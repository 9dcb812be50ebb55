"""Every run ends cleanly: jobs that end without destroy(), or with one rank failing,
exit as they should under every launcher (cases and checks: tests/exit_cleanly.py)."""
import pytest

from exit_cleanly import CASES, CLEAN_CASES, LAUNCHERS, RANK_TIMEOUT, run_job

CLEAN_RUNS = 3  # per launcher here; `python tests/exit_cleanly.py --runs 100` for the table


@pytest.mark.timeout(600)
@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_jobs_that_end_without_destroy_exit_0(launcher):
    for case in CLEAN_CASES:
        for _ in range(CLEAN_RUNS if case == "end" else 1):
            outcome = run_job(launcher, case)
            assert outcome.ok, outcome.describe()


@pytest.mark.timeout(600)
@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_a_failing_rank_fails_the_job_and_nobody_hangs(launcher):
    for case in CASES:
        if case in CLEAN_CASES:
            continue
        outcome = run_job(launcher, case)
        assert outcome.ok, outcome.describe()
        assert not outcome.aborted, outcome.describe()
        # start-up (a few seconds, more under load) + the survivors' timeout at most
        assert outcome.seconds < RANK_TIMEOUT + 40, outcome.describe()
