"""bench/flagship.sh's bookkeeping: one JSON line per timed command (``record``), and the
table and results.json of all of them (``table``). Standard library only."""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys

FIELDS = ("to_first_step_s", "train_s", "eval_s", "teardown_s", "total_s")


def record(args: argparse.Namespace) -> dict:
    t1, t2 = args.wall
    row = {"name": args.name, "kind": args.kind, "seed": args.seed, "rc": args.rc, "wall_s": round(t2 - t1, 3)}
    text = open(args.log, errors="replace").read() if os.path.exists(args.log) else ""
    floor = re.search(r'^\{"floor": .*\}$', text, re.M)
    if floor:
        row["floor"] = json.loads(floor.group(0))["floor"]
    summary_path = os.path.join(args.run_dir, "summary.json")
    if os.path.exists(summary_path):
        with open(summary_path) as f:
            row["summary"] = json.load(f)
    metrics_path = os.path.join(args.run_dir, "metrics.jsonl")
    if os.path.exists(metrics_path):
        with open(metrics_path) as f:
            rows = [json.loads(line) for line in f if line.strip()]
        if rows:
            row["test_acc"] = rows[-1].get("test_acc")
            row["train_s_airbench"] = rows[-1].get("train_s")  # steps and the final evaluation
    return row


def table(args: argparse.Namespace) -> None:
    with open(args.results) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    for r in rows:  # the curves are drawn after the exit: present now?
        run_dir = os.path.join(args.runs, r["name"])
        if os.path.isdir(run_dir):
            r["curves_png"] = os.path.exists(os.path.join(run_dir, "curves.png"))
    cols = " ".join(f"{k[:-2]:>13}" for k in FIELDS)
    head = f"{'run':<16} {'rc':>3} {'wall':>7} {cols} {'lead':>6} {'acc':>7}"
    print(head)
    print("-" * len(head))
    for r in rows:
        s = r.get("summary", {})
        cells = " ".join(f"{s[k]:>13.2f}" if s.get(k) is not None else f"{'-':>13}" for k in FIELDS)
        lead = s.get("launcher_lead_s")
        acc = r.get("test_acc")
        print(
            f"{r['name']:<16} {r['rc']:>3} {r['wall_s']:>7.2f} {cells} "
            f"{'-' if lead is None else f'{lead:.2f}':>6} {'-' if acc is None else f'{100 * acc:.2f}%':>7}"
        )
    floors = [r["floor"] for r in rows if "floor" in r]
    if floors:
        print("floor, rank 0, seconds from its process start: " + "  ".join(
            f"{k} {statistics.median(f[k] for f in floors):.2f}" for k in floors[0]
        ))  # fmt: skip
    for r in rows:
        if r.get("summary", {}).get("stages"):
            print(f"{r['name']} stages: " + "  ".join(f"{k} {v:.2f}" for k, v in r["summary"]["stages"].items()))
    print("wall: the whole command from outside; lead: torchrun's agent start to the worker's start; "
          "total: worker start to its last stamp (before the interpreter exits)")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
            f.write("\n")


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record")
    r.add_argument("--name", required=True)
    r.add_argument("--kind", required=True)
    r.add_argument("--seed", required=True)
    r.add_argument("--rc", type=int, required=True)
    r.add_argument("--wall", type=float, nargs=2, required=True)
    r.add_argument("--log", required=True)
    r.add_argument("--run-dir", required=True)
    t = sub.add_parser("table")
    t.add_argument("results")
    t.add_argument("--json", default="")
    t.add_argument("--runs", required=True, help="the folder that holds each run's out_dir")
    args = p.parse_args(argv)
    if args.cmd == "record":
        print(json.dumps(record(args)))
    else:
        table(args)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
