"""Loading a Hugging Face pretrained folder through the runner, and exporting a run back into one,
against the disk's own time for the same bytes, on one GPU.

    python -m bench.hf_io                                  # the Llama-3.2-1B shape in bf16
    python -m bench.hf_io --shard optimizer --reuse        # export from a sharded (DCP) checkpoint
    python -m bench.hf_io --report .bench/out/hf_io.jsonl  # the table of every row written so far
    python -m bench.hf_io --tiny                           # a tiny Llama on the CPU (the test)

What it does, in order:

1. The folder: the model of recipes/llama_1b.yaml's ``model.args.config`` (hidden 2048, 16 layers,
   32 heads, 8 key/value heads, MLP 8192, vocabulary 128256, tied embeddings), built by transformers
   on ``--device`` with its own random initialisation in ``--dtype`` and written by
   ``save_pretrained`` (safetensors) into ``--dir``; ``--reuse`` keeps a folder already there.
2. The disk anchors: reading the folder's files after evicting them from the page cache
   (``fsync``, then ``posix_fadvise(POSIX_FADV_DONTNEED)``, which needs no root), and writing as
   many bytes (a buffer, in 64 MiB writes) into a new file, fsynced. Medians of ``--repeats``.
3. Load: the runner's own ``Trainer.build_model`` on ``model.name: hf_causal_lm`` with
   ``model.args.pretrained: DIR`` (a Trainer and its task built as launch.py builds them, in this
   process, at world size 1): the model built on the device without initialisation, then
   ``load_pretrained`` reading the folder into it. The folder is evicted before each one, so every
   load is a cold read; the median of ``--repeats``, with its read part. Then the same through
   ``launch.py`` under torchrun (one process, ``dist.shard=--shard``, one step of ``--seq-len``
   tokens, the folder evicted first): its ``model`` stage from summary.json (the model, its read,
   the optimizer and the training step's set-up, and the first import of transformers' model
   classes, which the timed loads above leave out) and the final checkpoint it saves.
4. Export: ``distlib.runner.models.export.export(RUN_DIR, OUT_DIR)`` of that run's checkpoint, timed with
   the fsync of the files it wrote (export fsyncs its model.safetensors itself; config.json is left
   to this), median of ``--repeats``, twice: with the checkpoint cold (evicted first) and warm (its
   files read once before, as the run that wrote them leaves them in the page cache); then the
   command ``python -m distlib.runner.export`` once, cold, whose time includes its interpreter and
   imports. The cold ones against the cold read of the bytes export reads (the records of the
   exported tensors: the model's part of the checkpoint, not the optimizer's) plus the fsynced
   write of the bytes it writes; the warm one against that write alone.

The target: load and export each within 1.5x the disk's time for their bytes (the read for the
load; the read and the write for the cold export, the write for the warm one). On a filesystem that
ignores the eviction (tmpfs) the reads are from memory.
Every row is printed as a JSON line and appended to ``--json``; a markdown table comes last.
BENCHMARKS.md, "Llama recipe (Hugging Face)".
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence

if __package__ in (None, ""):  # run as `python bench/hf_io.py`: the repository root on the path
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import rows as rows_  # noqa: E402  (after the path is set)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHUNK = 64 << 20  # bytes a read or write of the anchors moves at a time
TINY_CONFIG = dict(model_type="llama", vocab_size=512, hidden_size=64, intermediate_size=192, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                   tie_word_embeddings=True)  # fmt: skip
TINY = ["--device=cpu", "--seq-len=32", "--repeats=2"]
TARGET = 1.5  # x the disk's time


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.hf_io", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--dir", default="", help="the pretrained folder (default .bench/hf-llama-1b-DTYPE, "
                   "with --tiny .bench/hf-tiny-DTYPE); the run and the export go next to it")  # fmt: skip
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16", help="of the folder and of the export")
    p.add_argument("--reuse", action="store_true", help="keep a folder already in --dir (its config.json)")
    p.add_argument("--shard", choices=["none", "optimizer", "full"], default="none",
                   help="dist.shard of the run: the checkpoint export reads (none: one file, optimizer and full: "
                   "DCP's)")  # fmt: skip
    p.add_argument("--seq-len", type=int, default=256, help="tokens of the run's one training sequence")
    p.add_argument("--repeats", type=int, default=3, help="timed loads, exports and anchors (medians)")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--keep", action="store_true", help="keep the run and the exported folder")
    p.add_argument("--json", default=os.path.join(".bench", "out", "hf_io.jsonl"), help="rows appended here")
    p.add_argument("--report", metavar="JSONL", help="print the table of the rows in this file and exit")
    p.add_argument("--tiny", action="store_true", help="a tiny Llama on the CPU: " + " ".join(TINY))
    args = p.parse_args(argv)
    if args.tiny:
        args = p.parse_args([*TINY, *argv])
    if args.repeats < 1:
        p.error(f"--repeats {args.repeats}: at least 1")
    if not args.dir:
        args.dir = os.path.join(".bench", f"hf-{'tiny' if args.tiny else 'llama-1b'}-{args.dtype}")
    args.dir = os.path.abspath(args.dir)
    return args


def emit(args: argparse.Namespace, row: dict, rows: list[dict]) -> None:
    rows_.emit("hf_io", args.json, row, rows)


def llama_config(tiny: bool) -> dict:
    """The transformers config of the folder: recipes/llama_1b.yaml's, or a tiny Llama."""
    if tiny:
        return dict(TINY_CONFIG)
    import yaml

    with open(os.path.join(ROOT, "recipes", "llama_1b.yaml")) as f:
        return dict(yaml.safe_load(f)["model"]["args"]["config"])


