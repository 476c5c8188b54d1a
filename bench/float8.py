"""Float8 training on one GPU: the runner's ``train.precision=fp8`` next to bf16 and to a plain torchao loop,
in one process, each figure beside its bf16 run.

    python -m bench.float8                                  # the table: 3 models, bf16/tensorwise/rowwise, 2 loops
    python -m bench.float8 --models gpt4096 --precisions bf16,tensorwise
    python -m bench.float8 --curve --out $OUT               # Shakespeare loss curves, bf16 (2 seeds) and fp8, a plot
    python -m bench.float8 --tiny                           # tiny sizes on the CPU, float8 emulated (the test)

Models (``--models``): ``gpt4096`` (the project's GPT, 16 layers x 4096, vocabulary 50304, 4 x 2048 tokens a
step), ``llama1b`` (recipes/llama_1b.yaml's Llama-3.2-1B shape through ``hf_causal_lm``, 8 x 2048), ``gpt1.5b``
(48 x 1600, 16 x 1024). Loops (``--loops``):

- ``runner``: the runner's own training step, built in this process as launch.py builds it
  (``Trainer.build``: model, ``train.precision``/``train.fp8_recipe`` with the default layer rule
  ``train.fp8_layers=auto`` or ``--fp8-layers``, ``train.compile=blocks``, fused AdamW, gradients clipped
  to 1, the warm-up), random tokens in a token file, ``dist.shard=none``; then ``--steps`` calls of the
  step on one batch;
- ``plain``: torchao's float8 training as its documentation writes it: the same model built on the GPU, torchao's
  ``convert_to_float8_training`` on every Linear but the output layer, each block compiled, bf16 autocast,
  fused AdamW, the same clipping, a plain cross-entropy.

Each row: the median step over ``--steps`` timed steps after ``--warmup`` untimed ones (compilation happens
there), tokens/s, MFU against the GPU's dense bf16 peak (989 TFLOP/s on H100/H200; the FLOPs are the model's,
whatever the precision), the timed steps' peak memory (not the runner's warm-up, which copies the
weights), and the speed-up over the same loop's bf16 row. Rows are JSON lines
(``--json``), the table last. BENCHMARKS.md, "Float8 training".

``--curve``: ``recipes/gpt_shakespeare.yaml`` at ``--curve-size`` (24 x 1024 by default, 302M parameters, bytes)
for ``--curve-steps`` steps of 16 x 512 bytes through the runner's whole run (``Trainer.fit``, no final
checkpoint), bf16 with seeds 0 and 1 (the noise) and fp8 (``--curve-recipe``) with seed 0, evaluated
``--curve-evals`` times (20); the validation losses of the three in a table and a plot (``float8_curve.png``
in ``--out``). ``--curve-jobs 3`` runs the three at once, each in a process of its own (the losses are the
same; the tokens/s, shared, are not one run's).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

if __package__ in (None, ""):  # run as `python bench/float8.py`: the repository root on the path
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from bench import rows as rows_  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "GH200": 989.0, "H800": 989.0}  # dense bf16
PRECISIONS = ("bf16", "tensorwise", "rowwise")
LOOPS = ("runner", "plain")
# name: (recipe, model.args overrides, sequences a step, tokens a sequence, vocabulary)
MODELS = {
    "gpt4096": ("gpt", dict(n_layer=16, n_head=32, n_embd=4096), 4, 2048, 50304),
    "llama1b": ("llama_1b", {}, 8, 2048, 128256),
    "gpt1.5b": ("gpt", dict(n_layer=48, n_head=25, n_embd=1600), 16, 1024, 50304),
}
TINY_MODELS = {
    "gpt4096": ("gpt", dict(n_layer=2, n_head=2, n_embd=64), 2, 32, 256),
    "llama1b": ("llama_demo", {}, 2, 32, 512),
    "gpt1.5b": ("gpt", dict(n_layer=3, n_head=2, n_embd=32), 2, 32, 256),
}


def _models(args: argparse.Namespace) -> dict:
    return TINY_MODELS if args.tiny else MODELS


def _sync(device: torch.device) -> None:
    rows_.sync(device.type)


def _peak_tflops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_TFLOPS.items() if k in name), None)


def _clear(device: torch.device) -> None:
    """Nothing of the last row left: its compiled graphs (dynamo counts recompilations of a block's code
    across rows, and falls back to eager past its limit), its tensors, the allocator's peak."""
    import torch._dynamo
    from torch._inductor import config as inductor_config

    torch._dynamo.reset()
    inductor_config.emulate_precision_casts = False  # torch's default, which rowwise rows turn on for themselves
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


