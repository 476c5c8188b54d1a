"""GPT training with DDP and torch.compile, written as the PyTorch tutorials write it: the baseline
of the GPT figures. Only the model comes from the project (distlib.runner.models.gpt.GPT), so that the
architecture is the same by construction; the loop is plain torch.

Throughput on random tokens (no --data), sizes as given:
    torchrun --nproc-per-node=2 bench/baselines/gpt_ddp.py --n-layer 24 --n-head 16 --n-embd 1024
    python bench/baselines/gpt_ddp.py --n-layer 12 --n-head 12 --n-embd 768      # one GPU, no DDP

Byte-level training on a text file to a validation loss (the last 5% of the bytes):
    torchrun --nproc-per-node=2 bench/baselines/gpt_ddp.py --data data/shakespeare.txt.gz --vocab 256 \
        --block-size 512 --n-layer 8 --n-head 8 --n-embd 512 --dropout 0.1 --batch 32 --steps 1460 --lr 1e-3 \
        --lr-warmup 73 --eval-every 292

Prints progress lines and one line starting with RESULT.
"""
import argparse
import gzip
import math
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from distlib.runner.models.gpt import GPT, GPTConfig  # noqa: E402

p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--data", help="a .txt or .txt.gz file: train byte-level on it (else: random tokens, throughput)")
p.add_argument("--n-layer", type=int, default=12)
p.add_argument("--n-head", type=int, default=12)
p.add_argument("--n-embd", type=int, default=768)
p.add_argument("--vocab", type=int, default=50304)
p.add_argument("--block-size", type=int, default=1024)
p.add_argument("--batch", type=int, default=16, help="sequences per GPU")
p.add_argument("--dropout", type=float, default=0.0)
p.add_argument("--steps", type=int, default=50, help="training steps (throughput: timed steps after --warmup)")
p.add_argument("--warmup", type=int, default=10, help="throughput: untimed steps first")
p.add_argument("--lr", type=float, default=6e-4)
p.add_argument("--min-lr", type=float, default=None, help="end of the cosine schedule (default lr / 10)")
p.add_argument("--lr-warmup", type=int, default=100, help="steps of linear learning-rate warm-up")
p.add_argument("--weight-decay", type=float, default=0.1)
p.add_argument("--clip", type=float, default=1.0)
p.add_argument("--eval-every", type=int, default=250)
p.add_argument("--no-compile", action="store_true")
p.add_argument("--seed", type=int, default=0)
args = p.parse_args()

# --- process group and device, as in the DDP tutorial -------------------------------------------
distributed = "RANK" in os.environ
cuda = torch.cuda.is_available()
if distributed:
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world, local = dist.get_rank(), dist.get_world_size(), int(os.environ["LOCAL_RANK"])
else:
    rank, world, local = 0, 1, 0
device = torch.device("cuda", local) if cuda else torch.device("cpu")
if cuda:
    torch.cuda.set_device(device)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
torch.manual_seed(args.seed)

# --- data -----------------------------------------------------------------------------------------
if args.data:
    opener = gzip.open if args.data.endswith(".gz") else open
    with opener(args.data, "rb") as f:
        data = torch.frombuffer(bytearray(f.read()), dtype=torch.uint8)
    cut = int(len(data) * 0.95)
    train_data, val_data = data[:cut], data[cut:]


def get_batch(gen):
    """--batch random windows of the training bytes (each rank its own offsets), or random tokens."""
    if not args.data:
        x = torch.randint(args.vocab, (args.batch, args.block_size + 1), generator=gen)
    else:
        ix = torch.randint(len(train_data) - args.block_size - 1, (args.batch,), generator=gen)
        x = torch.stack([train_data[i : i + args.block_size + 1] for i in ix.tolist()]).long()
    x = x.pin_memory().to(device, non_blocking=True) if cuda else x
    return x[:, :-1], x[:, 1:]


# --- model and optimizer ----------------------------------------------------------------------------
cfg = GPTConfig(args.vocab, args.block_size, args.n_layer, args.n_head, args.n_embd, args.dropout, False)
raw_model = GPT(cfg).to(device)
model = DDP(raw_model, device_ids=[local] if cuda else None) if distributed else raw_model
if not args.no_compile:
    model = torch.compile(model)
