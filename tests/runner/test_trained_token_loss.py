"""The step's loss is its mean over the trained targets (runner/tasks/losses.py, docs/loss.md).

Chat batches (``x`` a mapping of ``input_ids`` and ``position_ids``, ``y`` targets with
-100 where nothing is trained) of packed-like and padded-like rows whose trained targets differ
widely from row to row, a few rows and one whole step with none: at 1, 2 and 3 gloo ranks, with
``train.grad_accum`` 1 and 3, in every ``dist.shard`` mode and ``dist.mode=fallback``, each step's
logged loss (the ranks' mean of what the step returns, as the trainer logs it) and the weights
after each step equal one process taking sum(CE) / N over the whole global batch, written here on
its own.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import distlib
from distlib.runner.config import Config
from distlib.runner.training.step import build_step
from tests.conftest import run_ranks

VOCAB, T, DIM = 37, 12, 16
GLOBAL = 18  # divides over 1, 2, 3 ranks x grad_accum 1, 3
STEPS, EMPTY_STEP = 4, 2  # the step with no trained target at all
SMOOTHING, CLIP, LR = 0.1, 0.6, 0.3
# dist.shard none, optimizer, full; and "fallback": dist.mode=fallback (Replicas)
CASES = [(shard, accum, layout) for shard in ("none", "optimizer", "full", "fallback") for accum in (1, 3)
         for layout in ("packed", "padded")]  # fmt: skip


class TinyLM(nn.Module):
    """A causal LM small enough for many steps: token and position embeddings, two residual MLP
    blocks (each mixing in the running mean of the positions before: causal), an output layer."""

    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, DIM)
        self.wpe = nn.Embedding(T, DIM)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.Tanh(), nn.Linear(2 * DIM, DIM))
                                    for _ in range(2))  # fmt: skip
        self.lm_head = nn.Linear(DIM, VOCAB)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
        h = self.wte(input_ids) + self.wpe(position_ids)
        steps = torch.arange(1, h.shape[1] + 1, device=h.device).view(1, -1, 1)
        for block in self.blocks:
            h = h + block(h.cumsum(1) / steps)
        return self.lm_head(h)


def _model() -> TinyLM:
    torch.manual_seed(0)
    return TinyLM()


def chat_batches(layout: str, steps: int = STEPS, rows: int = GLOBAL, seed: int = 3) -> list:
    """``steps`` global batches ``(x, y)``. Packed: documents of 2 to 7 tokens back to back, positions
    restarting at each, a prompt of 1 to 4 tokens and each document's last token masked. Padded: one
    document a row, right-padded (pads masked, positions continuing). Rows 0 to 2 train nothing (a
    micro-batch with no trained target at 2 and 3 ranks with grad_accum 3), the later rows more and
    more (ranks train very different counts); step ``EMPTY_STEP`` trains nothing."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for step in range(steps):
        ids = torch.randint(0, VOCAB, (rows, T), generator=g)
        pos = torch.zeros(rows, T, dtype=torch.long)
        y = torch.full((rows, T), -100, dtype=torch.long)
        for r in range(rows):
            t = 0
            while t < T:
                n = min(int(torch.randint(2, 8, (1,), generator=g)), T - t) if layout == "packed" else T
                length = n if layout == "packed" else int(torch.randint(3, T + 1, (1,), generator=g))
                pos[r, t : t + n] = torch.arange(n)
                # the first half of the rows: longer prompts, fewer trained targets
                prompt = int(torch.randint(1, 4, (1,), generator=g)) + (3 if r < rows // 2 else 0)
                for i in range(prompt, length - 1):  # target at i: the document's token i + 1
                    y[r, t + i] = ids[r, t + i + 1]
                t += n
            if r < 3 or step == EMPTY_STEP:
                y[r] = -100
        out.append(({"input_ids": ids, "position_ids": pos}, y))
    return out


def _full(model: nn.Module) -> list[torch.Tensor]:
    return [(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().cpu().clone() for p in model.parameters()]


def _reference(accum_free_batches: list) -> tuple[list[float], list[list[torch.Tensor]]]:
    """One process, the whole global batch: sum(CE over the trained targets) / N, then SGD."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    losses, weights = [], []
    for x, y in accum_free_batches:
        logits = model(**x)
        total = F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1), ignore_index=-100, reduction="sum",
                                label_smoothing=SMOOTHING)  # fmt: skip
        loss = total / max(int((y != -100).sum()), 1)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        losses.append(loss.item())
        weights.append([p.detach().clone() for p in model.parameters()])
    return losses, weights


def _rank(ctx, cases) -> list:
    results = []
    for shard, accum, layout in cases:
        cfg = Config()
        if shard == "fallback":
            cfg.dist.mode = "fallback"
        else:
            cfg.dist.shard = shard
        cfg.train.batch_size, cfg.train.grad_accum = GLOBAL, accum
        cfg.train.label_smoothing, cfg.train.clip_grad_norm = SMOOTHING, CLIP
        model = _model()
        if shard == "full":
            model = distlib.shard_model(model, device=ctx.device)
        opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
        step = build_step(cfg, ctx, model, opt, GLOBAL // ctx.world_size)
        per = GLOBAL // ctx.world_size
        rows = slice(ctx.rank * per, (ctx.rank + 1) * per)
        losses, weights = [], []
        for x, y in chat_batches(layout):
            loss = step({k: v[rows] for k, v in x.items()}, y[rows])
            losses.append(distlib.all_reduce(loss.detach().clone(), op="mean").item())  # as the trainer logs it
            weights.append(_full(model))
        step.close()
        results.append(((shard, accum, layout), losses, weights))
    return results


def test_the_step_loss_is_the_trained_token_mean_at_every_world_size_accumulation_and_shard_mode():
    references = {layout: _reference(chat_batches(layout)) for layout in ("packed", "padded")}
    for layout in references:  # the data is what the test means: very different counts, empty parts
        counts = torch.stack([(y != -100).sum(1) for _, y in chat_batches(layout)])
        assert counts[EMPTY_STEP].sum() == 0 and (counts[:, :3] == 0).all()
        assert 2 * counts[0, :9].sum() < counts[0, 9:].sum()  # two ranks: one trains twice the other
    for world_size in (1, 2, 3):
        for rank_results in [run_ranks(_rank, world_size, CASES, timeout=300)[0]]:
            for case, losses, weights in rank_results:
                want_losses, want_weights = references[case[2]]
                where = f"{world_size} ranks, dist.shard={case[0]}, grad_accum={case[1]}, {case[2]}"
                assert losses[EMPTY_STEP] == 0.0, where
                for k, (got, want) in enumerate(zip(losses, want_losses)):
                    assert abs(got - want) < 1e-5, f"{where}, step {k}: loss {got} != {want}"
                for k, (got_w, want_w) in enumerate(zip(weights, want_weights)):
                    for a, b in itertools.zip_longest(got_w, want_w):
                        assert (a - b).abs().max() < 1e-5, f"{where}, step {k}: weights differ"


class ChatRows(torch.utils.data.Dataset):
    """Chat samples ``({"input_ids", "position_ids"}, targets)``, as a chat data set yields them."""

    def __init__(self, batches: list) -> None:
        self.rows = [({k: v[r] for k, v in x.items()}, y[r]) for x, y in batches for r in range(y.shape[0])]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int):
        return self.rows[i]


def chat_data(layout: str = "packed") -> tuple:
    """(train, validation): 4 global batches' rows, and one more batch's for validation."""
    return ChatRows(chat_batches(layout)), ChatRows(chat_batches(layout, steps=1, seed=9))


def _trainer_rank(ctx, out_dir: str, overrides: list[str]) -> list[dict]:
    from distlib.runner.config import load_config
    from tests.runner.test_trainer import built, metrics

    cfg = load_config(None, [f"run.out_dir={out_dir}", *overrides])
    with built(cfg, ctx) as trainer:
        assert trainer.fit() == 0
    return metrics(out_dir) if ctx.is_main else []


@pytest.mark.slow
def test_the_runner_logs_the_trained_token_mean_and_its_rates_alike_at_any_world_size(tmp_path):
    """The whole runner on chat data given by import path: the logged train_loss of each step and the
    validation loss do not change with the world size or grad_accum, and each row says what share of
    the targets trained and at what rate."""
    base = ["train.task=causal_lm", "model.name=tests.runner.test_trained_token_loss:TinyLM",
            "data.name=tests.runner.test_trained_token_loss:chat_data", "data.train_subset=0",
            "train.optimizer=sgd", f"train.lr={LR}", "train.weight_decay=0", "train.warmup_frac=0",
            f"train.batch_size={GLOBAL}", "train.epochs=2",
            "train.eval_every_steps=1", f"train.label_smoothing={SMOOTHING}", f"train.clip_grad_norm={CLIP}",
            "train.sample_tokens=0", "run.progress=plain", "run.final_checkpoint=none"]  # fmt: skip
    runs = {}
    for world_size, accum in ((1, 1), (3, 3)):
        out = str(tmp_path / f"w{world_size}")
        runs[world_size] = run_ranks(_trainer_rank, world_size, out, [*base, f"train.grad_accum={accum}"],
                                     timeout=300)[0]  # fmt: skip
    one, three = runs[1], runs[3]
    assert len(one) == len(three) == 2 * STEPS
    for a, b in zip(one, three):
        assert a["step"] == b["step"]
        # metrics.jsonl rounds to 5 decimals: equal within one unit of the last
        assert abs(a["train_loss"] - b["train_loss"]) < 2e-5 and abs(a["val_loss"] - b["val_loss"]) < 2e-5, (a, b)
        assert 0 < a["trained_frac"] == b["trained_frac"] < 1
        assert a["trained_tokens_per_s"] == pytest.approx(a["tokens_per_s"] * a["trained_frac"], rel=1e-3, abs=0.2)


def _graph_rank(ctx) -> list:
    # fp32 throughout, as the reference: the runner's default precision is bf16 autocast on a GPU, whose
    # rounding alone moves the weights by 1e-4 after one step; and matmuls without TF32 (set in the rank)
    torch.backends.cuda.matmul.allow_tf32 = False
    cfg = Config()
    cfg.train.precision = "fp32"
    cfg.train.batch_size, cfg.train.cuda_graph = GLOBAL, True
    cfg.train.label_smoothing, cfg.train.clip_grad_norm = SMOOTHING, CLIP
    model = _model().to(ctx.device)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9, fused=True)
    step = build_step(cfg, ctx, model, opt, GLOBAL)
    losses, weights = [], []
    for x, y in chat_batches("padded", steps=2 * STEPS):  # 3 eager steps, then captured and replayed
        losses.append(step({k: v.to(ctx.device) for k, v in x.items()}, y.to(ctx.device)).item())
        weights.append(_full(model))
    assert step.graph is not None and step.graph.captured
    step.close()
    return [losses, weights]


@pytest.mark.gpus(1)
def test_the_cuda_graph_step_takes_chat_batches_and_gives_the_trained_token_mean():
    """train.cuda_graph: the mapping's tensors and the step's scale are the graph's inputs; each
    replay's loss and weights are the one-process reference's (steps with nothing trained too)."""
    losses, weights = run_ranks(_graph_rank, 1, backend="nccl", timeout=300)[0]
    want_losses, want_weights = _reference(chat_batches("padded", steps=2 * STEPS))
    for k in range(2 * STEPS):
        assert abs(losses[k] - want_losses[k]) < 1e-4, (k, losses[k], want_losses[k])
        assert all((a - b).abs().max() < 1e-4 for a, b in zip(weights[k], want_weights[k])), k
