"""The nccl paths without a GPU: a group that refuses CPU tensors, and auto's choice.

NCCL moves device memory only: a CPU tensor handed to an NCCL-only group fails ("No
backend type associated with device type cpu"). torch's fake backend bound to the meta
device behaves the same way for CPU tensors while accepting device (meta) tensors
without moving anything. With it standing in for NCCL (world.DEVICE_BACKEND), two
spawned ranks run init's routing, the barrier, duplicates and every public
collective: every CPU tensor of bookkeeping (host tables, call checks, votes) must go
to gloo, where it really moves, and only device tensors to the stand-in. Both ways a
group comes: built by init ("cpu:gloo,meta:fake") and adopted from a script that
made an NCCL-only one ("meta:fake", which gets a gloo group beside it).

Then the backend auto takes, from per-host GPU counts faked in a census.
"""
import os

import pytest
import torch

import collectives
from collectives import world
from collectives.launch.census import Census
from collectives.launch.environment import LaunchError, LaunchInfo
from distributed import run_world

ALGORITHMS = {"all_reduce": ["ring", "halving-doubling", "tree", "naive", "native",
                             "hierarchical"],
              "broadcast": ["tree", "naive", "native"],
              "reduce_scatter": ["ring", "native"],
              "all_gather": ["ring", "native"]}


def _stand_in_for_nccl(gpus: int) -> None:
    """torch's fake backend on the meta device plays NCCL, with `gpus` faked GPUs."""
    from torch.testing._internal.distributed import fake_pg  # registers "fake"
    assert fake_pg
    world.DEVICE_BACKEND = ("meta", "fake")
    world.gpu_count = lambda: gpus
    world.gpu_ids = lambda: [f"GPU-{index}" for index in range(gpus)]


def every_path(_, route: str):
    """On each rank: join through `route`, then every call that has a metadata path."""
    import torch.distributed as dist
    _stand_in_for_nccl(gpus=2)
    if route == "init":
        comm = collectives.init(backend="nccl", device="meta")
    else:  # a script's own NCCL-only group, adopted
        dist.init_process_group("meta:fake")
        comm = collectives.get_comm()
    seen = {"backend": comm.backend, "device": str(comm.device),
            "hosts": comm.topology.hosts,
            "group": str(dist.get_backend_config())}
    comm.barrier()
    twin = comm.duplicate()
    twin.barrier()
    for collective, algorithms in ALGORITHMS.items():
        for algorithm in algorithms:
            data = torch.empty(12, device="meta")
            if collective == "all_reduce":
                collectives.all_reduce(data, "avg", algorithm, comm=comm)
            elif collective == "broadcast":
                collectives.broadcast(data, 1, algorithm, comm=comm)
            elif collective == "reduce_scatter":
                collectives.reduce_scatter(torch.empty(6, device="meta"), data,
                                           algorithm=algorithm, comm=comm)
            else:
                collectives.all_gather(torch.empty(24, device="meta"), data,
                                       algorithm=algorithm, comm=comm)
    collectives.all_gather([torch.empty(3, device="meta") for _ in range(2)],
                           torch.empty(3, device="meta"), comm=comm)
    collectives.all_to_all([torch.empty(2, device="meta") for _ in range(2)],
                           [torch.empty(2, device="meta") for _ in range(2)], comm=comm)
    for op in ("band", "bxor"):  # NCCL has none: reduced bit by bit, on the device
        collectives.all_reduce(torch.empty(5, dtype=torch.int16, device="meta"), op,
                               "native", comm=comm)
    # CPU tensors on an nccl communicator go to gloo, and really move
    counted = torch.tensor([comm.rank + 1.0])
    collectives.all_reduce(counted, "sum", "ring", comm=comm)
    flags = torch.tensor([comm.rank == 0, True])
    comm.native_all_reduce(flags, "band")
    twin.native_all_reduce(torch.ones(2, device="meta"))
    seen["sum"], seen["flags"] = counted.item(), flags.tolist()
    return seen


@pytest.mark.timeout(180)
@pytest.mark.parametrize("route", ["init", "adopted"])
def test_every_path_keeps_cpu_tensors_off_the_device_backend(route):
    results = run_world(every_path, 2, args=(route,), backend=None, timeout=150)
    for rank, seen in enumerate(results):
        assert seen["backend"] == "nccl" and seen["device"] == "meta"
        assert seen["hosts"] == [[0, 1]]
        assert seen["group"] == ("cpu:gloo,meta:fake" if route == "init" else "meta:fake")
        assert seen["sum"] == 3.0 and seen["flags"] == [False, True]


# --- auto's choice, from the census of the whole job --------------------------------------

def census(*hosts, one_each=False):
    """A census of hosts given as (ranks, GPUs): every process sees all of its host's
    GPUs, or (one_each) each sees one of them, as CUDA_VISIBLE_DEVICES per rank does."""
    lines = []
    for host, (ranks, gpus) in enumerate(hosts):
        ids = [f"GPU-{host}-{index}" for index in range(gpus)]
        for rank in range(ranks):
            seen = ids[rank % gpus:rank % gpus + 1] if one_each and gpus else ids
            lines.append(f"{1000 + host} {','.join(seen) or '-'} node{host}")
    return Census.from_lines(lines)