decay = [p for p in raw_model.parameters() if p.ndim >= 2]
no_decay = [p for p in raw_model.parameters() if p.ndim < 2]
opt = torch.optim.AdamW(
    [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
    lr=args.lr, betas=(0.9, 0.95), fused=cuda,
)
min_lr = args.lr / 10 if args.min_lr is None else args.min_lr


def lr_at(step):
    if step < args.lr_warmup:
        return args.lr * (step + 1) / args.lr_warmup
    progress = (step - args.lr_warmup) / max(1, args.steps - args.lr_warmup)
    return min_lr + 0.5 * (args.lr - min_lr) * (1 + math.cos(math.pi * min(1.0, progress)))


def train_step(x, y, lr):
    for group in opt.param_groups:
        group["lr"] = lr
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
        logits = model(x)
    loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.reshape(-1))
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(raw_model.parameters(), args.clip)
    opt.step()
    return loss


@torch.no_grad()
def val_loss():
    """Mean loss over every non-overlapping block_size window of the validation bytes (split over ranks)."""
    model.eval()
    n = (len(val_data) - 1) // args.block_size
    windows = torch.arange(n)[rank::world]
    total = torch.zeros(2, device=device)
    for i in range(0, len(windows), args.batch):
        starts = (windows[i : i + args.batch] * args.block_size).tolist()
        x = torch.stack([val_data[s : s + args.block_size + 1] for s in starts]).long().to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
            logits = raw_model(x[:, :-1])
        loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), x[:, 1:].reshape(-1), reduction="sum")
        total += torch.stack([loss, torch.tensor(float(x[:, 1:].numel()), device=device)])
    if distributed:
        dist.all_reduce(total)
    model.train()
    return (total[0] / total[1]).item()


def sync():
    if cuda:
        torch.cuda.synchronize()


gen = torch.Generator().manual_seed(args.seed * 1000 + rank)
tokens = args.batch * args.block_size
n_params = raw_model.num_params()
if not args.data:  # throughput: median step time after warm-up
    x, y = get_batch(gen)
    for _ in range(args.warmup):
        train_step(x, y, args.lr)
    sync()
    times = []
    for _ in range(args.steps):
        t = time.perf_counter()
        train_step(x, y, args.lr)
        sync()
        times.append(time.perf_counter() - t)
    step_s = statistics.median(times)
    if distributed:
        slowest = torch.tensor([step_s], device=device)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        step_s = slowest.item()
    name = torch.cuda.get_device_name() if cuda else "cpu"
    peak = 989e12 if ("H100" in name or "H200" in name) else None
    mfu = f"{raw_model.flops_per_token(args.block_size) * tokens / step_s / peak:.4f}" if peak else "-"
    mem = torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0
    if rank == 0:
        print(f"RESULT mode={'ddp' if distributed else 'single'}{'' if args.no_compile else '-compile'} "
              f"world={world} params={n_params} step_ms={step_s * 1e3:.2f} tokens_per_s={tokens * world / step_s:.0f} "
              f"tokens_per_s_per_gpu={tokens / step_s:.0f} mfu={mfu} peak_mem_gib={mem:.1f}", flush=True)
else:  # byte-level training to a validation loss
    t0 = time.perf_counter()
    first_step_s = None
    for step in range(args.steps):
        x, y = get_batch(gen)
        loss = train_step(x, y, lr_at(step))
        if step == 0:
            sync()
            first_step_s = time.perf_counter() - t0
        last = step == args.steps - 1
        if (step + 1) % args.eval_every == 0 or last:
            v = val_loss()
            if rank == 0:
                print(f"step {step + 1} train_loss {loss.item():.4f} val_loss {v:.4f} "
                      f"elapsed_s {time.perf_counter() - t0:.1f}", flush=True)
    sync()
    train_s = time.perf_counter() - t0
    if rank == 0:
        print(f"RESULT val_loss={v:.4f} train_s={train_s:.2f} first_step_s={first_step_s:.2f} steps={args.steps} "
              f"world={world} params={n_params} tokens_per_s={tokens * world * args.steps / train_s:.0f}", flush=True)

if distributed:
    dist.destroy_process_group()
