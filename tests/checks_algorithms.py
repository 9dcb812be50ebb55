"""Every algorithm x op x dtype x size against a numpy float64 reference, on every rank.

Shared by the gloo tests (spawned ranks) and the mpi tests (run under mpirun).
Each rank can compute every rank's input (seeded by rank), so each computes the
reference itself. Returns a digest of every result so the caller can check that all
ranks ended bitwise identical.
"""
import hashlib
import math
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


# every dtype the API accepts, for the checks at each dtype's limits
ALL_DTYPES = [torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64, torch.float16,
              torch.bfloat16, torch.float32, torch.float64]


def near_limits(rank, world_size, numel, dtype, op):
    """Values near `dtype`'s limits whose sum over `world_size` ranks overflows the dtype
    while their average fits; for op="sum", divided by the world size so the sum fits.

    Integers: any bit pattern (so half are beyond half the range), and the first two
    elements the largest and the smallest value on every rank. Floats: half to all of
    the largest finite value, either sign, and the first two elements +-that value
    (float32 and float64 divide in place: 8 units of roundoff below it, the margin
    algorithms/average.py promises for worlds of up to 6 ranks).
    """
    generator = torch.Generator().manual_seed(7 + 1000 * rank + numel)
    if dtype.is_floating_point:
        top = torch.finfo(dtype).max
        if dtype in (torch.float32, torch.float64):
            top *= 1 - 8 * torch.finfo(dtype).eps
        size = 0.5 + 0.5 * torch.rand(numel, generator=generator, dtype=torch.float64)
        sign = torch.randint(0, 2, (numel,), generator=generator) * 2 - 1
        values = sign * size * top
        values[:2] = torch.tensor([top, -top], dtype=torch.float64)
        if op == "sum":  # 0.9: room for the roundings of the division and the sum
            values *= 0.9 / world_size
        return values.to(dtype)
    width = torch.empty(0, dtype=dtype).element_size()
    values = torch.randint(0, 256, (numel * width,), generator=generator,
                           dtype=torch.uint8).view(dtype).clone()
    values[:2] = torch.tensor([torch.iinfo(dtype).max, torch.iinfo(dtype).min], dtype=dtype)
    if op == "sum":  # toward zero, so that n of them stay within the limits
        values = values.div(world_size, rounding_mode="trunc")
    return values


