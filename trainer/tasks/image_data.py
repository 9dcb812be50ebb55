"""Datasets for the trainer: an embedded one that needs no files, and torchvision's.

    shapes       (default) 10 classes of shapes drawn on 28x28 grayscale canvases with
                 random position, size, stroke, brightness and noise. Generated from a
                 seed, so it needs no download and every rank sees the same data.
    mnist        torchvision.datasets.MNIST under --data-dir (MNIST/raw/...)
    cifar10      torchvision.datasets.CIFAR10 under --data-dir (cifar-10-batches-py/)
    imagefolder  torchvision.datasets.ImageFolder: --data-dir/train/<class>/*.png and
                 --data-dir/val/<class>/*.png

Nothing is downloaded: a missing dataset is one clear error saying where we looked.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
from torch.utils.data import Dataset, Subset, TensorDataset

SHAPE_NAMES = ["horizontal bar", "vertical bar", "diagonal /", "diagonal \\", "plus",
               "cross", "square outline", "filled square", "ring", "disk"]


class DatasetMissing(Exception):
    """The dataset's files are not where --data-dir says. The message says what to do."""


@dataclass
class DataSplit:
    train: Dataset
    test: Dataset
    channels: int
    image_size: int
    num_classes: int


def draw_shape(kind: int, rng: np.random.Generator, size: int = 28) -> np.ndarray:
    """One `size` x `size` float32 image in [0, 1] of shape class `kind` (0-9)."""
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32)
    half = rng.uniform(5.0, 10.0)                       # the shape's half extent
    stroke = rng.uniform(1.0, 2.2)                      # half the line width
    cx, cy = rng.uniform(half + 1, size - half - 1, size=2)
    dx, dy = xx - cx, yy - cy
    along, across = (dx + dy) / np.sqrt(2), (dx - dy) / np.sqrt(2)
    box, radius = np.maximum(np.abs(dx), np.abs(dy)), np.hypot(dx, dy)
    masks = [
        (np.abs(dy) < stroke) & (np.abs(dx) < half),
        (np.abs(dx) < stroke) & (np.abs(dy) < half),
        (np.abs(along) < stroke) & (np.abs(across) < half),
        (np.abs(across) < stroke) & (np.abs(along) < half),
        ((np.abs(dy) < stroke) & (np.abs(dx) < half)) | ((np.abs(dx) < stroke) & (np.abs(dy) < half)),
        ((np.abs(along) < stroke) & (np.abs(across) < half)) |
        ((np.abs(across) < stroke) & (np.abs(along) < half)),
        (box < half) & (box > half - 2 * stroke),
        box < half * 0.75,
        np.abs(radius - half) < stroke,
        radius < half * 0.8,
    ]
    image = masks[kind].astype(np.float32) * rng.uniform(0.6, 1.0)
    image += rng.normal(0.0, 0.15, size=image.shape).astype(np.float32)
    return np.clip(image, 0.0, 1.0)


def make_shapes(count: int, seed: int) -> TensorDataset:
    """`count` labelled shape images (balanced classes, shuffled), from `seed`."""
    rng = np.random.default_rng(seed)
    labels = rng.permutation(np.arange(count) % len(SHAPE_NAMES))
    images = np.stack([draw_shape(int(k), rng) for k in labels])
    images = (images - 0.2) / 0.3  # roughly zero mean, unit variance
    return TensorDataset(torch.from_numpy(images).unsqueeze(1), torch.from_numpy(labels))


def _limit(dataset: Dataset, count: Optional[int]) -> Dataset:
    if count is None or count >= len(dataset):
        return dataset
    return Subset(dataset, range(count))


def _require(path: str, dataset: str, how: str) -> None:
    if not os.path.exists(path):
        raise DatasetMissing(f"--dataset {dataset}: nothing at {path}; {how}")


def load(name: str, data_dir: Optional[str], train_samples: Optional[int] = None,
         test_samples: Optional[int] = None) -> DataSplit:
    """The train and test splits of dataset `name` (see the module docstring)."""
    if name == "shapes":
        train = make_shapes(train_samples or 2048, seed=1)
        test = make_shapes(test_samples or 512, seed=2)
        return DataSplit(train, test, 1, 28, len(SHAPE_NAMES))

    from torchvision import datasets, transforms
    if not data_dir:
        raise DatasetMissing(f"--dataset {name} needs --data-dir (the folder holding it)")
    if name == "mnist":
        _require(os.path.join(data_dir, "MNIST", "raw", "train-images-idx3-ubyte"), name,
                 "put MNIST's raw files in DATA_DIR/MNIST/raw/ (torchvision.datasets.MNIST("
                 "DATA_DIR, download=True) does it on a machine with internet)")
        normalize = transforms.Compose([transforms.ToTensor(),
                                        transforms.Normalize((0.1307,), (0.3081,))])
        train = datasets.MNIST(data_dir, train=True, download=False, transform=normalize)
        test = datasets.MNIST(data_dir, train=False, download=False, transform=normalize)
        split = DataSplit(train, test, 1, 28, 10)
    elif name == "cifar10":
        _require(os.path.join(data_dir, "cifar-10-batches-py"), name,
                 "torchvision.datasets.CIFAR10(DATA_DIR, download=True) puts it there on a "
                 "machine with internet")
        normalize = transforms.Compose([transforms.ToTensor(), transforms.Normalize(
            (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616))])
        train = datasets.CIFAR10(data_dir, train=True, download=False, transform=normalize)
        test = datasets.CIFAR10(data_dir, train=False, download=False, transform=normalize)
        split = DataSplit(train, test, 3, 32, 10)
    elif name == "imagefolder":
        for part in ("train", "val"):
            _require(os.path.join(data_dir, part), name,
                     "it needs DATA_DIR/train/<class>/<images> and DATA_DIR/val/<class>/<images>")
        to_tensor = transforms.Compose([transforms.Resize((32, 32)), transforms.ToTensor()])
        train = datasets.ImageFolder(os.path.join(data_dir, "train"), transform=to_tensor)
        test = datasets.ImageFolder(os.path.join(data_dir, "val"), transform=to_tensor)
        split = DataSplit(train, test, 3, 32, len(train.classes))
    else:
        raise DatasetMissing(f"unknown dataset {name!r}")
    split.train = _limit(split.train, train_samples)
    split.test = _limit(split.test, test_samples)
    return split
