"""The faces hold up: a torch DDP script with one import changed, DDP's join() and
torch's constructor arguments, Horovod's API with Horovod's semantics, and ranks that
use different parameters (gloo on 2 and 3 spawned ranks; mpi under mpirun)."""
import ast
import os

import pytest
import torch

import checks_faces as checks
from distributed import run_world, run_world_collecting_errors
from launchers import ROOT, TESTS, mpirun, python, run, torchrun
from test_docs_figures import check_face_losses, printed_face_losses


def same_everywhere(results):
    assert len(set(results)) == 1, f"ranks disagree: {results}"
    return results[0]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world_size", [2, 3])
def test_horovod_face_has_horovods_semantics(world_size):
    """Every collective and its forms; join() with zeros from the joined and the last
    rank's number, alone and under DistributedOptimizer on uneven inputs; ranks that
    use different parameters (once a 300 s hang); the optimizer's rules; negotiation
    by name: different orders of submission, the same name with different arguments
    (an error on every rank), a name one rank submits alone (rank 0's stall warning,
    then an error, at a stall timeout of 1.5 s here), sparse allreduce."""
    results = same_everywhere([r[1:] for r in run_world(checks.check_horovod_face,
                                                        world_size, timeout=220)])
    assert results[0] == results[2] == world_size - 1  # join() named the last rank


@pytest.mark.timeout(200)
def test_horovod_process_sets():
    """A set of two ranks and one of one, and two sets sharing a rank: every collective
    and its gradient inside a set, DistributedOptimizer over a set, names and unnamed
    calls per set, and the errors (a rank outside the set, a duplicate or removed set,
    a name one rank of a set submits alone) on 3 ranks."""
    # each set's allreduce of 4 elements (evens: 1 + 3, odds: 2), then summed globally
    assert same_everywhere(run_world(checks.check_horovod_process_sets, 3, timeout=180)) \
        == 4 * ((1 + 3) * 2 + 2)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [2, 3])
def test_horovod_join_fails_at_the_stall_timeout_then_works(world_size):
    assert run_world(checks.check_horovod_join_stalls, world_size, timeout=100) == \
        [world_size - 1] * world_size


def _seconds_to_notice_an_exit(output: str) -> list:
    """From checks_faces.peer_exit's lines: how long each surviving rank took."""
    return [float(line.split(" noticed the exit in ")[1].split(" s")[0])
            for line in output.splitlines() if " noticed the exit in " in line]


@pytest.mark.timeout(120)
def test_horovod_a_rank_that_ends_is_noticed_within_seconds_under_torchrun():
    """The last rank's process ends while the other waits in an allreduce, which raises
    HorovodInternalError within seconds though the job's timeout is 120 s (it used to
    wait out the whole timeout). Under mpirun: test_both_faces_on_the_mpi_backend."""
    out = run(torchrun(2, "checks_faces.py", "peer-exit"), cwd=TESTS, timeout=100)
    noticed = _seconds_to_notice_an_exit(out.stdout)
    assert len(noticed) == 1 and noticed[0] < 20, out.stdout + out.stderr


@pytest.mark.timeout(300)
def test_both_faces_on_the_mpi_backend():
    """The Horovod checks and our DDP's join() under mpirun; join ends where it ends on
    gloo, bit for bit. Then the last rank ends, and the others, waiting in an
    allreduce, raise within seconds (the timeout is 120 s)."""
    on_gloo = same_everywhere(run_world(checks.ddp_join_digest, 3, timeout=100))
    out = run(mpirun(3, *python("checks_faces.py")), cwd=TESTS, timeout=220)
    lines = [line.split("results ")[1] for line in out.stdout.splitlines() if "results" in line]
    assert len(lines) == 3 and len(set(lines)) == 1, out.stdout
    assert ast.literal_eval(lines[0])[-1] == on_gloo, (lines[0], on_gloo)
    noticed = _seconds_to_notice_an_exit(out.stdout)
    assert len(noticed) == 2 and max(noticed) < 20, out.stdout + out.stderr


@pytest.mark.timeout(200)
@pytest.mark.parametrize("world_size", [2, 3])
def test_ddp_join_with_uneven_inputs_equals_torch_ddp(world_size):
    same_everywhere(run_world(checks.check_ddp_join_both_ways, world_size, timeout=180))


@pytest.mark.timeout(120)
def test_ddp_join_can_throw_on_every_rank():
    for status, message in run_world_collecting_errors(checks.check_ddp_join_throws_early, 3):
        assert status == "raised" and "ran out of inputs" in message, message


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [2, 3])
def test_ddp_ranks_using_different_parameters_fail_clearly_not_hang(world_size):
    outcomes = run_world_collecting_errors(checks.check_ddp_uneven_parameters_without_flag,
                                           world_size, timeout=100)
    # every rank but 0 lacks head_a's gradients (and rank 0 head_b's): each raises,
    # naming them, after taking part in the round, so nobody waits for anybody
    for status, message in outcomes:
        assert status == "raised" and "find_unused_parameters=True" in message, message


