"""The memory plan (distlib/runner/training/memory_plan.py, docs/memory_plan.md): its peak against the
CPU allocator's for the runner's own step, its parts, the command line, and the verdict and refusal
at launch."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from distlib.runner.config import load_config
from distlib.runner.training import memory_plan, plan_cache
from distlib.runner.training.memory_plan import fake_world, measure_step, plan, step_memory, step_spec
from tests.conftest import ROOT


@pytest.fixture(autouse=True)
def _in_root(monkeypatch, world_size_1, tmp_path):
    monkeypatch.chdir(ROOT)  # the recipes' relative paths
    # the plans kept at launch: the test's own (torch.compile's cache stays the user's: its kernels warm)
    monkeypatch.setattr(plan_cache, "cache_dir", lambda cfg: str(tmp_path / "plans"))


def _tiny(*overrides: str):
    return load_config("recipes/gpt_demo.yaml", ["train.batch_size=16", *overrides])


@pytest.mark.parametrize(
    ("shard", "tolerance"),
    # the same storages as the runner's step, to the byte but for small temporaries
    [("none", 0.01), ("optimizer", 0.01), ("full", 0.02)],
)
def test_the_plan_is_the_cpu_allocators_peak_of_the_runners_step_at_two_fake_ranks(shard, tolerance):
    """The runner's model and step (GradSync's flat buckets, the sharded optimizer, shard_model) built
    and run for real under a fake process group of 2 ranks, its allocations recorded by torch's
    profiler (bench/plan_accuracy.py --tiny): the plan's peak, a 6-block GPT extrapolated from 1, 2 and 3."""
    from bench import plan_accuracy

    cfg, per_rank = plan_accuracy.config_of("gpt-tiny", 2, shard, "none", False)
    planned = plan(cfg, 2, shards=(shard,), checkpointing=("none",), batches=False, warm_up=False).peak()
    measured = plan_accuracy.measure(cfg, 2, per_rank, torch.device("cpu"))["step"]
    assert abs(planned / measured - 1) < tolerance, (planned, measured)


@pytest.mark.parametrize("shard", ["none", "full"])
def test_the_measurement_of_a_float8_recipe_steps_the_float8_model_the_runner_builds(shard):
    """bench.plan_accuracy measures the runner's step: with train.precision=fp8 its model's blocks' Linears
    are float8 ones (emulated on the CPU), converted as Trainer.build_model converts them, before the
    sharding under dist.shard=full; 6 blocks of 4 Linears at train.fp8_layers=all."""
    pytest.importorskip("torchao")
    from bench import plan_accuracy

    cfg, per_rank = plan_accuracy.config_of("gpt-tiny", 2, shard, "none", False,
                                            ("train.precision=fp8", "train.fp8_layers=all"))  # fmt: skip
    assert plan_accuracy.measure(cfg, 2, per_rank, torch.device("cpu"))["float8_layers"] == 24
    cfg, per_rank = plan_accuracy.config_of("gpt-tiny", 2, shard, "none", False)
    assert plan_accuracy.measure(cfg, 2, per_rank, torch.device("cpu"))["float8_layers"] == 0


@pytest.mark.parametrize("shard", ["none", "full"])
def test_the_plan_of_a_hugging_face_llama_is_the_cpu_allocators_peak(shard):
    """A 6-layer transformers Llama with grouped-query attention (``hf_causal_lm``) at 2 fake ranks:
    the plan on fake tensors against the runner's step on real ones. transformers cannot read fake
    position ids and would make an attention mask and repeat the keys and values for every head
    (6-7% over here, 2.5 GiB for a Llama-3.2-1B shape at 8 x 2048 tokens); the real step makes neither."""
    pytest.importorskip("transformers")
    from bench import plan_accuracy

    cfg, per_rank = plan_accuracy.config_of("llama-tiny", 2, shard, "none", False)
    planned = plan(cfg, 2, shards=(shard,), checkpointing=("none",), batches=False, warm_up=False).peak()
    measured = plan_accuracy.measure(cfg, 2, per_rank, torch.device("cpu"))["step"]
    assert abs(planned / measured - 1) < 0.02, (planned, measured)


