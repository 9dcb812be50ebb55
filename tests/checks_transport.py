"""Transport checks that run on every rank, shared by the gloo tests (spawned ranks)
and the mpi tests (this file run under mpirun: `mpirun -np 4 python checks_transport.py`)."""
import sys

import torch

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64]
SIZES = [0, 1, 7, 1001]


def pattern(rank: int, numel: int, dtype) -> torch.Tensor:
    """Small integers, exact in every dtype, different on every rank."""
    return ((torch.arange(numel) % 5) + rank).to(dtype)


def check_transport(comm) -> str:
    n, rank = comm.world_size, comm.rank
    right, left = (rank + 1) % n, (rank - 1) % n
    for dtype in DTYPES:
        for numel in SIZES:
            what = f"{dtype} numel={numel}"
            # the ring step: send right, receive from the left
            received = torch.full((numel,), -1).to(dtype)
            comm.traffic.reset()
            comm.sendrecv(pattern(rank, numel, dtype), right, received, left)
            assert torch.equal(received, pattern(left, numel, dtype)), f"sendrecv {what}"
            elem = received.element_size()
            assert comm.traffic.bytes_sent == numel * elem, f"bytes_sent {what}"
            assert comm.traffic.bytes_received == numel * elem, f"bytes_received {what}"
            # blocking and nonblocking point to point: rank 0 talks to everyone
            if rank == 0:
                for peer in range(1, n):
                    comm.send(pattern(peer, numel, dtype), peer)
                handles, buffers = [], []
                for peer in range(1, n):
                    buffers.append(torch.empty(numel, dtype=dtype))
                    handles.append(comm.irecv(buffers[-1], peer))
                for peer, handle, buffer in zip(range(1, n), handles, buffers):
                    handle.wait()
                    assert torch.equal(buffer, pattern(10 + peer, numel, dtype)), f"irecv {what}"
            else:
                mine = torch.empty(numel, dtype=dtype)
                comm.recv(mine, 0)
                assert torch.equal(mine, pattern(rank, numel, dtype)), f"recv {what}"
                comm.isend(pattern(10 + rank, numel, dtype), 0).wait()
            # the backend's own collectives
            for op, combine in (("sum", sum), ("max", max), ("min", min)):
                value = pattern(rank, numel, dtype)
                comm.native_all_reduce(value, op)
                expected = [combine(int(i % 5) + r for r in range(n)) for i in range(numel)]
                assert value.tolist() == expected, f"native_all_reduce {op} {what}"
            value = pattern(rank, numel, dtype)
            comm.native_all_reduce(value, "avg")
            expected = pattern(0, numel, torch.float64) + (n - 1) / 2
            if not dtype.is_floating_point:
                expected = expected.floor()
            assert torch.allclose(value.double(), expected, atol=1e-2), f"native avg {what}"
            value = pattern(rank, numel, dtype)
            comm.native_broadcast(value, n - 1)
            assert torch.equal(value, pattern(n - 1, numel, dtype)), f"native_broadcast {what}"
    check_big_messages_and_reduce(comm)
    comm.barrier()
    return "ok"


def check_big_messages_and_reduce(comm) -> None:
    """Messages much larger than any transport buffer, both ways at once, and
    irecv_reduce (receive and fold in) for every op and a 16-bit float."""
    n, rank = comm.world_size, comm.rank
    right, left = (rank + 1) % n, (rank - 1) % n
    numel = 3_000_000 + 3  # 12 MB of float32: several times a shared-memory channel
    received = torch.empty(numel)
    comm.sendrecv(torch.arange(numel, dtype=torch.float32) + rank, right, received, left)
    assert torch.equal(received, torch.arange(numel, dtype=torch.float32) + left), "big sendrecv"
    for op, expect in (("sum", lambda a, b: a + b), ("max", torch.maximum),
                       ("min", torch.minimum)):
        for dtype, count in ((torch.float32, numel), (torch.bfloat16, 1001), (torch.int64, 5)):
            mine = (torch.arange(count) % 11 + rank).to(dtype)
            theirs = (torch.arange(count) % 11 + left).to(dtype)
            receiving = comm.irecv_reduce(mine, left, op)
            sending = comm.isend((torch.arange(count) % 11 + rank).to(dtype), right)
            receiving.wait()
            sending.wait()
            assert torch.equal(mine, expect((torch.arange(count) % 11 + rank).to(dtype), theirs)), \
                f"irecv_reduce {op} {dtype}"


if __name__ == "__main__":
    import collectives
    comm = collectives.init(backend=sys.argv[1] if len(sys.argv) > 1 else "mpi", timeout=60)
    result = check_transport(comm)
    sys.stdout.write(f"rank {comm.rank} of {comm.world_size} ({comm.name}): {result}\n")
