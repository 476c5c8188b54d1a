"""train.compile, train.activation_checkpointing and model.block_class in the runner: the GPT demo
compiled per block (with and without activation checkpointing) trains to the eager losses in every
shard mode at one and two gloo ranks, compiling one graph for all its blocks and nothing more as
steps go by; YAML booleans keep old recipes working; a model without blocks is compiled whole, and
what cannot work is a ConfigError naming the key; torch.compile's caches go to a stable directory."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

import distlib
from distlib.runner.config import ConfigError, load_config
from distlib.runner.training.compilation import apply_block_settings, compile_cache_dir, use_compile_cache
from distlib.step.activation_checkpointing import checkpointing_of
from tests.conftest import ROOT, run_ranks
from tests.runner.test_sharding import DEMO, STEPS, TINY
from tests.runner.test_trainer import built, metrics

AOT = "train.compile_backend=aot_eager"  # AOTAutograd's graphs, run without inductor's C++ build
TWO_BLOCKS = "model.args.n_layer=2"
CNN = os.path.join(ROOT, "recipes", "demo.yaml")  # small_cnn: no blocks


# ---- the recipe's keys ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("value", "want"),
    [("true", "auto"), ("false", "none"), ("yes", "auto"), ("off", "none"), ("blocks", "blocks"), ("model", "model")],
)
def test_train_compile_takes_yaml_booleans_and_its_modes(value, want):
    assert load_config(DEMO, [f"train.compile={value}"]).train.compile == want


def test_yaml_booleans_in_a_recipe_file_and_activation_checkpointing(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("train:\n  compile: true\n  activation_checkpointing: true\n")
    cfg = load_config(str(recipe), [])
    assert (cfg.train.compile, cfg.train.activation_checkpointing) == ("auto", "full")
    assert load_config(DEMO, ["train.activation_checkpointing=selective"]).train.activation_checkpointing == "selective"
    assert load_config(DEMO, ["train.activation_checkpointing=no"]).train.activation_checkpointing == "none"
    with pytest.raises(ConfigError, match="train.compile: expected one of 'none', 'auto', 'blocks', 'model'"):
        load_config(DEMO, ["train.compile=fast"])
    with pytest.raises(ConfigError, match="train.activation_checkpointing: expected one of"):
        load_config(DEMO, ["train.activation_checkpointing=2"])


@pytest.mark.parametrize(
    ("overrides", "names"),
    [
        (["dist.shard=full", "train.compile=model"], ["train.compile=model", "train.compile=blocks"]),
        (["dist.mode=fallback", "train.compile=true"], ["train.compile=auto", "dist.mode=process_per_gpu"]),
        (["dist.mode=fallback", "train.activation_checkpointing=full"], ["train.activation_checkpointing=full"]),
    ],
)
def test_what_cannot_work_is_a_config_error_naming_the_key(overrides, names):
    with pytest.raises(ConfigError) as e:
        load_config(DEMO, overrides)
    assert len(e.value.problems) == 1, e.value.problems
    for name in names:
        assert name in e.value.problems[0], e.value.problems[0]


class NoBlocks(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))


@pytest.mark.parametrize(
    ("overrides", "error"),
    [
        (["train.compile=blocks"], "train.compile=blocks: small_cnn has no blocks"),
        (["train.activation_checkpointing=full"], "train.activation_checkpointing=full: small_cnn has no blocks"),
        (["train.compile=true", "dist.shard=full"], "a fully sharded model is compiled per block"),
        (["train.compile=true", "model.block_class=Conv"], "model.block_class='Conv': small_cnn has no submodule"),
    ],
)
def test_a_model_without_blocks_is_compiled_whole_or_refused_naming_the_key(overrides, error):
    model = NoBlocks()
    cfg = load_config(CNN, [AOT])
    assert apply_block_settings(cfg, model) is False  # nothing asked: nothing done
    assert apply_block_settings(load_config(CNN, ["train.compile=true"]), model) is True
    with pytest.raises(ConfigError, match=error.replace("(", r"\(")):
        apply_block_settings(load_config(CNN, [AOT, *overrides]), model)


def test_model_block_class_names_the_blocks():
    model = NoBlocks()
    cfg = load_config(CNN, [AOT, "train.compile=true", "model.block_class=Linear",
                             "train.activation_checkpointing=selective"])  # fmt: skip
    assert apply_block_settings(cfg, model) is False  # compiled per block, not whole
    assert all(m._compiled_call_impl is not None for m in model.layers)
    assert [checkpointing_of(m) for m in model.layers] == ["selective"] * 3


def test_compile_caches_go_to_a_stable_directory(tmp_path, monkeypatch):
    """run.compile_cache_dir, else $TORCHINDUCTOR_CACHE_DIR, else the user's cache (torch's own default
    is a temporary directory); set for this process before anything compiles."""
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert compile_cache_dir(load_config(DEMO, [])) == str(tmp_path / "xdg" / "distlib" / "compile")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "env"))
    assert compile_cache_dir(load_config(DEMO, [])) == str(tmp_path / "env")
    cfg = load_config(DEMO, [f"run.compile_cache_dir={tmp_path / 'mine'}"])
    assert use_compile_cache(cfg) == str(tmp_path / "mine") == os.environ["TORCHINDUCTOR_CACHE_DIR"]
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    assert cache_dir() == str(tmp_path / "mine")  # where inductor writes its FX graphs and AOTAutograd's cache


def test_the_compiler_stage_starts_inductors_compile_workers_and_nothing_else_does(monkeypatch, tmp_path):
    """With inductor the compiler stage starts its kernel-compiling processes (torch would start
    them at the first graph); with another backend, eager, or the fallback mode it starts none."""
    import torch._inductor.async_compile as async_compile

    from distlib.runner.training.compilation import load_compiler

    started = []
    monkeypatch.setattr(async_compile, "maybe_warm_pool", lambda: started.append(True))
    cache = f"run.compile_cache_dir={tmp_path}"
    assert load_compiler(load_config(DEMO, ["train.compile=blocks", "train.compile_backend=inductor", cache]))
    assert started == [True]
    assert load_compiler(load_config(DEMO, ["train.compile=blocks", AOT, cache]))
    assert not load_compiler(load_config(DEMO, ["train.compile=none", cache]))
    assert started == [True]


@pytest.mark.gpus(1)
def test_on_a_gpu_the_compile_workers_run_once_the_compiler_stage_is_over(tmp_path):
    """A fresh process: after ``load_compiler`` inductor's pool of compile workers exists and takes
    work, before anything was compiled."""
    import subprocess
    import sys

    code = (
        "import torch; from distlib.runner.config import load_config; "
        "from distlib.runner.training.compilation import load_compiler; "
        f"assert load_compiler(load_config({DEMO!r}, ['train.compile=blocks', 'run.compile_cache_dir={tmp_path}'])); "
        "from torch._inductor.async_compile import AsyncCompile, _pool_set; "
        "from torch._dynamo.utils import counters; "
        "assert counters['stats']['unique_graphs'] == 0; "
        "print('pools', len(_pool_set)); "  # torch creates one at the first graph, or the compiler stage did
        "AsyncCompile.wait_pool_ready(timeout=120); print('ready', AsyncCompile.use_process_pool())"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "pools 1" in out.stdout and "ready True" in out.stdout, out.stdout


# ---- the eager losses, compiled per block, in every shard mode ------------------------------------
class Counted:
    """The trainer's step, recording this rank's loss and the graphs dynamo has compiled so far."""

    def __init__(self, step, losses: list[float], graphs: list[int]):
        self.step, self.losses, self.graphs = step, losses, graphs

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        from torch._dynamo.utils import counters

        loss = self.step(x, y)
        self.losses.append(loss.item())
        self.graphs.append(counters["stats"]["unique_graphs"])
        return loss

    def __getattr__(self, name: str):
        return getattr(self.step, name)


def _trained(ctx, shard: str, out_dir: str, *extra: str) -> dict:
    """The tiny two-block GPT demo: this rank's losses, the graphs compiled after each step, the
    blocks compiled and checkpointed, and the metrics rows."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    cfg = load_config(DEMO, [*TINY, TWO_BLOCKS, f"dist.shard={shard}", f"run.out_dir={out_dir}", *extra])
    losses, graphs = [], []
    with built(cfg, ctx) as trainer:
        compiled = [m._compiled_call_impl is not None for m in trainer.model.modules()
                    if getattr(m, "_compiled_call_impl", None) is not None]  # fmt: skip
        blocks = [getattr(b, "_compiled_call_impl", None) is not None for b in trainer.model.blocks]
        checkpointing = [checkpointing_of(b) for b in trainer.model.blocks]
        trainer.step_fn = Counted(trainer.step_fn, losses, graphs)
        assert trainer.fit() == 0
    rows = metrics(out_dir) if ctx.is_main else []
    return {"losses": losses, "graphs": graphs, "compiled": len(compiled), "blocks": blocks,
            "checkpointing": checkpointing, "rows": rows}  # fmt: skip


