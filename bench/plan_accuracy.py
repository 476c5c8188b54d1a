"""The memory plan against the memory the runner's step takes, on one GPU.

    python -m bench.plan_accuracy            # one H200: the 1.5B GPT, a 6.7B GPT, the Llama-1B recipe
    python -m bench.plan_accuracy --tiny     # a tiny and a small GPT and a tiny Llama on the CPU (the tests)
    python -m bench.plan_accuracy --plan-only  # the GPU cases' plans alone, on any machine (seconds each)

For each case (model, world size, ``dist.shard`` mode, ``train.activation_checkpointing``) the plan
(``distlib.runner.training.memory_plan``, fake tensors on the CPU) is made first, then the runner's own
step is built and run on the device: the model as ``Trainer.build_model`` makes it (``shard_model``
under ``dist.shard=full``; float8 Linears under ``train.precision=fp8``, the row counting them),
``build_step`` with its optimizer, the warm-up (``train.prewarm_steps``, on a GPU) and three steps of
random tokens, under torch's fake process group of the case's world size
(``init_process_group("fake")``: shapes and memory of that many ranks, collectives do nothing).
Measured: ``torch.cuda.max_memory_allocated`` above what the process held before the case, from the end
of the build (the build's own peak is its column) to the end of the steps; on the CPU the allocator's
bytes as torch's profiler records them (``profile_memory``), the build included. A case the plan says
does not fit the GPU is not run.

A simulated rank does not measure time in collectives, nor the buffers NCCL itself allocates
outside torch's allocator. Rows are printed as JSON lines and appended to ``--json``; the table last.
BENCHMARKS.md, "Memory plan".
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time

if __package__ in (None, ""):  # run as `python bench/plan_accuracy.py`: the repository root on the path
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import rows as rows_  # noqa: E402  (after the path is set)

GIB = 2**30
# (name, recipe, overrides, sequences per rank): the models of the plan's accuracy target
GPT_1_5B = ["model.args.n_layer=48", "model.args.n_embd=1600", "model.args.n_head=25", "model.args.vocab_size=50304",
            "data.args.block_size=1024", "model.args.dropout=0.0"]  # fmt: skip
GPT_6_7B = ["model.args.n_layer=32", "model.args.n_embd=4096", "model.args.n_head=32", "model.args.vocab_size=50304",
            "data.args.block_size=2048", "model.args.dropout=0.0"]  # fmt: skip
# the large-model issue's 39.8B GPT: 18.5 GiB of fp32 shards per rank at 8 ranks
GPT_39_8B = ["model.args.n_layer=64", "model.args.n_embd=7168", "model.args.n_head=56", "model.args.vocab_size=50304",
             "data.args.block_size=1024", "model.args.dropout=0.0"]  # fmt: skip
# a Llama-3-70B-shaped hf_causal_lm (80 x 8192, vocabulary 128256): 4.1 GiB of fp32 shards per rank at 64
LLAMA_70B = ["model.args.config.hidden_size=8192", "model.args.config.intermediate_size=28672",
             "model.args.config.num_hidden_layers=80", "model.args.config.num_attention_heads=64",
             "model.args.config.num_key_value_heads=8", "model.args.config.head_dim=128",
             "model.args.config.tie_word_embeddings=false", "data.args.block_size=1024"]  # fmt: skip
# the Llama-3.2-3B shape (hidden 3072, 28 layers, 24 heads, 8 key/value heads, MLP 8192, vocabulary 128256, tied
# embeddings) over the 1B recipe: at 4 x 2048 tokens on one H100 its plan (78.59 GiB) is 0.6 GiB under the device
LLAMA_3B = ["model.args.config.hidden_size=3072", "model.args.config.intermediate_size=8192",
            "model.args.config.num_hidden_layers=28", "model.args.config.num_attention_heads=24",
            "model.args.config.num_key_value_heads=8", "model.args.config.head_dim=128",
            "model.args.config.tie_word_embeddings=true", "data.args.block_size=2048"]  # fmt: skip
MODELS = {
    "gpt-1.5B": ("recipes/gpt_shakespeare.yaml", GPT_1_5B, 16),
    "gpt-6.7B": ("recipes/gpt_shakespeare.yaml", GPT_6_7B, 1),
    "gpt-39.8B": ("recipes/gpt_shakespeare.yaml", GPT_39_8B, 1),
    "llama-70B": ("recipes/llama_1b.yaml", LLAMA_70B, 1),
    "llama-1B": ("recipes/llama_1b.yaml", [], 8),
    "llama-3B": ("recipes/llama_1b.yaml", LLAMA_3B, 4),
    "gpt-tiny": ("recipes/gpt_demo.yaml", ["model.args.n_layer=6", "train.precision=fp32"], 8),
    # a Hugging Face Llama with grouped-query attention (4 heads, 2 key/value heads), 6 layers
    "llama-tiny": ("recipes/llama_demo.yaml", ["model.args.config.num_hidden_layers=6"], 8),
    "gpt-small": (
        "recipes/gpt_demo.yaml",
        ["model.args.n_layer=8", "model.args.n_embd=256", "data.args.block_size=256", "train.precision=fp32"],
        4,
    ),
}
# (model, world size, dist.shard, checkpointing): eager blocks (train.compile=none) unless --compile
CASES = [
    ("gpt-1.5B", 1, "none", "none"), ("gpt-1.5B", 1, "full", "none"), ("gpt-1.5B", 8, "optimizer", "none"),
    ("gpt-1.5B", 8, "full", "none"), ("gpt-1.5B", 64, "full", "none"), ("gpt-1.5B", 1, "none", "full"),
    ("gpt-6.7B", 1, "none", "none"), ("gpt-6.7B", 8, "full", "none"), ("gpt-6.7B", 64, "full", "none"),
    ("gpt-6.7B", 8, "optimizer", "selective"),
    ("llama-1B", 1, "none", "none"), ("llama-1B", 1, "full", "none"), ("llama-1B", 8, "full", "none"),
    ("llama-1B", 64, "full", "none"), ("llama-1B", 8, "optimizer", "full"), ("gpt-39.8B", 8, "full", "none"),
    ("llama-70B", 64, "full", "none"),
]  # fmt: skip
# --edge: shapes at the edge of one GPU, their blocks compiled as the recipe does, several sequences per rank
# (the fifth field): what the plan does not count (the margin's measurement, docs/memory_plan.md)
EDGE = [("llama-3B", 1, "none", "none", b) for b in (1, 2, 3, 4)] + [("llama-1B", 1, "none", "none", b)
                                                                     for b in (8, 16)]  # fmt: skip
TINY = [("gpt-tiny", w, s, ac) for w in (1, 2) for s in ("none", "optimizer", "full") for ac in ("none", "full")]
# enough blocks and width that FSDP2's first blocks (not yet linear under checkpointing) would show
TINY += [("gpt-small", w, "full", ac) for w in (1, 8) for ac in ("none", "full", "selective")]
TINY += [("llama-tiny", w, s, "none") for w in (1, 2) for s in ("none", "full")]


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.plan_accuracy", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--models", default="", help="only these models (comma-separated names)")
    p.add_argument("--case", action="append", default=[], metavar="MODEL:RANKS:SHARD:CHECKPOINTING[:PER_RANK]",
                   help="only these cases (repeatable): gpt-tiny:2:full:none, llama-3B:1:none:none:4")  # fmt: skip
    p.add_argument("--edge", action="store_true",
                   help="the shapes at the edge of the GPU (EDGE), compiled, with no margin in the plan: what the "
                        "plan does not count (reserved, outside torch's allocator)")  # fmt: skip
    p.add_argument("--compile", action="store_true", help="train.compile=true (the plan measures eager blocks)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a recipe override for every case (repeatable), e.g. dist.bucket_mb=1")  # fmt: skip
    p.add_argument("--json", default=os.path.join(".bench", "out", "plan_accuracy.jsonl"), help="rows appended here")
    p.add_argument("--tiny", action="store_true", help="small models on the CPU, at 1, 2 and 8 fake ranks")
    p.add_argument("--plan-only", action="store_true",
                   help="plan the cases as for a GPU run (its warm-up included) and measure nothing")  # fmt: skip
    return p.parse_args(argv)


def config_of(model: str, world: int, shard: str, ac: str, compile_: bool, extra: tuple[str, ...] = (),
              per_rank: int | None = None) -> tuple:  # fmt: skip
    from distlib.runner.config import load_config

    recipe, overrides, default = MODELS[model]
    per_rank = per_rank or default
    cfg = load_config(recipe, [*overrides, f"train.batch_size={per_rank * world}", f"dist.shard={shard}",
                               f"train.activation_checkpointing={ac}", f"train.compile={str(compile_).lower()}",
                               "run.checkpoint_staging=host", "train.prewarm_steps=2", *extra])  # fmt: skip
    # two warm-up steps: the second runs with the optimizer's state and the copy of the weights, the
    # warm-up's peak as with the runner's default five (one would end before the state exists)
    return cfg, per_rank


def cpu_peak(fn) -> int:  # noqa: ANN001
    """The most bytes the CPU allocator held at once while ``fn()`` ran (from zero at its start)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())  # fmt: skip
    held = peak = 0
    for e in events:
        held += e.nbytes()
        peak = max(peak, held)
    return peak


