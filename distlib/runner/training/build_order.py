"""The order in which the runner turns a recipe's model into a training step, written once.

Each stage is one call into the module that owns it; the order is this file's, top to bottom:

    the model: ``build_model`` (``Trainer.build_model``)
      1. build            model.name with model.args, on this rank's device   runner/components.py
      2. cast frozen      a frozen base (LoRA's) in the compute dtype         runner/models/parameters.py
                          (1 and 2 one parameter at a time: distlib's build_converted)
      3. float8           the blocks' Linear layers (train.precision=fp8)     runner/training/float8.py
      4. shard            dist.shard=full: FSDP2 per block, then the root     distlib.shard_model
                          (1 to 3 run inside it, before fully_shard);
         or channels_last otherwise (model.channels_last)
      5. pretrained load  ``load_pretrained()``: into the shards, where they are
    the step: ``prepare_for_step`` (called by ``build_step``; not with dist.mode=fallback)
      6. activation checkpointing, per block                                  runner/training/compilation.py
      7. compilation, per block (or of the whole model, which 9 does)
      8. the loss compiled with the model
      9. the gradient sync (train.compile=model: compiled around it), the optimizer over the
         parameters it trains, loss scaling and clipping                      runner/training/step.py
     10. float8 all-gathers' weight scales, refreshed after each optimizer step  runner/training/float8.py

Before 1, ``Trainer.build`` loads the compiler (``load_compiler``: a start-up stage of its own); between
5 and 6 it makes the optimizer's spec over the model's parameters (``optimizer_spec``), which 9 builds.
The memory plan (runner/training/memory_plan.py) replays 1 to 7 on fake tensors, in this order.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import torch
from torch import nn

import distlib
from distlib.runner import components
from distlib.runner.config import Config, ConfigError
from distlib.runner.models.parameters import cast_frozen
from distlib.runner.tasks.losses import StepLoss
from distlib.runner.training.compilation import apply_block_settings, compiled_loss
from distlib.runner.training.float8 import convert_model, scale_refresh
from distlib.runner.training.optimizer_step import autocast_dtype


def build_model(cfg: Config, device: torch.device, provided: Mapping[str, Any]) -> nn.Module:
    """Stages 1 to 5: the model of model.name with model.args (and of ``provided``, the task's, where it
    takes them), on ``device``. Built directly on the device (``with torch.device(device)``) under the
    caller's random stream, in every dist.shard mode: the same weights in every mode and at every world
    size. With dist.shard=full ``shard_model`` keeps this rank's shards (bf16 weights in the layers with
    train.precision=bf16 on a GPU, gradients reduced in fp32)."""
    dtype = autocast_dtype(cfg.train.precision, device)  # bf16 on a GPU, None (fp32) on the CPU

    def build() -> nn.Module:  # 1
        model = components.build("model", cfg.model.name, cfg.model.args, provided=provided)
        if not isinstance(model, nn.Module):
            raise ConfigError([f"model.name={cfg.model.name!r} returned {type(model).__name__}, "
                               "not a torch.nn.Module"])  # fmt: skip
        return model

    def convert(model: nn.Module) -> None:  # before anything wraps the model
        cast_frozen(model, dtype)  # 2: no fp32 copy of a frozen base; before float8 wraps its weights
        convert_model(cfg, model, device)  # 3

    if cfg.dist.shard == "full":  # 4
        block_types = [cfg.model.block_class] if cfg.model.block_class else None  # else model.blocks
        # a pretrained folder's weights are read into the shards: nothing to initialise first
        empty = cfg.model.name == "hf_causal_lm" and bool(cfg.model.args.get("pretrained"))
        model = distlib.shard_model(build, param_dtype=dtype, reduce_dtype=torch.float32 if dtype else None,
                                    device=device, block_types=block_types, empty=empty, offload=cfg.dist.offload,
                                    reshard_after_forward=cfg.dist.reshard_after_forward,
                                    convert=convert)  # fmt: skip
    elif dtype is not None and cfg.model.args.get("lora") is not None:
        # a frozen base cast to the compute dtype: made one parameter at a time, so the build never
        # holds the whole base in fp32 (an 8B base: 30 GiB for a moment, where bf16 needs 15)
        model = distlib.build_converted(build, convert, device)
    else:
        with torch.device(device):  # where it runs: no copy on the host first
            model = build().to(device)  # .to: a no-op, unless the model put a tensor on a device of its own
        convert(model)
        if cfg.model.channels_last:  # 4: changes 4-D (convolution) weights only
            model = model.to(memory_format=torch.channels_last)
    if callable(load := getattr(model, "load_pretrained", None)):  # 5
        load()  # weights from files, read in place: under dist.shard=full each rank its shards' rows
    return model


class Prepared(NamedTuple):
    """What stages 6 to 8 and 10 give the gradient-sync step (stage 9)."""

    compile_whole: bool  # train.compile=model (or true without blocks): 9 compiles the model around its sync
    loss_parts: Callable[..., tuple[torch.Tensor, torch.Tensor]]  # the loss, compiled with the model (8)
    refresh: Callable[[], None] | None  # after each optimizer step and weights_changed() (10)


def prepare_for_step(cfg: Config, model: nn.Module, loss_fn: StepLoss) -> Prepared:
    """Stages 6 to 8 on ``model`` (in place) and ``loss_fn``, and stage 10's refresh, for the step of
    dist.mode=process_per_gpu (``build_step``)."""
    whole = apply_block_settings(cfg, model)  # 6, 7: checkpointing, then each block compiled
    # 8: a loss the model applies (loss.chunks) compiles its own chunks
    parts = compiled_loss(cfg, loss_fn.parts) if loss_fn.head is None else loss_fn.parts
    # 10 (dist.shard=full, fp8): the weights' scales for the next step's all-gathers, computed once after
    # the optimizer step in one all-reduce rather than per block during the forward
    return Prepared(whole, parts, scale_refresh(cfg, model))
