"""Run configuration: a typed dataclass tree, YAML that holds only what differs
from the defaults, and ``a.b=value`` overrides from the command line.

Every problem in a recipe and its overrides is collected and reported at once
(``ConfigError``), before any process group starts and before anything is written.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import inspect
import math
import os
import re
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

import yaml

from distlib.errors import DistlibError


@dataclass
class AugmentConfig:
    crop_pad: int = 4  # random crop with this much reflect padding; 0 turns it off
    flip: Literal["none", "random", "alternating"] = "random"  # alternating: airbench's derandomized flip
    cutout: int = 0  # side of a zeroed square; 0 turns it off


@dataclass
class DataConfig:
    name: str = "image_folder"  # image_folder, byte_text (.txt/.txt.gz), token_file (.bin), chat, or module:callable
    args: dict[str, Any] = field(default_factory=dict)  # keyword arguments of the data set (text: block_size, ...)
    root: str = "data/cifar10-demo"  # image_folder: CIFAR-10 or ImageFolder; byte_text, token_file, chat: the file(s)
    download: bool = False  # let torchvision download CIFAR-10 into root when it is missing
    cache_dir: str = ""  # where the decoded uint8 tensors are kept; "" = $XDG_CACHE_HOME/distlib or ~/.cache/distlib
    train_subset: int = 0  # use only the first N training images (0 = all)
    on_device: bool = True  # keep the whole decoded set on the device and augment there
    augment: AugmentConfig = field(default_factory=AugmentConfig)


@dataclass
class ModelConfig:
    name: str = "resnet18_cifar"  # resnet18_cifar (3x3 stem), small_cnn, gpt, hf_causal_lm, or package.module:callable
    args: dict[str, Any] = field(default_factory=dict)  # keyword arguments of the model (gpt: n_layer, n_embd, ...)
    width: int = 64  # base channel count of small_cnn (given to any model that takes `width`)
    num_classes: int = 10  # must match the data set (given to any model that takes `num_classes`)
    channels_last: bool = True  # NHWC memory format: faster convolutions on GPUs
    block_class: str = ""  # the repeated block's class name (compile, checkpointing, shard=full); "" = model.blocks


@dataclass
class LossConfig:
    # cross_entropy, or package.module:callable (outputs, targets) -> mean loss (with a `reduction` keyword: summed
    # with reduction="sum", and the step takes its mean over the trained targets: docs/loss.md)
    name: str = "cross_entropy"
    args: dict[str, Any] = field(default_factory=dict)  # keyword arguments bound to the loss
    # a language model's cross_entropy with its output layer in this many chunks of tokens, never
    # holding the whole logits (gpt, hf_causal_lm; docs/loss.md): less memory, a larger batch, but a
    # slower step at the same batch on a GPU; 0 = the plain loss (the output layer in the model)
    chunks: int = 0
    # where the plain loss does not fit the GPU and the loss in 8 chunks does (the memory plan at launch),
    # the run takes loss.chunks=8, said in its log, rather than stopping: the same loss and gradients
    chunks_when_needed: bool = True


@dataclass
class TrainConfig:
    epochs: int = 10  # passes over the training set; 0 = no limit (then train.max_steps ends the run)
    max_steps: int = 0  # optimizer steps in all; the run ends at whichever of epochs and max_steps comes first; 0 = off
    batch_size: int = 512  # global: divided evenly over the ranks (causal_lm: sequences of block_size tokens)
    optimizer: Literal["sgd", "adamw"] = "sgd"  # SGD with momentum, or AdamW (fused on CUDA)
    lr: float = 0.4  # peak learning rate for the global batch
    momentum: float = 0.9  # SGD momentum
    nesterov: bool = True  # Nesterov momentum
    beta1: float = 0.9  # AdamW's decay of the gradient average
    beta2: float = 0.95  # AdamW's decay of the squared-gradient average
    weight_decay: float = 5e-4  # not applied to norm weights, biases or embeddings
    label_smoothing: float = 0.2  # of the cross-entropy targets (given to any loss that takes `label_smoothing`)
    warmup_frac: float = 0.15  # linear warm-up over this fraction of the steps, then the decay to min_lr_frac * lr
    schedule: Literal["linear", "cosine"] = "linear"  # shape of the decay after the warm-up
    min_lr_frac: float = 0.0  # the rate at the last step, as a fraction of lr
    # the autocast dtype; fp8: bf16 with the blocks' matrix products in float8 (torchao; docs/float8.md)
    precision: Literal["bf16", "fp16", "fp32", "fp8"] = "bf16"  # bf16 (fp32 on CPU); fp16 with loss scaling; fp32; fp8
    fp8_recipe: Literal["tensorwise", "rowwise"] = "tensorwise"  # fp8 (docs/float8.md): a scale per tensor or per row
    fp8_layers: Literal["auto", "all"] = "auto"  # fp8: auto: the blocks' Linears large enough to gain; all: every one
    clip_grad_norm: float = 0.0  # clip the global gradient norm (after averaging) to this; 0 = off
    grad_accum: int = 1  # micro-steps per optimizer step (communication only on the last)
    ema: float = 0.0  # decay of a per-step average of the weights (ramped up early; frozen ones shared); 0 = off
    eval_every: int = 1  # evaluate every N epochs (0 = at no epoch's end); the run's last step always
    eval_every_steps: int = 0  # also evaluate every N optimizer steps (global), mid-epoch too; 0 = off
    tta: bool = True  # flip test-time augmentation in the final evaluation
    tta_translate: int = 0  # with tta: also views shifted by this many pixels (airbench uses 2)
    seed: int = 0  # seeds model init, data order and augmentation
    cuda_graph: bool = False  # capture the whole training step as one CUDA graph
    compile: Literal["none", "auto", "blocks", "model"] = "none"  # torch.compile per block or whole; true: auto
    compile_backend: str = "inductor"  # torch.compile's backend (aot_eager: no code generation, for checks)
    activation_checkpointing: Literal["none", "full", "selective"] = "none"  # recompute in backward; true: full
    prewarm_steps: int = 5  # on a GPU: steps run, then undone, before the clock (autotuning, graph capture)
    prewarm_eval: bool = True  # on a GPU: one evaluation in the warm-up (its compile); false: at the first evaluation
    cudnn_benchmark: bool = True  # on a GPU: cuDNN tries its algorithms for each convolution (in the warm-up)
    task: Literal["auto", "classification", "causal_lm"] = "auto"  # auto: causal_lm for text/token data or an LM model
    peak_tflops: float = 0.0  # dense bf16 TFLOP/s of one GPU for MFU; 0 = from the GPU's name (none on a CPU)
    sample_tokens: int = 200  # causal_lm: bytes generated from the final model, printed and in summary.json


@dataclass
class DistConfig:
    backend: Literal["auto", "nccl", "gloo"] = "auto"  # auto: NCCL when the process has a GPU
    timeout_s: float = 300.0  # a collective that waits longer fails the job
    mode: Literal["process_per_gpu", "fallback"] = "process_per_gpu"
    bucket_mb: float = 25.0  # gradient bucket size
    comm_groups: int = 2  # communicators the buckets go to round-robin (their all_reduces overlap; 2: BENCHMARKS.md)
    compress: Literal["none", "bf16"] = "none"  # gradient compression for the all_reduce
    shard: Literal["none", "optimizer", "full"] = "none"  # optimizer: ZeRO-1; full: FSDP2 (docs/sharding.md)
    # shard=full: the weight, gradient and optimizer-state shards on the host (FSDP2's CPUOffloadPolicy),
    # each block's copied to the GPU for its forward and backward: for shards that do not fit the GPU
    offload: bool = False
    # shard=full: free each block's gathered weights after its forward (false: keep them until its
    # backward, one all-gather less per step for a block's weights of memory each)
    reshard_after_forward: bool = True
    # shard=full with train.grad_accum > 1: unsharded (the micro-batches' full gradients add up, one
    # reduce-scatter a step) or sharded (a reduce-scatter per micro-batch, only 1/N of the gradients held)
    accumulate: Literal["unsharded", "sharded"] = "unsharded"


@dataclass
class ProfileConfig:
    enabled: bool = False  # torch.profiler on every rank: <out_dir>/profile/trace_rank{R}.json and table_rank{R}.txt
    wait: int = 2  # training steps skipped before profiling
    warmup: int = 2  # steps traced but discarded (the profiler's own start-up)
    active: int = 4  # steps recorded


@dataclass
class WandbConfig:
    """Weights & Biases (needs 'distlib[wandb]'); the W&B run is resumed with the distlib run."""

    enabled: bool = False
    project: str = "distlib"
    entity: str = ""  # "" = the account's default
    group: str = ""
    # auto: WANDB_MODE or W&B's default (online); offline: files in out_dir/wandb, `wandb sync` uploads them
    mode: Literal["auto", "online", "offline", "disabled"] = "auto"


@dataclass
class MLflowConfig:
    """MLflow tracking (needs 'distlib[mlflow]'); the MLflow run is resumed with the distlib run."""

    enabled: bool = False
    tracking_uri: str = ""  # "" = a local store in out_dir (mlflow.db, mlartifacts/); or a server's address
    experiment: str = "distlib"


@dataclass
class RunConfig:
    name: str = ""  # "" = the recipe's file name
    out_dir: str = ""  # "" = runs/<name>; on several nodes a path all of them share (each rank writes checkpoints)
    checkpoint_every: int = 0  # epochs between checkpoints (0 = only at the end)
    checkpoint_every_steps: int = 0  # also a checkpoint every N optimizer steps (global), mid-epoch too; 0 = off
    keep_checkpoints: int = 3
    # where a periodic (background) save copies the GPU state first: spare GPU memory (training waits
    # milliseconds), page-locked host memory (the first save page-locks it), or auto: the GPU when it has room
    checkpoint_staging: Literal["auto", "device", "host"] = "auto"
    # the run's last checkpoint: full (model, optimizer, schedule: a later run resumes from it),
    # weights (the model alone, in <out_dir>/weights, which python -m distlib.runner.export reads), none
    final_checkpoint: Literal["full", "weights", "none"] = "full"
    resume: bool = True  # continue from the newest checkpoint in out_dir
    progress: Literal["auto", "rich", "plain"] = "auto"  # auto: a live bar on a terminal, plain lines otherwise
    # curves.png of the metrics; auto: when matplotlib is installed ('distlib[plots]'), else a line says so
    curves: Literal["auto", "on", "off"] = "auto"
    # the memory plan of the run's step at its start (python -m distlib.runner.plan): auto = on a GPU, where a
    # step that cannot fit is refused before anything is allocated; on = also on a CPU (the verdict only)
    memory_plan: Literal["auto", "on", "off"] = "auto"
    # what the plan's verdict keeps free of the GPU's memory for what it does not count (the CUDA context,
    # NCCL's and cuBLAS's buffers, the allocator's fragmentation, a compiled graph's temporaries): this many
    # GiB plus this fraction of the GPU's memory; a step fits when its planned peak plus both does
    memory_margin_gib: float = 1.0
    memory_margin_fraction: float = 0.03
    tensorboard: bool = False  # also write TensorBoard event files to out_dir (needs 'distlib[tensorboard]')
    wandb: WandbConfig = field(default_factory=lambda: WandbConfig())  # run.wandb=true turns it on
    mlflow: MLflowConfig = field(default_factory=lambda: MLflowConfig())  # run.mlflow=true turns it on
    compile_cache_dir: str = ""  # torch.compile's caches; "" = $TORCHINDUCTOR_CACHE_DIR or ~/.cache/distlib/compile


@dataclass
class Config:
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    run: RunConfig = field(default_factory=RunConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)


class ConfigError(DistlibError, ValueError):
    """All problems found in a recipe and its overrides, one per line."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("invalid configuration:\n" + "\n".join(f"  - {p}" for p in problems))


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if typing.get_origin(tp) is dict:
        return "a mapping of keyword arguments"
    return getattr(tp, "__name__", str(tp))


