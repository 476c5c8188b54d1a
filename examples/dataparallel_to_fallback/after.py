"""After: the same script on distlib's fallback mode (one process per node drives its GPUs).

python examples/dataparallel_to_fallback/after.py --epochs 2            # one node
torchrun --nnodes=N --nproc-per-node=1 --rdzv-backend=c10d --rdzv-endpoint=HOST:PORT \
    examples/dataparallel_to_fallback/after.py                           # N nodes
"""

import argparse
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torchvision import datasets, transforms
from torchvision.models import resnet18

import distlib


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
    ctx = distlib.init()  # one process per node; torch.distributed between nodes

    norm = transforms.Normalize((0.49, 0.48, 0.45), (0.25, 0.24, 0.26))
    train_tf = transforms.Compose(
        [transforms.RandomCrop(32, padding=4), transforms.RandomHorizontalFlip(), transforms.ToTensor(), norm]
    )
    train_set = datasets.ImageFolder(f"{args.data}/train", train_tf)
    test_set = datasets.ImageFolder(f"{args.data}/test", transforms.Compose([transforms.ToTensor(), norm]))
    loader = distlib.distributed_loader(  # each node its share of the global batch
        train_set, batch_size=args.batch_size // ctx.world_size, num_workers=4, pin_memory=True, drop_last=True
    )
    test_loader = torch.utils.data.DataLoader(test_set, batch_size=500, num_workers=4)

    model = build_model().cuda()
    replicas = distlib.Replicas(model)  # a persistent replica on every GPU of this node
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)

    for epoch in range(args.epochs):
        t0, loss_sum = time.perf_counter(), 0.0
        for x, y in loader:
            x, y = x.cuda(non_blocking=True), y.cuda(non_blocking=True)
            loss = replicas.train_step(x, y, F.cross_entropy, autocast_dtype=torch.bfloat16)
            opt.step()
            loss_sum += loss.item()
        ips = len(loader) * args.batch_size / (time.perf_counter() - t0)
        if ctx.is_main:
            print(f"epoch {epoch} loss {loss_sum / len(loader):.4f} {ips:.0f} img/s", flush=True)
    replicas.sync_buffers()  # BatchNorm statistics averaged over every GPU into the model
    if ctx.is_main:
        print(f"test_acc {evaluate(model, test_loader):.4f}")
    distlib.shutdown()


if __name__ == "__main__":
    main()
