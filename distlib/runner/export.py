"""``python -m distlib.runner.export RUN_DIR OUT_DIR [--dtype bf16|fp32]``: the final model of a run
(its newest checkpoint; the weight average when the run kept one, as its evaluation used) as files
other programs load.

- ``model.name: hf_causal_lm``: a Hugging Face folder, ``config.json`` and ``model.safetensors``,
  that ``AutoModelForCausalLM.from_pretrained(OUT_DIR)`` loads (a tied output layer stored once, as
  ``save_pretrained`` does);
- the built-in ``gpt``: ``model.safetensors`` and ``config.json`` holding ``GPTConfig``'s fields
  (``load_gpt(OUT_DIR)`` builds it back);
- any other model: an error naming ``python -m distlib.checkpoint.sharded``, which writes its
  state dict as one file.

The run's checkpoint (DCP's files, in every ``dist.shard`` mode) is read on the CPU of this one
process, a group of tensors at a time (no process group, no GPU); the tensors are written in the
dtype asked for, so the host holds about the exported bytes once. A one-file checkpoint
(``distlib.Checkpointer``'s, which the runner wrote for ``dist.shard=none`` in earlier versions) is
read too. Design: docs/huggingface.md.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from collections.abc import Iterator
from typing import Any

import torch

from distlib import DistlibError
from distlib.runner.config import Config, ConfigError, load_config

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
GROUP_BYTES = 1 << 30  # a DCP read plans and opens its files once per call: tensors read in groups of about 1 GiB


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
    return load_config(path)


def _newest_checkpoint(run_dir: str) -> tuple[str, str]:
    """("sharded" | "replicated", path) of the newest committed checkpoint of the run ("replicated": a one-file
    checkpoint of an earlier version, only when there is no sharded one)."""
    from distlib.checkpoint.checkpointer import Checkpointer
    from distlib.checkpoint.sharded import ShardedCheckpointer

    directory = os.path.join(run_dir, "checkpoints")
    sharded = ShardedCheckpointer(directory).paths() if os.path.isdir(directory) else []
    if sharded:
        return "sharded", sharded[0]
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


def _sharded_tensors(path: str, name: str, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """(key, whole tensor in ``dtype``) of the object ``name`` in a DCP checkpoint, read on the CPU a
    group of tensors at a time."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = dcp.FileSystemReader(path)
    prefix = f"{name}."
    entries = [(k, m) for k, m in reader.read_metadata().state_dict_metadata.items()
               if k.startswith(prefix) and isinstance(m, TensorStorageMetadata)]  # fmt: skip
    if not entries:
        raise ExportError(f"{path} holds no tensors of {name!r}")
    group: dict[str, torch.Tensor] = {}
    size = 0
    for i, (key, meta) in enumerate(entries):
        group[key] = torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
        size += group[key].nbytes
        if size >= GROUP_BYTES or i == len(entries) - 1:
            with warnings.catch_warnings():  # that it reads in one process is what is meant
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                dcp.load(group, storage_reader=dcp.FileSystemReader(path), no_dist=True)
            for k, t in group.items():
                yield k[len(prefix) :], t.to(dtype) if t.is_floating_point() else t
            group, size = {}, 0


def model_state(run_dir: str, dtype: torch.dtype) -> tuple[Config, dict[str, torch.Tensor], str]:
    """The run's config, its final model's state dict (whole tensors in ``dtype``, on the CPU: the
    weight average's when the run kept one) and the checkpoint it comes from."""
    cfg = _run_config(run_dir)
    kind, path = _newest_checkpoint(run_dir)
    name = "ema" if cfg.train.ema > 0 else "model"
    if kind == "replicated":
        state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in _replicated_state(path, name).items()}
    else:
        state = dict(_sharded_tensors(path, name, dtype))
    if name == "ema":  # the average's state dict: the averaged module's, under module.
        state = {k.removeprefix("module."): v for k, v in state.items() if k.startswith("module.")}
    return cfg, state, path


def _write_safetensors(tensors: dict[str, torch.Tensor], path: str) -> None:
    from safetensors.torch import save_file

    tmp = path + ".tmp"
    save_file({k: v.contiguous() for k, v in tensors.items()}, tmp, metadata={"format": "pt"})
    os.replace(tmp, path)


