"""torch.distributed on the "collectives" backend: torch's own collectives, DDP, ZeRO and
FSDP2 give what gloo gives; the same script runs under mpirun as init_process_group("mpi");
a peer killed mid-collective makes every survivor raise in time.

The checks live in checks_torch_backend.py, a script run as users run theirs (torchrun,
mpirun); each rank prints `ok CHECK RANK DIGEST` after comparing with gloo itself.
"""
import re
import signal
import subprocess
import threading
import time
from datetime import timedelta

import pytest

from launchers import TESTS, mpirun, python, rank_env, run, torchrun
from ports import free_port

CHECKS = ("check_reductions", "check_movement", "check_point_to_point", "check_subgroups",
          "check_disagreement", "check_chained_callbacks", "check_same_count_other_shapes",
          "check_refusals_leave_the_ranks_in_step", "check_integer_average_rounds_toward_zero")
TRAININGS = ("ddp", "ddp-fp16-hook", "ddp-bucket-view", "ddp-static-graph", "ddp-powersgd",
             "ddp-bf16-powersgd", "ddp-post-local-sgd",
             "ddp-powersgd-buckets", "zero", "fsdp2")
ENV = rank_env()


def digests(out: subprocess.CompletedProcess, names, world_size):
    """{(check, rank): digest}, after asserting every rank passed every check and ended."""
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    found = {}
    for name, rank, value in re.findall(r"^ok (\S+) (\d+) ?(\S*)$", out.stdout, re.M):
        found[(name, int(rank))] = value
    for name in list(names) + ["destroyed"]:
        for rank in range(world_size):
            assert (name, rank) in found, f"{name} on rank {rank} missing:\n{out.stdout}"
    return found


def under_torchrun(world_size, *args, timeout=200):
    """checks_torch_backend.py `args` on `world_size` ranks of torchrun."""
    return run(torchrun(world_size, "checks_torch_backend.py", *args), cwd=TESTS, env=ENV,
               timeout=timeout, check=False)


def under_mpirun(world_size, *args, timeout=200):
    """The same checks as init_process_group("mpi") on `world_size` ranks of mpirun."""
    return run(mpirun(world_size, *python("checks_torch_backend.py", *args, "--mpi")),
               cwd=TESTS, env=dict(ENV, COLLECTIVES_TORCH_MPI="1"), timeout=timeout,
               check=False)


def replicas_agree(found, world_size):
    for name in TRAININGS:  # the replicas agree (FSDP2: the gathered parameters)
        assert len({found[(name, rank)] for rank in range(world_size)}) == 1, name


@pytest.mark.timeout(300)
def test_two_ranks_train_as_on_gloo_and_the_mpi_route_computes_the_same():
    """5 steps of torch's DDP (plain, fp16 comm hook, gradient_as_bucket_view,
    static_graph), ZeroRedundancyOptimizer and FSDP2 on ours equal gloo's bit for bit,
    and so does every collective check. Then the same script as
    init_process_group("mpi") under mpirun (opted in by COLLECTIVES_TORCH_MPI=1), on
    the mpi4py transport, ends with the same values."""
    on_gloo = digests(under_torchrun(2, "all"), CHECKS + TRAININGS, 2)
    replicas_agree(on_gloo, 2)
    on_mpi = digests(under_mpirun(2, "all"), CHECKS + TRAININGS, 2)
    assert on_mpi == on_gloo


@pytest.mark.timeout(360)
def test_every_collective_matches_gloo_and_three_ranks_train_as_on_gloo():
    """On 3 ranks, in one job. Each collective and form (ops, dtypes, roots, lists and
    tensors, uneven all_to_all, async Work and future, tags, batch_isend_irecv,
    subgroups, objects, barriers) equals gloo; reduce_scatter leaves its input;
    mismatched calls raise on every rank and break only their own group; nothing runs
    after destroy. Tensors of one count in other shapes on each rank give gloo's values;
    refusals leave the group working where every rank refused, and in step where one
    did; integer avg rounds toward zero, as NCCL's. Then the trainings of the test
    above, within float rounding of another summation order."""
    replicas_agree(digests(under_torchrun(3, "all", timeout=300), CHECKS + TRAININGS, 3), 3)