class _Removed:
    """A command line's ``key=null`` inside a mapping of arguments: the key is removed."""

    def __repr__(self) -> str:
        return "null"


_REMOVED = _Removed()


def _plain(value: Any) -> Any:
    """``value`` with every command-line value inside it read as YAML, ``null`` as ``_REMOVED``."""
    if isinstance(value, _OverrideValue):
        return _REMOVED if value.parsed is None else value.parsed
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


_EXPONENT_FLOAT = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+$")


@dataclass(frozen=True)
class _OverrideValue:
    """A command-line value: read as YAML, but kept as typed for str keys
    (``run.name=no`` is the name "no", not False)."""

    parsed: Any
    raw: str

    def for_type(self, tp: Any) -> Any:
        if typing.get_origin(tp) is dict and self.parsed is None:
            return _REMOVED  # model.args=null: every argument removed
        if tp is str:
            return self.raw
        if typing.get_origin(tp) is Literal and self.parsed not in typing.get_args(tp):
            return self.raw
        return self.parsed

    def __repr__(self) -> str:
        return repr(self.parsed)


def _coerce(value: Any, tp: Any, path: str, problems: list[str]) -> Any:
    """Return ``value`` as ``tp``, or record a problem and return None."""
    if typing.get_origin(tp) is dict:
        value = _plain(value)
        if value is _REMOVED or (isinstance(value, dict) and all(isinstance(k, str) for k in value)):
            return value
    elif typing.get_origin(tp) is Literal:
        if value in typing.get_args(tp):
            return value
    elif tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        number = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):  # YAML's true is no number
            number = float(value)
        elif isinstance(value, str) and _EXPONENT_FLOAT.match(value):
            number = float(value)  # YAML 1.1 reads 1e-3 (no dot) as a string
        if number is not None and math.isfinite(number):  # .nan and .inf would slip past every range check
            return number
        if number is not None:
            problems.append(f"{path}: expected a finite float, got {value!r}")
            return None
    elif tp is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
    problems.append(f"{path}: expected {_type_name(tp)}, got {value!r}")
    return None


