"""Hugging Face ``transformers`` causal language models in recipes: ``model.name: hf_causal_lm``.

    model:
      name: hf_causal_lm
      args:
        config: {model_type: llama, hidden_size: 256, num_hidden_layers: 4, ...}   # built from a config
        # or: pretrained: path/to/folder   (config.json + model.safetensors, or sharded with its index)
      block_class: LlamaDecoderLayer       # optional: the model's _no_split_modules by default

The model (``HFCausalLM``) wraps the transformers model and returns its logits (a mixture of
experts in training: its logits and its router's load-balancing loss, which the causal-LM task adds
at the config's ``router_aux_loss_coef``), so the runner's loss, precision, sharding, compile and
checkpoints apply as to the built-in GPT. ``attn_implementation`` defaults to the fastest the family
allows (``attention``), and the recipe's check builds the model class on the meta device, so that
what transformers refuses is a config error before any rank starts. Its
``blocks`` (the layers its ``_no_split_modules`` names, e.g. ``LlamaDecoderLayer``; the recipe's
``model.block_class`` instead when set) are the units that full sharding wraps one by one and
per-block compile and activation checkpointing use (``distlib.find_blocks``). A pretrained model
is built without initialisation and its weights are read once it is on its device
(``load_pretrained``, called by the runner): under ``dist.shard=full`` after sharding, every
rank reading only the rows of its shards, in either of transformers' save formats
(runner/hf/safetensors_folder.py, runner/hf/weight_names.py).

transformers is an optional extra (``pip install 'distlib[hf]'``): imported only when a recipe
names this model. Design: docs/huggingface.md.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import difflib
import inspect
import os
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
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
            own.append(f"model.args.config: {type(e).__name__}: {' '.join(str(e).split())}")  # one line
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
    hf_config = None
    if config is not None and pretrained:
        problems.append(f"model.args: hf_causal_lm takes one of config or pretrained, not both: {BOTH}")
    elif config is None and not pretrained:
        problems.append("model.args: hf_causal_lm needs one of config (a mapping with model_type: build a new "
                        "model) or pretrained (a local folder: config.json and safetensors)")  # fmt: skip
    elif config is not None:
        hf_config = build_config(config, problems)
    else:
        from distlib.runner.hf.safetensors_folder import SafetensorsError, weight_files

        if not os.path.isfile(os.path.join(pretrained, "config.json")):
            problems.append(f"model.args.pretrained: {pretrained!r} has no config.json (a folder that "
                            "save_pretrained wrote, with its safetensors)")  # fmt: skip
        else:
            try:
                weight_files(pretrained)
                hf_config = _transformers().AutoConfig.from_pretrained(pretrained, local_files_only=True)
            except SafetensorsError as e:
                problems.append(f"model.args.pretrained: {e}")
            except Exception as e:  # a damaged or foreign config.json: transformers' own words
                problems.append(
                    f"model.args.pretrained: {pretrained!r}: its config.json cannot be read: {_first_line(e)}"
                )
    if hf_config is not None:
        problems.extend(_meta_build(hf_config, args.get("attn_implementation", "auto")))
    if args.get("lora") is not None:
        from distlib.runner.models import lora

        problems.extend(lora.check(args["lora"]))
    return problems


# how to drop one of config and pretrained when a recipe has one and the command line gives the other
BOTH = "drop one on the command line with model.args.config=null or model.args.pretrained=null"


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0] if lines else ''}"


def attention(hf_config: Any, requested: str | None = "auto") -> str:
    """transformers' attention implementation for ``requested``: ``auto`` is the fastest the family
    allows of torch's own kernels, ``sdpa`` (scaled_dot_product_attention: flash attention on GPUs)
    when its model class supports it, else ``eager``. A config that soft-caps the attention scores
    (Gemma 2's ``attn_logit_softcapping``) gets ``flex_attention`` where a CUDA GPU is visible: flex
    applies the soft-cap inside its kernel and keeps no (T x T) scores for the backward, which eager
    does (sdpa has no soft-capping: transformers 5.17 runs Gemma 2 under sdpa without it, later
    releases refuse sdpa for it). On the CPU, where flex has no backward, it gets ``eager``. A config
    with sliding-window layers (Gemma 3's ``layer_types``) gets flex too on a GPU, where its class
    supports it: flex skips the blocks of scores the window masks, sdpa computes them all and masks
    them. Anything else (``eager``, ``flex_attention``, ...) as given."""
    if requested not in (None, "", "auto"):
        return requested
    text = hf_config.get_text_config()
    if getattr(text, "attn_logit_softcapping", None):
        return "flex_attention" if torch.cuda.is_available() else "eager"
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(hf_config)]
    except KeyError:
        return "sdpa"
    windowed = "sliding_attention" in (getattr(text, "layer_types", None) or ())
    if windowed and torch.cuda.is_available() and getattr(cls, "_supports_flex_attn", False):
        return "flex_attention"
    return "sdpa" if getattr(cls, "_supports_sdpa", False) else "eager"


def _meta_build(hf_config: Any, requested: Any) -> list[str]:
    """The model class of ``hf_config`` built on the meta device (no memory, no initialisation),
    with the attention asked for: what transformers refuses, as one line, before any rank starts."""
    if not isinstance(requested, str):
        return [f"model.args.attn_implementation: expected a name (auto, sdpa, eager, ...), got {requested!r}"]
    transformers = _transformers()
    attn = attention(hf_config, requested)
    try:
        with torch.device("meta"), _no_init_weights():
            transformers.AutoModelForCausalLM.from_config(hf_config, attn_implementation=attn)
    except Exception as e:
        key = "model.args.attn_implementation" if requested not in ("", "auto") else "model.args"
        return [f"{key}: transformers cannot build {type(hf_config).__name__.removesuffix('Config')} "
                f"with attn_implementation={attn!r}: {_first_line(e)}"]  # fmt: skip
    return []


class _OwnPositions:
    """How many ``HFCausalLM`` forwards are running: transformers' packed-sequence detection skipped in them."""

    depth = 0


def _skip_packing_detection_in_own_calls() -> None:
    """transformers (``masking_utils``) looks, in every forward given no attention mask, for packed
    sequences: position ids that restart inside a row. On real tensors that check reads a value
    back (a device-to-host sync in every forward); where it cannot read values (fake tensors,
    torch.compile, CUDA-graph capture) it assumes packing and makes a (batch, 1, T, T) mask, which
    makes SDPA repeat the keys and values for every head (no grouped-query path) and keep the mask
    for backward: 160 MiB a layer at 8 x 2048 tokens of a Llama-3.2-1B shape, 2.5 GiB over its 16
    layers in the memory plan. ``HFCausalLM`` called with ``input_ids`` only lets the model make its
    own positions 0..T-1, so a row is never packed: in those forwards the detection answers "not
    packed" without looking. Called with ``position_ids`` (packed chat rows) the detection runs and
    its mask isolates the documents. Installed once; a transformers without the function is left
    as it is."""
    try:
        from transformers import masking_utils
    except ImportError:
        return
    find = getattr(masking_utils, "find_packed_sequence_indices", None)
    if find is None or getattr(find, "_distlib_wrapper", False):
        return

    def find_unless_own(position_ids: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor | None:
        return None if _OwnPositions.depth else find(position_ids, *args, **kwargs)

    find_unless_own._distlib_wrapper = True  # type: ignore[attr-defined]
    masking_utils.find_packed_sequence_indices = find_unless_own


def _plain_logits(config: Any) -> bool:
    """Whether the causal-LM class's logits are its output layer's product and nothing more."""
    return _scaled_product(config) and _logits_divisor(config) is None


def _scaled_product(config: Any) -> bool:
    """Whether the logits are the output layer's product, divided by ``_logits_divisor`` at most."""
    return not any(getattr(config, k, None) for k in ("final_logit_softcapping", "logit_scale", "output_multiplier"))


def _logits_divisor(config: Any) -> float | None:
    """Granite's ``logits_scaling``: its causal-LM classes divide the product by it; None for 1 or none."""
    value = getattr(config, "logits_scaling", None)
    return None if value in (None, 1) else float(value)


VOCAB_ALIGN = 64  # an output layer's rows padded to a multiple of this for its product (as nanoGPT's 50304)


def _aligned_logits(hidden: torch.Tensor, layer: nn.Linear) -> torch.Tensor:
    """``layer(hidden)`` (a bias-free output layer) with its matrix padded by zero rows to a multiple
    of ``VOCAB_ALIGN``, the logits then cut back to the vocabulary: the same values, but rows of
    logits (and of their gradient) whose length cuBLAS's fast kernels take. With an odd vocabulary
    (GPT-2's 50257) it otherwise falls back to kernels that read one element at a time: on one H100,
    GPT-2 large's output-layer products took 51 ms of a 253 ms step in them. A compiled whole model
    gets the same from inductor's padding; the runner's output layer runs outside the compiled
    blocks. The padded matrix is a copy of the layer's (its gradient flows back to the layer's rows)."""
    vocab = layer.weight.shape[0]
    return F.linear(hidden, F.pad(layer.weight, (0, 0, 0, -vocab % VOCAB_ALIGN)))[..., :vocab]


class HFCausalLM(nn.Module):
    """``logits = model(input_ids)``: a transformers causal LM (``self.hf``) called with ``input_ids``
    (and ``position_ids`` when given: packed documents, docs/fine_tuning.md), returning ``.logits``;
    input_ids (batch, time) token ids, logits (batch, time, vocab). A mixture of
    experts with a load-balancing loss returns ``(logits, aux_loss)`` in training (``forward``)."""

    def __init__(self, hf: nn.Module, *, pretrained: str = "", lora: Mapping[str, Any] | None = None):
        super().__init__()
        self.hf = hf
        self.pretrained = pretrained
        # model.args.lora: peft's adapters injected (runner/models/lora.py), the rest frozen; they are
        # initialised from the run's seed (torch.manual_seed's, before the build) by load_pretrained
        self.lora = dict(lora) if lora is not None else None
        self.adapter_seed = torch.initial_seed()
        if self.lora is not None:
            from distlib.runner.models import lora as adapters

            adapters.inject(hf, self.lora)
        # transformers' list of the layers not to split over devices: its repeated blocks
        self.block_names = tuple(sorted(getattr(hf, "_no_split_modules", None) or ()))
        # a mixture of experts with a load-balancing loss: its weight in the training loss (the
        # config's router_aux_loss_coef, as transformers adds it to .loss); None without one
        c = hf.config.get_text_config()
        takes = "output_router_logits" in inspect.signature(hf.forward).parameters
        coef = getattr(c, "router_aux_loss_coef", None) if takes else None
        self.aux_loss_coef: float | None = float(coef) if coef else None
        # forward(idx, head=): the loss applies the output layer (runner/tasks/chunked_loss.py), where
        # the logits are the output layer's product alone (no soft-capping or scaling after it) and
        # no load-balancing loss needs the causal-LM class's own forward
        self.takes_head = self.aux_loss_coef is None and _plain_logits(c) and hf.get_output_embeddings() is not None
        # the plain loss's logits through _aligned_logits where a bias-free output layer has an odd-sized
        # vocabulary (an adapter on it, peft's layer, is applied whole; float8 leaves it as it is)
        out = hf.get_output_embeddings()
        self.logits_divisor = _logits_divisor(c)  # applied after the padded product, as transformers does
        self.pads_logits = (
            self.aux_loss_coef is None
            and _scaled_product(c)
            and isinstance(out, nn.Linear)
            and out.bias is None
            and out.weight.shape[0] % VOCAB_ALIGN != 0
        )
        _skip_packing_detection_in_own_calls()

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        head: Callable[[torch.Tensor, nn.Module], Any] | None = None,
    ) -> Any:
        """The logits; in training, a mixture of experts with a load-balancing loss returns
        ``(logits, aux_loss)``: the causal-LM task adds ``aux_loss_coef * aux_loss`` to its loss,
        as transformers' ``.loss`` does, and reports ``aux_loss`` on its own. ``position_ids``
        (batch, time): given, transformers' packed-sequence detection runs (positions that restart
        inside a row start a new document: sdpa, eager and flex attention get a block-causal mask,
        no token attending to another document); without them, positions 0..T-1 and no detection.
        With ``head`` (where ``takes_head``): ``head(last hidden states, output layer)`` in place of
        the logits (the loss applies the output layer: runner/tasks/chunked_loss.py)."""
        own = position_ids is None
        if own:
            _OwnPositions.depth += 1  # the model makes positions 0..T-1 itself: no packed rows
        kwargs = {} if own else {"position_ids": position_ids}
        try:
            applies_head = head is not None and self.takes_head
            if applies_head or self.pads_logits:  # the output layer applied here, to the last hidden states
                base = getattr(self.hf, self.hf.base_model_prefix)
                hidden = base(input_ids=input_ids, use_cache=False, **kwargs).last_hidden_state
                layer = self.hf.get_output_embeddings()
                if applies_head:
                    return head(hidden, layer)
                logits = _aligned_logits(hidden, layer)
                return logits if self.logits_divisor is None else logits / self.logits_divisor
            if self.aux_loss_coef is not None and self.training:
                out = self.hf(input_ids=input_ids, use_cache=False, output_router_logits=True, **kwargs)
                return out.logits, out.aux_loss
            return self.hf(input_ids=input_ids, use_cache=False, **kwargs).logits
        finally:
            if own:
                _OwnPositions.depth -= 1

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
        0 for a model built from a config. With LoRA the folder fills the base layers (read under
        the names of the model without adapters), then the adapters are initialised
        (``lora.init_adapters``: the same in every shard mode, from a config or a folder)."""
        read = 0
        if self.pretrained:
            from distlib.runner.hf.safetensors_folder import read_into

            if self.lora is None:
                return read_into(self.hf, self.pretrained)
            from distlib.runner.models import lora

            with lora.base_names(self.hf) as base:
                read = read_into(base, self.pretrained)
        if self.lora is not None:
            from distlib.runner.models import lora

            lora.init_adapters(self.hf, self.adapter_seed)
        return read

    def num_params(self, embeddings: bool = True) -> int:
        """Parameters, a tied matrix counted once; without ``embeddings``: less the input embedding
        when it is not the output layer too (a lookup, no matrix product)."""
        n = sum(p.numel() for p in self.parameters())
        if embeddings:
            return n
        emb, out = self.hf.get_input_embeddings(), self.hf.get_output_embeddings()
        tied = out is not None and out.weight is emb.weight
        return n if tied else n - emb.weight.numel()

    def active_params(self, embeddings: bool = True) -> int:
        """``num_params``, the routed experts of a mixture of experts counted as the share a token
        uses (``num_experts_per_tok`` of them): the parameters each token computes with."""
        c = self.hf.config.get_text_config()
        experts = next((getattr(c, k) for k in EXPERTS if getattr(c, k, None)), 0)
        n = self.num_params(embeddings)
        if not experts:
            return n
        routed = sum(p.numel() for name, p in self.named_parameters()
                     if ".experts." in f".{name}" and p.ndim and p.shape[0] == experts)  # fmt: skip
        return n - routed + routed * c.num_experts_per_tok // experts

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token, counted as for the built-in GPT: 6 per weight of the matrix
        products a token goes through (the output layer included, tied or not; not an untied input
        embedding; of a mixture of experts the experts it is routed to) and
        6 * layers * heads * (query/key + value head dims) * seq_len for attention's scores and
        weighted values (12 * layers * heads * head_dim * seq_len where the two are one size). With
        LoRA, 4 per frozen weight (the forward's product and the input's gradient: a frozen weight has
        no gradient of its own to compute) and 6 per adapter weight."""
        c = self.hf.config.get_text_config()
        heads = getattr(c, "num_attention_heads", 0) or 0
        head_dim = getattr(c, "head_dim", None) or (c.hidden_size // heads if heads else 0)
        qk = getattr(c, "qk_head_dim", None) or head_dim  # multi-head latent attention's (DeepSeek-V3) differ
        v = getattr(c, "v_head_dim", None) or head_dim
        layers = getattr(c, "num_hidden_layers", 0) or 0
        weights = self.active_params(embeddings=False)
        frozen = 0
        if self.lora is not None:
            from distlib.runner.models import lora

            frozen = weights - sum(p.numel() for _, p in lora.adapters(self.hf))
        return 6 * weights - 2 * frozen + 6 * layers * heads * (qk + v) * seq_len

    def save_files(self, run_dir: str) -> list[str]:
        """The model's ``config.json`` (what builds it again, with no other folder) and, from a
        pretrained folder, its tokenizer and generation files, into ``run_dir``'s ``RUN_FILES``: the
        run's own copy, which the export reads. Returns the names written."""
        import shutil

        directory = os.path.join(run_dir, RUN_FILES)
        os.makedirs(directory, exist_ok=True)
        config = copy.deepcopy(self.hf.config)
        config.use_cache = True  # for whoever loads it; training turned it off
        config.save_pretrained(directory)
        written = ["config.json"]
        for name in sorted(os.listdir(self.pretrained)) if self.pretrained else []:
            if name in TOKENIZER_FILES or name.endswith(".jinja"):
                shutil.copyfile(os.path.join(self.pretrained, name), os.path.join(directory, name))
                written.append(name)
        return written


def hf_causal_lm(
    config: dict | None = None,
    pretrained: str = "",
    attn_implementation: str = "auto",
    vocab_size: int | None = None,
    lora: dict | None = None,
) -> HFCausalLM:
    """A transformers causal LM from ``config`` (``model_type`` and the config class's keys; the
    vocabulary the data's when it gives none), or from the local folder ``pretrained``
    (``config.json`` and safetensors). ``attn_implementation``: transformers' attention kernel
    (``auto``: ``sdpa``, torch's scaled_dot_product_attention, flash attention on GPUs, when the
    family supports it, else ``eager``; see ``attention``). ``vocab_size``: the
    data's (given by the runner), checked against the model's. Built in fp32 (the runner's
    precision casts) in the current default device; a pretrained model uninitialised:
    ``load_pretrained()`` reads its weights (the runner calls it once the model is on its device,
    and sharded). ``lora``: ``{r, alpha, dropout, target_modules}``, peft's LoRA adapters on the
    model, the rest of it frozen (runner/models/lora.py)."""
    transformers = _transformers()
    if config is not None and pretrained:
        raise ConfigError([f"model.args: hf_causal_lm takes one of config or pretrained, not both: {BOTH}"])
    if config is None and not pretrained:
        raise ConfigError(["model.args: hf_causal_lm needs one of config or pretrained"])
    if pretrained:
        try:
            hf_config = transformers.AutoConfig.from_pretrained(pretrained, local_files_only=True)
        except (OSError, ValueError) as e:  # missing, damaged or foreign config.json: transformers' own words
            raise ConfigError(
                [f"model.args.pretrained={pretrained!r}: its config.json cannot be read: {_first_line(e)}"]
            ) from e
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
        attn = attention(hf_config, attn_implementation)
        hf = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32, attn_implementation=attn)
    hf.tie_weights()  # skipped with the initialisation
    return HFCausalLM(hf, pretrained=pretrained, lora=lora)


def _no_init_weights() -> contextlib.AbstractContextManager:
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # elsewhere in older releases
        from transformers.modeling_utils import no_init_weights
    return no_init_weights()


# the folder of a run directory that save_files writes: the model's config.json and tokenizer files
RUN_FILES = "hf_model"
# the config keys that give a mixture of experts' number of routed experts, by family
EXPERTS = ("num_local_experts", "num_experts", "n_routed_experts")
# what a pretrained folder holds besides its weights that a run keeps with its config (save_files)
TOKENIZER_FILES = frozenset({"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                             "vocab.json", "merges.txt", "added_tokens.json", "generation_config.json"})  # fmt: skip

hf_causal_lm.check_args = check_args  # components.check calls it when the recipe is loaded

__all__ = ["HFCausalLM", "attention", "build_config", "check_args", "hf_causal_lm"]
