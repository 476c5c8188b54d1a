"""The memory plan of a recipe: what one rank holds at the peak of a training step, measured before
anything is allocated.

The step is run, twice (the optimizer's state exists from the first step on), on fake tensors
(``FakeTensorMode``: shapes, dtypes and storages, no data) on the CPU, under a fake process group
of the planned world size (collectives do nothing), with torch's memory trackers counting every
storage (``MemTracker``; ``FSDPMemTracker`` under ``dist.shard=full``): the method of torchtitan's
estimator (``scripts/estimate``). What the runner's step does is mirrored with what runs on fake
tensors: the model built by its component, ``fully_shard`` per block then the root as
``shard_model`` applies it (FSDP2's mixed precision: bf16 weights in the layers), activation
checkpointing per block (``distlib.checkpoint_blocks``), autocast to the GPU's dtype, the task's
loss, backward, the global-norm clipping, the optimizer step. These parts are stood in for, each by
what allocates the same storages, because the real code cannot run on fake tensors or runs another
kernel on the CPU:

- GradSync's flat gradient buckets (at world size > 1 every gradient lives in one fp32 flat buffer,
  kept between steps; its checks read values): a flat buffer the gradients are copied into, and
  with ``dist.compress=bf16`` the bf16 copy of it that the all_reduce sends;
- the sharded optimizer (``dist.shard=optimizer``): the optimizer state of this rank's slice of
  every parameter (1/N of its elements, ``docs/grad_sync.md``);
- a compiled loss (``train.compile``; inductor does not run on fake tensors): it keeps its input and
  one fp32 value per row for backward and writes one gradient of the input's dtype, where the eager
  loss keeps an fp32 copy of the logits and its log-softmax;
- a transformers model's ``flex_attention``: SDPA's flash kernel without a mask, which keeps the same
  storages for backward (``_sdpa_for_flex``);
- SDPA with dropout: the same call without it, which keeps what a GPU's kernels keep with it (a seed,
  where the CPU's math path keeps every probability: ``_AttentionDropoutAsOnGPU``);
- float8 matrix products (``precision="fp8"``): each Linear the run turns to float8 (the same rule:
  ``distlib.float8_layers`` with train.fp8_recipe and train.fp8_layers) keeps float8 copies (one
  byte an element) of its input and weight for backward, its weight stays as it is.

Blocks that ``train.compile`` compiles with inductor are measured as inductor partitions them: each
block's forward and backward traced into one graph with inductor's decompositions and split by its
min-cut partitioner, which recomputes cheap pointwise work in backward rather than keep it (a
compiled Llama's step keeps about a fifth less than an eager one), the two graphs then run op by op
on fake tensors (``_partitioned_as_inductor``). Checkpointed blocks, a model compiled whole and other
backends are measured eager (an upper bound: fusion keeps less). The checkpoint's staging
is the state's size (a copy of this rank's parameters and optimizer state on the device, while a
background save writes them). Design: docs/memory_plan.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import math
import os
import sys
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

import distlib
from distlib.errors import DistlibError
from distlib.runner import components
from distlib.runner.config import LM_DATA, Config, ConfigError, task_of
from distlib.runner.models.parameters import cast_frozen, param_groups
from distlib.runner.tasks.causal_lm import recipe_vocab_size
from distlib.runner.tasks.chunked_loss import chunked_cross_entropy, chunks_applied, linear_cross_entropy
from distlib.runner.training.optimizer_step import PRECISIONS

GIB = 2**30
SHARD_MODES = ("none", "optimizer", "full")
CHECKPOINTING = ("none", "full", "selective")
# the compute dtype of each train.precision on a GPU (fp8: bf16 around the float8 matrix products)
_COMPUTE = PRECISIONS
PARTS = ("parameters", "gradients", "optimizer state", "gathered blocks", "activations")
CHUNKED = 8  # the loss.chunks a refusal of the plain loss measures and names (docs/loss.md: 8 measured on a GPU)


class MemoryRefused(DistlibError):
    """A run whose step cannot fit its GPU, refused before anything is allocated: one line, with what fits."""


class PlanError(ConfigError):
    """A recipe the plan cannot measure (not a language model, no sequence length): one line, naming why."""


@dataclass
class StepMemory:
    """One rank's memory at the peak of a training step: ``peak`` bytes, and what they hold (``parts``)."""

    peak: int
    parts: dict[str, int]
    frozen: int = 0  # of "parameters": those that do not train (a LoRA base), which no save or warm-up copies


@dataclass
class ModePlan:
    """One ``dist.shard`` mode: the step at each activation-checkpointing mode, the logits and loss
    at their peak, the checkpoint's staging copy, the largest batch per rank that fits."""

    shard: str
    steps: dict[str, StepMemory]  # train.activation_checkpointing -> the step's peak
    logits_and_loss: int
    staging: int  # a copy of this rank's trained parameters and optimizer state
    warm_up_copy: int  # a copy of this rank's trained parameters and buffers
    largest_batch: int | None = None  # per rank, at the recipe's checkpointing; None: not asked


