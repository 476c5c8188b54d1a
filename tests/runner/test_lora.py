"""model.args.lora: peft's LoRA adapters on a tiny Llama saved as a pretrained folder in a temporary
directory. The first step's loss is the base model's (B starts at zero); every dist.shard mode trains
the same adapters step by step at 2 and 3 gloo ranks; the frozen base is bit-unchanged and neither in
the optimizer nor in the checkpoints; a resumed run ends as the uninterrupted one; the export is
peft's (``PeftModel.from_pretrained`` on the base folder gives the run's validation loss) and
``--merge``'s folder loads with ``from_pretrained`` and gives it too; the recipe's mistakes are
ConfigErrors at load time. Nothing is downloaded.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")

import distlib  # noqa: E402
from distlib.runner.config import ConfigError, load_config  # noqa: E402
from tests.conftest import run_ranks  # noqa: E402
from tests.runner.conftest import checkpoints  # noqa: E402
from tests.runner.test_hf_causal_lm import (  # noqa: E402
    SHARDS,
    FirstBatch,
    _transformers_loss,
    _val_loss,
    folder,  # noqa: F401  (the fixture)
    group_kept,
    recipe,
    whole,
)
from tests.runner.test_trainer import built, metrics  # noqa: E402

# r not a power of two, alpha != r; every Linear of the blocks (all-linear) unless a test names a subset
LORA = {"r": 3, "alpha": 5}
SUBSET = {"r": 5, "alpha": 7, "target_modules": ["q_proj", "v_proj", "down_proj"]}


def _lora_run(ctx, root: str, out: str, shard: str, lora: dict, steps: int = 3, overrides: tuple = ()) -> dict:
    """This rank's first batch, step losses, whole weights before and after, the optimizer's
    parameters' names, and the run's metrics rows (rank 0)."""
    from pathlib import Path

    args = {"pretrained": os.path.join(root, "tiny"), "lora": lora}
    cfg = load_config(recipe(Path(root), out, args, steps=steps), [f"dist.shard={shard}", *overrides])
    with group_kept(), built(cfg, ctx) as trainer:
        before = whole(trainer.model)
        names = {id(p): n for n, p in trainer.model.named_parameters()}
        stepped = sorted(names.get(id(p), "?") for g in trainer.step_fn.optimizer.param_groups for p in g["params"])
        trainer.step_fn = step = FirstBatch(trainer.step_fn)
        assert trainer.fit() == 0
        after = whole(trainer.model)
        trainable = sorted(n for n, p in trainer.model.named_parameters() if p.requires_grad)
    return {"batch": step.batch, "losses": step.losses, "before": before, "after": after, "trainable": trainable,
            "stepped": stepped, "rows": metrics(out) if ctx.is_main else []}  # fmt: skip


def _every_mode(ctx, root: str, out: str, lora: dict) -> dict:
    return {shard: _lora_run(ctx, root, os.path.join(out, shard), shard, lora) for shard in SHARDS}


def _adapter(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def test_the_first_loss_is_the_base_models_and_only_the_adapters_train(folder, tmp_path, world_size_1):  # noqa: F811
    """At one rank: the first step's loss is transformers' loss of the base folder on that batch (B
    is zero: the adapters add nothing yet); the trainable parameters are exactly the adapters of the
    targeted layers; the optimizer steps only them; after three steps every frozen weight is bit for
    bit the folder's, every B moved, every A moved."""
    root, saved = folder
    r = _lora_run(distlib.init("gloo"), str(root), str(tmp_path / "run"), "none", SUBSET)
    x, y = r["batch"]
    assert r["losses"][0] == pytest.approx(_transformers_loss(root / "tiny", x, y), rel=1e-5)
    assert r["trainable"] and all(_adapter(n) for n in r["trainable"])
    targeted = {n.split(".")[-4] for n in r["trainable"]}
    assert targeted == {"q_proj", "v_proj", "down_proj"}
    assert len(r["trainable"]) == 2 * 3 * 2  # A and B, 3 targets, 2 layers
    assert r["stepped"] == r["trainable"]
    for k, v in saved.items():  # the base: the folder's weights before and after training
        key = f"hf.{k}"
        if key not in r["after"]:
            key = key.replace(".weight", ".base_layer.weight")
        assert torch.equal(r["before"][key], v) and torch.equal(r["after"][key], v), k
    for key in r["trainable"]:
        n = key
        assert not torch.equal(r["before"][key], r["after"][key]), n
        if ".lora_B." in n:
            assert not r["before"][key].any(), n  # B starts at zero
    a = r["before"]["hf.model.layers.0.self_attn.q_proj.lora_A.default.weight"]
    assert a.shape == (5, 32) and a.abs().max() <= 1 / 32**0.5  # peft's Kaiming-uniform bound


