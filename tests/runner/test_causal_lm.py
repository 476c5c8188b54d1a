"""The causal language-model task: byte-level text cut into windows on the device (each rank its
own, targets the inputs shifted by one), training that is a plain torch loop (AdamW without
decay on norms, biases and embeddings, a cosine schedule, next-token cross-entropy), validation
loss and perplexity over every window once, tokens/s and MFU; the GPT demo's loss falls at two
ranks in well under a minute and the run ends with a generated sample."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch
import torch.nn.functional as F

import distlib
from distlib.runner.config import load_config
from distlib.runner.data.text import IGNORED, TokenLoader, decode_bytes, eval_windows, load_byte_text
from distlib.runner.models.gpt import GPT, GPTConfig, KVCache
from distlib.runner.observability.throughput import mfu, peak_tflops
from tests.conftest import ROOT
from tests.runner.test_e2e import launch
from tests.runner.test_trainer import built, metrics

DEMO = os.path.join(ROOT, "recipes", "gpt_demo.yaml")


def test_token_loader_gives_each_rank_its_own_windows_and_targets_shifted_by_one():
    tokens = torch.arange(1000)  # a token's value is its position
    loaders = [TokenLoader(tokens, block_size=8, batch_size=4, rank=r, world_size=2, seed=3) for r in range(2)]
    assert len(loaders[0]) == (1000 // 8 - 1) // 8 == 15
    epochs = []
    for _ in range(2):
        starts = []
        for loader in loaders:
            for x, y in loader:
                assert x.shape == y.shape == (4, 8)
                assert torch.equal(y, x + 1)  # the next token at every position
                assert torch.equal(x, x[:, :1] + torch.arange(8))  # contiguous windows
                starts += x[:, 0].tolist()
        assert len(set(starts)) == len(starts) == 15 * 2 * 4  # no window twice in an epoch, over both ranks
        assert len({s % 8 for s in starts}) == 1  # one offset per epoch
        epochs.append(starts)
    assert epochs[0] != epochs[1]  # a new order (and offset) each epoch


@pytest.mark.parametrize("n,world", [(20, 3), (9, 2), (8, 2), (1, 2)])
def test_eval_windows_cover_every_validation_window_once_over_the_ranks_in_as_many_batches(n, world):
    """Every rank yields the same number of batches (a fully sharded forward is a collective); a
    rank short of a batch gets one window whose targets are all ignored. A warm-up's ends_only: the
    first batch and the last."""
    tokens = torch.arange(10 * n + 3)
    counted, batches = [], []
    for r in range(world):
        mine = list(eval_windows(tokens, 10, r, world, 4, torch.device("cpu")))
        batches.append(len(mine))
        ends = list(eval_windows(tokens, 10, r, world, 4, torch.device("cpu"), ends_only=True))  # a warm-up's
        assert len(ends) == min(len(mine), 2)
        assert all(torch.equal(a, b) for a, b in [*zip(ends[0], mine[0]), *zip(ends[-1], mine[-1])])
        for x, y in mine:
            kept = (y != IGNORED).all(1)
            assert ((y == IGNORED).all(1) | kept).all()  # a window counts whole, or not at all
            counted += x[kept, 0].tolist()
    assert sorted(counted) == list(range(0, 10 * n, 10))
    assert len(set(batches)) == 1 and batches[0] == math.ceil(math.ceil(n / world) / 4), batches


def test_byte_text_splits_by_position(tmp_path):
    path = tmp_path / "t.txt"
    path.write_bytes(bytes(range(256)) * 4)
    text = load_byte_text(str(path), block_size=16, val_frac=0.25)
    assert torch.equal(torch.cat([text.train, text.val]), torch.tensor(list(range(256)) * 4, dtype=torch.uint8))
    assert len(text.val) == 256 and text.vocab_size == 256


def test_mfu_is_model_flops_over_the_peak_of_every_gpu(monkeypatch):
    assert mfu(1e5, 6e8, gpus=2, peak=989.0) == pytest.approx(1e5 * 6e8 / (2 * 989e12))
    assert mfu(1e5, 6e8, gpus=2, peak=None) is None
    assert peak_tflops(torch.device("cpu")) is None  # no MFU on a CPU unless the recipe gives a peak
    assert peak_tflops(torch.device("cpu"), override=50.0) == 50.0
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    assert peak_tflops(torch.device("cuda", 0)) == 989.0
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    assert peak_tflops(torch.device("cuda", 0)) == 312.0
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Some Future GPU")
    assert peak_tflops(torch.device("cuda", 0)) is None


def test_mfu_counts_every_gpu_a_fallback_process_drives(monkeypatch):
    """dist.mode=fallback: one process per node drives all of its GPUs; the MFU is over all of them."""
    from types import SimpleNamespace as NS

    from distlib.runner.tasks.causal_lm import CausalLMTask

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    model = GPT(GPTConfig(vocab_size=256, block_size=64, n_layer=1, n_head=2, n_embd=32))

    def rates(mode: str) -> float:
        task = NS(block_size=64, ctx=NS(world_size=2, device=torch.device("cpu")),
                  cfg=NS(train=NS(peak_tflops=0.001), dist=NS(mode=mode)))  # fmt: skip
        return CausalLMTask.rates(task, 1000.0, model)["mfu"]

    flops = model.flops_per_token(64) * 1000.0 * 64
    assert rates("process_per_gpu") == pytest.approx(flops / (2 * 1e9), rel=1e-3)  # 2 processes, a GPU each
    assert rates("fallback") == pytest.approx(flops / (8 * 1e9), rel=1e-3)  # 2 nodes of 4 GPUs


@pytest.mark.parametrize("new_tokens", [20, 50], ids=["within_block_size", "beyond_block_size"])
def test_generation_with_the_kv_cache_is_generation_without_it(new_tokens, monkeypatch, world_size_1):
    """The same tokens, greedy and sampled with the same generator, a batch of two prompts, within the
    block and once the window moves (block_size 32, prompts of 10); the cached decode runs the blocks
    outside their ``__call__`` (a compiled one is never given a new length at every step)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=256, block_size=32, n_layer=2, n_head=2, n_embd=32)).eval()
    prompt = torch.randint(0, 256, (2, 10))
    calls = []
    for block in model.blocks:
        block.register_forward_hook(lambda *_: calls.append(1))
    sdpa, shapes = F.scaled_dot_product_attention, set()

    def attention(q, k, v, **kwargs):
        shapes.add((q.shape, k.shape))
        return sdpa(q, k, v, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", attention)
    greedy = model.generate(prompt, new_tokens, temperature=0)
    # the prefill of the prompt, then one shape for every decode step (and for every step that runs the
    # moved window whole): no kernel plan or compilation per length
    assert len(shapes) == (2 if new_tokens <= 22 else 3), shapes
    monkeypatch.undo()
    assert calls == [] and greedy.shape == (2, 10 + new_tokens) and torch.equal(greedy[:, :10], prompt)
    assert torch.equal(greedy, model.generate(prompt, new_tokens, temperature=0, kv_cache=False))
    assert len(calls) == 2 * new_tokens  # without the cache: every block, every step
    sampled = [model.generate(prompt, new_tokens, temperature=0.8, generator=torch.Generator().manual_seed(1),
                              kv_cache=cached) for cached in (True, False)]  # fmt: skip
    assert torch.equal(*sampled) and not torch.equal(sampled[0], greedy)
    # a prefill's logits are the forward's, and each decoded position's those of the whole sequence
    cache = KVCache(2, 32)
    seq = greedy[:, :20]
    steps = [model.forward_cached(seq[:, :10], cache)] + [model.forward_cached(seq[:, i : i + 1], cache)
                                                          for i in range(10, 20)]  # fmt: skip
    torch.testing.assert_close(torch.cat(steps, dim=1), model(seq), rtol=1e-4, atol=1e-5)


SMALL = ["train.epochs=2", "data.train_subset=64", "model.args.n_layer=1", "model.args.n_embd=32",
         "model.args.n_head=2", "train.batch_size=8", "train.warmup_frac=0.25", "train.peak_tflops=0.5",
         "train.sample_tokens=20", "run.progress=plain"]  # fmt: skip


def test_training_is_a_plain_torch_loop_with_adamw_and_a_cosine_schedule(tmp_path, world_size_1):
    cfg = load_config(DEMO, [*SMALL, f"run.out_dir={tmp_path}"])
    with built(cfg, distlib.init("gloo")) as trainer:
        start = {k: v.clone() for k, v in trainer.model.state_dict().items()}
        assert trainer.fit() == 0
    rows = metrics(tmp_path)
    steps = 64 // 8  # per epoch

    # one process, torch's pieces: AdamW, decay on the matrices of the blocks only, a linear
    # warm-up over 4 of the 16 steps then a cosine decay to 0.1 lr, next-token cross-entropy,
    # the global gradient norm clipped to 1
    text = load_byte_text(os.path.join(ROOT, cfg.data.root), block_size=64)
    model = GPT(GPTConfig(vocab_size=256, block_size=64, n_layer=1, n_head=2, n_embd=32))
    model.load_state_dict(start)
    decay = [p for n, p in model.named_parameters() if p.ndim == 2 and not n.startswith(("wte", "wpe"))]
    rest = [p for p in model.parameters() if all(p is not q for q in decay)]
    assert len(rest) == 2 + 2 * 1 + 1  # wte (tied to lm_head), wpe, two LayerNorms a block, the final one
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                            lr=3e-3, betas=(0.9, 0.95))  # fmt: skip
    schedule = torch.optim.lr_scheduler.SequentialLR(
        opt, [torch.optim.lr_scheduler.LinearLR(opt, 1 / 4, 1.0, total_iters=3),
              torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=12, eta_min=3e-4)], milestones=[4],
    )  # fmt: skip
    loader = TokenLoader(text.train, block_size=64, batch_size=8, seed=0, max_windows=64)
    losses, lrs_after = [], []
    for _ in range(2):
        for x, y in loader:
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
            schedule.step()
            losses.append(loss.item())
            lrs_after.append(opt.param_groups[0]["lr"])
    for name, w in model.state_dict().items():
        torch.testing.assert_close(trainer.model.state_dict()[name], w, rtol=1e-4, atol=1e-5, msg=name)
    for row in rows:
        e = row["epoch"]
        assert row["train_loss"] == pytest.approx(sum(losses[steps * (e - 1) : steps * e]) / steps, abs=1e-4)
        assert row["lr"] == pytest.approx(lrs_after[steps * e - 1], rel=1e-6)
    assert rows[-1]["lr"] == pytest.approx(3e-4, rel=1e-6)  # the cosine's end: train.min_lr_frac of lr

    # validation: the mean next-token loss over every window of the last 5%, and its exponential
    with torch.no_grad():
        sums = [F.cross_entropy(model(x).flatten(0, 1), y.flatten(), reduction="sum").item()
                for x, y in eval_windows(text.val, 64, 0, 1, 100, torch.device("cpu"))]  # fmt: skip
    n = (len(text.val) - 1) // 64 * 64
    assert rows[-1]["val_loss"] == pytest.approx(sum(sums) / n, abs=2e-5)
    assert rows[-1]["val_ppl"] == pytest.approx(math.exp(rows[-1]["val_loss"]), rel=1e-3)
    # tokens/s and MFU (the recipe's peak of 0.5 TFLOP/s on this CPU): the model's FLOPs per token
    for row in rows:
        assert row["tokens_per_s"] == pytest.approx(row["samples_per_s"] * 64, rel=1e-3)
        flops = model.flops_per_token(64)
        assert row["mfu"] == pytest.approx(row["tokens_per_s"] * flops / 0.5e12, rel=1e-2, abs=1e-4)
        assert "peak_mem_gib" not in row  # a CPU run
    with open(tmp_path / "summary.json") as f:
        summary = json.load(f)
    assert summary["task"] == "causal_lm" and summary["final_val_loss"] == rows[-1]["val_loss"]
    # the sample: the first 32 validation bytes, then 20 generated ones
    assert summary["sample_prompt"] == text.val[:32].numpy().tobytes().decode()
    assert summary["sample"].startswith(summary["sample_prompt"]) and len(summary["sample"]) > 32


