"""model.name=hf_causal_lm: a tiny Hugging Face Llama, saved with save_pretrained in a temporary
folder, loads through a recipe at 1, 2 and 3 gloo ranks in every dist.shard mode with the folder's
weights, and its first-step loss on each rank equals transformers' own
``model(input_ids=x, labels=x).loss`` on that rank's batch; a sharded-safetensors folder loads under
dist.shard=full with every rank reading only its rows; built from a config it initialises as
transformers does, its blocks are the decoder layers (overridable), its embeddings stay tied under
FSDP2, a run resumes from its checkpoint; the recipe's mistakes are ConfigErrors at load time.
Nothing is downloaded: every model is made here from a config.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import shutil
from collections.abc import Iterator

import pytest
import torch
import yaml

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

import distlib  # noqa: E402
from distlib.runner.config import ConfigError, load_config  # noqa: E402
from tests.conftest import ROOT, run_ranks  # noqa: E402
from tests.runner.conftest import checkpoints  # noqa: E402
from tests.runner.test_trainer import built, metrics  # noqa: E402

TINY = dict(model_type="llama", hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256, max_position_embeddings=64, tie_word_embeddings=True)  # fmt: skip
BLOCK, BATCH = 16, 6  # 6 sequences divide over 1, 2 and 3 ranks
SHARDS = ("none", "optimizer", "full")


def save_tiny(directory, seed: int = 0, max_shard_size: str | None = None, **overrides) -> dict[str, torch.Tensor]:
    """A tiny Llama with transformers' own initialisation, written by save_pretrained; its state dict."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = AutoConfig.for_model(**{**TINY, **overrides})
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():  # norms away from 1: a norm weight left at its initial value would not show
        for p in model.parameters():
            if p.ndim == 1:
                p.uniform_(0.5, 1.5)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(str(directory), **kwargs)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A pretrained folder (one model.safetensors) and a small text to train on."""
    root = tmp_path_factory.mktemp("hf")
    state = save_tiny(root / "tiny")
    with gzip.open(os.path.join(ROOT, "data", "shakespeare-demo", "shakespeare.txt.gz"), "rb") as f:
        (root / "text.txt").write_bytes(f.read()[:4_000])
    return root, state


def recipe(root, out_dir, model_args: dict, *, epochs: int = 1, steps: int = 2) -> str:
    """A recipe file: the tiny text in windows of BLOCK bytes, ``steps`` steps of BATCH sequences
    per epoch, AdamW, fp32, no label smoothing (transformers' loss has none)."""
    path = f"{out_dir}.{os.getpid()}.yaml"  # each rank its own: a rank must not read another's half-written file
    os.makedirs(os.path.dirname(path), exist_ok=True)
    data = {
        "data": {"name": "byte_text", "root": str(root / "text.txt"), "args": {"block_size": BLOCK, "val_frac": 0.1},
                 "train_subset": BATCH * steps},
        "model": {"name": "hf_causal_lm", "args": model_args},
        "train": {"epochs": epochs, "batch_size": BATCH, "optimizer": "adamw", "lr": 1e-2, "label_smoothing": 0.0,
                  "precision": "fp32", "clip_grad_norm": 1.0, "warmup_frac": 0.0, "sample_tokens": 0},
        "run": {"out_dir": out_dir, "progress": "plain", "resume": True},
    }  # fmt: skip
    with open(path, "w") as f:
        yaml.safe_dump(data, f)
    return path


def whole(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every tensor of the model's state dict whole (DTensors gathered), on the CPU."""
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().cpu().clone()
            for k, v in model.state_dict().items()}  # fmt: skip


class FirstBatch:
    """The trainer's step, keeping the first batch and every step's loss of this rank."""

    def __init__(self, step):
        self.step, self.batch, self.losses = step, None, []

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.batch is None:
            self.batch = (x.detach().cpu().clone(), y.detach().cpu().clone())
        loss = self.step(x, y)
        self.losses.append(loss.item())
        return loss

    def __getattr__(self, name: str):
        return getattr(self.step, name)


@contextlib.contextmanager
def group_kept() -> Iterator[None]:
    """A trainer's close that keeps the process group (a barrier in place of distlib.shutdown), so
    that these ranks run the next recipe in it: new ranks would import transformers again."""
    real = distlib.shutdown
    distlib.shutdown = lambda *, barrier=None: distlib.barrier() if barrier is not False else None
    try:
        yield
    finally:
        distlib.shutdown = real


def _every_shard_mode(ctx, root: str, out: str) -> dict:
    """This rank's first batch, losses and whole initial weights in each dist.shard mode."""
    from pathlib import Path

    results = {}
    for shard in SHARDS:
        path = recipe(Path(root), os.path.join(out, shard), {"pretrained": os.path.join(root, "tiny")})
        cfg = load_config(path, [f"dist.shard={shard}"])
        with group_kept(), built(cfg, ctx) as trainer:
            initial = whole(trainer.model)
            hf = trainer.model.hf
            tied = hf.lm_head.weight is hf.model.embed_tokens.weight
            trainer.step_fn = step = FirstBatch(trainer.step_fn)
            assert trainer.fit() == 0
            still_tied = hf.lm_head.weight is hf.model.embed_tokens.weight
        results[shard] = {"batch": step.batch, "losses": step.losses, "initial": initial, "tied": (tied, still_tied)}
    return results


def _transformers_loss(directory, x: torch.Tensor, y: torch.Tensor) -> float:
    """transformers' own loss on the window the runner's (x, y) come from: it shifts the labels itself."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32)
    window = torch.cat([x, y[:, -1:]], dim=1).long()
    with torch.no_grad():
        return model(input_ids=window, labels=window).loss.item()


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_a_pretrained_llama_loads_in_every_shard_mode_with_transformers_first_loss(
    folder, tmp_path, world_size, world_size_1
):
    """Each rank's first loss equals transformers' loss on its batch (1e-5 relative: the same
    sums in another order); the weights the run starts from are the folder's (exactly, the tied
    embedding included, which stays tied through training); the later losses agree between the
    modes (their sums in other orders: 1e-4)."""
    root, saved = folder
    if world_size == 1:
        got = [_every_shard_mode(distlib.init("gloo"), str(root), str(tmp_path))]
    else:
        got = run_ranks(_every_shard_mode, world_size, str(root), str(tmp_path), timeout=300)
    for rank, results in enumerate(got):
        for shard in SHARDS:
            r = results[shard]
            x, y = r["batch"]
            assert x.shape == (BATCH // world_size, BLOCK)
            assert r["losses"][0] == pytest.approx(_transformers_loss(root / "tiny", x, y), rel=1e-5), (shard, rank)
            for k, v in saved.items():
                torch.testing.assert_close(r["initial"][f"hf.{k}"], v, rtol=0, atol=0, msg=f"{shard}: {k}")
            assert r["tied"] == (True, True), shard
            assert r["losses"] == pytest.approx(results["none"]["losses"], rel=1e-4), (shard, rank)


# ---- a sharded folder: each rank reads only its rows --------------------------------------------
def _read_counted(ctx, root: str, out: str, folder_name: str) -> dict:
    """Build the run under dist.shard=full, counting the bytes this rank's reads of the folder's
    files return (os.preadv, which read_into reads with) and what load_pretrained says it read."""
    from pathlib import Path

    from distlib.runner.models.hf_causal_lm import HFCausalLM
    from distlib.runner.training.trainer import Trainer
    from tests.library.test_sharded_build import peak_bytes

    opened, read, said = set(), [0], []
    real_preadv, real_load = os.preadv, HFCausalLM.load_pretrained

    def preadv(fd, buffers, offset, *args):
        name = os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))
        n = real_preadv(fd, buffers, offset, *args)
        if name.endswith(".safetensors"):
            opened.add(name)
            read[0] += n
        return n

    def load_pretrained(self):
        said.append(real_load(self))
        return said[-1]

    real_build = Trainer.build_model
    peak = []

    def build_model(self):  # the host memory the model's build and load allocate at their peak
        model, top = peak_bytes(lambda: real_build(self))
        peak.append(top)
        return model

    os.preadv, HFCausalLM.load_pretrained, Trainer.build_model = preadv, load_pretrained, build_model
    try:
        path = recipe(Path(root), out, {"pretrained": os.path.join(root, folder_name)})
        cfg = load_config(path, ["dist.shard=full", "train.epochs=1"])
        with built(cfg, ctx) as trainer:
            weights = whole(trainer.model)
            held = sum(p.to_local().untyped_storage().nbytes() for p in trainer.model.parameters())
    finally:
        os.preadv, HFCausalLM.load_pretrained, Trainer.build_model = real_preadv, real_load, real_build
    return {"read": read[0], "said": said, "opened": sorted(opened), "weights": weights, "peak": peak[0], "held": held}


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_sharded_safetensors_folder_loads_under_full_sharding_each_rank_reading_its_rows(
    folder, tmp_path, world_size
):
    """save_pretrained with a small max_shard_size writes several files and an index; under
    dist.shard=full every rank reads its rows of every tensor only: what the ranks read sums to
    the folder's bytes, each rank about 1/world of them (torch.chunk's uneven rows), none the
    whole; the weights are the folder's. The model is built on the meta device and sharded without
    values: the host memory its build and load allocate peaks at its shards and a tensor's rows."""
    root, _ = folder
    # six layers: the blocks, not the embedding, make most of the model (as in any real one)
    saved = save_tiny(root / "sharded", seed=1, max_shard_size="20KB", num_hidden_layers=6)
    names = os.listdir(root / "sharded")
    assert "model.safetensors.index.json" in names and sum(n.endswith(".safetensors") for n in names) >= 3
    total = sum(v.numel() * v.element_size() for k, v in saved.items() if k != "lm_head.weight")  # tied: once
    got = run_ranks(_read_counted, world_size, str(root), str(tmp_path / "run"), "sharded", timeout=300)
    reads = [g["read"] for g in got]
    assert [g["said"] for g in got] == [[r] for r in reads], got
    assert sum(reads) == total, reads
    for r in reads:
        assert r < total / world_size * 1.1, (reads, total)
    assert all(g["opened"] for g in got)
    largest = max(v.numel() * v.element_size() for v in saved.values())
    for g in got:  # built on the meta device and read into the shards: never the whole model
        assert g["peak"] <= g["held"] + 2 * largest + 16 * 1024, (g["peak"], g["held"], largest, total)
        assert g["peak"] < total * 0.85, (g["peak"], total)
    for k, v in saved.items():
        torch.testing.assert_close(got[0]["weights"][f"hf.{k}"], v, rtol=0, atol=0, msg=k)


