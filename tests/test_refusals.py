"""Never a silently wrong number, and a bad argument never breaks a communicator.

The Horovod face keeps unnamed collectives paired through refusals, joins and
disagreements, and stops every rank with one line when an unnamed one stalls; integer
reducescatter averages round once. Then one table of calls (checks_refusals.CASES:
every op and dtype, strided and 0-dim tensors, the argument errors gloo refuses) runs
on gloo, on the "collectives" torch.distributed backend and through our API, on the
same 2 ranks: ours is right where gloo is, otherwise right or refused on every rank
with one line, and an all-reduce right after is correct. A list only the root holds
(gather's outputs, scatter's inputs) is refused there, and the group stays in step;
splits that do not add up, refused on every rank alike, leave the group usable; splits
only one rank holds, refused there, stop the group on every rank at once.
"""
import pytest

import checks_refusals as checks
from distributed import run_world
from launchers import python, run


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
    """(Refusals only the root can decide are checked below, and so are those after
    which the group refuses the rest.)"""
    problems = []
    for case, rows in sweep.items():
        for face in ("backend", "api"):
            outcomes = _outcomes(rows, face)
            if len(outcomes) > 1 and case not in checks.REFUSED_BY_THE_ROOT:
                problems.append(f"{case} [{face}]: the ranks differ: {outcomes}")
            if "wrong" in {row[face][0] for row in rows}:
                problems.append(f"{case} [{face}]: a wrong value: "
                                f"{[row[face][1] for row in rows]}")
            for rank, row in enumerate(rows):
                outcome, text, survives = row[face]
                if face == "backend" and case in checks.BREAKS_THE_GROUP:
                    if "an earlier operation of this process group failed" not in survives:
                        problems.append(f"{case} rank {rank}: the group did not refuse the "
                                        f"all-reduce after it: {survives}")
                elif survives != "ok":
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
def test_a_list_only_the_root_holds_is_refused_there_and_the_group_stays_in_step(sweep):
    """gather's outputs and scatter's inputs are the root's alone. Refused there alone,
    the others' gather messages used to stay in the channel, and the root's next
    all-reduce read them (7 for 3 on both ranks, no error); scatter's others waited out
    the timeout. Now the root refuses in one line, and its first message tells the
    others, which send only after it and refuse too; the all-reduce after is right on
    every rank."""
    assert len(checks.REFUSED_BY_THE_ROOT) >= 4
    for case in checks.REFUSED_BY_THE_ROOT:
        rows = sweep[case]
        root, others = rows[0]["backend"], [row["backend"] for row in rows[1:]]
        assert root[0] == "refused" and "\n" not in root[1], (case, root)
        assert all(other[0] == "refused" for other in others), (case, others)
        assert all(row["backend"][2] == "ok" for row in rows), (case, rows)


@pytest.mark.timeout(60)
def test_a_gather_list_torch_refuses_on_the_root_leaves_no_message_behind():
    """torch refuses a gather list of another dtype on the root before the backend is
    called. The other rank's piece used to go at once, and the root's next all-reduce
    read it (a wrong sum, no error). Now the others wait for the root's first message:
    rank 1's gather fails, and no rank's all-reduce gives a number."""
    outcomes = run_world(checks.check_gather_list_torch_refuses_on_the_root, 2, timeout=50)
    assert "returned" != outcomes[0][0] and "returned" != outcomes[1][0], outcomes
    for rank, (_, reduced, total) in enumerate(outcomes):
        assert reduced != "returned" or total == [3.0, 3.0], (rank, outcomes)


@pytest.mark.timeout(180)
def test_outputs_whose_elements_share_memory(sweep):
    """all_reduce of an expand()ed tensor failed on the worker (copy_ refuses to write
    one) and disabled the group; in place it is right now, as gloo's; an output of
    another call that would hold several values in one place is refused in one line."""
    for case in ("all_reduce of an expand()ed tensor", "all_reduce of overlapping windows",
                 "broadcast of an expand()ed tensor", "reduce of an expand()ed tensor",
                 "all_reduce_coalesced with an expand()ed tensor",
                 "all_reduce_coalesced premul_sum with an expand()ed tensor"):
        assert _outcomes(sweep[case], "backend") == {"right"}, (case, sweep[case])
    for case in ("all_reduce_coalesced with an expand()ed tensor",
                 "broadcast_coalesced with an expand()ed tensor"):
        assert _outcomes(sweep[case], "api") == {"right"}, (case, sweep[case])
    for case in ("all_gather_into_tensor into an expand()ed output",
                 "reduce_scatter_tensor into an expand()ed output",
                 "all_gather list into an expand()ed output", "scatter into an expand()ed output"):
        assert _outcomes(sweep[case], "backend") == {"refused"}, (case, sweep[case])
        assert "share memory" in sweep[case][0]["backend"][1], sweep[case]


@pytest.mark.timeout(60)
def test_splits_refused_on_one_rank_stop_the_group_instead_of_pairing_stale_messages():
    """Rank 0 alone passes all_to_all_single splits that do not add up: it used to
    refuse and go on, while rank 1's exchange read rank 0's next all-reduce (7 for 3 on
    rank 0, no error). Now rank 0's refusal still takes the call's place (an all-reduce
    of nothing), so rank 1's exchange meets it and raises at once, naming both calls;
    then each group refuses every later call. No rank gets a number."""
    outcomes = run_world(checks.check_splits_refused_on_one_rank, 2, timeout=50)
    assert outcomes[0][0].startswith("ValueError: all_to_all_single: splits"), outcomes
    assert "ranks disagree" in outcomes[1][0] and "all_to_all" in outcomes[1][0], outcomes
    for rank in (0, 1):
        assert "an earlier operation of this process group failed" in outcomes[rank][1], \
            outcomes


@pytest.mark.timeout(180)
def test_all_gather_list_form_refuses_other_dtypes_and_shapes(sweep):
    """float32 gathered into int32 outputs came back truncated, (2, 1) outputs were
    taken for a (2,) input; both are refused now, as torch refuses them."""
    for case in ("all_gather list of another dtype", "all_gather list of another shape"):
        for face in ("api", "backend"):
            assert _outcomes(sweep[case], face) == {"refused"}, (case, sweep[case])


@pytest.mark.parametrize("command", [
    python("-m", "collectives.cost_model", "predict", "--constants", "unused.json",
           "--hosts", "2", "--size", "16M", "--bandwidth", "0gbit"),
    python("-m", "trainer.replay", "--trace", "unused", "--constants", "unused.json",
           "--bandwidth", "0gbit"),
])
def test_a_zero_bandwidth_is_refused_in_one_line(command):
    """0gbit used to be read as "the measured link"."""
    out = run(command, timeout=120, check=False)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "a link's rate must be more than 0" in out.stderr.splitlines()[-1], out.stderr


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [2, 3])
def test_horovod_randomized_programs_are_right_everywhere(world_size):
    """20 seeded programs of the Horovod face (every op, dtype and shape, grouped forms,
    a process set, joins, named batches in another order on each rank, one rank's
    tensor of the same count in another shape, one rank's arguments refused in its
    caller), every result checked on every rank, every refusal one line on every rank
    and the same call right after it right; the long run:
    `python tests/horovod_random.py --seeds 500`."""
    import horovod_random
    calls, wrong, refusals = horovod_random.run(world_size, range(20), timeout=100)
    assert not wrong, "\n".join(wrong[:10])
    assert calls > 500 * world_size / 2 and refusals > 50 * world_size, (calls, refusals)