def near_limits_reference(world_size, numel, dtype, op):
    """(expected, allowed error, unit) for `near_limits` inputs: integers exactly, as
    Python integers (integer avg rounds down, as //); floats in float64, in units of a
    power of two near the dtype's largest value (so that float64 itself cannot
    overflow), within the bound `reference` allows."""
    inputs = [near_limits(r, world_size, numel, dtype, op) for r in range(world_size)]
    if not dtype.is_floating_point:
        totals = [sum(column) for column in zip(*(t.tolist() for t in inputs))]
        return [t // world_size if op == "avg" else t for t in totals], None, None
    unit = 2.0 ** (math.frexp(torch.finfo(dtype).max)[1] - 1)
    scaled = np.stack([t.double().numpy() / unit for t in inputs])
    u = UNIT_ROUNDOFF[dtype]
    total = scaled.sum(0)
    bound = (world_size + 1) * u * np.abs(scaled).sum(0)
    if op == "avg":
        return total / world_size, bound / world_size + u * np.abs(total / world_size), unit
    return total, bound, unit


def check_near_limits(comm):
    """Every all-reduce and reduce-scatter algorithm x every dtype, sum and avg, on
    values whose sum overflows the dtype while their average fits (`near_limits`).
    Returns the all-reduce results' digests, for the caller to compare across ranks."""
    n, rank = comm.world_size, comm.rank
    digests = {}
    for collective in ("all_reduce", "reduce_scatter"):
        numel = 13 if collective == "all_reduce" else 5 * n  # uneven chunks; n outputs of 5
        mine = slice(None) if collective == "all_reduce" else slice(rank * 5, rank * 5 + 5)
        for algorithm in algorithms.names(collective):
            for dtype in ALL_DTYPES:
                for op in ("sum", "avg"):
                    tensor = near_limits(rank, n, numel, dtype, op)
                    what = f"{collective} {algorithm} {op} {dtype} near its limits"
                    if collective == "all_reduce":
                        result = collectives.all_reduce(tensor, op, algorithm, comm=comm)
                    else:
                        result = collectives.reduce_scatter(torch.empty(5, dtype=dtype),
                                                            tensor, op, algorithm, comm=comm)
                    expected, allowed, unit = near_limits_reference(n, numel, dtype, op)
                    if unit is None:
                        assert result.tolist() == expected[mine], (
                            f"{what}: got {result.tolist()}, expected {expected[mine]}")
                    else:
                        error = np.abs(result.double().numpy() / unit - expected[mine])
                        assert (error <= allowed[mine]).all(), (
                            f"{what}: got {(result.double() / unit).tolist()} x {unit:g}, "
                            f"expected {expected[mine].tolist()}")
                    if collective == "all_reduce":  # a reduce-scatter's chunk is per rank
                        digests[(algorithm, str(dtype), op)] = digest(result)
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


def check_public_calls_on_a_group(comm):
    """The public calls on some ranks of the world (transport/group.py: no native
    collectives): `auto` picks algorithms built from point-to-point where it would pick
    the backend's own, and asking for "native" there is a clear error. Ranks 0 and the
    last form the group; the others take no part."""
    from collectives import api
    from collectives.transport.group import Group
    members = [0, comm.world_size - 1]
    if comm.rank not in members:
        return None
    group = Group(comm, members)
    me = group.rank
    small = torch.full((5,), float(comm.rank + 1))  # whatever auto picks, not native
    api.all_reduce(small, op="sum", comm=group)
    assert torch.equal(small, torch.full((5,), float(comm.world_size + 1))), small
    value = torch.full((3,), float(comm.rank))
    api.broadcast(value, src=1, comm=group)  # auto: always native elsewhere
    assert torch.equal(value, torch.full((3,), float(members[1]))), value
    gathered = torch.empty(4)
    api.all_gather(gathered, torch.full((2,), float(me)), comm=group)
    assert gathered.tolist() == [0.0, 0.0, 1.0, 1.0], gathered
    try:
        api.all_reduce(small, algorithm="native", comm=group)
        raise AssertionError("native on a group was accepted")
    except ValueError as error:
        assert "native" in str(error), error
    return small.tolist()


def main(checks):
    """Under mpirun, on the mpi backend: `checks` names what runs, in one job (one
    start-up of the ranks): "transport" (checks_transport.py's, printing its line) and
    "algorithms" (a subset of the above, printing `N checks ok`)."""
    unknown = set(checks) - {"transport", "algorithms"}
    if unknown:
        sys.exit(f"checks_algorithms.py: unknown checks {sorted(unknown)}")
    comm = collectives.init(backend="mpi", timeout=60)
    if "transport" in checks:
        from checks_transport import check_transport
        result = check_transport(comm)
        sys.stdout.write(f"rank {comm.rank} of {comm.world_size} ({comm.name}): {result}\n")
    if "algorithms" in checks:
        results = [check_all_reduce(comm, dtypes=[torch.float32, torch.bfloat16, torch.int64]),
                   check_ring_segments(comm), check_broadcast_gather_scatter(comm),
                   check_product(comm)]
        # all ranks must hold bitwise identical results: compare digests with rank 0's
        from mpi4py import MPI
        first = MPI.COMM_WORLD.bcast(results, root=0)
        assert results[0] == first[0] and results[1] == first[1] and results[3] == first[3], \
            "ranks differ"
        sys.stdout.write(f"rank {comm.rank} ({comm.name}): {sum(map(len, results))} checks ok\n")


if __name__ == "__main__":  # mpirun -np 4 python checks_algorithms.py [transport] [algorithms]
    main(sys.argv[1:] or ["algorithms"])
