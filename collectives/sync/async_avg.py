"""`async-avg`: a background thread averages the models while training goes on.

Communicates: all parameters and floating-point buffers, in rounds that run on a
background thread (with its own communicator) as fast as the slowest rank's thread
allows, never blocking the training loop. At each optimizer step the training thread
only checks whether a round has finished. If so, it moves its model to the round's
average while keeping what it learned since the round started
(x <- x + (average - snapshot)), and starts the next round from a fresh snapshot. There
is no per-step barrier: a slower rank does not stall the others, it only contributes
to fewer rounds. Nor does it need the ranks to take the same number of steps: the
trainer lets a faster rank train more of each epoch (`uneven_steps`, --shards dynamic).

Stopping: every round carries a "still training" flag. A rank that finishes keeps
joining rounds (flag 0) until a round shows someone stopped; every rank then stops
after that same round, so none waits forever in a collective.

Checkpoint: nothing beyond each rank's own replica (the model the trainer saves for
every rank). A resumed run cannot continue bit for bit whatever is saved: which steps a
round spans depends on how fast each rank's thread happened to run, so even two
uninterrupted runs differ. Saving the round in flight would buy nothing: the next run
starts a fresh round at its first step, as a run does after any round.

Literature: asynchronous model averaging in the style of Zhang et al., "Deep Learning
with Elastic Averaging SGD" (NeurIPS 2015) and Lian et al., "Asynchronous
Decentralized Parallel SGD" (ICML 2018), which report near-synchronous accuracy with
better tolerance of stragglers.
"""
from __future__ import annotations

import torch

from .. import api
from ..bucketer import CommWorker
from .base import SyncStrategy, register
from .local_sgd import averaged_tensors
from .options import check_algorithm


@register("async-avg")
class AsyncAverage(SyncStrategy):
    uses_buckets = False
    forward_buffer_sync = False
    replicas_differ = True  # the model is the average of the replicas
    uneven_steps = True     # no collective at a set step: a fast rank may take more steps

    def __init__(self, algorithm: str = "auto"):
        check_algorithm(self.name, algorithm)
        self.algorithm = algorithm
        self.round = None      # (payload being summed, done event)
        self.snapshot = None   # what this rank contributed to the running round
        self.finished = False  # a round showed that some rank stopped
        self.rounds = 0

    def setup(self, model, comm) -> None:
        super().setup(model, comm)
        self.channel = comm.duplicate()  # the training thread keeps using comm
        self.worker = CommWorker(comm.device)

    def _start_round(self, model, still_training: bool) -> None:
        self.snapshot = torch.cat([t.reshape(-1) for t in averaged_tensors(model)])
        flag = torch.tensor([1.0 if still_training else 0.0], dtype=self.snapshot.dtype,
                            device=self.snapshot.device)
        payload = torch.cat([self.snapshot, flag])
        done = self.worker.submit(lambda: api.all_reduce(
            payload, op="sum", algorithm=self.algorithm, comm=self.channel, check=False),
            "averaging round")
        self.round = (payload, done)

    def _finish_round(self, model) -> bool:
        """Apply the finished round; True if every rank was still training."""
        payload, _ = self.round
        if self.worker.error is not None:
            raise self.worker.error
        n = self.comm.world_size
        average = payload[:-1] / n
        offset = 0
        for tensor in averaged_tensors(model):  # keep what was learned since the snapshot
            part = slice(offset, offset + tensor.numel())
            tensor.add_((average[part] - self.snapshot[part]).view_as(tensor))
            offset += tensor.numel()
        self.round = None
        self.rounds += 1
        return payload[-1].item() == n

    def after_step(self, model: torch.nn.Module, step: int) -> None:
        if self.finished or self.comm.world_size == 1:
            return
        if self.round is None:
            self._start_round(model, still_training=True)
        elif self.round[1].is_set():  # a round finished: apply it, start the next
            if self._finish_round(model):
                self._start_round(model, still_training=True)
            else:
                self.finished = True

    def settle(self) -> None:
        """Collective: finish the running round on every rank and apply it.

        Ranks may stand one round apart: a rank starts its next round at its first step
        after seeing the last one finish, which another rank may not have reached yet
        (never more than one apart, since a round finishes only when every rank has
        joined it). Waiting for one's own round alone could then wait forever for a rank
        that has gone on to the next collective. So the ranks first agree on the number
        of rounds started (the largest); a rank one behind finishes its round and
        starts the missing one; then each waits for its round and applies it."""
        if self.finished or self.comm.world_size == 1:
            return
        started = torch.tensor([self.rounds + (self.round is not None)], dtype=torch.int64)
        api.all_reduce(started, op="max", algorithm="auto", comm=self.comm, check=False)
        while self.rounds < started.item():
            if self.round is None:
                self._start_round(self.model, still_training=True)
            self.round[1].wait()
            if not self._finish_round(self.model):  # cannot happen before close()
                self.finished = True
                return

    def close(self) -> None:
        model = self.model
        while self.round is not None:
            self.round[1].wait()
            if not self._finish_round(model):
                break
            self._start_round(model, still_training=False)
        self.finished = True
        self.worker.stop()