# settings whose YAML booleans (true/false, yes/no, on/off) stand for one of their choices
_BOOL_CHOICES = {
    "train.compile": {True: "auto", False: "none"},
    "train.activation_checkpointing": {True: "full", False: "none"},
    "run.curves": {True: "on", False: "off"},
    "run.memory_plan": {True: "on", False: "off"},
}


def _apply(obj: Any, data: Any, prefix: str, problems: list[str]) -> None:
    """Write the mapping ``data`` into the dataclass ``obj``, recording every problem."""
    if isinstance(data, _OverrideValue):
        data = data.parsed
    if not isinstance(data, dict):
        problems.append(f"{prefix or '<top level>'}: expected a mapping of keys, got {data!r}")
        return
    hints = typing.get_type_hints(type(obj))
    names = [f.name for f in dataclasses.fields(obj)]
    for key, value in data.items():
        path = f"{prefix}.{key}" if prefix else str(key)
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            problems.append(f"{path}: unknown key (valid keys here: {', '.join(names)}){hint}")
            continue
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            plain = value.parsed if isinstance(value, _OverrideValue) else value
            if isinstance(plain, bool) and "enabled" in {f.name for f in dataclasses.fields(tp)}:
                value = {"enabled": plain}  # run.wandb=true: a section that is switched on or off
            _apply(getattr(obj, key), value, path, problems)
            continue
        if path in _BOOL_CHOICES:
            plain = value.parsed if isinstance(value, _OverrideValue) else value
            if isinstance(plain, bool):
                value = _BOOL_CHOICES[path][plain]
        if isinstance(value, _OverrideValue):
            value = value.for_type(tp)
        coerced = _coerce(value, tp, path, problems)
        if coerced is _REMOVED:  # model.args=null: every argument removed
            setattr(obj, key, {})
        elif coerced is not None and typing.get_origin(tp) is dict:
            setattr(obj, key, _merged(getattr(obj, key), coerced))  # a.args.b.c=value changes one key of b
        elif coerced is not None:
            setattr(obj, key, coerced)


