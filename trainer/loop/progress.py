"""The epoch's progress on rank 0: a bar on a terminal, plain lines in a log file.

tqdm redraws its bar in place: each update starts with a carriage return. On a terminal
that is one line that moves; in a file (a Slurm batch job's output, `mpirun ... > log`)
the updates pile up on one endless line. Where the output is a file, each update is
written as a line of its own instead, at most every LINES_EVERY seconds, and the
epoch's last one stays.

    --progress auto   (default) lines in a Slurm batch job (sbatch sets
                      ENVIRONMENT=BATCH) or when stderr is a file; else the bar: a pipe
                      is usually a launcher passing the output on to a terminal
    --progress bar | lines | off

A rank cannot see past its launcher's pipe: `mpirun ... > log` reaches rank 0 as a
pipe, so that case needs `--progress lines`.
"""
from __future__ import annotations

import io
import os
import stat
import sys
from typing import Iterable, Optional

from tqdm import tqdm

MODES = ("auto", "bar", "lines", "off")
BAR_EVERY = 1.0     # seconds between redraws of the bar
LINES_EVERY = 30.0  # seconds between lines in a log


class _OneLinePerUpdate(io.TextIOBase):
    """A stream for tqdm that writes each redraw as a line of its own."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, text: str) -> int:
        line = text.replace("\r", "").strip()  # tqdm's redraw and its erasing spaces
        if line:
            self.stream.write(line + "\n")
            self.stream.flush()
        return len(text)

    def flush(self) -> None:
        self.stream.flush()


def _writes_to_a_file(stream) -> bool:
    try:
        return stat.S_ISREG(os.fstat(stream.fileno()).st_mode)
    except (OSError, ValueError, io.UnsupportedOperation):
        return False


def chosen_mode(mode: str, stream=None, env=None) -> str:
    """What --progress `mode` means here: "bar", "lines" or "off"."""
    if mode != "auto":
        return mode
    stream = sys.stderr if stream is None else stream
    env = os.environ if env is None else env
    if env.get("ENVIRONMENT") == "BATCH" or _writes_to_a_file(stream):
        return "lines"
    return "bar"


def progress(batches: Iterable, description: str, total: int, mode: str,
             show: bool, stream=None) -> tqdm:
    """`batches` wrapped in tqdm as `mode` says; `show` False (ranks other than 0) or
    mode "off": no output at all."""
    stream = sys.stderr if stream is None else stream
    mode = chosen_mode(mode, stream)
    if mode == "lines":
        return tqdm(batches, desc=description, total=total, disable=not show,
                    file=_OneLinePerUpdate(stream), mininterval=LINES_EVERY, ncols=100,
                    leave=True)
    return tqdm(batches, desc=description, total=total, disable=not show or mode == "off",
                file=stream, mininterval=BAR_EVERY, dynamic_ncols=True, leave=False)
