"""A torch DDP training script as the tutorials write it, runnable on either DDP.

    torchrun --nproc-per-node 2 examples/torch_ddp_script.py              # ours
    torchrun --nproc-per-node 2 examples/torch_ddp_script.py --face torch # torch's
    python -m torch.distributed.launch --nproc-per-node 2 examples/torch_ddp_script.py

The script makes its own process group (`dist.init_process_group`), shards the data
with DistributedSampler, wraps a torchvision ResNet in DistributedDataParallel and
trains. The only line that differs between the two runs is the import of
DistributedDataParallel: `collectives.DistributedDataParallel` adopts the process group
the script made (no `collectives.init()`), as a drop-in must.
"""
import argparse
import os

import torch
import torch.distributed as dist
import torchvision
from torch import nn, optim
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms

from collectives.launch import add_local_rank_argument


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--face", choices=["collectives", "torch"], default="collectives")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--save", help="rank 0 saves the trained state_dict here")
    add_local_rank_argument(parser)  # torch.distributed.launch passes --local-rank=N
    args = parser.parse_args()
    if args.face == "torch":
        from torch.nn.parallel import DistributedDataParallel as DDP
    else:
        from collectives import DistributedDataParallel as DDP

    dist.init_process_group(backend="gloo", init_method="env://")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10)
    ddp_model = DDP(model)

    # Synthetic images (torchvision's FakeData): nothing to download.
    dataset = torchvision.datasets.FakeData(size=64, image_size=(3, 32, 32), num_classes=10,
                                            transform=transforms.ToTensor())
    sampler = DistributedSampler(dataset, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=8, sampler=sampler)
    loss_fn = nn.CrossEntropyLoss()
    optimizer = optim.SGD(ddp_model.parameters(), lr=0.01, momentum=0.9)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for images, labels in loader:
            optimizer.zero_grad()
            loss = loss_fn(ddp_model(images), labels)
            loss.backward()
            optimizer.step()
        # the whole line in one write: the ranks share the terminal
        print(f"rank {rank} epoch {epoch} loss {loss.item():.4f}\n", end="", flush=True)

    if rank == 0 and args.save:
        torch.save(ddp_model.module.state_dict(), args.save)
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