def _export_hf(cfg: Config, state: dict[str, torch.Tensor], out_dir: str, dtype: torch.dtype) -> None:
    from distlib.runner.hf_causal_lm import hf_causal_lm

    args = {k: v for k, v in cfg.model.args.items() if k in ("config", "pretrained", "attn_implementation")}
    with torch.device("meta"):  # the architecture only: its names, shapes, ties and config
        model = hf_causal_lm(**args)
    hf = model.hf
    # each parameter once (a tied output layer under the embedding's name, as save_pretrained
    # writes it), and the buffers a state dict holds
    every = {n for n, _ in hf.named_parameters(remove_duplicate=False)}
    names = [n for n, _ in hf.named_parameters()] + [n for n in hf.state_dict() if n not in every]
    tensors = {}
    missing = []
    for n in names:
        t = state.get(f"hf.{n}")
        if t is None:
            missing.append(n)
        else:
            tensors[n] = t
    if missing:
        raise ExportError(f"the checkpoint lacks {len(missing)} tensor(s) of the model: {', '.join(missing[:4])}")
    os.makedirs(out_dir, exist_ok=True)
    _write_safetensors(tensors, os.path.join(out_dir, "model.safetensors"))
    config = hf.config
    config.use_cache = True  # for inference; training turned it off
    config.dtype = dtype
    config.architectures = [type(hf).__name__]
    config.save_pretrained(out_dir)


def _export_gpt(cfg: Config, state: dict[str, torch.Tensor], out_dir: str) -> None:
    from distlib.runner.gpt import GPTConfig

    args = dict(cfg.model.args)
    # what the runner gave the model from the data: the shapes of its embeddings say it
    args.setdefault("vocab_size", state["wte.weight"].shape[0])
    args.setdefault("block_size", state["wpe.weight"].shape[0])
    config = GPTConfig(**{k: v for k, v in args.items() if k in GPTConfig.__dataclass_fields__})
    os.makedirs(out_dir, exist_ok=True)
    tensors = {k: v for k, v in state.items() if k != "lm_head.weight"}  # tied to wte.weight
    _write_safetensors(tensors, os.path.join(out_dir, "model.safetensors"))
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump({"model": "distlib.runner.gpt:GPT", **vars(config)}, f, indent=1)


def load_gpt(out_dir: str) -> torch.nn.Module:
    """The built-in GPT an export wrote into ``out_dir``."""
    from safetensors.torch import load_file

    from distlib.runner.gpt import GPT, GPTConfig

    with open(os.path.join(out_dir, "config.json")) as f:
        fields = {k: v for k, v in json.load(f).items() if k in GPTConfig.__dataclass_fields__}
    model = GPT(GPTConfig(**fields))
    state = load_file(os.path.join(out_dir, "model.safetensors"))
    model.load_state_dict({**state, "lm_head.weight": state["wte.weight"]})
    model.tie_weights()
    return model


def export(run_dir: str, out_dir: str, dtype: str = "bf16") -> dict[str, Any]:
    """Write the final model of the run in ``run_dir`` into ``out_dir`` (see the module's docstring).
    Returns what it did: the checkpoint read, the files written, their bytes."""
    if dtype not in DTYPES:
        raise ExportError(f"--dtype {dtype!r}: expected one of {', '.join(DTYPES)}")
    cfg, state, source = model_state(run_dir, DTYPES[dtype])
    if cfg.model.name == "hf_causal_lm":
        _export_hf(cfg, state, out_dir, DTYPES[dtype])
    else:
        _export_gpt(cfg, state, out_dir)
    files = sorted(os.listdir(out_dir))
    size = sum(os.path.getsize(os.path.join(out_dir, f)) for f in files)
    return {"checkpoint": source, "out_dir": out_dir, "files": files, "bytes": size}


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m distlib.runner.export", description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir", help="the run's directory (its run.out_dir: config.yaml and checkpoints/)")
    p.add_argument("out_dir", help="the folder to write")
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES), help="dtype of the written tensors")
    args = p.parse_args(argv)
    try:
        done = export(args.run_dir, args.out_dir, args.dtype)
    except (DistlibError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {', '.join(done['files'])} ({done['bytes'] / 2**20:.1f} MiB) into {done['out_dir']} "
          f"from {done['checkpoint']}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
