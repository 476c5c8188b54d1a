"""``train.precision=fp8`` in the runner: the model's blocks' Linear layers converted to float8 by the
library's rule (``distlib.convert_to_float8``, torchao), where the model is built (stage 3 of
runner/training/build_order.py), before anything wraps it: FSDP2 (``dist.shard=full``), activation
checkpointing, compilation. The rest of
the step is bf16's (autocast on a GPU; fp32 on a CPU, where torchao emulates the float8 products). Design:
docs/float8.md.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn

import distlib
from distlib.runner.config import Config, ConfigError
from distlib.runner.training.compilation import model_blocks


def float8_all_gather(cfg: Config) -> bool:
    """Whether FSDP2 all-gathers the float8 layers' weights in float8 (half of bf16's bytes): with
    full sharding and tensorwise scales, as torchtitan does (torchao has no float8 all-gather for
    rowwise scales: those weights are gathered in bf16 and cast after)."""
    t = cfg.train
    return t.precision == "fp8" and t.fp8_recipe == "tensorwise" and cfg.dist.shard == "full"


def convert_model(cfg: Config, model: nn.Module, device: torch.device) -> list[str]:
    """With train.precision=fp8, the model's Linear layers that the rule picks (train.fp8_layers) turned
    to float8 with train.fp8_recipe's scales, in place, and the names of those layers; else nothing."""
    t = cfg.train
    if t.precision != "fp8":
        return []
    blocks = model_blocks(cfg, model)
    if not blocks:
        raise ConfigError([f"train.precision=fp8: float8 goes to the Linear layers of the model's blocks, and "
                           f"{cfg.model.name} has none (no `blocks` ModuleList); name the class of its repeated "
                           "layer with model.block_class"])  # fmt: skip
    linears = sum(type(m) is nn.Linear for m in model.modules())
    names = distlib.convert_to_float8(model, recipe=t.fp8_recipe, layers=t.fp8_layers, blocks=blocks,
                                      fsdp_float8_all_gather=float8_all_gather(cfg))  # fmt: skip
    log = distlib.get_logger()
    how = "emulated on the CPU" if device.type != "cuda" else "float8 all-gathers" if float8_all_gather(cfg) else ""
    log.info("train.precision=fp8 (%s scales%s): %d of the model's %d Linear layers in float8, the rest in %s",
             t.fp8_recipe, f", {how}" if how else "", len(names), linears,
             "bf16" if device.type == "cuda" else "fp32")  # fmt: skip
    if not names:
        log.warning("train.precision=fp8: no Linear layer of the blocks is large enough to gain from float8 "
                    "(train.fp8_layers=auto), so this run trains as bf16 would; train.fp8_layers=all converts "
                    "every one whose sides are multiples of 16")  # fmt: skip
    return names


def scale_refresh(cfg: Config, model: nn.Module) -> Callable[[], None] | None:
    """What keeps float8 all-gathers' weight scales current, to run after each optimizer step and
    after anything else changes the weights in place (warm-up steps undone, a checkpoint loaded);
    None when nothing needs it."""
    if not float8_all_gather(cfg):
        return None
    return functools.partial(distlib.precompute_float8_scales, model)
