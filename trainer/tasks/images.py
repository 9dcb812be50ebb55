"""Image classification: a torchvision ResNet (resnets.py) on images (image_data.py),
trained with cross-entropy and scored by test accuracy.

The trainer's main job, and its defaults: ResNet-18 on drawn shapes (no files), SGD with
momentum 0.9 at lr 0.05, weight decay 1e-4, 32 images per rank per step, 3 epochs.
"""
from __future__ import annotations

import argparse
from typing import Dict

import torch
import torch.nn.functional as F
from torch.utils.data.distributed import DistributedSampler

from . import Task, image_data
from .resnets import build_model
from .scoring import summed_over_test_split

DEFAULTS = dict(dataset="shapes", optimizer="sgd", lr=0.05, weight_decay=1e-4,
                batch_size=32, warmup_steps=0, clip_grad=0.0)


class ImageClassification(Task):
    kind = "images"
    score_key, score_name = "test_acc", "test accuracy"
    units, units_per_sample, throughput_key = "img", 1, "images_per_s"

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.split = image_data.load(args.dataset, args.data_dir, args.train_samples,
                                     args.test_samples)
        self.train_set, self.test_set = self.split.train, self.split.test

    def first_line(self) -> str:
        return f"{self.args.arch} on {self.args.dataset} ({len(self.train_set)} images)"

    def build_model(self) -> torch.nn.Module:
        split = self.split
        return build_model(self.args.arch, split.channels, split.num_classes, split.image_size)

    def sampler(self, comm, seed: int, per_rank: int):
        """Every rank's DistributedSampler has the same seed, so each epoch's shards are
        disjoint; an epoch is one pass over the training images (`per_rank` unused)."""
        return DistributedSampler(self.train_set, num_replicas=comm.world_size,
                                  rank=comm.rank, shuffle=True, seed=seed)

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(outputs, targets)

    def evaluate(self, model, comm, device, batch_size: int, amp: str) -> Dict[str, float]:
        """Test accuracy and mean loss over the whole test split."""
        def totals(logits, labels):  # correct, count, summed loss
            return torch.stack([(logits.argmax(1) == labels).sum().double(),
                                torch.tensor(float(labels.numel()), dtype=torch.float64),
                                F.cross_entropy(logits, labels, reduction="sum").double()])
        correct, count, loss = summed_over_test_split(model, self.test_set, comm, device,
                                                      batch_size, amp, totals, 3).tolist()
        return {"test_acc": correct / max(count, 1), "test_loss": loss / max(count, 1)}

    def reached(self, score: float, target: float) -> bool:
        return score >= target

    def figures_text(self, record: dict) -> str:
        return f"test acc {record['test_acc']:.2%}"

    def score_text(self, score: float) -> str:
        return f"{self.score_name} {score:.2%}"