def _merged(base: dict, update: dict) -> dict:
    """``base`` with ``update``'s keys, mappings merged key by key at every depth (an override of
    ``model.args.config.x`` keeps the config's other keys); any other value replaces. A command
    line's ``key=null`` removes the key, so that what receives the mapping uses its own default (a
    key the recipe set that another model family does not take: ``model.args.config.head_dim=null``);
    a recipe's own ``key: null`` is a value, None."""
    out = dict(base)
    for k, v in update.items():
        if v is _REMOVED:
            out.pop(k, None)
        elif isinstance(v, dict):
            out[k] = _merged(out[k] if isinstance(out.get(k), dict) else {}, v)
        else:
            out[k] = v
    return out


def _parse_override(item: str, problems: list[str]) -> dict | None:
    """``a.b=value`` -> {"a": {"b": value}}, the value read as YAML: a scalar, or a flow mapping or list
    (``model.args.config.rope_parameters={rope_type: llama3, factor: 8.0}``); a key of type str keeps
    the text as it is (``_OverrideValue``)."""
    if "=" not in item:
        problems.append(f"override {item!r}: expected dotted.key=value")
        return None
    key, raw = item.split("=", 1)
    if not key or any(not part for part in key.split(".")):
        problems.append(f"override {item!r}: expected dotted.key=value")
        return None
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    if isinstance(value, (dict, list)) and not raw.lstrip().startswith(("{", "[")):
        value = raw  # "Question: why" or "- x" is text: only a flow mapping or list is read as one
    out: dict = {}
    node = out
    parts = key.split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    node[parts[-1]] = _OverrideValue(value, raw)
    return out


