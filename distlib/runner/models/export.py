"""``python -m distlib.runner.export RUN_DIR OUT_DIR [--dtype bf16|fp32] [--merge]``: the final model of a run
(its newest checkpoint; the weight average when the run kept one, as its evaluation used) as files
other programs load.

- ``model.name: hf_causal_lm``: a Hugging Face folder, ``config.json`` and ``model.safetensors``,
  that ``AutoModelForCausalLM.from_pretrained(OUT_DIR)`` loads (a tied output layer stored once, as
  ``save_pretrained`` does);
- the built-in ``gpt``: ``model.safetensors`` and ``config.json`` holding ``GPTConfig``'s fields
  (``load_gpt(OUT_DIR)`` builds it back);
- a LoRA run (``model.args.lora``): its adapters as peft saves them (``adapter_config.json``,
  ``adapter_model.safetensors``); with ``--merge`` the base (model.args.pretrained) with the
  adapters merged, a folder ``from_pretrained`` loads;
- any other model: an error naming ``python -m distlib.checkpoint.sharded``, which writes its
  state dict as one file.

The run's checkpoint (DCP's files, in every ``dist.shard`` mode) is read on the CPU of this one
process (no process group, no GPU), and ``model.safetensors`` is streamed (safetensors_stream): its
header first, from the checkpoint's metadata (names, shapes, the dtype asked for), then the tensors'
bytes a group of about ``GROUP_BYTES`` at a time, each group cast and written while the next is read
in background threads, straight from the records DCP wrote (dcp_tensors; only the exported tensors,
not the optimizer's state nor a tied output layer). The host holds two groups, not the model; the
file is fsynced and renamed into place, the disk writing it back as it goes, so the export takes
about the longer of the checkpoint's read and the file's write rather than their sum. A one-file
checkpoint (``distlib.Checkpointer``'s, which the runner wrote for ``dist.shard=none`` in earlier
versions) is read whole into memory, then written the same way. Design: docs/huggingface.md.
"""

from __future__ import annotations

import json
import math
import os
import sys
from typing import Any

import torch

from distlib import DistlibError
from distlib.checkpoint import disk
from distlib.runner.config import Config, ConfigError, load_config
from distlib.runner.hf import safetensors_stream
from distlib.runner.hf.dcp_tensors import CheckpointTensors
from distlib.runner.hf.dtypes import SHORT
from distlib.runner.hf.safetensors_stream import Entry

DTYPES = {k: SHORT[k] for k in ("bf16", "fp32")}  # what --dtype writes
# The write reads a group of about GROUP_BYTES of the checkpoint while it casts and writes the one
# before: the host holds two (small groups: little read before the first write and written after the
# last read, few new pages to fault in). Reads of at most PART_BYTES (a large tensor's rows a part at
# a time), READ_THREADS at once: the disk's queue kept full, page-cache copies on several cores.
GROUP_BYTES = 128 << 20
PART_BYTES = 8 << 20
READ_THREADS = 8


class ExportError(DistlibError, ValueError):
    """A run that cannot be exported: no run directory, no checkpoint, a model this cannot write."""


def _run_config(run_dir: str) -> Config:
    """The run's resolved config (its config.yaml), once its model is one this writes."""
    import yaml

    path = os.path.join(run_dir, "config.yaml")
    if not os.path.isfile(path):
        raise ExportError(f"{run_dir!r} is no run directory (no config.yaml): give the run.out_dir of a run")
    with open(path) as f:
        name = ((yaml.safe_load(f) or {}).get("model") or {}).get("name")
    if name not in ("hf_causal_lm", "gpt"):
        raise ExportError(
            f"model.name={name!r}: export writes Hugging Face folders (hf_causal_lm) and the built-in gpt; the "
            "run's checkpoint converts with python -m distlib.checkpoint.sharded CHECKPOINT_DIR OUT.pt (a one-file "
            "checkpoint of an earlier version is a torch.load file with the state dict under ['state']['model'])"
        )
    return load_config(path, check_components=False)  # the model's files are the export's to check