@pytest.mark.timeout(120)
def test_ddp_on_a_torch_subgroup_and_with_torch_ddp_arguments():
    assert run_world(checks.check_ddp_subgroup_and_arguments, 3, timeout=100) == [
        (2, True), (2, True), (None, True)]


@pytest.mark.timeout(300)
def test_torch_ddp_script_with_one_import_changed(tmp_path):
    """examples/torch_ddp_script.py under torchrun: the script makes its own process
    group; ours ends with torch DDP's parameters."""
    saved, printed = {}, {}
    for face in ("torch", "collectives"):
        path = tmp_path / f"{face}.pt"
        printed[face] = run(torchrun(2, os.path.join(ROOT, "examples", "torch_ddp_script.py"),
                                     "--face", face, "--save", str(path)), timeout=240).stdout
        saved[face] = torch.load(path)
    for name, expected in saved["torch"].items():
        torch.testing.assert_close(saved["collectives"][name], expected, rtol=1e-6, atol=1e-7,
                                   msg=lambda m: f"{name}: {m}")
    assert printed_face_losses(printed["torch"]) == printed_face_losses(printed["collectives"])
    check_face_losses(printed["collectives"])  # docs/faces.md quotes what it printed


@pytest.mark.timeout(120)
def test_horovod_backward_passes_per_step_with_a_parameter_used_in_fewer_passes():
    """backward_passes_per_step=2 and a parameter whose hook fires once in a step on one
    rank: its accumulated gradient is averaged (not zeros), and the next step's count
    starts afresh (no bucket launched after one pass)."""
    same_everywhere(run_world(checks.check_horovod_backward_passes_per_step, 2, timeout=100))


@pytest.mark.timeout(120)
def test_horovod_more_backward_passes_than_per_step_fail_clearly():
    for message in run_world(checks.check_horovod_too_many_backward_passes, 2, timeout=100):
        assert "more backward passes" in message, message


@pytest.mark.timeout(120)
def test_horovod_wrapping_an_optimizer_again_replaces_the_first_wrapping():
    assert run_world(checks.check_horovod_wrapping_again_replaces_the_first, 2,
                     timeout=100) == ["ok", "ok"]


# --- negotiation by name, on its own (one process: the table every rank keeps) ------------
def _meta(shape=(3,), kind="allreduce", op="sum"):
    from collectives.horovod.negotiation import Meta
    return Meta.of(kind, [torch.zeros(shape)], op=op if kind == "allreduce" else None)


def test_negotiation_runs_a_name_once_every_rank_has_submitted_it_in_any_order():
    from collectives.horovod.negotiation import Message, Table
    table = Table(2)
    first = table.apply([Message([("allreduce.b", _meta()), ("allreduce.a", _meta())]),
                         Message([("allreduce.a", _meta())])], now=0.0)
    assert [name for name, _ in first.ready] == ["allreduce.a"]
    assert list(table.entries) == ["allreduce.b"] and table.missing(table.entries[
        "allreduce.b"]) == [1]
    second = table.apply([Message(), Message([("allreduce.b", _meta())])], now=1.0)
    assert [name for name, _ in second.ready] == ["allreduce.b"] and not table.entries


def test_negotiation_fails_one_name_on_every_rank_when_arguments_differ():
    from collectives.horovod.negotiation import Message, Table
    outcome = Table(2).apply([Message([("allreduce.x", _meta((3,)))]),
                              Message([("allreduce.x", _meta((4,)))])], now=0.0)
    [(name, ranks, why)] = outcome.errors
    assert name == "allreduce.x" and ranks == {0, 1} and not outcome.ready
    assert "disagree on shape" in why and "(3,)" in why and "(4,)" in why, why
    gathers = Table(2).apply([Message([("allgather.y", _meta((3, 2), "allgather"))]),
                              Message([("allgather.y", _meta((5, 2), "allgather"))])], 0.0)
    assert [name for name, _ in gathers.ready] == ["allgather.y"]  # first dims may differ


def test_negotiation_with_a_joined_rank():
    from collectives.horovod.negotiation import Message, Table
    table = Table(2)
    outcome = table.apply([Message([("allreduce.x", _meta()),
                                    ("allgather.y", _meta(kind="allgather"))]),
                           Message(join=True)], now=0.0)
    assert [name for name, _ in outcome.ready] == ["allreduce.x"]  # rank 1 adds zeros
    [(name, ranks, why)] = outcome.errors
    assert name == "allgather.y" and ranks == {0} and "join" in why
    assert outcome.join_done is None
    done = table.apply([Message(join=True), Message()], now=1.0)
    assert done.join_done == 0  # the rank that joined last