@pytest.mark.parametrize(("shard", "world"), [("none", 1), ("full", 2)])
def test_compiled_blocks_are_planned_as_inductor_keeps_them(shard, world):
    """train.compile=blocks: each block is planned as inductor compiles it (its decompositions and the
    min-cut partitioner, which recomputes cheap pointwise work in backward instead of keeping it), not
    eager. The 6-layer transformers Llama against the CPU allocator's peak of the runner's step with
    its blocks compiled by inductor on the CPU: within 1% (planned eager, 1.21 and 1.23 of it). Against
    the GPU's peaks: BENCHMARKS.md, "Memory plan"."""
    pytest.importorskip("transformers")
    from bench import plan_accuracy

    cfg, per_rank = plan_accuracy.config_of("llama-tiny", world, shard, "none", True)
    assert step_spec(cfg).compiled_blocks
    planned = plan(cfg, world, shards=(shard,), checkpointing=("none",), batches=False, warm_up=False).peak()
    measured = plan_accuracy.measure(cfg, world, per_rank, torch.device("cpu"))["step"]
    assert abs(planned / measured - 1) < 0.01, (planned, measured)


def test_a_model_whose_layers_are_of_several_kinds_is_measured_whole():
    """Gemma 3's layers: five with a sliding window (each keeps its mask for backward) to one global
    (no mask). Its first layers are all sliding, so extrapolating from them planned every layer as
    one (1.012 of the CPU allocator's peak for 6 layers); the plan measures the whole model instead."""
    pytest.importorskip("transformers")
    from bench import plan_accuracy

    cfg = load_config("recipes/llama_demo.yaml", [
        "model.args.config.model_type=gemma3_text", "model.args.config.head_dim=8",
        "model.args.config.sliding_window=8", "model.args.config.num_hidden_layers=6", "train.batch_size=8",
        "train.compile=false", "run.checkpoint_staging=host"])  # fmt: skip
    assert step_spec(cfg).build_layers is None  # not extrapolated
    planned = plan(cfg, 1, shards=("none",), checkpointing=("none",), batches=False, warm_up=False).peak()
    measured = plan_accuracy.measure(cfg, 1, 8, torch.device("cpu"))["step"]
    assert abs(planned / measured - 1) < 0.005, (planned, measured)


def test_a_model_with_flex_attention_is_planned_with_the_storages_of_flash_attention():
    """attn_implementation=flex_attention does not run on fake tensors (its block mask is made from real
    index tensors; it has no backward on the CPU): the plan stands SDPA's flash kernel in for it, which
    keeps what flex keeps (query, keys and values, output, log-sum-exp; no scores). A Llama plans the
    same with either (neither has a mask); a Gemma 3 plans less with flex than with sdpa, whose
    sliding-window layers keep a mask and the keys and values repeated for every head; transformers'
    own flex functions are back afterwards."""
    pytest.importorskip("transformers")
    from transformers.masking_utils import AttentionMaskInterface
    from transformers.modeling_utils import AttentionInterface

    before = (
        AttentionInterface._global_mapping["flex_attention"],
        AttentionMaskInterface._global_mapping["flex_attention"],
    )

    def peak(recipe: str, *overrides: str) -> int:
        cfg = load_config(recipe, ["train.batch_size=8", "train.compile=false", "run.checkpoint_staging=host",
                                   *overrides])  # fmt: skip
        return plan(cfg, 1, shards=("none",), checkpointing=("none",), batches=False, warm_up=False).peak()

    flex = "model.args.attn_implementation=flex_attention"
    assert peak("recipes/llama_demo.yaml", flex) == peak("recipes/llama_demo.yaml")
    gemma3 = ["model.args.config.model_type=gemma3_text", "model.args.config.head_dim=8",
              "model.args.config.sliding_window=8", "model.args.config.num_hidden_layers=6"]  # fmt: skip
    assert peak("recipes/llama_demo.yaml", *gemma3, flex) < peak("recipes/llama_demo.yaml", *gemma3)
    after = (
        AttentionInterface._global_mapping["flex_attention"],
        AttentionMaskInterface._global_mapping["flex_attention"],
    )
    assert after == before


