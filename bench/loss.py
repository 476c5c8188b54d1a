"""The language-model loss three ways on one GPU: the plain loss (the model's logits, then the
cross-entropy), the runner's chunked loss (``loss.chunks``: runner/tasks/chunked_loss.py) and
Liger-Kernel's ``LigerFusedLinearCrossEntropyLoss`` (when the ``liger-kernel`` package is
installed; skipped otherwise): the peak memory and tokens/s of a whole training step, and the
largest batch that fits.

    python -m bench.loss                                  # recipes/llama_1b.yaml's model, 8 x 2048 tokens
    python -m bench.loss --batches 8,12,16,20,24,28,32    # the batch sizes tried for the largest that fits
    python -m bench.loss --chunks 4,8,16                  # the chunked loss at several chunk counts
    python -m bench.loss --tiny                           # a tiny Llama on the CPU (the test)
    python -m bench.loss --loss-only                      # the loss alone on the CPU: time and peak RSS

``--loss-only``: the output layer and the loss alone (hidden states of ``--tokens`` x ``--hidden``,
a ``--vocab`` output matrix, fp32), forward and backward, each variant in a process of its own on
the CPU: the median time and the process's peak resident memory above its start.

The model is the recipe's transformers config (``model.args.config``) built on the GPU in fp32,
trained under bf16 autocast with fused AdamW, each decoder layer compiled (``--no-compile``: eager)
as the runner does; the plain loss compiled too, as the runner's ``train.compile`` does. The targets
are random token ids with a third of them ignored (-100), as a chat batch's prompts are. Each variant
runs ``--warmup`` steps, then ``--steps`` timed ones (tokens/s from the median step); the peak is
``torch.cuda.max_memory_allocated`` over the timed steps. The largest batch: each size of
``--batches`` in turn (two steps each) until one runs out of memory. Every row is a JSON line in
``--json``; the table comes last. BENCHMARKS.md, "The loss".
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import statistics
import sys
import time
from collections.abc import Callable

if __package__ in (None, ""):  # run as `python bench/loss.py`: the repository root on the path
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
from torch import nn

TINY = dict(model_type="llama", vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            tie_word_embeddings=True)  # fmt: skip


def build(config: dict, device: torch.device, compile_blocks: bool) -> nn.Module:
    import distlib
    from distlib.runner.models.hf_causal_lm import hf_causal_lm

    torch.manual_seed(0)
    with torch.device(device):
        model = hf_causal_lm(config=config)
    if compile_blocks:
        distlib.compile_blocks(distlib.find_blocks(model))
    return model


def step_fn(variant: str, model: nn.Module, chunks: int, compile_loss: bool) -> Callable:
    """``loss = step(x, y)``'s forward and backward for one loss variant (the mean over the trained targets)."""
    from distlib.runner.tasks.chunked_loss import chunked_cross_entropy
    from distlib.runner.tasks.losses import cross_entropy

    if variant == "plain":
        loss_fn = functools.partial(cross_entropy, reduction="sum")
        if compile_loss:
            loss_fn = torch.compile(loss_fn, dynamic=False)
        return lambda x, y: loss_fn(model(x), y) / (y != -100).sum()
    if variant == "chunked":
        loss = chunked_cross_entropy(chunks, compile_backend="inductor" if compile_loss else None)  # as the runner's
        return lambda x, y: model(x, head=loss.head(y)) / (y != -100).sum()
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

    liger = LigerFusedLinearCrossEntropyLoss(ignore_index=-100)  # its mean over the trained targets
    hf = model.hf
    base = getattr(hf, hf.base_model_prefix)
    head = hf.get_output_embeddings()

    def liger_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        hidden = base(input_ids=x, use_cache=False).last_hidden_state
        return liger(head.weight, hidden.flatten(0, 1), y.flatten())

    return liger_step