def _validate(cfg: Config, problems: list[str], components: bool = True) -> None:
    """Checks of values that a type alone does not express."""
    positive = {
        "train.epochs": cfg.train.epochs if not cfg.train.max_steps else None,  # 0: max_steps alone ends the run
        "train.batch_size": cfg.train.batch_size,
        "train.grad_accum": cfg.train.grad_accum,
        "profile.active": cfg.profile.active,
        "dist.timeout_s": cfg.dist.timeout_s,
        "dist.bucket_mb": cfg.dist.bucket_mb,
        "dist.comm_groups": cfg.dist.comm_groups,
        "model.width": cfg.model.width,
        "model.num_classes": cfg.model.num_classes,
        "run.keep_checkpoints": cfg.run.keep_checkpoints,
    }
    for path, value in positive.items():
        if value is not None and value <= 0:
            problems.append(f"{path}: must be > 0, got {value!r}")
    non_negative = {
        "train.lr": cfg.train.lr,
        "train.weight_decay": cfg.train.weight_decay,
        "profile.wait": cfg.profile.wait,
        "profile.warmup": cfg.profile.warmup,
        "data.train_subset": cfg.data.train_subset,
        "data.augment.crop_pad": cfg.data.augment.crop_pad,
        "data.augment.cutout": cfg.data.augment.cutout,
        "run.checkpoint_every": cfg.run.checkpoint_every,
        "run.checkpoint_every_steps": cfg.run.checkpoint_every_steps,
        "train.epochs": cfg.train.epochs if cfg.train.max_steps else None,
        "train.max_steps": cfg.train.max_steps,
        "train.eval_every": cfg.train.eval_every,
        "train.eval_every_steps": cfg.train.eval_every_steps,
        "loss.chunks": cfg.loss.chunks,
        "train.prewarm_steps": cfg.train.prewarm_steps,
        "train.tta_translate": cfg.train.tta_translate,
        "train.clip_grad_norm": cfg.train.clip_grad_norm,
        "train.peak_tflops": cfg.train.peak_tflops,
        "train.sample_tokens": cfg.train.sample_tokens,
        "run.memory_margin_gib": cfg.run.memory_margin_gib,
    }
    for path, value in non_negative.items():
        if value is not None and value < 0:
            problems.append(f"{path}: must be >= 0, got {value!r}")
    for path, value in {
        "train.warmup_frac": cfg.train.warmup_frac,
        "train.ema": cfg.train.ema,
        "train.label_smoothing": cfg.train.label_smoothing,
        "train.momentum": cfg.train.momentum,
        "train.beta1": cfg.train.beta1,
        "train.beta2": cfg.train.beta2,
        "train.min_lr_frac": cfg.train.min_lr_frac,
        "run.memory_margin_fraction": cfg.run.memory_margin_fraction,
    }.items():
        if value is not None and not 0.0 <= value < 1.0:
            problems.append(f"{path}: must be in [0, 1), got {value!r}")
    if cfg.train.precision == "fp16" and cfg.train.cuda_graph:
        # a GradScaler decides on the host whether to step; a replayed graph cannot ask it
        problems.append(
            "train.precision=fp16 with train.cuda_graph=true: the fp16 loss scaler cannot run inside a captured "
            "step; use train.precision=bf16 (no scaler needed) or train.cuda_graph=false"
        )
    if cfg.train.precision == "fp8":
        if importlib.util.find_spec("torchao") is None:
            problems.append("train.precision=fp8: the torchao package is not installed; pip install 'distlib[fp8]', "
                            "or set train.precision=bf16")  # fmt: skip
        if cfg.dist.mode == "fallback":
            problems.append("train.precision=fp8 with dist.mode=fallback: the fallback mode's replicas are not "
                            "converted to float8; use dist.mode=process_per_gpu or train.precision=bf16")  # fmt: skip
    for path, wanted, package, extra in (
        ("run.tensorboard", cfg.run.tensorboard, "tensorboard", "tensorboard"),
        ("run.wandb", cfg.run.wandb.enabled, "wandb", "wandb"),
        ("run.mlflow", cfg.run.mlflow.enabled, "mlflow", "mlflow"),
        ("run.curves", cfg.run.curves == "on", "matplotlib", "plots"),
    ):
        if components and wanted and importlib.util.find_spec(package) is None:
            on, off = ("on", "off") if path == "run.curves" else ("true", "false")
            problems.append(f"{path}={on}: the {package} package is not installed; pip install 'distlib[{extra}]', "
                            f"or set {path}={off}")  # fmt: skip
    if components:
        _check_components(cfg, problems)
    _check_sharding(cfg, problems)
    if cfg.train.compile != "none" and cfg.dist.mode == "fallback":
        problems.append(
            f"train.compile={cfg.train.compile} with dist.mode=fallback: the fallback mode's replicas are not "
            "compiled; use dist.mode=process_per_gpu or train.compile=none"
        )
    if cfg.train.activation_checkpointing != "none" and cfg.dist.mode == "fallback":
        problems.append(
            f"train.activation_checkpointing={cfg.train.activation_checkpointing} with dist.mode=fallback: the "
            "fallback mode's replicas are not checkpointed; use dist.mode=process_per_gpu or "
            "train.activation_checkpointing=none"
        )