@pytest.mark.parametrize("world_size", [2, 3])
def test_every_shard_mode_trains_the_same_adapters_step_by_step(folder, tmp_path, world_size):  # noqa: F811
    """At 2 and 3 ranks, dist.shard none, optimizer (ZeRO-1 over the adapters) and full (FSDP2 units
    of frozen and trainable parameters): the same losses at every step and the same adapters after
    (1e-5), the frozen base bit-unchanged in each."""
    root, saved = folder
    got = run_ranks(_every_mode, world_size, str(root), str(tmp_path), LORA, timeout=300)
    for rank, results in enumerate(got):
        ref = results["none"]
        for shard in SHARDS:
            r = results[shard]
            assert r["losses"] == pytest.approx(ref["losses"], rel=1e-5, abs=1e-6), (shard, rank)
            for k, v in r["after"].items():
                if _adapter(k):
                    torch.testing.assert_close(v, ref["after"][k], rtol=1e-5, atol=1e-6, msg=f"{shard}: {k}")
                else:
                    assert torch.equal(v, r["before"][k]), (shard, k)
            assert r["stepped"] == r["trainable"]
        assert ref["losses"][-1] != ref["losses"][0]


def _two_epochs(ctx, root: str, out: str, shard: str, ema: float = 0.0) -> list[dict]:
    from pathlib import Path

    args = {"pretrained": os.path.join(root, "tiny"), "lora": SUBSET}
    cfg = load_config(recipe(Path(root), out, args, epochs=2),
                      [f"dist.shard={shard}", "run.checkpoint_every=1", f"train.ema={ema}"])  # fmt: skip
    with built(cfg, ctx) as trainer:
        assert trainer.fit() == 0
    return metrics(out) if ctx.is_main else []


@pytest.mark.parametrize(("shard", "ema"), [("optimizer", 0.0), ("full", 0.0), ("optimizer", 0.9)])
def test_a_resumed_lora_run_ends_as_the_uninterrupted_one_and_its_checkpoints_hold_no_base(
    folder,  # noqa: F811
    tmp_path,
    shard,
    ema,
):
    """Two epochs at two ranks; the checkpoints hold the adapters and their optimizer state, not the
    frozen base (nor, with train.ema, the average's, which shares the base); the last one removed, the
    run again resumes after epoch 1 (the base read from the folder again) and its rows equal the
    uninterrupted run's exactly."""
    import torch.distributed.checkpoint as dcp

    root, _ = folder
    out = str(tmp_path / "run")
    ref = run_ranks(_two_epochs, 2, str(root), out, shard, ema, timeout=300)[0]
    saved = checkpoints(out)
    assert len(saved) == 2
    meta = dcp.FileSystemReader(os.path.join(out, "checkpoints", saved[-1])).read_metadata().state_dict_metadata
    model_keys = [k for k in meta if k.startswith("model.")]
    assert model_keys and all(_adapter(k) for k in model_keys), [k for k in model_keys if not _adapter(k)]
    averaged = [k for k in meta if k.startswith("ema.") and k.endswith("weight")]
    assert bool(averaged) == (ema > 0) and all(_adapter(k) for k in averaged), averaged
    assert any(k.startswith("optimizer.state.") and _adapter(k) for k in meta)
    assert not any(k.startswith("optimizer.state.") and not _adapter(k) for k in meta)
    shutil.rmtree(os.path.join(out, "checkpoints", saved[-1]))
    again = run_ranks(_two_epochs, 2, str(root), out, shard, ema, timeout=300)[0]
    keys = ("epoch", "train_loss", "val_loss")
    assert [{k: r[k] for k in keys} for r in again] == [{k: r[k] for k in keys} for r in ref]


