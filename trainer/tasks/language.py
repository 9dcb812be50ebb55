"""Language modelling: a byte-level GPT (gpt.py) on text every machine has (text.py),
trained to predict the next byte and scored by held-out bits per byte.

    mpirun -np 4 python -m trainer --model gpt-tiny              # the standard library
    mpirun -np 4 python -m trainer --model gpt-small --dataset text --data-dir MY_TEXT

Language models train in steps, not epochs: --steps optimizer steps, with a held-out
evaluation every --eval-every steps (each such stretch is what the loop calls an
epoch), --stop-at a held-out bits per byte. Defaults, as the papers that study
low-communication training use (DiLoCo, DeMo, SparseLoCo): AdamW (betas 0.9, 0.95,
weight decay 0.1) at lr 3e-3, a linear warm-up over the first 5 % of the steps then
cosine decay, gradients clipped to norm 1, 16 windows of the model's context per rank
per step.

The score: the mean cross-entropy over every byte of the held-out windows, in bits per
byte (8 is a uniform guess over the 256 byte values), and its perplexity per byte.
"""
from __future__ import annotations

import argparse
import math
from typing import Dict

import torch
import torch.nn.functional as F

from . import Task, text
from .gpt import SIZES, build_gpt, hidden_matrices
from .scoring import summed_over_test_split

DEFAULTS = dict(dataset="stdlib", optimizer="adamw", lr=3e-3, weight_decay=0.1,
                batch_size=16, clip_grad=1.0, steps=1000, eval_every=100, test_samples=256)
WARMUP_SHARE = 0.05  # of --steps, where --warmup-steps is not given


class LanguageModelling(Task):
    kind = "language"
    score_key, score_name = "test_bpb", "held-out bits per byte"
    units, throughput_key = "tok", "tokens_per_s"

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.config = SIZES[args.arch]
        self.units_per_sample = self.config.context
        self.text = text.read_text(args.dataset, args.data_dir)
        self.train_set = text.TrainingWindows(self.text.train, self.config.context)
        self.test_set = text.HeldOutWindows(self.text.test, self.config.context,
                                            args.test_samples, seed=args.seed)

    def first_line(self) -> str:
        """(After build_model, whose parameters it counts: building another here would
        draw from the seeded generator a resumed run has restored.)"""
        count = self.parameter_count
        trained, held = self.text.files
        return (f"{self.args.arch} ({count / 1e6:.2f} M parameters, context "
                f"{self.config.context}) on {self.text.source}: {len(self.text.train):,} "
                f"bytes in {trained} files to train on, {len(self.text.test):,} in {held} "
                f"held out ({len(self.test_set)} windows scored)")

    def build_model(self) -> torch.nn.Module:
        model = build_gpt(self.args.arch)
        self.parameter_count = sum(p.numel() for p in model.parameters())
        return model

    def hidden_matrices(self, model: torch.nn.Module) -> list:
        return hidden_matrices(model)

    def sampler(self, comm, seed: int, per_rank: int):
        """`per_rank` random windows for this rank each epoch (text.WindowSampler)."""
        return text.WindowSampler(len(self.train_set), per_rank, comm.rank, comm.world_size,
                                  seed)

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The mean cross-entropy of every position's next-byte prediction, in nats."""
        return F.cross_entropy(outputs.reshape(-1, outputs.shape[-1]), targets.reshape(-1))

    def evaluate(self, model, comm, device, batch_size: int, amp: str) -> Dict[str, float]:
        """Held-out loss per byte: nats, bits, and perplexity."""
        def totals(logits, targets):  # summed loss, bytes
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                   reduction="sum")
            return torch.stack([loss.double(),
                                torch.tensor(float(targets.numel()), dtype=torch.float64)])
        loss, count = summed_over_test_split(model, self.test_set, comm, device, batch_size,
                                             amp, totals, 2).tolist()
        nats = loss / max(count, 1)
        return {"test_loss": nats, "test_bpb": text.bits_per_byte(nats),
                "test_ppl": math.exp(nats)}

    def reached(self, score: float, target: float) -> bool:
        return score <= target

    def figures_text(self, record: dict) -> str:
        return f"held-out {record['test_bpb']:.3f} bits/byte (ppl {record['test_ppl']:.2f})"

    def score_text(self, score: float) -> str:
        return f"{self.score_name} {score:.3f}"


def fill_defaults(args: argparse.Namespace) -> None:
    """The language model's defaults where a flag was not given, and its epochs: the
    stretches of --eval-every steps in --steps."""
    for key, value in DEFAULTS.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    if args.warmup_steps is None:
        args.warmup_steps = int(WARMUP_SHARE * args.steps)
    args.epochs = -(-args.steps // args.eval_every)
