"""Our safetensors reader and writer against torch.distributed.checkpoint's own Hugging Face storage
(``HuggingFaceStorageReader`` / ``HuggingFaceStorageWriter``, what torchtitan uses), on a GPT-2 and a
Llama folder: the time of a load and of an export, and the host memory each takes at its peak.

    python -m bench.hf_dcp                         # the CPU check: two small folders, bf16 (< 2 minutes)
    python -m bench.hf_dcp --size full --device cuda   # GPT-2 1.5B (GPT-2 XL's shape) and Llama-3.2-1B

What is compared, each in a fresh process (so that its peak resident memory is its own), the files
evicted from the page cache before every timed repeat (cold reads; medians of ``--repeats``):

- load: a transformers model built without its weights (``to_empty`` on ``--device``), then the
  folder's ``model.safetensors`` read into it: ours, ``distlib.runner.hf.safetensors_folder.read_into``
  (what ``model.args.pretrained`` runs); theirs, ``dcp.load(model.state_dict(),
  storage_reader=HuggingFaceStorageReader(folder))`` (the tied output layer, which the file does not
  hold, left out of the state dict it fills).
- export: the model's DCP checkpoint (``ShardedCheckpointer``, as a run saves it) written as a
  ``model.safetensors`` of the same dtype: ours, the runner's export path (``CheckpointTensors`` reading
  the DCP records, ``safetensors_stream.write``, what ``python -m distlib.runner.export`` runs); theirs,
  ``dcp.load`` of the checkpoint into a state dict on the host, then ``dcp.save`` of it through
  ``HuggingFaceStorageWriter`` (one file).

Each child runs its operation once untimed (the modules it imports at its first call), then
``--repeats`` times timed. Each row: seconds (median), the ratio theirs / ours, and the peak resident
memory above the process's resident memory after that first run (the model's own tensors excluded). The output
files of the two exports are compared tensor for tensor, and the loaded weights with the file's.
BENCHMARKS.md, "Hugging Face folders: our reader and writer against DCP's".
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence

if __package__ in (None, ""):  # run as `python bench/hf_dcp.py`: the repository root on the path
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.hf_io import evict, files_under, size_of  # noqa: E402  (after the path is set)

# transformers configs: "cpu" small enough for the 2-minute CPU check, "full" the GPU machine's
MODELS = {
    "tiny": {  # the check that the script runs (tests/runner/test_bench.py)
        "gpt2": {"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 300, "n_positions": 64},
        "llama": {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                  "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 300, "tie_word_embeddings": True},
    },
    "cpu": {
        "gpt2": {"model_type": "gpt2", "n_embd": 768, "n_layer": 6, "n_head": 12, "vocab_size": 50257,
                 "n_positions": 1024},
        "llama": {"model_type": "llama", "hidden_size": 768, "num_hidden_layers": 6, "num_attention_heads": 12,
                  "num_key_value_heads": 4, "intermediate_size": 2048, "vocab_size": 32000,
                  "tie_word_embeddings": True},
    },
    "full": {
        # GPT-2 XL's shape (1.56B parameters)
        "gpt2": {"model_type": "gpt2", "n_embd": 1600, "n_layer": 48, "n_head": 25, "vocab_size": 50257,
                 "n_positions": 1024},
        # recipes/llama_1b.yaml's Llama-3.2-1B
        "llama": {"model_type": "llama", "hidden_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 32,
                  "num_key_value_heads": 8, "intermediate_size": 8192, "vocab_size": 128256,
                  "tie_word_embeddings": True, "rope_theta": 500000.0, "max_position_embeddings": 131072},
    },
}  # fmt: skip
DTYPE = "bfloat16"


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", choices=sorted(MODELS), default="cpu")
    p.add_argument("--models", default="gpt2,llama", help="comma-separated: gpt2, llama")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where the loaded parameters live")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dir", default="", help="work folder (default: a temporary one, removed)")
    p.add_argument("--json", default=os.path.join(".bench", "out", "hf_dcp.jsonl"), help="rows appended here")
    p.add_argument("--one", help=argparse.SUPPRESS)  # a child: one JSON job
    return p.parse_args(argv)


# ---- one measurement, in a child process ------------------------------------------------------------------
def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _reset_peak() -> None:
    """Start the peak resident memory (VmHWM) over from the present (Linux: clear_refs 5)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _peak() -> int:
    """The peak resident memory since ``_reset_peak`` (VmHWM); the process's whole peak (ru_maxrss)
    where the kernel cannot reset it."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def _empty_model(config: dict, device: str):
    import torch
    import transformers

    cfg = transformers.AutoConfig.for_model(**config)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, DTYPE))
    model.to_empty(device=device)
    model.tie_weights()
    return model


def _file_names(folder: str) -> set[str]:
    from safetensors import safe_open

    names = set()
    for f in files_under(folder):
        if f.endswith(".safetensors"):
            with safe_open(f, "pt") as s:
                names.update(s.keys())
    return names


def _load(job: dict, model) -> None:
    if job["impl"] == "ours":
        from distlib.runner.hf.safetensors_folder import read_into

        read_into(model, job["folder"])
    else:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import HuggingFaceStorageReader

        stored = _file_names(job["folder"])
        state = {k: v for k, v in model.state_dict().items() if k in stored}  # the tied copy: not in the file
        dcp.load(state, storage_reader=HuggingFaceStorageReader(job["folder"]))


def _export(job: dict, out: str) -> None:
    if job["impl"] == "ours":
        from distlib.runner.hf import safetensors_stream
        from distlib.runner.hf.dcp_tensors import CheckpointTensors
        from distlib.runner.models.export import GROUP_BYTES, PART_BYTES, READ_THREADS

        with CheckpointTensors(job["checkpoint"], "model.") as tensors:
            keys = [k for k in tensors.shapes if k.removeprefix("model.") in job["names"]]
            entries = [safetensors_stream.Entry(k.removeprefix("model."), tensors.shapes[k][0], tensors.shapes[k][1],
                                                tensors.shapes[k][1], tensors.splittable(k)) for k in keys]  # fmt: skip

            def read(e, start: int, stop: int, into):
                return tensors.rows(f"model.{e.name}", start, stop, into)

            safetensors_stream.write(os.path.join(out, "model.safetensors"), entries, read,
                                     metadata={"format": "pt"}, group_bytes=GROUP_BYTES, part_bytes=PART_BYTES,
                                     threads=READ_THREADS)  # fmt: skip
    else:
        import torch
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import FileSystemReader, HuggingFaceStorageWriter

        meta = FileSystemReader(job["checkpoint"]).read_metadata().state_dict_metadata
        state = {}
        for name in job["names"]:
            md = meta[f"model.{name}"]
            state[name] = torch.empty(md.size, dtype=md.properties.dtype)
        dcp.load({"model": state}, storage_reader=FileSystemReader(job["checkpoint"]))
        dcp.save(state, storage_writer=HuggingFaceStorageWriter(out, save_distributed=False))


def child(job: dict) -> dict:
    import warnings

    import torch

    warnings.filterwarnings("ignore")  # DCP's "assuming the intent is to load in a single process"
    torch.set_num_threads(max(1, min(8, os.cpu_count() or 1)))
    model = _empty_model(job["config"], job["device"]) if job["op"] == "load" else None
    files = files_under(job["folder"] if job["op"] == "load" else job["checkpoint"])
    # the modules either side imports on its first call, and its first call's other costs: one untimed
    # run first; the peak memory is measured above what the process holds after it
    seconds, before = [], None
    for i in range(job["repeats"] + 1):
        if i == 1:
            before = _rss()
            _reset_peak()
        out = os.path.join(job["work"], f"out-{job['model']}-{job['impl']}")
        shutil.rmtree(out, ignore_errors=True)
        os.makedirs(out)
        evict(files)
        if job["device"] == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        if job["op"] == "load":
            _load(job, model)
            if job["device"] == "cuda":
                torch.cuda.synchronize()
        else:
            _export(job, out)
            written = files_under(out)
            for f in written:  # on the disk, as a written export must be
                fd = os.open(f, os.O_RDONLY)
                os.fsync(fd)
                os.close(fd)
        if i:
            seconds.append(time.perf_counter() - t0)
    row = {"s": statistics.median(seconds), "all_s": [round(s, 3) for s in seconds],
           "peak_extra_bytes": max(0, _peak() - before), "bytes": size_of(files)}  # fmt: skip
    if job["op"] == "load":  # what was read is the file's
        from safetensors.torch import load_file

        stored = {}
        for f in files:
            if f.endswith(".safetensors"):
                stored.update(load_file(f))
        sd = model.state_dict()
        row["equal"] = all(torch.equal(sd[k].cpu(), v) for k, v in stored.items())
    else:
        row["out"] = out
    return row


# ---- the parent: folders, checkpoints, the children ---------------------------------------------------------
def make_inputs(name: str, config: dict, work: str) -> dict:
    """The model's folder (save_pretrained) and its DCP checkpoint (ShardedCheckpointer, as a run saves it)."""
    import torch
    import transformers

    from distlib.checkpoint.sharded import ShardedCheckpointer

    torch.manual_seed(0)
    cfg = transformers.AutoConfig.for_model(**config)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, DTYPE))
    folder = os.path.join(work, f"{name}-folder")
    model.save_pretrained(folder)
    checkpoint_dir = os.path.join(work, f"{name}-checkpoints")
    ShardedCheckpointer(checkpoint_dir).save(1, {"model": model})
    names = sorted(_file_names(folder))
    params = sum(p.numel() for p in model.parameters())
    return {"folder": folder, "checkpoint": ShardedCheckpointer(checkpoint_dir).paths()[0], "names": names,
            "params": params}  # fmt: skip


