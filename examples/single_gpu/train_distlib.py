"""Train a small CNN on one device or many: the "after" of examples/single_gpu.

python examples/single_gpu/train_distlib.py
torchrun --nproc-per-node=2 examples/single_gpu/train_distlib.py
"""

import argparse

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import distlib


def synthetic_data(n_train: int, n_test: int, seed: int = 0) -> tuple[TensorDataset, TensorDataset]:
    """Noisy copies of ten random 3x16x16 class templates: learnable in a few epochs on a CPU."""
    g = torch.Generator().manual_seed(seed)
    templates = torch.randn(10, 3, 16, 16, generator=g)
    y = torch.randint(0, 10, (n_train + n_test,), generator=g)
    x = templates[y] + 2.0 * torch.randn(n_train + n_test, 3, 16, 16, generator=g)
    return TensorDataset(x[:n_train], y[:n_train]), TensorDataset(x[n_train:], y[n_train:])


def make_model() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(32 * 4 * 4, 10),
    )  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=0.02)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save", default="", help="write the final state_dict here")
    args = p.parse_args()

    ctx = distlib.init()  # torchrun's environment, or one process
    device = ctx.device
    torch.manual_seed(args.seed)
    train_ds, test_ds = synthetic_data(2048, 512)
    # each rank takes its share of the batch, so the global batch stays args.batch_size
    train_loader = distlib.distributed_loader(train_ds, batch_size=args.batch_size // ctx.world_size, seed=args.seed)
    test_loader = distlib.distributed_loader(test_ds, batch_size=256, shuffle=False, exact=True)
    model = make_model().to(device)
    sync = distlib.GradSync(model)  # same start on every rank; averages gradients
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)

    for epoch in range(args.epochs):
        model.train()
        total = 0.0
        for x, y in train_loader:
            x, y = x.to(device), y.to(device)
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            sync.wait()
            opt.step()
            total += loss.item()
        train_loss = distlib.all_reduce(torch.tensor(total / len(train_loader), device=device), op="mean").item()

        model.eval()
        correct = torch.zeros((), device=device)
        with torch.no_grad():
            for x, y in test_loader:
                correct += (model(x.to(device)).argmax(1) == y.to(device)).sum()
        correct = distlib.all_reduce(correct).item()  # each test sample counted once over the ranks
        if ctx.is_main:
            print(f"epoch {epoch + 1}/{args.epochs}  loss {train_loss:.4f}  acc {correct / len(test_ds):.4f}")

    if args.save and ctx.is_main:
        torch.save(model.state_dict(), args.save)
    distlib.shutdown()


if __name__ == "__main__":
    main()
