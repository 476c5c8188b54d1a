"""Every figure the runner reports — tokens/s, samples/s, tokens seen, FLOPs per token, MFU, peak
memory per rank — against a computation written here from the model's shapes and each row's own
steps and clock, in every place it appears: the progress lines, metrics.jsonl, the summary on
screen, summary.json and TensorBoard (read back with its EventAccumulator); at 2 ranks, with rows
inside epochs too. Peak memory is a GPU's: on the CPU its source is a stand-in (each rank its own
figure) and the rest of the way is the real one; on GPUs the real source (a gpu test)."""

from __future__ import annotations

import json
import os
import re

import pytest
import torch

from distlib.runner.models.gpt import GPT, GPTConfig
from tests.conftest import ROOT, run_ranks
from tests.runner.test_trainer import metrics

DEMO = os.path.join(ROOT, "recipes", "gpt_demo.yaml")
LAYERS, WIDTH, VOCAB, BLOCK, BATCH, SPE, PEAK = 2, 32, 256, 64, 8, 8, 0.001  # PEAK: TFLOP/s of one device
RUN = [f"model.args.n_layer={LAYERS}", f"model.args.n_embd={WIDTH}", "model.args.n_head=2",
       f"data.args.block_size={BLOCK}", "data.args.val_frac=0.005", "data.train_subset=64",
       f"train.batch_size={BATCH}", "train.epochs=2", "train.eval_every_steps=5", f"train.peak_tflops={PEAK}",
       "train.sample_tokens=0", "run.progress=plain", "run.tensorboard=true"]  # fmt: skip
FAKE_GIB = [1.5, 3.0]  # each rank's stand-in peak memory


def flops_per_token_by_hand() -> float:
    """A GPT-2 block's matrices (qkv 3d x d, the attention's output d x d, the MLP's 4d x d and d x 4d)
    and LayerNorm weights (no biases), the final LayerNorm, the embedding matrix that is also the output
    layer (counted once; not the position table): 6 FLOPs per weight a token (2 forward, 4 backward),
    and the attention's scores and weighted sum, 12 x layers x width x sequence length (PaLM's count)."""
    d = WIDTH
    weights = LAYERS * (3 * d * d + d * d + 4 * d * d + 4 * d * d + 2 * d) + d + VOCAB * d
    return 6 * weights + 12 * LAYERS * d * BLOCK


def test_the_hand_count_is_the_models_own_parameters():
    model = GPT(GPTConfig(vocab_size=VOCAB, block_size=BLOCK, n_layer=LAYERS, n_head=2, n_embd=WIDTH))
    counted = sum(p.numel() for n, p in model.named_parameters() if n != "wpe.weight")
    assert 6 * counted + 12 * LAYERS * WIDTH * BLOCK == flops_per_token_by_hand()


def _launch_with_stand_in_memory(ctx, out_dir: str) -> int:
    import launch
    from distlib.runner.observability import throughput

    throughput.allocated_peak = lambda device: int(FAKE_GIB[ctx.rank] * 2**30)  # this forked rank's own
    return launch.main([DEMO, *RUN, f"run.out_dir={out_dir}"])


def steps_of(row: dict) -> int:
    return row.get("epoch_step", SPE)  # a row inside an epoch counts the epoch's steps so far


def rel(seconds: float) -> float:
    """The relative error a rate can differ by from one computed from ``seconds`` rounded to the ms."""
    return 6e-4 / seconds + 1e-4


