"""What the check before launch costs a recipe's first run, on any machine: the memory plan of the
recipe's own mode, as ``launch.py`` makes it (``check_before_launch``, ``run.memory_plan=on``, an
empty plan cache), in a fresh process each time.

    python -m bench.plan_time                       # the 1.5B GPT of bench.scale, 16 x 1024, compiled blocks
    python -m bench.plan_time --recipe recipes/llama_1b.yaml --repeats 3

Each repeat prints one RESULT line, process-CPU and wall seconds of:
``torch``: ``import torch``; ``compile_imports``: AOTAutograd's and inductor's modules that the plan of
compiled blocks needs (its partitioner) and that the run's own compilation imports anyway, imported
first here so that they are not counted in ``plan``; ``plan``: the check itself, after them;
``rerun``: the same check again (the plan read from its cache, as a rerun or a resume reads it).
BENCHMARKS.md, "Start-up".
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPT_1_5B = ["data.name=token_file", "data.args.block_size=1024", "model.args.vocab_size=50304",
            "model.args.n_layer=48", "model.args.n_head=25", "model.args.n_embd=1600", "model.args.dropout=0.0",
            "train.batch_size=16", "train.precision=bf16", "train.compile=blocks", "train.prewarm_steps=3",
            "dist.shard=none"]  # fmt: skip


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.plan_time", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--recipe", default="", help="a recipe (default: the 1.5B GPT on a token file)")
    p.add_argument("overrides", nargs="*", help="a.b=value overrides of the recipe")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    return p.parse_intermixed_args(argv)


def child(args: argparse.Namespace) -> int:
    clock = [(time.process_time(), time.perf_counter())]

    def lap() -> str:
        clock.append((time.process_time(), time.perf_counter()))
        (c0, w0), (c1, w1) = clock[-2], clock[-1]
        return f"{c1 - c0:.2f}/{w1 - w0:.2f}"

    import torch  # noqa: F401

    out = {"torch": lap()}
    import torch._functorch.aot_autograd  # noqa: F401
    import torch._functorch.partitioners  # noqa: F401
    import torch._inductor.compile_fx  # noqa: F401
    import torch._inductor.decomposition  # noqa: F401

    from distlib.runner.config import load_config
    from distlib.runner.training.memory_plan import check_before_launch

    out["compile_imports"] = lap()
    with tempfile.TemporaryDirectory() as d:
        overrides = [*args.overrides, "run.memory_plan=on", f"run.compile_cache_dir={d}", f"run.out_dir={d}/out"]
        if not args.recipe:
            tokens = os.path.join(d, "tokens.bin")
            with open(tokens, "wb") as f:
                f.write(b"\0" * 4 * 1024 * 64)
            overrides = [*GPT_1_5B, f"data.root={tokens}", *overrides]
        cfg = load_config(args.recipe or os.path.join(ROOT, "recipes", "gpt_tokens_demo.yaml"), overrides)
        lap()
        check_before_launch(cfg)
        out["plan"] = lap()
        check_before_launch(cfg)
        out["rerun"] = lap()
    print("RESULT " + " ".join(f"{k}={v}" for k, v in out.items()) + "  (CPU/wall s)", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.child:
        return child(args)
    cmd = [sys.executable, "-m", "bench.plan_time", "--child", *(["--recipe", args.recipe] if args.recipe else []),
           *args.overrides]  # fmt: skip
    ok = True
    for _ in range(args.repeats):
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        found = re.search(r"^RESULT .*$", proc.stdout, re.M)
        ok &= proc.returncode == 0 and found is not None
        print(found.group(0) if found else (proc.stdout + proc.stderr)[-2000:], flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
