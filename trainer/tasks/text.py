"""Text for the language model: bytes every machine has, windows of them, and who reads which.

    stdlib   (default) the source files of the running interpreter's standard library,
             test suites left out: about 12 MB of Python with its docstrings, on every
             machine that runs us, no download. The same files (and so the same split)
             on every rank and every machine of one Python version.
    text     the user's own files: every file under --data-dir (recursively), read as
             bytes; a file that is not UTF-8 text trains as bytes all the same.

Byte level: the model reads and predicts bytes (256 symbols), so there is no tokenizer
to download and the loss in bits per byte compares across any text.

The split is by file, not by position, so held-out text is text the model never saw
in any window: a file is held out when a checksum of its path (relative to the root,
so the same on every machine) falls in the held-out twentieth. Checksums, not
Python's hash(), which is salted per process and would split differently on each rank.

    training windows  any byte offset of the training text: window i is bytes
                      [i, i + context] (inputs i.. i+context-1, each input's target
                      the byte after it); drawn at random offsets by WindowSampler
    held-out windows  consecutive, non-overlapping windows of the held-out text, a
                      seeded choice of --test-samples of them: the same set in every
                      evaluation, on every rank
"""
from __future__ import annotations

import math
import os
import sysconfig
import zlib
from dataclasses import dataclass
from typing import Iterator, List, Optional

import numpy as np
import torch
from torch.utils.data import Dataset, Sampler

HELD_OUT_OF = 20           # one file in 20 is held out
TEST_FOLDERS = {"test", "tests", "idle_test", "site-packages", "__pycache__"}


class TextMissing(Exception):
    """No text where the flags say. The message says what to do."""


def stdlib_files(root: Optional[str] = None) -> List[str]:
    """The standard library's .py files (paths relative to `root`), sorted, test suites
    and installed packages left out."""
    root = root or sysconfig.get_paths()["stdlib"]
    found = []
    for folder, subfolders, names in os.walk(root):
        subfolders[:] = sorted(s for s in subfolders if s not in TEST_FOLDERS)
        found += [os.path.relpath(os.path.join(folder, name), root)
                  for name in names if name.endswith(".py")]
    return sorted(found)


def all_files(root: str) -> List[str]:
    """Every file under `root` (relative paths, sorted), hidden ones left out."""
    found = []
    for folder, subfolders, names in os.walk(root):
        subfolders[:] = sorted(s for s in subfolders if not s.startswith("."))
        found += [os.path.relpath(os.path.join(folder, name), root)
                  for name in names if not name.startswith(".")]
    return sorted(found)


def held_out(path: str) -> bool:
    """Whether the file at relative `path` is held out: the same answer everywhere."""
    return zlib.crc32(path.replace(os.sep, "/").encode()) % HELD_OUT_OF == 0


@dataclass
class TextSplit:
    """The training and held-out text, each the concatenation of its files' bytes."""
    train: np.ndarray        # uint8
    test: np.ndarray         # uint8
    source: str              # where it came from, in words
    files: tuple             # (training files, held-out files)


def read_text(dataset: str, data_dir: Optional[str]) -> TextSplit:
    """The bytes of `dataset` ("stdlib" or "text" under `data_dir`), split by file."""
    if dataset == "stdlib":
        root = sysconfig.get_paths()["stdlib"]
        names = stdlib_files(root)
        source = f"the Python {'.'.join(map(str, __import__('sys').version_info[:2]))} " \
                 f"standard library ({root})"
    else:
        root = data_dir or ""
        if not os.path.isdir(root):
            raise TextMissing(f"--dataset text: no folder at {data_dir!r}; pass --data-dir "
                              "FOLDER holding your text files")
        names = all_files(root)
        source = root
    parts = {False: [], True: []}
    for name in names:
        with open(os.path.join(root, name), "rb") as f:
            parts[held_out(name)].append(f.read())
    counts = (len(parts[False]), len(parts[True]))
    if not parts[False] or not parts[True]:
        raise TextMissing(f"--dataset {dataset}: {source} has {len(names)} file(s); one in "
                          f"{HELD_OUT_OF} is held out, so it needs files for both sides "
                          f"(found {counts[0]} to train on and {counts[1]} held out)")
    join = lambda chunks: np.frombuffer(b"\n".join(chunks), dtype=np.uint8)
    return TextSplit(join(parts[False]), join(parts[True]), source, counts)


class TrainingWindows(Dataset):
    """Window i of the training text: (inputs, targets), `context` bytes each, targets
    one byte ahead. Every byte offset is a window; WindowSampler picks which."""

    def __init__(self, text: np.ndarray, context: int):
        if len(text) <= context:
            raise TextMissing(f"the training text has {len(text)} bytes: fewer than one "
                              f"window of {context + 1}")
        self.text, self.context = torch.from_numpy(text.copy()), context

    def __len__(self) -> int:
        return len(self.text) - self.context

    def __getitem__(self, offset: int):
        chunk = self.text[offset:offset + self.context + 1].long()
        return chunk[:-1], chunk[1:]


class HeldOutWindows(Dataset):
    """`count` non-overlapping windows of the held-out text, chosen by `seed` (all of
    them when there are fewer): the same ones at every evaluation and on every rank."""

    def __init__(self, text: np.ndarray, context: int, count: int, seed: int = 0):
        whole = (len(text) - 1) // context
        if whole < 1:
            raise TextMissing(f"the held-out text has {len(text)} bytes: fewer than one "
                              f"window of {context + 1}")
        chosen = torch.randperm(whole, generator=torch.Generator().manual_seed(seed))
        self.starts = (chosen[:count].sort().values * context).tolist()
        self.text, self.context = torch.from_numpy(text.copy()), context

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, index: int):
        start = self.starts[index]
        chunk = self.text[start:start + self.context + 1].long()
        return chunk[:-1], chunk[1:]


class WindowSampler(Sampler):
    """Random window offsets, dealt to the ranks like DistributedSampler deals images.

    Each epoch (here: the steps between two evaluations) draws `per_rank * world_size`
    offsets from a generator seeded by (seed, epoch), the same on every rank, and rank
    r takes every world_size-th from r: disjoint draws, nothing to communicate, and a
    resumed run draws the same windows again. Offsets are drawn with replacement, as
    nanoGPT draws its batches: 12 MB hold millions of windows, a run reads a few."""

    def __init__(self, windows: int, per_rank: int, rank: int, world_size: int, seed: int):
        self.windows, self.per_rank = windows, per_rank
        self.rank, self.world_size, self.seed = rank, world_size, seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.per_rank

    def __iter__(self) -> Iterator[int]:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        every = torch.randint(self.windows, (self.per_rank * self.world_size,),
                              generator=generator)
        return iter(every[self.rank::self.world_size].tolist())


def bits_per_byte(nats_per_byte: float) -> float:
    """A loss in nats per byte (what cross-entropy gives) in bits per byte: uniform
    guessing over 256 byte values is 8, and a perfect model 0."""
    return nats_per_byte / math.log(2)