@pytest.mark.timeout(30)
def test_jobs_run_in_the_order_they_were_admitted():
    """A blocking call admitted first (nothing pending: it runs on its caller's thread)
    runs first, even where its thread is held up between being admitted and running
    while another thread's call, admitted after it, reaches the worker: on each rank a
    different order would pair the ranks' calls wrongly. (The caller's thread used to
    take the running lock only after letting the admission lock go, and the worker ran
    the later call first.)"""
    from collectives.torch_backend.work import Worker
    order, took_second, second_started = [], threading.Event(), threading.Event()

    class HeldUp(Worker):
        def _execute(self, work, run):
            if work.describe() == "first":  # the caller's thread, admitted, held up
                took_second.wait(10)
                second_started.wait(0.5)   # time enough for the worker to start it
            elif work.describe() == "second":
                took_second.set()
            super()._execute(work, run)

    def second():
        second_started.set()
        order.append("second")

    worker = HeldUp("order", timedelta(seconds=30))
    caller = threading.Thread(target=worker.submit, args=(
        "first", lambda: order.append("first"), []), kwargs={"inline": True})
    caller.start()
    deadline = time.monotonic() + 10
    while worker.pending == 0 and time.monotonic() < deadline:  # "first" admitted
        time.sleep(0.001)
    queued = worker.submit("second", second, [])
    caller.join(10)
    queued.wait()
    worker.stop()
    assert order == ["first", "second"], order


def test_without_the_opt_in_mpi_says_how():
    """On torch without MPI, init_process_group("mpi") names the opt-in."""
    code = ("import torch.distributed as dist\n"
            "try:\n"
            "    dist.init_process_group('mpi')\n"
            "except RuntimeError as error:\n"
            "    print(error)\n")
    env = {k: v for k, v in ENV.items() if k != "COLLECTIVES_TORCH_MPI"}
    out = run(python("-c", code), env=env, timeout=120, check=False)
    assert "COLLECTIVES_TORCH_MPI=1" in out.stdout, out.stdout + out.stderr


def test_a_bad_algorithm_setting_fails_when_the_group_is_made():
    """COLLECTIVES_ALGORITHM is read once, when the group is made: a bad value is named
    there (a world of one, nothing to wait for), not at the first collective."""
    code = ("import torch.distributed as dist\n"
            "try:\n"
            "    dist.init_process_group('collectives', store=dist.HashStore(), rank=0,\n"
            "                            world_size=1)\n"
            "except ValueError as error:\n"
            "    print('refused:', error)\n")
    out = run(python("-c", code), env=dict(ENV, COLLECTIVES_ALGORITHM="butterfly"),
              timeout=120, check=False)
    assert "refused: COLLECTIVES_ALGORITHM='butterfly': choose from auto" in out.stdout, \
        out.stdout + out.stderr


@pytest.mark.timeout(120)
def test_a_script_that_never_destroys_its_group_exits_cleanly():
    """As with torch's gloo: exit closes our groups first (else: SIGABRT at exit)."""
    out = under_torchrun(2, "no-destroy", timeout=100)
    assert out.returncode == 0 and out.stdout.count("ok leaving") == 2, out.stderr[-3000:]
    assert "terminate called" not in out.stderr


def _launch(world_size, *args):
    """The ranks as separate processes (no torchrun: it would end the survivors)."""
    port = free_port()
    return [subprocess.Popen(python("checks_torch_backend.py", *args), cwd=TESTS,
                             env=dict(ENV, RANK=str(rank), WORLD_SIZE=str(world_size),
                                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size),
                                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for rank in range(world_size)]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("where", ["all_reduce", "ddp"])
def test_a_killed_peer_makes_every_survivor_raise(where):
    """The last of 3 ranks is SIGKILLed during dist.all_reduce, or between two of DDP's
    backward passes: both survivors raise (group timeout 20 s) and exit."""
    ranks = _launch(3, "dead-peer", where)
    started = time.monotonic()
    try:
        outs = [rank.communicate(timeout=120) for rank in ranks]
    finally:
        for rank in ranks:
            if rank.poll() is None:
                rank.kill()
    assert ranks[2].returncode == -signal.SIGKILL
    for rank, (stdout, stderr) in enumerate(outs[:2]):
        match = re.search(r"raised (\w+) after ([\d.]+) s", stdout)
        assert match, f"rank {rank} did not raise:\n{stdout}\n{stderr[-3000:]}"
        assert float(match.group(2)) < 40, stdout
    assert time.monotonic() - started < 120
