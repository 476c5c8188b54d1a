"""The models the recipes name."""

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


def gpt(
    vocab_size: int = 256,
    block_size: int = 256,
    n_layer: int = 6,
    n_head: int = 6,
    n_embd: int = 384,
    dropout: float = 0.0,
    bias: bool = False,
) -> nn.Module:
    """The decoder-only transformer of runner/gpt.py (GPT-2 small: n_layer=12, n_head=12, n_embd=768)."""
    from distlib.runner.gpt import GPT, GPTConfig

    return GPT(GPTConfig(vocab_size, block_size, n_layer, n_head, n_embd, dropout, bias))


def build_model(name: str, num_classes: int, width: int) -> nn.Module:
    """A built-in image model by its short name (the benchmarks' entry; recipes go through runner/components.py)."""
    if name == "resnet18_cifar":
        return resnet18_cifar(num_classes)
    if name == "small_cnn":
        return small_cnn(num_classes, width)
    raise ValueError(f"unknown model {name!r}; known: resnet18_cifar, small_cnn")


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on conv and linear weights only: not on norm weights, biases or embeddings
    (a weight tied to an embedding, like GPT's output layer, counts as the embedding)."""
    embedding = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    params = [p for p in model.parameters() if p.requires_grad]  # each shared parameter once
    decay = [p for p in params if p.ndim > 1 and id(p) not in embedding]
    no_decay = [p for p in params if p.ndim <= 1 or id(p) in embedding]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def count_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


__all__ = ["resnet18_cifar", "small_cnn", "gpt", "build_model", "param_groups", "count_params"]