def run_child(job: dict) -> dict:
    out = subprocess.run([sys.executable, "-m", "bench.hf_dcp", "--one", json.dumps(job)], capture_output=True,
                         text=True, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # fmt: skip
    if out.returncode:
        raise RuntimeError(f"{job['op']} {job['model']} {job['impl']}: {out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def same_files(a: str, b: str) -> bool:
    from safetensors.torch import load_file

    def tensors(folder: str) -> dict:
        out = {}
        for f in files_under(folder):
            if f.endswith(".safetensors"):
                out.update(load_file(f))
        return out

    x, y = tensors(a), tensors(b)
    import torch

    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.one:
        print(json.dumps(child(json.loads(args.one))))
        return 0
    import torch

    work = args.dir or tempfile.mkdtemp(prefix="hf_dcp-", dir=os.path.join(".bench") if os.path.isdir(".bench")
                                        else None)  # fmt: skip
    os.makedirs(work, exist_ok=True)
    rows = []
    try:
        for name in args.models.split(","):
            config = MODELS[args.size][name]
            inputs = make_inputs(name, config, work)
            results = {}
            for op in ("load", "export"):
                for impl in ("ours", "theirs"):
                    job = {"op": op, "impl": impl, "model": name, "config": config, "device": args.device,
                           "repeats": args.repeats, "work": work, **inputs}  # fmt: skip
                    results[(op, impl)] = r = run_child(job)
                    print(f"{name} {op} {impl}: {r['s']:.3f} s {r['all_s']}, peak +{r['peak_extra_bytes'] / 2**20:.0f} "
                          f"MiB", flush=True)  # fmt: skip
            same = same_files(results[("export", "ours")]["out"], results[("export", "theirs")]["out"])
            for op in ("load", "export"):
                ours, theirs = results[(op, "ours")], results[(op, "theirs")]
                row = {"bench": "hf_dcp", "model": name, "size": args.size, "params": inputs["params"], "op": op,
                       "device": args.device, "bytes": ours["bytes"], "ours_s": round(ours["s"], 3),
                       "theirs_s": round(theirs["s"], 3), "theirs_over_ours": round(theirs["s"] / ours["s"], 2),
                       "ours_peak_mib": round(ours["peak_extra_bytes"] / 2**20),
                       "theirs_peak_mib": round(theirs["peak_extra_bytes"] / 2**20), "repeats": args.repeats,
                       "equal": ours.get("equal", same) and theirs.get("equal", same),
                       "torch": torch.__version__}  # fmt: skip
                rows.append(row)
    finally:
        if not args.dir:
            shutil.rmtree(work, ignore_errors=True)
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    print(
        "\n| model | op | bytes | ours s | theirs s | theirs / ours | ours peak MiB | theirs peak MiB | same result |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} ({r['params'] / 1e6:.0f}M) | {r['op']} | {r['bytes'] / 2**20:.0f} MiB | {r['ours_s']} | "
              f"{r['theirs_s']} | {r['theirs_over_ours']} | {r['ours_peak_mib']} | {r['theirs_peak_mib']} | "
              f"{r['equal']} |")  # fmt: skip
    return 0 if all(r["equal"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
