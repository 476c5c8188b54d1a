"""Hugging Face ``transformers`` causal language models in recipes: ``model.name: hf_causal_lm``.

    model:
      name: hf_causal_lm
      args:
        config: {model_type: llama, hidden_size: 256, num_hidden_layers: 4, ...}   # built from a config
        # or: pretrained: path/to/folder   (config.json + model.safetensors, or sharded with its index)
      block_class: LlamaDecoderLayer       # optional: the model's _no_split_modules by default

The model (``HFCausalLM``) wraps the transformers model and returns its logits only, so the
runner's loss, precision, sharding, compile and checkpoints apply as to the built-in GPT. Its
``blocks`` (the layers its ``_no_split_modules`` names, e.g. ``LlamaDecoderLayer``; the recipe's
``model.block_class`` instead when set) are the units that full sharding wraps one by one and
per-block compile and activation checkpointing use (``distlib.find_blocks``). A pretrained model
is built without initialisation and its weights are read once it is on its device
(``load_pretrained``, called by the runner): under ``dist.shard=full`` after sharding, every
rank reading only the rows of its shards (runner/hf/safetensors_folder.py).

transformers is an optional extra (``pip install 'distlib[hf]'``): imported only when a recipe
names this model. Design: docs/huggingface.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import inspect
import os
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from distlib import find_blocks
from distlib.runner.config import ConfigError

EXTRA = "pip install 'distlib[hf]' (transformers and safetensors)"


def _transformers() -> Any:
    """The transformers module; a ConfigError naming the extra when it (or safetensors) is missing."""
    try:
        import safetensors  # noqa: F401
        import transformers
    except ImportError as e:
        raise ConfigError([f"model.name=hf_causal_lm needs the Hugging Face extra: {EXTRA} ({e})"]) from e
    return transformers


def _config_fields(config_class: type) -> set[str]:
    """The keys a transformers config class takes (its dataclass fields or constructor arguments)."""
    if dataclasses.is_dataclass(config_class):
        return {f.name for f in dataclasses.fields(config_class)}
    names: set[str] = set()
    for cls in config_class.__mro__:
        if "__init__" in vars(cls):
            names |= set(inspect.signature(cls.__init__).parameters) - {"self", "kwargs"}
    return names


def build_config(config: Mapping[str, Any], problems: list[str] | None = None) -> Any:
    """The transformers config of ``model.args.config`` (``model_type`` and the class's keys).
    Mistakes go to ``problems`` when given (and None is returned), else raise ConfigError."""
    own: list[str] = []
    transformers = _transformers()
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    cfg = None
    model_type = config.get("model_type")
    kwargs = {k: v for k, v in config.items() if k != "model_type"}
    if not isinstance(model_type, str):
        own.append("model.args.config: needs model_type (e.g. model_type: llama), the transformers model family")
    elif model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        close = difflib.get_close_matches(model_type, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        own.append(f"model.args.config.model_type: {model_type!r} is no causal language model transformers "
                   f"{transformers.__version__} knows{hint}")  # fmt: skip
    else:
        try:
            cfg = transformers.AutoConfig.for_model(model_type, **kwargs)
        except Exception as e:  # the config class's own checks (head counts, rope parameters)
            own.append(f"model.args.config: {type(e).__name__}: {e}")
        if cfg is not None:
            fields = _config_fields(type(cfg))
            for key in kwargs:
                # a key the class does not take stays as a plain attribute (a typo); older names that
                # the class converts (rope_theta into rope_parameters) do not
                if key not in fields and key in vars(cfg):
                    close = difflib.get_close_matches(key, sorted(fields), n=1)
                    hint = f"; did you mean {close[0]!r}?" if close else ""
                    own.append(f"model.args.config.{key}: {type(cfg).__name__} has no key {key!r}{hint}")
    if problems is not None:
        problems.extend(own)
        return None if own else cfg
    if own:
        raise ConfigError(own)
    return cfg


def check_args(args: Mapping[str, Any]) -> list[str]:
    """The mistakes in ``model.args`` of ``hf_causal_lm``, found when the recipe is loaded."""
    problems: list[str] = []
    try:
        _transformers()
    except ConfigError as e:
        return e.problems
    config, pretrained = args.get("config"), args.get("pretrained") or ""
    if (config is None) == (not pretrained):
        problems.append("model.args: hf_causal_lm needs exactly one of config (a mapping with model_type: build "
                        "a new model) or pretrained (a local folder: config.json and safetensors)")  # fmt: skip
    elif config is not None:
        build_config(config, problems)
    else:
        from distlib.runner.hf.safetensors_folder import SafetensorsError, weight_files

        if not os.path.isfile(os.path.join(pretrained, "config.json")):
            problems.append(f"model.args.pretrained: {pretrained!r} has no config.json (a folder that "
                            "save_pretrained wrote, with its safetensors)")  # fmt: skip
        else:
            try:
                weight_files(pretrained)
                _transformers().AutoConfig.from_pretrained(pretrained, local_files_only=True)
            except SafetensorsError as e:
                problems.append(f"model.args.pretrained: {e}")
            except (OSError, ValueError) as e:  # a damaged or foreign config.json: transformers' own words
                first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
                problems.append(f"model.args.pretrained: {pretrained!r}: its config.json cannot be read: {first}")
    return problems


class HFCausalLM(nn.Module):
    """``logits = model(idx)``: a transformers causal LM (``self.hf``) called with ``input_ids``,
    returning ``.logits`` only; idx (batch, time) token ids, logits (batch, time, vocab)."""

    def __init__(self, hf: nn.Module, *, pretrained: str = ""):
        super().__init__()
        self.hf = hf
        self.pretrained = pretrained
        # transformers' list of the layers not to split over devices: its repeated blocks
        self.block_names = tuple(sorted(getattr(hf, "_no_split_modules", None) or ()))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.hf(input_ids=idx, use_cache=False).logits

    @property
    def config(self) -> Any:
        return self.hf.config

    @property
    def blocks(self) -> nn.ModuleList:
        """The layers ``_no_split_modules`` names, outermost first in model order: the units that
        full sharding wraps one by one. A view, not registered: the state dict is the model's."""
        return nn.ModuleList(find_blocks(self.hf, self.block_names) if self.block_names else [])

    def tie_weights(self) -> None:
        """The output layer shares the input embedding when the config ties them (again after
        ``to_empty()``)."""
        self.hf.tie_weights()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """transformers' own initialisation (``initialize_weights``) of every parameter: what a
        model whose parameters were on the meta device runs once its storage exists."""
        for m in self.hf.modules():  # every module again: to_empty() left their storage uninitialised
            m._is_hf_initialized = False
        for p in self.hf.parameters():
            p._is_hf_initialized = False
        self.hf.initialize_weights()
        self.hf.tie_weights()

    def load_pretrained(self) -> int:
        """The pretrained folder's weights into the parameters, where they are: whole, or this
        rank's shards once the model is fully sharded (each rank reading only their rows); the
        runner calls it once the model is built (and sharded). Returns the bytes this rank read;
        0 for a model built from a config."""
        if not self.pretrained:
            return 0
        from distlib.runner.hf.safetensors_folder import read_into

        return read_into(self.hf, self.pretrained)

    def num_params(self, embeddings: bool = True) -> int:
        """Parameters, a tied matrix counted once; without ``embeddings``: less the input embedding
        when it is not the output layer too (a lookup, no matrix product)."""
        n = sum(p.numel() for p in self.parameters())
        if embeddings:
            return n
        emb, out = self.hf.get_input_embeddings(), self.hf.get_output_embeddings()
        tied = out is not None and out.weight is emb.weight
        return n if tied else n - emb.weight.numel()

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token, counted as for the built-in GPT: 6 per weight of the matrix
        products (the output layer included, tied or not; not an untied input embedding) and
        12 * layers * (heads * head_dim) * seq_len for attention's scores and weighted values."""
        c = self.hf.config.get_text_config()
        heads = getattr(c, "num_attention_heads", 0) or 0
        head_dim = getattr(c, "head_dim", None) or (c.hidden_size // heads if heads else 0)
        layers = getattr(c, "num_hidden_layers", 0) or 0
        return 6 * self.num_params(embeddings=False) + 12 * layers * heads * head_dim * seq_len


def hf_causal_lm(
    config: dict | None = None,
    pretrained: str = "",
    attn_implementation: str = "sdpa",
    vocab_size: int | None = None,
) -> HFCausalLM:
    """A transformers causal LM from ``config`` (``model_type`` and the config class's keys; the
    vocabulary the data's when it gives none), or from the local folder ``pretrained``
    (``config.json`` and safetensors). ``attn_implementation``: transformers' attention kernel
    (``sdpa``: torch's scaled_dot_product_attention, flash attention on GPUs). ``vocab_size``: the
    data's (given by the runner), checked against the model's. Built in fp32 (the runner's
    precision casts) in the current default device; a pretrained model uninitialised:
    ``load_pretrained()`` reads its weights (the runner calls it once the model is on its device,
    and sharded)."""
    transformers = _transformers()
    if (config is None) == (not pretrained):
        raise ConfigError(["model.args: hf_causal_lm needs exactly one of config or pretrained"])
    if pretrained:
        try:
            hf_config = transformers.AutoConfig.from_pretrained(pretrained, local_files_only=True)
        except (OSError, ValueError) as e:  # missing, damaged or foreign config.json: transformers' own words
            first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
            raise ConfigError([f"model.args.pretrained={pretrained!r}: its config.json cannot be read: {first}"]) from e
    else:
        config = dict(config)
        if vocab_size is not None and "vocab_size" not in config:
            config["vocab_size"] = vocab_size
        hf_config = build_config(config)
    if vocab_size is not None and hf_config.get_text_config().vocab_size < vocab_size:
        raise ConfigError([f"model.args: the model's vocabulary ({hf_config.get_text_config().vocab_size}) is "
                           f"smaller than the data's ({vocab_size} token ids)"])  # fmt: skip
    hf_config.use_cache = False  # training: no key/value cache
    # pretrained: its weights replace the initialisation, which is skipped
    skip_init = _no_init_weights() if pretrained else contextlib.nullcontext()
    with skip_init:
        hf = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32,
                                                           attn_implementation=attn_implementation)  # fmt: skip
    hf.tie_weights()  # skipped with the initialisation
    return HFCausalLM(hf, pretrained=pretrained)


def _no_init_weights() -> contextlib.AbstractContextManager:
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # elsewhere in older releases
        from transformers.modeling_utils import no_init_weights
    return no_init_weights()


hf_causal_lm.check_args = check_args  # components.check calls it when the recipe is loaded

__all__ = ["HFCausalLM", "build_config", "check_args", "hf_causal_lm"]