def measure(cfg, world: int, per_rank: int, device) -> dict:  # noqa: ANN001
    """The runner's model and step under a fake process group of ``world`` ranks: peaks in bytes."""
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import distlib
    from distlib.distributed.process_group import Context
    from distlib.runner.training.float8 import convert_model
    from distlib.runner.training.memory_plan import step_spec
    from distlib.runner.training.optimizer_step import autocast_dtype, optimizer_spec
    from distlib.runner.training.step import build_step

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    ctx = Context(rank=0, local_rank=0, world_size=world, local_world_size=world, device=device, backend="fake")
    spec, t, cuda = step_spec(cfg), cfg.train, device.type == "cuda"
    out: dict = {}

    def convert(model: torch.nn.Module) -> None:  # train.precision=fp8: as Trainer.build_model converts
        out["float8_layers"] = len(convert_model(cfg, model, device))

    def run() -> None:
        torch.manual_seed(0)
        if cfg.dist.shard == "full":  # as Trainer.build_model
            dtype = autocast_dtype(t.precision, device)
            blocks = [cfg.model.block_class] if cfg.model.block_class else None
            model = distlib.shard_model(spec.build, param_dtype=dtype, reduce_dtype=torch.float32 if dtype else None,
                                        device=device, block_types=blocks, offload=cfg.dist.offload,
                                        reshard_after_forward=cfg.dist.reshard_after_forward,
                                        convert=convert)  # fmt: skip
        else:
            with torch.device(device):
                model = spec.build().to(device)
            convert(model)
        if cuda:
            torch.cuda.synchronize()
            out["build"] = torch.cuda.max_memory_allocated() - base
            torch.cuda.reset_peak_memory_stats()
        opt = optimizer_spec(t, model, device, offload=cfg.dist.offload)  # as Trainer.build_optimizer
        ema: list = []  # as Trainer.build: made once the step has put the weights where it keeps them
        loss_fn = spec.loss_fn  # the plain loss, or the output layer in chunks as the runner's task picks it
        if spec.chunks and getattr(model, "takes_head", False):
            from distlib.runner.tasks.chunked_loss import chunked_cross_entropy

            loss_fn = chunked_cross_entropy(spec.chunks, t.label_smoothing)
        step = build_step(cfg, ctx, model, opt, per_rank, loss_fn=loss_fn,
                          post_step=(lambda: ema[0].update()) if t.ema > 0 else None)  # fmt: skip
        if t.ema > 0:
            ema.append(distlib.EMA(model, 0.99))
        vocab = spec.vocab_size or 256
        x = torch.randint(0, vocab, (per_rank, spec.seq_len), device=device)
        y = torch.randint(0, vocab, (per_rank, spec.seq_len), device=device)
        if cuda:
            step.warm_up(x, y, steps=t.prewarm_steps)
        for _ in range(3):
            step(x, y)
        if cuda:
            torch.cuda.synchronize()
            out["step"] = torch.cuda.max_memory_allocated() - base
        step.close()

    def held() -> None:
        """What the device holds beyond what the step allocated: the allocator's reserved peak, and what is
        in use outside torch's allocator (the CUDA context, NCCL's and cuBLAS's buffers), now."""
        free, total = torch.cuda.mem_get_info(device)
        out["peak_allocated"] = torch.cuda.max_memory_allocated() - base
        out["reserved"] = torch.cuda.max_memory_reserved() - base_reserved
        out["outside"] = total - free - torch.cuda.memory_reserved()
        out["device"] = total

    # what the process already holds (an earlier case's or test's leftovers: caches, compiled code) is
    # not this step's: peaks are counted from it
    base = base_reserved = 0
    try:
        if cuda:
            gc.collect()
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            base, base_reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
            torch.cuda.reset_peak_memory_stats()
            try:
                run()
            except torch.OutOfMemoryError:
                held()  # at the moment it ran out
                out["oom"] = True
            else:
                held()
        else:
            out["step"] = cpu_peak(run)
    finally:
        dist.destroy_process_group()
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    import torch

    from distlib.runner.training.memory_plan import device_bytes, plan

    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    planned_as_gpu = device.type == "cuda" or (args.plan_only and not args.tiny)  # the runner warms up on a GPU
    cases = TINY if args.tiny else EDGE if args.edge else CASES
    if args.models:
        cases = [c for c in cases if c[0] in args.models.split(",")]
    if args.case:
        cases = [(m, int(w), s, a, *map(int, b)) for m, w, s, a, *b in (c.split(":") for c in args.case)]
    # the plan as it counts, without the margin its verdict keeps (what --edge measures): a case runs unless
    # its planned peak exceeds the device
    extra = ("run.memory_margin_gib=0", "run.memory_margin_fraction=0", *args.set)
    compile_ = args.compile or args.edge
    gpu = device_bytes() if device.type == "cuda" else None
    rows: list[dict] = []
    for model, world, shard, ac, *batch in cases:
        cfg, per_rank = config_of(model, world, shard, ac, compile_, extra, *batch)
        t0 = time.perf_counter()
        result = plan(cfg, world, gpu_bytes=gpu, shards=(shard,), checkpointing=(ac,), batches=False,
                      warm_up=planned_as_gpu)  # fmt: skip
        row = {"model": model, "world": world, "shard": shard, "ac": ac, "compile": compile_,
               "tokens_per_rank": per_rank * result.seq_len, "plan_bytes": result.peak(),
               "plan_s": round(time.perf_counter() - t0, 1)}  # fmt: skip
        if args.plan_only:
            row["note"] = "planned only"
        elif result.fits() is False:
            row["note"] = "the plan says it does not fit: not run"
        else:
            try:
                got = measure(cfg, world, per_rank, device)
            except torch.OutOfMemoryError:  # in the build, before the step's figures
                got = {}
                row["note"] = "out of memory"
            if "step" in got:
                row["measured_bytes"] = got["step"]
                row["plan_over_measured"] = round(result.peak() / got["step"], 3)
            if "build" in got:
                row["build_bytes"] = got["build"]
            if "reserved" in got:  # what the plan does not count: the allocator's reserve beyond it, and the rest
                unaccounted = got["reserved"] + got["outside"] - result.peak()
                row |= {"peak_allocated_bytes": got["peak_allocated"], "reserved_bytes": got["reserved"],
                        "outside_bytes": got["outside"], "device_bytes": got["device"],
                        "unaccounted_bytes": unaccounted,
                        "unaccounted_of_device": round(unaccounted / got["device"], 4)}  # fmt: skip
            if got.get("oom"):
                row["note"] = "out of memory"
            if got.get("float8_layers"):
                row["float8_layers"] = got["float8_layers"]
        rows_.emit("plan_accuracy", args.json, row, rows)
    print(table(rows))
    return 0