def test_bytes_decode_with_ids_past_the_bytes_as_replacement_characters():
    """A byte model's vocabulary padded past 256 (as GPT-2's is to 50304) can sample an id that is no
    byte: each such id is one U+FFFD, the valid UTF-8 around it kept."""
    euro = list("€".encode())
    assert decode_bytes([72, 105, *euro]) == "Hi€"
    assert decode_bytes([72, 300, 105, 50303, *euro, 256]) == "H\ufffdi\ufffd€\ufffd"
    # a sequence cut by an id: the cut start, the id, and each stray continuation byte (Python's rule)
    assert decode_bytes([euro[0], 257, *euro[1:]]) == "\ufffd" * 4
    assert decode_bytes([]) == ""


def test_a_byte_model_with_a_vocabulary_past_the_bytes_samples_without_failing(tmp_path, world_size_1):
    """model.args.vocab_size=320 on byte text (the sample then draws from 320 ids): the run ends with
    exit 0 and its sample in summary.json."""
    cfg = load_config(DEMO, [*SMALL, "train.epochs=1", "model.args.vocab_size=320", "train.sample_tokens=64",
                             f"run.out_dir={tmp_path}"])  # fmt: skip
    with built(cfg, distlib.init("gloo")) as trainer:
        with torch.no_grad():  # the padded ids made likelier than any byte: the sample surely draws some
            trainer.model.lm_head.weight[256:] = trainer.model.lm_head.weight[:256].abs().max() * 4
        assert trainer.fit() == 0
    with open(tmp_path / "summary.json") as f:
        summary = json.load(f)
    assert summary["sample"].startswith(summary["sample_prompt"]) and "\ufffd" in summary["sample"]


