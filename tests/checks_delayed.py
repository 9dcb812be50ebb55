"""Per-rank bodies of test_delayed.py: delayed against allreduce on the embedded shapes."""
import torch
from torch import nn

import collectives
from collectives import sync
from trainer.tasks.image_data import make_shapes
from checks_sync import step_once


def small_resnet_like():
    """A small convolutional network with BatchNorm, as the trainer's ResNets have
    (BatchNorm makes a network sharp early on, where a stale gradient overshoots)."""
    def block(inputs, outputs):
        return [nn.Conv2d(inputs, outputs, 3, padding=1, bias=False), nn.BatchNorm2d(outputs),
                nn.ReLU()]
    return nn.Sequential(*block(1, 16), nn.MaxPool2d(2), *block(16, 32), nn.MaxPool2d(2),
                         *block(32, 64), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(64, 10))


def shapes_accuracy(comm, name, options=None, steps=48, seed=0, images=2048, batch=32,
                    lr=0.05, momentum=0.9):
    """Train on this rank's shard of the embedded shapes with the trainer's optimizer
    (SGD, lr 0.05, momentum 0.9, weight decay 1e-4, cosine decay over the steps, batches
    of 32 per rank); return the test accuracy of rank 0's model."""
    train = make_shapes(images, seed=1000 + seed)
    test = make_shapes(512, seed=2000 + seed)
    torch.manual_seed(seed)
    strategy = sync.create(name, algorithm="ring", **(options or {}))
    model = collectives.DistributedDataParallel(small_resnet_like(), sync=strategy,
                                                moments="loop", comm=comm)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum,
                                weight_decay=1e-4)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, steps)
    images, labels = train.tensors
    mine = torch.arange(comm.rank, len(images), comm.world_size)
    generator = torch.Generator().manual_seed(seed)
    order = torch.cat([mine[torch.randperm(len(mine), generator=generator)]
                       for _ in range(steps * batch // len(mine) + 1)])
    model.train()
    for step in range(1, steps + 1):
        batch_indices = order[(step - 1) * batch:step * batch]
        step_once(model, strategy, optimizer, images[batch_indices], labels[batch_indices],
                  step, after_optimizer=lambda module, step: schedule.step())
    strategy.close()
    model.module.eval()
    with torch.no_grad():
        predicted = model.module(test.tensors[0]).argmax(1)
    return (predicted == test.tensors[1]).float().mean().item()


def delayed_against_allreduce(comm, runs, lr=0.05, seed=0):
    """{label: accuracy} for {label: (strategy name, options)}, each trained alike."""
    return {label: shapes_accuracy(comm, name, options, lr=lr, seed=seed)
            for label, (name, options) in runs.items()}