# ---- built from a config -----------------------------------------------------------------------
def test_built_from_a_config_it_initialises_as_transformers_does_in_every_shard_mode(folder, tmp_path, world_size_1):
    """The weights have transformers' initialisation (normal(0, initializer_range) matrices, unit
    norms, the padding token's row zero: row 7, where row 0 would hide a row zeroed in the wrong
    place), the same in every mode, also when materialised shard by shard; its blocks are the decoder
    layers, each one sharded by FSDP2 under dist.shard=full; the embedding stays tied."""
    from torch.distributed.fsdp import FSDPModule
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    root, _ = folder
    ctx = distlib.init("gloo")
    config = {**TINY, "hidden_size": 64, "intermediate_size": 128, "initializer_range": 0.05, "pad_token_id": 7}
    first = None
    for shard in SHARDS:
        cfg = load_config(recipe(root, str(tmp_path / shard), {"config": config}), [f"dist.shard={shard}"])
        with built(cfg, ctx) as trainer:
            model = trainer.model
            w = whole(model)
            blocks = list(model.blocks)
            assert len(blocks) == 2 and all(isinstance(b, LlamaDecoderLayer) for b in blocks)
            assert all(isinstance(b, FSDPModule) for b in blocks) == (shard == "full")
            assert model.hf.lm_head.weight is model.hf.model.embed_tokens.weight
        embedding = w["hf.model.embed_tokens.weight"]
        assert not embedding[7].any() and embedding[0].all(), shard
        first = first or w
        for k, v in w.items():
            assert torch.equal(v, first[k]), (shard, k)
            if k.endswith("norm.weight"):
                assert torch.equal(v, torch.ones_like(v)), (shard, k)
            elif v.ndim == 2:
                assert v.std().item() == pytest.approx(0.05, rel=0.15), (shard, k)
                assert abs(v.mean().item()) < 0.01, (shard, k)


