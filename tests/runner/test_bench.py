"""The benchmarks in bench/ (not part of the library): bench.step's CLI and a tiny run on two gloo
ranks through torchrun, and the fallback mode's harness on CPU replicas."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

from bench.step import MODES, bucket_bounds, parse_args
from tests.conftest import ROOT


def test_help_lists_the_subcommands():
    out = subprocess.run([sys.executable, "bench/step.py", "--help"], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    for word in ("allreduce", "step", "all", "bus bandwidth"):
        assert word in out.stdout


def test_compile_startup_help_and_arguments():
    cmd = [sys.executable, "bench/compile_startup.py", "--help"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0 and "--compile-times" in out.stdout and "warm" in out.stdout, out.stderr
    from bench.compile_startup import parse_args as startup_args

    args = startup_args(["--modes", "distlib,plain", "--runs", "warm"])
    assert args.modes == ["distlib", "plain"] and args.runs == "warm" and args.child is None
    assert parse_args(["step", "--no-broadcast-buffers"]).broadcast_buffers is False
    assert parse_args(["step"]).broadcast_buffers is True


def test_parse_args_defaults_and_errors(capsys):
    args = parse_args(["all"])
    assert args.sizes_mb == [1, 4, 16, 64, 256, 1024] and args.batch == 512 and args.modes == list(MODES)
    assert parse_args(["step", "--modes", "ddp-eager,distlib-graph"]).modes == ["ddp-eager", "distlib-graph"]
    with pytest.raises(SystemExit):
        parse_args(["step", "--modes", "turbo"])
    assert "unknown mode 'turbo'" in capsys.readouterr().err
    assert args.groups == [1, 2, 4] and args.comm_groups == [1]
    assert parse_args(["allreduce", "--groups", "2,1,2"]).groups == [2, 1]
    for bad in ("0,2", "two"):
        with pytest.raises(SystemExit):
            parse_args(["allreduce", "--groups", bad])
        assert "--groups" in capsys.readouterr().err


def test_bucket_bounds_cut_like_grad_sync():
    mb = 2**20 // 4  # fp32 elements in a MB
    assert bucket_bounds(60 * mb, 4, 25, 1) == [(0, mb), (mb, 26 * mb), (26 * mb, 51 * mb), (51 * mb, 60 * mb)]
    assert bucket_bounds(mb // 2, 4, 25, 1) == [(0, mb // 2)]


def test_tiny_run_on_two_gloo_ranks(tmp_path):
    out_json = tmp_path / "bench.json"
    cmd = [
        os.path.join(os.path.dirname(sys.executable), "torchrun"),
        "--standalone",
        "--nproc-per-node=2",
        "-m",
        "bench.step",
        "all",
        "--device=cpu",
        "--sizes-mb=0.0625,0.25",
        "--iters=2",
        "--model-params=5e4",
        "--model=small_cnn",
        "--width=8",
        "--batch=4",
        "--image-size=16",
        "--steps=2",
        "--warmup=1",
        "--modes=single-eager,ddp-eager,ddp-compile,distlib-eager,distlib-graph,fallback",
        "--bucket-mb=0.05",  # several buckets, so that they go to several communicators
        "--first-bucket-mb=0.01",
        "--groups=1,2",
        "--comm-groups=1,2",
        f"--json={out_json}",
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout
    assert "bus bandwidth" in text and "synthetic model" in text
    for mode in ("single-eager", "ddp-eager", "distlib-eager"):
        assert mode in text
    assert "CUDA graphs need a GPU" in text  # distlib-graph on the CPU: reported, not fatal
    tail = text.rstrip().splitlines()
    summary = tail[tail.index("summary") + 1 :]  # the summary comes last
    assert summary[0].strip().startswith("distlib eager / DDP eager")
    assert any(line.strip().startswith("distlib-eager:g2 / distlib-eager") for line in summary)
    assert sum("synthetic model: GradSync sync (" in line for line in summary) == 2
    res = json.loads(out_json.read_text())
    steps = {r["mode"]: r for r in res["step"]}
    assert steps["distlib-eager"]["world"] == 2 and steps["distlib-eager"]["images_per_s"] > 0
    assert steps["distlib-eager:g2"]["images_per_s"] > 0 and steps["distlib-eager:g2"]["extra"]["comm_groups"] == 2
    assert "CUDA graphs need a GPU" in steps["distlib-graph:g2"]["note"]
    assert "CUDA graphs need a GPU" in steps["ddp-compile"]["note"]
    assert steps["single-eager"]["world"] == 1
    assert steps["fallback"]["note"]  # the slot for the fallback mode: one process for all GPUs
    ar = res["allreduce"]
    assert [r["bytes"] for r in ar["rows"]] == [65536, 262144]
    assert [r["buckets"] for r in ar["rows"]] == [3, 6]  # 0.01 MB, then 0.05 MB each
    for r in ar["rows"]:
        assert [b["groups"] for b in r["bucketed"]] == [1, 2] and all(b["busbw"] > 0 for b in r["bucketed"])
    assert [m["groups"] for m in ar["model_sync"]] == [1, 2] and all(m["sync_ms"] > 0 for m in ar["model_sync"])
    assert res["environment"]["world_size"] == 2


def test_fallback_benchmark_and_breakdown_run_on_cpu_replicas(monkeypatch):
    from bench.fallback_bench import benchmark_step, step_breakdown
    from distlib import Replicas

    def net():
        return nn.Sequential(nn.Conv2d(3, 4, 3, stride=4), nn.Flatten(), nn.Linear(4 * 8 * 8, 10))

    built: list[nn.Module] = []

    def tracked():
        built.append(net())
        return built[-1]

    steps: list[int] = []
    original = Replicas.train_step

    def counting(self, *args, **kwargs):
        steps.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Replicas, "train_step", counting)
    ips = benchmark_step(4, steps=2, warmup=1, devices=["cpu", "cpu"], cuda_graph=False, model_fn=tracked)
    assert len(steps) == 3, "warm-up plus timed steps"
    assert math.isfinite(ips) and ips > 0
    torch.manual_seed(0)  # the benchmark's seed: the same initial weights
    fresh = net()
    assert any(not torch.equal(p, q) for p, q in zip(built[0].parameters(), fresh.parameters())), "it must train"
    rows = step_breakdown(4, 2, devices=["cpu", "cpu"], cuda_graph=False, model_fn=tracked)
    expected = {"broadcast_parameters", "scatter", "reduce_gradients", "step", "  forward_backward of GPU 0 alone"}
    assert expected <= set(rows)
    for phase, (host, done) in rows.items():
        assert 0 <= host <= done, (phase, host, done)  # the launches return before every device has finished


def test_compile_modes_on_two_gloo_ranks(tmp_path):
    """distlib-compile and ddp-compile-default run (aot_eager: AOTAutograd without inductor's C++
    build), distlib-compile with several buckets, so with its graph cut."""
    cmd = [
        os.path.join(os.path.dirname(sys.executable), "torchrun"),
        "--standalone",
        "--nproc-per-node=2",
        "-m",
        "bench.step",
        "step",
        "--device=cpu",
        "--model=small_cnn",
        "--width=64",  # 1.5 MB of parameters: 3 buckets
        "--batch=4",
        "--image-size=16",
        "--steps=2",
        "--warmup=1",
        "--modes=distlib-compile,ddp-compile-default",
        "--compile-backend=aot_eager",
        "--bucket-mb=1",  # torch.compile(DDP) needs buckets of >= 1 MB (its first bucket's size)
        "--first-bucket-mb=0.002",
        f"--json={tmp_path / 'bench.json'}",
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = {r["mode"]: r for r in json.loads((tmp_path / "bench.json").read_text())["step"]}
    for mode in ("distlib-compile", "ddp-compile-default"):
        assert not rows[mode]["note"] and rows[mode]["images_per_s"] > 0, rows[mode]
    assert len(rows["distlib-compile"]["extra"]["bucket_mb"]) > 1


# ---- bench.gpt_step and the GPT baseline -------------------------------------------------------
GPT_TINY = ["--device=cpu", "--sizes=2x64", "--vocab=256", "--seq-len=32", "--batch=2", "--steps=2", "--warmup=1"]


def test_gpt_step_modes_on_two_gloo_ranks(tmp_path):
    """Every mode that runs on the CPU reports tokens/s, consistent with its step time, and an MFU
    against the given peak; the GPU-only modes say why they did not run."""
    from bench.gpt_step import MODES
    from distlib.runner.models.gpt import GPT, GPTConfig

    out_json = tmp_path / "gpt.json"
    cmd = [
        os.path.join(os.path.dirname(sys.executable), "torchrun"), "--standalone", "--nproc-per-node=2",
        "-m", "bench.gpt_step", *GPT_TINY, f"--modes={','.join(MODES)}", "--compile-backend=eager",
        "--peak-tflops=0.001", "--hang-timeout-s=100", f"--json={out_json}",
    ]  # fmt: skip
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    rows = {json.loads(line)["gpt_step"]["mode"]: json.loads(line)["gpt_step"] for line in lines if "gpt_step" in line}
    assert list(rows) == list(MODES)
    assert lines[-len(MODES) - 1].startswith("size") and lines[-1].split()[2] == "distlib-fsdp"  # the table last
    params = GPT(GPTConfig(256, 32, 2, 1, 64)).num_params()
    flops = GPT(GPTConfig(256, 32, 2, 1, 64)).flops_per_token(32)
    for mode in ("single-compile", "ddp", "ddp-compile", "zero-redundancy", "fsdp2", "fsdp2-compile", "distlib",
                 "distlib-compile", "distlib-zero", "distlib-zero-compile", "distlib-fsdp"):  # fmt: skip
        r = rows[mode]
        assert not r["note"], (mode, r["note"])
        assert r["params"] == params and r["tokens_per_gpu_step"] == 64
        assert r["world"] == (1 if mode == "single-compile" else 2)
        assert r["tokens_per_s_per_gpu"] == pytest.approx(64 / (r["step_ms"] / 1e3))
        assert r["tokens_per_s"] == pytest.approx(r["world"] * r["tokens_per_s_per_gpu"])
        assert r["mfu"] == pytest.approx(flops * r["tokens_per_s_per_gpu"] / 1e9)
        assert 0 < r["step_ms"] < 10_000 and r["peak_mem_gib"] is None  # no GPU memory on the CPU
    for mode in ("distlib-graph", "distlib-zero-graph"):
        assert rows[mode]["note"] == "CUDA graphs need a GPU"
    saved = json.loads(out_json.read_text())
    assert [r["mode"] for r in saved["results"]] == list(MODES) and saved["environment"]["world_size"] == 2


def test_gpt_step_modes_at_world_size_one():
    """As one process (no torchrun) every mode that runs on the CPU runs: distlib's collectives are
    no-ops there, torch's DDP, ZeroRedundancyOptimizer and FSDP2 get a one-rank group."""
    from bench.gpt_step import MODES

    cmd = [sys.executable, "-m", "bench.gpt_step", *GPT_TINY, f"--modes={','.join(MODES)}",
           "--compile-backend=eager", "--hang-timeout-s=100"]  # fmt: skip
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line)["gpt_step"] for line in out.stdout.splitlines() if line.startswith('{"gpt_step"')]
    assert [r["mode"] for r in rows] == list(MODES)
    for r in rows:
        if r["mode"].endswith("-graph"):
            assert r["note"] == "CUDA graphs need a GPU", r
        else:
            assert not r["note"] and r["world"] == 1 and r["tokens_per_s"] > 0, r


