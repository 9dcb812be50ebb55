"""Per-rank runs of the trainer itself, in process (run on spawned gloo ranks by
test_trainer.py).

A trainer run is a whole program: parse the flags, connect, train, save, disconnect.
Started as its own job it pays torch's import and a rendezvous every time (seconds on
a small machine); here the ranks of one spawned world run several trainer runs one
after another on the communicator they already have, with a tiny network in place of
the ResNet. Everything else is the trainer's own code, flags and checkpoint files.
"""
import contextlib
import os
import shutil

from torch import nn

import collectives
import trainer.loop.train as train


def tiny_model(arch, channels, num_classes, image_size):
    """Two convolutions with BatchNorm (whose running statistics are buffers, which
    local SGD averages and DDP broadcasts) and a linear head: about 1.8k parameters."""
    return nn.Sequential(
        nn.Conv2d(channels, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
        nn.Conv2d(8, 16, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, num_classes))


@contextlib.contextmanager
def trainer_on(comm, keep_every_epoch=False):
    """train.train() runs on `comm` (it neither connects nor disconnects) and builds
    tiny_model; keep_every_epoch: rank 0 also copies each epoch's checkpoint to
    epoch<N>.pt beside it, so that one run leaves the checkpoint of every epoch."""
    saved = train.connect, train.build_model, train.save_checkpoint, collectives.destroy

    def save_and_keep(run, epoch, *rest):
        saved[2](run, epoch, *rest)
        if keep_every_epoch and run.comm.rank == 0:
            folder = run.args.checkpoint_dir
            shutil.copy(os.path.join(folder, "checkpoint.pt"),
                        os.path.join(folder, f"epoch{epoch}.pt"))

    train.connect, train.build_model = (lambda args: comm), tiny_model
    train.save_checkpoint, collectives.destroy = save_and_keep, (lambda: None)
    try:
        yield
    finally:
        train.connect, train.build_model, train.save_checkpoint, collectives.destroy = saved


def straight_and_resumed(comm, folder, flags, epochs):
    """Two runs of `epochs` epochs with the same flags: one straight through, keeping
    every epoch's checkpoint (in folder/straight), and one resumed from the straight
    run's first checkpoint (writing folder/resumed), as a run killed in epoch 2 and
    started again with --resume would be. The caller compares the last checkpoints."""
    common = [*flags, "--epochs", str(epochs)]
    with trainer_on(comm, keep_every_epoch=True):
        train.train([*common, "--checkpoint-dir", os.path.join(folder, "straight")])
    comm.barrier()  # rank 0 has written epoch1.pt
    with trainer_on(comm):
        train.train([*common, "--checkpoint-dir", os.path.join(folder, "resumed"),
                     "--resume", os.path.join(folder, "straight", "epoch1.pt")])
    return "ok"