def test_the_blocks_come_from_the_recipe_when_it_names_them(folder, tmp_path, world_size_1):
    """model.block_class names other layers: full sharding wraps those; the model's view of its
    blocks adds no names to the state dict."""
    from torch.distributed.fsdp import FSDPModule

    root, _ = folder
    cfg = load_config(recipe(root, str(tmp_path / "r"), {"config": TINY}), ["dist.shard=full",
                      "model.block_class=LlamaMLP"])  # fmt: skip
    with built(cfg, distlib.init("gloo")) as trainer:
        hf = trainer.model.hf
        assert [isinstance(layer.mlp, FSDPModule) for layer in hf.model.layers] == [True, True]
        assert not any(isinstance(layer, FSDPModule) for layer in hf.model.layers)
        assert all(not k.startswith("blocks") for k in trainer.model.state_dict())


COMPILED = [
    ["train.compile=blocks"],
    ["train.compile=model"],
    ["train.activation_checkpointing=full"],
    ["train.compile=blocks", "dist.shard=full", "train.activation_checkpointing=selective"],
]


def test_compiled_per_block_or_whole_and_checkpointed_it_trains_as_eager(folder, tmp_path, world_size_1):
    """train.compile (per decoder layer, or the whole model; aot_eager: dynamo's graphs without
    code generation) and activation checkpointing, replicated and fully sharded: the losses of
    the eager run (1e-5 relative)."""
    root, _ = folder
    ctx = distlib.init("gloo")
    losses = []
    for i, extra in enumerate([[], *COMPILED]):
        cfg = load_config(recipe(root, str(tmp_path / str(i)), {"config": TINY}),
                          ["train.compile_backend=aot_eager", *extra])  # fmt: skip
        with group_kept(), built(cfg, ctx) as trainer:
            layers = list(trainer.model.hf.model.layers)
            compiled = [getattr(m, "_compiled_call_impl", None) is not None for m in layers]
            assert compiled == [("train.compile=blocks" in extra)] * 2, extra  # each decoder layer, in place
            checkpointed = ["Checkpointed" in type(m).__name__ for m in layers]
            assert checkpointed == [any("checkpointing" in e for e in extra)] * 2, extra
            trainer.step_fn = step = FirstBatch(trainer.step_fn)
            assert trainer.fit() == 0
        losses.append(step.losses)
    for extra, got in zip(COMPILED, losses[1:]):
        assert got == pytest.approx(losses[0], rel=1e-5), extra