def _check_sharding(cfg: Config, problems: list[str]) -> None:
    """The settings dist.shard cannot run with (docs/sharding.md, "With the runner")."""
    shard, t, d = cfg.dist.shard, cfg.train, cfg.dist
    if shard != "full":
        defaults = {"offload": False, "reshard_after_forward": True, "accumulate": "unsharded"}
        changed = [f"dist.{k}={str(getattr(d, k)).lower()}" for k, v in defaults.items() if getattr(d, k) != v]
        problems.extend(f"{c} with dist.shard={shard}: it applies to full sharding only; set dist.shard=full or "
                        "leave it out" for c in changed)  # fmt: skip
    if shard == "none":
        return
    if d.mode == "fallback":
        problems.append(f"dist.shard={shard} with dist.mode=fallback: the fallback mode replicates the model on every "
                        "GPU of a node; use dist.mode=process_per_gpu or dist.shard=none")  # fmt: skip
    if t.precision == "fp16":
        # the GradScaler's inf/nan check would read this rank's shard only: the ranks could disagree on a skip
        problems.append(f"train.precision=fp16 with dist.shard={shard}: the fp16 loss scaler cannot check sharded "
                        "gradients; use train.precision=bf16 (no scaler) or fp32, or dist.shard=none")  # fmt: skip
    if shard != "full":
        return
    if t.cuda_graph:
        problems.append("train.cuda_graph=true with dist.shard=full: FSDP2 has no CUDA-graph support "
                        "(pytorch/pytorch#164264); set train.cuda_graph=false, or use dist.shard=optimizer, "
                        "whose whole step can be one CUDA graph")  # fmt: skip
    if t.compile == "model":
        problems.append("train.compile=model with dist.shard=full: a fully sharded model is compiled per block; "
                        "set train.compile=blocks (or true)")  # fmt: skip
    if t.ema > 0:
        problems.append("train.ema > 0 with dist.shard=full: the weight average is a whole copy of the model on "
                        "every rank; set train.ema=0, or use dist.shard=optimizer")  # fmt: skip
    if d.compress != "none":
        problems.append(f"dist.compress={d.compress} with dist.shard=full: FSDP2 reduce-scatters the gradients in "
                        "fp32 (bf16 weights with train.precision=bf16); set dist.compress=none")  # fmt: skip


def task_of(cfg: Config) -> str:
    """train.task, with "auto" resolved: causal_lm for byte_text or token_file data or a language model
    (gpt, hf_causal_lm), else classification."""
    if cfg.train.task != "auto":
        return cfg.train.task
    lm = cfg.data.name in LM_DATA or cfg.model.name in LM_MODELS
    return "causal_lm" if lm else "classification"


LM_DATA = ("byte_text", "token_file", "chat")  # the built-in language-model data sets
LM_MODELS = ("gpt", "hf_causal_lm")  # the built-in language models


# the keyword arguments the runner gives a component that takes them (runner/tasks/task.py), so a
# component may need them without the recipe's args naming them
PROVIDED = {
    "model": ("num_classes", "width", "vocab_size", "block_size"),
    "data": ("root", "download", "cache_dir", "pretrained"),
    "loss": ("label_smoothing",),
}


