"""The image models recipes name: torchvision's ResNet18 in its CIFAR form, and a small CNN."""

from __future__ import annotations

from torch import nn


def resnet18_cifar(num_classes: int = 10) -> nn.Module:
    """torchvision's ResNet18 in its CIFAR form: a 3x3 stride-1 stem and no max-pool
    (11,173,962 parameters for 10 classes)."""
    from torchvision.models import resnet18

    model = resnet18(num_classes=num_classes)
    model.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
    model.maxpool = nn.Identity()
    return model


def small_cnn(num_classes: int = 10, width: int = 32) -> nn.Module:
    """A few conv-BN-ReLU blocks: trains CIFAR-sized images to well above chance in
    seconds on a CPU (the offline demo)."""

    def block(cin: int, cout: int) -> nn.Sequential:
        return nn.Sequential(
            nn.Conv2d(cin, cout, 3, padding=1, bias=False),
            nn.BatchNorm2d(cout),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
        )

    return nn.Sequential(
        block(3, width),
        block(width, 2 * width),
        block(2 * width, 4 * width),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(4 * width, num_classes),
    )


def build_model(name: str, num_classes: int, width: int) -> nn.Module:
    """A built-in image model by its short name (the benchmarks' entry; recipes go through runner/components.py)."""
    if name == "resnet18_cifar":
        return resnet18_cifar(num_classes)
    if name == "small_cnn":
        return small_cnn(num_classes, width)
    raise ValueError(f"unknown model {name!r}; known: resnet18_cifar, small_cnn")


__all__ = ["resnet18_cifar", "small_cnn", "build_model"]
