"""The transport on gloo (spawned ranks) and in a world of one."""
import pytest
import torch

import collectives
from checks_transport import check_transport
from collectives.transport import LocalTransport
from distributed import run_world


@pytest.mark.timeout(180)
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_gloo_point_to_point_and_native(world_size):
    assert run_world(check_transport, world_size, timeout=150) == ["ok"] * world_size


def test_world_of_one_needs_no_launcher(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "PMI_RANK", "PMI_SIZE", "SLURM_PROCID", "SLURM_NTASKS",
                 "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK"):
        monkeypatch.delenv(name, raising=False)
    for backend in ("auto", "gloo", "mpi"):
        comm = collectives.init(backend=backend)
        assert isinstance(comm, LocalTransport)
        assert (comm.rank, comm.world_size, comm.local_rank) == (0, 1, 0)
        tensor = torch.arange(5.0)
        for algorithm in ("auto", "ring", "halving-doubling", "tree", "naive", "native"):
            for op in ("sum", "avg", "max", "min"):
                collectives.all_reduce(tensor, op=op, algorithm=algorithm)
                assert tensor.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
        collectives.broadcast(tensor, src=0)
        comm.barrier()
        with pytest.raises(ValueError, match="not another rank"):
            comm.send(tensor, 0)
        collectives.destroy()


def test_api_works_without_init_in_a_plain_process(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    collectives.destroy()
    tensor = torch.ones(3)
    collectives.all_reduce(tensor, op="avg")
    assert tensor.tolist() == [1.0, 1.0, 1.0]