@dataclass
class MemoryPlan:
    """The plan of one recipe at ``world_size`` ranks, ``batch`` sequences of ``seq_len`` tokens per rank."""

    world_size: int
    batch: int
    seq_len: int
    precision: str
    shard: str  # the recipe's
    checkpointing: str  # the recipe's
    staging: str  # run.checkpoint_staging
    warm_up: bool  # the runner's warm-up steps (train.prewarm_steps on a GPU) run with a copy of the weights
    modes: dict[str, ModePlan] = field(default_factory=dict)
    gpu_bytes: int | None = None  # the device's memory; None: no fit asked
    # kept free of gpu_bytes for what the plan does not count (run.memory_margin_gib, run.memory_margin_fraction)
    margin: int = 0
    # the run's peak with loss.chunks=CHUNKED (the output layer and the loss in chunks) at the recipe's modes:
    # measured for a refusal of a recipe with the plain loss, so that its advice can name it; None: not measured
    chunked: int | None = None

    def peak(self, shard: str | None = None, checkpointing: str | None = None) -> int:
        """The run's peak (the recipe's mode by default): a step's, with on top the larger of what
        runs beside some steps: the warm-up's copy of the weights (its steps put them back after),
        and a checkpoint's staging copy on the device with ``run.checkpoint_staging=device`` (``auto``
        stages on the device only when it has room to spare; ``host`` never)."""
        mode = self.modes[shard or self.shard]
        step = mode.steps[checkpointing or self.checkpointing].peak
        return step + max(mode.warm_up_copy if self.warm_up else 0, mode.staging if self.staging == "device" else 0)

    def fits(self, shard: str | None = None, checkpointing: str | None = None) -> bool | None:
        """Whether the peak, with the margin for what the plan does not count, is within the device's memory."""
        return None if self.gpu_bytes is None else self.peak(shard, checkpointing) + self.margin <= self.gpu_bytes

    def device(self) -> str:
        """The device's memory, and the margin kept of it."""
        assert self.gpu_bytes is not None
        kept = f" less a {size(self.margin)} margin (run.memory_margin_gib, run.memory_margin_fraction)"
        return f"the device's {size(self.gpu_bytes)}{kept if self.margin else ''}"

    def verdict(self) -> str:
        """One line: the recipe's peak per rank and, with a device size, whether it fits."""
        where = f"dist.shard={self.shard}, train.activation_checkpointing={self.checkpointing}"
        head = (f"memory plan: {size(self.peak())} per rank at the peak of a step ({self.world_size} rank(s), "
                f"{self.batch} x {self.seq_len} tokens per rank, {where})")  # fmt: skip
        if self.gpu_bytes is None:
            return head
        if self.fits():
            return f"{head}: fits {self.device()}"
        return f"{head}: does not fit {self.device()}{self.advice()}"

    def chunked_fits(self) -> bool:
        """Whether the peak with loss.chunks=CHUNKED (``chunked``, measured for a refused plain loss) fits."""
        return self.chunked is not None and self.gpu_bytes is not None and self.chunked + self.margin <= self.gpu_bytes

    def advice(self) -> str:
        """What would fit instead, among the modes measured ("; ..."), or what to change when none does."""
        fitting = [(self.peak(s, c), s, c) for s, m in self.modes.items() for c in m.steps if self.fits(s, c)]
        chunked = (
            f"loss.chunks={CHUNKED} (the output layer and the loss in chunks) would ({size(self.chunked)})"
            if self.chunked_fits()
            else ""
        )
        if not fitting:
            if chunked:
                return f"; {chunked}"
            return "; no dist.shard or checkpointing mode fits: more ranks, or a smaller train.batch_size"
        _, s, c = min(fitting, key=lambda f: (f[1] != self.shard) + (f[2] != self.checkpointing) + f[0] / 2**60)
        mode = f"dist.shard={s} with train.activation_checkpointing={c} would ({size(self.peak(s, c))})"
        return f"; {mode}" + (f"; or {chunked}" if chunked else "")

    def table(self) -> str:
        """Per rank, in GiB: the parts of the recipe's step, the peak at each checkpointing mode, the fit
        and the largest batch, one column per dist.shard mode."""
        shards = list(self.modes)
        unit, div = (
            ("GiB", GIB) if max(self.peak(s, c) for s in shards for c in self.modes[s].steps) >= GIB else ("MiB", 2**20)
        )

        def cell(n: int) -> str:
            return f"{n / div:.2f}"

        rows: list[tuple[str, list[str]]] = []
        for part in PARTS:
            rows.append((part, [cell(m.steps[self.checkpointing].parts.get(part, 0)) for m in self.modes.values()]))
        rows.append(("  of which logits and loss", [cell(m.logits_and_loss) for m in self.modes.values()]))
        if self.warm_up:
            rows.append(("warm-up copy of the weights", [cell(m.warm_up_copy) for m in self.modes.values()]))
        staged = {"device": "on the device", "host": "on the host", "auto": "device if room"}[self.staging]
        rows.append((f"checkpoint staging ({staged})", [cell(m.staging) for m in self.modes.values()]))
        for c in CHECKPOINTING:
            if all(c in m.steps for m in self.modes.values()):
                mark = " *" if c == self.checkpointing else ""
                rows.append((f"peak, checkpointing {c}{mark}", [cell(self.peak(s, c)) for s in shards]))
        if self.gpu_bytes is not None:
            for c in CHECKPOINTING:
                if all(c in m.steps for m in self.modes.values()):
                    fit = f"{size(self.gpu_bytes)} - {size(self.margin)}" if self.margin else size(self.gpu_bytes)
                    rows.append((f"fits {fit}, checkpointing {c}",
                                 ["yes" if self.fits(s, c) else "no" for s in shards]))  # fmt: skip
            if any(m.largest_batch is not None for m in self.modes.values()):
                rows.append(("largest batch per rank *", [str(m.largest_batch) if m.largest_batch is not None
                                                          else "-" for m in self.modes.values()]))  # fmt: skip
        width = max(len(r[0]) for r in rows) + 2
        lines = [f"{unit + ' per rank':<{width}}" + "".join(f"{'shard=' + s:>16}" for s in shards)]
        lines += [f"{name:<{width}}" + "".join(f"{v:>16}" for v in values) for name, values in rows]
        title = (f"memory plan: {self.world_size} rank(s), {self.batch} x {self.seq_len} tokens per rank, "
                 f"train.precision={self.precision}; * the recipe's checkpointing ({self.checkpointing})")  # fmt: skip
        return "\n".join([title, *lines])

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> MemoryPlan:
        """The plan ``as_dict`` wrote (a plan kept between runs, plan_cache)."""
        modes = {
            shard: ModePlan(**{**m, "steps": {c: StepMemory(**s) for c, s in m["steps"].items()}})
            for shard, m in d["modes"].items()
        }
        return cls(**{**d, "modes": modes})


def margin_bytes(cfg: Config, gpu_bytes: int | None) -> int:
    """What a verdict keeps free of a device of ``gpu_bytes`` for what the plan does not count:
    run.memory_margin_gib plus run.memory_margin_fraction of the device (0 without a device)."""
    if gpu_bytes is None:
        return 0
    return int(cfg.run.memory_margin_gib * GIB + cfg.run.memory_margin_fraction * gpu_bytes)


def size(n: int) -> str:
    """``n`` bytes in GiB, or in MiB below one GiB."""
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / 2**20:.1f} MiB"


# ---- what the recipe asks for --------------------------------------------------------------------
@dataclass
class StepSpec:
    """What one rank's step is made of, read from the recipe (the plan takes no data)."""

    build: Callable[[], nn.Module]
    block_class: str
    vocab_size: int
    seq_len: int
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    optimizer: str
    weight_decay: float
    grad_accum: int
    clip: bool
    compiled_loss: bool
    reshard_after_forward: bool = True  # dist.reshard_after_forward (shard=full)
    accumulate: str = "unsharded"  # dist.accumulate (shard=full, grad_accum > 1)
    offload: bool = False  # dist.offload (shard=full): the shards and the optimizer's state on the host
    layers: int = 0  # the model's blocks, when it can be built with another number of them
    build_layers: Callable[[int], nn.Module] | None = None  # the model with that many blocks
    fp8_recipe: str = "tensorwise"  # train.fp8_recipe (precision fp8)
    fp8_layers: str = "auto"  # train.fp8_layers (precision fp8): which Linears the run turns to float8
    momentum: float = 0.9  # train.momentum (SGD): a momentum buffer per parameter unless 0
    nesterov: bool = True  # train.nesterov (SGD)
    cuda_graph: bool = False  # train.cuda_graph: the runner's SGD is fused in a graph, foreach otherwise
    compress: str = "none"  # dist.compress: "bf16", GradSync keeps a bf16 copy of its buckets to send
    ema: bool = False  # train.ema > 0: an average of the weights (distlib.EMA), updated after each step
    compiled_blocks: bool = False  # train.compile compiles the blocks one by one with inductor
    chunks: int = 0  # loss.chunks: the output layer and the loss in chunks, where the model takes a head
    # the compiled blocks' traces (seconds each), shared by every step measured of this spec: the model at
    # 1, 2, 3... blocks and each mode's step trace its blocks once (_partitioned_as_inductor)
    traces: dict[Any, Callable[..., Any]] = field(default_factory=dict, compare=False, repr=False)


