"""The transport on gloo (spawned ranks) and in a world of one."""
import os
from datetime import timedelta

import pytest
import torch

import collectives
from collectives.transport.group import Group
from collectives.transport.local import LocalTransport
from checks_transport import check_transport
from distributed import run_world
from launchers import python, run

LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "PMI_RANK", "PMI_SIZE", "SLURM_PROCID",
                    "SLURM_NTASKS", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK",
                    "MASTER_ADDR", "MASTER_PORT")


def transport_name(comm):
    return comm.name


@pytest.mark.timeout(180)
@pytest.mark.parametrize("world_size,shm", [(2, "on"), (3, "on"), (4, "on"), (2, "off"),
                                            (3, "off")])
def test_gloo_point_to_point_and_native(world_size, shm):
    # "on": ranks of one host talk through shared memory; "off": gloo's TCP
    expected = "gloo+shm" if shm == "on" else "gloo"
    assert run_world(transport_name, world_size, shm=shm) == [expected] * world_size
    assert run_world(check_transport, world_size, timeout=150, shm=shm) == ["ok"] * world_size


def staged_then_checked(comm):
    """Every message through a staging copy, as NCCL's CPU tensors (and gloo's CUDA
    tensors) go: sends from a copy, receives copied back on wait(), native calls too."""
    comm.cpu_tensors_ok = False  # stage CPU tensors to comm.device, here the CPU itself
    assert comm.staging_device(torch.zeros(1)) == comm.device
    return check_transport(comm)


@pytest.mark.timeout(180)
def test_staged_tensors_arrive_whole():
    assert run_world(staged_then_checked, 3, timeout=150, shm="off") == ["ok"] * 3


WORLD_OF_ONE = """
import torch, collectives
from collectives.transport import LocalTransport
comm = collectives.init(backend={backend!r})
assert isinstance(comm, LocalTransport), comm
assert (comm.rank, comm.world_size, comm.local_rank) == (0, 1, 0)
tensor = torch.arange(5.0)
for algorithm in ("auto", "ring", "halving-doubling", "tree", "naive", "native"):
    for op in ("sum", "avg", "max", "min"):
        collectives.all_reduce(tensor, op=op, algorithm=algorithm)
        assert tensor.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
collectives.broadcast(tensor, src=0)
comm.barrier()
try:
    comm.send(tensor, 0)
    raise SystemExit("send to myself did not raise")
except ValueError as error:
    assert "not another rank" in str(error)
print("ok")
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", ["auto", "gloo", "mpi"])
def test_world_of_one_needs_no_launcher(backend):
    # A fresh process, as a user's script: no launcher variables at all.
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARIABLES}
    result = run(python("-c", WORLD_OF_ONE.format(backend=backend)), env=env, timeout=100,
                 check=False)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


def test_api_works_without_init_in_a_plain_process(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    collectives.destroy()
    tensor = torch.ones(3)
    collectives.all_reduce(tensor, op="avg")
    assert tensor.tolist() == [1.0, 1.0, 1.0]


def duplicate_a_subgroup_then_make_a_group_of_everyone(comm):
    """Ranks 0 and 1 of 4 adopt torch's group of the two and duplicate it (as the
    hierarchy's pipeline and the background strategies do); then all four make a new
    torch group and all-reduce on it. torch names a group from a counter that only the
    ranks creating it advance, so a duplicate made by the members alone would leave
    ranks 0, 1 and ranks 2, 3 naming the next group differently: it would never form."""
    from datetime import timedelta

    import torch.distributed as dist

    from collectives.world import adopt_torch_group
    pair = dist.new_group([0, 1])  # every rank calls new_group, as torch asks
    got = None
    if comm.rank in (0, 1):
        sub = adopt_torch_group(pair, timeout=20, shm="off")
        twin = sub.duplicate()
        mine, theirs = torch.full((3,), float(sub.rank)), torch.empty(3)
        twin.sendrecv(mine, 1 - sub.rank, theirs, 1 - sub.rank)
        got = theirs.tolist()
    everyone = dist.new_group(timeout=timedelta(seconds=20))
    total = torch.ones(1)
    dist.all_reduce(total, group=everyone)
    return got, total.item()


@pytest.mark.timeout(120)
def test_duplicating_a_subgroup_leaves_later_torch_groups_formable():
    results = run_world(duplicate_a_subgroup_then_make_a_group_of_everyone, 4, timeout=90,
                        init_timeout=20, shm="off")
    assert results == [([1.0] * 3, 4.0), ([0.0] * 3, 4.0), (None, 4.0), (None, 4.0)]


def talk_to_a_dead_peer(comm):
    """Rank 1 exits; rank 0 notices on a receive, then sends and receives again: gloo
    refuses those at once (the connection is closed), and that must be a PeerError
    naming the peer too, not torch's RuntimeError."""
    if comm.rank == 1:
        comm.barrier()
        os._exit(0)
    comm.barrier()
    raised = []
    for attempt in (lambda: comm.recv(torch.zeros(1), 1), lambda: comm.send(torch.zeros(1), 1),
                    lambda: comm.recv(torch.zeros(1), 1)):
        try:
            attempt()
            raised.append("returned")
        except Exception as error:
            raised.append(f"{type(error).__name__}: {error}")
    return raised


