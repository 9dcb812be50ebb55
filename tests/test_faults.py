"""The fault-injection cases (tests/fault_injection.py), once each, each with a hard timeout."""
import pytest

from fault_injection import CASES, TIMEOUT


@pytest.mark.timeout(400)
@pytest.mark.parametrize("name", list(CASES))
def test_fault_case(name):
    result = CASES[name]()
    for outcome in (result if isinstance(result, list) else [result]):
        assert outcome.ok, f"{name}: {outcome.detail}"
        if "mismatch" in name or "differs" in name or "debug" in name:
            assert outcome.seconds < 10, f"{name}: {outcome.seconds:.1f} s"
        elif "mpirun" in name:  # whole job: start-up included
            assert outcome.seconds < TIMEOUT + 30, f"{name}: {outcome.seconds:.1f} s"
        elif "SIGKILL" in name and "rank" in name or "stalls" in name:
            assert outcome.seconds < TIMEOUT + 5, f"{name}: {outcome.seconds:.1f} s"
