"""Models larger than one GPU, on one GPU: built sharded at a simulated world size, and offloaded.

    PYTHONPYCACHEPREFIX=/tmp/pyc python -m bench.large_models            # every part, a table last
    python -m bench.large_models --parts build --cases gpt-39.8B           # one case
    python -m bench.large_models --tiny                                    # tiny sizes on the CPU (the test)

Parts (``--parts``, default ``build,offload``):

- ``build``: for each ``--cases`` case, torch's fake process group stands in for the other ranks
  (``init_process_group("fake", ..., rank=0, world_size=W)``: FSDP2 runs with the real shard shapes
  and memory, every collective does nothing); ``distlib.shard_model`` builds the model (bf16 compute,
  fp32 reduce) on the meta device and replays its initialisation one parameter at a time; then one
  training step (forward, backward, fused AdamW) on ``--batch`` × ``--seq-len`` random tokens. Rows:
  the build's time and peak (``torch.cuda.max_memory_allocated``) against the rank's shards and the
  whole model, the step's time and peak. Cases: ``gpt-39.8B`` (the built-in GPT, 64 × 7168,
  vocabulary 50304) at world 8; ``llama-70B`` (``hf_causal_lm`` from a config of Llama-3-70B's shape:
  80 layers, 8192 wide, 64 heads, 8 key/value heads, MLP 28672, vocabulary 128256, untied) at 64.
  A simulated rank measures memory and its own compute, not the time in collectives (they do
  nothing) nor the waits a slower rank would cause.
- ``offload``: a 7B-class GPT (``--offload-size``, 32 × 4096) on one GPU (a real one-rank group),
  sharded with and without ``offload=True`` (FSDP2's CPUOffloadPolicy: weights, gradients and AdamW
  state on the host, AdamW stepping on the host): tokens/s over ``--steps`` steps after one warm-up
  step, and the peak GPU memory. The host holds 16 bytes a parameter with offload (107 GB at 6.7B):
  ``--offload-size 24x4096`` where the host has less than 128 GB.

Every row is printed as a JSON line; a markdown table of them comes last. BENCHMARKS.md, "Models
larger than one GPU"; docs/sharding.md.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

if __package__ in (None, ""):  # run as `python bench/large_models.py`: the repository root on the path
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

GIB = 2**30
LLAMA_70B = dict(model_type="llama", hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                 num_attention_heads=64, num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0,
                 tie_word_embeddings=False)  # fmt: skip
CASES = {  # name: (kind, shape, simulated world size)
    "gpt-39.8B": ("gpt", dict(n_layer=64, n_embd=7168, n_head=56, vocab_size=50304), 8),
    "llama-70B": ("llama", LLAMA_70B, 64),
}
TINY_CASES = {
    "gpt-39.8B": ("gpt", dict(n_layer=4, n_embd=64, n_head=4, vocab_size=256), 8),
    "llama-70B": ("llama", {**LLAMA_70B, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 3,
                            "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256}, 64),
}  # fmt: skip


def csv(text: str) -> list[str]:
    return [v for v in text.split(",") if v]


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.large_models", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--parts", type=csv, default=["build", "offload"], help="build, offload")
    p.add_argument("--cases", type=csv, default=list(CASES), help="cases of the build part: " + ", ".join(CASES))
    p.add_argument("--batch", type=int, default=1, help="sequences a step")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--offload-size", default="32x4096", help="the offload part's GPT: LAYERSxWIDTH")
    p.add_argument("--steps", type=int, default=3, help="timed steps of the offload part (after one warm-up)")
    p.add_argument("--tiny", action="store_true", help="tiny models on the CPU, the same code (the test)")
    args = p.parse_args(argv)
    bad = [c for c in args.cases if c not in CASES] + [x for x in args.parts if x not in ("build", "offload")]
    if bad:
        p.error(f"unknown part or case: {', '.join(bad)}")
    if args.tiny:
        args.batch, args.seq_len, args.offload_size, args.steps = 2, 16, "2x64", 1
    return args


def _model(kind: str, shape: dict, seq_len: int):
    """A function that builds the model (``shard_model`` runs it on the meta device)."""
    if kind == "gpt":
        from distlib.runner.models.gpt import GPT, GPTConfig

        return lambda: GPT(GPTConfig(block_size=seq_len, **shape))
    from distlib.runner.models.hf_causal_lm import hf_causal_lm

    return lambda: hf_causal_lm(config={**shape, "max_position_embeddings": seq_len})


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


def _peak_gib(device) -> float | None:
    import torch

    return round(torch.cuda.max_memory_allocated() / GIB, 2) if device.type == "cuda" else None


def _reset(device) -> None:
    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _step(model, opt, vocab: int, args, device) -> float:
    """One training step on random tokens; its seconds."""
    import torch
    import torch.nn.functional as F

    x = torch.randint(0, vocab, (args.batch, args.seq_len), device=device)
    _sync(device)
    t0 = time.perf_counter()
    logits = model(x)
    F.cross_entropy(logits.float().flatten(0, 1), x.flatten()).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    _sync(device)
    return time.perf_counter() - t0


def _held_bytes(model) -> int:
    return sum(p.to_local().untyped_storage().nbytes() for p in model.parameters())


def build_case(name: str, args, device) -> dict:
    """``name`` at its simulated world size: the sharded build, then one step."""
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import distlib

    kind, shape, world = (TINY_CASES if args.tiny else CASES)[name]
    vocab = shape["vocab_size"]
    _reset(device)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    row: dict = {"part": "build", "case": name, "world": world}
    try:
        t0 = time.perf_counter()
        bf16 = torch.bfloat16 if device.type == "cuda" else None
        model = distlib.shard_model(_model(kind, shape, args.seq_len), param_dtype=bf16,
                                    reduce_dtype=torch.float32 if bf16 else None, device=device, seed=0)  # fmt: skip
        _sync(device)
        params = sum(p.numel() for p in model.parameters())
        row.update(params_b=round(params / 1e9, 2), build_s=round(time.perf_counter() - t0, 1),
                   whole_gib=round(params * 4 / GIB, 2), shards_gib=round(_held_bytes(model) / GIB, 2),
                   build_peak_gib=_peak_gib(device))  # fmt: skip
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
        row["step_s"] = round(_step(model, opt, vocab, args, device), 4)
        row["step_peak_gib"] = _peak_gib(device)
        del model, opt
    except torch.OutOfMemoryError as e:
        row["error"] = f"out of memory: {str(e).splitlines()[0]}"
    finally:
        dist.destroy_process_group()
    return row


def offload_case(offload: bool, args, device) -> dict:
    """The 7B-class GPT on this one device, with or without FSDP2's CPU offload."""
    import torch
    import torch.distributed as dist

    import distlib

    layers, width = (int(v) for v in args.offload_size.lower().split("x"))
    shape = dict(n_layer=layers, n_embd=width, n_head=max(1, width // 128), vocab_size=50304 if not args.tiny else 256)
    _reset(device)
    row: dict = {"part": "offload", "case": f"gpt-{args.offload_size}", "offload": offload}
    try:
        bf16 = torch.bfloat16 if device.type == "cuda" else None
        model = distlib.shard_model(_model("gpt", shape, args.seq_len), param_dtype=bf16,
                                    reduce_dtype=torch.float32 if bf16 else None, device=device, seed=0,
                                    offload=offload)  # fmt: skip
        row["params_b"] = round(sum(p.numel() for p in model.parameters()) / 1e9, 2)
        # on the host with offload: fused AdamW's CPU kernel there
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda" or offload)
        _step(model, opt, shape["vocab_size"], args, device)  # warm-up: the optimizer state is made
        seconds = sum(_step(model, opt, shape["vocab_size"], args, device) for _ in range(args.steps))
        row.update(tokens_per_s=round(args.steps * args.batch * args.seq_len / seconds, 1),
                   step_s=round(seconds / args.steps, 4), peak_gib=_peak_gib(device))  # fmt: skip
        del model, opt
    except torch.OutOfMemoryError as e:
        row["error"] = f"out of memory: {str(e).splitlines()[0]}"
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return row


def table(rows: list[dict]) -> str:
    cols = ["part", "case", "world", "offload", "params_b", "whole_gib", "shards_gib", "build_s", "build_peak_gib",
            "step_s", "step_peak_gib", "tokens_per_s", "peak_gib", "error"]  # fmt: skip
    cols = [c for c in cols if any(c in r for r in rows)]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join("" if r.get(c) is None else str(r[c]) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    import torch

    device = torch.device("cpu") if args.tiny or not torch.cuda.is_available() else torch.device("cuda", 0)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    rows = []
    if "build" in args.parts:
        for name in args.cases:
            rows.append(build_case(name, args, device))
            print(json.dumps(rows[-1]), flush=True)
    if "offload" in args.parts:
        for offload in (False, True):  # offload last: it needs the most host memory
            rows.append(offload_case(offload, args, device))
            print(json.dumps(rows[-1]), flush=True)
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