def token_windows(block_size: int = 16) -> tuple:
    """A user's own language-model data set: (input, target) windows of the demo text."""
    text = load_byte_text(os.path.join(ROOT, "data", "shakespeare-demo", "shakespeare.txt.gz"), block_size=block_size)

    def windows(tokens, n):
        w = tokens[: n * block_size + 1].long()
        return torch.utils.data.TensorDataset(w[:-1].view(n, block_size), w[1:].view(n, block_size))

    return windows(text.train, 64), windows(text.val, 16)


def test_a_users_own_token_data_set_trains_a_language_model_through_distributed_loader(tmp_path, world_size_1):
    overrides = ["data.name=tests.runner.test_causal_lm:token_windows", "data.train_subset=0",
                 "data.args.block_size=16", f"run.out_dir={tmp_path}", "train.sample_tokens=0"]  # fmt: skip
    cfg = load_config(DEMO, [*SMALL, *overrides])
    with built(cfg, distlib.init("gloo")) as trainer:
        assert trainer.task.name == "causal_lm" and isinstance(trainer.loader, distlib.EpochLoader)
        assert trainer.model.cfg.block_size == 16  # from the data set's samples
        assert trainer.fit() == 0
    rows = metrics(tmp_path)
    assert len(trainer.loader) == 64 // 8 and [r["epoch"] for r in rows] == [1, 2]
    assert rows[-1]["val_loss"] < math.log(256) and rows[-1]["tokens_per_s"] == pytest.approx(
        rows[-1]["samples_per_s"] * 16, rel=1e-3
    )