def test_gpt_step_reports_oom_and_goes_on(monkeypatch):
    """An out-of-memory error (also wrapped by a compiler) is the mode's result, "OOM"; the next mode runs."""
    import types

    from bench import gpt_step

    built: list[tuple[str, int]] = []

    def build(mode, cfg, args, ctx):
        built.append((mode, cfg.n_layer))
        if mode == "single-compile":
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        if mode == "ddp":
            try:
                raise torch.cuda.OutOfMemoryError("CUDA out of memory")
            except torch.cuda.OutOfMemoryError as e:
                raise RuntimeError("backend compiler failed") from e
        if mode == "fsdp2":
            raise ValueError("a real bug")
        return (lambda: None), (lambda: None)

    monkeypatch.setattr(gpt_step, "_build", build)
    args = gpt_step.parse_args([*GPT_TINY, "--modes=single-compile,ddp,fsdp2,distlib", "--sizes=2x64,1x64,4x64"])
    ctx = types.SimpleNamespace(world_size=1, device=torch.device("cpu"), is_main=True)
    results, complete = gpt_step.bench(args, ctx)
    assert complete
    assert [(r.mode, r.note) for r in results[:2]] == [("single-compile", "OOM"), ("ddp", "OOM")]
    assert results[2].note == "ValueError: a real bug"
    assert not results[3].note and results[3].tokens_per_s > 0
    # a smaller model is tried again; a larger one than a mode ran out of memory with is not
    assert ("single-compile", 1) in built and ("single-compile", 4) not in built and ("fsdp2", 4) in built
    assert results[8].size == "4x64" and results[8].note.startswith("OOM (at a smaller size")


