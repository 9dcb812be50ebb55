"""torchvision ResNets, with the stem adapted for small images.

ImageNet ResNets open with a 7x7 stride-2 convolution and a stride-2 max-pool: on a
28x28 or 32x32 image that throws away three quarters of the pixels before the first
block. For small images people use a 3x3 stride-1 convolution and no max-pool (as in
the CIFAR ResNets of He et al.), and take the number of input channels from the data.
"""
from __future__ import annotations

import torchvision
from torch import nn

ARCHITECTURES = ["resnet18", "resnet34", "resnet50", "resnet101", "resnet152",
                 "resnext50_32x4d", "resnext101_32x8d", "wide_resnet50_2", "wide_resnet101_2"]


def build_model(arch: str, channels: int, num_classes: int, image_size: int) -> nn.Module:
    """A torchvision ResNet for `channels`-channel images of `image_size` pixels."""
    model = getattr(torchvision.models, arch)(num_classes=num_classes)
    if image_size <= 64:
        model.conv1 = nn.Conv2d(channels, 64, kernel_size=3, stride=1, padding=1, bias=False)
        model.maxpool = nn.Identity()
    elif channels != 3:
        model.conv1 = nn.Conv2d(channels, 64, kernel_size=7, stride=2, padding=3, bias=False)
    return model