def test_auto_takes_nccl_only_where_every_host_has_a_gpu_per_rank():
    assert world.choose_backend("auto", census((4, 8), (4, 4)))[0] == "nccl"
    backend, said = world.choose_backend("auto", census((4, 8), (4, 1)))
    assert backend == "gloo"
    assert "host node1 has 4 ranks and 1 GPU" in said and "CUDA tensors" in said
    assert world.choose_backend("auto", census((4, 0), (4, 0))) == ("gloo", None)
    assert world.choose_backend("gloo", census((4, 8))) == ("gloo", None)
    # a GPU each, as Slurm's --gpus-per-task gives: four distinct GPUs on the host
    assert world.choose_backend("auto", census((4, 4), one_each=True))[0] == "nccl"
    assert census((4, 4), one_each=True).gpus_of_host([0, 1, 2, 3]) == 4


def test_nccl_named_with_too_few_gpus_is_one_line():
    with pytest.raises(LaunchError, match="host node0 has 4 ranks and 1 GPU"):
        world.choose_backend("nccl", census((4, 1), (4, 4)))
    info = LaunchInfo(rank=0, world_size=8, local_rank=0, launcher="torchrun",
                      local_world_size=4)
    with pytest.raises(LaunchError, match="this host has 4 ranks and 1 GPU"):
        world.check_gpus_for_nccl(info, gpus=1)
    world.check_gpus_for_nccl(info, gpus=4)  # enough


def test_nccl_with_too_few_gpus_fails_before_the_rendezvous(monkeypatch):
    """No peer ever comes: the error must come at once, not at the store's timeout."""
    for name, value in dict(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="2",
                            MASTER_ADDR="127.0.0.1", MASTER_PORT="1").items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(world, "gpu_count", lambda: 1)
    with pytest.raises(LaunchError, match="2 ranks and 1 GPU"):
        collectives.init(backend="nccl", timeout=5)


def census_of_the_job(_, gpus_by_rank):
    """auto on two spawned ranks of one host, each seeing the GPUs faked for it."""
    rank = int(os.environ["RANK"])
    world.gpu_ids = lambda: gpus_by_rank[rank]
    return world.choose_backend("auto", _take_census(rank, len(gpus_by_rank)))


def _take_census(rank, size):
    import time
    from datetime import timedelta
    import torch.distributed as dist
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), size,
                          is_master=rank == 0, timeout=timedelta(seconds=30))
    taken = Census.take(store, rank, size, world.gpu_ids())
    store.add("read", 1)
    while rank == 0 and store.add("read", 0) < size:  # the store lives on rank 0
        time.sleep(0.05)
    return taken


@pytest.mark.timeout(120)
def test_auto_is_decided_by_the_whole_job():
    """Two ranks of one host: one GPU there is too few for both, so both take gloo; two
    GPUs (both seen by each rank, or one each) are enough for nccl."""
    both_see_one = [["GPU-a"], ["GPU-a"]]
    results = run_world(census_of_the_job, 2, args=(both_see_one,), backend=None, timeout=90)
    assert [backend for backend, _ in results] == ["gloo", "gloo"]
    assert "has 2 ranks and 1 GPU" in results[0][1]
    for seen in ([["GPU-a", "GPU-b"]] * 2, [["GPU-a"], ["GPU-b"]]):  # all, or one each
        results = run_world(census_of_the_job, 2, args=(seen,), backend=None, timeout=90)
        assert [backend for backend, _ in results] == ["nccl", "nccl"]


# --- the trainer's first line, with CUDA faked -----------------------------------------

class _FakeComm:
    def __init__(self, backend, device, ranks_here):
        from collectives.transport.topology import Topology
        self.backend, self.device, self.rank = backend, torch.device(device), 0
        self.topology = Topology((0,) * ranks_here)


def test_the_first_line_says_where_the_ranks_train(monkeypatch):
    from trainer.loop.train import where_it_trains
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert where_it_trains(_FakeComm("gloo", "cpu", 4)) == "on the CPU"
    assert where_it_trains(_FakeComm("gloo", "cuda:0", 4)) == (
        "on cuda:0 (1 GPU shared by 4 ranks here, communication through host memory)")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert where_it_trains(_FakeComm("nccl", "cuda:3", 4)) == (
        "on cuda:3 (a GPU per rank, NCCL between them)")


def test_device_cuda_without_a_gpu_is_one_line(monkeypatch):
    monkeypatch.setattr(world, "gpu_count", lambda: 0)
    with pytest.raises(LaunchError, match="torch sees no CUDA GPU"):
        world.choose_device("cuda", "gloo", 0)
    assert world.choose_device("auto", "gloo", 3) == torch.device("cpu")
    monkeypatch.setattr(world, "gpu_count", lambda: 2)
    assert world.choose_device("auto", "gloo", 3) == torch.device("cuda", 1)  # shared
    with pytest.raises(LaunchError, match="has 2 GPUs"):
        world.choose_device("cuda:2", "nccl", 0)
