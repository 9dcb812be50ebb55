"""Per-rank checks of the trainer (run on spawned gloo ranks by test_trainer.py).

The trainer's own `train()` runs in each rank's process, on the world's communicator
(`connect` returns it, and `collectives.destroy` leaves it open for the next run), with
spies on three of its steps: they record, and change nothing.
"""
import contextlib
import io
import os
from unittest import mock

import torch

import collectives
from trainer.loop import train


def copy_state(model: torch.nn.Module) -> dict:
    """The model's parameters and buffers, cloned: what it holds now."""
    return {name: value.clone() for name, value in model.state_dict().items()}


def same_state(a: dict, b: dict) -> bool:
    """True when two states hold bitwise the same tensors."""
    return a.keys() == b.keys() and all(torch.equal(a[name], b[name]) for name in a)


def train_then_eval_only(comm, flags, folder):
    """Train one epoch with `flags` (checkpoint and metrics in `folder`), then run
    `--eval-only` on its checkpoint. Returns, on every rank:

        scores     (accuracy, loss) of each call of evaluate: the epoch's, then
                   --eval-only's
        untouched  whether this rank's replica after the epoch's evaluation (as the
                   epoch's record is made) is bitwise the replica its training left
        printed    what rank 0 printed (empty on the other ranks)

    and saves this rank's replica, as training left it, to folder/rank<R>.pt.
    """
    scores, trained, untouched = [], {}, []
    real_train_one_epoch, real_evaluate = train.train_one_epoch, train.evaluate
    real_summarise_epoch = train.summarise_epoch

    def train_one_epoch(run, epoch):
        result = real_train_one_epoch(run, epoch)
        trained[epoch] = copy_state(run.model)
        torch.save(trained[epoch], os.path.join(folder, f"rank{comm.rank}.pt"))
        return result

    def evaluate(*args, **kwargs):
        accuracy, loss = real_evaluate(*args, **kwargs)
        scores.append((accuracy, loss))
        return accuracy, loss

    def summarise_epoch(run, epoch, *args, **kwargs):
        untouched.append(same_state(copy_state(run.model), trained[epoch]))
        return real_summarise_epoch(run, epoch, *args, **kwargs)

    checkpoint = os.path.join(folder, "ckpt", "checkpoint.pt")
    printed = io.StringIO()
    with mock.patch.object(train, "connect", lambda args: comm), \
            mock.patch.object(collectives, "destroy", lambda: None), \
            mock.patch.object(train, "train_one_epoch", train_one_epoch), \
            mock.patch.object(train, "evaluate", evaluate), \
            mock.patch.object(train, "summarise_epoch", summarise_epoch), \
            contextlib.redirect_stdout(printed):
        train.train([*flags, "--epochs", "1", "--checkpoint-dir", os.path.dirname(checkpoint)])
        train.train([*flags, "--resume", checkpoint, "--eval-only"])
    return {"scores": scores, "untouched": untouched, "printed": printed.getvalue()}
