"""Every dense Hugging Face family through the runner against the plain compiled transformers loop,
on one GPU: tokens/s of each, their ratio, one table.

    python -m bench.hf_families                                   # every dense family, 8 x 2048 tokens
    python -m bench.hf_families --families llama,qwen2,gemma2     # some of them
    python -m bench.hf_families --tiny                            # tiny shapes on the CPU (the test)
    python -m bench.hf_families --families gemma3_text --attn flex_attention   # another attention, both sides
    python -m bench.hf_families --families gemma3_text --runner-attn flex_attention   # the runner's alone
    python -m bench.hf_families --plan-only                       # each recipe's memory plan, any machine
    python -m bench.hf_families --families llama --titan          # and torchtitan on the Llama shape
    python -m bench.hf_families --families gemma --profile 3      # and where each side's step goes

For each family, in a process of its own: the model of ``SHAPES[family]`` (the config of a released
0.5-3B checkpoint of that family, or that family's layer at a 1-2B size where none is released:
the table says which) is trained

1. by ``bench/baselines/hf_loop.py`` on that config, batch and attention (the runner's default for
   the family), in a process of its own: ``model(input_ids=x, labels=x).loss`` under bf16 autocast,
   fused AdamW, clipping, ``torch.compile(model)``;
2. then by the runner, in the family's process: a recipe of ``model.name: hf_causal_lm`` with that
   config, bf16, AdamW, clipping, each decoder layer compiled (``train.compile=blocks``; the whole
   model with ``--runner-compile model``), one GPU,
   random token ids in a token file; ``Trainer.build`` as launch.py runs it (the model, the step,
   its warm-up), then ``--steps`` timed calls of the trainer's own ``train_step`` on one batch (the
   schedule included; no evaluation or checkpoint).

Both print tokens/s from the median step (each step timed to a sync: the ``ratio``), and from as many
steps again back to back with one sync at the end, where the host may run ahead of the GPU as in a
training run that reads nothing back each step (``run_ratio``; the table's "back to back"). MFU
counts the runner's FLOPs per token (6 per weight of the matrix products, attention's 6 * layers *
heads * (qk + v head dims) * sequence). Every row is
a JSON line in ``--json``; the table comes last. The run of every family takes 1.5 to 4 minutes on
an H200 (the baseline's whole-model compile is most of it): ``--families`` splits the families over
calls.

With ``--titan``, the llama family's process also runs ``bench/baselines/titan_llama.py`` (torchtitan's
own trainer on its llama3 1B flavor, the same shape, batch and steps; its wheels installed) before the
runner, and the row has its tokens/s and the runner's ratio to it.

With ``--profile N``, each side then runs N more steps under torch.profiler, and the row has each
side's kernel time a step by kind of work (``bench.kernel_split``: attention, matmul, norm, loss,
optimizer, copy, other) and its costliest kernels; a table a family, after the main one, sets the
two sides' kinds side by side, then each side's timed step and the part of it in which the GPU ran
no kernel (the step less the kernels: where a side waits on its host).

Before the runner's build, the family's process plans the recipe's memory (``distlib.runner.plan``, on
fake tensors; the warm-up's copy of the weights included on a GPU): the row has it beside the peak the
runner then takes (``torch.cuda.max_memory_allocated`` over the build, the warm-up and the steps).
BENCHMARKS.md, "Hugging Face families" and "Memory plan".
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

if __package__ in (None, ""):  # run as `python bench/hf_families.py`: the repository root on the path
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import kernel_split  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}  # fmt: skip


def rope(theta: float) -> dict:
    """Plain rotary embeddings of base ``theta``, in transformers 5's form."""
    return {"rope_type": "default", "rope_theta": theta}