def _newest_checkpoint(run_dir: str) -> tuple[str, str]:
    """("sharded" | "replicated", path) of the newest committed checkpoint of the run, in checkpoints/ or
    weights/ (run.final_checkpoint=weights) ("replicated": a one-file checkpoint of an earlier version,
    only when there is no sharded one)."""
    from distlib.checkpoint.checkpointer import Checkpointer, CheckpointError
    from distlib.checkpoint.sharded import ShardedCheckpointer, verify

    directory = os.path.join(run_dir, "checkpoints")
    # run.final_checkpoint=weights writes the final model alone into weights/: the newest step wins
    sharded = [p for d in (directory, os.path.join(run_dir, "weights")) if os.path.isdir(d)
               for p in ShardedCheckpointer(d).paths()[:1]]  # fmt: skip
    if sharded:
        newest = max(sharded, key=os.path.basename)
        try:  # commit.json, the files' sizes and .metadata before it is unpickled (the shards' records: not read)
            verify(newest, records=False)
        except CheckpointError as e:
            raise ExportError(f"{e}; resume the run from the previous one, or export another run") from e
        return "sharded", newest
    replicated = Checkpointer(directory).paths()
    if replicated:
        return "replicated", replicated[0]
    raise ExportError(f"{directory} holds no checkpoint: the run saves one at its end (and at run.checkpoint_every)")


def _replicated_state(path: str, name: str) -> dict[str, torch.Tensor]:
    from distlib.checkpoint.checkpointer import read_verified

    state = read_verified(path)["state"]
    if name not in state:
        raise ExportError(f"{path} holds no {name!r} (it has {', '.join(state)})")
    return {k: v for k, v in state[name].items() if isinstance(v, torch.Tensor)}


class _Tensors:
    """The final model's tensors in a checkpoint, by their state-dict names (the weight average's
    under its module's names): their shapes and dtypes, and their rows read on demand (from a DCP
    checkpoint's files, or from a one-file checkpoint's state dict in memory)."""

    def __init__(self, kind: str, path: str, name: str):
        self.dcp: CheckpointTensors | None = None
        self.memory: dict[str, torch.Tensor] = {}
        if kind == "replicated":
            self.memory = _replicated_state(path, name)
            found = {k: k for k in self.memory}
        else:
            self.dcp = CheckpointTensors(path, f"{name}.")
            found = {k[len(name) + 1 :]: k for k in self.dcp.shapes}
            if not found:
                raise ExportError(f"{path} holds no tensors of {name!r}")
        if name == "ema":  # the average's state dict: the averaged module's, under module.
            found = {k.removeprefix("module."): v for k, v in found.items() if k.startswith("module.")}
        self.keys = found  # state-dict name -> the checkpoint's

    def close(self) -> None:
        if self.dcp is not None:
            self.dcp.close()

    def shape(self, key: str) -> tuple[tuple[int, ...], torch.dtype]:
        found = self.keys[key]
        if self.dcp is not None:
            return self.dcp.shapes[found]
        return tuple(self.memory[found].shape), self.memory[found].dtype

    def splittable(self, key: str) -> bool:
        return self.dcp.splittable(self.keys[key]) if self.dcp is not None else True

    def rows(self, key: str, start: int, stop: int, out: torch.Tensor) -> torch.Tensor:
        if self.dcp is not None:
            return self.dcp.rows(self.keys[key], start, stop, out)
        t = self.memory[self.keys[key]]
        return (t[start:stop] if t.dim() else t).contiguous()

    def tensor(self, key: str) -> torch.Tensor:
        if self.dcp is not None:
            return self.dcp.tensor(self.keys[key])
        return self.memory[self.keys[key]]


def _model_tensors(run_dir: str) -> tuple[Config, _Tensors, str]:
    cfg = _run_config(run_dir)
    kind, path = _newest_checkpoint(run_dir)
    return cfg, _Tensors(kind, path, "ema" if cfg.train.ema > 0 else "model"), path


def _written(t: torch.dtype, dtype: torch.dtype) -> torch.dtype:
    """The dtype a tensor of dtype ``t`` is written in: ``dtype`` for floating point, its own otherwise."""
    return dtype if t.is_floating_point else t


def model_state(run_dir: str, dtype: torch.dtype) -> tuple[Config, dict[str, torch.Tensor], str]:
    """The run's config, its final model's state dict (whole tensors in ``dtype``, on the CPU: the
    weight average's when the run kept one) and the checkpoint it comes from."""
    cfg, tensors, path = _model_tensors(run_dir)
    try:
        state = {}
        for k in tensors.keys:
            t = tensors.tensor(k)
            state[k] = t.to(_written(t.dtype, dtype))
    finally:
        tensors.close()
    return cfg, state, path


def _write_safetensors(tensors: _Tensors, names: dict[str, str], path: str, dtype: torch.dtype) -> None:
    """The file ``path`` of the checkpoint's tensors ``names`` (file name -> state-dict name) in ``dtype``
    (floating point ones), streamed: see safetensors_stream for why it is not save_file."""
    entries, key = [], {}
    for name, k in names.items():
        shape, source = tensors.shape(k)
        entries.append(Entry(name, shape, _written(source, dtype), source, tensors.splittable(k)))
        key[name] = k

    def read(e: Entry, start: int, stop: int, out: torch.Tensor) -> torch.Tensor:
        return tensors.rows(key[e.name], start, stop, out)

    need = sum(math.prod(e.shape) * e.dtype.itemsize for e in entries)
    with disk.writing(os.path.dirname(path) or ".", os.path.basename(path), need):  # its .tmp removed on failure
        safetensors_stream.write(path, entries, read, metadata={"format": "pt"}, group_bytes=GROUP_BYTES,
                                 part_bytes=PART_BYTES, threads=READ_THREADS)  # fmt: skip


