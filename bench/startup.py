"""A Hugging Face family's recipe through ``launch.py`` twice, cold and warm: where its start-up goes.

    python -m bench.startup --families llama,gemma2          # one GPU: each family's shape, cold then warm
    python -m bench.startup --tiny                           # tiny shapes on the CPU (the test)

For each family of ``bench.hf_families.SHAPES`` (its batch and sequence there), a recipe of
``model.name: hf_causal_lm`` with that config, bf16, AdamW, each decoder layer compiled, ``--steps``
steps on random token ids in a token file, one GPU, under torchrun: first with an empty compile cache
(cold: the memory plan is made, the blocks compiled), then again with what the first run left (warm:
the plan read, the kernels cached). From each run's ``summary.json``: the start-up stages (``imports``,
``config``, ``memory_plan``, ``init``, ``model``, ``warmup``...), start to first step, the final
checkpoint and its phases, steps, evaluation and the whole command. Rows in ``--json``; a table last.
BENCHMARKS.md, "Start-up".
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

if __package__ in (None, ""):  # run as `python bench/startup.py`: the repository root on the path
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import hf_families  # noqa: E402
from bench import rows as rows_  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STAGES = ("imports", "config", "memory_plan", "init", "data", "loader", "compiler", "model", "warmup")
PHASES = ("to_host_s", "write_s", "fsync_s", "commit_s")


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.startup", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--families", default="llama,gemma2", help="of: " + ", ".join(hf_families.SHAPES))
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--dir", default="", help="runs, caches and tokens (default: a temporary directory, deleted)")
    p.add_argument("--json", default=os.path.join(ROOT, ".bench", "out", "startup.jsonl"))
    p.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU, 2 steps, aot_eager")
    args = p.parse_args(argv)
    args.families = [f for f in args.families.split(",") if f]
    for f in args.families:
        if f not in hf_families.SHAPES:
            p.error(f"--families: {f!r} is not one of {', '.join(hf_families.SHAPES)}")
    return args


def recipe(args: argparse.Namespace, family: str, base: str) -> tuple[str, int, int]:
    """The family's recipe file in ``base``, its batch and sequence length."""
    import yaml

    batch, seq = hf_families.SEQ.get(family, (8, 2048))
    config = hf_families.tiny_shape(family) if args.tiny else dict(hf_families.SHAPES[family][1])
    if args.tiny:
        batch, seq = 2, 32
    train = {"epochs": 1, "max_steps": args.steps, "batch_size": batch, "optimizer": "adamw", "lr": 3e-4,
             "precision": "bf16", "clip_grad_norm": 1.0, "compile": "blocks", "sample_tokens": 0,
             "prewarm_steps": 3, "compile_backend": "aot_eager" if args.tiny else "inductor"}  # fmt: skip
    text = {"data": {"name": "token_file", "args": {"block_size": seq}},
            "model": {"name": "hf_causal_lm", "args": {"config": {"model_type": family, **config}}},
            "train": train}  # fmt: skip
    path = os.path.join(base, f"{family}.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(text, f)
    return path, batch, seq


def tokens(base: str, batch: int, seq: int, steps: int) -> tuple[str, float]:
    """Random ids for the steps and a validation split of two sequences; the split's fraction."""
    import numpy as np

    from distlib.runner.data.token_files import write_token_file

    n, n_val = (steps * batch + 4) * seq + 1, 2 * seq + 1
    ids = np.random.default_rng(0).integers(0, hf_families.TOKEN_IDS, n + n_val, dtype=np.int64)
    path = os.path.join(base, f"tokens-{batch}x{seq}.bin")
    write_token_file(path, ids, dtype="uint16", header=True)
    return path, n_val / (n + n_val)


def run(args: argparse.Namespace, family: str, base: str, cold: bool) -> dict:
    path, batch, seq = recipe(args, family, base)
    data, val = tokens(base, batch, seq, args.steps)
    out, cache = os.path.join(base, f"{family}-{'cold' if cold else 'warm'}"), os.path.join(base, f"cache-{family}")
    if cold:
        shutil.rmtree(cache, ignore_errors=True)
    shutil.rmtree(out, ignore_errors=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1", **({"CUDA_VISIBLE_DEVICES": ""} if args.tiny else {}))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1",
           os.path.join(ROOT, "launch.py"), path, f"data.root={data}", f"data.args.val_frac={val:.6f}",
           f"run.out_dir={out}", f"run.compile_cache_dir={cache}", "run.resume=false", "run.progress=plain",
           *(["run.memory_plan=on"] if args.tiny else [])]  # fmt: skip
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    row = {"family": family, "cache": "cold" if cold else "warm", "rc": proc.returncode,
           "command_s": round(time.perf_counter() - t0, 1)}  # fmt: skip
    logs = os.path.join(os.path.dirname(args.json) or ".", "logs")
    os.makedirs(logs, exist_ok=True)
    with open(os.path.join(logs, f"startup-{family}-{row['cache']}.log"), "w") as f:
        f.write(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        row["note"] = rows_.failure(proc.stderr)
        return row
    with open(os.path.join(out, "summary.json")) as f:
        summary = json.load(f)
    row.update({f"{s}_s": summary.get("stages", {}).get(s) for s in STAGES})
    row.update({k: summary.get(k) for k in ("to_first_step_s", "train_s", "eval_s", "final_checkpoint_s")})
    row["save_phases"] = summary.get("final_checkpoint_phases")
    row["beyond_s"] = round(row["command_s"] - (row["train_s"] or 0) - (row["eval_s"] or 0), 1)
    return row


def table(rows: list[dict]) -> str:
    def f(v) -> str:
        return "—" if v is None else f"{v:.1f}" if isinstance(v, float) else str(v)

    head = ["family", "cache", *STAGES, "to 1st step", "final save (to host / write / fsync / commit)", "steps",
            "evaluation", "whole", "beyond"]  # fmt: skip
    out = ["| " + " | ".join(head) + " |", "|---|---|" + "---:|" * (len(head) - 2)]
    for r in rows:
        if r.get("rc"):
            out.append(f"| {r['family']} | {r['cache']} | failed: {r.get('note', '')} |")
            continue
        phases = r.get("save_phases") or {}
        save = f"{f(r.get('final_checkpoint_s'))} ({' / '.join(f(phases.get(k)) for k in PHASES)})"
        cells = [r["family"], r["cache"], *(f(r.get(f"{s}_s")) for s in STAGES), f(r.get("to_first_step_s")), save,
                 f(r.get("train_s")), f(r.get("eval_s")), f(r.get("command_s")), f(r.get("beyond_s"))]  # fmt: skip
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else list(argv))
    base = args.dir or tempfile.mkdtemp(prefix="distlib-startup-")
    os.makedirs(base, exist_ok=True)
    rows: list[dict] = []
    try:
        for family in args.families:
            for cold in (True, False):
                rows_.emit("startup", args.json, run(args, family, base, cold), rows)
    finally:
        if not args.dir:
            shutil.rmtree(base, ignore_errors=True)
    print(table(rows), flush=True)
    return 0 if all(not r.get("rc") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