# ---- files and the page cache --------------------------------------------------------------------
def files_under(path: str) -> list[str]:
    """Every file under ``path`` (or ``path`` itself), in name order."""
    if os.path.isfile(path):
        return [path]
    return sorted(os.path.join(d, f) for d, _, names in os.walk(path) for f in names)


def size_of(files: Sequence[str]) -> int:
    return sum(os.path.getsize(f) for f in files)


def sync_files(files: Sequence[str]) -> None:
    """Each file's data on the disk (and the directories that name them)."""
    for path in [*files, *sorted({os.path.dirname(f) for f in files})]:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def evict(files: Sequence[str]) -> None:
    """Drop the files' pages from the page cache, so the next read comes from the disk: written back
    first (fsync), as the kernel keeps dirty pages."""
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def disk_read_s(files: Sequence[str]) -> float:
    """Seconds to read the files whole, from the disk (evicted first)."""
    evict(files)
    buf = memoryview(bytearray(CHUNK))
    t0 = time.perf_counter()
    for path in files:
        with open(path, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass
    return time.perf_counter() - t0


def disk_write_s(directory: str, nbytes: int) -> float:
    """Seconds to write ``nbytes`` into a new file in ``directory`` and fsync it."""
    chunk = memoryview(os.urandom(min(CHUNK, max(nbytes, 1))))
    path = os.path.join(directory, "anchor-write.bin")
    t0 = time.perf_counter()
    with open(path, "wb", buffering=0) as f:
        left = nbytes
        while left > 0:
            left -= f.write(chunk[: min(left, len(chunk))])
        os.fsync(f.fileno())
    seconds = time.perf_counter() - t0
    os.remove(path)
    return seconds


def median_of(repeats: int, fn: Callable[[], float]) -> float:
    return statistics.median(fn() for _ in range(repeats))


# ---- the folder ----------------------------------------------------------------------------------
def make_folder(args: argparse.Namespace, config: dict) -> dict:
    """The model of ``config`` with transformers' random initialisation, written by save_pretrained."""
    import torch
    import transformers

    from distlib.runner.models.export import DTYPES
    from distlib.runner.models.hf_causal_lm import build_config

    cfg = build_config(config)
    torch.manual_seed(0)
    with torch.device(args.device):  # initialised where it is fast; save_pretrained copies to the host
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=DTYPES[args.dtype])
    shutil.rmtree(args.dir, ignore_errors=True)
    rows_.sync(args.device)
    t0 = time.perf_counter()
    model.save_pretrained(args.dir)
    saved_s = time.perf_counter() - t0
    sync_files(files_under(args.dir))
    params = sum(p.numel() for p in model.parameters())
    del model
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return {"save_pretrained_s": round(saved_s, 4), "save_pretrained_fsync_s": round(time.perf_counter() - t0, 4),
            "params": params}  # fmt: skip