def _export_hf(cfg: Config, tensors: _Tensors, out_dir: str, dtype: torch.dtype, run_dir: str) -> None:
    import shutil

    from distlib.runner.models.hf_causal_lm import RUN_FILES, hf_causal_lm

    args = {k: v for k, v in cfg.model.args.items() if k in ("config", "pretrained", "attn_implementation")}
    saved = os.path.join(run_dir, RUN_FILES)
    own = os.path.isfile(os.path.join(saved, "config.json"))
    if own:  # the run's copy of the model's config (and tokenizer): nothing outside the run needed
        args = {"pretrained": saved, "attn_implementation": args.get("attn_implementation", "auto")}
    elif args.get("pretrained") and not os.path.isfile(os.path.join(args["pretrained"], "config.json")):
        raise ExportError(f"the run has no {RUN_FILES}/config.json (runs of earlier versions) and its "
                          f"model.args.pretrained folder {args['pretrained']!r} has none either: the model's "
                          "config is needed to write config.json")  # fmt: skip
    with torch.device("meta"):  # the architecture only: its names, shapes, ties and config
        model = hf_causal_lm(**args)
    hf = model.hf
    # each parameter once (a tied output layer under the embedding's name, as save_pretrained
    # writes it), and the buffers a state dict holds
    every = {n for n, _ in hf.named_parameters(remove_duplicate=False)}
    names = [n for n, _ in hf.named_parameters()] + [n for n in hf.state_dict() if n not in every]
    missing = [n for n in names if f"hf.{n}" not in tensors.keys]
    if missing:
        raise ExportError(f"the checkpoint lacks {len(missing)} tensor(s) of the model: {', '.join(missing[:4])}")
    os.makedirs(out_dir, exist_ok=True)
    _write_safetensors(tensors, {n: f"hf.{n}" for n in names}, os.path.join(out_dir, "model.safetensors"), dtype)
    config = hf.config
    config.use_cache = True  # for inference; training turned it off
    config.dtype = dtype
    config.architectures = [type(hf).__name__]
    config.save_pretrained(out_dir)
    for name in sorted(os.listdir(saved)) if own else []:  # the tokenizer files the run kept
        if name != "config.json":
            shutil.copyfile(os.path.join(saved, name), os.path.join(out_dir, name))


def _export_lora(cfg: Config, tensors: _Tensors, out_dir: str, dtype: torch.dtype, run_dir: str, merge: bool) -> None:
    """A LoRA run (model.args.lora): its adapters as peft saves them (``adapter_config.json``,
    ``adapter_model.safetensors``: ``PeftModel.from_pretrained(base, OUT_DIR)`` loads them on the base
    folder); ``merge``: the base with the adapters merged into its weights, on this process's CPU (the
    base read whole from model.args.pretrained, the adapters from the checkpoint), as a
    ``save_pretrained`` folder ``AutoModelForCausalLM.from_pretrained`` loads. The checkpoint holds
    every rank's part of each adapter (DCP's files, in every shard mode): they are read whole here."""
    import shutil

    import transformers

    from distlib.runner.models import lora
    from distlib.runner.models.hf_causal_lm import RUN_FILES

    saved = os.path.join(run_dir, RUN_FILES)
    base = cfg.model.args.get("pretrained") or ""
    config_dir = saved if os.path.isfile(os.path.join(saved, "config.json")) else base
    if not config_dir:
        raise ExportError(f"the run has no {RUN_FILES}/config.json: the model's config is needed to write the adapters")
    names = [k for k in tensors.keys if ".lora_A." in k or ".lora_B." in k]
    if not names:
        raise ExportError("the checkpoint holds no adapter (model.args.lora's lora_A / lora_B tensors)")
    adapters = {k.removeprefix("hf."): tensors.tensor(k).to(dtype) for k in names}
    hf_config = transformers.AutoConfig.from_pretrained(config_dir, local_files_only=True)
    if not merge:
        lora.save_adapters(hf_config, cfg.model.args["lora"], adapters, out_dir, base=os.path.abspath(base) if base
                           else "")  # fmt: skip
        return
    if not base:
        raise ExportError("--merge needs the base weights, and this run built its base from model.args.config "
                          "(random weights, which no checkpoint holds: the base is frozen and rebuilt at each "
                          "start); export the adapters alone (without --merge), or train from a pretrained "
                          "folder")  # fmt: skip
    if not os.path.isfile(os.path.join(base, "config.json")):
        raise ExportError(f"--merge reads the base from model.args.pretrained, {base!r}, which has no config.json")
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32, local_files_only=True)
    merged = lora.merged_model(model, cfg.model.args["lora"], {k: v.float() for k, v in adapters.items()})
    merged.to(dtype)
    merged.config.use_cache = True
    merged.save_pretrained(out_dir)
    for name in sorted(os.listdir(saved)) if os.path.isdir(saved) else []:  # the tokenizer files the run kept
        if name != "config.json" and not os.path.exists(os.path.join(out_dir, name)):
            shutil.copyfile(os.path.join(saved, name), os.path.join(out_dir, name))