def step_spec(cfg: Config) -> StepSpec:
    """The model, sequence length and loss of ``cfg``, without its data: a language-model recipe's
    ``data.args.block_size`` (or the data set's default) and vocabulary (``byte_text``: 256; else
    the recipe's). Raises PlanError for what the plan does not measure."""
    if task_of(cfg) != "causal_lm":
        raise PlanError([f"memory plan: train.task={task_of(cfg)}: only language-model recipes are planned"])
    length = "max_length" if cfg.data.name == "chat" else "block_size"  # chat rows: data.args.max_length tokens
    seq_len = cfg.data.args.get(length)
    if seq_len is None:
        default = inspect.signature(components.resolve("data", cfg.data.name)).parameters.get(length)
        seq_len = default.default if default is not None and default.default is not inspect.Parameter.empty else None
    if not isinstance(seq_len, int):
        raise PlanError([f"memory plan: data.args.block_size: the sequence length of data.name={cfg.data.name} "
                         "is needed; set it in the recipe"])  # fmt: skip
    provided: dict[str, Any] = {"block_size": seq_len}
    if cfg.data.name == "byte_text":
        provided["vocab_size"] = 256
    # the recipe's own vocab_size wins over what the data provides, as components.build lets it
    vocab = recipe_vocab_size(cfg) or provided.get("vocab_size")
    if vocab is None and cfg.data.name not in LM_DATA:
        raise PlanError(["memory plan: the model's vocabulary size: set model.args.vocab_size"])
    loss = components.resolve("loss", cfg.loss.name)
    kwargs = {**components.accepted(loss, {"label_smoothing": cfg.train.label_smoothing}), **cfg.loss.args}
    t = cfg.train
    layers, build_layers = _layer_count(cfg, provided)
    return StepSpec(
        layers=layers, build_layers=build_layers,
        build=lambda: components.build("model", cfg.model.name, cfg.model.args, provided=provided),
        block_class=cfg.model.block_class, vocab_size=vocab or 0, seq_len=seq_len,
        loss_fn=lambda out, y: loss(out, y, **kwargs), optimizer=t.optimizer, weight_decay=t.weight_decay,
        grad_accum=t.grad_accum, clip=t.clip_grad_norm > 0, compiled_loss=t.compile != "none",
        reshard_after_forward=cfg.dist.reshard_after_forward, accumulate=cfg.dist.accumulate,
        offload=cfg.dist.offload, fp8_recipe=t.fp8_recipe, fp8_layers=t.fp8_layers, momentum=t.momentum,
        nesterov=t.nesterov, cuda_graph=t.cuda_graph, compress=cfg.dist.compress, ema=t.ema > 0,
        compiled_blocks=t.compile in ("auto", "blocks") and t.compile_backend == "inductor",
        chunks=chunks_applied(cfg),
    )  # fmt: skip


def _layer_count(cfg: Config, provided: dict[str, Any]) -> tuple[int, Callable[[int], nn.Module] | None]:
    """The number of blocks of a built-in model whose recipe sets it (gpt's ``n_layer``, a transformers
    config's ``num_hidden_layers`` without per-layer lists), and how to build it with another number."""
    args, name = cfg.model.args, cfg.model.name
    if name == "gpt":
        key, where = "n_layer", None
        n = args.get(key, inspect.signature(components.resolve("model", name)).parameters[key].default)
    elif name == "hf_causal_lm" and isinstance(args.get("config"), dict):
        key, where = "num_hidden_layers", "config"
        n = args["config"].get(key)
        if any(isinstance(v, list) for v in args["config"].values()):  # per-layer settings (layer_types)
            return 0, None
        if len(_layer_kinds(args["config"])) > 1:  # e.g. Gemma 3's five sliding-window layers to one global
            return 0, None
    else:
        return 0, None
    if not isinstance(n, int):
        return 0, None

    def build(layers: int) -> nn.Module:
        changed = {**args, where: {**args[where], key: layers}} if where else {**args, key: layers}
        return components.build("model", name, changed, provided=provided)

    return n, build


def _layer_kinds(config: dict[str, Any]) -> set[str]:
    """The kinds of layer a transformers config makes (its ``layer_types``, which the config class
    derives from a pattern: sliding-window and global attention). Layers of several kinds do not each
    add the same (a sliding-window layer keeps its mask, a global one has none), so a model of them is
    measured whole, not extrapolated from its first few layers, which may all be of one kind."""
    from distlib.runner.models.hf_causal_lm import build_config

    return set(getattr(build_config(config).get_text_config(), "layer_types", None) or ())


