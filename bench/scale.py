"""A large GPT through the runner, as a user runs it, next to its anchors, on one GPU.

    python -m bench.scale                                   # 1.5B: every shard mode, the anchors, a table
    python -m bench.scale --parts runner --modes optimizer  # one mode (cold and warm compile cache)
    python -m bench.scale --parts ac                        # 6.7B, seq 4096: the largest batch per checkpointing
    python -m bench.scale --report .bench/out/scale.jsonl   # the table of every row written so far
    python -m bench.scale --tiny                            # the same on the CPU, tiny sizes (the test)

Parts (``--parts``, default ``anchors,runner,ac``):

- ``runner``: for each ``--modes`` shard mode (none, optimizer, full), ``launch.py`` under torchrun on
  one GPU with a GPT of ``--size`` (48 × 1600 by default, vocabulary 50304) trained for ``--steps``
  steps of ``--batch`` × ``--seq-len`` tokens (random tokens in a token file), bf16, AdamW, each
  block compiled (``train.compile=blocks``). Twice: with an empty compile cache (cold) and again
  with the cache the first run left (warm; ``run.compile_cache_dir``). From its summary.json and
  metrics.jsonl: the model stage, the warm-up (the compile), start to first step, tokens/s, MFU,
  peak memory, and the final checkpoint (the synchronous save of the cold run).
- ``recipe``: the same, on the byte-level Shakespeare recipe as a user runs it at this size
  (``recipes/gpt_shakespeare.yaml``, ``--text``; one epoch of the whole text, its second half for
  validation: ``data.args.val_frac=0.5``, ``--batch`` × ``--seq-len``, vocabulary 256): the whole
  command against its training and evaluation (the final checkpoint is written while the final
  evaluation runs).
- ``anchors``: in this process, the same model built directly on the GPU
  (``with torch.device("cuda"): GPT(cfg)``), ``torch.save`` of its weights and AdamW state (fsynced),
  ``ShardedCheckpointer.save`` of the same (synchronous), then for each ``staging`` (``device``,
  ``host``) two ``save(async_=True)`` (the first of a process takes its host copy, which ``host``
  page-locks; the second reuses it): how long each blocks, and how much slower than a step without a
  save the steps are that run until its write is done (the copies and the write compete); then
  ``bench.gpt_step single-compile`` (the plain one-GPU ``torch.compile`` loop) in a subprocess.
- ``ac``: the GPT of ``--ac-size`` (32 × 4096) at ``--ac-seq-len`` (4096) tokens: for each
  ``train.activation_checkpointing`` mode, each batch of ``--ac-batches`` in a fresh process (one
  GPU, eager blocks unless ``--ac-compile``, bf16, fused AdamW, two steps) until one runs out of
  memory: the largest batch that trains, its tokens/s and peak memory.

Every row is printed as a JSON line and appended to ``--json`` (default .bench/out/scale.jsonl), each
runner run's output kept in ``logs/`` beside it; a markdown table of this run's rows comes last.
Each part fits the GPU machine's 10 minutes a command at the default sizes (``--steps`` and
``--modes`` make a run shorter). BENCHMARKS.md, "Large models".
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from distlib.runner.models.gpt import GPT

if __package__ in (None, ""):  # run as `python bench/scale.py`: the repository root on the path
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import rows as rows_  # noqa: E402  (after the path is set)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODES = ("none", "optimizer", "full")
AC_MODES = ("none", "full", "selective")
TINY = ["--device=cpu", "--size=2x64", "--vocab=256", "--seq-len=32", "--batch=4", "--steps=6",
        "--ac-size=2x64", "--ac-seq-len=32", "--ac-batches=1,2", "--compile-backend=aot_eager",
        "--text=" + os.path.join("data", "shakespeare-demo", "shakespeare.txt.gz"), "--recipe-steps=6"]  # fmt: skip


def parse_size(text: str) -> tuple[int, int, int]:
    from bench.gpt_step import parse_size as gpt_size

    return gpt_size(text)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.scale", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    csv = lambda s: [v for v in s.split(",") if v]  # noqa: E731
    p.add_argument("--parts", type=csv, default=["anchors", "runner", "ac"], help="anchors, runner, recipe, ac")
    p.add_argument("--text", default=os.path.join("data", "shakespeare.txt.gz"), help="the recipe part's text")
    p.add_argument("--recipe-steps", type=int, default=0, help="the recipe part's train.max_steps (0: the epoch)")
    p.add_argument("--modes", type=csv, default=list(MODES), help="dist.shard modes of the runner part")
    p.add_argument("--size", default="1.5B", help="GPT of the runner and anchors: a name or LAYERSxWIDTH")
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--batch", type=int, default=16, help="sequences a step per GPU")
    p.add_argument("--nproc", type=int, default=1, help="GPUs (one process each) of the runner part")
    p.add_argument("--steps", type=int, default=40, help="training steps of each runner run")
    p.add_argument("--compile-backend", default="inductor")
    p.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                   help="a recipe override of the runner and recipe parts' runs, after the bench's own "
                        "(repeatable): run.memory_plan=off, beside a run without it, says what the check before "
                        "launch costs")  # fmt: skip
    p.add_argument("--ac-size", default="6.7B")
    p.add_argument("--ac-seq-len", type=int, default=4096)
    p.add_argument("--ac-modes", type=csv, default=list(AC_MODES))
    p.add_argument("--ac-batches", type=lambda s: [int(v) for v in csv(s)], default=[1, 2, 3, 4, 6, 8, 12, 16])
    p.add_argument("--ac-compile", action="store_true", help="compile the blocks in the ac part too")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--dir", default="", help="where runs, checkpoints and caches go (default: a temporary one)")
    p.add_argument("--json", default=os.path.join(".bench", "out", "scale.jsonl"), help="rows appended here")
    p.add_argument("--report", metavar="JSONL", help="print the table of the rows in this file and exit")
    p.add_argument("--tiny", action="store_true", help="tiny sizes on the CPU: " + " ".join(TINY))
    p.add_argument("--ac-probe", nargs=2, metavar=("MODE", "BATCH"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.tiny:
        args = p.parse_args(TINY + argv)
    for m in args.modes:
        if m not in MODES:
            p.error(f"--modes: {m!r} is not one of {', '.join(MODES)}")
    for m in args.ac_modes:
        if m not in AC_MODES:
            p.error(f"--ac-modes: {m!r} is not one of {', '.join(AC_MODES)}")
    return args


def emit(args: argparse.Namespace, row: dict, rows: list[dict]) -> None:
    rows_.emit("scale", args.json, row, rows)


def _timed_step(
    model: GPT, opt: torch.optim.Optimizer, x: torch.Tensor, autocast: torch.autocast, device: str
) -> float:
    """Seconds of one training step of the GPT on the tokens ``x`` (next-token cross-entropy on ``x``
    itself, under ``autocast``), the device synchronised on both sides."""
    import torch.nn.functional as F

    rows_.sync(device)
    t = time.perf_counter()
    with autocast:
        loss = F.cross_entropy(model(x).flatten(0, 1).float(), x.flatten())
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    rows_.sync(device)
    return time.perf_counter() - t


# ---- the runner --------------------------------------------------------------------------------------
def token_file(args: argparse.Namespace, directory: str) -> str:
    """Random tokens for ``--steps`` steps and a short validation split, in one headerless file."""
    import numpy as np

    from distlib.runner.data.token_files import write_token_file

    n = (args.steps * args.batch * args.nproc + 4) * args.seq_len + 1
    n_val = 2 * args.seq_len + 1
    tokens = np.random.default_rng(0).integers(0, args.vocab, n + n_val, dtype=np.int64)
    path = os.path.join(directory, "tokens.bin")
    write_token_file(path, tokens, dtype="uint16" if args.vocab <= 1 << 16 else "uint32", header=True)
    return path


def runner_command(args: argparse.Namespace, shard: str, data: str, out: str, cache: str) -> list[str]:
    layers, heads, width = parse_size(args.size)
    n_val = 2 * args.seq_len + 1
    total = (args.steps * args.batch * args.nproc + 4) * args.seq_len + 1 + n_val
    overrides = [
        "data.name=token_file", f"data.root={data}", "data.train_subset=0", f"data.args.block_size={args.seq_len}",
        f"data.args.val_frac={n_val / total:.6f}",
        f"model.args.vocab_size={args.vocab}", f"model.args.n_layer={layers}", f"model.args.n_head={heads}",
        f"model.args.n_embd={width}", "model.args.dropout=0.0",
        f"train.batch_size={args.batch * args.nproc}", "train.epochs=1", "train.precision=bf16",
        "train.sample_tokens=0",
        "train.compile=blocks", f"train.compile_backend={args.compile_backend}", "train.prewarm_steps=3",
        f"dist.shard={shard}", f"run.out_dir={out}", "run.resume=false", f"run.compile_cache_dir={cache}",
        "run.progress=plain", *args.override,
    ]  # fmt: skip
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}"]
    return [*torchrun, os.path.join(ROOT, "launch.py"), os.path.join(ROOT, "recipes", "gpt_tokens_demo.yaml"),
            *overrides]  # fmt: skip


def recipe_command(args: argparse.Namespace, shard: str, out: str, cache: str) -> list[str]:
    """The Shakespeare recipe at ``--size``: one epoch of the text, half of it for validation."""
    layers, heads, width = parse_size(args.size)
    overrides = [
        f"data.root={args.text}", f"data.args.block_size={args.seq_len}", "data.args.val_frac=0.5",
        f"model.args.n_layer={layers}", f"model.args.n_head={heads}", f"model.args.n_embd={width}",
        "model.args.dropout=0.0", f"train.batch_size={args.batch * args.nproc}", "train.epochs=1",
        "train.sample_tokens=0", "train.compile=blocks", f"train.compile_backend={args.compile_backend}",
        f"dist.shard={shard}", f"run.out_dir={out}", "run.resume=false", f"run.compile_cache_dir={cache}",
        "run.progress=plain", f"train.max_steps={args.recipe_steps}", *args.override,
    ]  # fmt: skip
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}"]
    return [*torchrun, os.path.join(ROOT, "launch.py"), os.path.join(ROOT, "recipes", "gpt_shakespeare.yaml"),
            *overrides]  # fmt: skip


def runner_row(args: argparse.Namespace, shard: str, cache: str, data: str, base: str, cold: bool,
               part: str = "runner") -> dict:  # fmt: skip
    out = os.path.join(base, f"{part}-{shard}-{'cold' if cold else 'warm'}")
    shutil.rmtree(out, ignore_errors=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if args.device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    command = recipe_command(args, shard, out, cache) if part == "recipe" else runner_command(args, shard, data,
                                                                                              out, cache)  # fmt: skip
    t0 = time.perf_counter()
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    row = {"part": part, "mode": shard, "cache": "cold" if cold else "warm", "rc": proc.returncode,
           "command_s": round(time.perf_counter() - t0, 1), "overrides": args.override}  # fmt: skip
    # the run's own output (TORCH_LOGS=recompiles and the like go there), next to the rows
    logs = os.path.join(os.path.dirname(args.json) or ".", "logs")
    os.makedirs(logs, exist_ok=True)
    with open(os.path.join(logs, f"{part}-{shard}-{row['cache']}.log"), "w") as f:
        f.write(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        row["note"] = rows_.failure(proc.stderr)
        return row
    with open(os.path.join(out, "summary.json")) as f:
        summary = json.load(f)
    with open(os.path.join(out, "metrics.jsonl")) as f:
        metrics = [json.loads(line) for line in f if line.strip()]
    stages, last = summary.get("stages", {}), metrics[-1] if metrics else {}
    peak = last.get("peak_mem_gib")
    row.update(
        model_s=stages.get("model"),
        warmup_s=stages.get("warmup"),
        to_first_step_s=summary.get("to_first_step_s"),
        tokens_per_s=last.get("tokens_per_s"),
        mfu=last.get("mfu"),
        peak_mem_gib=max(peak) if isinstance(peak, list) else peak,
        final_save_s=summary.get("final_checkpoint_s"),  # from the save's start to its commit
        # where it went (rank 0): the copies to the host, DCP's writes, the fsync, the commit
        save_phases=summary.get("final_checkpoint_phases"),
        imports_s=stages.get("imports"),
        memory_plan_s=stages.get("memory_plan"),
        config_s=stages.get("config"),
        save_wait_s=stages.get("checkpoint"),  # what is left of it after the final evaluation
        train_s=summary.get("train_s"),  # the steps
        eval_s=summary.get("eval_s"),  # every evaluation, the final one's included
        total_s=summary.get("total_s"),
    )
    if row["train_s"] is not None and row["eval_s"] is not None:
        row["beyond_s"] = round(row["command_s"] - row["train_s"] - row["eval_s"], 1)  # the target: <= 30
    return row


def run_runner(args: argparse.Namespace, base: str, rows: list[dict], part: str = "runner") -> None:
    data = token_file(args, base) if part == "runner" else ""
    for shard in args.modes:
        cache = os.path.join(base, f"compile-cache-{part}-{shard}")
        shutil.rmtree(cache, ignore_errors=True)
        for cold in (True, False):
            emit(args, runner_row(args, shard, cache, data, base, cold, part), rows)
            shutil.rmtree(os.path.join(base, f"{part}-{shard}-{'cold' if cold else 'warm'}", "checkpoints"),
                          ignore_errors=True)  # fmt: skip


# ---- the anchors -----------------------------------------------------------------------------------
def run_anchors(args: argparse.Namespace, base: str, rows: list[dict]) -> None:
    import torch

    import distlib
    from distlib.runner.models.gpt import GPT, GPTConfig

    layers, heads, width = parse_size(args.size)
    cfg = GPTConfig(vocab_size=args.vocab, block_size=args.seq_len, n_layer=layers, n_head=heads, n_embd=width)
    device = torch.device(args.device)
    rows_.sync(args.device)
    t0 = time.perf_counter()
    with torch.device(device):
        model = GPT(cfg)
    rows_.sync(args.device)
    build_s = time.perf_counter() - t0
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=args.device == "cuda")
    x = torch.randint(0, args.vocab, (args.batch, args.seq_len), device=device)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.device == "cuda")

    def step() -> float:
        return _timed_step(model, opt, x, autocast, args.device)

    for _ in range(2):
        step()  # the optimizer state exists, the kernels are chosen
    normal = min(step() for _ in range(3))
    path = os.path.join(base, "anchor.pt")
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, f)
        f.flush()
        os.fsync(f.fileno())
    save_s = time.perf_counter() - t0
    size_gib = os.path.getsize(path) / 2**30
    os.remove(path)
    ckpt = distlib.ShardedCheckpointer(os.path.join(base, "anchor-dcp"), keep=1)
    objects = {"model": model, "optimizer": opt}
    t0 = time.perf_counter()
    ckpt.save(1, objects)  # synchronous: DCP, write_threads files at once
    sharded_s = time.perf_counter() - t0
    row = {"part": "anchors", "mode": "plain", "build_s": round(build_s, 3), "torch_save_s": round(save_s, 2),
           "sharded_save_s": round(sharded_s, 2), "checkpoint_gib": round(size_gib, 2),
           "step_ms": round(normal * 1e3, 1)}  # fmt: skip
    ckpt.close()
    # per staging, two asynchronous saves (the first of a process takes its host copy, page-locked for
    # "host"; the next reuse it): what each blocks, and how much slower than ``normal`` the steps that
    # run until its write is done are, each cost to training
    for staging in ("device", "host"):
        ckpt = distlib.ShardedCheckpointer(os.path.join(base, "anchor-dcp"), keep=1, staging=staging)
        for key, step_no in ((f"{staging}_async", 2), (f"{staging}_async2", 3)):
            t0 = time.perf_counter()
            ckpt.save(step_no, objects, async_=True)
            blocked_s = time.perf_counter() - t0
            during = [step()]
            while not ckpt.written() and len(during) < 400:
                during.append(step())
            t0 = time.perf_counter()
            ckpt.wait()  # the rest of the write and the commit
            rest_s = time.perf_counter() - t0
            row |= {f"{key}_blocked_s": round(blocked_s, 3), f"{key}_steps": len(during),
                    f"{key}_stall_s": round(blocked_s + sum(max(0.0, d - normal) for d in during), 3),
                    f"{key}_write_s": round(sum(during) + rest_s, 2)}  # fmt: skip
    ckpt.close()
    emit(args, row, rows)
    model = opt = ckpt = objects = None  # freed before the compile loop runs in its own process
    shutil.rmtree(os.path.join(base, "anchor-dcp"), ignore_errors=True)
    if args.device == "cuda":
        torch.cuda.empty_cache()
    # the plain one-GPU compile loop
    out = os.path.join(base, "gpt_step.json")
    cmd = [sys.executable, "-m", "bench.gpt_step", f"--sizes={args.size}", "--modes=single-compile",
           f"--vocab={args.vocab}", f"--seq-len={args.seq_len}", f"--batch={args.batch}", f"--device={args.device}",
           f"--compile-backend={args.compile_backend}", f"--json={out}"]  # fmt: skip
    if args.device == "cpu":
        cmd += ["--steps=2", "--warmup=1"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    row = {"part": "anchors", "mode": "single-compile", "rc": proc.returncode}
    if proc.returncode == 0:
        with open(out) as f:
            res = json.load(f)["results"][0]
        row.update(tokens_per_s=res.get("tokens_per_s"), mfu=res.get("mfu"), peak_mem_gib=res.get("peak_mem_gib"),
                   note=res.get("note", ""))  # fmt: skip
    else:
        row["note"] = rows_.failure(proc.stderr)
    emit(args, row, rows)


# ---- activation checkpointing: the largest batch ---------------------------------------------------
def ac_probe(args: argparse.Namespace, mode: str, batch: int) -> int:
    """Two training steps of ``--ac-size`` at ``batch`` × ``--ac-seq-len`` with ``mode``: prints a JSON
    result line; exit status 3 when out of memory."""
    import torch

    import distlib
    from distlib.runner.models.gpt import GPT, GPTConfig

    layers, heads, width = parse_size(args.ac_size)
    cfg = GPTConfig(vocab_size=args.vocab, block_size=args.ac_seq_len, n_layer=layers, n_head=heads, n_embd=width)
    device = torch.device(args.device)
    try:
        with torch.device(device):
            model = GPT(cfg)
        if mode != "none":
            distlib.checkpoint_blocks(model.blocks, mode)
        if args.ac_compile:
            distlib.compile_blocks(model.blocks, backend=args.compile_backend)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=args.device == "cuda")
        x = torch.randint(0, args.vocab, (batch, args.ac_seq_len), device=device)
        autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.device == "cuda")
        times = [_timed_step(model, opt, x, autocast, args.device) for _ in range(3 if args.ac_compile else 2)]
    except torch.OutOfMemoryError:
        print(json.dumps({"oom": True}), flush=True)
        return 3
    peak = torch.cuda.max_memory_allocated() / 2**30 if args.device == "cuda" else None
    step_s = times[-1]
    flops = model.flops_per_token(args.ac_seq_len) * batch * args.ac_seq_len / step_s
    print(json.dumps({"step_s": step_s, "tokens_per_s": batch * args.ac_seq_len / step_s,
                      "tflops": flops / 1e12, "peak_mem_gib": peak}), flush=True)  # fmt: skip
    return 0


def run_ac(args: argparse.Namespace, rows: list[dict], argv: list[str]) -> None:
    for mode in args.ac_modes:
        best, tried = None, []
        for batch in args.ac_batches:
            proc = subprocess.run([sys.executable, "-m", "bench.scale", *argv, "--ac-probe", mode, str(batch)],
                                  cwd=ROOT, capture_output=True, text=True)  # fmt: skip
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
            result = json.loads(lines[-1]) if lines else {}
            if proc.returncode != 0 or "step_s" not in result:
                tried.append(f"{batch}: {'OOM' if result.get('oom') else 'failed'}")
                break
            tried.append(f"{batch}: ok")
            best = {"batch": batch, **result}
        row = {"part": "ac", "mode": mode, "size": args.ac_size, "seq_len": args.ac_seq_len, "tried": ", ".join(tried)}
        if best is not None:
            row.update(max_batch=best["batch"], tokens_per_s=round(best["tokens_per_s"], 1),
                       tflops=round(best["tflops"], 1), peak_mem_gib=best["peak_mem_gib"])  # fmt: skip
        emit(args, row, rows)


# ---- the table --------------------------------------------------------------------------------------
def _f(v, digits: int = 1) -> str:
    if v is None:
        return "—"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def table(rows: list[dict]) -> str:
    out = []
    anchors = {r["mode"]: r for r in rows if r.get("part") == "anchors"}
    for part in ("runner", "recipe"):
        runner = [r for r in rows if r.get("part") == part]
        if not runner:
            continue
        out += [*([""] if out else []), f"{part}:",
                "| shard | cache | imports s | memory plan s | model s | warm-up s | to 1st step s | tokens/s | MFU | "
                "peak GiB | final save s (left after the evaluation) | of it: to host / write / fsync / commit s | "
                "steps s | evaluation s | whole command s | beyond those s |",
                "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|"]  # fmt: skip
        for r in runner:
            if r.get("overrides"):  # the shard column names what else the run was given
                r = {**r, "mode": f"{r['mode']}, {' '.join(r['overrides'])}"}
            if r.get("rc"):
                out.append(f"| {r['mode']} | {r['cache']} | failed: {r.get('note', '')} ||||||||||||||")
                continue
            mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") else "—"
            phases = r.get("save_phases") or {}
            split = " / ".join(_f(phases.get(k)) for k in ("to_host_s", "write_s", "fsync_s", "commit_s"))
            out.append(f"| {r['mode']} | {r['cache']} | {_f(r.get('imports_s'))} | {_f(r.get('memory_plan_s'))} | "
                       f"{_f(r.get('model_s'), 2)} | {_f(r.get('warmup_s'))} | "
                       f"{_f(r.get('to_first_step_s'))} | {_f(r.get('tokens_per_s'), 0)} | {mfu} | "
                       f"{_f(r.get('peak_mem_gib'))} | {_f(r.get('final_save_s'))} ({_f(r.get('save_wait_s'))}) | "
                       f"{split} | "
                       f"{_f(r.get('train_s'))} | {_f(r.get('eval_s'))} | {_f(r.get('command_s'))} | "
                       f"{_f(r.get('beyond_s'))} |")  # fmt: skip
    if anchors:
        plain, loop = anchors.get("plain", {}), anchors.get("single-compile", {})
        mfu = f"{100 * loop['mfu']:.1f}%" if loop.get("mfu") else "—"
        out += ["", "| anchor | figure |", "|---|---|",
                f"| `with torch.device(...): GPT(cfg)` | {_f(plain.get('build_s'), 2)} s |",
                f"| `torch.save` of model + AdamW ({_f(plain.get('checkpoint_gib'))} GiB, fsynced) | "
                f"{_f(plain.get('torch_save_s'))} s |",
                f"| `ShardedCheckpointer.save` (synchronous) | {_f(plain.get('sharded_save_s'))} s |",
                *(f"| `save(async_=True)`, staging={staging}, {which}: blocked / cost to training / written in | "
                  f"{_f(plain.get(f'{staging}_{key}_blocked_s'), 2)} / "
                  f"{_f(plain.get(f'{staging}_{key}_stall_s'), 2)} / "
                  f"{_f(plain.get(f'{staging}_{key}_write_s'))} s |"
                  for staging in ("device", "host") for key, which in (("async", "first"), ("async2", "second"))),
                f"| `bench.gpt_step single-compile` | {_f(loop.get('tokens_per_s'), 0)} tokens/s, {mfu}, "
                f"{_f(loop.get('peak_mem_gib'))} GiB {loop.get('note') or ''} |"]  # fmt: skip
    ac = [r for r in rows if r.get("part") == "ac"]
    if ac:
        out += ["", "| activation checkpointing | GPT | largest batch | tokens/s | TFLOP/s | peak GiB | tried |",
                "|---|---|---:|---:|---:|---:|---|"]  # fmt: skip
        for r in ac:
            out.append(f"| {r['mode']} | {r['size']}, seq {r['seq_len']} | {_f(r.get('max_batch'))} | "
                       f"{_f(r.get('tokens_per_s'), 0)} | {_f(r.get('tflops'))} | {_f(r.get('peak_mem_gib'))} | "
                       f"{r['tried']} |")  # fmt: skip
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if args.ac_probe:
        return ac_probe(args, args.ac_probe[0], int(args.ac_probe[1]))
    if args.report:
        with open(args.report) as f:
            print(table([json.loads(line) for line in f if line.strip()]))
        return 0
    base = args.dir or tempfile.mkdtemp(prefix="distlib-scale-")
    os.makedirs(base, exist_ok=True)
    rows: list[dict] = []
    try:
        for part in args.parts:
            if part == "anchors":
                run_anchors(args, base, rows)
            elif part in ("runner", "recipe"):
                run_runner(args, base, rows, part)
            elif part == "ac":
                run_ac(args, rows, argv)
            else:
                print(f"unknown part {part!r}: anchors, runner, recipe, ac", file=sys.stderr)
                return 2
    finally:
        if not args.dir:
            shutil.rmtree(base, ignore_errors=True)
    print(table(rows), flush=True)
    return 0 if all(not r.get("rc") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