def _check_components(cfg: Config, problems: list[str]) -> None:
    """Each named component resolves and takes the recipe's arguments (runner/components.py)."""
    from distlib.runner import components

    for key, section in (("model", cfg.model), ("data", cfg.data), ("loss", cfg.loss)):
        provided = dict.fromkeys(PROVIDED[key])
        components.check(key, key, section.name, section.args, problems, provided=provided,
                         positional=2 if key == "loss" else 0)  # fmt: skip
    for path, name, package, what in (
        ("model.name", cfg.model.name, "torchvision", "resnet18_cifar"),
        ("data.name", cfg.data.name, "PIL", "image_folder"),
    ):
        if name == what and importlib.util.find_spec(package) is None:
            problems.append(f"{path}={name} needs the images extra ({package} is not installed): "
                            "pip install 'distlib[images]'")  # fmt: skip
    task = task_of(cfg)
    if task == "causal_lm" and cfg.data.name == "image_folder":
        problems.append("train.task=causal_lm with data.name=image_folder: a language model trains on text; "
                        "set data.name=byte_text and data.root to a .txt or .txt.gz file")  # fmt: skip
    if task == "classification" and cfg.data.name in LM_DATA:
        problems.append(f"train.task=classification with data.name={cfg.data.name}: {cfg.data.name} is language-model "
                        "data; use train.task=causal_lm (or auto)")  # fmt: skip
    if cfg.data.name == "token_file" and cfg.model.name == "gpt" and "vocab_size" not in cfg.model.args:
        problems.append("model.args.vocab_size: needed with data.name=token_file (the tokenizer's vocabulary size; "
                        "the gpt's default of 256 is byte_text's)")  # fmt: skip
    if cfg.data.name == "chat":  # what packed documents need of the model
        from distlib.runner.data.chat_recipe import chat_problems

        problems.extend(chat_problems(cfg.data.args, cfg.model.name, cfg.model.args, cfg.dist.mode))
    hf_config = cfg.model.args.get("config")
    if cfg.data.name == "token_file" and cfg.model.name == "hf_causal_lm" and isinstance(hf_config, dict):
        if "vocab_size" not in hf_config:
            problems.append("model.args.config.vocab_size: needed with data.name=token_file (the tokenizer's "
                            "vocabulary size; the config class's default is some other model's)")  # fmt: skip


def _check_device(cfg: Config, problems: list[str]) -> None:
    """What the device this process trains on cannot run: the device ``distlib.init`` binds, a CUDA GPU
    with dist.backend nccl, or auto where one is visible, else the CPU."""
    import torch

    cuda = cfg.dist.backend == "nccl" or (cfg.dist.backend == "auto" and torch.cuda.is_available())
    attn = cfg.model.args.get("attn_implementation") if cfg.model.name == "hf_causal_lm" else None
    if attn == "flex_attention" and not cuda:
        why = "dist.backend=gloo" if torch.cuda.is_available() else "no CUDA GPU is visible"
        problems.append(f"model.args.attn_implementation=flex_attention: torch's flex attention has no backward on "
                        f"the CPU, where this run would train ({why}); use sdpa or eager (auto: the fastest the "
                        "family allows), or train on CUDA GPUs")  # fmt: skip


def load_config(
    recipe: str | os.PathLike | None, overrides: list[str] = (), check_components: bool = True, launch: bool = False
) -> Config:
    """Build the run config from a YAML recipe (or defaults) and CLI overrides.

    Raises ConfigError listing every problem found. ``check_components=False`` leaves out the checks
    of what running it needs on this machine (the named data set, model and loss: their files and
    imports; the extras its outputs need): a finished run's config, read for its values (the export)
    where those may be gone. ``launch``: the run trains in this process: also what its device cannot
    run (a config read to plan another machine's run, or to look at, is not refused for it).
    """
    problems: list[str] = []
    cfg = Config()
    name = ""
    if recipe is not None:
        name = os.path.splitext(os.path.basename(os.fspath(recipe)))[0]
        try:
            with open(recipe) as f:
                data = yaml.safe_load(f)
        except FileNotFoundError:
            problems.append(f"recipe {os.fspath(recipe)!r}: no such file")
            data = None
        except IsADirectoryError:
            problems.append(f"recipe {os.fspath(recipe)!r}: is a directory, expected a YAML file")
            data = None
        except yaml.YAMLError as e:
            problems.append(f"recipe {os.fspath(recipe)!r}: malformed YAML: {e}".replace("\n", " "))
            data = None
        if data is not None:
            _apply(cfg, data, "", problems)
    for item in overrides:
        parsed = _parse_override(item, problems)
        if parsed is not None:
            _apply(cfg, parsed, "", problems)
    _validate(cfg, problems, components=check_components)
    if launch:
        _check_device(cfg, problems)
    if problems:
        raise ConfigError(problems)
    if not cfg.run.name:
        cfg.run.name = name or "default"
    if not cfg.run.out_dir:
        cfg.run.out_dir = os.path.join("runs", cfg.run.name)
    return cfg


def to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)


def dump_yaml(cfg: Config) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