@pytest.mark.parametrize("shard", ["none", "full"])
@pytest.mark.parametrize("momentum", ["0.9", "0"])
def test_an_sgd_recipe_is_planned_as_the_runner_steps_it(shard, momentum):
    """train.optimizer=sgd (the default) at 2 fake ranks: a momentum buffer per parameter only with
    momentum, and under FSDP2 the runner's foreach SGD (torch has no fused SGD for DTensors, so a plan
    with it did not run); within 1% of the CPU allocator's peak of the runner's step."""
    from bench import plan_accuracy

    extra = ("train.optimizer=sgd", f"train.momentum={momentum}", f"train.nesterov={momentum != '0'}".lower())
    cfg, per_rank = plan_accuracy.config_of("gpt-tiny", 2, shard, "none", False, extra)
    planned = plan(cfg, 2, shards=(shard,), checkpointing=("none",), batches=False, warm_up=False).peak()
    measured = plan_accuracy.measure(cfg, 2, per_rank, torch.device("cpu"))["step"]
    assert abs(planned / measured - 1) < 0.01, (planned, measured)


@pytest.mark.parametrize("shard", ["none", "optimizer"])
def test_gradient_compression_is_planned_with_its_bf16_buffer(shard):
    """dist.compress=bf16: GradSync keeps a bf16 copy of its buckets, what the all_reduce sends (3%
    of this small step's peak); the plan within 1% of the CPU allocator's peak at 2 fake ranks."""
    from bench import plan_accuracy

    cfg, per_rank = plan_accuracy.config_of("gpt-tiny", 2, shard, "none", False, ("dist.compress=bf16",))
    planned = plan(cfg, 2, shards=(shard,), checkpointing=("none",), batches=False, warm_up=False).peak()
    measured = plan_accuracy.measure(cfg, 2, per_rank, torch.device("cpu"))["step"]
    assert abs(planned / measured - 1) < 0.01, (planned, measured)


@pytest.mark.parametrize("shard", ["none", "optimizer"])
def test_the_weight_average_is_planned(shard):
    """train.ema: the average (a copy of the floating parameters and buffers) and its update after the
    optimizer step; the plan within 1% of the CPU allocator's peak at 2 fake ranks (6% under without it)."""
    from bench import plan_accuracy

    cfg, per_rank = plan_accuracy.config_of("gpt-tiny", 2, shard, "none", False, ("train.ema=0.99",))
    planned = plan(cfg, 2, shards=(shard,), checkpointing=("none",), batches=False, warm_up=False).peak()
    measured = plan_accuracy.measure(cfg, 2, per_rank, torch.device("cpu"))["step"]
    assert abs(planned / measured - 1) < 0.01, (planned, measured)


def test_blocks_extrapolate_exactly_and_the_parts_follow_the_shard_mode():
    cfg = _tiny("model.args.n_layer=6")
    spec = step_spec(cfg)
    assert spec.layers == 6
    with fake_world(4):
        kw = dict(world_size=4, batch=4, checkpointing="none", precision="fp32")
        step = {s: measure_step(spec, shard=s, **kw) for s in ("none", "optimizer", "full")}
        assert step_memory(spec, shard="full", **kw) == step["full"]  # 1, 2 and 3 blocks, extrapolated to 6
    params = sum(p.numel() * 4 for p in spec.build().parameters())
    none, zero1, full = step["none"].parts, step["optimizer"].parts, step["full"].parts
    assert none["parameters"] == zero1["parameters"] == params
    assert none["gradients"] == params  # GradSync's flat buckets, kept between steps at world size > 1
    assert none["optimizer state"] == pytest.approx(2 * params, rel=0.01)  # AdamW: two moments
    assert zero1["optimizer state"] == pytest.approx(2 * params / 4, rel=0.01)
    assert full["parameters"] == pytest.approx(params / 4, rel=0.01)
    assert full["gathered blocks"] > 0 and none["gathered blocks"] == 0


