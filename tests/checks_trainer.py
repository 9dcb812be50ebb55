"""Per-rank runs of the trainer itself, in process (run on spawned gloo ranks by
test_trainer.py).

A trainer run is a whole program: parse the flags, connect, train, save, disconnect.
Started as its own job it pays torch's import and a rendezvous every time (seconds on
a small machine); here the ranks of one spawned world run several trainer runs one
after another on the communicator they already have (`connect` returns it, and
`collectives.destroy` leaves it open for the next run). Everything else is the
trainer's own code, flags and checkpoint files; where a check needs to see inside a
run, spies wrap some of its steps: they record, and change nothing.
"""
import contextlib
import io
import json
import os
import shutil
from unittest import mock

import torch
from torch import nn

import collectives
from trainer.loop import train
from trainer.tasks.images import ImageClassification


def tiny_model(arch, channels, num_classes, image_size):
    """Two convolutions with BatchNorm (whose running statistics are buffers, which
    local SGD averages and DDP broadcasts) and a linear head: about 1.8k parameters."""
    return nn.Sequential(
        nn.Conv2d(channels, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
        nn.Conv2d(8, 16, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, num_classes))


def image_models_made_by(make):
    """The image task's build_model, making `make(arch, channels, classes, size)`."""
    def build_model(task):
        split = task.split
        return make(task.args.arch, split.channels, split.num_classes, split.image_size)
    return build_model


@contextlib.contextmanager
def trainer_on(comm, keep_every_epoch=False, image_model=tiny_model):
    """train.train() runs on `comm` (it neither connects nor disconnects) and builds
    `image_model` for images (None: the trainer's own --arch; a language model is the
    trainer's own); keep_every_epoch: rank 0 also copies each epoch's checkpoint to
    epoch<N>.pt beside it, so that one run leaves the checkpoint of every epoch."""
    saved = (train.connect, ImageClassification.build_model, train.save_checkpoint,
             collectives.destroy)

    def save_and_keep(run, epoch, *rest):
        saved[2](run, epoch, *rest)
        if keep_every_epoch and run.comm.rank == 0:
            folder = run.args.checkpoint_dir
            shutil.copy(os.path.join(folder, "checkpoint.pt"),
                        os.path.join(folder, f"epoch{epoch}.pt"))

    train.connect = lambda args: comm
    if image_model is not None:
        ImageClassification.build_model = image_models_made_by(image_model)
    train.save_checkpoint, collectives.destroy = save_and_keep, (lambda: None)
    try:
        yield
    finally:
        (train.connect, ImageClassification.build_model, train.save_checkpoint,
         collectives.destroy) = saved


def straight_and_resumed(comm, folder, flags, epochs):
    """Two runs of `epochs` epochs with the same flags: one straight through, keeping
    every epoch's checkpoint (in folder/straight), and one resumed from the straight
    run's first checkpoint (writing folder/resumed), as a run killed in epoch 2 and
    started again with --resume would be (epochs None: the flags say how long, as a
    language model's --steps do). The caller compares the last checkpoints."""
    common = [*flags, *(["--epochs", str(epochs)] if epochs else [])]  # text: --steps
    with trainer_on(comm, keep_every_epoch=True):
        train.train([*common, "--checkpoint-dir", os.path.join(folder, "straight")])
    comm.barrier()  # rank 0 has written epoch1.pt
    with trainer_on(comm):
        train.train([*common, "--checkpoint-dir", os.path.join(folder, "resumed"),
                     "--resume", os.path.join(folder, "straight", "epoch1.pt")])
    return "ok"


def case_folder(name: str) -> str:
    """The folder of case `name` (a sync and its options, say "topk --amp fp16")."""
    return name.replace(" ", "_")


def resumed_runs(comm, folder, cases):
    """straight_and_resumed (2 epochs) for each (name, flags) of `cases`, one after
    another in this world; folder/case_folder(name)/ holds each case's checkpoints. A
    case that fails is named in the error."""
    for name, flags in cases:
        try:
            straight_and_resumed(comm, os.path.join(folder, case_folder(name)), flags, 2)
        except Exception as error:
            raise RuntimeError(f"case {name!r} failed on rank {comm.rank}") from error
        comm.barrier()
    return "ok"


def copy_state(model: torch.nn.Module) -> dict:
    """The model's parameters and buffers, cloned: what it holds now."""
    return {name: value.clone() for name, value in model.state_dict().items()}


def same_state(a: dict, b: dict) -> bool:
    """True when two states hold bitwise the same tensors."""
    return a.keys() == b.keys() and all(torch.equal(a[name], b[name]) for name in a)


def train_then_eval_only(comm, flags, folder):
    """Train one epoch of tiny_model with `flags` (checkpoint and metrics in `folder`),
    then run `--eval-only` on its checkpoint. Returns, on every rank:

        scores     (accuracy, loss) of each call of evaluate: the epoch's, then
                   --eval-only's
        untouched  whether this rank's replica after the epoch's evaluation (as the
                   epoch's record is made) is bitwise the replica its training left
        printed    what rank 0 printed (empty on the other ranks)

    and saves this rank's replica, as training left it, to folder/rank<R>.pt.
    """
    scores, trained, untouched = [], {}, []
    real_train_one_epoch, real_evaluate = train.train_one_epoch, ImageClassification.evaluate
    real_summarise_epoch = train.summarise_epoch

    def train_one_epoch(run, epoch):
        result = real_train_one_epoch(run, epoch)
        trained[epoch] = copy_state(run.model)
        torch.save(trained[epoch], os.path.join(folder, f"rank{comm.rank}.pt"))
        return result

    def evaluate(*args, **kwargs):
        figures = real_evaluate(*args, **kwargs)
        scores.append((figures["test_acc"], figures["test_loss"]))
        return figures

    def summarise_epoch(run, epoch, *args, **kwargs):
        untouched.append(same_state(copy_state(run.model), trained[epoch]))
        return real_summarise_epoch(run, epoch, *args, **kwargs)

    checkpoint = os.path.join(folder, "ckpt", "checkpoint.pt")
    printed = io.StringIO()
    with mock.patch.object(train, "connect", lambda args: comm), \
            mock.patch.object(ImageClassification, "build_model",
                              image_models_made_by(tiny_model)), \
            mock.patch.object(collectives, "destroy", lambda: None), \
            mock.patch.object(train, "train_one_epoch", train_one_epoch), \
            mock.patch.object(ImageClassification, "evaluate", evaluate), \
            mock.patch.object(train, "summarise_epoch", summarise_epoch), \
            contextlib.redirect_stdout(printed):
        train.train([*flags, "--epochs", "1", "--checkpoint-dir", os.path.dirname(checkpoint)])
        train.train([*flags, "--resume", checkpoint, "--eval-only"])
    return {"scores": scores, "untouched": untouched, "printed": printed.getvalue()}


def epoch_records(comm, folder, flags):
    """One run with `flags` that writes its --metrics to folder/metrics.jsonl; returns
    the epochs' records (on rank 0; [] elsewhere)."""
    path = os.path.join(folder, "metrics.jsonl")
    with trainer_on(comm):
        train.train([*flags, "--metrics", path])
    if comm.rank != 0:
        return []
    with open(path) as lines:
        return [json.loads(line) for line in lines]


def extended_by_resume(comm, folder, flags):
    """A run of 2 epochs straight (folder/straight), and one of 1 epoch (folder/split)
    resumed with --epochs 2: a finished run extended. The caller compares the last
    checkpoints."""
    with trainer_on(comm):
        train.train([*flags, "--epochs", "2", "--checkpoint-dir",
                     os.path.join(folder, "straight")])
        split = os.path.join(folder, "split")
        train.train([*flags, "--epochs", "1", "--checkpoint-dir", split])
        comm.barrier()  # rank 0 has written the checkpoint
        train.train([*flags, "--epochs", "2", "--checkpoint-dir", split,
                     "--resume", os.path.join(split, "checkpoint.pt")])
    return "ok"


def printed_by_runs(comm, folder, runs, image_model=tiny_model):
    """Trainer runs one after another in `folder` (each a list of flags), on `comm` with
    `image_model` (None: the trainer's own); returns, per run, what rank 0 printed and
    how it ended: the exit code argparse's kind of error gives (2), or 0, and its
    stderr."""
    os.chdir(folder)
    outcomes = []
    for flags in runs:
        printed, errors, code = io.StringIO(), io.StringIO(), 0
        with trainer_on(comm, image_model=image_model), contextlib.redirect_stdout(printed), \
                contextlib.redirect_stderr(errors):
            try:
                train.train(flags)
            except SystemExit as exited:
                code = exited.code
        outcomes.append({"stdout": printed.getvalue(), "stderr": errors.getvalue(),
                         "code": code})
        comm.barrier()  # rank 0 has written what the next run reads
    return outcomes


def overflowing_first_backward(comm, folder, flags):
    """A run whose first backward overflows as fp16 would: the gradient of the model's
    output replaced by inf on that step only (GradScaler must skip it and halve its
    scale)."""
    def model_whose_first_backward_overflows(*args):
        model = tiny_model(*args)

        def overflow_once(module, inputs, output):
            handle.remove()
            output.register_hook(lambda grad: torch.full_like(grad, float("inf")))

        handle = model.register_forward_hook(overflow_once)
        return model

    os.chdir(folder)
    with trainer_on(comm, image_model=model_whose_first_backward_overflows):
        train.train(flags)
    return "ok"