def _trained(ctx, root: str, out: str, shard: str) -> list[dict]:
    return _lora_run(ctx, root, out, shard, LORA)["rows"]


@pytest.mark.parametrize("shard", ["optimizer", "full"])
def test_the_adapters_export_as_peft_saves_them_and_merged_as_a_transformers_folder(folder, tmp_path, shard):  # noqa: F811
    """A LoRA run at two ranks (ZeRO-1 or FSDP2 shards of the adapters), exported in fp32: the folder
    holds peft's two files under peft's own key names (those get_peft_model_state_dict gives), and
    ``PeftModel.from_pretrained(base, folder)`` on the base folder gives the run's final validation
    loss; ``--merge`` writes a folder AutoModelForCausalLM loads, with the same loss."""
    from peft import PeftModel, get_peft_model, get_peft_model_state_dict
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from distlib.runner.models.export import main
    from distlib.runner.models.lora import lora_config

    root, _ = folder
    out = str(tmp_path / "run")
    rows = run_ranks(_trained, 2, str(root), out, shard, timeout=300)[0]
    assert main([out, str(tmp_path / "adapters"), "--dtype", "fp32"]) == 0
    assert sorted(os.listdir(tmp_path / "adapters")) == ["README.md", "adapter_config.json",
                                                         "adapter_model.safetensors"]  # fmt: skip
    fresh = get_peft_model(AutoModelForCausalLM.from_pretrained(str(root / "tiny")), lora_config(LORA))
    with safe_open(str(tmp_path / "adapters" / "adapter_model.safetensors"), "pt") as f:
        assert sorted(f.keys()) == sorted(get_peft_model_state_dict(fresh))
    base = AutoModelForCausalLM.from_pretrained(str(root / "tiny"), dtype=torch.float32)
    model = PeftModel.from_pretrained(base, str(tmp_path / "adapters"))
    assert _val_loss(model, root) == pytest.approx(rows[-1]["val_loss"], rel=1e-4)
    assert _val_loss(AutoModelForCausalLM.from_pretrained(str(root / "tiny")), root) != pytest.approx(
        rows[-1]["val_loss"], rel=1e-4
    )

    assert main([out, str(tmp_path / "merged"), "--dtype", "fp32", "--merge"]) == 0
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"))
    assert not any(".lora_" in k or "base_layer" in k for k in merged.state_dict())
    assert _val_loss(merged, root) == pytest.approx(rows[-1]["val_loss"], rel=1e-4)


# ---- mistakes, at load time --------------------------------------------------------------------
@pytest.mark.parametrize(
    ("lora", "words"),
    [
        ({"r": 0}, ["lora.r"]),
        ({"rank": 4, "alpha": -1}, ["lora.rank: unknown key", "lora.alpha"]),
        ({"dropout": 1.5, "target_modules": []}, ["lora.dropout", "lora.target_modules"]),
    ],
)
def test_a_mistake_in_lora_is_a_config_error_at_load_time(folder, tmp_path, lora, words):  # noqa: F811
    root, _ = folder
    path = recipe(root, str(tmp_path / "r"), {"pretrained": str(root / "tiny"), "lora": lora})
    with pytest.raises(ConfigError) as e:
        load_config(path)
    text = "\n".join(e.value.problems)
    for w in words:
        assert w in text, text


def test_without_peft_the_check_says_how_to_install_it(folder, tmp_path, monkeypatch):  # noqa: F811
    import builtins

    real = builtins.__import__

    def without_peft(name, *args, **kwargs):
        if name == "peft" or name.startswith("peft."):
            raise ImportError("No module named 'peft'")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", without_peft)
    root, _ = folder
    path = recipe(root, str(tmp_path / "r"), {"pretrained": str(root / "tiny"), "lora": LORA})
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert len(e.value.problems) == 1 and "pip install 'distlib[peft]'" in e.value.problems[0]


