"""LoRA adapters on a ``hf_causal_lm`` model through peft: ``model.args.lora``.

    model:
      name: hf_causal_lm
      args:
        pretrained: path/to/Llama-3.1-8B
        lora: {r: 16, alpha: 32, dropout: 0.0, target_modules: all-linear}

peft's own layers are injected into the transformers model (``peft.inject_adapter_in_model``): each
targeted Linear becomes peft's ``lora.Linear`` holding the frozen Linear as ``base_layer`` and the
adapters ``lora_A.default`` / ``lora_B.default``; every other parameter is frozen
(``requires_grad=False``). The model stays the transformers model (no ``PeftModel`` wrapper), so its
blocks, its compile, checkpointing, sharding and float8 apply as without adapters; only the names of
the targeted Linears' weights gain ``.base_layer``, which ``base_names`` takes away again for the
reads of a pretrained folder and for the merged export.

The adapters are initialised as peft does (A Kaiming-uniform, B zero: the model starts as the base),
but drawn whole on the CPU from a generator of their own seeded with the run's seed (``init_adapters``),
each rank keeping its rows: the same adapters in every ``dist.shard`` mode, at every world size,
whether the base is built from a config or read from a folder. Saved as peft saves them
(``save_adapters``: ``adapter_config.json`` and ``adapter_model.safetensors``, written by peft's
``save_pretrained``) and merged into the base on one process's CPU (``merged_model``). Design:
docs/adapters.md.

peft is an optional extra (``pip install 'distlib[peft]'``), imported only when a recipe asks for LoRA.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

EXTRA = "pip install 'distlib[peft]'"
ADAPTER = "default"  # peft's name of the one adapter
# model.args.lora's keys, their defaults; r and alpha as peft's LoraConfig defaults
DEFAULTS: dict[str, Any] = {"r": 8, "alpha": 8, "dropout": 0.0, "target_modules": "all-linear"}


def _peft() -> Any:
    try:
        import peft
    except ImportError as e:
        from distlib.runner.config import ConfigError

        raise ConfigError([f"model.args.lora needs peft: {EXTRA} ({e})"]) from e
    return peft


def check(spec: Any) -> list[str]:
    """The mistakes in ``model.args.lora`` (all of them), peft's absence included."""
    if not isinstance(spec, Mapping):
        return [f"model.args.lora: expected a mapping {{r, alpha, dropout, target_modules}}, got {spec!r}"]
    problems = [f"model.args.lora.{k}: unknown key (expected {', '.join(DEFAULTS)})" for k in spec if k not in DEFAULTS]
    s = {**DEFAULTS, **spec}
    if isinstance(s["r"], bool) or not isinstance(s["r"], int) or s["r"] < 1:
        problems.append(f"model.args.lora.r: expected an integer >= 1 (the adapters' rank), got {s['r']!r}")
    if isinstance(s["alpha"], bool) or not isinstance(s["alpha"], (int, float)) or s["alpha"] <= 0:
        problems.append(f"model.args.lora.alpha: expected a number > 0 (the scale is alpha / r), got {s['alpha']!r}")
    d = s["dropout"]
    if isinstance(d, bool) or not isinstance(d, (int, float)) or not 0 <= d < 1:
        problems.append(f"model.args.lora.dropout: expected a number in [0, 1), got {d!r}")
    t = s["target_modules"]
    if not (isinstance(t, str) and t) and not (isinstance(t, list) and t and all(isinstance(x, str) for x in t)):
        problems.append("model.args.lora.target_modules: expected 'all-linear' or a list of module names "
                        f"(e.g. [q_proj, v_proj]), got {t!r}")  # fmt: skip
    if not problems:
        try:
            _peft()
        except Exception as e:  # ConfigError: its one line
            problems.extend(getattr(e, "problems", [str(e)]))
    return problems


def lora_config(spec: Mapping[str, Any]) -> Any:
    """peft's ``LoraConfig`` of ``model.args.lora`` (a new one each time: peft expands
    ``all-linear`` into module names in place)."""
    s = {**DEFAULTS, **spec}
    target = s["target_modules"]
    return _peft().LoraConfig(r=s["r"], lora_alpha=s["alpha"], lora_dropout=float(s["dropout"]),
                              target_modules=list(target) if isinstance(target, list) else target,
                              task_type="CAUSAL_LM")  # fmt: skip


def inject(hf: nn.Module, spec: Mapping[str, Any]) -> None:
    """peft's LoRA layers into the transformers model ``hf`` in place, every other parameter frozen.
    The adapters keep the dtype of their base layer (the runner builds in fp32): no upcast of their
    own (peft's ``autocast_adapter_dtype`` is ``get_peft_model``'s), so under full sharding every
    trainable parameter of a block has the one dtype FSDP2 asks for."""
    from distlib.runner.config import ConfigError

    try:
        if any(_fake(p) for p in hf.parameters()):
            _on_fake_tensors(hf, spec)
        else:
            _peft().inject_adapter_in_model(lora_config(spec), hf, adapter_name=ADAPTER)
    except ValueError as e:  # no module matched target_modules: peft's words
        raise ConfigError([f"model.args.lora.target_modules: {' '.join(str(e).split())[:300]}"]) from e


def _fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