@pytest.mark.parametrize("world", [1, 8])
def test_a_checkpointed_fully_sharded_model_is_extrapolated_from_where_each_block_adds_the_same(world):
    """Under dist.shard=full with full checkpointing, 2 and 3 blocks peak at different points of the
    backward (one more block gathered at 3): taken as every block's step, that difference planned an
    8-block GPT at 8 fake ranks 25% over the CPU allocator's peak of the runner's step, and a 6.7B GPT
    with negative parts. The plan is the whole model's, to the byte, and the measured peak's."""
    from bench import plan_accuracy

    cfg, per_rank = plan_accuracy.config_of("gpt-small", world, "full", "full", False)
    spec = step_spec(cfg)
    assert spec.layers == 8
    with fake_world(world):
        kw = dict(shard="full", world_size=world, batch=per_rank, checkpointing="full", precision="fp32")
        planned = step_memory(spec, **kw)
        assert planned == measure_step(spec, **kw)
    assert all(v >= 0 for v in planned.parts.values()), planned.parts
    measured = plan_accuracy.measure(cfg, world, per_rank, torch.device("cpu"))["step"]
    assert abs(planned.peak / measured - 1) < 0.02, (planned.peak, measured)


@pytest.mark.parametrize("shard", ["none", "optimizer"])
def test_gradsync_holds_each_gradient_once_under_checkpointing_as_planned(shard):
    """With full checkpointing the step peaks at the end of backward, with every gradient made: GradSync
    frees autograd's gradient tensors when their bucket is launched (1 MB buckets here), so the runner's
    step at 2 fake ranks peaks where the plan says. Kept until wait(), they made it 11-14% higher."""
    from bench import plan_accuracy

    cfg, per_rank = plan_accuracy.config_of("gpt-small", 2, shard, "full", False, ("dist.bucket_mb=1",))
    planned = plan(cfg, 2, shards=(shard,), checkpointing=("full",), batches=False, warm_up=False).peak()
    measured = plan_accuracy.measure(cfg, 2, per_rank, torch.device("cpu"))["step"]
    assert abs(planned / measured - 1) < 0.01, (planned, measured)


def test_checkpointing_and_float8_keep_less_for_backward():
    """Activation checkpointing and float8 matrix products (float8 copies of every Linear's input and
    weight kept for backward; the output layer in bf16) lower the activations, not the weights."""
    cfg = _tiny("model.args.n_embd=128", "train.precision=bf16", "train.fp8_layers=all")
    spec = step_spec(cfg)
    with fake_world(1):
        kw = dict(shard="none", world_size=1, batch=16)
        bf16 = measure_step(spec, checkpointing="none", precision="bf16", **kw)
        fp8 = measure_step(spec, checkpointing="none", precision="fp8", **kw)
        full = measure_step(spec, checkpointing="full", precision="bf16", **kw)
    assert fp8.parts["parameters"] == bf16.parts["parameters"]
    assert fp8.parts["activations"] < 0.9 * bf16.parts["activations"]
    assert full.parts["activations"] < 0.7 * bf16.parts["activations"]


def test_float8_is_planned_on_the_layers_the_run_converts():
    """The plan takes the run's rule (distlib.float8_layers with train.fp8_layers): at auto, torchao's
    thresholds leave a tiny model's Linears in bf16, so the run trains as bf16 and is planned so."""
    pytest.importorskip("torchao")
    spec = step_spec(_tiny("model.args.n_embd=128", "train.precision=fp8"))
    assert spec.fp8_layers == "auto"
    with fake_world(1):
        kw = dict(shard="none", world_size=1, batch=16, checkpointing="none")
        auto = measure_step(spec, precision="fp8", **kw)
        bf16 = measure_step(spec, precision="bf16", **kw)
        every = measure_step(dataclasses.replace(spec, fp8_layers="all"), precision="fp8", **kw)
    assert auto.parts == bf16.parts
    assert every.parts["activations"] < 0.9 * auto.parts["activations"]


