"""What an elastic loop must not lose, and the loop that survives losing a rank.

    world = ElasticWorld(store_host, store_port, min_ranks=2)
    state = State(model, optimizer, epoch=1, done=0)    # done: images of the epoch trained

    def train(state, world):                # runs again after every change of members
        comm = world.comm                   # the rest of the epoch, over this generation:
        sampler = ElasticSampler(len(dataset), comm.rank, comm.world_size, 32,
                                 state.epoch, state.done)
        for images, labels in DataLoader(dataset, sampler=sampler, batch_size=32):
            ... forward, backward, all-reduce on world.comm, optimizer step ...
            state.done += 32 * world.comm.world_size
            state.commit()                  # a consistent point: every rank has the step
        ...

    run(train, state, world, expected=4)

A commit keeps, in memory, a copy of everything `State` holds: the model's and the
optimizer's state_dicts and the loop's own counters. When a peer fails, every survivor's
call raises PeerError; `run` then puts the last commit back, joins the next generation
(the survivors), and gives every member the commit of the member that got furthest
(the most commits; of those, the lowest rank), so that all continue from the same
step, even where one survivor had committed a step that another had not finished, and
a newcomer never overwrites the job with its fresh state.
A newcomer joins at the next commit: `commit()` asks whether one waits (one small
broadcast), and if so every member leaves the loop (MembersChanged) for `run` to take
the newcomer in and hand it the state.

Where a strategy's replicas agree only now and then (local SGD, DiLoCo), commit at the
averaging points: a commit between them would hold each rank's own drift.
"""
from __future__ import annotations

import copy
import hashlib
import io
import pickle
import secrets
import sys
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np
import torch

from .. import api
from ..transport import PeerError
from .generations import ElasticWorld
from .membership import JobFinished, MembershipError


class MembersChanged(Exception):
    """Raised by State.commit() on every member alike: newcomers wait to join."""


class State:
    """The model, the optimizer and named counters of a training loop, with commits.

    Counters are plain attributes (`state.epoch`, `state.done`): whatever the loop needs
    to know where it is. Everything is restored and handed to newcomers together."""

    def __init__(self, model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer] = None,
                 **counters: Any):
        self.model, self.optimizer = model, optimizer
        self.counters = list(counters)
        for name, value in counters.items():
            setattr(self, name, value)
        self.world: Optional[ElasticWorld] = None
        self.commits = 0
        self._saved = self._snapshot()

    def _snapshot(self) -> Dict[str, Any]:
        return copy.deepcopy({
            "commits": self.commits,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict() if self.optimizer else None,
            "counters": {name: getattr(self, name) for name in self.counters}})

    def _load(self, saved: Dict[str, Any]) -> None:
        # Gradients are not state: those of a step that failed (this rank's own, never
        # reduced) would be added into the first step after it.
        for parameter in self.model.parameters():
            parameter.grad = None
        self.model.load_state_dict(saved["model"])
        if self.optimizer is not None:
            self.optimizer.load_state_dict(saved["optimizer"])
        for name, value in saved["counters"].items():
            setattr(self, name, value)
        self.commits = saved["commits"]
        self._saved = copy.deepcopy(saved)

    def state_dict(self) -> Dict[str, Any]:
        """A copy of the current state, as a commit keeps it: for a checkpoint."""
        return self._snapshot()

    def load_state_dict(self, saved: Dict[str, Any]) -> None:
        """Take `saved` (from state_dict()) as the current state and the last commit:
        resuming from a checkpoint."""
        self._load(saved)

    def commit(self) -> None:
        """Keep the current state as the one to return to. Collective: then, if newcomers
        wait, raise MembersChanged on every member (run() takes them in)."""
        self.commits += 1
        self._saved = self._snapshot()
        if self.world is not None and self.world.newcomers():
            raise MembersChanged()

    def restore(self) -> None:
        """Back to the last commit."""
        self._load(self._saved)

    def _buffer_names(self) -> List[str]:
        """The model's buffers in its state_dict (every alias; the non-persistent ones are
        not there), in a fixed order."""
        saved = self._saved["model"]
        return sorted({name for name, _ in self.model.named_buffers(remove_duplicate=False)
                       if name in saved})

    def furthest(self, comm) -> Tuple[int, bool]:
        """Collective: the rank whose last commit is furthest on (the most commits; of
        those, the lowest rank), and whether every member holds that very commit: the
        same count and the same digest of its parameters, optimizer state and counters
        (the survivors of a failure usually do). Buffers are left out: BatchNorm's
        running statistics are each rank's own between DDP's broadcasts of rank 0's.
        A newcomer has no commits."""
        commits, buffers = self._saved["commits"], self._buffer_names()
        digest = _digest({key: value for key, value in self._saved.items() if key != "model"},
                         {name: value for name, value in self._saved["model"].items()
                          if name not in buffers})
        extremes = torch.tensor([commits, -commits, digest, -digest], dtype=torch.int64)
        api.all_reduce(extremes, op="max", comm=comm)  # the most and (negated) the fewest
        most = int(extremes[0])
        alike = most == -int(extremes[1]) and int(extremes[2]) == -int(extremes[3])
        if alike:
            return 0, True
        rank = torch.tensor([comm.rank if commits == most else comm.world_size],
                            dtype=torch.int64)
        api.all_reduce(rank, op="min", comm=comm)
        return int(rank.item()), False

    def sync(self, comm, src: Optional[int] = None) -> None:
        """Collective: every member takes rank `src`'s last commit (model, optimizer,
        counters), as bytes of torch.save, broadcast over `comm`. `src` None: the
        furthest member's, and nothing is sent where every member holds it already."""
        if src is None:
            src, alike = self.furthest(comm)
            if alike:  # only the buffers differ: rank 0's, as DDP's forward would give
                api.broadcast_coalesced([self._saved["model"][name] for name in
                                         self._buffer_names()], src=0, comm=comm)
                self.restore()
                return
        payload = torch.zeros(1, dtype=torch.int64)
        if comm.rank == src:
            buffer = io.BytesIO()
            torch.save(self._saved, buffer)
            data = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)
            payload[0] = data.numel()
        api.broadcast(payload, src=src, comm=comm)
        if comm.rank != src:
            data = torch.empty(int(payload.item()), dtype=torch.uint8)
        api.broadcast(data, src=src, comm=comm)
        if comm.rank != src:
            saved = torch.load(io.BytesIO(data.numpy().tobytes()), weights_only=False)
            self._load(saved)
        else:
            self.restore()