def test_flops_per_token_count_the_matrix_products_as_the_gpt_does():
    """6 per weight of a matrix product (the output layer counted once when tied; an untied input
    embedding is a lookup, not counted) plus 12 * layers * heads * head_dim * seq_len."""
    from distlib.runner.models.hf_causal_lm import hf_causal_lm

    def by_hand(m, tied: bool) -> int:
        n = sum(p.numel() for p in m.parameters())
        if not tied:
            n -= m.hf.model.embed_tokens.weight.numel()
        return 6 * n + 12 * 2 * 4 * 8 * 100

    tied = hf_causal_lm(config=TINY)
    untied = hf_causal_lm(config={**TINY, "tie_word_embeddings": False})
    assert tied.flops_per_token(100) == by_hand(tied, True)
    assert untied.flops_per_token(100) == by_hand(untied, False)
    assert untied.num_params() - tied.num_params() == 256 * 32
    assert tied.num_params(embeddings=False) == tied.num_params()


@pytest.mark.parametrize(("model_type", "vocab"), [("gpt2", 301), ("llama", 301), ("granite", 301), ("llama", 256)])
def test_an_odd_vocabulary_has_its_output_product_padded_and_the_same_logits_and_gradients(model_type, vocab):
    """GPT-2's 50257 (301 here): the output layer's product runs on its matrix padded to a multiple of
    64 (384), where cuBLAS's fast kernels apply; the logits and every gradient are transformers' own
    (Granite's divided by its logits_scaling, tied to its embedding). A vocabulary already aligned
    (256) is used as it is."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from distlib.runner.models.hf_causal_lm import hf_causal_lm

    class Products(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.widths: set[int] = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default):
                self.widths |= {*args[-2].shape, *args[-1].shape}
            return func(*args, **(kwargs or {}))

    config = {**TINY, "vocab_size": vocab, "tie_word_embeddings": False}
    if model_type == "granite":
        config = {**TINY, "model_type": "granite", "vocab_size": vocab, "logits_scaling": 8.0,
                  "embedding_multiplier": 12.0, "residual_multiplier": 0.22, "attention_multiplier": 0.015625,
                  "tie_word_embeddings": True}  # fmt: skip
    if model_type == "gpt2":
        config = dict(model_type="gpt2", vocab_size=vocab, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
    torch.manual_seed(5)
    model = hf_causal_lm(config=config)
    x = torch.randint(0, vocab, (3, 16), generator=torch.Generator().manual_seed(1))
    with Products() as seen:
        logits = model(x)
    assert model.pads_logits == (vocab % 64 != 0)
    padded = -(-vocab // 64) * 64
    assert padded in seen.widths and (vocab == padded or vocab not in seen.widths), seen.widths
    want = model.hf(input_ids=x, use_cache=False).logits
    assert logits.shape == want.shape == (3, 16, vocab)
    assert torch.allclose(logits, want, atol=1e-6, rtol=0)
    y = torch.randint(0, vocab, (3, 16), generator=torch.Generator().manual_seed(2))
    params = [p for p in model.parameters() if p.requires_grad]
    got = torch.autograd.grad(torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten()), params)
    ref = torch.autograd.grad(torch.nn.functional.cross_entropy(want.flatten(0, 1), y.flatten()), params)
    for p, a, b in zip(params, got, ref):
        assert a.shape == p.shape and torch.allclose(a, b, atol=1e-6, rtol=0)


def test_its_forward_makes_no_attention_mask_where_transformers_cannot_read_the_positions():
    """transformers looks for packed rows in the position ids of every forward given no mask; where it
    cannot read values (fake tensors here; torch.compile and CUDA-graph capture alike) it assumes
    packing and makes a (batch, 1, T, T) mask, and SDPA then repeats the keys and values for every
    head. The wrapper's rows are never packed (it passes input_ids only): its forward makes no mask
    and hands SDPA the grouped keys (2 key/value heads of 4), on fake and on real tensors with the
    same logits as transformers; the same model called directly still gets transformers' mask: the
    skip is the wrapper's, not the process's."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    from distlib.runner.models.hf_causal_lm import hf_causal_lm

    B, T = 3, 16

    class Seen(TorchDispatchMode):
        """The key heads each attention call gets, and whether any op made a (B, 1, T, T) mask."""

        def __init__(self) -> None:
            super().__init__()
            self.key_heads: list[int] = []
            self.mask = False

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
            out = func(*args, **(kwargs or {}))
            if "scaled_dot_product" in str(func):
                self.key_heads.append(args[1].shape[1])
            self.mask |= any(isinstance(t, torch.Tensor) and tuple(t.shape) == (B, 1, T, T) for t in tree_leaves(out))
            return out

    def seen(call, x: torch.Tensor) -> Seen:  # noqa: ANN001
        with Seen() as mode:
            call(x)
        return mode

    torch.manual_seed(0)
    model = hf_causal_lm(config=TINY)
    x = torch.randint(0, 256, (B, T))
    direct = lambda x: model.hf(input_ids=x, use_cache=False).logits  # noqa: E731
    real = seen(model, x)
    assert (real.key_heads, real.mask) == ([2, 2], False)
    assert torch.equal(model(x), direct(x))
    with FakeTensorMode(allow_non_fake_inputs=True):
        fake_x = torch.zeros(B, T, dtype=torch.long)
        wrapped, plain = seen(model, fake_x), seen(direct, fake_x)
    assert (wrapped.key_heads, wrapped.mask) == ([2, 2], False)
    assert plain.mask and plain.key_heads == [4, 4], "transformers' own detection no longer masks fake tensors"