def _run(world_size: int, *args) -> list[dict]:
    if world_size == 1:
        return [_trained(distlib.init("gloo"), *args)]
    return run_ranks(_trained, world_size, *args, timeout=300)


# each shard mode compiled per block, two of them with activation checkpointing too
MODES = [
    ("none", ["train.compile=true"]),
    ("optimizer", ["train.compile=blocks", "train.activation_checkpointing=selective"]),
    ("full", ["train.compile=blocks", "train.activation_checkpointing=full"]),
]


@pytest.mark.parametrize("world_size", [1, 2])
def test_per_block_compile_and_checkpointing_train_to_the_eager_losses_in_every_shard_mode(
    tmp_path, world_size, world_size_1
):
    """Each rank's loss at each of the 16 steps and the epochs' validation losses as the eager,
    replicated run's (1e-5 relative: the modes and the compiled graphs sum in other orders); the two
    blocks and nothing else compiled, into one graph for both (a few more for evaluation and the
    sample's no-grad forwards), and no graph compiled after the second step."""
    ref = _run(world_size, "none", str(tmp_path / "eager"))
    for shard, extra in MODES:
        got = _run(world_size, shard, str(tmp_path / shard), AOT, *extra)
        for r in range(world_size):
            g, want = got[r], ref[r]
            assert len(g["losses"]) == STEPS
            assert g["losses"] == pytest.approx(want["losses"], rel=1e-5), (shard, r)
            assert g["blocks"] == [True, True] and g["compiled"] == 2, (shard, g)
            mode = next((e.split("=")[1] for e in extra if "activation_checkpointing" in e), "none")
            assert g["checkpointing"] == [mode] * 2
            assert 1 <= g["graphs"][0] <= 2, g["graphs"]  # the training forward: one graph for both blocks
            assert len(set(g["graphs"][1:])) <= 2, g["graphs"]  # evaluation after epoch 1 may add one
            assert g["graphs"][-1] <= 4, g["graphs"]
        rows, want_rows = got[0]["rows"], ref[0]["rows"]
        assert [row["val_loss"] for row in rows] == pytest.approx([row["val_loss"] for row in want_rows], rel=1e-5)
    assert ref[0]["losses"][-1] < ref[0]["losses"][0] - 0.3  # it learns


