"""Side-by-side summary of one gpu_gradsync.sh run: distlib's benchmark against the baselines.

    python3 bench/gradsync_report.py OUT_DIR      # reads bench.json and the baseline logs there

Prints a Markdown summary (also written to OUT_DIR/gradsync_summary.md) for BENCHMARKS.md.
"""

from __future__ import annotations

import json
import os
import re
import sys


def _read(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def _baseline_ips(text: str) -> float | None:
    m = re.search(r"RESULT .*images_per_s=(\d+)", text)
    return float(m.group(1)) if m else None


def _baseline_busbw(text: str) -> dict[int, float]:
    rows = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[0].isdigit():
            rows[int(parts[0])] = float(parts[2])
    return rows


def main(out: str) -> int:
    lines = ["# gradsync GPU run", ""]
    bench = {}
    if os.path.exists(os.path.join(out, "bench.json")):
        with open(os.path.join(out, "bench.json")) as f:
            bench = json.load(f)
    env = bench.get("environment", {})
    lines.append(f"torch {env.get('torch')}, CUDA {env.get('cuda')}, NCCL {env.get('nccl')}, GPUs {env.get('gpus')}")
    lines += ["", "## Training step, ResNet18-CIFAR, 512 images per GPU, bf16, channels_last", ""]
    single = _baseline_ips(_read(os.path.join(out, "baseline_single.log")))
    ddp = _baseline_ips(_read(os.path.join(out, "baseline_ddp.log")))
    lines += ["| mode | GPUs | step ms | images/s | vs ddp-eager row | vs baseline DDP |", "|---|---|---|---|---|---|"]
    steps = bench.get("step", [])
    fallback_json = os.path.join(out, "bench_fallback.json")
    if os.path.exists(fallback_json):  # the fallback mode runs as its own single process
        with open(fallback_json) as f:
            steps = [r for r in steps if r["mode"] != "fallback"] + json.load(f).get("step", [])
    ours_ddp = next((r["images_per_s"] for r in steps if r["mode"] == "ddp-eager" and not r["note"]), None)
    for r in steps:
        if r["note"]:
            lines.append(f"| {r['mode']} | - | - | - | {r['note']} | |")
            continue
        v1 = f"{r['images_per_s'] / ours_ddp:.3f}" if ours_ddp else "-"
        v2 = f"{r['images_per_s'] / ddp:.3f}" if ddp else "-"
        lines.append(f"| {r['mode']} | {r['world']} | {r['step_ms']:.2f} | {r['images_per_s']:.0f} | {v1} | {v2} |")
    lines.append(f"| baseline rn18_throughput MODE=single | 1 | | {single or '-'} | | |")
    lines.append(f"| baseline rn18_throughput MODE=ddp | 2 | | {ddp or '-'} | | 1.000 |")

    ar = bench.get("allreduce")
    if ar:
        baseline_bw = _baseline_busbw(_read(os.path.join(out, "baseline_allreduce_bw.log")))
        alt = ar.get("also_bucket_mb", 0) > 0
        groups = ar.get("groups", [1])
        title = f"## all_reduce fp32, {ar['world']} GPUs, bus bandwidth GB/s"
        note = (
            f"{ar['bucket_mb']:g} MB buckets launched back to back, bucket i on communicator i % n "
            "(GradSync's `comm_groups=n`); ratio = bucketed / raw"
        )
        head = "| bytes | raw | buckets |" + "".join(f" n={n} | ratio |" for n in groups)
        head += f" {ar['also_bucket_mb']:g} MB buckets (n=1) | ratio |" if alt else ""
        cols = 3 + 2 * len(groups) + (2 if alt else 0) + 1
        lines += ["", title, "", note, "", head + " baseline allreduce_bw.py |", "|---" * cols + "|"]
        for r in ar["rows"]:
            a = baseline_bw.get(r["bytes"])
            line = f"| {r['bytes']} | {r['raw_busbw']:.1f} | {r['buckets']} |"
            line += "".join(f" {b['busbw']:.1f} | {b['ratio']:.3f} |" for b in r["bucketed"])
            if alt:
                line += f" {r['alt_bucketed_busbw']:.1f} ({r['alt_buckets']}) | {r['alt_ratio']:.3f} |"
            lines.append(line + f" {a if a is not None else '-'} |")
        lines.append("")
        for m in ar["model_sync"]:
            lines.append(
                f"Synthetic {m['params'] / 1e6:.1f}M-parameter model ({m['buckets']} buckets, {m['groups']} "
                f"communicator(s)): GradSync sync {m['sync_ms']:.2f} ms ({m['sync_busbw']:.1f} GB/s) vs one raw "
                f"all_reduce {m['raw_ms']:.2f} ms ({m['raw_busbw']:.1f} GB/s): {m['ratio']:.3f}."
            )
    if bench.get("summary"):
        lines += ["", "## Targets", ""] + [f"- {k}: {v}" for k, v in bench["summary"].items()]
    probe = _read(os.path.join(out, "graph_step_probe.log"))
    if probe:
        where = [ln.strip() for ln in probe.splitlines() if "graph_step.py" in ln and "line" in ln]
        lines += ["", "## bench/baselines/graph_step.py with 2 processes (hang probe)", ""]
        lines.append("RESULT printed: " + ("yes" if "RESULT" in probe else "no"))
        lines.append("returned: " + ("yes" if "returned" in probe else "no"))
        if where:
            lines.append("stuck at (innermost graph_step.py frame per rank): " + "; ".join(sorted(set(where))))
    text = "\n".join(lines) + "\n"
    print(text)
    with open(os.path.join(out, "gradsync_summary.md"), "w") as f:
        f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else os.environ.get("OUT", ".bench/out")))