# ---- the runner --------------------------------------------------------------------------------------
def token_file(directory: str, n: int, vocab: int) -> str:
    import numpy as np

    from distlib.runner.data.token_files import write_token_file

    path = os.path.join(directory, f"tokens-{vocab}-{n}.bin")
    if not os.path.exists(path):
        tokens = np.random.default_rng(0).integers(0, vocab, n, dtype=np.int64)
        write_token_file(path, tokens, dtype="uint16" if vocab <= 1 << 16 else "uint32", header=True)
    return path


def runner_overrides(args: argparse.Namespace, model: str, precision: str, data: str, out: str) -> tuple[str, list]:
    recipe, model_args, batch, seq, vocab = _models(args)[model]
    overrides = [
        "data.name=token_file", f"data.root={data}", "data.train_subset=0", f"data.args.block_size={seq}",
        f"train.batch_size={batch}", "train.epochs=1", "train.sample_tokens=0", "train.optimizer=adamw",
        "train.clip_grad_norm=1.0", "train.compile=blocks", f"train.compile_backend={args.compile_backend}",
        f"train.prewarm_steps={args.warmup}", f"run.out_dir={out}", "run.resume=false", "run.progress=plain",
        f"train.fp8_layers={args.fp8_layers}",
        "dist.shard=none",
        *(["train.precision=bf16"] if precision == "bf16" else
          ["train.precision=fp8", f"train.fp8_recipe={precision}"]),
    ]  # fmt: skip
    if recipe == "gpt":
        overrides += [f"model.args.{k}={v}" for k, v in {**model_args, "vocab_size": vocab, "dropout": 0.0}.items()]
        recipe = "gpt_tokens_demo"
    return os.path.join(ROOT, "recipes", f"{recipe}.yaml"), overrides


def run_runner(args: argparse.Namespace, model: str, precision: str, device: torch.device) -> dict:
    from distlib.distributed.process_group import Context
    from distlib.runner.config import load_config
    from distlib.runner.observability.timeline import Timeline
    from distlib.runner.training.trainer import Trainer

    _, _, batch, seq, vocab = _models(args)[model]
    n = (args.warmup + args.steps + 8) * batch * seq * 2
    data = token_file(args.dir, n, vocab)
    recipe, overrides = runner_overrides(args, model, precision, data, os.path.join(args.dir, "run"))
    cfg = load_config(recipe, overrides)
    # world size 1 without a process group, as launch.py's one process (bench.hf_io builds it alike)
    ctx = Context(rank=0, local_rank=0, world_size=1, local_world_size=1, device=device, backend="none")
    trainer = Trainer(cfg, ctx, Timeline())
    try:
        trainer.build()  # on a GPU with the warm-up: the compilation and the first steps, undone
        x, y = trainer.task.warm_up_batch()
        times = _times(lambda: trainer.step_fn(x, y), args, device, warm=device.type != "cuda")
        flops = trainer.model.flops_per_token(seq)
        layers = sum(type(m).__name__ == "Float8Linear" for m in trainer.model.modules())
    finally:
        trainer.close()
    return {"step_s": statistics.median(times), "flops_per_token": flops, "float8_layers": layers}


# ---- the plain loop ----------------------------------------------------------------------------------
def _plain_model(args: argparse.Namespace, model: str, device: torch.device) -> tuple[nn.Module, list, callable]:
    """The model on the device, its blocks, and ``logits(x)``."""
    recipe, model_args, _, seq, vocab = _models(args)[model]
    if recipe == "gpt":
        from distlib.runner.models.gpt import GPT, GPTConfig

        with torch.device(device):
            net = GPT(GPTConfig(vocab_size=vocab, block_size=seq, **model_args))
        return net, list(net.blocks), net
    import yaml
    from transformers import AutoConfig, AutoModelForCausalLM

    with open(os.path.join(ROOT, "recipes", f"{recipe}.yaml")) as f:
        config = dict(yaml.safe_load(f)["model"]["args"]["config"])
    config = AutoConfig.for_model(config.pop("model_type"), **config)
    config.use_cache = False
    with torch.device(device):
        net = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    return net, list(net.model.layers), lambda x: net(input_ids=x).logits