# ---- GPUs ----------------------------------------------------------------------------------------
@pytest.mark.gpus(1)
@pytest.mark.slow
@pytest.mark.parametrize(
    ("shard", "overrides"),
    [
        ("none", ["train.compile=blocks", "train.cuda_graph=true"]),
        ("optimizer", ["train.compile=blocks"]),
        ("optimizer", ["train.compile=blocks", "train.cuda_graph=true", "train.activation_checkpointing=selective"]),
        ("full", ["train.compile=blocks", "train.activation_checkpointing=full"]),
        ("none", ["train.compile=model", "train.activation_checkpointing=full"]),
    ],
    ids=["none-graph", "optimizer", "optimizer-graph-selective", "full-checkpointed", "none-whole-checkpointed"],
)
def test_the_gpt_demo_compiled_per_block_trains_on_one_gpu(tmp_path, shard, overrides):
    """Inductor per block inside the whole-step CUDA graph, under optimizer sharding (its graph and
    checkpointing captured too) and under FSDP2 with checkpointed blocks; the whole model compiled
    around checkpointed blocks. bf16; the loss falls."""
    from tests.runner.test_e2e import launch

    out = tmp_path / "gpt"
    launch([DEMO, f"run.out_dir={out}", "run.progress=plain", "train.precision=bf16", "train.epochs=2",
            f"dist.shard={shard}", f"run.compile_cache_dir={tmp_path / 'cache'}", *overrides], nproc=1,
           timeout=400)  # fmt: skip
    rows = metrics(out)
    assert rows[-1]["val_loss"] < rows[0]["val_loss"] and rows[0]["val_loss"] < 3.5, rows
    assert os.listdir(tmp_path / "cache")  # inductor's caches went where the recipe said


def test_the_loss_is_compiled_with_the_model_and_gives_the_eager_loss_and_gradient():
    from distlib.runner.tasks.losses import cross_entropy
    from distlib.runner.training.compilation import compiled_loss

    assert compiled_loss(load_config(DEMO, ["train.compile=none"]), cross_entropy) is cross_entropy
    fn = compiled_loss(load_config(DEMO, [AOT, "train.compile=blocks"]), cross_entropy)
    assert fn is not cross_entropy
    logits = torch.randn(2, 5, 11, dtype=torch.bfloat16, requires_grad=True)
    targets = torch.randint(0, 11, (2, 5))
    want = cross_entropy(logits, targets)
    (want_grad,) = torch.autograd.grad(want, logits)
    got = fn(logits, targets)
    (got_grad,) = torch.autograd.grad(got, logits)
    assert got.dtype == torch.float32 and torch.equal(got, want)
    torch.testing.assert_close(got_grad, want_grad, rtol=0, atol=0)
