"""A hand-written DDP script, as in the PyTorch tutorials: the "before" of examples/ddp_tutorial.

torchrun --nproc-per-node=2 examples/ddp_tutorial/train_ddp.py
"""

import argparse
import importlib
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


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


def setup() -> tuple[int, int, torch.device]:
    # Imported after the group exists (the optimizer imports it through torch._dynamo), this module
    # binds the group as its functions' default arguments and so keeps it alive past
    # destroy_process_group(): see cleanup().
    importlib.import_module("torch.distributed.nn.functional")
    dist.init_process_group(backend="nccl" if torch.cuda.is_available() else "gloo")
    local_rank = int(os.environ["LOCAL_RANK"])
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    return dist.get_rank(), dist.get_world_size(), device


def cleanup() -> None:
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=32, help="per process")
    p.add_argument("--lr", type=float, default=0.02)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save", default="", help="write the final state_dict here")
    args = p.parse_args()

    rank, world_size, device = setup()
    torch.manual_seed(args.seed)
    train_ds, test_ds = synthetic_data(2048, 512)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler)
    test_loader = DataLoader(test_ds, batch_size=256)
    model = make_model().to(device)
    model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        total = 0.0
        for x, y in train_loader:
            x, y = x.to(device), y.to(device)
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += loss.item()
        train_loss = torch.tensor(total / len(train_loader), device=device)
        dist.all_reduce(train_loss)
        train_loss = train_loss.item() / world_size

        if rank == 0:
            model.eval()
            correct = 0
            with torch.no_grad():
                for x, y in test_loader:
                    correct += (model.module(x.to(device)).argmax(1) == y.to(device)).sum().item()
            print(f"epoch {epoch + 1}/{args.epochs}  loss {train_loss:.4f}  acc {correct / len(test_ds):.4f}")

    if args.save and rank == 0:
        torch.save(model.module.state_dict(), args.save)
    # The DDP model holds the process group. While anything does, destroy_process_group() leaves
    # gloo's worker threads running, and a process that exits under them can abort ("terminate
    # called without an active exception"). Dropped first, the group is really destroyed.
    del model, opt
    cleanup()


if __name__ == "__main__":
    main()