# family -> (what the shape is, its config); batch x sequence 8 x 2048 unless SEQ says otherwise
SHAPES: dict[str, tuple[str, dict]] = {
    "llama": ("Llama-3.2-1B", dict(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64, max_position_embeddings=131072, rms_norm_eps=1e-5,
        rope_parameters=LLAMA3_ROPE, tie_word_embeddings=True)),
    "mistral": ("Mistral layer, 16 x 2048 (1.2B)", dict(
        vocab_size=32768, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64, max_position_embeddings=32768, sliding_window=None,
        tie_word_embeddings=False)),
    "qwen2": ("Qwen2.5-0.5B", dict(
        vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
        num_key_value_heads=2, max_position_embeddings=32768, rms_norm_eps=1e-6, rope_parameters=rope(1e6),
        tie_word_embeddings=True)),
    "qwen3": ("Qwen3-0.6B", dict(
        vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, max_position_embeddings=40960, rms_norm_eps=1e-6,
        rope_parameters=rope(1e6), tie_word_embeddings=True)),
    "gemma": ("Gemma-2B", dict(
        vocab_size=256000, hidden_size=2048, intermediate_size=16384, num_hidden_layers=18, num_attention_heads=8,
        num_key_value_heads=1, head_dim=256, max_position_embeddings=8192, hidden_act="gelu_pytorch_tanh",
        tie_word_embeddings=True)),
    "gemma2": ("Gemma-2-2B", dict(
        vocab_size=256000, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26, num_attention_heads=8,
        num_key_value_heads=4, head_dim=256, max_position_embeddings=8192, sliding_window=4096,
        attn_logit_softcapping=50.0, final_logit_softcapping=30.0, query_pre_attn_scalar=256,
        tie_word_embeddings=True)),
    "gemma3_text": ("Gemma-3-1B", dict(
        vocab_size=262144, hidden_size=1152, intermediate_size=6912, num_hidden_layers=26, num_attention_heads=4,
        num_key_value_heads=1, head_dim=256, max_position_embeddings=32768, sliding_window=512,
        query_pre_attn_scalar=256, tie_word_embeddings=True)),
    "phi3": ("Phi-3-mini layer, 16 of its 32 (1.9B)", dict(
        vocab_size=32064, hidden_size=3072, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=32, max_position_embeddings=4096, pad_token_id=32000, bos_token_id=1, eos_token_id=32000,
        tie_word_embeddings=False)),
    "olmo2": ("OLMo-2-1B", dict(
        vocab_size=100352, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=16,
        num_key_value_heads=16, max_position_embeddings=4096, rms_norm_eps=1e-6, rope_parameters=rope(500000.0),
        pad_token_id=100277, bos_token_id=None, eos_token_id=100257, tie_word_embeddings=False)),
    "gpt2": ("GPT-2 large (774M)", dict(
        vocab_size=50257, n_embd=1280, n_layer=36, n_head=20, n_positions=1024)),
    "gpt_neox": ("Pythia-1B", dict(
        vocab_size=50304, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=8,
        rotary_pct=0.25, max_position_embeddings=2048, tie_word_embeddings=False)),
    "granite": ("Granite-3.1-2B", dict(
        vocab_size=49155, hidden_size=2048, intermediate_size=8192, num_hidden_layers=40, num_attention_heads=32,
        num_key_value_heads=8, max_position_embeddings=131072, rope_parameters=rope(5e6), embedding_multiplier=12.0,
        logits_scaling=8.0, residual_multiplier=0.22, attention_multiplier=0.015625, pad_token_id=0,
        bos_token_id=0, eos_token_id=0, tie_word_embeddings=True)),
}  # fmt: skip
# gpt2: its 1024 positions, the same tokens a step. gemma2: its soft-capped scores need eager attention,
# which keeps (batch, heads, T, T) scores for the backward: at 8 x 2048 the compiled loop needs more
# than an H200's 141 GB (and the runner peaks at 133.5 GiB), so both run half the batch
SEQ = {"gpt2": (16, 1024), "gemma2": (4, 2048)}
TOKEN_IDS = 32000  # random ids below every family's vocabulary
PEAK = 989e12  # dense bf16 FLOP/s of an H100/H200
TINY = dict(vocab_size=TOKEN_IDS, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, max_position_embeddings=64)  # fmt: skip


