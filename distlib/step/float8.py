"""Float8 training: the matrix products of a model's Linear layers in float8, through torchao
(``torchao.float8``), the rest of the model as it was (bf16 autocast on a GPU).

    layers = distlib.convert_to_float8(model, recipe="tensorwise")   # before shard_model / GradSync
    ...
    opt.step()
    distlib.precompute_float8_scales(model)  # FSDP2 with float8 all-gathers: the next step's scales

Which layers go float8 is a rule (``float8_layers``), the same for every model: a layer of type
``nn.Linear`` inside the model's blocks (``find_blocks``: ``model.blocks`` or the blocks named),
whose weight is no other module's too, with both sides a multiple of 16 (float8 matrix products
need it); with ``layers="auto"`` also large enough to gain (torchao's thresholds for the recipe,
measured on H100: a small matrix costs more to scale and cast than its float8 product saves).
Everything outside the blocks stays in high precision: the embeddings and the output layer (whose
logits feed the loss), a classifier head.

Emulation: on a CPU (or with ``emulate=True``) torchao casts to float8 and back and multiplies in
high precision, with the same rounding: the numerics of float8 training without a float8 GPU, for
tests. A GPU runs float8 products only from compute capability 8.9 (Ada, Hopper) on; an older one
is refused rather than emulated, which would be slower than bf16.

torchao is imported when a function here needs it (``pip install 'distlib[fp8]'``); importing
distlib does not need it. Design: docs/float8.md.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import logging
from collections.abc import Sequence
from typing import Literal

import torch
from torch import nn

from distlib.errors import DistlibError
from distlib.parallel.blocks import find_blocks

__all__ = [
    "FLOAT8_RECIPES",
    "Float8Error",
    "convert_to_float8",
    "float8_available",
    "float8_layers",
    "precompute_float8_scales",
]

FLOAT8_RECIPES = ("tensorwise", "rowwise")  # torchao's Float8LinearConfig.from_recipe_name
Recipe = Literal["tensorwise", "rowwise"]
Layers = Literal["auto", "all"]
_MIN_CAPABILITY = (8, 9)  # float8 tensor cores: Ada (sm_89) and Hopper (sm_90) on


class Float8Error(DistlibError, ValueError):
    """Float8 training cannot run as asked: torchao missing, a GPU without float8, no blocks, a
    recipe torchao does not have."""


def float8_available() -> bool:
    """Whether torchao is installed (without importing it)."""
    return importlib.util.find_spec("torchao") is not None


def _torchao_float8():
    # torchao 0.18 registers an Enum with torch's pytree at import, which torch 2.14 logs as deprecated on
    # every rank: a warning about torchao's code, not the user's, kept out of the run's log
    pytree_log = logging.getLogger("torch.utils._pytree")
    level = pytree_log.level
    pytree_log.setLevel(logging.ERROR)
    try:
        # by name, not an import statement: torchao is an optional extra, never needed to import distlib
        float8 = importlib.import_module("torchao.float8")
    except ImportError as e:
        raise Float8Error("float8 training needs torchao, which is not installed: pip install 'distlib[fp8]'") from e
    finally:
        pytree_log.setLevel(level)
    return float8


def _check_recipe(recipe: str) -> None:
    if recipe not in FLOAT8_RECIPES:
        raise Float8Error(f"float8 recipe {recipe!r}: expected one of {', '.join(FLOAT8_RECIPES)}")


def _tied(model: nn.Module) -> set[int]:
    """Parameters that more than one module holds (an output layer tied to the embedding)."""
    owners: dict[int, int] = {}
    for m in model.modules():
        for p in m.parameters(recurse=False):
            owners[id(p)] = owners.get(id(p), 0) + 1
    return {k for k, n in owners.items() if n > 1}


def float8_layers(
    model: nn.Module,
    *,
    recipe: Recipe = "tensorwise",
    layers: Layers = "auto",
    blocks: Sequence[nn.Module] | None = None,
) -> list[str]:
    """The names of the Linear layers of ``model`` that ``convert_to_float8`` turns to float8 (the
    module's rule, above): the rest stays in high precision. ``blocks``: the model's repeated
    layers (default ``find_blocks(model)``: ``model.blocks``). Works on a model on the meta device.
    Needs torchao only with ``layers="auto"`` (its thresholds)."""
    _check_recipe(recipe)
    if layers not in ("auto", "all"):
        raise Float8Error(f"float8 layers {layers!r}: expected 'auto' or 'all'")
    blocks = find_blocks(model) if blocks is None else list(blocks)
    if not blocks:
        raise Float8Error(
            f"float8 training converts the Linear layers of the model's blocks, and {type(model).__name__} has "
            "none (no `blocks` ModuleList): name its repeated layer's class (blocks=, model.block_class)"
        )
    size_ok = None
    if layers == "auto":
        # torchao's own rule of which (K, N) gain from float8 for the recipe (measured on H100)
        size_ok = _torchao_float8()._auto_filter_for_recipe(recipe, filter_fqns=[])
    inside = {id(m) for b in blocks for m in b.modules()}
    tied = _tied(model)
    out = []
    for name, m in model.named_modules():
        if type(m) is not nn.Linear or id(m) not in inside or id(m.weight) in tied:
            continue
        out_features, in_features = m.weight.shape
        if in_features % 16 or out_features % 16:
            continue
        if size_ok is not None and not size_ok(m, name):
            continue
        out.append(name)
    return out


def _emulate(model: nn.Module, emulate: bool | None) -> bool:
    """Emulated on a CPU; real float8 on a GPU that has it; an older GPU refused."""
    if emulate is not None:
        return emulate
    devices = {p.device for p in model.parameters() if p.device.type != "meta"}
    if not devices:  # on the meta device: where it is going to run
        devices = {torch.device("cuda", torch.cuda.current_device())} if torch.cuda.is_available() else set()
    cuda = [d for d in devices if d.type == "cuda"]
    if not cuda:
        return True
    for d in cuda:
        capability = torch.cuda.get_device_capability(d)
        if capability < _MIN_CAPABILITY:
            raise Float8Error(
                f"float8 training needs a GPU of compute capability {_MIN_CAPABILITY[0]}.{_MIN_CAPABILITY[1]} or "
                f"newer (Ada, Hopper); {torch.cuda.get_device_name(d)} is {capability[0]}.{capability[1]}: train "
                "in bf16"
            )
    return False


def convert_to_float8(
    model: nn.Module,
    *,
    recipe: Recipe = "tensorwise",
    layers: Layers = "auto",
    blocks: Sequence[nn.Module] | None = None,
    emulate: bool | None = None,
    fsdp_float8_all_gather: bool = False,
) -> list[str]:
    """Turn the Linear layers ``float8_layers`` names into torchao's ``Float8Linear``, in place;
    returns their names. Their weights and state_dict keys stay as they were (a checkpoint of the
    unconverted model loads into the converted one and back). Before ``shard_model``/``fully_shard``,
    activation checkpointing and compilation (per block or whole).

    ``recipe``: torchao's scaling: ``tensorwise`` (one scale per tensor: the fastest on H100/H200)
    or ``rowwise`` (one per row: more accurate, slower there). ``emulate``: None, decided by the
    device the parameters are on (the CPU: emulated; a GPU of capability < 8.9: ``Float8Error``).
    ``fsdp_float8_all_gather`` (tensorwise only): the weights are wrapped so that FSDP2 all-gathers
    them in float8, half the bytes of bf16; only for a model that ``fully_shard`` shards next
    (call ``precompute_float8_scales`` after every optimizer step then)."""
    _check_recipe(recipe)
    if fsdp_float8_all_gather and recipe != "tensorwise":
        raise Float8Error(f"float8 all-gathers need the tensorwise recipe (torchao has none for {recipe})")
    names = float8_layers(model, recipe=recipe, layers=layers, blocks=blocks)
    float8 = _torchao_float8()
    config = float8.Float8LinearConfig.from_recipe_name(recipe)
    config = dataclasses.replace(config, emulate=_emulate(model, emulate),
                                 enable_fsdp_float8_all_gather=fsdp_float8_all_gather)  # fmt: skip
    if recipe == "rowwise":
        # inductor rounds rowwise's casts differently from eager unless told not to (pytorch/pytorch#150859;
        # torchtitan sets the same)
        import torch._inductor.config

        torch._inductor.config.emulate_precision_casts = True
    chosen = set(names)
    float8.convert_to_float8_training(model, config=config, module_filter_fn=lambda m, name: name in chosen)
    return names


@torch.no_grad()
def precompute_float8_scales(model: nn.Module) -> None:
    """The float8 scales of every weight that FSDP2 all-gathers in float8, from the weights as they
    are now, in one all-reduce (torchao's ``precompute_float8_dynamic_scale_for_fsdp``): after each
    optimizer step, and after anything else that changes the weights in place (loading a
    checkpoint, putting the weights back after warm-up steps): a scale computed earlier is kept and
    used by the next all-gather. A collective; nothing to do without such weights."""
    if not any(type(m).__name__ == "Float8Linear" for m in model.modules()):
        return
    _torchao_float8().precompute_float8_dynamic_scale_for_fsdp(model)