# ---- the run ---------------------------------------------------------------------------------------
def write_recipe(args: argparse.Namespace, work: str, vocab: int) -> tuple[str, str]:
    """Random tokens for the run's one step and its evaluation, and the recipe of that run: the
    folder as ``model.args.pretrained``, AdamW (its state in the checkpoint, as a training run's).
    Returns (recipe path, run directory)."""
    import numpy as np
    import yaml

    from distlib.runner.data.token_files import write_token_file

    n_train, n_val = 5 * args.seq_len + 1, 2 * args.seq_len + 1
    tokens = np.random.default_rng(0).integers(0, vocab, n_train + n_val, dtype=np.int64)
    data = os.path.join(work, "tokens.bin")
    write_token_file(data, tokens, dtype="uint16" if vocab <= 1 << 16 else "uint32", header=True)
    run_dir = os.path.join(work, "run")
    recipe = {
        "data": {"name": "token_file", "root": data,
                 "args": {"block_size": args.seq_len, "val_frac": round(n_val / (n_train + n_val), 6)}},
        "model": {"name": "hf_causal_lm", "args": {"pretrained": args.dir}},
        "train": {"epochs": 1, "max_steps": 1, "batch_size": 1, "optimizer": "adamw", "lr": 1e-5,
                  "label_smoothing": 0.0, "precision": "bf16", "compile": "none", "prewarm_steps": 1,
                  "sample_tokens": 0},
        "dist": {"shard": args.shard},
        "run": {"out_dir": run_dir, "resume": False, "progress": "plain"},
    }  # fmt: skip
    path = os.path.join(work, "recipe.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(recipe, f)
    return path, run_dir


def import_model_classes(folder: str) -> None:
    """The folder's model built once on the meta device, untimed: transformers imports its model
    classes on their first use, which the timed loads then leave out (launch.py's stage has it)."""
    import torch

    from distlib.runner.models.hf_causal_lm import hf_causal_lm

    with torch.device("meta"):
        hf_causal_lm(pretrained=folder)


def load_once(args: argparse.Namespace, recipe: str, folder: list[str]) -> dict:
    """One cold load by the runner's Trainer.build_model (the folder evicted first), at world size 1
    and dist.shard=none (full sharding needs a process group: the launch.py run covers it)."""
    import torch

    from distlib.distributed.process_group import Context
    from distlib.runner.config import load_config
    from distlib.runner.models.hf_causal_lm import HFCausalLM
    from distlib.runner.observability.timeline import Timeline
    from distlib.runner.tasks import build_task
    from distlib.runner.training.trainer import Trainer

    cfg = load_config(recipe, ["dist.shard=none"])
    device = torch.device(args.device)
    ctx = Context(rank=0, local_rank=0, world_size=1, local_world_size=1, device=device, backend="none")
    trainer = Trainer(cfg, ctx, Timeline())
    trainer.task = build_task(cfg, ctx, cfg.train.batch_size, trainer.timeline)  # what build() does first
    read = {}
    original = HFCausalLM.load_pretrained

    def timed_load(model: HFCausalLM) -> int:  # the read, within build_model
        rows_.sync(args.device)
        t = time.perf_counter()
        read["bytes"] = original(model)
        rows_.sync(args.device)
        read["s"] = time.perf_counter() - t
        return read["bytes"]

    evict(folder)
    HFCausalLM.load_pretrained = timed_load
    try:
        torch.manual_seed(cfg.train.seed)
        rows_.sync(args.device)
        t0 = time.perf_counter()
        model = trainer.build_model()
        rows_.sync(args.device)
        total = time.perf_counter() - t0
    finally:
        HFCausalLM.load_pretrained = original
    if "s" not in read:
        raise RuntimeError("Trainer.build_model did not call load_pretrained: no read to time")
    del model, trainer
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return {"s": total, "read_s": read["s"], "read_bytes": read["bytes"]}


def run_launch(args: argparse.Namespace, recipe: str, run_dir: str, folder: list[str]) -> dict:
    """launch.py under torchrun, one process, the folder evicted first: its model stage and final
    checkpoint from summary.json."""
    shutil.rmtree(run_dir, ignore_errors=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if args.device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1",
           os.path.join(ROOT, "launch.py"), recipe]  # fmt: skip
    evict(folder)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    row = {"rc": proc.returncode, "command_s": round(time.perf_counter() - t0, 2)}
    if proc.returncode != 0:
        row["note"] = rows_.failure(proc.stderr)
        return row
    with open(os.path.join(run_dir, "summary.json")) as f:
        summary = json.load(f)
    stages = summary.get("stages", {})
    row.update(s=stages.get("model"), checkpoint_s=stages.get("checkpoint"), total_s=summary.get("total_s"))
    return row


# ---- export --------------------------------------------------------------------------------------
def export_reads(checkpoint_dir: str, out_file: str) -> list[tuple[str, int, int]]:
    """(file, offset, length) of each record the export of ``out_file``'s tensors reads from the DCP
    checkpoint ``checkpoint_dir`` (the model's tensors, the run's hf_causal_lm without a weight
    average): the optimizer's state and the tied output layer are not read."""
    import torch.distributed.checkpoint as dcp
    from safetensors import safe_open

    with safe_open(out_file, framework="pt") as f:
        fqns = {f"model.hf.{k}" for k in f.keys()}
    storage = dcp.FileSystemReader(checkpoint_dir).read_metadata().storage_data
    return sorted((os.path.join(checkpoint_dir, info.relative_path), info.offset, info.length)
                  for index, info in storage.items() if index.fqn in fqns)  # fmt: skip


def disk_read_ranges_s(ranges: Sequence[tuple[str, int, int]]) -> float:
    """Seconds to read the byte ranges, in file and offset order, from the disk (their files evicted first)."""
    evict(sorted({f for f, _, _ in ranges}))
    buf = memoryview(bytearray(CHUNK))
    t0 = time.perf_counter()
    for path, offset, length in ranges:
        with open(path, "rb", buffering=0) as f:
            f.seek(offset)
            while length > 0:
                n = f.readinto(buf[: min(length, CHUNK)])
                if not n:
                    break
                length -= n
    return time.perf_counter() - t0


def warm(files: Sequence[str]) -> None:
    """Each file read once: in the page cache, as a run leaves the checkpoint it just wrote."""
    buf = memoryview(bytearray(CHUNK))
    for path in files:
        with open(path, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass


def export_once(args: argparse.Namespace, run_dir: str, out: str, checkpoint: list[str], cold: bool = True
                ) -> tuple[float, float]:  # fmt: skip
    """(seconds of export(), seconds with the fsync of what it wrote), the checkpoint evicted first
    (``cold``) or read once before."""
    from distlib.runner.models.export import export

    shutil.rmtree(out, ignore_errors=True)
    if cold:
        evict(checkpoint)
    else:
        warm(checkpoint)
    t0 = time.perf_counter()
    export(run_dir, out, args.dtype)
    done = time.perf_counter() - t0
    sync_files(files_under(out))
    return done, time.perf_counter() - t0


def export_command(args: argparse.Namespace, run_dir: str, out: str, checkpoint: list[str]) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    evict(checkpoint)
    cmd = [sys.executable, "-m", "distlib.runner.export", run_dir, out, f"--dtype={args.dtype}"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    row = {"rc": proc.returncode, "command_s": round(time.perf_counter() - t0, 4)}
    if proc.returncode != 0:
        row["note"] = rows_.failure(proc.stderr)
        return row
    sync_files(files_under(out))
    row["s"] = round(time.perf_counter() - t0, 4)
    return row


# ---- the whole -----------------------------------------------------------------------------------
def measure(args: argparse.Namespace, work: str, rows: list[dict]) -> None:
    config = llama_config(args.tiny)
    common = {"model": "tiny llama" if args.tiny else "llama-3.2-1b shape", "dtype": args.dtype,
              "device": args.device}  # fmt: skip
    if args.reuse and os.path.isfile(os.path.join(args.dir, "config.json")):
        made = {"reused": True}
    else:
        made = make_folder(args, config)
    folder = files_under(args.dir)
    folder_bytes = size_of(folder)
    read_s = median_of(args.repeats, lambda: disk_read_s(folder))
    write_s = median_of(args.repeats, lambda: disk_write_s(work, folder_bytes))
    emit(args, {"part": "folder", **common, "dir": args.dir, "bytes": folder_bytes, **made,
                "disk_read_s": round(read_s, 4), "disk_write_s": round(write_s, 4)}, rows)  # fmt: skip

    with open(os.path.join(args.dir, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    recipe, run_dir = write_recipe(args, work, vocab)
    import_model_classes(args.dir)
    loads = [load_once(args, recipe, folder) for _ in range(args.repeats)]
    emit(args, {"part": "load", "mode": "build_model", **common, "shard": "none", "bytes": folder_bytes,
                "s": round(statistics.median(r["s"] for r in loads), 4),
                "read_s": round(statistics.median(r["read_s"] for r in loads), 4),
                "read_bytes": loads[0]["read_bytes"], "disk_s": round(read_s, 4)}, rows)  # fmt: skip
    launched = run_launch(args, recipe, run_dir, folder)
    emit(args, {"part": "load", "mode": "launch.py", **common, "shard": args.shard, "bytes": folder_bytes,
                **launched, "disk_s": round(read_s, 4)}, rows)  # fmt: skip
    if launched["rc"]:
        return

    checkpoint = files_under(os.path.join(run_dir, "checkpoints"))
    ckpt_bytes = size_of(checkpoint)
    out = os.path.join(work, "export")
    cold = [export_once(args, run_dir, out, checkpoint) for _ in range(args.repeats)]
    hot = [export_once(args, run_dir, out, checkpoint, cold=False) for _ in range(args.repeats)]
    out_bytes = size_of(files_under(out))
    out_write_s = median_of(args.repeats, lambda: disk_write_s(work, out_bytes))
    directory = os.path.dirname(checkpoint[0])
    if os.path.isfile(os.path.join(directory, ".metadata")):  # DCP's: the records export reads
        reads = export_reads(directory, os.path.join(out, "model.safetensors"))
    else:  # a one-file checkpoint is read whole
        reads = [(f, 0, os.path.getsize(f)) for f in checkpoint]
    read_bytes = sum(n for _, _, n in reads)
    read_s = median_of(args.repeats, lambda: disk_read_ranges_s(reads))
    anchors = {"bytes": out_bytes, "checkpoint_bytes": ckpt_bytes, "read_bytes": read_bytes,
               "disk_read_s": round(read_s, 4), "disk_write_s": round(out_write_s, 4)}  # fmt: skip
    for cache, times in (("cold", cold), ("warm", hot)):
        disk = read_s + out_write_s if cache == "cold" else out_write_s
        emit(args, {"part": "export", "mode": "export()", "cache": cache, **common, "shard": args.shard, **anchors,
                    "disk_s": round(disk, 4), "s": round(statistics.median(d for _, d in times), 4),
                    "no_fsync_s": round(statistics.median(t for t, _ in times), 4)}, rows)  # fmt: skip
    emit(args, {"part": "export", "mode": "command", "cache": "cold", **common, "shard": args.shard, **anchors,
                "disk_s": round(read_s + out_write_s, 4), **export_command(args, run_dir, out, checkpoint)},
         rows)  # fmt: skip


# ---- the table --------------------------------------------------------------------------------------
def _f(v: float | None) -> str:
    """Seconds: two decimals, three below one second."""
    return "—" if v is None else f"{v:.2f}" if v >= 1 else f"{v:.3f}"


def _gb(n: int | None) -> str:
    return "—" if n is None else f"{n / 1e9:.2f}" if n >= 1e9 else f"{n / 1e9:.3g}"


def _rate(n: int | None, s: float | None) -> str:
    return "—" if not n or not s else f"{n / 1e9 / s:.2f}"


def _ratio(s: float | None, disk: float | None, target: bool = True) -> str:
    if s is None or not disk:
        return "—"
    r = s / disk
    return f"{r:.2f}x ({('met' if r <= TARGET else '**not met**') if target else 'no target'})"


def table(rows: Sequence[dict]) -> str:
    out = ["| operation | GB | s | GB/s | disk s | disk GB/s | vs disk (target ≤ 1.5x) |",
           "|---|---:|---:|---:|---:|---:|---|"]  # fmt: skip
    notes = []
    for r in rows:
        part, n = r.get("part"), r.get("bytes")
        what = f"{r.get('model', '')} {r.get('dtype', '')}".strip()
        if part == "folder":
            disk_r, disk_w = r.get("disk_read_s"), r.get("disk_write_s")
            out.append(f"| disk: read the folder's files, cold ({what}) | {_gb(n)} | {_f(disk_r)} | "
                       f"{_rate(n, disk_r)} | | | |")  # fmt: skip
            out.append(f"| disk: write as many bytes, fsynced | {_gb(n)} | {_f(disk_w)} | {_rate(n, disk_w)} | | | |")
            if "save_pretrained_fsync_s" in r:
                s = r["save_pretrained_fsync_s"]
                out.append(f"| save_pretrained + fsync (making the folder) | {_gb(n)} | {_f(s)} | {_rate(n, s)} | "
                           f"{_f(disk_w)} | {_rate(n, disk_w)} | {_ratio(s, disk_w, target=False)} |")  # fmt: skip
            continue
        if r.get("rc"):
            out.append(f"| {part} ({r.get('mode')}, dist.shard={r.get('shard')}): failed: {r.get('note', '')} "
                       "||||||")  # fmt: skip
            continue
        s, disk = r.get("s"), r.get("disk_s")
        if part == "load" and r.get("mode") == "build_model":
            label = f"load: Trainer.build_model, cold (of which the read {_f(r.get('read_s'))} s)"
        elif part == "load":
            label = f"load: launch.py's model stage, cold, dist.shard={r.get('shard')}"
            if r.get("checkpoint_s") is not None:
                notes.append(f"- The run's final checkpoint (dist.shard={r.get('shard')}): {_f(r['checkpoint_s'])} s.")
        elif part == "export":
            what = ("export() + fsync" if r.get("mode") == "export()"
                    else "python -m distlib.runner.export + fsync (the command)")  # fmt: skip
            where = f"dist.shard={r.get('shard')}"
            if r.get("cache") == "warm":
                label = f"export: {what}, checkpoint in the page cache, {where} (disk s: the write)"
            elif r.get("cache") == "cold":
                label = (f"export: {what}, checkpoint cold, {where} (disk s: the cold read of the "
                         f"{_gb(r.get('read_bytes'))} GB it reads + the write)")  # fmt: skip
                if r.get("mode") == "export()":
                    notes.append(
                        f"- Export ({where}) reads {_gb(r.get('read_bytes'))} GB of the "
                        f"{_gb(r.get('checkpoint_bytes'))} GB checkpoint (the exported tensors' records, not the "
                        f"optimizer's state): its cold read {_f(r.get('disk_read_s'))} s, the write "
                        f"{_f(r.get('disk_write_s'))} s; export() without the fsync {_f(r.get('no_fsync_s'))} s."
                    )
            else:  # a row of an earlier version: cold, against the write alone
                label = f"export: {what}, checkpoint cold, {where} (disk s: the write)"
        out.append(f"| {label} | {_gb(n)} | {_f(s)} | {_rate(n, s)} | {_f(disk)} | {_rate(n, disk)} | "
                   f"{_ratio(s, disk)} |")  # fmt: skip
    return "\n".join(out + ([""] + notes if notes else []))


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if args.report:
        with open(args.report) as f:
            print(table([json.loads(line) for line in f if line.strip()]))
        return 0
    os.makedirs(os.path.dirname(args.dir), exist_ok=True)
    work = tempfile.mkdtemp(prefix="hf-io-", dir=os.path.dirname(args.dir))  # the folder's disk: the anchors' too
    rows: list[dict] = []
    try:
        measure(args, work, rows)
    finally:
        if args.keep:
            print(f"kept {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)
    print(table(rows), flush=True)
    return 0 if all(not r.get("rc") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