def run_plain(args: argparse.Namespace, model: str, precision: str, device: torch.device) -> dict:
    _, _, batch, seq, vocab = _models(args)[model]
    torch.manual_seed(0)
    net, blocks, logits = _plain_model(args, model, device)
    layers = 0
    if precision != "bf16":
        import dataclasses

        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        config = dataclasses.replace(Float8LinearConfig.from_recipe_name(precision), emulate=device.type != "cuda")
        if precision == "rowwise":
            from torch._inductor import config as inductor_config

            inductor_config.emulate_precision_casts = True  # as torchtitan sets it
        convert_to_float8_training(net, config=config, module_filter_fn=lambda m, fqn: fqn != "lm_head")
        layers = sum(type(m).__name__ == "Float8Linear" for m in net.modules())
    for block in blocks:
        block.compile(backend=args.compile_backend)
    cuda = device.type == "cuda"
    opt = torch.optim.AdamW(net.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=cuda or None)
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randint(0, vocab, (batch, seq + 1), device=device, generator=g)
    x, y = x[:, :-1].contiguous(), x[:, 1:].contiguous()

    def step() -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
            out = logits(x)
        F.cross_entropy(out.flatten(0, 1).float(), y.flatten()).backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)

    times = _times(step, args, device, warm=True)
    if hasattr(net, "flops_per_token"):
        flops = net.flops_per_token(seq)
    else:  # the runner's count for a transformers model
        from distlib.runner.models.hf_causal_lm import HFCausalLM

        flops = HFCausalLM(net).flops_per_token(seq)
    return {"step_s": statistics.median(times), "flops_per_token": flops, "float8_layers": layers}


def _times(step, args: argparse.Namespace, device: torch.device, warm: bool) -> list[float]:
    """Seconds of each of ``--steps`` steps, after ``--warmup`` untimed ones when ``warm`` (the runner's
    warm-up already ran them on a GPU); the peak memory is the timed steps'."""
    for _ in range(args.warmup if warm else 1):
        step()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for _ in range(args.steps):
        _sync(device)
        t = time.perf_counter()
        step()
        _sync(device)
        times.append(time.perf_counter() - t)
    return times