@pytest.mark.gpus(1)
def test_its_forward_and_backward_on_a_gpu_read_nothing_back():
    """On a GPU, after a first step (lazy set-up may read values), a forward and backward wait for
    nothing on the host (``torch.cuda.set_sync_debug_mode("error")``): transformers' packed-sequence
    check, skipped in the wrapper's forward, read a value back in every forward."""
    from distlib.runner.models.hf_causal_lm import hf_causal_lm

    torch.manual_seed(0)
    model = hf_causal_lm(config=TINY).cuda()
    x = torch.randint(0, 256, (3, 16), device="cuda")
    model(x).float().sum().backward()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        model(x).float().sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode(0)


# ---- checkpoints and resume --------------------------------------------------------------------
def _two_epochs(ctx, root: str, out: str, shard: str) -> list[dict]:
    from pathlib import Path

    args = {"pretrained": os.path.join(root, "tiny")}
    cfg = load_config(recipe(Path(root), out, args, epochs=2), [f"dist.shard={shard}", "run.checkpoint_every=1"])
    with built(cfg, ctx) as trainer:
        assert trainer.fit() == 0
    return metrics(out) if ctx.is_main else []


@pytest.mark.parametrize("shard", ["none", "full"])
def test_a_run_resumed_from_its_checkpoint_ends_as_the_uninterrupted_one(folder, tmp_path, shard):
    """Two epochs at two ranks from the pretrained folder; then the last checkpoint is removed and
    the run started again: it resumes after epoch 1 (the checkpoint's weights, not the folder's)
    and its second epoch's row equals the uninterrupted run's."""
    root, _ = folder
    out = str(tmp_path / "run")
    ref = run_ranks(_two_epochs, 2, str(root), out, shard, timeout=300)[0]
    saved = checkpoints(out)
    assert len(saved) == 2
    shutil.rmtree(os.path.join(out, "checkpoints", saved[-1]))
    again = run_ranks(_two_epochs, 2, str(root), out, shard, timeout=300)[0]
    keys = ("epoch", "train_loss", "val_loss")
    assert [{k: r[k] for k in keys} for r in again] == [{k: r[k] for k in keys} for r in ref]
    assert ref[-1]["val_loss"] < ref[0]["val_loss"] or ref[-1]["train_loss"] < ref[0]["train_loss"]


# ---- mistakes, at load time --------------------------------------------------------------------
@pytest.mark.parametrize(
    ("args", "names"),
    [
        ({}, ["needs one of config", "pretrained"]),
        ({"config": TINY, "pretrained": "x"}, ["not both", "model.args.config=null"]),
        ({"config": {"hidden_size": 8}}, ["needs model_type"]),
        ({"config": {"model_type": "lama"}}, ["'lama'", "did you mean 'llama'"]),
        ({"config": {**TINY, "hiden_size": 8}}, ["model.args.config.hiden_size", "did you mean 'hidden_size'"]),
        ({"pretrained": "/no/such/folder"}, ["model.args.pretrained", "no config.json"]),
        ({"config": TINY, "n_layer": 2}, ["takes no argument 'n_layer'"]),
    ],
)
def test_a_mistake_in_the_model_args_is_a_config_error_at_load_time(tmp_path, folder, args, names):
    root, _ = folder
    with pytest.raises(ConfigError) as e:
        load_config(recipe(root, str(tmp_path / "r"), args))
    assert len(e.value.problems) == 1, e.value.problems
    for name in names:
        assert name in e.value.problems[0], e.value.problems[0]