def test_a_step_that_does_not_run_on_fake_tensors_is_one_line_naming_the_error(monkeypatch, capsys):
    """A model whose step has no meta kernel (a mixture of experts with fp32 weights: transformers'
    grouped_mm, whose meta kernel takes bf16 only) is the command's one-line error, exit 1, no traceback."""

    def no_meta_kernel(*args, **kwargs):
        raise RuntimeError("Expected mat_a to be BFloat16, got torch.float32.\nat grouped_mm")

    monkeypatch.setattr(memory_plan, "measure_step", no_meta_kernel)
    assert memory_plan.main(["recipes/gpt_demo.yaml", "--nproc", "2"]) == 1
    out, err = capsys.readouterr()
    want = "error: memory plan: the step did not run on fake tensors (RuntimeError: Expected mat_a to be BFloat16, "
    assert out == "" and err.splitlines() == [want + "got torch.float32.)"]


def test_the_command_prints_every_mode_the_fit_and_the_largest_batch(capsys):
    # a GPU of 10 MiB, kept whole (the default margin of 1 GiB would leave nothing)
    code = memory_plan.main(["recipes/gpt_demo.yaml", "--nproc", "2", "--gpu-gib", "0.01", "run.memory_margin_gib=0",
                             "run.memory_margin_fraction=0"])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0
    lines = out.splitlines()
    assert "shard=none" in lines[1] and "shard=optimizer" in lines[1] and "shard=full" in lines[1]
    rows = ["parameters", "gradients", "optimizer state", "gathered blocks", "activations", "of which logits and loss",
            "checkpoint staging", "peak, checkpointing none", "peak, checkpointing full",
            "peak, checkpointing selective", "fits 10.2 MiB", "largest batch per rank"]  # fmt: skip
    for row in rows:
        assert any(line.lstrip().startswith(row) for line in lines), row
    largest = next(line for line in lines if line.startswith("largest batch")).split()[-3:]
    assert all(int(b) > 0 for b in largest)
    assert lines[-1].startswith("memory plan: ") and "(2 rank(s), 16 x 64 tokens per rank" in lines[-1]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["recipes/gpt_demo.yaml", "--nproc", "3"], "train.batch_size=32 must divide evenly over 3 ranks"),
        (["recipes/demo.yaml"], "train.task=classification: only language-model recipes are planned"),
        (["recipes/gpt_demo.yaml", "train.batch_size=-1"], "train.batch_size: must be > 0"),
    ],
)
def test_the_command_refuses_what_it_cannot_plan_in_one_line(args, message, capsys):
    assert memory_plan.main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and message in err and len(err.splitlines()) == 1, err


def test_launch_refuses_a_run_that_cannot_fit_the_gpu_before_anything_starts(monkeypatch, tmp_path, capfd):
    """A GPU of 1 MiB: exit 2, the verdict and what would fit instead, no process group started and
    no run directory written."""
    import launch

    monkeypatch.setattr(memory_plan, "device_bytes", lambda index=None: 2**20)
    out_dir = tmp_path / "run"
    code = launch.main(["recipes/gpt_demo.yaml", "run.memory_plan=on", f"run.out_dir={out_dir}"])
    err = capfd.readouterr().err
    assert code == 2
    line = next(e for e in err.splitlines() if e.startswith("error: "))
    assert "error: memory plan: " in line and "does not fit the device's 1.0 MiB" in line, err
    assert "no dist.shard or checkpointing mode fits" in line or "would (" in line
    assert not torch.distributed.is_initialized() and not os.path.exists(out_dir)


def test_launch_logs_the_verdict_on_rank_0_only(monkeypatch, capfd):
    cfg = _tiny()
    cfg.run.memory_plan = "on"
    memory_plan.check_before_launch(cfg)
    assert "memory plan: " in capfd.readouterr().err
    monkeypatch.setenv("RANK", "1")
    memory_plan.check_before_launch(cfg)
    assert "memory plan" not in capfd.readouterr().err
    monkeypatch.setenv("RANK", "0")
    memory_plan.check_before_launch(load_config("recipes/demo.yaml", ["run.memory_plan=on"]))  # not a language
    assert "memory plan: not made: train.task=classification" in capfd.readouterr().err  # model: said, and on


