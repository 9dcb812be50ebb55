"""CUDA tensors through every collective and through our DDP (run under torchrun).

    torchrun --nproc-per-node 1 tests/checks_gpu.py nccl   # NCCL, one GPU, world size 1
    torchrun --nproc-per-node 1 tests/checks_gpu.py nccl-mixed   # "cpu:gloo,cuda:nccl"
    torchrun --nproc-per-node 2 tests/checks_gpu.py gloo   # CUDA tensors staged by gloo
    mpirun -np 2 python tests/checks_gpu.py mpi            # ... and by mpi4py

NCCL needs a GPU per rank, so on one GPU it runs at world size 1; gloo and mpi move CUDA
tensors through host memory, so any number of ranks may share the GPU. Each rank checks
its results against a float64 reference computed on the CPU, that results stay on the
GPU, and that our DDP on the GPU ends with torch DDP's parameters (torch DDP runs on the
same torch.distributed backend, or on a gloo group for mpi). Prints `ok RANK DIGEST`.
"""
import hashlib
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

import collectives
from collectives import algorithms
from collectives.world import adopt_torch_group
from checks_algorithms import check_all_reduce, make_input
from checks_ddp import batch, make_model, state

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int64]


def check_others(comm, device, hasher):
    """broadcast, all_gather and reduce_scatter, every algorithm, on the GPU."""
    n, rank = comm.world_size, comm.rank
    inputs = [make_input(r, 8 * n, torch.float32) for r in range(n)]
    for algorithm in algorithms.names("broadcast"):
        tensor = inputs[rank].to(device)
        collectives.broadcast(tensor, src=n - 1, algorithm=algorithm, comm=comm)
        assert torch.equal(tensor.cpu(), inputs[n - 1]), ("broadcast", algorithm)
    for algorithm in algorithms.names("all_gather"):
        output = torch.empty(n * 8 * n, device=device)
        collectives.all_gather(output, inputs[rank].to(device), algorithm=algorithm, comm=comm)
        assert torch.equal(output.cpu(), torch.cat(inputs)), ("all_gather", algorithm)
    total = torch.stack([x.double() for x in inputs]).sum(0)
    for algorithm in algorithms.names("reduce_scatter"):
        output = torch.empty(8, device=device)
        collectives.reduce_scatter(output, inputs[rank].to(device), algorithm=algorithm,
                                   comm=comm)
        mine = total[rank * 8:(rank + 1) * 8]
        torch.testing.assert_close(output.cpu().double(), mine, rtol=1e-5, atol=1e-5)
        hasher.update(output.cpu().numpy().tobytes())


def train(model, rank, world_size, device, steps=3):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for step in range(steps):
        x, y = batch("resnet18", rank, world_size, step)
        optimizer.zero_grad()
        F.cross_entropy(model(x.to(device)), y.to(device)).backward()
        optimizer.step()


def check_ddp(comm, device, backend, hasher):
    """Our DDP on the GPU ends where torch's DDP on the GPU ends (3 ResNet-18 steps)."""
    rank, n = comm.rank, comm.world_size
    if backend == "mpi":  # torch has no mpi backend: torch DDP runs on a gloo group
        store = dist.TCPStore("127.0.0.1", 29533, n, rank == 0)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=n)
    theirs = torch.nn.parallel.DistributedDataParallel(make_model("resnet18").to(device))
    train(theirs, rank, n, device)
    ours = collectives.DistributedDataParallel(make_model("resnet18").to(device))
    train(ours, rank, n, device)
    expected, actual = state(theirs.module), state(ours.module)
    for name in expected:
        assert actual[name].device == device, name
        torch.testing.assert_close(actual[name], expected[name], rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"{name} on rank {rank}: {m}")
    for name in sorted(actual):
        hasher.update(actual[name].cpu().numpy().tobytes())


