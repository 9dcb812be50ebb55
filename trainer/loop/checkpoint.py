"""Checkpoints that survive a crash at any moment.

A checkpoint is written to a temporary file in the same folder, flushed to disk
(fsync), then renamed over the old one. A rename within one filesystem is atomic: a
crash leaves either the old checkpoint or the new one, never half of one. The folder
is fsynced too, so the rename itself survives a power loss.

It holds everything needed to continue exactly where training stopped: model,
optimizer, gradient scaler, the epoch, and every random number generator's state.
"""
from __future__ import annotations

import os
import random
import tempfile
from typing import Any, Dict

import numpy as np
import torch


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


def save_atomically(state: Dict[str, Any], path: str) -> None:
    """torch.save `state` to `path` so that a crash never leaves a broken file there."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    handle, temporary = tempfile.mkstemp(prefix=".tmp-", suffix=".pt", dir=folder)
    try:
        with os.fdopen(handle, "wb") as out:
            torch.save(state, out)
            out.flush()
            os.fsync(out.fileno())
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


def load(path: str) -> Dict[str, Any]:
    return torch.load(path, map_location="cpu", weights_only=False)