def _on_fake_tensors(hf: nn.Module, spec: Mapping[str, Any]) -> None:
    """The injection on a model of fake tensors (the memory plan): peft moves each new adapter to its
    base layer's device and dtype with ``Module.to`` although it is there already (built beside it, in
    its dtype), and on fake tensors ``Module.to`` swaps every tensor, which torch refuses for tensors
    the fake mode references; here a ``to`` that would change nothing returns the module as it is."""
    real = nn.Module.to

    def to(self: nn.Module, *args: Any, **kwargs: Any) -> nn.Module:
        device, dtype, *_ = torch._C._nn._parse_to(*args, **kwargs)
        tensors = [*self.parameters(), *self.buffers()]
        if all((device is None or t.device == device) and (dtype is None or not t.is_floating_point()
                                                            or t.dtype == dtype) for t in tensors):  # fmt: skip
            return self
        return real(self, *args, **kwargs)

    nn.Module.to = to  # type: ignore[method-assign]
    try:
        _peft().inject_adapter_in_model(lora_config(spec), hf, adapter_name=ADAPTER)
    finally:
        nn.Module.to = real  # type: ignore[method-assign]


def adapters(model: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    """The adapters' parameters of ``model``, by name, in model order."""
    for name, p in model.named_parameters():
        if f".lora_A.{ADAPTER}." in name or f".lora_B.{ADAPTER}." in name:
            yield name, p


def _lora_layers(model: nn.Module) -> list[tuple[nn.Module, str, nn.Module]]:
    """(parent, attribute, layer) of every peft LoRA layer in ``model``."""
    found = []
    for parent in model.modules():
        for attr, child in parent.named_children():
            if hasattr(child, "base_layer") and hasattr(child, "lora_A"):
                found.append((parent, attr, child))
    return found


@contextlib.contextmanager
def base_names(model: nn.Module) -> Iterator[nn.Module]:
    """``model`` seen without its adapters: every LoRA layer replaced in its parent by its base
    Linear for the duration (the same parameters, under the names of the model without adapters),
    so that a pretrained folder's names and transformers' conversions apply as they are."""
    layers = _lora_layers(model)
    for parent, attr, layer in layers:
        setattr(parent, attr, layer.base_layer)
    try:
        yield model
    finally:
        for parent, attr, layer in layers:
            setattr(parent, attr, layer)


@torch.no_grad()
def init_adapters(model: nn.Module, seed: int) -> None:
    """Every adapter initialised as peft does (A: Kaiming-uniform with a = sqrt(5), B: zero), A drawn
    whole on the CPU from a generator seeded with ``seed``, in the model's order of the adapters;
    each rank copies its rows (a DTensor shard of FSDP2: its part, cut as FSDP2 cuts it)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    g = torch.Generator().manual_seed(seed)
    for name, p in adapters(model):
        whole = torch.zeros(p.shape, dtype=torch.float32)
        if f".lora_A.{ADAPTER}." in name:
            bound = 1.0 / math.sqrt(p.shape[1])  # kaiming_uniform_(a=sqrt(5)) of a (r, in) weight
            whole.uniform_(-bound, bound, generator=g)
        if isinstance(p, DTensor):
            part = distribute_tensor(whole.to(p.device_mesh.device_type), p.device_mesh, p.placements,
                                     src_data_rank=None).to_local()  # fmt: skip
            p.to_local().copy_(part)
        else:
            p.copy_(whole)


def _meta_peft_model(hf_config: Any, spec: Mapping[str, Any]) -> Any:
    """peft's ``PeftModel`` around the model of ``hf_config`` built on the meta device (names only)."""
    import transformers

    with torch.device("meta"):
        base = transformers.AutoModelForCausalLM.from_config(hf_config)
        return _peft().get_peft_model(base, lora_config(spec), autocast_adapter_dtype=False)


def _peft_names(model_names: list[str]) -> dict[str, str]:
    """The transformers model's adapter names (``...q_proj.lora_A.default.weight``) -> the
    ``PeftModel``'s (``base_model.model....q_proj.lora_A.default.weight``)."""
    return {n: f"base_model.model.{n}" for n in model_names}


def save_adapters(hf_config: Any, spec: Mapping[str, Any], tensors: Mapping[str, torch.Tensor], out_dir: str,
                  base: str = "") -> list[str]:  # fmt: skip
    """The adapters ``tensors`` (the transformers model's names, whole, on the CPU) into ``out_dir``
    as peft writes them: peft's ``save_pretrained`` of a ``PeftModel`` holding them
    (``adapter_config.json`` with ``base_model_name_or_path=base``, ``adapter_model.safetensors``
    under peft's key names). Returns the files written."""
    import os

    model = _meta_peft_model(hf_config, spec)
    model.load_state_dict({v: tensors[k] for k, v in _peft_names(list(tensors)).items()}, strict=False, assign=True)
    left = [n for n, p in model.named_parameters() if p.requires_grad and p.device.type == "meta"]
    if left:
        raise ValueError(f"the checkpoint lacks {len(left)} adapter tensor(s): {', '.join(left[:3])}")
    model.peft_config[ADAPTER].base_model_name_or_path = base or None
    model.save_pretrained(out_dir)
    return sorted(os.listdir(out_dir))


def merged_model(base: nn.Module, spec: Mapping[str, Any], tensors: Mapping[str, torch.Tensor]) -> nn.Module:
    """The transformers model ``base`` (whole, on the CPU) with the adapters ``tensors`` merged into
    its weights (peft's ``merge_and_unload``): a plain transformers model again."""
    model = _peft().get_peft_model(base, lora_config(spec), autocast_adapter_dtype=False)
    missing = model.load_state_dict({v: tensors[k] for k, v in _peft_names(list(tensors)).items()}, strict=False)
    left = [k for k in missing.missing_keys if ".lora_" in k]
    if left:
        raise ValueError(f"the checkpoint lacks {len(left)} adapter tensor(s): {', '.join(left[:3])}")
    return model.merge_and_unload()


__all__ = ["DEFAULTS", "EXTRA", "adapters", "base_names", "check", "init_adapters", "inject", "lora_config",
           "merged_model", "save_adapters"]  # fmt: skip
