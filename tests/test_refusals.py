"""Never a silently wrong number, and a bad argument never breaks a communicator.

The Horovod face keeps unnamed collectives paired through refusals, joins and
disagreements, and stops every rank with one line when an unnamed one stalls; integer
reducescatter averages round once. Then one table of calls (checks_refusals.CASES:
every op and dtype, strided and 0-dim tensors, the argument errors gloo refuses) runs
on gloo, on the "collectives" torch.distributed backend and through our API, on the
same 2 ranks: ours is right where gloo is, otherwise right or refused on every rank
with one line, and an all-reduce right after is correct.
"""
import subprocess
import sys

import pytest

import checks_refusals as checks
from distributed import run_world


@pytest.mark.timeout(90)
def test_horovod_unnamed_calls_pair_after_refusals_joins_and_disagreements(monkeypatch):
    """Refused while a rank is joined (broadcast, allgather, add_process_set), run while
    a rank is joined, refused for disagreeing, refused in the caller (alltoall of a
    0-dim tensor, an unknown op): the next unnamed calls pair with each other on every
    rank. (They used to be numbered one apart after a join with refusals, and stall.)"""
    # calls that do not pair would stall: let them fail within the test's time
    monkeypatch.setenv("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "20")
    run_world(checks.check_horovod_unnamed_stay_paired, 2, timeout=75)


@pytest.mark.timeout(60)
def test_horovod_a_stalled_unnamed_call_stops_every_rank_with_one_line():
    """A stray unnamed call on rank 0 alone used to fail there and shift every later
    unnamed call by one (rank 0's loss summed with rank 1's acc). Now, at the stall
    timeout, every rank's engine stops with one line naming it, as Horovod shuts down."""
    names = run_world(checks.check_horovod_unnamed_stall_stops_every_rank, 2, timeout=50)
    assert len(set(names)) == 1 and names[0].startswith("allreduce.noname."), names


@pytest.mark.timeout(60)
def test_horovod_integer_reducescatter_average_with_postscale_rounds_once():
    """int32 [2 + 3 rank, 1] averaged with postscale 2: rank 0 gets trunc(7 * 2 / 2) = 7
    (not 6), as allreduce gives; int8, int64, uint8 and postscale 1.5 alike."""
    results = run_world(checks.check_horovod_reducescatter_rounds_once, 2, timeout=50)
    assert results[0][0] == [7], results[0]


@pytest.fixture(scope="module")
def sweep():
    """{case: [each rank's {face: (outcome, text, survives)}]}, from one world of 2."""
    reports = run_world(checks.check_sweep, 2, timeout=150)
    return {case: [report[case] for report in reports] for case in reports[0]}


def _outcomes(rows, face):
    return {row[face][0] for row in rows}


@pytest.mark.timeout(180)
def test_every_call_is_right_or_refused_alike_and_the_communicator_lives(sweep):
    problems = []
    for case, rows in sweep.items():
        for face in ("backend", "api"):
            outcomes = _outcomes(rows, face)
            if len(outcomes) > 1:
                problems.append(f"{case} [{face}]: the ranks differ: {outcomes}")
            if "wrong" in outcomes:
                problems.append(f"{case} [{face}]: a wrong value: {rows[0][face][1]}")
            for rank, row in enumerate(rows):
                outcome, text, survives = row[face]
                if survives != "ok":
                    problems.append(f"{case} [{face}] rank {rank}: the all-reduce after it: "
                                    f"{survives}")
                if outcome == "refused" and "\n" in text:
                    problems.append(f"{case} [{face}]: more than one line: {text!r}")
    assert not problems, "\n".join(problems)


@pytest.mark.timeout(180)
def test_the_backend_does_whatever_gloo_does(sweep):
    """Where gloo gives the right value (bool and complex reductions, non-contiguous
    and odd-strided tensors in every collective), so does the backend."""
    missed = [case for case, rows in sweep.items()
              if _outcomes(rows, "gloo") == {"right"} and _outcomes(rows, "backend") != {"right"}]
    assert not missed, missed
    # and where gloo is right, the sweep covered something
    assert sum(_outcomes(rows, "gloo") == {"right"} for rows in sweep.values()) > 80


@pytest.mark.timeout(180)
def test_bitwise_ops_on_floats_are_refused_on_every_rank(sweep):
    """all_reduce(op=band|bor|bxor) of a float used to raise on one rank halfway and
    break the communicator on both; now refused before anything is sent."""
    for dtype in ("float32", "float16", "bfloat16", "float64"):
        for op in ("band", "bor", "bxor"):
            rows = sweep[f"all_reduce {dtype} {op}"]
            for face in ("api", "backend"):
                assert _outcomes(rows, face) == {"refused"}, (dtype, op, face, rows)
                assert all(row[face][2] == "ok" for row in rows), rows


@pytest.mark.timeout(180)
def test_all_gather_list_form_refuses_other_dtypes_and_shapes(sweep):
    """float32 gathered into int32 outputs came back truncated, (2, 1) outputs were
    taken for a (2,) input; both are refused now, as torch refuses them."""
    for case in ("all_gather list of another dtype", "all_gather list of another shape"):
        for face in ("api", "backend"):
            assert _outcomes(sweep[case], face) == {"refused"}, (case, sweep[case])


@pytest.mark.parametrize("command", [
    [sys.executable, "-m", "collectives.model", "predict", "--constants", "unused.json",
     "--hosts", "2", "--size", "16M", "--bandwidth", "0gbit"],
    [sys.executable, "-m", "trainer.predict", "--trace", "unused", "--constants",
     "unused.json", "--bandwidth", "0gbit"],
])
def test_a_zero_bandwidth_is_refused_in_one_line(command):
    """0gbit used to be read as "the measured link"."""
    out = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "a link's rate must be more than 0" in out.stderr.splitlines()[-1], out.stderr


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [2, 3])
def test_horovod_randomized_programs_are_right_everywhere(world_size):
    """20 seeded programs of the Horovod face (every op, dtype and shape, grouped forms,
    a process set, joins, named batches in another order on each rank), every result
    checked on every rank; the long run: `python tests/horovod_random.py --seeds 500`."""
    import horovod_random
    calls, wrong = horovod_random.run(world_size, range(20), timeout=100)
    assert not wrong, "\n".join(wrong[:10])
    assert calls > 500 * world_size / 2, calls