def test_gpt_step_arguments(capsys):
    from bench.gpt_step import parse_args, parse_size

    assert parse_size("1.5B") == (48, 25, 1600) and parse_size("13B") == (40, 40, 5120)
    assert parse_size("4x256") == (4, 4, 256)
    args = parse_args([])
    assert args.batch == 16 and args.seq_len == 1024 and args.vocab == 50304 and args.steps >= 20
    for bad, word in ((["--modes", "turbo"], "unknown mode 'turbo'"), (["--sizes", "7T"], "unknown size '7T'")):
        with pytest.raises(SystemExit):
            parse_args(bad)
        assert word in capsys.readouterr().err


def test_gpt_baseline_trains_bytes_to_a_validation_loss(tmp_path):
    """bench/baselines/gpt_ddp.py on a text file: the validation loss falls below a uniform guess over the bytes."""
    import gzip

    with open(os.path.join(ROOT, "README.md"), "rb") as f:
        text = f.read() * 20
    path = tmp_path / "text.txt.gz"
    path.write_bytes(gzip.compress(text))
    cmd = [sys.executable, "bench/baselines/gpt_ddp.py", f"--data={path}", "--vocab=256", "--block-size=32",
           "--n-layer=1", "--n-head=2", "--n-embd=32", "--batch=8", "--steps=40", "--eval-every=20", "--lr=3e-3",
           "--lr-warmup=5", "--no-compile"]  # fmt: skip
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    result = dict(kv.split("=") for kv in out.stdout.splitlines()[-1].split()[1:])
    assert float(result["val_loss"]) < math.log(256) - 1.0 and float(result["train_s"]) > 0


# ---- bench.scale ---------------------------------------------------------------------------------
def test_scale_parses_its_parts_and_tiny_sizes_and_tables_every_part():
    from bench import scale

    args = scale.parse_args(["--tiny", "--modes=optimizer"])
    assert (args.device, args.size, args.modes, args.ac_batches) == ("cpu", "2x64", ["optimizer"], [1, 2])
    assert scale.parse_args([]).size == "1.5B" and scale.parse_args([]).ac_size == "6.7B"
    with pytest.raises(SystemExit):
        scale.parse_args(["--modes=zero3"])
    rows = [
        {"part": "runner", "mode": "none", "cache": "cold", "rc": 0, "model_s": 0.4, "warmup_s": 15.3,
         "to_first_step_s": 24.0, "tokens_per_s": 48500.0, "mfu": 0.504, "peak_mem_gib": 64.7, "final_save_s": 25.0,
         "imports_s": 2.5, "memory_plan_s": 0.02,
         "save_phases": {"to_host_s": 4.25, "write_s": 12.0, "fsync_s": 6.5, "commit_s": 0.1}},
        {"part": "recipe", "mode": "optimizer", "cache": "warm", "rc": 0, "model_s": 0.2, "warmup_s": 3.1,
         "to_first_step_s": 8.0, "tokens_per_s": 49000.0, "mfu": 0.51, "peak_mem_gib": 70.0, "final_save_s": 21.0,
         "save_wait_s": 4.5, "train_s": 50.2, "eval_s": 17.1, "command_s": 85.0, "beyond_s": 17.7},
        {"part": "runner", "mode": "full", "cache": "warm", "rc": 1, "note": "boom"},
        {"part": "runner", "mode": "none", "cache": "cold", "rc": 0, "overrides": ["run.memory_plan=off"],
         "to_first_step_s": 22.5},
        {"part": "anchors", "mode": "plain", "build_s": 0.38, "torch_save_s": 23.0, "checkpoint_gib": 16.5,
         "sharded_save_s": 15.5, "host_async_blocked_s": 6.5, "host_async_stall_s": 6.9, "host_async_write_s": 14.0,
         "host_async2_blocked_s": 0.02, "host_async2_stall_s": 0.9, "host_async2_write_s": 25.5,
         "device_async_blocked_s": 0.03, "device_async_stall_s": 0.4, "device_async_write_s": 18.0},
        {"part": "anchors", "mode": "single-compile", "tokens_per_s": 48900.0, "mfu": 0.508, "peak_mem_gib": 72.0},
        {"part": "ac", "mode": "full", "size": "6.7B", "seq_len": 4096, "tried": "1: ok, 2: OOM", "max_batch": 1,
         "tokens_per_s": 8000.0, "tflops": 350.0, "peak_mem_gib": 130.0},
    ]  # fmt: skip
    text = scale.table(rows)
    assert ("| none | cold | 2.5 | 0.0 | 0.40 | 15.3 | 24.0 | 48500 | 50.4% | 64.7 | 25.0 (—) | "
            "4.2 / 12.0 / 6.5 / 0.1 | — | — | — | — |") in text  # fmt: skip
    recipe = ("| optimizer | warm | — | — | 0.20 | 3.1 | 8.0 | 49000 | 51.0% | 70.0 | 21.0 (4.5) | — / — / — / — | "
              "50.2 | 17.1 | 85.0 | 17.7 |")  # fmt: skip
    assert "recipe:\n" in text and recipe in text
    assert "| full | warm | failed: boom |" in text
    assert "| none, run.memory_plan=off | cold | — | — | — | — | 22.5 |" in text  # --override: the row says it
    assert scale.parse_args(["--override", "run.memory_plan=off", "--override=a.b=1"]).override == [
        "run.memory_plan=off",
        "a.b=1",
    ]
    command = scale.runner_command(scale.parse_args(["--override", "run.memory_plan=off"]), "none", "d", "o", "c")
    assert command[-1] == "run.memory_plan=off"  # after the bench's own: it wins
    assert "| 0.38 s |" in text and "| 15.5 s |" in text and "48900 tokens/s, 50.8%" in text
    assert "staging=host, first: blocked / cost to training / written in | 6.50 / 6.90 / 14.0 s |" in text
    assert "staging=host, second: blocked / cost to training / written in | 0.02 / 0.90 / 25.5 s |" in text
    assert "staging=device, first: blocked / cost to training / written in | 0.03 / 0.40 / 18.0 s |" in text
    assert "staging=device, second: blocked / cost to training / written in | — / — / — s |" in text
    assert "| full | 6.7B, seq 4096 | 1 | 8000 | 350.0 | 130.0 | 1: ok, 2: OOM |" in text