def table(rows: list[dict]) -> str:
    """Markdown, in GiB (MiB when every figure is under one GiB)."""
    unit, div = ("GiB", GIB) if any(r["plan_bytes"] >= GIB for r in rows) else ("MiB", 2**20)

    def size(key: str, r: dict) -> str:
        return f"{r[key] / div:.2f}" if r.get(key) is not None else "-"

    edge = any("reserved_bytes" in r for r in rows)
    head = (f"| model | ranks | dist.shard | checkpointing | tokens/rank | plan {unit} | measured {unit} | "
            f"plan/measured | build {unit} |")  # fmt: skip
    if edge:
        head += f" reserved {unit} | outside torch {unit} | unaccounted {unit} | of the device |"
    lines = [head, "|" + "---|" * (13 if edge else 9)]
    for r in rows:
        line = (f"| {r['model']} | {r['world']} | {r['shard']} | {r['ac']} | {r['tokens_per_rank']} | "
                f"{size('plan_bytes', r)} | {size('measured_bytes', r)} | {r.get('plan_over_measured', '-')} | "
                f"{size('build_bytes', r)} |")  # fmt: skip
        if edge:
            line += (f" {size('reserved_bytes', r)} | {size('outside_bytes', r)} | {size('unaccounted_bytes', r)} | "
                     f"{r.get('unaccounted_of_device', '-')} |")  # fmt: skip
        lines.append(line + (f" {r['note']}" if r.get("note") else ""))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