def test_a_folder_without_weights_and_a_missing_extra_are_config_errors(tmp_path, folder, monkeypatch):
    root, _ = folder
    empty = tmp_path / "empty"
    empty.mkdir()
    shutil.copy(root / "tiny" / "config.json", empty / "config.json")
    with pytest.raises(ConfigError, match="neither model.safetensors nor model.safetensors.index.json"):
        load_config(recipe(root, str(tmp_path / "r"), {"pretrained": str(empty)}))
    damaged = tmp_path / "damaged"
    shutil.copytree(root / "tiny", damaged)
    (damaged / "config.json").write_text((root / "tiny" / "config.json").read_text()[:-20])  # cut short
    with pytest.raises(ConfigError, match=f"{damaged}'?: its config.json cannot be read: "):
        load_config(recipe(root, str(tmp_path / "r"), {"pretrained": str(damaged)}))
    import builtins

    real_import = builtins.__import__

    def without_transformers(name, *args, **kwargs):
        if name == "transformers" or name.startswith("transformers."):
            raise ImportError("No module named 'transformers'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", without_transformers)
    with pytest.raises(ConfigError, match=r"pip install 'distlib\[hf\]'"):
        load_config(recipe(root, str(tmp_path / "r"), {"config": TINY}))


def test_the_weights_of_another_model_are_an_error_naming_the_tensors(tmp_path, folder, world_size_1):
    from distlib.runner.hf.safetensors_folder import SafetensorsError

    root, _ = folder
    other = tmp_path / "other"
    save_tiny(other, num_hidden_layers=1)
    config = json.loads((other / "config.json").read_text())
    config["num_hidden_layers"] = 2
    (other / "config.json").write_text(json.dumps(config))
    cfg = load_config(recipe(root, str(tmp_path / "r"), {"pretrained": str(other)}))
    with pytest.raises(SafetensorsError, match=r"missing 9 tensor\(s\): model.layers.1"):
        with built(cfg, distlib.init("gloo")):
            pass


def test_token_files_need_the_vocabulary_in_the_config_and_take_a_pretrained_folders(tmp_path, folder):
    """With data.name=token_file the tokens' vocabulary is the model's to say: a config without
    vocab_size is refused (the config class's default belongs to some other model); a pretrained
    folder's config.json gives it, and the token files are checked against it."""
    from distlib.runner.tasks.causal_lm import recipe_vocab_size

    root, _ = folder
    tokens = ["data.name=token_file", f"data.root={os.path.join(ROOT, 'data', 'shakespeare-demo', 'tokens')}",
              "data.args.val_frac=null"]  # fmt: skip
    config = {k: v for k, v in TINY.items() if k != "vocab_size"}
    with pytest.raises(ConfigError) as e:
        load_config(recipe(root, str(tmp_path / "r"), {"config": config}), tokens)
    assert e.value.problems == [
        "model.args.config.vocab_size: needed with data.name=token_file (the tokenizer's vocabulary size; "
        "the config class's default is some other model's)"
    ]
    cfg = load_config(recipe(root, str(tmp_path / "r"), {"pretrained": str(root / "tiny")}), tokens)
    assert recipe_vocab_size(cfg) == 256


# ---- export ------------------------------------------------------------------------------------
def _trained(ctx, root: str, out: str, shard: str) -> list[dict]:
    from pathlib import Path

    args = {"pretrained": os.path.join(root, "tiny")}
    cfg = load_config(recipe(Path(root), out, args, steps=3), [f"dist.shard={shard}"])
    with built(cfg, ctx) as trainer:
        assert trainer.fit() == 0
    return metrics(out) if ctx.is_main else []


def _val_loss(model, root) -> float:
    """The validation loss over every window once, as the run evaluates it (world size 1)."""
    import torch.nn.functional as F

    from distlib.runner.data.text import eval_windows, load_byte_text

    data = load_byte_text(str(root / "text.txt"), block_size=BLOCK, val_frac=0.1)
    total, n = 0.0, 0
    with torch.no_grad():
        for x, y in eval_windows(data.val, BLOCK, 0, 1, batch_size=4, device=torch.device("cpu")):
            logits = model(input_ids=x.long()).logits
            total += F.cross_entropy(logits.flatten(0, 1).float(), y.long().flatten(), reduction="sum").item()
            n += y.numel()
    return total / n


def _dcp_loaded(run_dir: str) -> dict[str, torch.Tensor]:
    """The model's tensors of the run's checkpoint as dcp.load reads them (the reference)."""
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    path = os.path.join(run_dir, "checkpoints", checkpoints(run_dir)[-1])
    meta = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    state = {k: torch.empty(tuple(m.size), dtype=m.properties.dtype) for k, m in meta.items()
             if k.startswith("model.") and isinstance(m, TensorStorageMetadata)}  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # that it reads in one process
        dcp.load(state, storage_reader=dcp.FileSystemReader(path), no_dist=True)
    return {k.removeprefix("model."): v for k, v in state.items()}