@pytest.mark.slow
def test_the_gpt_demo_loss_falls_at_two_ranks_in_under_a_minute(tmp_path):
    """What `recipes/gpt_demo.yaml` promises, on two CPU processes: the validation loss falls far
    below the uniform guess (ln 256 = 5.55) and the run ends with its figures and a sample."""
    out = tmp_path / "gpt"
    proc = launch([DEMO, f"run.out_dir={out}", "run.progress=plain"], nproc=2, timeout=240)
    rows = metrics(out)
    with open(out / "summary.json") as f:
        summary = json.load(f)
    print(f"gpt demo: val_loss {[r['val_loss'] for r in rows]}; {summary['total_s']:.1f} s from process start")
    assert rows[0]["val_loss"] < 3.0 and rows[-1]["val_loss"] < rows[0]["val_loss"] - 0.15, rows
    assert rows[-1]["train_s"] < 60, rows[-1]
    assert rows[-1]["world_size"] == 2 and rows[-1]["tokens_per_s"] > 0
    assert "final validation loss" in proc.stdout and "perplexity" in proc.stdout
    assert "sample from the final model" in proc.stderr and summary["sample"] in proc.stderr
    assert summary["final_val_ppl"] == rows[-1]["val_ppl"]


@pytest.mark.gpus(2)
@pytest.mark.slow
@pytest.mark.parametrize(
    "overrides",
    [["train.compile=true"], ["train.cuda_graph=true"]],
    ids=["compiled", "cuda_graph"],
)
def test_the_gpt_demo_on_two_gpus_reports_mfu_and_each_ranks_peak_memory(tmp_path, overrides):
    """On GPUs: bf16, fused AdamW (capturable inside a CUDA graph), the model compiled with its
    buckets overlapped or the step captured; the loss falls as on the CPU; every row has the MFU
    (the GPU's peak from its name, or a stand-in) and each rank's peak memory."""
    out = tmp_path / "gpt-gpu"
    launch([DEMO, f"run.out_dir={out}", "run.progress=plain", "train.precision=bf16", "train.peak_tflops=100",
            *overrides], nproc=2, timeout=400)  # fmt: skip
    rows = metrics(out)
    assert rows[-1]["val_loss"] < rows[0]["val_loss"] - 0.15 and rows[0]["val_loss"] < 3.0, rows
    for row in rows:
        assert row["mfu"] > 0 and len(row["peak_mem_gib"]) == 2 and min(row["peak_mem_gib"]) > 0, row
