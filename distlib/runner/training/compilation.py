"""How the runner compiles a model and checkpoints its activations: ``train.compile``,
``train.activation_checkpointing`` and ``model.block_class`` (docs/compile.md).

Both work per block (``distlib.find_blocks``): activation checkpointing first, then each block
compiled in place, so the same model object goes on to the step in every shard mode (with
``dist.shard=full`` the blocks are FSDP2's, already sharded): stages 6 and 7 of
runner/training/build_order.py. ``train.compile=model`` compiles the whole model instead, around the
gradient sync (``distlib.compile_for_sync``), which the step does.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
from torch import nn

import distlib
from distlib.runner.config import Config, ConfigError
from distlib.runner.data.images import default_cache_dir


def compile_cache_dir(cfg: Config) -> str:
    """Where torch.compile keeps its on-disk caches (inductor's FX graphs, AOTAutograd's, Triton's
    kernels): ``run.compile_cache_dir``, else ``$TORCHINDUCTOR_CACHE_DIR``, else the user's cache
    (torch's own default is a temporary directory, which a reboot or a tmp cleaner empties)."""
    return (
        cfg.run.compile_cache_dir
        or os.environ.get("TORCHINDUCTOR_CACHE_DIR")
        or os.path.join(default_cache_dir(), "compile")
    )


def use_compile_cache(cfg: Config) -> str:
    """Point torch.compile's caches at ``compile_cache_dir(cfg)`` for this process (inductor reads
    the variable at each use, Triton's directory follows it); before the first compilation."""
    path = os.path.abspath(compile_cache_dir(cfg))
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = path
    return path


def load_compiler(cfg: Config) -> bool:
    """When ``train.compile`` is on: point its caches at ``compile_cache_dir(cfg)``, import inductor
    (about 1.7 s with warm bytecode caches, 7.6 s without), a start-up stage of its own ("compiler")
    rather than part of the model's build, and start its compile workers. Returns whether it did."""
    if cfg.train.compile == "none" or cfg.dist.mode == "fallback":
        return False
    use_compile_cache(cfg)
    if cfg.train.compile_backend == "inductor":
        import torch._inductor.compile_fx  # noqa: F401  # what torch.compile imports at its first call

        start_compile_workers()
    return True


def start_compile_workers() -> None:
    """Start inductor's pool of kernel-compiling processes now, in the background, rather than at
    the first compilation. torch starts it when dynamo first hands a graph to inductor, and inductor
    compiles in this process, one kernel after another, any kernel it meets before the workers
    (each a process that imports torch and Triton) are ready: started at the compiler stage they
    start while the model is built and the first graph traced. A no-op where inductor makes no
    Triton kernels (no Triton: a CPU-only torch) or where ``TORCH_WARM_POOL=0`` turns it off."""
    try:
        from torch._inductor.async_compile import maybe_warm_pool
    except ImportError:  # a torch without it: the pool starts at the first compilation, as before
        return
    maybe_warm_pool()


def model_blocks(cfg: Config, model: nn.Module) -> list[nn.Module]:
    """The model's blocks: those of class ``model.block_class``, else the entries of ``model.blocks``."""
    name = cfg.model.block_class
    blocks = distlib.find_blocks(model, name or None)
    if name and not blocks:
        classes = sorted({type(m).__name__ for m in model.modules()} - {type(model).__name__})
        raise ConfigError([f"model.block_class={name!r}: {cfg.model.name} has no submodule of that class "
                           f"(its classes: {', '.join(classes[:20])})"])  # fmt: skip
    return blocks


def apply_block_settings(cfg: Config, model: nn.Module) -> bool:
    """Activation checkpointing and per-block compilation, in place, as the recipe asks. Returns True
    when the whole model is to be compiled instead (``train.compile=model``, or ``true`` for a
    model without blocks), which the step does around its gradient sync."""
    t = cfg.train
    if t.compile == "none" and t.activation_checkpointing == "none":
        return False
    blocks = model_blocks(cfg, model)
    why = (
        f"{cfg.model.name} has no blocks (no `blocks` ModuleList); name the class of its repeated layer "
        "with model.block_class"
    )
    if t.activation_checkpointing != "none":
        if not blocks:
            raise ConfigError([f"train.activation_checkpointing={t.activation_checkpointing}: {why}"])
        distlib.checkpoint_blocks(blocks, t.activation_checkpointing)
    mode = t.compile
    if mode == "auto":
        mode = "blocks" if blocks else "model"
    if mode == "none":
        return False
    use_compile_cache(cfg)
    if mode == "model":
        if cfg.dist.shard == "full":
            raise ConfigError([f"train.compile={t.compile} with dist.shard=full: a fully sharded model is "
                               f"compiled per block, and {why}"])  # fmt: skip
        return True
    if not blocks:
        raise ConfigError([f"train.compile=blocks: {why}, or set train.compile=model"])
    n = distlib.compile_blocks(blocks, backend=t.compile_backend)
    distlib.get_logger().info("train.compile: %d blocks (%s) compiled one by one", n, type(blocks[0]).__name__)
    return False


def compiled_loss(cfg: Config, loss_fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``loss_fn`` compiled too whenever ``train.compile`` compiles the model (blocks or whole). In
    eager mode a language model's fp32 cross-entropy is several passes over the logits (the cast to
    fp32, the log-softmax, their backward: at a 128k vocabulary and 16k tokens each pass moves 8 GB);
    compiled, it reads the bf16 logits and writes their gradient once each way. ``dynamic=False``: the
    step's shapes are fixed."""
    if cfg.train.compile == "none":
        return loss_fn
    return torch.compile(loss_fn, backend=cfg.train.compile_backend, dynamic=False)