@pytest.mark.parametrize("shard", ["none", "full"])
def test_an_exported_run_loads_with_from_pretrained_and_gives_its_validation_loss(folder, tmp_path, shard, monkeypatch):
    """A run at two ranks (replicated or fully sharded training: a DCP checkpoint), exported in fp32: transformers'
    from_pretrained loads the folder (config.json, one model.safetensors, the tied embedding stored
    once) with the checkpoint's weights exactly (as dcp.load reads them), and its validation loss is
    the run's final one; a bf16 export holds the same weights rounded to bf16. Written in many groups
    of small parts, which cross the rows of the two ranks' chunks of the sharded tensors, every one
    read from its records (none through dcp.load)."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from distlib.runner.hf.dcp_tensors import CheckpointTensors
    from distlib.runner.models import export as export_module
    from distlib.runner.models.export import export, model_state

    root, _ = folder
    out = str(tmp_path / "run")
    rows = run_ranks(_trained, 2, str(root), out, shard, timeout=300)[0]
    monkeypatch.setattr(export_module, "GROUP_BYTES", 20_000)  # the embedding alone is 32 KiB in fp32
    monkeypatch.setattr(export_module, "PART_BYTES", 3_000)  # 23 rows of 128 bytes: across a rank's 128 (full)
    monkeypatch.setattr(CheckpointTensors, "_load", lambda *a: pytest.fail(f"read by dcp.load: {a[1]}"))
    done = export(out, str(tmp_path / "fp32"), "fp32")
    assert done["files"] == ["config.json", "generation_config.json", "model.safetensors"]  # the folder's, kept
    with safe_open(str(tmp_path / "fp32" / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in f.keys() and "model.embed_tokens.weight" in f.keys()
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "fp32"))
    assert model.dtype == torch.float32 and model.lm_head.weight is model.model.embed_tokens.weight
    _, state, _ = model_state(out, torch.float32)
    reference = _dcp_loaded(out)
    assert state.keys() == reference.keys()
    assert all(torch.equal(state[k], reference[k]) for k in state)
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, state[f"hf.{k}"], rtol=0, atol=0, msg=k)
    saved = save_tiny(tmp_path / "unused")  # the folder's own weights: training moved them
    assert not torch.equal(model.model.norm.weight, saved["model.norm.weight"])
    assert _val_loss(model, root) == pytest.approx(rows[-1]["val_loss"], rel=1e-4)

    export(out, str(tmp_path / "bf16"), "bf16")
    half = AutoModelForCausalLM.from_pretrained(str(tmp_path / "bf16"), dtype="auto")
    assert half.dtype == torch.bfloat16
    for k, v in half.state_dict().items():
        torch.testing.assert_close(v, state[f"hf.{k}"].to(torch.bfloat16), rtol=0, atol=0, msg=k)


def test_the_gpt_exports_as_safetensors_and_its_config_and_other_models_are_refused(tmp_path, world_size_1):
    """The built-in GPT: model.safetensors (the tied output layer once) and config.json, which
    load_gpt builds back with the run's weights; a model by import path is an error naming what
    to use instead, and so is a folder that is no run (exit status 2 from the command line)."""
    from distlib.runner.models.export import ExportError, export, load_gpt, main, model_state

    out = str(tmp_path / "gpt")
    cfg = load_config(os.path.join(ROOT, "recipes", "gpt_demo.yaml"),
                      ["train.epochs=1", "data.train_subset=64", "model.args.n_layer=1", "model.args.n_embd=32",
                       "model.args.n_head=2", "train.batch_size=8", "train.sample_tokens=0", "run.progress=plain",
                       f"run.out_dir={out}"])  # fmt: skip
    with built(cfg, distlib.init("gloo")) as trainer:
        assert trainer.fit() == 0
    assert main([out, str(tmp_path / "exported"), "--dtype", "fp32"]) == 0
    model = load_gpt(str(tmp_path / "exported"))
    _, state, _ = model_state(out, torch.float32)
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, state[k], rtol=0, atol=0, msg=k)
    assert model.lm_head.weight is model.wte.weight and model.cfg.vocab_size == 256
    # a run directory of one-file checkpoints (distlib.Checkpointer's, which the runner wrote for
    # dist.shard=none before it saved every mode through ShardedCheckpointer) exports too
    legacy = tmp_path / "legacy"
    (legacy / "checkpoints").mkdir(parents=True)
    shutil.copy(os.path.join(out, "config.yaml"), legacy)
    distlib.Checkpointer(str(legacy / "checkpoints")).save({"model": trainer.model}, epoch=1, step=0, global_step=8,
                                                           fingerprint={})  # fmt: skip
    _, old, path = model_state(str(legacy), torch.float32)
    assert os.path.basename(path) == "epoch0001-step000000.pt" and old.keys() == state.keys()
    assert all(torch.equal(old[k], state[k]) for k in state)

    with open(os.path.join(out, "config.yaml")) as f:
        text = f.read().replace("name: gpt", "name: examples.own_model.spirals:MLP", 1)
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.yaml").write_text(text)
    with pytest.raises(ExportError, match="python -m distlib.checkpoint.sharded"):
        export(str(other), str(tmp_path / "x"))
    assert main([str(tmp_path / "nothing"), str(tmp_path / "x")]) == 2


# ---- the recipes and the baseline --------------------------------------------------------------
LLAMA_DEMO = os.path.join(ROOT, "recipes", "llama_demo.yaml")


@pytest.mark.slow
def test_the_llama_demo_loss_falls_at_two_ranks_in_under_a_minute_and_exports(tmp_path):
    """What `recipes/llama_demo.yaml` promises, on two CPU processes under torchrun: the validation
    loss falls well below the uniform guess (ln 512 = 6.24) within a minute of training; the
    export command writes a folder that transformers loads."""
    import subprocess
    import sys

    from tests.runner.test_e2e import launch

    out = tmp_path / "llama"
    launch([LLAMA_DEMO, f"run.out_dir={out}", "run.progress=plain"], nproc=2, timeout=300)
    rows = metrics(out)
    print(f"llama demo: val_loss {[r['val_loss'] for r in rows]}; train_s {rows[-1]['train_s']}")
    assert rows[0]["val_loss"] < 5.5 and rows[-1]["val_loss"] < rows[0]["val_loss"] - 0.3, rows
    assert rows[-1]["train_s"] < 60 and rows[-1]["world_size"] == 2, rows[-1]
    proc = subprocess.run([sys.executable, "-m", "distlib.runner.export", str(out), str(out / "hf")], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(out / "hf"))
    assert model.dtype == torch.bfloat16 and model.config.vocab_size == 512


@pytest.mark.slow
def test_the_baseline_loop_runs_on_the_cpu():
    """bench/baselines/hf_loop.py on the demo's model, eager, a few steps: its RESULT line."""
    import subprocess
    import sys

    cmd = [sys.executable, os.path.join(ROOT, "bench", "baselines", "hf_loop.py"), "--recipe", LLAMA_DEMO,
           "--batch", "2", "--seq", "32", "--steps", "2", "--warmup", "1", "--no-compile"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = dict(kv.split("=") for kv in proc.stdout.split("RESULT ", 1)[1].split())
    assert result["mode"] == "hf-loop" and float(result["tokens_per_s"]) > 0 and result["mfu"] == "-"
    attention, mlp, norms = 2 * 64 * 64 + 2 * 64 * 32, 3 * 64 * 192, 2 * 64  # 2 of 4 heads for keys and values
    assert int(result["params"]) == 512 * 64 + 2 * (attention + mlp + norms) + 64  # the tied embedding once


@pytest.mark.gpus(1)
@pytest.mark.slow
@pytest.mark.parametrize("overrides", [[], ["train.compile=true"], ["train.cuda_graph=true"],
                                       ["dist.shard=full", "train.compile=true"]],
                         ids=["eager", "compiled", "cuda_graph", "full-compiled"])  # fmt: skip
def test_the_llama_demo_on_a_gpu_in_bf16(tmp_path, overrides):
    """On a GPU: bf16, fused AdamW, eager, compiled per decoder layer, as one CUDA graph (capturable
    AdamW; or the step falls back to eager with a warning saying why), fully sharded and compiled:
    the loss falls as on the CPU and every row has the MFU."""
    from tests.runner.test_e2e import launch

    out = tmp_path / "llama-gpu"
    proc = launch([LLAMA_DEMO, f"run.out_dir={out}", "run.progress=plain", "train.precision=bf16",
                   "train.peak_tflops=100", *overrides], nproc=1, timeout=400)  # fmt: skip
    rows = metrics(out)
    assert rows[-1]["val_loss"] < rows[0]["val_loss"] - 0.3, rows
    assert all(0 < r["mfu"] < 1 for r in rows), rows
    print(proc.stderr[-2000:])


def test_the_header_gives_each_tensors_dtype_shape_and_byte_range(tmp_path):
    from safetensors.torch import save_file

    from distlib.runner.hf.safetensors_folder import _data_offsets

    tensors = {"b": torch.arange(6, dtype=torch.float32), "a": torch.arange(4, dtype=torch.bfloat16).view(2, 2)}
    path = str(tmp_path / "model.safetensors")
    save_file(tensors, path)
    data = open(path, "rb").read()
    offsets = _data_offsets(path)
    assert set(offsets) == {"a", "b"}
    assert (offsets["a"].dtype, offsets["a"].shape, offsets["b"].dtype, offsets["b"].shape) == ("BF16", (2, 2),
                                                                                              "F32", (6,))  # fmt: skip
    for name, t in tensors.items():
        _, _, start, end = offsets[name]
        assert data[start:end] == t.contiguous().view(torch.uint8).numpy().tobytes()