def batch(n: int, seq: int, vocab: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(n)
    x = torch.randint(0, vocab, (n, seq), generator=g)
    y = torch.randint(0, vocab, (n, seq), generator=g)
    y[torch.rand(n, seq, generator=g) < 1 / 3] = -100
    return x.to(device), y.to(device)


def run(step: Callable, model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor,
        steps: int, warmup: int, device: torch.device) -> dict:  # fmt: skip
    """``warmup`` then ``steps`` timed training steps; tokens/s of the median, the peak memory, the last loss."""
    cuda = device.type == "cuda"
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda)
    times, loss = [], None
    for k in range(warmup + steps):
        if k == warmup and cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        with autocast:
            loss = step(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        if k >= warmup:
            times.append(time.perf_counter() - t0)
    return {"tokens_per_s": round(x.numel() / statistics.median(times), 1),
            "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None,
            "loss": round(loss.item(), 4)}  # fmt: skip


def fits(step: Callable, model: nn.Module, opt: torch.optim.Optimizer, n: int, seq: int, vocab: int,
         device: torch.device) -> bool:  # fmt: skip
    try:
        x, y = batch(n, seq, vocab, device)
        run(step, model, opt, x, y, steps=1, warmup=1, device=device)
        return True
    except torch.OutOfMemoryError:
        return False
    finally:
        opt.zero_grad(set_to_none=True)
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()


def loss_only(variant: str, tokens: int, hidden: int, vocab: int, chunks: int, steps: int) -> dict:
    """The output layer and the loss alone on the CPU, fp32: median seconds and peak RSS growth (GiB)."""
    import resource

    import torch.nn.functional as F

    from distlib.runner.tasks.chunked_loss import linear_cross_entropy

    torch.manual_seed(0)
    h = torch.randn(tokens, hidden, requires_grad=True)
    head = nn.Linear(hidden, vocab, bias=False)
    y = torch.randint(0, vocab, (tokens,))
    y[torch.rand(tokens) < 1 / 3] = -100
    start = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        if variant == "plain":
            loss = F.cross_entropy(head(h).float(), y, ignore_index=-100, reduction="sum")
        else:
            loss = linear_cross_entropy(h, head, y, chunks=chunks)
        loss.backward()
        times.append(time.perf_counter() - t0)
        h.grad = head.weight.grad = None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - start  # KiB on Linux
    return {"variant": variant, "chunks": chunks or None, "tokens": tokens, "hidden": hidden, "vocab": vocab,
            "seconds": round(statistics.median(times), 4), "peak_rss_gib": round(peak / 2**20, 3)}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipe", default="recipes/llama_1b.yaml")
    p.add_argument("--batch", type=int, default=8, help="sequences a step for the tokens/s and peak (default 8)")
    p.add_argument("--seq", type=int, default=0, help="tokens a sequence (default: the recipe's block_size)")
    p.add_argument("--chunks", default="8", help="the chunked loss's chunk counts, comma-separated")
    p.add_argument("--batches", default="8,12,16,20,24,28,32,40,48",
                   help="batch sizes tried, in order, for the largest that fits; empty: no search")  # fmt: skip
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--no-compile", action="store_true", help="eager decoder layers and loss")
    p.add_argument("--variants", default="plain,chunked,liger")
    p.add_argument("--tiny", action="store_true", help="a tiny Llama on the CPU, no search (the test)")
    p.add_argument("--json", default="", help="append each row as a JSON line to this file")
    p.add_argument("--loss-only", action="store_true", help="the output layer and loss alone, on the CPU")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--one", default="", help=argparse.SUPPRESS)  # a --loss-only variant in this process
    a = p.parse_args(argv)
    if a.one:
        variant, chunks = a.one.split(":")
        print(json.dumps(loss_only(variant, a.tokens, a.hidden, a.vocab, int(chunks), a.steps)))
        return 0
    if a.loss_only:
        import subprocess

        runs = [("plain", 0)] + [("chunked", int(c)) for c in a.chunks.split(",")]
        for variant, chunks in runs:
            cmd = [sys.executable, "-m", "bench.loss", "--one", f"{variant}:{chunks}", "--tokens", str(a.tokens),
                   "--hidden", str(a.hidden), "--vocab", str(a.vocab), "--steps", str(a.steps)]  # fmt: skip
            line = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
            print(line, flush=True)
            if a.json:
                with open(a.json, "a") as f:
                    f.write(line + "\n")
        return 0
    device = torch.device("cuda" if torch.cuda.is_available() and not a.tiny else "cpu")
    if a.tiny:
        config, seq, a.batch, a.batches, a.steps, a.warmup, a.no_compile = TINY, a.seq or 64, 2, "", 2, 1, True
    else:
        from distlib.runner.config import load_config

        cfg = load_config(a.recipe, [])
        config, seq = cfg.model.args["config"], a.seq or cfg.data.args["block_size"]
    vocab = config["vocab_size"]
    variants: list[tuple[str, int]] = []
    for v in a.variants.split(","):
        if v == "chunked":
            variants += [("chunked", int(c)) for c in a.chunks.split(",")]
        elif v == "liger":
            try:
                import liger_kernel.transformers  # noqa: F401
            except ImportError:
                print("liger: skipped (pip install liger-kernel)", file=sys.stderr)
                continue
            if device.type != "cuda":
                print("liger: skipped (Triton kernels: a GPU only)", file=sys.stderr)
                continue
            variants.append(("liger", 0))
        else:
            variants.append((v, 0))
    rows = []
    for variant, chunks in variants:
        model = build(config, device, compile_blocks=not a.no_compile)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
        step = step_fn(variant, model, chunks, compile_loss=not a.no_compile)
        x, y = batch(a.batch, seq, vocab, device)
        row = {"variant": variant, "chunks": chunks or None, "batch": a.batch, "seq": seq, "device": str(device),
               "torch": torch.__version__, **run(step, model, opt, x, y, a.steps, a.warmup, device)}  # fmt: skip
        largest = None
        for n in [int(b) for b in a.batches.split(",") if b]:
            if not fits(step, model, opt, n, seq, vocab, device):
                break
            largest = n
        row["largest_batch"] = largest
        rows.append(row)
        print(json.dumps(row), flush=True)
        if a.json:
            with open(a.json, "a") as f:
                f.write(json.dumps(row) + "\n")
        del model, opt, step
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print(f"\n{'variant':<12}{'tokens/s':>12}{'peak GiB':>10}{'largest batch':>15}{'loss':>9}")
    for r in rows:
        name = r["variant"] + (f"/{r['chunks']}" if r["chunks"] else "")
        print(f"{name:<12}{r['tokens_per_s']:>12}{r['peak_gib'] if r['peak_gib'] is not None else '-':>10}"
              f"{r['largest_batch'] if r['largest_batch'] is not None else '-':>15}{r['loss']:>9}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