def test_negotiation_stall_warning_then_error():
    from collectives.horovod.negotiation import Message, StallInspector, Table
    table, warnings = Table(3), []
    table.apply([Message(), Message([("allreduce.x", _meta())]), Message()], now=0.0)
    inspector = StallInspector(warn_after=1.0, fail_after=10.0, report=warnings.append)
    assert inspector.inspect(table, now=0.5) == [] and not warnings
    assert inspector.inspect(table, now=2.0) == []
    assert "rank 0: [allreduce.x]" in warnings[0] and "rank 2: [allreduce.x]" in warnings[0]
    expired = inspector.inspect(table, now=11.0)
    assert expired == ["allreduce.x"]
    outcome = table.apply([Message(expired=expired), Message(), Message()], now=11.0,
                          stall_timeout=10.0)
    [(name, ranks, why)] = outcome.errors
    assert ranks == {1} and "stalled" in why and "[0, 2]" in why, why
    assert not table.entries


def test_negotiation_shutdown_of_one_rank_reaches_every_rank():
    from collectives.horovod.negotiation import Message, Table
    outcome = Table(2).apply([Message([("allreduce.x", _meta())]), Message(shutdown=True)],
                             now=0.0)
    assert outcome.shutdown_by == 1 and not outcome.ready


def test_negotiation_scopes_names_per_process_set():
    from collectives.horovod.negotiation import Message, Meta, Table, scoped
    table = Table(3)
    add = ("add_process_set.noname.1", Meta("add_process_set", members=(0, 2)))
    outcome = table.apply([Message([add]), Message([add]), Message([add])], now=0.0)
    assert [name for name, _ in outcome.ready] == [add[0]] and table.sets[1] == (0, 2)
    in_set = scoped("allreduce.x", 1)
    set_meta = Meta.of("allreduce", [torch.zeros(3)], op="sum", process_set=1)
    # rank 0 submits allreduce.x in set 1, rank 1 the global allreduce.x: two names
    outcome = table.apply([Message([(in_set, set_meta)]), Message([("allreduce.x", _meta())]),
                           Message()], now=1.0)
    assert not outcome.ready and table.missing(table.entries[in_set]) == [2]
    assert table.missing(table.entries["allreduce.x"]) == [0, 2]
    outcome = table.apply([Message(), Message(), Message([(in_set, set_meta)])], now=2.0)
    assert [name for name, _ in outcome.ready] == [in_set]  # rank 1 is not needed
    # the same ranks again: refused on every rank; removing frees them
    again = ("add_process_set.noname.2", Meta("add_process_set", members=(0, 2)))
    outcome = table.apply([Message([again])] * 3, now=3.0)
    assert "exists already" in outcome.errors[0][2] and table._next_set == 2
    gone = ("remove_process_set.noname.3", Meta("remove_process_set", members=(0, 2)))
    late = (scoped("allgather.y", 1), Meta.of("allgather", [torch.zeros(2)], process_set=1))
    table.apply([Message([late]), Message(), Message()], now=4.0)
    outcome = table.apply([Message([gone])] * 3, now=5.0)
    assert 1 not in table.sets and [name for name, _ in outcome.ready] == [gone[0]]
    # a name left waiting in a removed set fails on its callers
    outcome = table.apply([Message()] * 3, now=6.0)
    [(name, ranks, why)] = outcome.errors
    assert name == late[0] and ranks == {0} and "removed" in why, why


def test_negotiation_join_fails_when_nothing_moves_for_the_stall_timeout():
    from collectives.horovod.negotiation import Message, StallInspector, Table
    table, warnings = Table(3), []
    inspector = StallInspector(warn_after=1.0, fail_after=10.0, report=warnings.append)
    table.apply([Message(), Message(), Message(join=True)], now=0.0)
    # rank 0 and 1 still run allreduces (rank 2 adds zeros): that is progress
    outcome = table.apply([Message([("allreduce.a", _meta())]),
                           Message([("allreduce.a", _meta())]), Message()], now=8.0)
    assert outcome.ready and not inspector.join_stalled(table, now=12.0)
    assert "rank(s) [2] have waited in join()" in warnings[0]
    assert inspector.join_stalled(table, now=18.5)
    # an expiry decided while a rank joins in the same cycle is moot
    moot = table.apply([Message(join_expired=True), Message(join=True), Message()], now=18.5)
    assert moot.join_failed is None and table.joined == {1, 2}
    failed = table.apply([Message(join_expired=True), Message(), Message()], now=40.0,
                         stall_timeout=10.0)
    ranks, why = failed.join_failed
    assert ranks == {1, 2} and "rank(s) [0] did not join" in why and not table.joined, why