def check_figures(out, stdout: str, world: int, peak_gib: list[float] | None) -> None:
    """Every figure of the run in ``out`` (and its progress ``stdout``) against the hand computations;
    ``peak_gib``: each rank's peak memory, or None to check the figures against each other only."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    flops = flops_per_token_by_hand()
    rows = metrics(out)
    assert [r["step"] for r in rows] == [5, 8, 10, 15, 16], rows
    memory = peak_gib or rows[-1]["peak_mem_gib"]
    assert len(memory) == world
    hand, tol = [], []
    for row in rows:  # metrics.jsonl: each rate from the row's own steps and epoch clock
        tokens_per_s = steps_of(row) * BATCH * BLOCK / row["epoch_s"]
        hand.append(tokens_per_s)
        tol.append(rel(row["epoch_s"]))  # the row keeps epoch_s to the ms
        assert row["tokens"] == row["step"] * BATCH * BLOCK
        assert row["tokens_per_s"] == pytest.approx(tokens_per_s, rel=tol[-1]), row
        assert row["samples_per_s"] == pytest.approx(tokens_per_s / BLOCK, rel=tol[-1]), row
        assert row["mfu"] == pytest.approx(tokens_per_s * flops / (world * PEAK * 1e12), rel=tol[-1]), row
        assert row["world_size"] == world and row["peak_mem_gib"] == memory

    # the progress lines: one a row, its rate and MFU as the row has them
    lines = re.findall(r"^epoch (\d+)(?:/2)?(?: step (\d+)/8)?  loss \S+  val_loss \S+  ([\d,]+) tok/s  "
                       r"MFU ([\d.]+)%", stdout, flags=re.M)  # fmt: skip
    assert len(lines) == len(rows), stdout
    for (epoch, step, rate, mfu), row, tokens_per_s, r in zip(lines, rows, hand, tol):
        assert (int(epoch), int(step) if step else None) == (row["epoch"], row.get("epoch_step"))
        assert int(rate.replace(",", "")) == pytest.approx(tokens_per_s, rel=r, abs=1)
        assert float(mfu) == pytest.approx(100 * tokens_per_s * flops / (world * PEAK * 1e12), rel=r, abs=0.05)

    # over the run: every step's tokens over the epochs' training time (each epoch's last row's clock)
    ends = [r for r in rows if "epoch_step" not in r]
    trained_s = sum(r["epoch_s"] for r in ends)
    run_tokens_per_s, run_tol = len(ends) * SPE * BATCH * BLOCK / trained_s, rel(trained_s / len(ends))
    table = dict(re.findall(r"^  (\S.*?)  +(\S.*)$", stdout.split("run summary")[-1], flags=re.M))
    assert int(table["tokens/s"].replace(",", "")) == pytest.approx(run_tokens_per_s, rel=run_tol, abs=1)
    # the summary prints the last row's own figure to one decimal: the same string, not a tolerance
    # (a value such as 2.9595 lies on the rounding boundary, where float error picks either side)
    assert table["MFU (last epoch)"] == f"{100 * rows[-1]['mfu']:.1f}%"
    assert table["peak GPU memory (GiB/rank)"].split() == [f"{g:.1f}" for g in memory]
    with open(out / "summary.json") as f:
        summary = json.load(f)
    assert summary["flops_per_token"] == flops
    assert summary["tokens_per_s"] == pytest.approx(run_tokens_per_s, rel=run_tol)
    assert summary["samples_per_s"] == pytest.approx(run_tokens_per_s / BLOCK, rel=run_tol)
    assert summary["mfu"] == rows[-1]["mfu"] and summary["peak_mem_gib"] == memory

    # TensorBoard: a point a row, at its global step
    acc = EventAccumulator(str(out))
    acc.Reload()
    for tag, expected in (("throughput/tokens_per_s", hand), ("throughput/samples_per_s", [h / BLOCK for h in hand]),
                          ("throughput/mfu", [h * flops / (world * PEAK * 1e12) for h in hand])):  # fmt: skip
        points = acc.Scalars(tag)
        assert [p.step for p in points] == [r["step"] for r in rows], tag
        assert all(p.value == pytest.approx(e, rel=r) for p, e, r in zip(points, expected, tol)), tag
    for rank, gib in enumerate(memory):
        assert [p.value for p in acc.Scalars(f"memory/peak_gib_rank{rank}")] == pytest.approx([gib] * len(rows))


def test_every_figure_is_the_hand_computation_in_every_place_it_appears_at_two_ranks(tmp_path, capfd):
    out = tmp_path / "out"
    assert run_ranks(_launch_with_stand_in_memory, 2, str(out), timeout=180) == [0, 0]
    check_figures(out, capfd.readouterr().out, world=2, peak_gib=FAKE_GIB)


@pytest.mark.gpus(2)
@pytest.mark.slow
def test_gpu_peak_memory_is_each_ranks_own_and_holds_at_least_the_training_state(tmp_path):
    """The real source on 2 GPUs (fp32, no compile): each rank's peak is at least its weights, their
    gradients and AdamW's two moments (16 bytes a parameter), and below the GPU's memory; the same in
    every place, with the other figures checked as on the CPU."""
    from tests.runner.test_e2e import launch

    out = tmp_path / "out"
    proc = launch([DEMO, *RUN, f"run.out_dir={out}", "train.precision=fp32"], nproc=2, timeout=400)
    params = sum(p.numel() for p in GPT(GPTConfig(vocab_size=VOCAB, block_size=BLOCK, n_layer=LAYERS, n_head=2,
                                                  n_embd=WIDTH)).parameters())  # fmt: skip
    memory = metrics(out)[-1]["peak_mem_gib"]
    assert all(16 * params / 2**30 <= g < torch.cuda.get_device_properties(0).total_memory / 2**30 for g in memory)
    check_figures(out, proc.stdout, world=2, peak_gib=None)