def _export_gpt(cfg: Config, tensors: _Tensors, out_dir: str, dtype: torch.dtype) -> None:
    from distlib.runner.models.gpt import GPTConfig

    args = dict(cfg.model.args)
    # what the runner gave the model from the data: the shapes of its embeddings say it
    args.setdefault("vocab_size", tensors.shape("wte.weight")[0][0])
    args.setdefault("block_size", tensors.shape("wpe.weight")[0][0])
    config = GPTConfig(**{k: v for k, v in args.items() if k in GPTConfig.__dataclass_fields__})
    os.makedirs(out_dir, exist_ok=True)
    names = {k: k for k in tensors.keys if k != "lm_head.weight"}  # tied to wte.weight
    _write_safetensors(tensors, names, os.path.join(out_dir, "model.safetensors"), dtype)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump({"model": "distlib.runner.models.gpt:GPT", **vars(config)}, f, indent=1)


def load_gpt(out_dir: str) -> torch.nn.Module:
    """The built-in GPT an export wrote into ``out_dir``."""
    from safetensors.torch import load_file

    from distlib.runner.models.gpt import GPT, GPTConfig

    with open(os.path.join(out_dir, "config.json")) as f:
        fields = {k: v for k, v in json.load(f).items() if k in GPTConfig.__dataclass_fields__}
    model = GPT(GPTConfig(**fields))
    state = load_file(os.path.join(out_dir, "model.safetensors"))
    model.load_state_dict({**state, "lm_head.weight": state["wte.weight"]})
    model.tie_weights()
    return model


def export(run_dir: str, out_dir: str, dtype: str = "bf16", merge: bool = False) -> dict[str, Any]:
    """Write the final model of the run in ``run_dir`` into ``out_dir`` (see the module's docstring).
    A LoRA run: its adapters as peft saves them, or with ``merge`` the base with them merged
    (``_export_lora``). Returns what it did: the checkpoint read, the files written, their bytes."""
    if dtype not in DTYPES:
        raise ExportError(f"--dtype {dtype!r}: expected one of {', '.join(DTYPES)}")
    cfg, tensors, source = _model_tensors(run_dir)
    lora = cfg.model.name == "hf_causal_lm" and cfg.model.args.get("lora") is not None
    if merge and not lora:
        tensors.close()
        raise ExportError("--merge: the run trained no adapters (model.args.lora): its export is the whole model")
    try:
        with disk.writing(out_dir, "the exported model's config"):  # model.safetensors says its own size
            if lora:
                _export_lora(cfg, tensors, out_dir, DTYPES[dtype], run_dir, merge)
            elif cfg.model.name == "hf_causal_lm":
                _export_hf(cfg, tensors, out_dir, DTYPES[dtype], run_dir)
            else:
                _export_gpt(cfg, tensors, out_dir, DTYPES[dtype])
    finally:
        tensors.close()
    files = sorted(os.listdir(out_dir))
    size = sum(os.path.getsize(os.path.join(out_dir, f)) for f in files)
    return {"checkpoint": source, "out_dir": out_dir, "files": files, "bytes": size}


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m distlib.runner.export", description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir", help="the run's directory (its run.out_dir: config.yaml and checkpoints/)")
    p.add_argument("out_dir", help="the folder to write")
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES), help="dtype of the written tensors")
    p.add_argument(
        "--merge",
        action="store_true",
        help="a LoRA run: the base with the adapters merged (default: the adapters, as peft saves them)",
    )
    args = p.parse_args(argv)
    try:
        done = export(args.run_dir, args.out_dir, args.dtype, merge=args.merge)
    except (DistlibError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {', '.join(done['files'])} ({done['bytes'] / 2**20:.1f} MiB) into {done['out_dir']} "
          f"from {done['checkpoint']}")  # fmt: skip
    return 0