def one_row(args: argparse.Namespace, model: str, loop: str, precision: str, device: torch.device) -> dict:
    _, _, batch, seq, _ = _models(args)[model]
    row: dict = {"model": model, "loop": loop, "precision": precision}
    _clear(device)
    t0 = time.perf_counter()
    try:
        got = (run_runner if loop == "runner" else run_plain)(args, model, precision, device)
    except Exception as e:  # noqa: BLE001  # a row that fails (out of memory) is reported; the rest go on
        oom = "out of memory" in str(e).lower() or isinstance(e, torch.cuda.OutOfMemoryError)
        row["note"] = "OOM" if oom else f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        return row
    finally:
        row["row_s"] = round(time.perf_counter() - t0, 1)
    tokens_per_s = batch * seq / got["step_s"]
    row.update(tokens_per_s=round(tokens_per_s, 1), step_ms=round(got["step_s"] * 1e3, 2),
               float8_layers=got["float8_layers"])  # fmt: skip
    if (peak := _peak_tflops(device)) is not None:
        row["mfu"] = round(got["flops_per_token"] * tokens_per_s / (peak * 1e12), 4)
    if device.type == "cuda":
        row["peak_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 1)
    return row


def table(rows: list[dict]) -> str:
    out = ["| model | loop | precision | float8 layers | tokens/s | × bf16 | MFU | peak GiB | note |",
           "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    base = {(r["model"], r["loop"]): r.get("tokens_per_s") for r in rows if r["precision"] == "bf16"}
    for r in rows:
        tps, ref = r.get("tokens_per_s"), base.get((r["model"], r["loop"]))
        ratio = f"{tps / ref:.3f}" if tps and ref else ""
        mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") is not None else ""
        head = f"| {r['model']} | {r['loop']} | {r['precision']} |"
        if tps:
            peak = r.get("peak_gib", "")
            out.append(
                f"{head} {r.get('float8_layers', '')} | {tps:,.0f} | {ratio} | {mfu} | {peak} | {r.get('note', '')} |"
            )
        else:
            out.append(f"{head} | | | | | {r.get('note', '')} |")
    # the runner against the plain loop, precision by precision
    pairs = []
    for r in rows:
        if r["loop"] == "runner" and r.get("tokens_per_s"):
            plain = next((p for p in rows if p["loop"] == "plain" and p["model"] == r["model"]
                          and p["precision"] == r["precision"] and p.get("tokens_per_s")), None)  # fmt: skip
            if plain:
                ratio = r["tokens_per_s"] / plain["tokens_per_s"]
                pairs.append(f"{r['model']} {r['precision']}: runner / plain {ratio:.3f}")
    return "\n".join(out + ([""] + pairs if pairs else []))


# ---- the loss curve ----------------------------------------------------------------------------------
def _curve_dir(args: argparse.Namespace, precision: str, seed: int) -> str:
    return os.path.join(args.dir, f"curve-{precision}-{seed}")


def _curve_run(args: argparse.Namespace, precision: str, seed: int, device: torch.device) -> None:
    """One curve through the runner's whole run (``Trainer.fit``): its metrics.jsonl in ``_curve_dir``."""
    from bench.gpt_step import parse_size
    from distlib.distributed.process_group import Context
    from distlib.runner.config import load_config
    from distlib.runner.observability.timeline import Timeline
    from distlib.runner.training.trainer import Trainer

    layers, heads, width = parse_size(args.curve_size)
    every = max(1, args.curve_steps // args.curve_evals)
    overrides = [
        f"data.root={args.text}", f"data.args.block_size={args.curve_seq}", f"model.args.n_layer={layers}",
        f"model.args.n_head={heads}", f"model.args.n_embd={width}", f"train.batch_size={args.curve_batch}",
        "train.epochs=0", f"train.max_steps={args.curve_steps}", f"train.eval_every_steps={every}",
        "train.eval_every=0", "train.sample_tokens=0", f"train.seed={seed}",
        f"run.out_dir={_curve_dir(args, precision, seed)}", "run.resume=false", "run.progress=plain",
        "run.final_checkpoint=none",
        f"train.compile_backend={args.compile_backend}",
        *([f"data.args.val_frac={args.curve_val_frac}"] if args.curve_val_frac else []),
        *(["train.precision=bf16"] if precision == "bf16" else
          ["train.precision=fp8", f"train.fp8_recipe={precision}", f"train.fp8_layers={args.curve_layers}"]),
    ]  # fmt: skip
    cfg = load_config(os.path.join(ROOT, "recipes", "gpt_shakespeare.yaml"), overrides)
    ctx = Context(rank=0, local_rank=0, world_size=1, local_world_size=1, device=device, backend="none")
    _clear(device)
    trainer = Trainer(cfg, ctx, Timeline())
    try:
        trainer.build()
        assert trainer.fit() == 0
    finally:
        trainer.close()


def curve(args: argparse.Namespace, device: torch.device) -> int:
    """The curves of ``--curve``, then their table and plot."""
    runs = [("bf16", 0), ("bf16", 1), (args.curve_recipe, 0)]
    if args.curve_run:  # a child of --curve-jobs: one curve, its metrics.jsonl in its folder of --dir
        precision, seed = args.curve_run.split(":")
        _curve_run(args, precision, int(seed), device)
        return 0
    curves, rows, seconds = {}, [], {}
    if args.curve_jobs > 1:  # each curve in a process of its own, --curve-jobs at once on the one device
        procs = {}
        pending = list(runs)
        while pending or procs:
            while pending and len(procs) < args.curve_jobs:
                precision, seed = pending.pop(0)
                cmd = [sys.executable, "-m", "bench.float8", *args.argv, "--dir", args.dir,
                       "--curve-run", f"{precision}:{seed}"]  # fmt: skip
                procs[(precision, seed)] = (subprocess.Popen(cmd, cwd=ROOT), time.perf_counter())
            for run, (proc, t0) in list(procs.items()):
                if proc.poll() is not None:
                    if proc.returncode:
                        raise SystemExit(f"the curve {run} exited {proc.returncode}")
                    seconds[run] = time.perf_counter() - t0
                    del procs[run]
            time.sleep(1)
    for precision, seed in runs:
        t0 = time.perf_counter()
        if args.curve_jobs <= 1:
            _curve_run(args, precision, seed, device)
        label = f"{'bf16' if precision == 'bf16' else 'fp8 ' + precision} seed {seed}"
        with open(os.path.join(_curve_dir(args, precision, seed), "metrics.jsonl")) as f:
            lines = [json.loads(line) for line in f if line.strip()]
        points = [(p["step"], p["val_loss"]) for p in lines if p.get("val_loss") is not None]
        curves[label] = points
        speed = [p.get("tokens_per_s") for p in lines if p.get("tokens_per_s")]
        row = {"curve": label, "final_val_loss": points[-1][1], "min_val_loss": min(v for _, v in points),
               # with --curve-jobs > 1 the curves shared the device: their tokens/s are not one run's
               "tokens_per_s": statistics.median(speed) if speed else None, "concurrent": args.curve_jobs,
               "run_s": round(seconds.get((precision, seed), time.perf_counter() - t0), 1)}  # fmt: skip
        rows_.emit("float8_curve", args.json, row, rows)
    plot = os.path.join(args.out, "float8_curve.png")
    os.makedirs(args.out, exist_ok=True)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, points in curves.items():
        ax.plot([s for s, _ in points], [v for _, v in points], label=label, marker=".")
    ax.set_xlabel("step")
    ax.set_ylabel("validation loss (nats per byte)")
    ax.set_title(f"Shakespeare, GPT {args.curve_size}, bf16 and float8")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(plot, dpi=120)
    steps = [s for s, _ in next(iter(curves.values()))]
    print("| step | " + " | ".join(curves) + " |")
    print("|---|" + "---|" * len(curves))
    for i, s in enumerate(steps):
        print(f"| {s} | " + " | ".join(f"{c[i][1]:.4f}" if i < len(c) else "" for c in curves.values()) + " |")
    print(f"\nplot: {plot}")
    return 0


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.float8", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    csv = lambda s: [v for v in s.split(",") if v]  # noqa: E731
    p.add_argument("--models", type=csv, default=list(MODELS), help=f"of {', '.join(MODELS)}")
    p.add_argument("--precisions", type=csv, default=list(PRECISIONS), help=f"of {', '.join(PRECISIONS)}")
    p.add_argument("--loops", type=csv, default=list(LOOPS), help=f"of {', '.join(LOOPS)}")
    p.add_argument("--steps", type=int, default=10, help="timed steps a row")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (the compilation)")
    p.add_argument("--compile-backend", default="inductor")
    p.add_argument("--fp8-layers", default="auto", choices=["auto", "all"], help="the runner's train.fp8_layers")
    p.add_argument("--tiny", action="store_true", help="tiny sizes on the CPU (emulated float8), for the test")
    p.add_argument("--dir", default="", help="working directory (token files, runs); default a temporary one")
    p.add_argument("--json", default=os.path.join(".bench", "out", "float8.jsonl"), help="rows appended here")
    p.add_argument("--curve", action="store_true", help="the Shakespeare loss curves instead of the table")
    p.add_argument("--curve-size", default="24x1024", help="LAYERSxWIDTH of the curve's GPT")
    p.add_argument("--curve-steps", type=int, default=2000)
    p.add_argument("--curve-batch", type=int, default=16, help="sequences a step")
    p.add_argument("--curve-seq", type=int, default=512, help="bytes a sequence")
    p.add_argument("--curve-evals", type=int, default=20, help="evaluations over the run")
    p.add_argument("--curve-val-frac", type=float, default=0.0, help="data.args.val_frac; 0: the recipe's")
    p.add_argument("--curve-recipe", default="tensorwise", choices=["tensorwise", "rowwise"])
    p.add_argument(
        "--curve-jobs",
        type=int,
        default=1,
        help="curves at once, each in a process of its own (their tokens/s then share the device)",
    )
    p.add_argument("--curve-run", default="", help=argparse.SUPPRESS)  # PRECISION:SEED, one curve (a child)
    p.add_argument("--curve-layers", default="auto", choices=["auto", "all"], help="train.fp8_layers of the fp8 run")
    p.add_argument("--text", default=os.path.join(ROOT, "data", "shakespeare.txt.gz"))
    p.add_argument("--out", default=os.environ.get("OUT") or os.path.join(".bench", "out"), help="where the plot goes")
    args = p.parse_args(argv)
    args.argv = list(argv)  # what a --curve-jobs child is started with
    for name, values, known in (("--models", args.models, MODELS), ("--precisions", args.precisions, PRECISIONS),
                                ("--loops", args.loops, LOOPS)):  # fmt: skip
        if bad := [v for v in values if v not in known]:
            p.error(f"{name}: unknown {', '.join(bad)} (known: {', '.join(known)})")
    if args.tiny:
        args.compile_backend = "aot_eager"
        args.steps, args.warmup = min(args.steps, 2), min(args.warmup, 1)
        args.curve_size, args.curve_steps, args.curve_batch, args.curve_seq = "2x64", 10, 4, 32
        args.curve_evals, args.curve_val_frac = 2, 0.005
        args.text = os.path.join(ROOT, "data", "shakespeare-demo", "shakespeare.txt.gz")
        args.curve_layers = args.fp8_layers = "all"  # tiny matrices: below torchao's sizes for a gain
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    device = torch.device("cuda", 0) if torch.cuda.is_available() and not args.tiny else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True
    os.environ.setdefault("TORCH_WARM_POOL", "1")
    with tempfile.TemporaryDirectory() as tmp:
        args.dir = args.dir or tmp
        os.makedirs(args.dir, exist_ok=True)
        if args.curve:
            return curve(args, device)
        rows: list[dict] = []
        for model in args.models:
            for loop in args.loops:
                for precision in args.precisions:
                    rows_.emit("float8", args.json, one_row(args, model, loop, precision, device), rows)
        print(table(rows))
    return 0 if all(r.get("tokens_per_s") for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