def tiny_shape(family: str) -> dict:
    """A small config of ``family``: the keys of its shape, at tiny sizes."""
    if family == "gpt2":
        return dict(vocab_size=TOKEN_IDS, n_embd=32, n_layer=2, n_head=4, n_positions=64)
    _, shape = SHAPES[family]
    out = {k: v for k, v in shape.items() if k not in TINY and k != "rope_parameters"}
    out.update({k: v for k, v in TINY.items() if k in shape})
    if "num_key_value_heads" in shape:
        out["num_key_value_heads"] = min(shape["num_key_value_heads"], 4)
    for k in ("pad_token_id", "bos_token_id", "eos_token_id"):
        if out.get(k) is not None:
            out[k] = 0
    return out


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.hf_families", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--families", default=",".join(SHAPES), help="comma-separated, of: " + ", ".join(SHAPES))
    p.add_argument("--steps", type=int, default=8, help="timed steps of each")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (the baseline's first compiles)")
    p.add_argument("--batch", type=int, default=8, help="sequences a step")
    p.add_argument("--seq", type=int, default=2048, help="tokens a sequence")
    p.add_argument(
        "--attn", default="auto", help="attn_implementation of both sides (auto: the runner's default for the family)"
    )
    p.add_argument(
        "--runner-attn",
        default="",
        help="attn_implementation of the runner alone (default: --attn's); the loop keeps --attn",
    )
    p.add_argument(
        "--runner-compile",
        default="blocks",
        choices=("blocks", "model"),
        help="the runner's train.compile: each decoder layer (the recipes' default) or the whole model",
    )
    p.add_argument("--json", default=os.path.join(ROOT, ".bench", "out", "hf_families.jsonl"))
    p.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU, 2 steps (the test)")
    p.add_argument(
        "--plan-only",
        action="store_true",
        help="the memory plan of each family's recipe alone, on any machine (as for a GPU run)",
    )
    p.add_argument(
        "--gpu-gib",
        type=float,
        default=0.0,
        help="the memory the plan fits each family's batch to (default: the GPU's; none on the CPU)",
    )
    p.add_argument("--profile", type=int, default=0, help="then N steps of each side under torch.profiler")
    p.add_argument("--titan", action="store_true", help="also torchtitan on the Llama shape (llama's row; a GPU)")
    p.add_argument("--child", default="", help=argparse.SUPPRESS)
    p.add_argument("--work", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.families = [f for f in args.families.split(",") if f]
    args.fitted = 0  # the batch the memory plan fits on the card (plan_row), once planned
    unknown = [f for f in args.families if f not in SHAPES]
    if unknown:
        p.error(f"--families: unknown {', '.join(unknown)} (known: {', '.join(SHAPES)})")
    if args.tiny:
        args.steps, args.warmup, args.batch, args.seq = 2, 1, 2, 32
    if args.titan and "llama" not in args.families:
        p.error("--titan runs on the llama family's row: add llama to --families")
    if args.titan and (args.tiny or args.plan_only):
        p.error("--titan: torchtitan trains on a GPU only (its flex attention has no backward on the CPU)")
    return args


def config_of(args: argparse.Namespace, family: str) -> dict:
    return {"model_type": family, **(tiny_shape(family) if args.tiny else SHAPES[family][1])}


def batch_of(args: argparse.Namespace, family: str) -> tuple[int, int]:
    """Sequences a step and tokens a sequence: the family's, or the batch its memory plan fits."""
    batch, seq = (args.batch, args.seq) if args.tiny else SEQ.get(family, (args.batch, args.seq))
    return args.fitted or batch, seq


def token_file(directory: str, n: int) -> str:
    import numpy as np

    path = os.path.join(directory, "tokens.bin")
    np.random.default_rng(0).integers(0, TOKEN_IDS, n, dtype=np.uint32).tofile(path)
    return path


def runner_config(args: argparse.Namespace, family: str, work: str):  # noqa: ANN201  (a runner Config)
    """The recipe the runner trains ``family`` with: its token file and recipe written into ``work``."""
    import yaml

    from distlib.runner.config import load_config

    batch, seq = batch_of(args, family)
    data = token_file(work, max(200_000, 40 * batch * seq))  # its 1% for validation: a few windows
    recipe = {
        "data": {"name": "token_file", "root": data, "args": {"block_size": seq, "dtype": "uint32",
                                                               "val_frac": 0.01}},
        "model": {"name": "hf_causal_lm", "args": {"config": config_of(args, family),
                                                   "attn_implementation": args.runner_attn or args.attn}},
        "train": {"epochs": 1, "batch_size": batch, "optimizer": "adamw", "lr": 3e-4, "weight_decay": 0.1,
                  "label_smoothing": 0.0, "warmup_frac": 0.0, "precision": "bf16", "clip_grad_norm": 1.0,
                  "compile": args.runner_compile, "sample_tokens": 0, "prewarm_steps": args.warmup},
        "run": {"out_dir": os.path.join(work, "run"), "resume": False, "progress": "plain"},
    }  # fmt: skip
    path = os.path.join(work, "recipe.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(recipe, f)
    return load_config(path, ["train.compile=none", "train.compile_backend=inductor"] if args.tiny else [])


def plan_row(args: argparse.Namespace, family: str, work: str) -> dict:
    """The memory plan of the runner's recipe (``distlib.runner.plan``, fake tensors on the CPU): one
    rank's peak, the warm-up's copy of the weights included where the runner warms up (a GPU). On a
    GPU (or with ``--gpu-gib``) the batch is halved until the plan says the run fits the card, with
    the runner's own margin, down to 1 sequence: both sides then run at that batch (``args.fitted``,
    the row's ``batch``), as a user of the card would."""
    import torch

    from distlib.runner.training.memory_plan import device_bytes, plan

    gpu = int(args.gpu_gib * 2**30) if args.gpu_gib else None if args.tiny else device_bytes()
    t0 = time.perf_counter()
    while True:
        cfg = runner_config(args, family, work)
        result = plan(cfg, 1, gpu_bytes=gpu, shards=(cfg.dist.shard,),
                      checkpointing=(cfg.train.activation_checkpointing,), batches=False,
                      warm_up=torch.cuda.is_available() or args.plan_only)  # fmt: skip
        batch = cfg.train.batch_size
        if result.fits() is not False or batch == 1:
            break
        args.fitted = batch // 2
    return {"batch": batch, "plan_gib": round(result.peak() / 2**30, 2), "plan_fits": result.fits(),
            "plan_s": round(time.perf_counter() - t0, 1)}  # fmt: skip


def runner_row(args: argparse.Namespace, family: str, work: str) -> dict:
    """The runner's trainer on ``family``, in this process: its build (warm-up included) and timed steps."""
    import torch

    import distlib
    from distlib.runner.observability.timeline import Timeline
    from distlib.runner.training.trainer import Trainer

    batch, seq = batch_of(args, family)
    cfg = runner_config(args, family, work)
    timeline = Timeline(time.time())  # the build's stages from here (the process group's is "init")
    ctx = distlib.init()
    timeline.mark("init")
    t0 = time.perf_counter()
    trainer = Trainer(cfg, ctx, timeline)
    try:
        trainer.build()
        build_s = time.perf_counter() - t0
        x, y = trainer.task.warm_up_batch()
        cuda = ctx.device.type == "cuda"
        times = []
        for _ in range(args.steps + (0 if cuda else args.warmup)):
            t = time.perf_counter()
            trainer.train_step(x, y)
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
        step_s = statistics.median(times[-args.steps :])
        t = time.perf_counter()  # the same steps back to back, one sync: the host may run ahead, as in a run
        for _ in range(args.steps):
            trainer.train_step(x, y)
        if cuda:
            torch.cuda.synchronize()
        run_s = (time.perf_counter() - t) / args.steps
        profiled = {}
        if args.profile:  # after the timed steps: the profiler's own cost stays out of them
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
                for _ in range(args.profile):
                    trainer.train_step(x, y)
                if cuda:
                    torch.cuda.synchronize()
            profiled["runner_profile"] = kernel_split.split(kernel_split.entries(prof), args.profile)
        model = trainer.model
        flops = model.flops_per_token(seq)
        mem = torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0
        return {"family": family, "params": model.num_params(), "attn": model.config._attn_implementation, "cuda": cuda,
                "runner_tokens_per_s": round(batch * seq / step_s),
                "runner_run_tokens_per_s": round(batch * seq / run_s), "tokens_per_step": batch * seq,
                "runner_build_s": round(build_s, 1),
                "runner_stages": {k: round(v, 2) for k, v in timeline.stages.items()},
                "flops_per_token": flops, "runner_peak_gib": round(mem, 2), **profiled}  # fmt: skip
    finally:
        trainer.close()


def result_fields(cmd: list[str]) -> dict[str, str] | str:
    """Runs a baseline script: the ``key=value`` fields of the line it prints starting with RESULT, or
    (it failed) the tail of its output."""
    proc = subprocess.run(cmd, capture_output=True, text=True)
    found = re.search(r"RESULT .*", proc.stdout)
    if proc.returncode or not found:
        return (proc.stdout + proc.stderr)[-1500:]
    return dict(kv.split("=", 1) for kv in found.group(0).split()[1:])


def baseline_row(args: argparse.Namespace, family: str, attn: str, work: str) -> dict:
    """bench/baselines/hf_loop.py on the same config, batch and attention, in its own process. Out of
    memory at that batch, it runs again at half the batch (down to 1 sequence), the batch it ran at
    in the row (``baseline_batch``): the loop's best on the card, where the runner fits the larger."""
    first = batch = batch_of(args, family)[0]
    while True:
        out = _baseline_at(args, family, attn, work, batch)
        if "OutOfMemoryError" not in out.get("baseline_error", "") or batch == 1:
            break
        batch //= 2
    if batch != first:
        out["baseline_batch"] = batch
    return out


def _baseline_at(args: argparse.Namespace, family: str, attn: str, work: str, batch: int) -> dict:
    _, seq = batch_of(args, family)
    path = os.path.join(work, "baseline.json")
    with open(path, "w") as f:
        json.dump(config_of(args, family), f)
    cmd = [sys.executable, os.path.join(ROOT, "bench", "baselines", "hf_loop.py"), "--config-json", path,
           "--batch", str(batch), "--seq", str(seq), "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--attn", attn, *(["--no-compile"] if args.tiny else [])]  # fmt: skip
    profile = os.path.join(work, "baseline_profile.json")
    if args.profile:
        cmd += ["--profile-json", profile, "--profile-steps", str(args.profile)]
    fields = result_fields(cmd)
    if isinstance(fields, str):
        return {"baseline_error": fields}
    out = {"baseline_tokens_per_s": float(fields["tokens_per_s"]),
           "baseline_run_tokens_per_s": float(fields["run_tokens_per_s"]), "baseline_attn": fields["attn"],
           "baseline_first_step_s": float(fields["first_step_s"]),
           "baseline_peak_gib": float(fields["peak_mem_gib"])}  # fmt: skip
    if args.profile:
        with open(profile) as f:
            written = json.load(f)
        out["baseline_profile"] = kernel_split.split(written["rows"], written["steps"])
    return out


def titan_row(args: argparse.Namespace) -> dict:
    """bench/baselines/titan_llama.py (torchtitan, its llama3 1B flavor) at the same batch and steps,
    in its own process."""
    batch, seq = batch_of(args, "llama")
    cmd = [sys.executable, os.path.join(ROOT, "bench", "baselines", "titan_llama.py"), "--batch", str(batch),
           "--seq", str(seq), "--steps", str(args.steps), "--warmup", str(args.warmup)]  # fmt: skip
    fields = result_fields(cmd)
    if isinstance(fields, str):
        return {"titan_error": fields}
    return {"titan_tokens_per_s": float(fields["tokens_per_s"]), "titan_mode": fields["mode"],
            "titan_params": int(fields["params"]), "titan_peak_gib": float(fields["peak_mem_gib"]),
            "titan_first_step_s": float(fields["first_step_s"]), "titan_shimmed": fields["shimmed"]}  # fmt: skip


def child(args: argparse.Namespace) -> int:
    family = args.child
    with tempfile.TemporaryDirectory(dir=args.work or None) as work:
        row = {"family": family, "shape": "tiny" if args.tiny else SHAPES[family][0]}
        if args.runner_compile != "blocks":
            row["runner_compile"] = args.runner_compile
        try:  # first: the batch the card holds (the plan starts a fake process group: before the real one)
            row.update(plan_row(args, family, work))
        except Exception as e:  # as at launch, a plan not made leaves the run itself alone
            row["plan_error"] = f"{type(e).__name__}: {e}"[-1500:]
        # the baseline next, in its own process: this one holds nothing on the GPU meanwhile
        # (auto: the same attention as the runner's default, which the row's "attn" shows)
        if not args.plan_only:
            row.update(baseline_row(args, family, args.attn, work))
            if args.titan and family == "llama":
                row.update(titan_row(args))
            try:
                row.update(runner_row(args, family, work))
            except Exception as e:  # the row says so; the other families still run
                row["runner_error"] = f"{type(e).__name__}: {e}"[-1500:]
    if "runner_tokens_per_s" in row and "baseline_tokens_per_s" in row:
        row["ratio"] = round(row["runner_tokens_per_s"] / row["baseline_tokens_per_s"], 3)
        row["run_ratio"] = round(row["runner_run_tokens_per_s"] / row["baseline_run_tokens_per_s"], 3)
    if "runner_tokens_per_s" in row and "titan_tokens_per_s" in row:
        row["titan_ratio"] = round(row["runner_tokens_per_s"] / row["titan_tokens_per_s"], 3)
    print("ROW " + json.dumps(row), flush=True)
    return 0


def table(rows: list[dict]) -> str:
    """The markdown table of ``rows``: a failed side says so."""
    lines = ["| family | shape | attention | params | batch | runner tok/s | hf_loop compiled tok/s | ratio "
             "| back to back: runner / loop tok/s, ratio | runner MFU | runner peak GiB | planned GiB |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        tps, base = r.get("runner_tokens_per_s"), r.get("baseline_tokens_per_s")
        mfu = f"{tps * r['flops_per_token'] / PEAK:.1%}" if tps and r.get("cuda") else "-"
        params = f"{r['params'] / 1e9:.2f}B" if "params" in r else "-"
        peak = r.get("runner_peak_gib") if r.get("cuda") else None
        attn = r.get("attn", "-")
        if r.get("baseline_attn", attn) != attn:  # --runner-attn: the runner's / the loop's
            attn = f"{attn} / {r['baseline_attn']}"
        runner = tps or ("failed" if "runner_error" in r or "error" in r else "-")  # "-": not run (--plan-only)
        baseline = round(base) if base else "failed" if "baseline_error" in r else "-"
        if base and "baseline_batch" in r:  # out of memory at the runner's batch: the batch it ran at
            baseline = f"{baseline} (batch {r['baseline_batch']})"
        family = r["family"] + (f" (compile={r['runner_compile']})" if "runner_compile" in r else "")
        run = (f"{r['runner_run_tokens_per_s']} / {round(r['baseline_run_tokens_per_s'])}, {r['run_ratio']}"
               if "run_ratio" in r else "-")  # fmt: skip
        lines.append(f"| {family} | {r['shape']} | {attn} | {params} | {r.get('batch', '-')} | {runner} | "
                     f"{baseline} | {r.get('ratio', '-')} | {run} | {mfu} | {peak or '-'} | "
                     f"{r.get('plan_gib', 'failed' if 'plan_error' in r else '-')} |")  # fmt: skip
    staged = [r for r in rows if "runner_stages" in r]
    if staged:  # where the runner's build goes: the stages launch.py times after its memory check
        names = list(dict.fromkeys(k for r in staged for k in r["runner_stages"]))
        lines += ["", "| family | " + " | ".join(f"{n} s" for n in names) + " | build s |",
                  "|---|" + "---|" * (len(names) + 1)]  # fmt: skip
        for r in staged:
            cells = [str(r["runner_stages"].get(n, "-")) for n in names]
            lines.append(f"| {r['family']} | " + " | ".join(cells) + f" | {r['runner_build_s']} |")
    for r in rows:
        if "titan_tokens_per_s" in r:
            tps, ratio = round(r["titan_tokens_per_s"]), r.get("titan_ratio", "-")
            lines.append(f"\n{r['titan_mode']} on the {r['family']} shape: {tps} tok/s, "
                         f"peak {r['titan_peak_gib']} GiB; the runner / torchtitan: {ratio}")  # fmt: skip
        elif "titan_error" in r:
            lines.append(f"\ntorchtitan on the {r['family']} shape: failed (the row's titan_error)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.child:
        return child(args)
    rows = []
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    for family in args.families:
        cmd = [sys.executable, "-m", "bench.hf_families", "--child", family, "--steps", str(args.steps),
               "--warmup", str(args.warmup), "--batch", str(args.batch), "--seq", str(args.seq),
               "--attn", args.attn, "--runner-attn", args.runner_attn, "--profile", str(args.profile),
               "--gpu-gib", str(args.gpu_gib), "--runner-compile", args.runner_compile,
               *(["--tiny"] if args.tiny else []), *(["--titan"] if args.titan else []),
               *(["--plan-only"] if args.plan_only else [])]  # fmt: skip
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        found = re.search(r"^ROW (.*)$", proc.stdout, re.M)
        row = json.loads(found.group(1)) if found else {"family": family, "shape": "?", "error": proc.stderr[-1500:]}
        row["wall_s"] = round(time.perf_counter() - t0, 1)
        print(json.dumps(row), flush=True)
        for key in ("plan_error", "runner_error", "baseline_error", "titan_error", "error"):
            if key in row:
                print(f"{family} {key}:\n{row[key]}", file=sys.stderr, flush=True)
        with open(args.json, "a") as f:
            f.write(json.dumps(row) + "\n")
        rows.append(row)
    print()
    print(table(rows))
    for r in rows:
        if "runner_profile" in r and "baseline_profile" in r:
            on = r["runner_profile"]["on"]
            print(f"\n{r['family']}: kernel time a step by kind ({on}, {args.profile} profiled steps a side)\n")
            steps = [r["tokens_per_step"] / r[k] * 1e3 if r.get(k) else None
                     for k in ("runner_tokens_per_s", "baseline_tokens_per_s")]  # fmt: skip
            print(kernel_split.table(r["runner_profile"], r["baseline_profile"], step_ms=steps))
    ok = all(("plan_gib" if args.plan_only else "ratio") in r for r in rows)
    return 0 if ok and not any("titan_error" in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