def check_model_averaging(comm, device, hasher):
    """The strategies that average models on the GPU: diloco (plain, and streaming with a
    fragment in flight on its background thread) and hier-local-sgd, 4 steps each.
    Plain diloco and hier-local-sgd end on a step where every parameter was just
    synchronized: every rank then holds the same model, on the GPU."""
    from collectives import sync
    settings = [("diloco", {"period": 2}), ("diloco", {"period": 4, "fragments": 2,
                                                       "delay": 1}),
                ("hier-local-sgd", {"period": 2})]
    for name, options in settings:
        synced_at_the_end = options.get("fragments", 1) == 1
        strategy = sync.create(name, **options)
        model = collectives.DistributedDataParallel(make_model("resnet18").to(device),
                                                    sync=strategy, moments="loop", comm=comm)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        for step in range(1, 5):
            x, y = batch("resnet18", comm.rank, comm.world_size, step)
            optimizer.zero_grad()
            F.cross_entropy(model(x.to(device)), y.to(device)).backward()
            strategy.after_backward(model.module)
            optimizer.step()
            strategy.after_step(model.module, step)
        strategy.close()
        parameters = torch.cat([p.detach().reshape(-1) for p in model.module.parameters()])
        assert parameters.device == device and bool(torch.isfinite(parameters).all()), name
        if synced_at_the_end:
            rank0s = parameters.clone()
            collectives.broadcast(rank0s, src=0, comm=comm)
            assert torch.equal(rank0s, parameters), (name, options, "replicas differ")
        hasher.update(parameters.cpu().numpy().tobytes())


def check_what_nccl_lacks(comm, device):
    """The calls NCCL has no kernel for, on real NCCL: int16 (reduced in int32), bool,
    band/bor/bxor (bit by bit), complex sums; CPU tensors on gloo beside it; the
    barrier and a duplicate. At world size 1 every reduction must give its input back
    exactly, which checks the bits' unpacking and packing too."""
    generator = torch.Generator().manual_seed(7)
    values = torch.randint(-2**15, 2**15, (33,), generator=generator)
    cases = [(values.to(torch.int16), op) for op in ("sum", "max", "band", "bor", "bxor")]
    cases += [(values.to(torch.int32), op) for op in ("band", "bor", "bxor", "avg")]
    cases += [(values.to(torch.uint8), "bxor"), (values > 0, "sum"), (values > 0, "band"),
              (torch.randn(5, dtype=torch.complex64, generator=generator), "sum")]
    for tensor, op in cases:
        for on in (device, torch.device("cpu")):
            moved = tensor.to(on)
            comm.native_all_reduce(moved, op)
            assert moved.device == on and torch.equal(moved.cpu(), tensor), (tensor.dtype, op, on)
    comm.barrier()
    twin = comm.duplicate()
    twin.barrier()
    ones = torch.ones(4, device=device)
    twin.native_all_reduce(ones, "sum")
    assert torch.equal(ones.cpu(), torch.ones(4))


def main(backend):
    torch.set_num_threads(1)
    torch.backends.cudnn.deterministic = True  # so the two DDPs compute the same gradients
    if backend.startswith("nccl"):  # init() needs no group at world size 1: adopt one
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl" if backend == "nccl" else "cpu:gloo,cuda:nccl")
        comm = adopt_torch_group(timeout=120)
        assert comm.device_tensors_ok, "nccl moves CUDA tensors itself"
        assert (comm.cpu_group is None) == (backend == "nccl-mixed"), "gloo beside NCCL"
        check_what_nccl_lacks(comm, torch.device("cuda", torch.cuda.current_device()))
    else:
        comm = collectives.init(backend=backend, timeout=120, device="cuda")
    device = torch.device("cuda", torch.cuda.current_device())
    hasher = hashlib.sha1()
    digests = check_all_reduce(comm, dtypes=DTYPES, ops=("sum", "avg", "max"), device=device)
    hasher.update(repr(sorted(digests.items())).encode())
    check_others(comm, device, hasher)
    check_ddp(comm, device, backend, hasher)
    if comm.world_size > 1:
        check_model_averaging(comm, device, hasher)
    print(f"ok {comm.rank} {hasher.hexdigest()[:12]}", flush=True)
    if backend.startswith("nccl"):
        comm.close()
        dist.destroy_process_group()
    else:
        collectives.destroy()


if __name__ == "__main__":
    main(sys.argv[1])
