"""Every algorithm x op x dtype x size against a numpy float64 reference, on every rank.

Shared by the gloo tests (spawned ranks) and the mpi tests (run under mpirun).
Each rank can compute every rank's input (seeded by rank), so each computes the
reference itself. Returns a digest of every result so the caller can check that all
ranks ended bitwise identical.
"""
import hashlib
import sys

import numpy as np
import torch

import collectives
from collectives import algorithms
from collectives.algorithms import ring

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32,
          torch.int64]
OPS = ["sum", "avg", "max", "min"]
# unit roundoff of each float dtype: one addition errs by at most this, relatively
UNIT_ROUNDOFF = {torch.float32: 2.0 ** -24, torch.float64: 2.0 ** -53,
                 torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}


def sizes_for(world_size):
    """0, 1, fewer than the world, not divisible by it, and several ring segments."""
    return sorted({0, 1, max(world_size - 1, 1), 13, 1001})


def make_input(rank, numel, dtype):
    generator = torch.Generator().manual_seed(1000 * rank + numel)
    if dtype.is_floating_point:
        return torch.randn(numel, generator=generator, dtype=torch.float64).to(dtype)
    return torch.randint(-1000, 1000, (numel,), generator=generator).to(dtype)


def reference(world_size, numel, dtype, op):
    """(expected as float64 numpy, allowed error per element)."""
    inputs = np.stack([make_input(r, numel, dtype).double().numpy() for r in range(world_size)])
    if op == "max":
        return inputs.max(0), np.zeros(numel)
    if op == "min":
        return inputs.min(0), np.zeros(numel)
    total = inputs.sum(0)
    if not dtype.is_floating_point:
        return (np.floor_divide(total, world_size) if op == "avg" else total), np.zeros(numel)
    # n-1 additions in this dtype (any order), each off by at most u * the partial sum,
    # plus the final rounding and, for avg, the division.
    u = UNIT_ROUNDOFF[dtype]
    bound = (world_size + 1) * u * np.abs(inputs).sum(0)
    if op == "avg":
        return total / world_size, bound / world_size + u * np.abs(total / world_size)
    return total, bound


def digest(tensor):
    raw = tensor.view(torch.int16) if tensor.dtype in (torch.float16, torch.bfloat16) else tensor
    return hashlib.sha1(raw.numpy().tobytes()).hexdigest()[:12]


def check_all_reduce(comm, algorithm_names=None, dtypes=DTYPES, ops=OPS, device="cpu"):
    """device: where the tensors live (a GPU's are checked to stay there)."""
    n, rank, device = comm.world_size, comm.rank, torch.device(device)
    digests = {}
    for algorithm in algorithm_names or algorithms.names("all_reduce"):
        for dtype in dtypes:
            for op in ops:
                for numel in sizes_for(n):
                    tensor = make_input(rank, numel, dtype).to(device)
                    collectives.all_reduce(tensor, op=op, algorithm=algorithm, comm=comm)
                    assert tensor.device == device, (algorithm, tensor.device)
                    result = tensor.cpu()
                    expected, allowed = reference(n, numel, dtype, op)
                    error = np.abs(result.double().numpy() - expected)
                    assert (error <= allowed).all(), (
                        f"{algorithm} {op} {dtype} numel={numel}: max error "
                        f"{error.max()} > allowed {allowed[error.argmax()]}")
                    digests[(algorithm, str(dtype), op, numel)] = digest(result)
    return digests