# ---- the stand-ins -------------------------------------------------------------------------------
class _CompiledLoss(torch.autograd.Function):
    """The storages of a compiled cross-entropy: it keeps its input and one fp32 value per row (the
    log-sum-exp), returns a scalar, and writes one gradient of its input's dtype."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor) -> torch.Tensor:
        lse = logits.new_empty(logits.shape[:-1], dtype=torch.float32)
        ctx.save_for_backward(logits, lse)
        return logits.new_zeros((), dtype=torch.float32)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        logits, _ = ctx.saved_tensors
        return torch.empty_like(logits)


class _Float8Linear(torch.autograd.Function):
    """A Linear whose matrix products run in float8 (torchao's float8 training): the weight stays in
    its dtype; float8 copies of the input and the weight (one byte an element) are kept for backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(x.to(torch.float8_e4m3fn), weight.to(torch.float8_e4m3fn))
        ctx.dtypes, ctx.has_bias = (x.dtype, weight.dtype), bias is not None
        compute = torch.bfloat16
        return F.linear(x.to(compute), weight.to(compute), None if bias is None else bias.to(compute))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        x8, w8 = ctx.saved_tensors
        grad_x = (grad @ w8.to(grad.dtype)).to(ctx.dtypes[0])
        grad_w = (grad.flatten(0, -2).t() @ x8.flatten(0, -2).to(grad.dtype)).to(ctx.dtypes[1])
        grad_b = grad.flatten(0, -2).sum(0) if ctx.has_bias else None
        return grad_x, grad_w, grad_b


def _float8_linears(model: nn.Module, spec: StepSpec, blocks: list[nn.Module]) -> int:
    """The Linear layers the run turns to float8 (``distlib.float8_layers``: the same rule, the same
    recipe and train.fp8_layers) compute through ``_Float8Linear``. Returns how many."""
    try:
        names = set(distlib.float8_layers(model, recipe=spec.fp8_recipe, layers=spec.fp8_layers, blocks=blocks))
    except distlib.Float8Error as e:
        raise PlanError([f"memory plan: {e}"]) from e
    for name, m in model.named_modules():
        if name in names:
            m.forward = lambda x, m=m: _Float8Linear.apply(x, m.weight, m.bias)  # type: ignore[method-assign]
    return len(names)


def _sdpa_for_flex(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' ``flex_attention`` (query (batch, heads, T, head_dim), key and value with their own
    heads) as SDPA's flash kernel without a mask: both keep the query, the keys and values (not repeated
    for each head), the output and one fp32 log-sum-exp per row and head for backward, and neither
    holds T x T scores (flex applies a window, a document mask or Gemma 2's soft-cap in its kernel)."""
    causal = bool(getattr(module, "is_causal", True)) and query.shape[2] > 1
    out = F.scaled_dot_product_attention(query, key, value, is_causal=causal, scale=scaling,
                                         enable_gqa=query.shape[1] != key.shape[1])  # fmt: skip
    return out.transpose(1, 2).contiguous(), None


@contextlib.contextmanager
def _flex_attention_as_sdpa() -> Iterator[None]:
    """A transformers model with ``attn_implementation="flex_attention"`` planned with ``_sdpa_for_flex``:
    flex attention does not run on fake tensors (its block mask is made from real index tensors, and it
    has no backward on the CPU). Its mask, a few int32 block indices, is left out (no mask). Nothing is
    changed while transformers is not imported (no model of it was built)."""
    if "transformers.modeling_utils" not in sys.modules or "transformers.masking_utils" not in sys.modules:
        yield
        return
    from transformers.masking_utils import AttentionMaskInterface
    from transformers.modeling_utils import AttentionInterface

    saved = [(m, m.get("flex_attention")) for m in (AttentionInterface._global_mapping,
                                                    AttentionMaskInterface._global_mapping)]  # fmt: skip
    AttentionInterface._global_mapping["flex_attention"] = _sdpa_for_flex
    AttentionMaskInterface._global_mapping["flex_attention"] = lambda *args, **kwargs: None
    try:
        yield
    finally:
        for mapping, fn in saved:
            if fn is None:
                mapping.pop("flex_attention", None)
            else:
                mapping["flex_attention"] = fn


class _AttentionDropoutAsOnGPU(TorchFunctionMode):
    """SDPA with dropout planned as it runs on a GPU: its flash and memory-efficient kernels draw the
    dropout mask inside the kernel from a seed and keep only the seed for backward, the same storages
    as without dropout; on the CPU, where the plan runs, SDPA with dropout takes the math path, which
    keeps the (batch, heads, T, T) probabilities and their mask. Planned so, a GPT-2 large at 8 x 1024
    tokens (dropout 0.1, its default) was 2.06 times the GPU's peak."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:  # a copy of its arguments only: every other call as it is
            if len(args) > 4:  # dropout_p given by position
                args = (*args[:4], 0.0, *args[5:])
            else:
                kwargs = {**kwargs, "dropout_p": 0.0}
        return func(*args, **kwargs)


def _flat_buckets(params: list[nn.Parameter]) -> torch.Tensor:
    """GradSync's flat gradient buffer at world size > 1: every gradient copied into it once produced
    (then ``.grad`` is a view of it and autograd's tensor is freed), kept between steps. GradSync
    copies a bucket's gradients once the bucket is complete: up to one bucket more, not planned."""
    flat = torch.empty(sum(p.numel() for p in params), dtype=torch.float32)
    at = 0
    for p in params:
        view = flat[at : at + p.numel()].view_as(p)
        at += p.numel()

        def into(param: torch.Tensor, view: torch.Tensor = view) -> None:
            if param.grad is not view:
                view.copy_(param.grad)
                param.grad = view

        p.register_post_accumulate_grad_hook(into)
    return flat


@contextlib.contextmanager
def fake_world(world_size: int) -> Iterator[None]:
    """A fake process group of ``world_size`` ranks (collectives do nothing) as the default group, and
    destroyed after; refused inside a real one."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("memory plan: a process group is running; plan before distlib.init()")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _autocast(dtype: torch.dtype | None) -> contextlib.AbstractContextManager:
    # the CPU's autocast runs the GPU's policy for what a transformer computes: matrix products and
    # attention in the low precision, norms of fp32 inputs and the loss in fp32
    return torch.autocast("cpu", dtype=dtype) if dtype is not None else contextlib.nullcontext()


def _storage(t: torch.Tensor) -> torch.UntypedStorage | None:
    local = getattr(t, "_local_tensor", None)  # a DTensor: its shard
    t = local if local is not None else t
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # a tensor without storage of its own
        return None


class Ledger(TorchDispatchMode):
    """Every storage an operation makes, counted until it is freed, under the part it was made for:
    what the running code says (``part``), else "activations"; ``peak`` and the parts at that moment.
    Storages that exist before are counted through ``hold``. Torch's MemTracker counts the same way
    but files each tensor per module at every operation, which is minutes for a large model; this is
    seconds."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[str, int] = dict.fromkeys(PARTS, 0)
        self.peak, self.at_peak = 0, dict(self.live)
        self._part = "activations"
        self._seen: dict[int, list[Any]] = {}  # id(storage) -> [part, bytes]

    def hold(self, tensors: Any, part: str) -> None:
        """Count ``tensors``' storages under ``part`` (moving them there if counted already)."""
        for t in pytree.tree_leaves(tensors):
            if isinstance(t, torch.Tensor) and (st := _storage(t)) is not None:
                self._count(st, part)

    def refresh(self, tensors: Any) -> None:
        """Take the current size of ``tensors``' storages, which were resized in place (FSDP2 frees
        and reallocates its gathered parameters by resizing their storage, no operation sees it)."""
        for t in tensors:
            st = _storage(t)
            entry = self._seen.get(id(st)) if st is not None else None
            if entry is None:
                continue
            n = st.nbytes()
            self.live[entry[0]] += n - entry[1]
            entry[1] = n
            total = sum(self.live.values())
            if total > self.peak:
                self.peak, self.at_peak = total, dict(self.live)

    def reset_peak(self) -> None:
        self.peak, self.at_peak = sum(self.live.values()), dict(self.live)

    @contextlib.contextmanager
    def part(self, name: str) -> Iterator[None]:
        before, self._part = self._part, name
        try:
            yield
        finally:
            self._part = before

    def _count(self, st: torch.UntypedStorage, part: str) -> None:
        key = id(st)
        entry = self._seen.get(key)
        if entry is not None:
            if entry[0] != part:
                self.live[entry[0]] -= entry[1]
                self.live[part] += entry[1]
                entry[0] = part
            return
        n = st.nbytes()
        entry = self._seen[key] = [part, n]
        self.live[part] += n
        weakref.finalize(st, self._free, key, entry)
        total = sum(self.live.values())
        if total > self.peak:
            self.peak, self.at_peak = total, dict(self.live)

    def _free(self, key: int, entry: list[Any]) -> None:
        if self._seen.get(key) is entry:
            del self._seen[key]
            self.live[entry[0]] -= entry[1]

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and (st := _storage(t)) is not None and id(st) not in self._seen:
                self._count(st, self._part)
        return out


@contextlib.contextmanager
def _fsdp_parts(ledger: Ledger) -> Iterator[None]:
    """FSDP2's gathered parameters and its communication buffers counted as "gathered blocks", and the
    gradient shards its reduce-scatter leaves as "gradients" (FSDP2's own methods, wrapped while the
    step runs; where a torch lacks them, what they make counts as activations)."""
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
    except ImportError:
        yield
        return
    names = ("unshard", "wait_for_unshard", "reshard", "post_backward")
    saved = {name: getattr(FSDPParamGroup, name, None) for name in names}

    def wrap(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(group: Any, *args: Any, **kwargs: Any) -> Any:
            with ledger.part("gathered blocks"):
                out = fn(group, *args, **kwargs)
            # the gathered parameters' storages, allocated or freed in place
            ledger.refresh([t for p in getattr(group, "fsdp_params", ()) for t in getattr(p, "all_gather_outputs", ())])
            if name == "post_backward":
                ledger.hold([p.sharded_param.grad for p in getattr(group, "fsdp_params", ())
                             if p.sharded_param.grad is not None], "gradients")  # fmt: skip
            return out

        return wrapped

    try:
        for name, fn in saved.items():
            if fn is not None:
                setattr(FSDPParamGroup, name, wrap(name, fn))
        yield
    finally:
        for name, fn in saved.items():
            if fn is not None:
                setattr(FSDPParamGroup, name, fn)


def measure_step(
    spec: StepSpec,
    *,
    shard: str,
    world_size: int,
    batch: int,
    checkpointing: str,
    precision: str,
    layers: int | None = None,
) -> StepMemory:
    """One rank's peak over two training steps of ``batch`` sequences (the second's: the optimizer's
    state exists from the first step on), on fake tensors, under the fake process group of
    ``world_size`` ranks that must be running (``fake_world``). ``layers``: the model built with that
    many blocks (``spec.build_layers``)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    if shard == "full":  # FSDP2's imports (a second on a CPU) only where it runs
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    dtype = _COMPUTE[precision]
    mesh = init_device_mesh("cpu", (world_size,)) if shard == "full" else None  # outside the fake mode
    ledger = Ledger()
    with FakeTensorMode(), torch.device("cpu"), contextlib.ExitStack() as stack:
        model = spec.build() if layers is None or spec.build_layers is None else spec.build_layers(layers)
        if not isinstance(model, nn.Module):
            raise PlanError([f"memory plan: the model's builder returned {type(model).__name__}, not an nn.Module"])
        stack.enter_context(_flex_attention_as_sdpa())  # after the build: it imports transformers, if anything
        stack.enter_context(_AttentionDropoutAsOnGPU())
        blocks = distlib.find_blocks(model, spec.block_class or None)
        cast_frozen(model, dtype)  # as the runner: a frozen base (LoRA's) in the compute dtype, no gradient
        if precision == "fp8":
            _float8_linears(model, spec, blocks)
        if shard == "full":  # as shard_model: each block, the last kept gathered after forward, then the root
            policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32 if dtype else None)
            again = spec.reshard_after_forward
            for i, block in enumerate(blocks):
                fully_shard(block, mesh=mesh, reshard_after_forward=again and i < len(blocks) - 1, mp_policy=policy)
            fully_shard(model, mesh=mesh, reshard_after_forward=again, mp_policy=policy)
        if checkpointing != "none":
            if not blocks:
                raise PlanError([f"memory plan: train.activation_checkpointing={checkpointing}: the model has no "
                                 "blocks; name their class with model.block_class"])  # fmt: skip
            distlib.checkpoint_blocks(blocks, checkpointing)
        partitioned = spec.compiled_blocks and checkpointing == "none" and bool(blocks)
        for block in blocks if partitioned else ():  # what changes a block's forward besides itself: fp8
            _partitioned_as_inductor(block, spec.traces, (precision, spec.fp8_recipe, spec.fp8_layers))
        groups = param_groups(model, spec.weight_decay)
        params = [p for g in groups for p in g["params"]]
        ledger.hold([*model.parameters(), *model.buffers()], "parameters")
        flat = None
        if shard != "full" and world_size > 1:
            flat = _flat_buckets(params)
            ledger.hold(flat, "gradients")
            if spec.compress == "bf16":  # the bf16 copy of every bucket that its all_reduce sends, kept
                sent = torch.empty(flat.numel(), dtype=torch.bfloat16)
                ledger.hold(sent, "gradients")
        stepped, slices = groups, []
        if shard == "optimizer" and flat is not None:
            # this rank's slice of every parameter (views of the parameters and of the flat gradient
            # buffer in the real step: no memory of their own), stepped by the optimizer
            slices = [nn.Parameter(torch.empty(math.ceil(p.numel() / world_size))) for p in params]
            stepped = [{"params": slices}]
        if spec.optimizer == "adamw":
            opt: torch.optim.Optimizer = torch.optim.AdamW(stepped, lr=1e-3, fused=True)
        else:
            # as Trainer.build_optimizer on a GPU: fused only inside a CUDA graph (never under FSDP2, which
            # has none, and whose DTensors have no fused SGD), else foreach, torch's default for CUDA tensors
            fused = spec.cuda_graph and shard != "full"
            nesterov = spec.nesterov and spec.momentum > 0
            opt = torch.optim.SGD(stepped, lr=1e-3, momentum=spec.momentum, nesterov=nesterov, fused=fused or None,
                                  foreach=None if fused else True)  # fmt: skip

        # train.ema: distlib.EMA's average, a copy of every floating parameter and buffer but the frozen
        # parameters, which it shares (with the parameters: the warm-up and the checkpoint copy it too),
        # updated after each optimizer step
        tensors = [*(p for p in model.parameters() if p.requires_grad), *model.buffers()]
        averaged = [t for t in tensors if t.is_floating_point()] if spec.ema else []
        average = [torch.empty_like(t) for t in averaged]
        ledger.hold(average, "parameters")

        def step_optimizer() -> None:
            at = 0
            for s in slices:  # the sharded optimizer's gradients: views of the flat buffer
                s.grad = flat[at : at + s.numel()]
                at += s.numel()
            opt.step()
            opt.zero_grad(set_to_none=True)
            for p in params if flat is None else ():
                p.grad = None
            if average:  # EMA.update: a difference per tensor, added in place
                torch._foreach_add_(average, torch._foreach_sub([t.detach() for t in averaged], average))

        # the optimizer's state as after a first step (one step without forward: the state, not the
        # gradients, is what it leaves), then one whole step measured
        for g in stepped:
            for p in g["params"] if not slices else ():
                p.grad = torch.zeros_like(p)
        step_optimizer()
        ledger.hold([v for state in opt.state.values() for v in state.values()], "optimizer state")
        x = torch.zeros(batch // spec.grad_accum, spec.seq_len, dtype=torch.long)
        y = torch.zeros_like(x)
        for p in params if flat is None else ():
            p.register_post_accumulate_grad_hook(lambda p: ledger.hold(p.grad, "gradients"))
        autocast = _autocast(dtype) if shard != "full" else contextlib.nullcontext()
        if partitioned:
            with autocast:  # the blocks traced, as compiled at their first call, outside the ledger
                model(x)
            for m in model.modules() if shard == "full" else ():
                if isinstance(m, FSDPModule):  # the last block stays gathered after forward: counted when
                    m.reshard()  # the measured step gathers it
        # the output layer applied by the loss in chunks, inside the model's forward (runner/tasks/chunked_loss.py)
        head = chunked_cross_entropy(spec.chunks).head(y) if spec.chunks and getattr(model, "takes_head", False) \
            else None  # fmt: skip
        with _fsdp_parts(ledger) if shard == "full" else contextlib.nullcontext(), ledger:
            for k in range(spec.grad_accum):
                if shard == "full":  # FSDPSync: no reduce-scatter before the last micro-batch, unless sharded
                    model.set_requires_gradient_sync(k == spec.grad_accum - 1 or spec.accumulate == "sharded")
                if head is not None:
                    with autocast:
                        loss = model(x, head=head)
                    loss.backward()
                    del loss
                    continue
                with autocast:
                    out = model(x)
                    # a mixture of experts in training: (logits, aux_loss), the aux term added to the loss
                    out, aux = (out[0], out[1]) if isinstance(out, tuple) else (out, None)
                    if shard == "full" and out.dtype != torch.float32:
                        out = out.float()  # the runner's step: the loss in fp32
                    loss = _CompiledLoss.apply(out) if spec.compiled_loss else spec.loss_fn(out, y)
                    if aux is not None:
                        loss = loss + aux.float()
                del out, aux
                loss.backward()
                del loss
            if spec.clip:
                torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
            with ledger.part("optimizer state"):
                step_optimizer()
    parts = dict(ledger.at_peak)
    peak = ledger.peak
    frozen = sum(_local(p).untyped_storage().nbytes() for p in model.parameters() if not p.requires_grad)
    if shard == "full" and spec.offload:
        # FSDP2's CPU offload keeps the weight, gradient and optimizer-state shards on the host (fake
        # tensors live on one device: the host's part of the peak is taken out of the device's)
        for part in ("parameters", "gradients", "optimizer state"):
            peak -= parts[part]
            parts[part] = 0
        frozen = 0
    return StepMemory(peak=peak, parts=parts, frozen=frozen)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _partitioned_as_inductor(block: nn.Module, traced: dict[Any, Callable[..., Any]], context: tuple = ()) -> None:
    """``block``'s forward, in place, as inductor compiles it for training, run on fake tensors: traced
    at its first call into a joint forward and backward graph with inductor's decompositions, split by
    the min-cut partitioner that inductor uses (it keeps for backward what is costly to recompute and
    recomputes cheap pointwise work), the two graphs then run op by op, so the ledger sees each
    storage. Inductor itself does not run on fake tensors, and torch.compile does not compile under
    the ledger's dispatch mode; ``aot_function`` traces without dynamo. Blocks alike (``_alike``) called
    with inputs alike share one trace in ``traced`` (seconds each), as they share one compiled graph, in
    this step and in the others measured of the same recipe (``context``: what else tells them apart)."""
    from torch._functorch.aot_autograd import aot_function
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch._inductor.decomposition import select_decomp_table
    from torch.nn.utils.stateless import _reparametrize_module

    forward, alike = block.forward, _alike(block)

    def call(*args: Any, **kwargs: Any) -> Any:
        # the parameters at each call: under FSDP2, the ones its pre-forward hook has just gathered
        tensors = {**dict(block.named_parameters()), **dict(block.named_buffers())}
        key = (context, alike, _inputs_alike((tensors, args, kwargs)), torch.is_autocast_enabled("cpu"),
               torch.get_autocast_dtype("cpu"), torch.is_grad_enabled())  # fmt: skip
        if key not in traced:

            def functional(tensors: dict[str, torch.Tensor], args: tuple, kwargs: dict) -> Any:
                # torch.func.functional_call would call the module again: its hooks, then this forward
                with _reparametrize_module(block, tensors):
                    return forward(*args, **kwargs)

            traced[key] = aot_function(functional, fw_compiler=_as_it_is, bw_compiler=_as_it_is,
                                       partition_fn=min_cut_rematerialization_partition,
                                       decompositions=select_decomp_table())  # fmt: skip
        return traced[key](tensors, args, kwargs)

    block.forward = call


def _alike(block: nn.Module) -> tuple:
    """What makes two blocks compute alike: each submodule's class and plain attributes (a window
    size, an attention kind), each parameter's and buffer's name, shape and dtype. A transformers
    layer's ``layer_idx`` is left out: it indexes the generation cache, which training does not use."""
    out: list[Any] = []
    for name, m in block.named_modules():
        plain = sorted((k, v) for k, v in vars(m).items() if not k.startswith("_") and k != "layer_idx"
                       and isinstance(v, (int, float, str, bool, type(None))))  # fmt: skip
        out.append((name, type(m), tuple(plain)))
    for name, t in (*block.named_parameters(), *block.named_buffers()):
        out.append((name, tuple(t.shape), t.dtype))
    return tuple(out)


def _inputs_alike(inputs: Any) -> tuple:
    """The structure of ``inputs`` and each leaf's shape and dtype (a tensor) or value (anything else)."""
    leaves, structure = pytree.tree_flatten(inputs)
    return str(structure), tuple((tuple(v.shape), v.dtype, v.requires_grad) if isinstance(v, torch.Tensor)
                                 else repr(v) for v in leaves)  # fmt: skip


def _as_it_is(gm: torch.fx.GraphModule, _inputs: Any) -> Callable[..., Any]:
    return gm


def measure_loss(spec: StepSpec, batch: int, shard: str, precision: str) -> int:
    """The logits (of the dtype the step hands the loss) and the loss's own storages at their peak."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    dtype = _COMPUTE[precision] or torch.float32
    ledger = Ledger()
    if spec.chunks:
        with FakeTensorMode(), torch.device("cpu"):
            model = spec.build_layers(1) if spec.build_layers is not None else spec.build()
            out_layer = (
                model.lm_head if hasattr(model, "lm_head") else getattr(model, "hf", model).get_output_embeddings()
            )
            if getattr(model, "takes_head", False):  # the hidden states, one chunk's logits and the gradients
                hidden = torch.empty(batch // spec.grad_accum, spec.seq_len, out_layer.weight.shape[1], dtype=dtype,
                                     requires_grad=True)  # fmt: skip
                weight = out_layer.weight.detach().to(dtype).requires_grad_()
                y = torch.zeros(hidden.shape[:-1], dtype=torch.long)
                layer = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
                layer.weight = nn.Parameter(weight)
                ledger.hold(hidden, "activations")
                with ledger, _autocast(dtype) if shard != "full" else contextlib.nullcontext():
                    loss = linear_cross_entropy(hidden, layer, y, chunks=spec.chunks)
                    loss.backward()
                return ledger.peak
    with FakeTensorMode(), torch.device("cpu"):
        logits = torch.empty(batch // spec.grad_accum, spec.seq_len, spec.vocab_size, dtype=dtype,
                             requires_grad=True)  # fmt: skip
        y = torch.zeros(logits.shape[:-1], dtype=torch.long)
        ledger.hold(logits, "activations")
        with ledger:
            out = logits.float() if shard == "full" else logits
            loss = _CompiledLoss.apply(out) if spec.compiled_loss else spec.loss_fn(out, y)
            del out
            loss.backward()
    return ledger.peak


def step_memory(spec: StepSpec, **kwargs: Any) -> StepMemory:
    """``measure_step``; for a model of more than 5 blocks that can be built with fewer, measured at 1,
    2, 3... blocks until each block adds the same to every part twice in a row, then extrapolated to
    its number from the last two: past the first few blocks every block adds the same storages (its
    weights, their gradient and optimizer state, its activations) and the peak comes at the same
    point of the step, so the peak is linear in the blocks. The first blocks are not yet there: under
    ``dist.shard=full`` with checkpointing, a block's recomputation holds its own gathered weights,
    those FSDP2 prefetches and the last block's (kept gathered since forward), which overlap at 2
    blocks and not from 3 on, and the peak moves to another point of the backward; the step
    from 2 to 3 blocks, taken as every block's, planned a 6.7B GPT at 1.7 times its GPU's peak, with
    negative parts. Where no two steps agree by 8 blocks, the whole model is measured. From 1 block
    on, not 2: a model whose blocks add the same from the first (most: no sharding, or no
    checkpointing) is planned from 6 fake blocks instead of 9, the plan of a recipe's first run 0.8x
    (docs/memory_plan.md); one that does not yet measures one more small model."""
    n = spec.layers
    if n <= 5 or spec.build_layers is None:
        return measure_step(spec, **kwargs)

    def growth(a: StepMemory, b: StepMemory) -> dict[str, int]:
        return {k: b.parts[k] - a.parts[k] for k in b.parts}

    before, last = measure_step(spec, layers=1, **kwargs), measure_step(spec, layers=2, **kwargs)
    for k in range(3, min(n, 9)):
        step = growth(before, last)
        before, last = last, measure_step(spec, layers=k, **kwargs)
        if growth(before, last) == step:
            parts = {part: last.parts[part] + (n - k) * step[part] for part in last.parts}
            frozen = last.frozen + (n - k) * (last.frozen - before.frozen)
            return StepMemory(peak=last.peak + (n - k) * (last.peak - before.peak), parts=parts, frozen=frozen)
    return measure_step(spec, **kwargs)


@contextlib.contextmanager
def _meta_failures_unlogged() -> Iterator[None]:
    """FakeTensorMode logs the traceback of an operation whose meta kernel raises before it raises it
    (torch._subclasses.fake_tensor, at ERROR): the error reaches the plan's caller, which says it in one
    line (at launch and in the command), so the log's copy is held back while the plan runs."""
    import logging

    logger = logging.getLogger("torch._subclasses.fake_tensor")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def largest_batch(measure: Callable[[int], int], micro: int, peak: int, limit: int) -> int:
    """The largest micro-batch whose peak (``measure(batch)`` bytes; ``peak`` at ``micro``) is at most
    ``limit``. Past the point where the activations set the peak (a small batch may peak at the
    optimizer's step, which the batch does not change), the peak grows linearly with the batch: the
    batch is multiplied by 4 until the peak grows (at most 3 times), and the line through the last two
    measurements gives the answer."""
    lo, p_lo = micro, peak
    hi = 2 * micro
    for _ in range(4):
        p_hi = measure(hi)
        if p_hi > limit or p_hi - p_lo > 0.02 * p_lo:
            break
        lo, p_lo, hi = hi, p_hi, hi * 4
    slope = (p_hi - p_lo) / (hi - lo)
    if slope <= 0:  # not even the largest batch tried changes the peak
        return hi if p_hi <= limit else 0
    return max(0, lo + math.floor((limit - p_lo) / slope))


def plan(
    cfg: Config,
    world_size: int,
    *,
    gpu_bytes: int | None = None,
    shards: tuple[str, ...] = SHARD_MODES,
    checkpointing: tuple[str, ...] = CHECKPOINTING,
    batches: bool = True,
    precision: str | None = None,
    warm_up: bool = True,
) -> MemoryPlan:
    """The memory plan of ``cfg`` at ``world_size`` ranks: each of ``shards`` at each of
    ``checkpointing``, the largest batch per rank (``batches``, with ``gpu_bytes``) at the recipe's
    checkpointing. ``precision``: in place of train.precision (``"fp8"``: float8 matrix products).
    ``warm_up``: the run warms up (on a GPU; train.prewarm_steps).
    Starts and ends a fake process group: call it before ``distlib.init()``."""
    precision = precision or cfg.train.precision
    if precision not in _COMPUTE:
        raise PlanError([f"memory plan: precision {precision!r}: one of {', '.join(_COMPUTE)}"])
    spec = step_spec(cfg)
    if cfg.train.batch_size % world_size:
        raise PlanError([f"memory plan: train.batch_size={cfg.train.batch_size} must divide evenly over "
                         f"{world_size} ranks"])  # fmt: skip
    batch = cfg.train.batch_size // world_size
    if batch % spec.grad_accum:
        raise PlanError([f"memory plan: {batch} sequences per rank must divide evenly into "
                         f"train.grad_accum={spec.grad_accum} micro-batches"])  # fmt: skip
    own = cfg.train.activation_checkpointing
    result = MemoryPlan(world_size=world_size, batch=batch, seq_len=spec.seq_len, precision=precision,
                        shard=cfg.dist.shard, checkpointing=own, staging=cfg.run.checkpoint_staging,
                        warm_up=warm_up and cfg.train.prewarm_steps > 0, gpu_bytes=gpu_bytes,
                        margin=margin_bytes(cfg, gpu_bytes))  # fmt: skip
    # only FSDP2 needs a process group (a fake one; none and optimizer stand in for GradSync's)
    with fake_world(world_size) if "full" in shards else contextlib.nullcontext(), _meta_failures_unlogged():
        for shard in shards:
            steps = {c: step_memory(spec, shard=shard, world_size=world_size, batch=batch, checkpointing=c,
                                     precision=precision) for c in dict.fromkeys((*checkpointing, own))}  # fmt: skip
            parts, frozen = steps[own].parts, steps[own].frozen
            # a copy of what is on the device (nothing with dist.offload: the shards are on the host); of
            # the parameters, those that train: a frozen base is neither saved nor changed by the warm-up
            mode = ModePlan(shard, steps, logits_and_loss=measure_loss(spec, batch, shard, precision),
                            staging=parts["parameters"] - frozen + parts["optimizer state"],
                            warm_up_copy=parts["parameters"] - frozen)  # fmt: skip
            result.modes[shard] = mode
            if batches and gpu_bytes is not None:
                # what runs beside the steps, and the margin
                room = gpu_bytes - result.margin - (result.peak(shard, own) - steps[own].peak)

                def peak_at(micro: int, shard: str = shard) -> int:
                    return step_memory(spec, shard=shard, world_size=world_size, batch=micro * spec.grad_accum,
                                       checkpointing=own, precision=precision).peak  # fmt: skip

                micro = batch // spec.grad_accum
                mode.largest_batch = largest_batch(peak_at, micro, steps[own].peak, room) * spec.grad_accum
    return result


def main(argv: list[str] | None = None) -> int:
    """``python -m distlib.runner.plan RECIPE [a.b=value ...] --nproc N [--gpu-gib G]``."""
    import argparse
    import sys

    p = argparse.ArgumentParser(
        prog="python -m distlib.runner.plan",
        description="The memory one rank of a recipe needs at the peak of a training step, in each dist.shard "
        "mode and activation-checkpointing mode, measured on fake tensors (no GPU, no data needed).",
    )
    p.add_argument("recipe", help="YAML recipe")
    p.add_argument("overrides", nargs="*", help="dotted.key=value overrides, as for launch.py")
    p.add_argument("--nproc", type=int, default=1, help="ranks (GPUs) in all: train.batch_size is divided over them")
    p.add_argument("--gpu-gib", type=float, default=None,
                   help="one GPU's memory in GiB (default: this machine's GPU, if it has one)")  # fmt: skip
    p.add_argument("--precision", choices=sorted(_COMPUTE), default=None,
                   help="in place of train.precision (fp8: float8 matrix products)")  # fmt: skip
    p.add_argument("--json", metavar="PATH", help="also write the plan as JSON to PATH")
    args = p.parse_intermixed_args(argv)  # options anywhere among the overrides
    try:
        if args.nproc < 1:
            raise PlanError([f"--nproc: must be >= 1, got {args.nproc}"])
        if args.gpu_gib is not None and args.gpu_gib <= 0:
            raise PlanError([f"--gpu-gib: must be > 0, got {args.gpu_gib}"])
        from distlib.runner.config import load_config

        cfg = load_config(args.recipe, args.overrides)
        gpu = int(args.gpu_gib * GIB) if args.gpu_gib is not None else device_bytes()
        result = plan(cfg, args.nproc, gpu_bytes=gpu, precision=args.precision)
        add_chunked(cfg, result, lambda chunked: plan(chunked, args.nproc, gpu_bytes=gpu, precision=args.precision,
                                                      shards=(cfg.dist.shard,), batches=False,
                                                      checkpointing=(cfg.train.activation_checkpointing,)))  # fmt: skip
    except ConfigError as e:
        lines = e.problems
        print("error: " + (lines[0] if len(lines) == 1 else str(e)), file=sys.stderr)
        return 2
    except Exception as e:  # the model's step does not run on fake tensors: one line, as at launch
        print(f"error: memory plan: the step did not run on fake tensors ({_one_line(e)})", file=sys.stderr)
        return 1
    print(result.table())
    print(result.verdict())
    if result.fits() is False and takes_chunked(cfg, result):
        print(f"a launch takes loss.chunks={CHUNKED} instead (loss.chunks_when_needed=false refuses it)")
    if args.json:
        import json

        with open(args.json, "w") as f:
            json.dump(result.as_dict(), f, indent=1)
    return 0


def add_chunked(cfg: Config, result: MemoryPlan, measure: Callable[[Config], MemoryPlan | None]) -> None:
    """``result.chunked``, for a refusal of a recipe with the plain loss (loss.chunks 0): the peak that
    ``measure`` gives the recipe with loss.chunks=CHUNKED, kept where it is lower (a model whose output
    layer the loss cannot take has the same peak)."""
    if result.fits() is not False or cfg.loss.chunks != 0:
        return
    other = measure(dataclasses.replace(cfg, loss=dataclasses.replace(cfg.loss, chunks=CHUNKED)))
    if other is not None and other.peak() < result.peak():
        result.chunked = other.peak()


def takes_chunked(cfg: Config, result: MemoryPlan) -> bool:
    """Whether a launch of ``cfg``, refused as ``result`` says, goes on with loss.chunks=CHUNKED instead:
    ``loss.chunks_when_needed`` on and the loss in chunks measured to fit (``add_chunked``)."""
    return cfg.loss.chunks_when_needed and result.chunked_fits()


def device_bytes(index: int | None = None) -> int | None:
    """GPU ``index``'s memory in bytes (None: the smallest of the visible GPUs); None without a GPU.
    Reads the device's properties only: no CUDA context is made."""
    if not torch.cuda.is_available():
        return None
    indices = range(torch.cuda.device_count()) if index is None else [index % torch.cuda.device_count()]
    return min(torch.cuda.get_device_properties(i).total_memory for i in indices)


def check_before_launch(cfg: Config) -> MemoryPlan | None:
    """A run's memory plan at its start, before the process group (``run.memory_plan``: on a GPU by
    default): the recipe's own mode at the
    launcher's world size (``WORLD_SIZE``), one line in rank 0's log. On a GPU, a step that cannot fit
    it raises MemoryRefused on every rank (each computes the same plan, so all stop alike); on a CPU
    the line is all. A recipe the plan does not measure, or a model that cannot run on fake tensors,
    is said in that line and the run goes on. Returns the plan (its verdict "fits"), or None when none
    was made: a step that runs out of memory all the same names it (runner/training/out_of_memory.py)."""
    if cfg.dist.mode == "fallback":  # one process drives every GPU of its node: not one rank per GPU
        return None
    # a CPU run has no device memory to run out of, and the plan costs seconds of start-up (more under
    # dist.shard=full, planned in a process of its own): made on a GPU, or when asked for
    if cfg.run.memory_plan == "off" or (cfg.run.memory_plan == "auto" and not torch.cuda.is_available()):
        return None
    gpus = torch.cuda.device_count() if cfg.dist.backend != "gloo" else 0
    if gpus and int(os.environ.get("LOCAL_WORLD_SIZE", "1")) > gpus:
        return None  # more processes than GPUs: the process group's start names that error, a plan would not
    log = distlib.get_logger()
    main = os.environ.get("RANK", "0") == "0"
    world = int(os.environ.get("WORLD_SIZE", "1"))
    gpu = device_bytes(int(os.environ.get("LOCAL_RANK", "0"))) if cfg.dist.backend != "gloo" else None
    on_gpu = torch.cuda.is_available() and cfg.dist.backend != "gloo"
    own = dict(shards=(cfg.dist.shard,), checkpointing=(cfg.train.activation_checkpointing,))

    def make() -> tuple[str, Any, bool]:
        # FSDP2 runs under a fake process group: in a process of its own, since a process group and its
        # device meshes leave state behind them (a later sharded checkpoint of the real group was wrong)
        measure = _plan_in_child if cfg.dist.shard == "full" else _plan_here
        outcome, result = measure(cfg, world, gpu, on_gpu, own)
        if outcome == "ok" and result.fits() is False:  # what would fit instead: every mode, measured only now
            outcome, result = _plan_in_child(cfg, world, gpu, on_gpu, {})
            if outcome == "ok":  # and the recipe's modes with the loss in chunks, where its loss is plain
                measure_own = _plan_in_child if cfg.dist.shard == "full" else _plan_here

                def in_chunks(chunked: Config) -> MemoryPlan | None:
                    how, other = measure_own(chunked, world, gpu, on_gpu, own)
                    return other if how == "ok" else None

                add_chunked(cfg, result, in_chunks)
        if outcome == "ok":
            return outcome, result.as_dict(), True
        return outcome, result, outcome != "died"  # a child that died (out of host memory) may not die again

    # made once: kept for a rerun or a resume, and by local rank 0 only (plan_cache)
    from distlib.runner.training import plan_cache

    local = int(os.environ.get("LOCAL_RANK", "0"))
    on_cuda = gpu is not None and torch.cuda.is_available()
    name = torch.cuda.get_device_name(local % torch.cuda.device_count()) if on_cuda else ""
    key = plan_cache.plan_key(cfg, world, name, gpu, on_gpu, own)
    outcome, result, source = plan_cache.shared_plan(plan_cache.cache_dir(cfg), key, make)
    if outcome == "died":
        outcome = "failed"
    if outcome == "ok":
        result = MemoryPlan.from_dict(result)
    if outcome == "not planned":
        if main:
            log.info("memory plan: not made: %s", result.removeprefix("memory plan: "))
        return None
    if outcome == "failed":  # a model that does not run on fake tensors: the run itself is not in question
        if main:
            log.warning("memory plan: not made: the step did not run on fake tensors (%s)", result)
        return None
    if result.fits() is False:
        if takes_chunked(cfg, result):
            # the same loss and gradients at a slower step (docs/loss.md): a run that trains rather than
            # one that stops; every rank takes the same plan, so every rank switches alike
            if main:
                log.info("%s: the run takes it (loss.chunks_when_needed=false stops here instead)", result.verdict())
            cfg.loss.chunks = CHUNKED
            return check_before_launch(cfg)  # the plan of the run as it goes: its own, kept under its own key
        raise MemoryRefused(result.verdict())
    if main:
        log.info("%s%s", result.verdict(), " (the plan of an earlier run: plan_cache)" if source == "cache" else "")
    return result


def _plan_here(cfg: Config, world: int, gpu: int | None, on_gpu: bool, modes: dict[str, Any]) -> tuple[str, Any]:
    """``plan`` as an outcome: ("ok", the plan), ("not planned", why) or ("failed", the error in a line)."""
    try:
        return "ok", plan(cfg, world, gpu_bytes=gpu, batches=False, warm_up=on_gpu, **modes)
    except PlanError as e:
        return "not planned", e.problems[0]
    except Exception as e:
        return "failed", _one_line(e)


def _one_line(e: BaseException) -> str:
    """An error as one line: its type and the first line of its message."""
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"


def _plan_in_child(cfg: Config, world: int, gpu: int | None, on_gpu: bool, modes: dict[str, Any]) -> tuple[str, Any]:
    """``_plan_here`` in a fresh process (spawned: nothing of this one's state in it)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        try:
            return pool.submit(_plan_here, cfg, world, gpu, on_gpu, modes).result()
        except Exception as e:  # the child died (out of host memory): say so, the run goes on
            return "died", f"{type(e).__name__}: {e}"