def test_by_default_a_cpu_run_makes_no_plan_and_off_makes_none_anywhere(monkeypatch, capfd):
    cfg = _tiny()
    assert cfg.run.memory_plan == "auto" and not torch.cuda.is_available()
    monkeypatch.setattr(memory_plan, "_plan_here", lambda *a: (_ for _ in ()).throw(AssertionError("planned")))
    monkeypatch.setattr(memory_plan, "_plan_in_child", lambda *a: (_ for _ in ()).throw(AssertionError("planned")))
    memory_plan.check_before_launch(cfg)
    monkeypatch.setattr(memory_plan.torch.cuda, "is_available", lambda: True)
    cfg.run.memory_plan = "off"
    memory_plan.check_before_launch(cfg)
    assert "memory plan" not in capfd.readouterr().err


def test_the_accuracy_benchmark_tables_plan_against_measured_on_the_cpu(tmp_path, capsys):
    """bench/plan_accuracy.py --tiny: one case, its JSON row and the table (the GPU run's command)."""
    import json

    from bench import plan_accuracy

    out = tmp_path / "rows.jsonl"
    assert plan_accuracy.main(["--tiny", "--case", "gpt-tiny:1:none:full", "--json", str(out)]) == 0
    row = json.loads(out.read_text().splitlines()[0])
    assert row["world"] == 1 and row["ac"] == "full" and 0.95 < row["plan_over_measured"] < 1.05
    table = capsys.readouterr().out.strip().splitlines()
    assert table[-3].startswith("| model | ranks | dist.shard | checkpointing")
    assert table[-1].startswith("| gpt-tiny | 1 | none | full |")


def test_the_accuracy_benchmark_plans_the_gpu_cases_alone_with_their_warm_up(tmp_path, capsys):
    """bench/plan_accuracy.py --plan-only: a case planned as the GPU run is (its warm-up's copy of the
    weights included), on this CPU, nothing run."""
    import json

    from bench import plan_accuracy

    out = tmp_path / "rows.jsonl"
    assert plan_accuracy.main(["--plan-only", "--case", "gpt-tiny:2:full:none", "--json", str(out)]) == 0
    row = json.loads(out.read_text().splitlines()[0])
    cfg, _ = plan_accuracy.config_of("gpt-tiny", 2, "full", "none", False)
    with_copy, without = (plan(cfg, 2, shards=("full",), checkpointing=("none",), batches=False, warm_up=w).peak()
                          for w in (True, False))  # fmt: skip
    assert row["plan_bytes"] == with_copy > without and "measured_bytes" not in row, row
    assert capsys.readouterr().out.strip().splitlines()[-1].endswith("| - | - | - | planned only")


