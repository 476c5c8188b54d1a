"""Before: a typical nn.DataParallel training script (one process drives every GPU).

python examples/dataparallel_to_fallback/before.py --epochs 2
"""

import argparse
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torchvision import datasets, transforms
from torchvision.models import resnet18


def build_model() -> nn.Module:
    model = resnet18(num_classes=10)
    model.conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False)  # CIFAR stem
    model.maxpool = nn.Identity()
    return model


@torch.no_grad()
def evaluate(model: nn.Module, loader) -> float:
    model.eval()
    correct = total = 0
    for x, y in loader:
        x, y = x.cuda(non_blocking=True), y.cuda(non_blocking=True)
        correct += (model(x).argmax(1) == y).sum().item()
        total += y.numel()
    model.train()
    return correct / total


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="data/cifar10-demo")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=256)
    args = p.parse_args()

    norm = transforms.Normalize((0.49, 0.48, 0.45), (0.25, 0.24, 0.26))
    train_tf = transforms.Compose(
        [transforms.RandomCrop(32, padding=4), transforms.RandomHorizontalFlip(), transforms.ToTensor(), norm]
    )
    train_set = datasets.ImageFolder(f"{args.data}/train", train_tf)
    test_set = datasets.ImageFolder(f"{args.data}/test", transforms.Compose([transforms.ToTensor(), norm]))
    loader = torch.utils.data.DataLoader(
        train_set, batch_size=args.batch_size, shuffle=True, num_workers=4, pin_memory=True, drop_last=True
    )
    test_loader = torch.utils.data.DataLoader(test_set, batch_size=500, num_workers=4)

    model = nn.DataParallel(build_model().cuda())
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)

    for epoch in range(args.epochs):
        t0, loss_sum = time.perf_counter(), 0.0
        for x, y in loader:
            x, y = x.cuda(non_blocking=True), y.cuda(non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            loss_sum += loss.item()
        ips = len(loader) * args.batch_size / (time.perf_counter() - t0)
        print(f"epoch {epoch} loss {loss_sum / len(loader):.4f} {ips:.0f} img/s", flush=True)
    print(f"test_acc {evaluate(model, test_loader):.4f}")


if __name__ == "__main__":
    main()