def check_product(comm):
    """op="product" through every all-reduce algorithm (float64 and int64, exact for the
    integers; within n roundings for the floats)."""
    n, rank = comm.world_size, comm.rank
    digests = {}
    for algorithm in algorithms.names("all_reduce"):
        for dtype in (torch.float64, torch.int64):
            for numel in sizes_for(n):
                tensor = make_input(rank, numel, dtype)
                collectives.all_reduce(tensor, op="product", algorithm=algorithm, comm=comm)
                inputs = [make_input(r, numel, dtype) for r in range(n)]
                expected = inputs[0].clone()
                for other in inputs[1:]:
                    expected = expected * other
                if dtype.is_floating_point:
                    allowed = (n + 1) * UNIT_ROUNDOFF[dtype] * expected.abs()
                    assert ((tensor - expected).abs() <= allowed).all(), (algorithm, numel)
                else:
                    assert torch.equal(tensor, expected), (algorithm, numel)
                digests[(algorithm, str(dtype), numel)] = digest(tensor)
    return digests


def check_ring_segments(comm):
    """The pipelined ring with tiny segments: many messages a step, uneven chunks."""
    digests = {}
    for numel in (1, 37, 1001):
        for segment_bytes in (4, 12, 100):
            tensor = make_input(comm.rank, numel, torch.float64)
            ring.all_reduce(comm, tensor, "sum", segment_bytes=segment_bytes)
            expected, allowed = reference(comm.world_size, numel, torch.float64, "sum")
            assert (np.abs(tensor.numpy() - expected) <= allowed).all(), (numel, segment_bytes)
            digests[(numel, segment_bytes)] = digest(tensor)
    return digests


def check_broadcast_gather_scatter(comm):
    n, rank = comm.world_size, comm.rank
    digests = {}
    for dtype in DTYPES:
        for numel in sizes_for(n):
            for algorithm in algorithms.names("broadcast"):
                for root in range(n):
                    tensor = make_input(rank, numel, dtype)
                    collectives.broadcast(tensor, src=root, algorithm=algorithm, comm=comm)
                    assert torch.equal(tensor, make_input(root, numel, dtype)), (
                        f"broadcast {algorithm} root={root} {dtype} numel={numel}")
            for algorithm in algorithms.names("all_gather"):
                mine = make_input(rank, numel, dtype)
                gathered = torch.empty(n * numel, dtype=dtype)
                collectives.all_gather(gathered, mine, algorithm=algorithm, comm=comm)
                expected = torch.cat([make_input(r, numel, dtype) for r in range(n)])
                assert torch.equal(gathered, expected), f"all_gather {algorithm} {dtype} {numel}"
                as_list = [torch.empty(numel, dtype=dtype) for _ in range(n)]
                collectives.all_gather(as_list, mine, algorithm=algorithm, comm=comm)
                assert torch.equal(torch.cat(as_list), expected)
            for algorithm in algorithms.names("reduce_scatter"):
                for op in OPS:
                    full = make_input(rank, n * numel, dtype)
                    out = torch.empty(numel, dtype=dtype)
                    collectives.reduce_scatter(out, full, op=op, algorithm=algorithm, comm=comm)
                    expected, allowed = reference(n, n * numel, dtype, op)
                    mine = slice(rank * numel, (rank + 1) * numel)
                    error = np.abs(out.double().numpy() - expected[mine])
                    assert (error <= allowed[mine]).all(), (
                        f"reduce_scatter {algorithm} {op} {dtype} numel={numel}")
                    digests[("reduce_scatter", algorithm, op, str(dtype), numel)] = digest(out)
    return digests


if __name__ == "__main__":
    comm = collectives.init(backend="mpi", timeout=60)
    results = [check_all_reduce(comm, dtypes=[torch.float32, torch.bfloat16, torch.int64]),
               check_ring_segments(comm), check_broadcast_gather_scatter(comm),
               check_product(comm)]
    # all ranks must hold bitwise identical results: compare digests with rank 0's
    from mpi4py import MPI
    first = MPI.COMM_WORLD.bcast(results, root=0)
    assert results[0] == first[0] and results[1] == first[1] and results[3] == first[3], \
        "ranks differ"
    sys.stdout.write(f"rank {comm.rank} ({comm.name}): {sum(map(len, results))} checks ok\n")