@pytest.mark.slow
def test_scale_runs_tiny_on_the_cpu_through_the_runner(tmp_path):
    """Every part at tiny sizes on the CPU: the runner in one shard mode cold and warm (its figures
    from summary.json and metrics.jsonl), the anchors, the largest batch per checkpointing mode; the
    rows in the JSON file and the table last."""
    out = tmp_path / "scale.jsonl"
    cmd = [sys.executable, "-m", "bench.scale", "--tiny", "--parts=anchors,runner,recipe,ac", "--modes=optimizer",
           "--ac-modes=selective",
           "--ac-batches=1,2", f"--json={out}", f"--dir={tmp_path / 'work'}"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    for part in ("runner", "recipe"):
        runner = [r for r in rows if r["part"] == part]
        assert [r["cache"] for r in runner] == ["cold", "warm"]
        for r in runner:
            assert r["rc"] == 0 and r["model_s"] > 0 and r["to_first_step_s"] > 0 and r["tokens_per_s"] > 0, r
            assert r["final_save_s"] > 0 and r["eval_s"] > 0 and r["save_wait_s"] <= r["final_save_s"], r
            assert r["beyond_s"] == pytest.approx(r["command_s"] - r["train_s"] - r["eval_s"], abs=0.11), r
            phases = r["save_phases"]  # the final save's, from summary.json
            assert phases["write_s"] > 0 and phases["fsync_s"] >= 0 and phases["commit_s"] >= 0, r
    anchors = {r["mode"]: r for r in rows if r["part"] == "anchors"}
    assert anchors["plain"]["build_s"] > 0 and anchors["plain"]["torch_save_s"] > 0
    assert anchors["plain"]["sharded_save_s"] > 0 and anchors["single-compile"]["tokens_per_s"] > 0
    for key in ("device_async", "device_async2", "host_async", "host_async2"):
        assert anchors["plain"][f"{key}_blocked_s"] >= 0 and anchors["plain"][f"{key}_steps"] >= 1
        assert anchors["plain"][f"{key}_write_s"] > 0
    (ac,) = [r for r in rows if r["part"] == "ac"]
    assert ac["mode"] == "selective" and ac["max_batch"] == 2 and ac["tried"] == "1: ok, 2: ok"
    assert "| optimizer | warm |" in proc.stdout and "| selective |" in proc.stdout
    report = subprocess.run([sys.executable, "-m", "bench.scale", f"--report={out}"], cwd=ROOT, capture_output=True,
                            text=True)  # fmt: skip
    assert report.returncode == 0 and "| optimizer | cold |" in report.stdout


# ---- bench.hf_io ---------------------------------------------------------------------------------
def test_hf_io_parses_tiny_and_tables_each_figure_against_its_disk_time():
    from bench import hf_io

    args = hf_io.parse_args(["--tiny"])
    assert (args.device, args.seq_len, args.repeats, args.shard) == ("cpu", 32, 2, "none")
    assert args.dir.endswith(os.path.join(".bench", "hf-tiny-bf16")) and os.path.isabs(args.dir)
    default = hf_io.parse_args(["--dtype=fp32"])
    assert default.device == "cuda" and default.dir.endswith("hf-llama-1b-fp32")
    for bad in (["--shard=zero3"], ["--repeats=0"]):
        with pytest.raises(SystemExit):
            hf_io.parse_args(bad)
    config = hf_io.llama_config(tiny=False)  # the recipe's model
    assert (config["hidden_size"], config["num_hidden_layers"], config["num_key_value_heads"]) == (2048, 16, 8)
    assert (config["vocab_size"], config["tie_word_embeddings"]) == (128256, True)
    gb = 2_500_000_000
    rows = [
        {"part": "folder", "model": "llama-3.2-1b shape", "dtype": "bf16", "bytes": gb, "disk_read_s": 1.0,
         "disk_write_s": 2.0, "save_pretrained_fsync_s": 5.0},
        {"part": "load", "mode": "build_model", "shard": "none", "bytes": gb, "s": 1.5, "read_s": 1.1, "disk_s": 1.0},
        {"part": "load", "mode": "launch.py", "shard": "full", "bytes": gb, "rc": 0, "s": 3.0, "checkpoint_s": 25.2,
         "disk_s": 1.0},
        {"part": "export", "mode": "export()", "cache": "cold", "shard": "none", "bytes": gb,
         "checkpoint_bytes": 14_800_000_000, "read_bytes": 4_900_000_000, "disk_read_s": 3.0, "disk_write_s": 2.0,
         "disk_s": 5.0, "s": 6.0, "no_fsync_s": 5.5},
        {"part": "export", "mode": "export()", "cache": "warm", "shard": "none", "bytes": gb, "disk_write_s": 2.0,
         "disk_s": 2.0, "s": 2.5, "no_fsync_s": 2.4},
        {"part": "export", "mode": "command", "cache": "cold", "shard": "none", "rc": 2, "note": "boom"},
        {"part": "export", "mode": "export()", "shard": "full", "bytes": gb, "disk_s": 2.0, "s": 12.0},  # earlier rows
    ]  # fmt: skip
    text = hf_io.table(rows)
    row = {line.split(" | ")[0]: line for line in text.splitlines()}  # by the operation's words
    assert row["| disk: read the folder's files, cold (llama-3.2-1b shape bf16)"].endswith(
        "| 2.50 | 1.00 | 2.50 | | | |")  # fmt: skip
    assert row["| save_pretrained + fsync (making the folder)"].endswith(
        "| 5.00 | 0.50 | 2.00 | 1.25 | 2.50x (no target) |")  # fmt: skip
    assert row["| load: Trainer.build_model, cold (of which the read 1.10 s)"].endswith(
        "| 2.50 | 1.50 | 1.67 | 1.00 | 2.50 | 1.50x (met) |")  # fmt: skip
    assert row["| load: launch.py's model stage, cold, dist.shard=full"].endswith(
        "| 2.50 | 3.00 | 0.83 | 1.00 | 2.50 | 3.00x (**not met**) |")  # fmt: skip
    cold = "| export: export() + fsync, checkpoint cold, dist.shard=none (disk s: the cold read of the 4.90 GB it reads"
    assert row[cold + " + the write)"].endswith("| 2.50 | 6.00 | 0.42 | 5.00 | 0.50 | 1.20x (met) |")
    warm = "| export: export() + fsync, checkpoint in the page cache, dist.shard=none (disk s: the write)"
    assert row[warm].endswith("| 2.50 | 2.50 | 1.00 | 2.00 | 1.25 | 1.25x (met) |")
    assert row["| export: export() + fsync, checkpoint cold, dist.shard=full (disk s: the write)"].endswith(
        "| 2.50 | 12.00 | 0.21 | 2.00 | 1.25 | 6.00x (**not met**) |")  # fmt: skip
    assert "failed: boom" in text and "final checkpoint (dist.shard=full): 25.20 s" in text
    assert ("reads 4.90 GB of the 14.80 GB checkpoint (the exported tensors' records, not the optimizer's state): its "
            "cold read 3.00 s, the write 2.00 s; export() without the fsync 5.50 s.") in text  # fmt: skip


def test_hf_io_disk_anchors_read_and_write_the_bytes_asked(tmp_path, monkeypatch):
    from bench import hf_io

    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "x.bin").write_bytes(os.urandom(3 << 20))
    (tmp_path / "a" / "y.json").write_text("{}")
    files = hf_io.files_under(str(tmp_path / "a"))
    assert [os.path.basename(f) for f in files] == ["x.bin", "y.json"] and hf_io.size_of(files) == (3 << 20) + 2
    hf_io.evict(files)  # without root: fsync and fadvise on a file opened read-only
    assert hf_io.disk_read_s(files) > 0
    seen, real_fsync = [], os.fsync
    # the write anchor's file holds every byte asked when it is synced, and is gone after
    monkeypatch.setattr(os, "fsync", lambda fd: seen.append(os.fstat(fd).st_size) or real_fsync(fd))
    assert hf_io.disk_write_s(str(tmp_path), hf_io.CHUNK * 2 + 5) > 0
    monkeypatch.undo()
    assert seen == [hf_io.CHUNK * 2 + 5] and sorted(os.listdir(tmp_path)) == ["a"]