# ---- kill -9 and resume, end to end ------------------------------------------------------------
@pytest.mark.slow
def test_a_lora_run_killed_with_sigkill_resumes_bit_for_bit(folder, tmp_path):  # noqa: F811
    """``python launch.py`` of a LoRA recipe (ZeRO-1's code path at world size 1) killed with SIGKILL
    once its first checkpoint is committed, then run again with the same command: it resumes from
    that checkpoint, and its rows and final adapters and optimizer state equal an uninterrupted run's
    bit for bit."""
    import signal
    import subprocess
    import sys
    import time

    from tests.conftest import ROOT
    from tests.runner.conftest import saved, step_name

    root, _ = folder
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}

    def command(out: str) -> list[str]:
        path = recipe(root, out, {"pretrained": str(root / "tiny"), "lora": SUBSET}, epochs=6)
        return [sys.executable, "launch.py", path, "dist.shard=optimizer", "run.checkpoint_every=1"]

    ref, out = str(tmp_path / "ref"), str(tmp_path / "killed")
    assert subprocess.run(command(ref), cwd=ROOT, env=env, capture_output=True).returncode == 0
    proc = subprocess.Popen(command(out), cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    first = os.path.join(out, "checkpoints", step_name(2))
    end = time.monotonic() + 300
    while not os.path.exists(first) and proc.poll() is None and time.monotonic() < end:
        time.sleep(0.02)
    assert proc.poll() is None, "the run ended before it could be killed"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert len(metrics(out)) < 6
    again = subprocess.run(command(out), cwd=ROOT, env=env, capture_output=True, text=True)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resuming from" in again.stderr
    keys = ("epoch", "step", "train_loss", "val_loss", "lr")
    assert [{k: r[k] for k in keys} for r in metrics(out)] == [{k: r[k] for k in keys} for r in metrics(ref)]
    a, b = saved(out), saved(ref)
    for name in ("model", "optimizer"):
        flat_a = {k: v for k, v in torch.utils._pytree.tree_flatten_with_path(a[name])[0]}
        flat_b = {k: v for k, v in torch.utils._pytree.tree_flatten_with_path(b[name])[0]}
        assert flat_a.keys() == flat_b.keys()
        for k in flat_a:
            va, vb = flat_a[k], flat_b[k]
            assert torch.equal(va, vb) if isinstance(va, torch.Tensor) else va == vb, (name, k)
    assert all(_adapter(k) for k in a["model"])


# ---- the memory plan ---------------------------------------------------------------------------
def test_the_plan_counts_no_gradient_nor_optimizer_state_for_the_frozen_base(folder, tmp_path, world_size_1):  # noqa: F811
    """The plan of a bf16 LoRA recipe: the frozen base in bf16 (2 bytes an element), the adapters in
    fp32 with their gradients and AdamW's two moments, nothing more; the full recipe's plan holds
    fp32 weights, gradients and moments for every parameter; the warm-up's and the checkpoint's
    copies are of the adapters alone."""
    from distlib.runner.training.memory_plan import measure_step, plan, step_spec

    root, _ = folder
    parts, models = {}, {}
    for name, extra in (("full", {}), ("lora", {"lora": SUBSET})):
        cfg = load_config(recipe(root, str(tmp_path / name), {"pretrained": str(root / "tiny"), **extra}),
                          ["train.precision=bf16", "dist.shard=none"])  # fmt: skip
        spec = step_spec(cfg)
        models[name] = spec.build()
        parts[name] = measure_step(spec, shard="none", world_size=1, batch=2, checkpointing="none", precision="bf16")
        if name == "lora":
            mode = plan(cfg, 1, shards=("none",), checkpointing=("none",), batches=False).modes["none"]
    every = sum(p.numel() for p in models["full"].parameters())
    trained = sum(p.numel() for p in models["lora"].parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in models["lora"].parameters() if not p.requires_grad)
    assert frozen == every and 0 < trained < every / 10
    buffers = sum(b.numel() * b.element_size() for b in models["full"].buffers())  # rotary frequencies
    full, lora = parts["full"], parts["lora"]
    assert full.parts["parameters"] == 4 * every + buffers and full.frozen == 0
    assert full.parts["optimizer state"] == pytest.approx(8 * every, abs=4096)
    assert lora.parts["parameters"] == 2 * frozen + 4 * trained + buffers and lora.frozen == 2 * frozen
    assert lora.parts["optimizer state"] == pytest.approx(8 * trained, abs=4096)  # and AdamW's step counters
    assert lora.parts["gradients"] <= 4 * trained
    assert mode.warm_up_copy == 4 * trained + buffers
    assert mode.staging == 4 * trained + buffers + lora.parts["optimizer state"]


def test_the_weight_average_of_a_lora_run_holds_the_adapters_not_the_base(folder, tmp_path, world_size_1):  # noqa: F811
    """train.ema with adapters: distlib.EMA shares the frozen base (no copy of it), and the plan counts
    the average of the adapters and the buffers alone."""
    from distlib.runner.training.memory_plan import measure_step, step_spec

    root, _ = folder
    held = {}
    for ema in ("0", "0.99"):
        cfg = load_config(recipe(root, str(tmp_path / ema), {"pretrained": str(root / "tiny"), "lora": SUBSET}),
                          ["train.precision=bf16", "dist.shard=none", f"train.ema={ema}"])  # fmt: skip
        spec = step_spec(cfg)
        model = spec.build()
        held[ema] = measure_step(spec, shard="none", world_size=1, batch=2, checkpointing="none", precision="bf16")
    trained = [p for p in model.parameters() if p.requires_grad]
    buffers = sum(b.numel() * b.element_size() for b in model.buffers() if b.is_floating_point())
    assert held["0.99"].parts["parameters"] - held["0"].parts["parameters"] == 4 * sum(
        p.numel() for p in trained) + buffers  # fmt: skip
    average = distlib.EMA(model, 0.99)
    frozen = [p for p in model.parameters() if not p.requires_grad]
    shared = {id(p) for p in average.module.parameters()}
    assert all(id(p) in shared for p in frozen) and not any(id(p) in shared for p in trained)


def test_with_a_compute_dtype_the_frozen_base_is_built_one_parameter_at_a_time(tmp_path, monkeypatch):
    """Where the compute dtype is bf16 (a GPU; patched here on the CPU), the runner builds a LoRA model
    through ``build_converted``, never holding the base in fp32: the same weights, dtypes and random
    state as the plain build followed by the cast, adapters included, and with float8 the same layers
    swapped (torchao emulates float8 on the CPU); a full fine-tune keeps the plain build."""
    from distlib.runner.models.parameters import cast_frozen
    from distlib.runner.training import build_order
    from distlib.runner.training.float8 import convert_model

    config = {"model_type": "llama", "hidden_size": 48, "intermediate_size": 96, "num_hidden_layers": 3,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 300, "pad_token_id": 6}  # fmt: skip
    (tmp_path / "text.txt").write_bytes(bytes(range(256)) * 8)
    real = distlib.build_converted
    calls = []
    monkeypatch.setattr(distlib, "build_converted", lambda *a: calls.append(a) or real(*a))
    monkeypatch.setattr(build_order, "autocast_dtype", lambda precision, device: torch.bfloat16)
    fp8 = ["train.precision=fp8", "train.fp8_layers=all"]
    cases = [(SUBSET, ["train.precision=bf16"], 1), (None, ["train.precision=bf16"], 0)]
    try:
        import torchao  # noqa: F401
    except ImportError:
        pass
    else:
        cases.append((SUBSET, fp8, 1))
    for lora, overrides, converted in cases:
        args = {"config": config, **({"lora": lora} if lora else {})}
        cfg = load_config(recipe(tmp_path, str(tmp_path / "run"), args), overrides)
        calls.clear()
        torch.manual_seed(11)
        got = build_order.build_model(cfg, torch.device("cpu"), {})
        got_rng = torch.get_rng_state()
        assert len(calls) == converted
        torch.manual_seed(11)
        from distlib.runner import components

        want = components.build("model", cfg.model.name, cfg.model.args, provided={})
        cast_frozen(want, torch.bfloat16)
        swapped = convert_model(cfg, want, torch.device("cpu"))
        assert bool(swapped) == (overrides == fp8)
        want.load_pretrained()  # stage 5: the adapters drawn from the run's seed
        assert [type(m).__name__ for m in got.modules()] == [type(m).__name__ for m in want.modules()]
        assert torch.equal(got_rng, torch.get_rng_state())
        want_p, got_p = dict(want.named_parameters()), dict(got.named_parameters())
        assert want_p.keys() == got_p.keys()
        for n, w in want_p.items():
            assert got_p[n].dtype == w.dtype and got_p[n].requires_grad == w.requires_grad, n
            assert torch.equal(got_p[n], w), n
        frozen = [p for p in got.parameters() if not p.requires_grad]
        assert bool(frozen) == bool(lora) and all(p.dtype == torch.bfloat16 for p in frozen)


def test_a_lora_models_flops_count_no_weight_gradient_for_the_frozen_base():
    """MFU's FLOPs per token with LoRA: 4 per frozen weight (forward, the input's gradient), 6 per
    adapter weight, attention as without adapters; without LoRA, 6 per weight."""
    from distlib.runner.models.hf_causal_lm import hf_causal_lm
    from distlib.runner.models.lora import adapters

    config = {"model_type": "llama", "hidden_size": 48, "intermediate_size": 96, "num_hidden_layers": 3,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 300}  # fmt: skip
    plain = hf_causal_lm(config=config)
    adapted = hf_causal_lm(config=config, lora=SUBSET)
    weights = plain.active_params(embeddings=False)
    attention = plain.flops_per_token(64) - 6 * weights
    assert attention == 6 * 3 * 4 * (12 + 12) * 64
    n_adapters = sum(p.numel() for _, p in adapters(adapted.hf))
    assert 0 < n_adapters and adapted.active_params(embeddings=False) == weights + n_adapters
    assert adapted.flops_per_token(64) == 4 * weights + 6 * n_adapters + attention


# ---- conversations -----------------------------------------------------------------------------
def _chat_run(ctx, out: str, cache: str) -> dict:
    from tests.conftest import ROOT

    overrides = [f"run.out_dir={out}", f"data.cache_dir={cache}", "data.args.eval_answers=0", "train.max_steps=3",
                 "train.batch_size=4", "dist.shard=full", "run.progress=plain",
                 "model.args.lora={r: 3, alpha: 5}"]  # fmt: skip
    cfg = load_config(os.path.join(ROOT, "recipes", "sft_demo.yaml"), overrides)
    with group_kept(), built(cfg, ctx) as trainer:
        before = whole(trainer.model)
        trainer.step_fn = step = _DictBatches(trainer.step_fn)
        assert trainer.fit() == 0
        after = whole(trainer.model)
    return {"batch": step.batch, "losses": step.losses, "before": before, "after": after}


class _DictBatches(FirstBatch):
    """FirstBatch for chat batches: ``x`` a dict of tensors."""

    def __call__(self, x, y: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        if self.batch is None:
            self.batch = ({k: v.detach().cpu().clone() for k, v in x.items()}, y.detach().cpu().clone())
        loss = self.step(x, y)
        self.losses.append(loss.item())
        return loss


def test_adapters_train_on_conversations(tmp_path):
    """recipes/sft_demo.yaml (chat batches: a dict of input_ids and position_ids, prompts masked) with
    LoRA under FSDP2 at two ranks: the adapters move, the base does not, the losses are finite."""
    got = run_ranks(_chat_run, 2, str(tmp_path / "run"), str(tmp_path), timeout=300)
    for r in got:
        x, _ = r["batch"]
        assert isinstance(x, dict) and "position_ids" in x
        assert all(loss == loss and loss > 0 for loss in r["losses"])
        moved = [k for k in r["after"] if not torch.equal(r["after"][k], r["before"][k])]
        assert moved and all(_adapter(k) for k in moved)
        assert any(".lora_B." in k for k in moved)


@pytest.mark.slow
def test_the_benchmark_runs_tiny_on_the_cpu(capsys):
    """bench/lora.py at tiny shapes: every case runs in its process and gives its row."""
    from bench import lora as bench

    assert bench.main(["--tiny", "--steps", "1", "--warmup", "1"]) == 0
    out = capsys.readouterr().out
    for case in bench.CASES:
        assert f"| {case} |" in out