@pytest.mark.slow
def test_a_fully_sharded_run_planned_at_launch_saves_and_resumes_its_checkpoints(tmp_path):
    """Two torchrun ranks of the GPT demo with dist.shard=full: the plan (FSDP2 under a fake process
    group, in a process of its own) leaves nothing behind that the real group's run trips on; its
    sharded checkpoint is written whole and resumed (planned in this process, the fake group's
    meshes made the final save's shards overlap: DCP refused it)."""
    import subprocess
    import sys

    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "launch.py",
           "recipes/gpt_demo.yaml", "dist.shard=full", "train.max_steps=2", "run.memory_plan=on",
           f"run.out_dir={out}"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": ROOT}
    for extra in ([], ["train.max_steps=3"]):  # the second run resumes from the first's final checkpoint
        proc = subprocess.run(cmd + extra, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert proc.stderr.count("INFO memory plan: ") == 1, proc.stderr[-3000:]  # rank 0 alone
    assert "resumed" in proc.stderr.lower() or "step000000002" in proc.stderr, proc.stderr[-3000:]


def test_offload_keeps_the_shards_off_the_device_and_reshard_after_forward_false_keeps_blocks_gathered():
    """dist.offload=true: no shard on the device at the peak. 8 blocks (a plan extrapolated from fewer)
    with full checkpointing peak where the gradient shards exist; without checkpointing, or with 4
    blocks, the peak comes before them (a plan that kept them on the device passed there)."""
    kw = dict(shards=("full",), checkpointing=("full",), batches=False)
    eight = ("model.args.n_layer=8", "dist.shard=full", "train.activation_checkpointing=full")
    base = plan(_tiny(*eight), 2, **kw).modes["full"]
    off = plan(_tiny(*eight, "dist.offload=true"), 2, **kw).modes["full"]
    assert base.steps["full"].parts["gradients"] > 0  # at this peak the gradient shards exist
    shards = ("parameters", "gradients", "optimizer state")
    assert {p: off.steps["full"].parts[p] for p in shards} == dict.fromkeys(shards, 0)
    assert off.steps["full"].peak < base.steps["full"].peak and off.warm_up_copy == off.staging == 0
    kw = dict(shards=("full",), checkpointing=("none",), batches=False)
    four = plan(_tiny("model.args.n_layer=4", "dist.shard=full"), 2, **kw).modes["full"]
    kept = plan(_tiny("model.args.n_layer=4", "dist.shard=full", "dist.reshard_after_forward=false"), 2,
                **kw).modes["full"]  # fmt: skip
    assert kept.steps["none"].parts["gathered blocks"] > four.steps["none"].parts["gathered blocks"]


@pytest.mark.gpus(1)
@pytest.mark.parametrize(("world", "shard"), [(1, "none"), (8, "optimizer"), (8, "full")])
def test_the_plan_is_within_10_percent_of_the_gpus_peak(world, shard):
    """A 6-block GPT of width 512 (bf16, 4 x 512 tokens per rank) on one GPU under a fake process
    group of ``world`` ranks: the plan against torch.cuda.max_memory_allocated of the runner's step
    with its warm-up (bench/plan_accuracy.py at small sizes), measured the second time in this process:
    the first time also counts the process's one-time CUDA allocations (65-75 MiB on an H200, about
    12% of this small step; the plan does not hold them, docs/memory_plan.md), and whether a test
    before it in the same worker made them would decide the result."""
    from bench import plan_accuracy

    cfg = load_config("recipes/gpt_demo.yaml", ["model.args.n_layer=6", "model.args.n_embd=512", "model.args.n_head=8",
                                                 "data.args.block_size=512", f"train.batch_size={4 * world}",
                                                 f"dist.shard={shard}", "train.precision=bf16",
                                                 "run.checkpoint_staging=host", "train.prewarm_steps=2"])  # fmt: skip
    planned = plan(cfg, world, shards=(shard,), checkpointing=("none",), batches=False, warm_up=True).peak()
    plan_accuracy.measure(cfg, world, 4, torch.device("cuda"))
    measured = plan_accuracy.measure(cfg, world, 4, torch.device("cuda"))["step"]
    assert abs(planned / measured - 1) < 0.10, (planned, measured)


def test_the_recipes_vocabulary_wins_over_the_datas_as_in_the_build():
    """byte_text provides 256 tokens, model.args.vocab_size=50304 overrides it in the model: the
    logits (and the largest batch) are planned at the model's vocabulary."""
    spec = step_spec(_tiny("model.args.vocab_size=50304"))
    assert spec.vocab_size == 50304 == spec.build().lm_head.out_features
    assert step_spec(_tiny()).vocab_size == 256


def test_attention_dropout_is_planned_as_the_gpus_kernels_keep_it():
    """SDPA with dropout keeps only a seed for backward on a GPU (flash and memory-efficient kernels);
    on the CPU, where the plan runs, it takes the math path and keeps the (batch, heads, T, T)
    probabilities (fp32 here) and their mask: planned so, a GPT-2 large at 8 x 1024 was 2.06 times
    its H100 peak. With dropout the plan now adds what the blocks' other dropouts keep, which grows
    with T, not with T squared: less than one byte per score of the blocks."""
    t, blocks = 512, 3
    spec_of = {p: step_spec(_tiny(f"data.args.block_size={t}", f"model.args.n_layer={blocks}",
                                  f"model.args.dropout={p}")) for p in (0.0, 0.1)}  # fmt: skip
    kw = dict(shard="none", world_size=1, batch=16, checkpointing="none", precision="fp32")
    with fake_world(1):
        plain, dropped = (measure_step(spec_of[p], **kw) for p in (0.0, 0.1))
    extra = dropped.parts["activations"] - plain.parts["activations"]
    scores = blocks * 16 * 4 * t * t  # batch x heads x T x T, one byte each (the math path keeps 5)
    assert 0 < extra < scores, (extra, scores)