@pytest.mark.timeout(120)
def test_a_send_or_receive_to_a_dead_peer_is_a_peer_error_naming_it():
    raised = run_world(talk_to_a_dead_peer, 2, timeout=90, init_timeout=20, shm="off",
                       may_die=(1,))[0]
    assert [line.split(":")[0] for line in raised] == ["PeerError"] * 3, raised
    assert ["rank 1" in line for line in raised] == [True] * 3, raised


def test_a_slow_link_gets_segments_it_moves_in_about_40_ms():
    from collectives.transport import Transport
    assert Transport.segment_for_link(100e6 / 8) == 256 << 10  # 0.5 MB in 40 ms
    assert Transport.segment_for_link(1e9 / 8) == 4 << 20      # the default, at most
    assert Transport.segment_for_link(1e6 / 8) == 64 << 10     # at least


def test_a_segment_given_in_the_environment_is_taken_and_a_bad_one_refused(monkeypatch):
    from collectives.launch import LaunchError
    from collectives.world import segment_from_env
    monkeypatch.setenv("COLLECTIVES_SEGMENT_KB", "256")
    assert segment_from_env() == 256 << 10
    monkeypatch.setenv("COLLECTIVES_SEGMENT_KB", "4M")
    with pytest.raises(LaunchError, match="COLLECTIVES_SEGMENT_KB"):
        segment_from_env()


def test_an_algorithms_workspace_is_kept_from_call_to_call_per_name_and_dtype():
    comm = LocalTransport(torch.device("cpu"), timedelta(seconds=5))
    floats, doubles = torch.zeros(1), torch.zeros(1, dtype=torch.float64)
    first = comm.workspace("ring scratch 0", floats, 100)
    assert first.numel() == 100 and first.dtype == torch.float32
    again = comm.workspace("ring scratch 0", floats, 60)  # smaller: the same memory
    assert again.numel() == 60 and again.data_ptr() == first.data_ptr()
    assert comm.workspace("ring scratch 1", floats, 60).data_ptr() != first.data_ptr()
    assert comm.workspace("ring scratch 0", doubles, 60).dtype == torch.float64
    grown = comm.workspace("ring scratch 0", floats, 1000)
    assert grown.numel() == 1000
    assert comm.workspace("ring scratch 0", floats, 10).data_ptr() == grown.data_ptr()
    # a group uses its parent's; a duplicate has its own
    assert Group(comm, [0]).workspace("ring scratch 0", floats, 10).data_ptr() == grown.data_ptr()
    assert comm.duplicate().workspace("ring scratch 0", floats, 10).data_ptr() != grown.data_ptr()
    # after a failed call (api.py releases it) the next call gets fresh memory
    Group(comm, [0]).release_workspace()
    assert comm.workspace("ring scratch 0", floats, 10).data_ptr() != grown.data_ptr()


def test_a_workspace_made_in_inference_mode_can_be_written_outside_it():
    comm = LocalTransport(torch.device("cpu"), timedelta(seconds=5))
    with torch.inference_mode():
        comm.workspace("tree scratch", torch.zeros(1), 8)
    comm.workspace("tree scratch", torch.zeros(1), 8).copy_(torch.ones(8))  # no error
