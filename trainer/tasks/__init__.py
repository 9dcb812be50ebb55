"""What the trainer learns: a task is the model, the data, the loss, the score and the
optimizer's defaults. The loop (trainer/loop/) knows none of them; it asks the task.

    images.py      image classification: torchvision ResNets on drawn shapes (embedded),
                   MNIST, CIFAR-10 or an image folder; scored by test accuracy; SGD
    language.py    language modelling: a byte-level GPT (gpt.py) on the standard
                   library's sources or your text (text.py); scored by held-out bits
                   per byte; AdamW
    resnets.py, image_data.py, gpt.py, text.py   their models and data
    optimizers.py  sgd, adamw, muon (Muon on hidden matrices, AdamW on the rest), and
                   the learning rate's warm-up and cosine decay

The task follows from --model: a ResNet name is image classification, a gpt-* name
language modelling. What the loop asks of a task (Task below):

    first_line()                       what trains on what, for the run's first line
    build_model()                      the model, from the seeded generator
    train_set, test_set                the data
    sampler(comm, seed, per_rank)      this rank's training samples, set_epoch()-able
    loss(outputs, targets)             the training loss, a mean
    evaluate(model, comm, ...)         held-out figures, the whole split's, as a dict
    score_key, reached(score, target)  the headline figure, and --stop-at's test
    figures_text(record), score_text   the epoch line's figures, the last line's
    hidden_matrices(model)             what --optimizer muon steps with Muon
    units_per_sample                   what throughput counts: 1 image, or context bytes
"""
from __future__ import annotations

import argparse
from typing import Dict, List

import torch

from .gpt import SIZES as GPT_SIZES
from .resnets import ARCHITECTURES

MODELS: List[str] = ARCHITECTURES + list(GPT_SIZES)
IMAGE_DATASETS = ["shapes", "mnist", "cifar10", "imagefolder"]
TEXT_DATASETS = ["stdlib", "text"]


def kind_of(model: str) -> str:
    """"language" for a gpt-* model, else "images"."""
    return "language" if model in GPT_SIZES else "images"


class Task:
    """What the loop asks of a task (the module docstring lists it)."""
    kind: str
    score_key: str          # the headline figure in each epoch's record
    score_name: str         # the same, in words
    units: str              # what throughput counts ("img", "tok")
    units_per_sample: int   # how many of them one sample holds
    throughput_key: str     # the record's key for them per second

    def first_line(self) -> str:
        raise NotImplementedError

    def build_model(self) -> torch.nn.Module:
        raise NotImplementedError

    def hidden_matrices(self, model: torch.nn.Module) -> list:
        """The parameters --optimizer muon steps with Muon (none: it is refused)."""
        return []

    def sampler(self, comm, seed: int, per_rank: int):
        raise NotImplementedError

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def evaluate(self, model, comm, device, batch_size: int, amp: str) -> Dict[str, float]:
        raise NotImplementedError

    def reached(self, score: float, target: float) -> bool:
        raise NotImplementedError

    def figures_text(self, record: dict) -> str:
        raise NotImplementedError

    def score_text(self, score: float) -> str:
        raise NotImplementedError


def create(args: argparse.Namespace) -> Task:
    """The task of `args` (parse_args has filled its defaults), data read. Raises
    image_data.DatasetMissing or text.TextMissing, with the line to print."""
    if kind_of(args.arch) == "language":
        from .language import LanguageModelling
        return LanguageModelling(args)
    from .images import ImageClassification
    return ImageClassification(args)
