"""LoRA against full fine-tuning through the runner, and against a plain peft + transformers loop, on one GPU.

    python -m bench.lora                      # Llama-3.2-1B shape, 8 x 2048: runner full, runner LoRA, peft loop;
                                              # then the Llama-3.1-8B shape with LoRA at 4 x 2048, planned then run
    python -m bench.lora --cases 8b-lora      # some of them (runner-full, runner-lora, peft-loop, 8b-lora)
    python -m bench.lora --tiny               # tiny shapes on the CPU (the check that it runs)

Each case runs in a process of its own (its GPU peak its own), on random token ids, random weights
from the shape's config (nothing downloaded), bf16:

- ``runner-full`` / ``runner-lora``: the runner's recipe (``model.name: hf_causal_lm``, AdamW, clipping,
  each decoder layer compiled, ``train.compile=blocks``) without and with ``model.args.lora`` (r 16,
  alpha 32, every Linear of the blocks); ``Trainer.build`` as launch.py runs it (its warm-up included),
  then ``--steps`` timed calls of the trainer's ``train_step`` on one batch;
- ``peft-loop``: the same LoRA as a plain loop writes it: the transformers model in bf16,
  ``peft.get_peft_model`` (its adapters upcast to fp32, peft's default), ``model(input_ids=x,
  labels=x).loss`` under bf16 autocast, fused AdamW over the adapters, clipping, ``torch.compile(model)``;
- ``8b-lora``: the Llama-3.1-8B shape with the same LoRA at 4 x 2048, with full activation
  checkpointing: first its memory plan (``distlib.runner.plan``, fake tensors), then the run, whose
  measured peak stands beside the plan's.

Each prints tokens/s from the median step, the peak (``torch.cuda.max_memory_allocated``) and the
seconds from the process's start to the end of its first step; every row a JSON line in ``--json``,
the table last.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

T0 = time.perf_counter()

if __package__ in (None, ""):  # run as `python bench/lora.py`: the repository root on the path
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}  # fmt: skip
SHAPES = {
    "1b": dict(model_type="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
               num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=131072,
               rms_norm_eps=1e-5, rope_parameters=LLAMA3_ROPE, tie_word_embeddings=True),
    "8b": dict(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
               num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=131072,
               rms_norm_eps=1e-5, rope_parameters=LLAMA3_ROPE, tie_word_embeddings=False),
}  # fmt: skip
TINY = dict(model_type="llama", vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128)  # fmt: skip
LORA = {"r": 16, "alpha": 32, "dropout": 0.0, "target_modules": "all-linear"}
CASES = ("runner-full", "runner-lora", "peft-loop", "8b-lora")


def shape(args: argparse.Namespace, case: str) -> tuple[dict, int, int]:
    """The config, batch and sequence length of ``case``."""
    if args.tiny:
        return TINY, 4, 64
    if case == "8b-lora":
        return SHAPES["8b"], 4, 2048
    return SHAPES["1b"], args.batch, args.seq


def runner_config(args: argparse.Namespace, case: str, work: str):  # noqa: ANN201  (a runner Config)
    import numpy as np
    import yaml

    from distlib.runner.config import load_config

    config, batch, seq = shape(args, case)
    data = os.path.join(work, "tokens.bin")
    np.random.default_rng(0).integers(0, 32000 if not args.tiny else 512, max(200_000, 40 * batch * seq),
                                      dtype=np.uint32).tofile(data)  # fmt: skip
    model_args: dict = {"config": config}
    if case != "runner-full":
        model_args["lora"] = LORA
    recipe = {
        "data": {"name": "token_file", "root": data, "args": {"block_size": seq, "dtype": "uint32", "val_frac": 0.01}},
        "model": {"name": "hf_causal_lm", "args": model_args},
        "train": {"epochs": 1, "batch_size": batch, "optimizer": "adamw", "lr": 3e-4, "weight_decay": 0.1,
                  "label_smoothing": 0.0, "warmup_frac": 0.0, "precision": "bf16", "clip_grad_norm": 1.0,
                  "compile": "blocks", "sample_tokens": 0, "prewarm_steps": args.warmup,
                  "activation_checkpointing": "full" if case == "8b-lora" else "none"},
        "run": {"out_dir": os.path.join(work, "run"), "resume": False, "progress": "plain"},
    }  # fmt: skip
    path = os.path.join(work, "recipe.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(recipe, f)
    return load_config(path, ["train.compile=none"] if args.tiny else [])


def plan_gib(cfg) -> float:  # noqa: ANN001
    import torch

    from distlib.runner.training.memory_plan import plan

    result = plan(cfg, 1, shards=(cfg.dist.shard,), checkpointing=(cfg.train.activation_checkpointing,),
                  batches=False, warm_up=torch.cuda.is_available())  # fmt: skip
    return round(result.peak() / 2**30, 2)


def runner_case(args: argparse.Namespace, case: str, work: str) -> dict:
    import torch

    import distlib
    from distlib.runner.training.trainer import Trainer

    cfg = runner_config(args, case, work)
    row: dict = {"case": case}
    try:
        row["plan_gib"] = plan_gib(cfg)  # before the process group: the plan starts a fake one
    except Exception as e:  # as at launch: a plan not made leaves the run alone
        row["plan_error"] = f"{type(e).__name__}: {e}"[-500:]
    _, batch, seq = shape(args, case)
    ctx = distlib.init()
    trainer = Trainer(cfg, ctx)
    cuda = ctx.device.type == "cuda"
    try:
        trainer.build()  # on a GPU its warm-up compiles and runs prewarm_steps steps
        x, y = trainer.task.warm_up_batch()
        times = []
        for i in range(args.steps + (0 if cuda else args.warmup)):
            t = time.perf_counter()
            trainer.train_step(x, y)
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
            if i == 0:
                row["first_step_s"] = round(time.perf_counter() - T0, 1)
        step_s = statistics.median(times[-args.steps :])
        model = trainer.model
        row.update(params=sum(p.numel() for p in model.parameters()),
                   trained=sum(p.numel() for p in model.parameters() if p.requires_grad),
                   tokens_per_s=round(batch * seq / step_s), step_ms=round(step_s * 1e3, 1),
                   peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else 0.0)  # fmt: skip
    finally:
        trainer.close()
    return row


def peft_case(args: argparse.Namespace) -> dict:
    """The plain loop: transformers model in bf16, peft's LoRA (adapters in fp32), autocast, compile."""
    import peft
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config, batch, seq = shape(args, "peft-loop")
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    torch.manual_seed(0)
    c = dict(config)
    cfg = AutoConfig.for_model(c.pop("model_type"), **c)
    cfg.use_cache = False
    dtype = torch.bfloat16 if cuda else torch.float32
    with torch.device(device):
        base = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="sdpa")
    lc = peft.LoraConfig(r=LORA["r"], lora_alpha=LORA["alpha"], lora_dropout=LORA["dropout"],
                         target_modules=LORA["target_modules"], task_type="CAUSAL_LM")  # fmt: skip
    model = peft.get_peft_model(base, lc)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=3e-4, weight_decay=0.1, fused=cuda)
    step_model = model if args.tiny else torch.compile(model)

    def step(x: torch.Tensor) -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
            loss = step_model(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    x = torch.randint(32000 if not args.tiny else 512, (batch, seq), device=device)
    row: dict = {"case": "peft-loop"}
    for i in range(max(1, args.warmup)):
        step(x)
        if i == 0:
            sync()
            row["first_step_s"] = round(time.perf_counter() - T0, 1)
    sync()
    times = []
    for _ in range(args.steps):
        t = time.perf_counter()
        step(x)
        sync()
        times.append(time.perf_counter() - t)
    step_s = statistics.median(times)
    row.update(params=sum(p.numel() for p in model.parameters()), trained=sum(p.numel() for p in params),
               tokens_per_s=round(batch * seq / step_s), step_ms=round(step_s * 1e3, 1),
               peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else 0.0)  # fmt: skip
    return row


def child(args: argparse.Namespace) -> int:
    case = args.child
    with tempfile.TemporaryDirectory() as work:
        row = peft_case(args) if case == "peft-loop" else runner_case(args, case, work)
    print("ROW " + json.dumps(row), flush=True)
    return 0


def table(rows: list[dict]) -> str:
    lines = ["| case | params | trained | tokens/s | step ms | peak GiB | planned GiB | first step s |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['case']} | failed: {r['error'][-120:]} | | | | | | |")
            continue
        lines.append(f"| {r['case']} | {r.get('params', 0) / 1e9:.2f}B | {r.get('trained', 0) / 1e6:.1f}M | "
                     f"{r.get('tokens_per_s', '-')} | {r.get('step_ms', '-')} | {r.get('peak_gib', '-')} | "
                     f"{r.get('plan_gib', r.get('plan_error', '-'))} | {r.get('first_step_s', '-')} |")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.lora", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--cases", default=",".join(CASES), help="comma-separated, of: " + ", ".join(CASES))
    p.add_argument("--steps", type=int, default=10, help="timed steps of each")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (the first compiles)")
    p.add_argument("--batch", type=int, default=8, help="sequences a step (the 1B shape)")
    p.add_argument("--seq", type=int, default=2048, help="tokens a sequence (the 1B shape)")
    p.add_argument("--tiny", action="store_true", help="tiny shapes, on the CPU: the check that it runs")
    p.add_argument("--json", default="", help="append every row as a JSON line")
    p.add_argument("--child", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return child(args)
    rows = []
    for case in args.cases.split(","):
        if case not in CASES:
            p.error(f"--cases: {case!r} is none of {', '.join(CASES)}")
        cmd = [sys.executable, "-m", "bench.lora", "--child", case, "--steps", str(args.steps), "--warmup",
               str(args.warmup), "--batch", str(args.batch), "--seq", str(args.seq),
               *(["--tiny"] if args.tiny else [])]  # fmt: skip
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=root)
        found = [line for line in proc.stdout.splitlines() if line.startswith("ROW ")]
        row = json.loads(found[-1][4:]) if found and not proc.returncode else {
            "case": case, "error": " ".join((proc.stdout + proc.stderr)[-1500:].split())}  # fmt: skip
        print(json.dumps(row), flush=True)
        rows.append(row)
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(row) + "\n")
    print(table(rows))
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