@pytest.mark.slow
def test_hf_io_runs_tiny_on_the_cpu_through_the_runner_and_export(tmp_path):
    """The tiny Llama's folder made, loaded by the runner (in process and through launch.py), a
    one-step run exported back; every figure and its anchor in the rows, the table last."""
    pytest.importorskip("transformers")
    from safetensors import safe_open

    out, folder = tmp_path / "hf_io.jsonl", tmp_path / "folder"
    cmd = [sys.executable, "-m", "bench.hf_io", "--tiny", f"--dir={folder}", f"--json={out}", "--keep"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {(r["part"], r.get("mode"), r.get("cache")): r for r in map(json.loads, out.read_text().splitlines())}
    made = rows[("folder", None, None)]
    assert made["bytes"] == sum(f.stat().st_size for f in folder.iterdir()) and made["save_pretrained_s"] > 0
    assert made["disk_read_s"] > 0 and made["disk_write_s"] > 0
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:  # the tied output layer once
        names = list(f.keys())
        tensor_bytes = sum(f.get_tensor(k).nbytes for k in names)
    assert "lm_head.weight" not in names
    load = rows[("load", "build_model", None)]
    assert load["read_bytes"] == tensor_bytes and 0 < load["read_s"] <= load["s"]
    launched = rows[("load", "launch.py", None)]
    assert launched["rc"] == 0 and launched["s"] > 0 and launched["checkpoint_s"] is not None
    exported, hot = rows[("export", "export()", "cold")], rows[("export", "export()", "warm")]
    command = rows[("export", "command", "cold")]
    assert command["rc"] == 0 and command["s"] >= command["command_s"] > 0
    for r in (exported, hot):
        assert 0 < r["no_fsync_s"] <= r["s"] and r["disk_write_s"] > 0 and r["bytes"] == exported["bytes"]
    # against the cold read of what it reads and the write when cold, the write alone when warm
    assert exported["disk_s"] == pytest.approx(exported["disk_read_s"] + exported["disk_write_s"], abs=2e-4)
    assert hot["disk_s"] == hot["disk_write_s"] and exported["disk_read_s"] > 0
    assert exported["checkpoint_bytes"] > 2 * exported["bytes"]  # the checkpoint holds AdamW's state too
    # it reads the exported tensors' fp32 records (the bf16 file's tensors twice over), not AdamW's state
    assert 2 * tensor_bytes < exported["read_bytes"] < exported["checkpoint_bytes"] / 2
    work = proc.stderr.strip().splitlines()[-1].removeprefix("kept ")
    with safe_open(os.path.join(work, "export", "model.safetensors"), framework="pt") as f:  # the same tensors
        assert sorted(f.keys()) == sorted(names)
        assert sum(f.get_tensor(k).nbytes for k in f.keys()) == tensor_bytes
    assert "| load: Trainer.build_model, cold" in proc.stdout
    assert "| export: python -m distlib.runner.export" in proc.stdout


@pytest.mark.parametrize("shard", ["none", "full"])
def test_save_call_times_an_in_place_save_and_its_parts_on_the_cpu(shard):
    cmd = [sys.executable, "-m", "bench.save_call", "--shard", shard, "--size", "tiny"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [line for line in out.stdout.splitlines() if line.startswith("| ")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    assert header[:3] == ["save", "call_s", "total_s"] and "host_copy" in header and "state_dicts" in header
    rows = [[float(c) for c in line.strip("|").split("|")] for line in lines[1:]]
    assert [r[0] for r in rows] == [1, 2]
    assert all(0 < r[1] <= r[2] for r in rows)  # the call returns before the save is committed


# ---- bench.large_models --------------------------------------------------------------------------
def test_large_models_runs_tiny_on_the_cpu():
    """Both parts at tiny sizes on the CPU, the same code as on the GPU: each case built at its
    simulated world size (fake process group) and stepped, the offload part with and without
    offload; a row each and the table last."""
    from bench import large_models

    assert large_models.parse_args([]).cases == ["gpt-39.8B", "llama-70B"]
    with pytest.raises(SystemExit):
        large_models.parse_args(["--cases=gpt-1T"])
    proc = subprocess.run([sys.executable, "-m", "bench.large_models", "--tiny"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [(r["part"], r.get("world"), r.get("offload")) for r in rows] == [
        ("build", 8, None),
        ("build", 64, None),
        ("offload", None, False),
        ("offload", None, True),
    ]
    for r in rows:
        assert "error" not in r and r["step_s"] > 0, r
    assert all(r["shards_gib"] <= r["whole_gib"] for r in rows[:2])
    assert rows[2]["tokens_per_s"] > 0 and rows[3]["tokens_per_s"] > 0
    assert proc.stdout.rstrip().splitlines()[-1].startswith("| offload | gpt-2x64 |")


def test_hf_families_shapes_build_and_the_table_shows_each_ratio():
    """bench.hf_families: every shape is a config its family builds (on the meta device: no memory),
    of 0.5 to 3B parameters; the tiny ones build as well; the table gives each family's ratio and
    says which side failed."""
    pytest.importorskip("transformers")
    from transformers import AutoConfig, AutoModelForCausalLM

    from bench import hf_families

    args = hf_families.parse_args(["--families", "llama,gemma2"])
    assert args.families == ["llama", "gemma2"] and args.steps > args.warmup
    with pytest.raises(SystemExit):
        hf_families.parse_args(["--families", "mixtral"])  # dense families only
    from distlib.runner.models.hf_causal_lm import check_args

    for family in hf_families.SHAPES:
        for tiny in (False, True):
            config = hf_families.config_of(hf_families.parse_args(["--tiny"] if tiny else []), family)
            assert check_args({"config": config}) == [], (family, tiny)  # what the runner's recipe check says
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config))
            n = sum(p.numel() for p in model.parameters())
            assert tiny or 0.45e9 < n < 3e9, (family, n)
    rows = [{"family": "llama", "shape": "Llama-3.2-1B", "attn": "sdpa", "params": 1.24e9, "cuda": True,
             "runner_tokens_per_s": 60000, "flops_per_token": 9e9, "baseline_tokens_per_s": 50000.0, "ratio": 1.2,
             "runner_run_tokens_per_s": 63000, "baseline_run_tokens_per_s": 52500.4, "run_ratio": 1.2,
             "runner_peak_gib": 48.5, "plan_gib": 48.39, "batch": 4},
            {"family": "gemma2", "shape": "Gemma-2-2B", "runner_error": "OOM", "baseline_tokens_per_s": 1,
             "plan_error": "no fake flex"},
            {"family": "qwen3", "shape": "Qwen3-0.6B", "attn": "flex_attention", "baseline_attn": "sdpa"}]  # fmt: skip
    table = hf_families.table(rows).splitlines()
    assert table[2] == ("| llama | Llama-3.2-1B | sdpa | 1.24B | 4 | 60000 | 50000 | 1.2 | 63000 / 52500, 1.2 | 54.6% "
                        "| 48.5 | 48.39 |")  # fmt: skip
    assert table[3] == "| gemma2 | Gemma-2-2B | - | - | - | failed | 1 | - | - | - | - | failed |"
    assert table[4].startswith("| qwen3 | Qwen3-0.6B | flex_attention / sdpa |")  # --runner-attn: both named
    # torchtitan's anchor (--titan) rides on the llama row; a GPU only, so the CPU's modes refuse it
    assert hf_families.parse_args(["--families", "llama", "--titan"]).titan
    for argv in (["--families", "qwen2", "--titan"], ["--tiny", "--titan"], ["--plan-only", "--titan"]):
        with pytest.raises(SystemExit):
            hf_families.parse_args(argv)
    rows[0].update(titan_tokens_per_s=50000.0, titan_mode="torchtitan-flex", titan_peak_gib=49.5, titan_ratio=1.2)
    rows[1]["titan_error"] = "no torchtitan"
    del rows[2]
    table = hf_families.table(rows).splitlines()
    assert table[-3:] == [
        "torchtitan-flex on the llama shape: 50000 tok/s, peak 49.5 GiB; the runner / torchtitan: 1.2",
        "",
        "torchtitan on the gemma2 shape: failed (the row's titan_error)",
    ]


def test_hf_families_runs_the_loop_at_half_the_batch_where_it_runs_out_of_memory(monkeypatch, tmp_path):
    """The compiled loop out of memory at the runner's batch (gemma2: 4) runs again at 2, then 1; the row
    keeps the batch it ran at, the table says it; an error that is not out of memory is not retried."""
    from bench import hf_families

    args = hf_families.parse_args(["--families", "gemma2"])
    seen = []

    def fields(cmd):
        batch = int(cmd[cmd.index("--batch") + 1])
        seen.append(batch)
        if batch > 1:
            return "...\ntorch.OutOfMemoryError: CUDA out of memory. Tried to allocate 512.00 MiB"
        return {"tokens_per_s": "9000.5", "run_tokens_per_s": "9100", "attn": "flex_attention", "first_step_s": "30",
                "peak_mem_gib": "70"}  # fmt: skip

    monkeypatch.setattr(hf_families, "result_fields", fields)
    first = hf_families.batch_of(args, "gemma2")[0]
    assert first == 4
    row = {"family": "gemma2", "shape": "Gemma-2-2B", **hf_families.baseline_row(args, "gemma2", "auto", str(tmp_path))}
    assert seen == [4, 2, 1] and row["baseline_batch"] == 1 and row["baseline_tokens_per_s"] == 9000.5
    assert "| 9000 (batch 1) |" in hf_families.table([row])
    seen.clear()
    monkeypatch.setattr(hf_families, "result_fields", lambda cmd: seen.append(1) or "ImportError: no transformers")
    row = hf_families.baseline_row(args, "gemma2", "auto", str(tmp_path))
    assert seen == [1] and "baseline_batch" not in row and "baseline_error" in row


def test_hf_families_fits_the_batch_to_the_card_by_the_memory_plan(tmp_path):
    """With a card's memory (--gpu-gib here, the GPU's on a GPU) the family's batch is halved until the
    plan fits it, down to 1 sequence; the row and the table name the batch both sides run at."""
    pytest.importorskip("transformers")
    from bench import hf_families

    args = hf_families.parse_args(["--tiny", "--families", "qwen3", "--plan-only"])
    roomy = hf_families.plan_row(args, "qwen3", str(tmp_path))  # no card: the batch asked for, no verdict
    assert roomy["batch"] == 2 and roomy["plan_fits"] is None and hf_families.batch_of(args, "qwen3")[0] == 2
    args = hf_families.parse_args(["--tiny", "--families", "qwen3", "--plan-only", "--gpu-gib", "1e-3"])
    tight = hf_families.plan_row(args, "qwen3", str(tmp_path))  # below the margin: nothing fits, down to 1
    assert tight["batch"] == 1 and tight["plan_fits"] is False and hf_families.batch_of(args, "qwen3")[0] == 1
    assert 0 < tight["plan_gib"] < roomy["plan_gib"], (tight, roomy)
    big = 1.0 + 0.03 * 80 + 2 * roomy["plan_gib"] + 0.01  # room for batch 2 beside the 1 GiB + 3% margin
    args = hf_families.parse_args(["--tiny", "--families", "qwen3", "--plan-only", "--gpu-gib", "80"])
    assert big < 80 and hf_families.plan_row(args, "qwen3", str(tmp_path))["batch"] == 2
    table = hf_families.table([{"family": "qwen3", "shape": "tiny", **tight}])
    assert "| qwen3 | tiny | - | - | 1 | - |" in table


@pytest.mark.slow
def test_hf_families_runs_tiny_on_the_cpu(tmp_path):
    """One family, tiny, through the runner's trainer and the baseline loop: a row with both rates, both
    sides with the attention --attn names (auto, the default, picks sdpa for qwen2)."""
    pytest.importorskip("transformers")
    out = tmp_path / "rows.jsonl"
    cmd = [sys.executable, "-m", "bench.hf_families", "--tiny", "--families", "qwen2", "--attn", "eager",
           "--json", str(out), "--profile", "1"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    row = json.loads(out.read_text().splitlines()[-1])
    assert row["runner_tokens_per_s"] > 0 and row["baseline_tokens_per_s"] > 0, row
    assert row["attn"] == row["baseline_attn"] == "eager" and row["plan_gib"] >= 0, row
    assert row["ratio"] == pytest.approx(row["runner_tokens_per_s"] / row["baseline_tokens_per_s"], rel=1e-2)
    # the same steps back to back, one sync at the end: each side's tokens/s and their ratio
    assert row["runner_run_tokens_per_s"] > 0 and row["baseline_run_tokens_per_s"] > 0, row
    assert row["run_ratio"] == pytest.approx(row["runner_run_tokens_per_s"] / row["baseline_run_tokens_per_s"],
                                             rel=1e-2)  # fmt: skip
    # --profile: each side's operators by kind of work, both tables' totals the sum of their kinds
    for side in ("runner_profile", "baseline_profile"):
        split = row[side]
        assert split["on"] == "cpu" and split["ms_per_step"]["matmul"] > 0, split
        assert split["total_ms"] == pytest.approx(sum(split["ms_per_step"].values()), abs=0.01)
    assert "qwen2: kernel time a step by kind (cpu, 1 profiled steps a side)" in proc.stdout
    assert proc.stdout.strip().splitlines()[-1].startswith("| total |")
    assert "| qwen2 | tiny | eager |" in proc.stdout


def test_kernel_split_sorts_gpu_kernels_by_kind():
    """bench.kernel_split: kernel names as a GPU profile of a compiled step has them, by kind; fused
    inductor kernels with a cast in them are not copies; the split sums each side's device time, the
    profiler's annotated ranges (which span kernels already counted) left out."""
    from bench import kernel_split

    names = {
        "nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NTN": "matmul",
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64": "matmul",
        "triton_tem_fused_mm_3": "matmul",
        "triton_tem_fused_addmm_4": "matmul",
        "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128>>": "attention",
        "fmha_cutlassB_bf16_aligned_64x64_k64_sm80": "attention",
        "triton_tem_fused_flex_attention_backward_0": "attention",
        "triton_red_fused__log_softmax_nll_loss_forward_0": "loss",
        "triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_1": "norm",
        "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedAdamMathFunctor>": "optimizer",
        "Memcpy DtoD (Device -> Device)": "copy",
        "triton_poi_fused__to_copy_mul_silu_2": "other",
    }
    for name, expected in names.items():
        assert kernel_split.kind(name) == expected, name
    rows = [{"name": n, "device": "CUDA", "self_cpu_us": 0.0, "self_device_us": 1000.0, "count": 2} for n in names]
    rows.append({"name": "aten::mm", "device": "CPU", "self_cpu_us": 5e6, "self_device_us": 0.0, "count": 2})
    # the optimizer's record_function range, on the device as long as its kernels: not counted twice
    rows.append({"name": "Optimizer.step#AdamW.step", "device": "CUDA", "self_cpu_us": 0.0, "self_device_us": 1e5,
                 "count": 2, "annotation": True})  # fmt: skip
    split = kernel_split.split(rows, steps=2, top=3)
    assert split["on"] == "device" and split["total_ms"] == pytest.approx(len(names) * 0.5)  # the CPU's op left out
    assert split["ms_per_step"]["matmul"] == pytest.approx(2.0) and len(split["top"]) == 3
    table = kernel_split.table(split, {**split, "ms_per_step": {"matmul": 2.0}, "total_ms": 2.0}).splitlines()
    assert table[2] == "| matmul | 2.00 | 2.00 | +0.00 |" and table[-1] == "| total | 6.00 | 2.00 | -4.00 |"
    # with each side's timed step: the step, and the part of it with no kernel running
    timed = kernel_split.table(split, {**split, "ms_per_step": {"matmul": 2.0}, "total_ms": 2.0}, step_ms=(7.5, 2.25))
    assert timed.splitlines()[-2:] == ["| timed step | 7.50 | 2.25 | -5.25 |",
                                       "| no kernel running | 1.50 | 0.25 | -1.25 |"]  # fmt: skip


# ---- bench.float8 --------------------------------------------------------------------------------
def test_float8_bench_runs_tiny_on_the_cpu(tmp_path):
    """Through the runner and the plain loop, bf16 and emulated float8, a GPT and a transformers Llama:
    a row each with its tokens/s and float8 layers, the table with each row's ratio to its loop's bf16;
    then the loss curves of bf16 (two seeds) and fp8 through the runner's whole run, and the plot."""
    pytest.importorskip("torchao")
    out = tmp_path / "float8.jsonl"
    cmd = [sys.executable, "-m", "bench.float8", "--tiny", "--models=gpt4096,llama1b", "--precisions=bf16,rowwise",
           f"--json={out}", f"--dir={tmp_path / 'work'}"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["model"], r["loop"], r["precision"]) for r in rows] == [
        (m, loop, p) for m in ("gpt4096", "llama1b") for loop in ("runner", "plain") for p in ("bf16", "rowwise")
    ]
    for r in rows:
        assert r["tokens_per_s"] > 0 and "note" not in r, r
        assert (r["float8_layers"] > 0) == (r["precision"] == "rowwise"), r
    assert "| gpt4096 | runner | bf16 |" in proc.stdout and "| 1.000 |" in proc.stdout
    assert "llama1b rowwise: runner / plain" in proc.stdout
    # two curves at once, each in a process of its own: the parallel path (its children) and the table
    curve = subprocess.run([sys.executable, "-m", "bench.float8", "--tiny", "--curve", "--curve-jobs=2",
                            f"--json={out}", f"--dir={tmp_path / 'work'}", f"--out={tmp_path}"], cwd=ROOT,
                           capture_output=True, text=True, timeout=600)  # fmt: skip
    assert curve.returncode == 0, curve.stdout[-3000:] + curve.stderr[-3000:]
    assert (tmp_path / "float8_curve.png").stat().st_size > 0
    assert "bf16 seed 0 | bf16 seed 1 | fp8 tensorwise seed 0 |" in curve.stdout


@pytest.mark.slow
def test_hf_dcp_compares_ours_and_dcps_hugging_face_storage_tiny_on_the_cpu(tmp_path):
    """bench/hf_dcp.py on a tiny Llama: both loads fill the model with the file's tensors, both exports write
    the same tensors, and a row of each operation carries the ratio and both peaks."""
    out = tmp_path / "rows.jsonl"
    cmd = [sys.executable, "-m", "bench.hf_dcp", "--size", "tiny", "--models", "llama", "--repeats", "1",
           "--dir", str(tmp_path / "work"), "--json", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in open(out)]
    assert [r["op"] for r in rows] == ["load", "export"] and all(r["equal"] for r in rows), rows
    assert all(r["ours_s"] > 0 and r["theirs_s"] > 0 and r["theirs_over_ours"] > 0 for r in rows), rows
    assert "| llama" in proc.stdout and "theirs / ours" in proc.stdout


# ---- bench.startup -------------------------------------------------------------------------------
def test_startup_parses_its_families_and_tables_each_runs_stages_and_save_phases():
    from bench import startup

    args = startup.parse_args(["--families=llama,gemma2", "--tiny"])
    assert args.families == ["llama", "gemma2"] and args.tiny and args.steps == 10
    with pytest.raises(SystemExit):
        startup.parse_args(["--families=llama,nosuch"])
    rows = [
        {"family": "llama", "cache": "cold", "rc": 0, "imports_s": 2.1, "config_s": 3.9, "memory_plan_s": 4.2,
         "init_s": 0.8, "data_s": 0.1, "loader_s": 0.0, "compiler_s": 1.5, "model_s": 0.6, "warmup_s": 12.0,
         "to_first_step_s": 25.3, "final_checkpoint_s": 9.0, "train_s": 5.0, "eval_s": 0.2, "command_s": 45.0,
         "beyond_s": 39.8, "save_phases": {"to_host_s": 2.0, "write_s": 5.5, "fsync_s": 1.25, "commit_s": 0.1}},
        {"family": "gemma2", "cache": "warm", "rc": 1, "note": "boom"},
    ]  # fmt: skip
    text = startup.table(rows)
    assert ("| llama | cold | 2.1 | 3.9 | 4.2 | 0.8 | 0.1 | 0.0 | 1.5 | 0.6 | 12.0 | 25.3 | "
            "9.0 (2.0 / 5.5 / 1.2 / 0.1) | 5.0 | 0.2 | 45.0 | 39.8 |") in text  # fmt: skip
    assert "| gemma2 | warm | failed: boom |" in text


def test_the_loss_bench_runs_tiny_on_the_cpu(tmp_path):
    """bench/loss.py: the plain and the chunked loss train a tiny Llama to the same loss (Liger,
    a GPU's, skipped); the loss alone in processes of their own gives each one's time and memory."""
    out = tmp_path / "loss.jsonl"
    proc = subprocess.run([sys.executable, "-m", "bench.loss", "--tiny", f"--json={out}"], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["variant"], r["chunks"]) for r in rows] == [("plain", None), ("chunked", 8)]
    assert rows[0]["loss"] == pytest.approx(rows[1]["loss"], abs=1e-3) and all(r["tokens_per_s"] > 0 for r in rows)
    assert "liger: skipped" in proc.stderr and "chunked/8" in proc.stdout
    alone = subprocess.run([sys.executable, "-m", "bench.loss", "--loss-only", "--tokens=256", "--hidden=32",
                            "--vocab=1000", "--steps=2", "--chunks=4"], cwd=ROOT, capture_output=True, text=True,
                           timeout=600)  # fmt: skip
    assert alone.returncode == 0, alone.stderr[-3000:]
    assert [json.loads(line)["variant"] for line in alone.stdout.splitlines()] == ["plain", "chunked"]


def test_plan_time_times_the_first_check_and_the_cached_rerun():
    """bench.plan_time: the check before launch in a fresh process, each stage's CPU and wall seconds;
    the rerun reads the plan its first check wrote (far cheaper than making it)."""
    cmd = [sys.executable, "-m", "bench.plan_time", "--recipe", "recipes/gpt_demo.yaml", "--repeats", "1",
           "train.batch_size=12"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    line = proc.stdout.strip().splitlines()[-1]
    fields = dict(kv.split("=") for kv in line.split()[1:5])
    assert list(fields) == ["torch", "compile_imports", "plan", "rerun"], line
    cpu = {k: float(v.split("/")[0]) for k, v in fields.items()}
    assert cpu["plan"] > 0 and cpu["rerun"] < cpu["plan"] / 2, line
