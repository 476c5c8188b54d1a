"""Recipe runs: time to accuracy (or to a validation loss), launch.py over recipes x seeds, one table.

    python bench/recipes.py --nproc 2 --data .bench/cifar10-jpeg.tar.gz \
        --run "fast:recipes/cifar.yaml" --run "accuracy:recipes/cifar_accuracy.yaml" --seeds 0 1 2
    python bench/recipes.py --nproc 2 --data .bench/shakespeare.txt.gz --run "gpt:recipes/gpt_shakespeare.yaml"

Each run is a whole `torchrun ... launch.py RECIPE data.root=DATA train.seed=S` command, timed from
outside (wall) and from inside (metrics.jsonl: the training clock from the first step through the
final evaluation; test accuracy for classification, validation loss for language models).
BENCHMARKS.md, "Time to accuracy" and "GPT recipe".
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--data", required=True)
    p.add_argument("--run", action="append", required=True, help="NAME:RECIPE [overrides...]")
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--out", default=os.environ.get("OUT", "runs/bench"))
    p.add_argument("--json", default="")
    args = p.parse_args()
    rows = []
    for spec in args.run:
        name, rest = spec.split(":", 1)
        recipe, *overrides = shlex.split(rest)
        for seed in args.seeds:
            out_dir = os.path.join(args.out, f"{name}-s{seed}-n{args.nproc}")
            cmd = [
                "torchrun", "--standalone", f"--nproc-per-node={args.nproc}", "launch.py", recipe,
                f"data.root={args.data}", f"train.seed={seed}", f"run.out_dir={out_dir}", "run.resume=false",
                *overrides,
            ]  # fmt: skip
            t0 = time.perf_counter()
            proc = subprocess.run(cmd, capture_output=True, text=True)
            wall = time.perf_counter() - t0
            log = proc.stdout + proc.stderr
            print(f"$ {shlex.join(cmd)}\n{log[-3000:]}", flush=True)
            metrics = []
            mpath = os.path.join(out_dir, "metrics.jsonl")
            if os.path.exists(mpath):
                metrics = [json.loads(line) for line in open(mpath) if line.strip()]
            last = metrics[-1] if metrics else {}
            rows.append(
                {
                    "name": name, "seed": seed, "nproc": args.nproc, "rc": proc.returncode,
                    "epochs": last.get("epoch"), "test_acc": last.get("test_acc"), "val_loss": last.get("val_loss"),
                    "train_s": last.get("train_s"), "wall_s": round(wall, 2),
                    "images_per_s": last.get("images_per_s"), "overrides": " ".join(overrides),
                    "curve": [(m["train_s"], m.get("test_acc", m.get("val_loss"))) for m in metrics
                              if m.get("test_acc", m.get("val_loss")) is not None],
                }
            )  # fmt: skip
            if args.json:  # after every run, so a call cut short still returns what it measured
                with open(args.json, "w") as f:
                    json.dump(rows, f, indent=1)
    print(
        f"\n{'name':<10} {'seed':>4} {'n':>2} {'rc':>3} {'ep':>3} {'acc':>7} {'val_loss':>8} {'train_s':>8} "
        f"{'wall_s':>7} {'img/s':>9}"
    )
    for r in rows:
        print(
            f"{r['name']:<10} {r['seed']:>4} {r['nproc']:>2} {r['rc']:>3} {r['epochs'] or '-':>3} "
            f"{r['test_acc'] or float('nan'):>7.4f} {r['val_loss'] or float('nan'):>8.4f} "
            f"{r['train_s'] or float('nan'):>8.2f} {r['wall_s']:>7.2f} "
            f"{r['images_per_s'] or float('nan'):>9.0f}"
        )
    return 0 if all(r["rc"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