def _digest(*values: Any) -> int:
    """63 bits of a BLAKE2 hash of `values`: nested dicts, lists and tuples of tensors
    and plain values, each fed with its type and size, so that two different states do
    not feed the same bytes (ResNet-18's 45 MB: ~0.1 s). A value it cannot read makes a
    random digest: unlike every other member's, so the state is sent."""
    hasher = hashlib.blake2b(digest_size=8)

    def feed(value: Any) -> None:
        hasher.update(type(value).__name__.encode() + b"\0")
        if isinstance(value, torch.Tensor):
            tensor = value.detach().cpu()
            if tensor.is_quantized:
                tensor = tensor.dequantize()
            if tensor.layout != torch.strided:
                tensor = tensor.to_dense()
            tensor = tensor.resolve_conj().resolve_neg().contiguous()
            hasher.update(f"{tensor.dtype}{tuple(tensor.shape)}\0".encode())
            hasher.update(tensor.reshape(-1).view(torch.uint8).numpy())
        elif isinstance(value, dict):
            hasher.update(f"{len(value)}\0".encode())
            for key in sorted(value, key=repr):
                feed(key)
                feed(value[key])
        elif isinstance(value, (list, tuple)):
            hasher.update(f"{len(value)}\0".encode())
            for item in value:
                feed(item)
        elif isinstance(value, (np.ndarray, np.generic)):
            array = np.ascontiguousarray(value)
            hasher.update(f"{array.dtype}{array.shape}\0".encode())
            hasher.update(array.tobytes())
        elif value is None or isinstance(value, (bool, int, float, complex, str, bytes)):
            hasher.update(repr(value).encode() + b"\0")  # exact for these
        else:  # anything else: its pickle (a value that cannot be pickled: sent, below)
            hasher.update(pickle.dumps(value, protocol=4))

    try:
        feed(values)
    except Exception:  # sparse, meta, ...: not worth a crash; the state is sent instead
        return secrets.randbits(63)
    return int.from_bytes(hasher.digest(), "little") >> 1  # an int64 that max/min can take


def run(train: Callable[[State, ElasticWorld], Any], state: State, world: ElasticWorld,
        expected: Optional[int] = None, attempts: int = 5) -> Any:
    """Call train(state, world) until it returns; after a failed peer or when newcomers
    wait, go on in the next generation from the last commit (see the module docstring).
    Returns what train returned; None on a member whose last step failed while the
    others finished the job. MembershipError (too few members, the store lost) ends it,
    and so does the same PeerError `attempts` generations in a row with no commit
    between them (a fault of this host, not a peer's)."""
    state.world = world
    if state.commits == 0:  # what the caller loaded into the model since State(...)
        state._saved = state._snapshot()
    failures, member = 0, False
    while True:
        commits_before = state.commits
        try:  # the next generation: join, take the furthest commit, train
            world.join(expected)
            member = True  # of the job, from here (a resumed state has commits already)
            state.sync(world.comm)  # a newcomer takes the job's state
            result = train(state, world)
            world.finish()  # those who come later are told, not left to train alone
            return result
        except PeerError as error:  # a member failed (perhaps while the generation formed)
            world.drop(failed=True)  # the members still waiting on us learn it now
            failures = 0 if state.commits > commits_before else failures + 1
            # the generation joined (its communicator may have failed as it was built);
            # the error names ranks of it: say who they were
            view = world.membership.view
            generation = view.generation if view else "-"
            ranks = ", ".join(f"{rank} {member}" for rank, member
                              in enumerate(view.members)) if view else "-"
            print(f"collectives.elastic: {world.membership.me}: generation {generation}: "
                  f"{str(error).splitlines()[0]}; forming the next (its ranks: {ranks})",
                  file=sys.stderr, flush=True)
            if failures >= attempts:
                raise
            state.restore()
        except MembersChanged:
            pass
        except JobFinished:
            if not member:  # a newcomer that came too late
                raise
            return None  # our last step failed, and the others ended the job
        expected = None  # only the first generation waits for the launcher's count


__all__ = ["State", "run", "MembersChanged", "MembershipError"]
