"""Checkpoints that survive a crash at any moment.

A checkpoint is written to a temporary file in the same folder, flushed to disk
(fsync), then renamed over the old one. A rename within one filesystem is atomic: a
crash leaves either the old checkpoint or the new one, never half of one. The folder
is fsynced too, so the rename itself survives a power loss.

A kill during a save leaves its temporary file behind (a process that is SIGKILLed
cleans nothing up). Temporaries are named after the checkpoint they become
(`.checkpoint.pt.tmp-XXXX`), so the next save of that checkpoint removes the ones it
finds, and nothing else: one writer per checkpoint file, as the trainer's rank 0 is.

It holds everything needed to continue exactly where training stopped, for every rank:
each rank's own model, optimizer, gradient scaler, sync strategy state and random
generators (the ranks' replicas and states differ under local SGD, gossip or error
feedback), with the epoch and step. Only rank 0 writes: the other ranks' states reach
it through the communicator (`gather_on_rank_0`).
"""
from __future__ import annotations

import io
import os
import random
import re
import tempfile
from typing import Any, Dict, List, Optional

import numpy as np
import torch

from collectives.api import gather_rows


def seed_everything(seed: int) -> None:
    """The same seed for torch, numpy and Python on every rank: the same initial weights."""
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)


def rng_state() -> Dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(),
             "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: Dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def gather_on_rank_0(comm, state: Any) -> Optional[List[Any]]:
    """Every rank's `state`, in rank order, on rank 0; None on the other ranks.

    Collective: every rank calls it. A state is any object torch.save can write (tensors
    on any device, numbers, dicts); it travels as its torch.save bytes in a uint8 tensor.
    One small all-reduce tells rank 0 every rank's byte count (gather_rows), then each
    other rank sends its bytes and rank 0 receives them, one rank after another:

        rank 0 <- rank 1's bytes, then rank 2's, ...       (rank 0's own stays as it is)

    Rank 0 holds every state at once, as the file it writes will.
    """
    if comm.world_size == 1:
        return [state]
    serialised = b""
    if comm.rank != 0:
        buffer = io.BytesIO()
        torch.save(state, buffer)
        serialised = buffer.getvalue()
    sizes = [row[0] for row in gather_rows(comm, [len(serialised)])]
    if comm.rank != 0:
        comm.send(torch.frombuffer(bytearray(serialised), dtype=torch.uint8), 0)
        return None
    states = [state]
    for peer in range(1, comm.world_size):
        received = torch.empty(sizes[peer], dtype=torch.uint8)
        comm.recv(received, peer)
        states.append(torch.load(io.BytesIO(received.numpy().tobytes()), map_location="cpu",
                                 weights_only=False))
    return states


def temporary_prefix(path: str) -> str:
    """How the temporary files of a save of `path` begin: `.NAME.tmp-`."""
    return f".{os.path.basename(path)}.tmp-"


def remove_stale_temporaries(path: str) -> List[str]:
    """Remove the temporary files an interrupted save of `path` left in its folder (only
    ours: temporary_prefix(path) and the 8 characters mkstemp adds); returns the names
    removed."""
    folder, prefix = os.path.dirname(os.path.abspath(path)), temporary_prefix(path)
    ours = re.compile(re.escape(prefix) + r"[a-z0-9_]{8}")
    removed = []
    for name in os.listdir(folder):
        if ours.fullmatch(name):
            try:
                os.unlink(os.path.join(folder, name))
                removed.append(name)
            except FileNotFoundError:
                pass
    return removed


def save_atomically(state: Dict[str, Any], path: str) -> None:
    """torch.save `state` to `path` so that a crash never leaves a broken file there;
    temporaries that an earlier, killed save of `path` left behind are removed first."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    remove_stale_temporaries(path)
    handle, temporary = tempfile.mkstemp(prefix=temporary_prefix(path), dir=folder)
    try:
        with os.fdopen(handle, "wb") as out:
            torch.save(state, out)
            out.flush()
            os.fsync(out.fileno())
        os.chmod(temporary, 0o666 & ~_umask())  # mkstemp's file is private (0600)
        os.replace(temporary, path)
    except BaseException:
        if os.path.exists(temporary):
            os.unlink(temporary)
        raise
    directory = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


def _umask() -> int:
    """The process's umask, as Linux reports it (os.umask can only read it by setting
    it, which would race with other threads creating files); 022 if unknown."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    return 0o022


def load(path: str) -> Dict[str, Any]:
    """A checkpoint as save_atomically wrote it, every tensor on the CPU."""
    return torch.load(path, map_location="cpu", weights_only=False)
