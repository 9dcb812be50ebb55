"""A plain torch.distributed training script that runs on this project's algorithms.

    torchrun --nproc-per-node 2 examples/torch_backend_fsdp.py --wrap fsdp2
    torchrun --nproc-per-node 2 examples/torch_backend_fsdp.py --wrap ddp
    torchrun --nproc-per-node 2 examples/torch_backend_fsdp.py --backend gloo   # torch's own

Nothing here is specific to this project except the backend's name: torch's DDP or
FSDP2 (fully_shard) does the sharding, bucketing and overlapping, and every collective
it issues runs through `collectives.torch_backend` (our ring, halving-doubling, ...
chosen by size). The model learns to tell which of four noisy patterns an input is.
"""
import argparse
import os

import torch
import torch.distributed as dist
from torch import nn


def batches(rank: int, steps: int, batch: int = 32):
    """Noisy copies of 4 fixed patterns, a different stream on each rank."""
    patterns = torch.randn(4, 64, generator=torch.Generator().manual_seed(0))
    generator = torch.Generator().manual_seed(1 + rank)
    for _ in range(steps):
        labels = torch.randint(0, 4, (batch,), generator=generator)
        yield patterns[labels] + 0.8 * torch.randn(batch, 64, generator=generator), labels


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--wrap", choices=["ddp", "fsdp2"], default="fsdp2")
    parser.add_argument("--backend", default="collectives")
    parser.add_argument("--steps", type=int, default=60)
    # torch.distributed.launch passes --local-rank=N (before torch 2.0: --local_rank); torch
    # documents accepting both. The backend reads the local rank from LOCAL_RANK, which that
    # launcher sets too; a launcher that only passes the flag has it exported here.
    parser.add_argument("--local-rank", "--local_rank", type=int)
    args = parser.parse_args()
    if args.local_rank is not None:
        os.environ.setdefault("LOCAL_RANK", str(args.local_rank))

    dist.init_process_group(args.backend)
    rank = dist.get_rank()
    torch.manual_seed(0)  # the same initial model everywhere
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(),
                          nn.Linear(128, 4))
    if args.wrap == "ddp":
        model = nn.parallel.DistributedDataParallel(model)
    else:
        from torch.distributed.fsdp import fully_shard
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)  # each layer's parameters sharded over the ranks
        fully_shard(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)

    for step, (x, y) in enumerate(batches(rank, args.steps), 1):
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        if step % 20 == 0 or step == 1:
            mean = loss.detach().clone()
            dist.all_reduce(mean, op=dist.ReduceOp.AVG)
            if rank == 0:
                print(f"step {step:3d}  loss {mean.item():.3f}  ({args.wrap} on "
                      f"{dist.get_backend()}, {dist.get_world_size()} ranks)", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