# ---- docs/configuration.md is generated from the dataclasses above -----------------------------

CONFIGURATION_DOC = "docs/configuration.md"  # relative to the repository root

_CONFIGURATION_INTRO = """\
# Configuration reference

<!-- Generated from distlib/runner/config.py by `make reference`; do not edit by hand. -->

Recipes are YAML files that hold only what differs from the defaults below; `a.b=value` on the
command line overrides them, with the value converted to the key's type (`train.lr=1e-3`,
`data.download=true`, `run.name=no` is the string "no"); inside a mapping of arguments an override
changes one key at any depth (`model.args.config.num_key_value_heads=1` keeps the config's other
keys), a value may be a YAML flow mapping or list (`model.args.config.rope_parameters={rope_type:
llama3, factor: 8.0}`, merged into the recipe's mapping as the dotted form is), and `key=null`
removes a key, so that what receives the mapping uses its own default (`model.args.config=null`;
`model.args.config.head_dim=null`, a key the recipe sets that another model family does not take).
A recipe's own `key: null` is a value: None. Every problem in a recipe and its
overrides is reported at once, before any process group starts and before anything is written,
and the command exits with status 2. `python -m distlib.runner.config RECIPE [a.b=value ...]`
checks a recipe and prints the resolved config.

This page is generated from the config's dataclasses (`make reference` rewrites it; a test checks
that it is current).

"""


def _field_comments(cls: type) -> dict[str, str]:
    """The comment after each field's definition: the reference's descriptions."""
    lines, _ = inspect.getsourcelines(cls)
    out = {}
    for line in lines:
        m = re.match(r"\s+(\w+):[^#]*#\s*(.*)$", line)
        if m:
            out[m.group(1)] = m.group(2).strip()
    return out


def _show_type(tp: Any) -> str:
    if typing.get_origin(tp) is Literal:
        return "one of " + ", ".join(f"`{a}`" for a in typing.get_args(tp))
    if typing.get_origin(tp) is dict:
        return "mapping"
    return tp.__name__


def _show_default(value: Any) -> str:
    if isinstance(value, str):
        return f'`"{value}"`'
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    return f"`{value}`"


def reference_table() -> str:
    """The markdown table of every config key: dotted key, type, default, meaning."""
    rows = ["| key | type | default | meaning |", "|---|---|---|---|"]

    def walk(obj: Any, prefix: str) -> None:
        hints = typing.get_type_hints(type(obj))
        comments = _field_comments(type(obj))
        for f in dataclasses.fields(obj):
            path = f"{prefix}.{f.name}" if prefix else f.name
            value = getattr(obj, f.name)
            if dataclasses.is_dataclass(hints[f.name]):
                walk(value, path)
            else:
                meaning = comments.get(f.name, "").replace("|", "\\|").replace("<", "\\<")
                rows.append(f"| `{path}` | {_show_type(hints[f.name])} | {_show_default(value)} | {meaning} |")

    walk(Config(), "")
    return "\n".join(rows) + "\n"


def configuration_page() -> str:
    """The whole of docs/configuration.md: a short introduction, then the reference table."""
    return _CONFIGURATION_INTRO + reference_table()


def write_configuration_page(path: str) -> bool:
    """Write ``configuration_page()`` to ``path``; True when the file changed."""
    new = configuration_page()
    try:
        with open(path) as f:
            if f.read() == new:
                return False
    except FileNotFoundError:
        pass
    with open(path, "w") as f:
        f.write(new)
    return True


def main(argv: list[str] | None = None) -> int:
    import argparse
    import sys

    p = argparse.ArgumentParser(
        prog="python -m distlib.runner.config",
        description="Validate a recipe and print the resolved config, or print the config reference.",
    )
    p.add_argument("recipe", nargs="?", help="YAML recipe to validate")
    p.add_argument("overrides", nargs="*", help="dotted.key=value overrides")
    p.add_argument("--reference", action="store_true", help="print the markdown table of every key")
    p.add_argument("--write-docs", metavar="PATH", help=f"write the configuration page ({CONFIGURATION_DOC}) to PATH")
    args = p.parse_args(argv)
    if args.reference:
        sys.stdout.write(reference_table())
        return 0
    if args.write_docs:
        changed = write_configuration_page(args.write_docs)
        print(f"{args.write_docs}: {'updated' if changed else 'already up to date'}")
        return 0
    try:
        cfg = load_config(args.recipe, args.overrides)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    sys.stdout.write(dump_yaml(cfg))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
