"""The language-model data paths at 3 gloo ranks, for token files (``data.name: token_file``) and for
a data set named by import path, with sizes that do not divide evenly (100 training windows in
global batches of 6, 23 validation windows over 3 ranks): each rank trains on its own slice of
every global batch (disjoint, covering the epoch but its remainder), the global batch of a step is
the same at any world size, ``train.seed`` changes the order, evaluation counts every validation
window once; a run stopped mid-epoch resumes to the rows and weights of the uninterrupted run, and a
resume at another world size continues at the same global sample (docs/token_files.md, "Resume")."""

from __future__ import annotations

import os
import shutil
import signal

import numpy as np
import pytest
import torch

import distlib
from distlib.runner.config import load_config
from distlib.runner.data.text import TokenLoader
from distlib.runner.data.token_files import open_stream, write_token_file
from tests.conftest import ROOT, run_ranks
from tests.runner.conftest import checkpoints
from tests.runner.test_trainer import built, metrics

DEMO = os.path.join(ROOT, "recipes", "gpt_tokens_demo.yaml")
T, VOCAB, BATCH, STEPS = 8, 64, 6, 16  # 100 windows // 6 = 16 steps an epoch, 4 windows left over
TRAIN_WINDOWS, VAL_WINDOWS = 100, 23
KINDS = ["token_file", "import_path"]


def _stream_tokens(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, VOCAB, n)


def windows_data_set(root: str, block_size: int = T) -> tuple:
    """A user's data set by import path: (input, target) windows of random tokens."""

    def windows(n: int, seed: int) -> torch.utils.data.TensorDataset:
        w = torch.from_numpy(_stream_tokens(n * (block_size + 1), seed)).view(n, block_size + 1)
        return torch.utils.data.TensorDataset(w[:, :-1].contiguous(), w[:, 1:].contiguous())

    return windows(TRAIN_WINDOWS, 1), windows(VAL_WINDOWS, 2)


def _write_token_files(folder: str) -> None:
    """Two training shards (windows cross from one into the other) of (100 + 1) * 8 + 3 tokens, so
    that 100 windows fit every offset; a validation file of 23 windows and 4 tokens more."""
    os.makedirs(folder)
    tokens = _stream_tokens((TRAIN_WINDOWS + 1) * T + 3, 1)
    write_token_file(os.path.join(folder, "train_000000.bin"), tokens[:333])
    write_token_file(os.path.join(folder, "train_000001.bin"), tokens[333:])
    write_token_file(os.path.join(folder, "val_000000.bin"), _stream_tokens(VAL_WINDOWS * T + 4, 2))


def _overrides(kind: str, data: str, *extra: str) -> list[str]:
    common = [f"data.args.block_size={T}", "data.train_subset=0", f"model.args.vocab_size={VOCAB}",
              "model.args.n_layer=1", "model.args.n_embd=16", "model.args.n_head=2", "train.epochs=2",
              f"train.batch_size={BATCH}", "train.sample_tokens=0", "run.progress=plain",
              "run.checkpoint_every=1"]  # fmt: skip
    if kind == "token_file":
        return [*common, f"data.root={data}", *extra]
    return [*common, "data.name=tests.runner.test_lm_data_ranks:windows_data_set", *extra]


def _train(ctx, overrides: list[str], out_dir: str, stop_after: int) -> dict:
    """One rank of a run that records what it trains and evaluates on (``stop_after`` > 0: rank 0
    gets a SIGTERM after that many steps of this process)."""
    from distlib.runner.tasks.causal_lm import CausalLMTask
    from distlib.runner.training.trainer import Trainer

    seen, evals = [], []
    step, val_batches = Trainer.train_step, CausalLMTask._val_batches

    def recording_step(self, x, y):
        seen.append((self.state.epoch * len(self.loader) + self.state.step, x.tolist()))
        step(self, x, y)
        if stop_after and ctx.rank == 0 and len(seen) == stop_after:
            os.kill(os.getpid(), signal.SIGTERM)

    def recording_val(self):
        batches = list(val_batches(self))
        evals.append([row for x, _ in batches for row in x.tolist()])
        return batches

    Trainer.train_step, CausalLMTask._val_batches = recording_step, recording_val
    cfg = load_config(DEMO, [*overrides, f"run.out_dir={out_dir}"])
    with built(cfg, ctx) as trainer:
        code = trainer.fit()
        weights = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    return {"code": code, "seen": seen, "evals": evals, "weights": weights, "steps": len(trainer.loader)}


def _global_batches(ranks: list[dict]) -> dict[int, list]:
    """Global step -> the sorted windows every rank trained on at that step."""
    out: dict[int, list] = {}
    for r in ranks:
        for g, rows in r["seen"]:
            out.setdefault(g, []).extend(map(tuple, rows))
    return {g: sorted(rows) for g, rows in sorted(out.items())}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """kind -> the runs of that data kind, made once: "ref" uninterrupted at 3 ranks; "stopped" at 3
    ranks by a SIGTERM in epoch 2; "resumed" from it at 3 ranks; "resumed_at_2" from a copy of it at 2."""
    cache: dict[str, dict] = {}

    def get(kind: str) -> dict:
        if kind in cache:
            return cache[kind]
        base = tmp_path_factory.mktemp(kind)
        data = str(base / "tokens")
        _write_token_files(data)
        o = _overrides(kind, data)
        res = {"data": data, "ref": run_ranks(_train, 3, o, str(base / "ref"), 0, timeout=240)}
        res["stopped"] = run_ranks(_train, 3, o, str(base / "run"), STEPS + 3, timeout=240)
        shutil.copytree(base / "run", base / "run2")
        res["checkpoints"] = checkpoints(base / "run")
        res["resumed"] = run_ranks(_train, 3, o, str(base / "run"), 0, timeout=240)
        res["resumed_at_2"] = run_ranks(_train, 2, o, str(base / "run2"), 0, timeout=240)
        res["rows"] = {k: metrics(base / d) for k, d in [("ref", "ref"), ("resumed", "run"), ("resumed_at_2", "run2")]}
        cache[kind] = res
        return res

    return get


def _one_process_batches(kind: str, data: str, seed: int = 0) -> dict[int, list]:
    """The global batches of both epochs at world size 1 (one loader, the whole global batch)."""
    if kind == "token_file":
        loader = TokenLoader(open_stream(os.path.join(data, "train_*.bin")), block_size=T, batch_size=BATCH,
                             seed=seed)  # fmt: skip
    else:
        loader = distlib.distributed_loader(windows_data_set("")[0], BATCH, seed=seed, drop_last=True, num_replicas=1,
                                            rank=0)  # fmt: skip
    out = {}
    for epoch in range(2):
        loader.set_epoch(epoch)
        for s, (x, _) in enumerate(loader):
            out[epoch * STEPS + s] = sorted(map(tuple, x.tolist()))
    return out


def _all_windows(kind: str, data: str, split: str) -> list[tuple]:
    if kind == "import_path":
        ds = windows_data_set("")[0 if split == "train" else 1]
        return sorted(tuple(ds[i][0].tolist()) for i in range(len(ds)))
    stream = open_stream(os.path.join(data, f"{split}_*.bin"))
    n = (len(stream) - 1) // T
    return sorted(tuple(stream.read(i * T, T).tolist()) for i in range(n))


@pytest.mark.parametrize("kind", KINDS)
def test_each_rank_trains_on_its_own_slice_of_every_global_batch_at_3_ranks(runs, kind):
    res = runs(kind)
    ref = res["ref"]
    assert [r["steps"] for r in ref] == [STEPS] * 3 and all(r["code"] == 0 for r in ref)
    batches = _global_batches(ref)
    assert sorted(batches) == list(range(2 * STEPS)) and all(len(b) == BATCH for b in batches.values())
    for r in ref:  # a rank's own slice: BATCH / 3 windows a step
        assert all(len(rows) == BATCH // 3 for _, rows in r["seen"])
    for epoch in range(2):
        rows = [w for g in range(epoch * STEPS, (epoch + 1) * STEPS) for w in batches[g]]
        assert len(set(rows)) == len(rows) == STEPS * BATCH  # disjoint over ranks and steps
        if kind == "import_path":  # covering: the epoch's windows but the 4 left over
            assert set(rows) <= set(_all_windows(kind, res["data"], "train"))
    # the global batch of a step is the world size's business only in who takes which slice
    assert batches == _one_process_batches(kind, res["data"])


def _first_epoch_of_the_recipe(kind: str, data: str, out_dir: str, seed: int) -> dict[int, list]:
    """The global batches of the first epoch of the recipe with ``train.seed=seed``, at world size 1."""
    cfg = load_config(DEMO, [*_overrides(kind, data, f"train.seed={seed}"), f"run.out_dir={out_dir}"])
    with built(cfg, distlib.init("gloo")) as trainer:
        return {s: sorted(map(tuple, x.tolist())) for s, (x, _) in enumerate(trainer.loader)}


@pytest.mark.parametrize("kind", KINDS)
def test_train_seed_changes_the_order(runs, kind, tmp_path, world_size_1):
    res = runs(kind)
    ref = _global_batches(res["ref"])
    seed0 = _first_epoch_of_the_recipe(kind, res["data"], str(tmp_path / "s0"), 0)
    seed1 = _first_epoch_of_the_recipe(kind, res["data"], str(tmp_path / "s1"), 1)
    assert seed0 == {g: ref[g] for g in range(STEPS)}  # the 3-rank run's first epoch
    assert sorted(seed1) == sorted(seed0) and all(seed1[g] != seed0[g] for g in seed0)


@pytest.mark.parametrize("kind", KINDS)
def test_evaluation_counts_every_validation_window_once_at_3_ranks(runs, kind):
    res = runs(kind)
    ref = res["ref"]
    expected = _all_windows(kind, res["data"], "val")
    assert len(expected) == VAL_WINDOWS
    for e in range(2):  # each epoch's evaluation
        per_rank = [r["evals"][e] for r in ref]
        assert sorted(map(len, per_rank)) == [7, 8, 8]
        assert sorted(tuple(w) for rows in per_rank for w in rows) == expected


@pytest.mark.parametrize("kind", KINDS)
def test_a_run_stopped_mid_epoch_at_3_ranks_resumes_to_the_uninterrupted_rows_and_weights(runs, kind):
    res = runs(kind)
    stopped, resumed, ref = res["stopped"], res["resumed"], res["ref"]
    assert all(r["code"] == 128 + signal.SIGTERM for r in stopped)
    done = int(res["checkpoints"][-1].removeprefix("step"))  # the stop's global step
    assert STEPS < done < 2 * STEPS, res["checkpoints"]  # mid-epoch, in epoch 2
    for a, b, c in zip(stopped, resumed, ref):  # every rank: its batches before the stop and after, as uninterrupted
        assert [g for g, _ in a["seen"]][:done] == list(range(done))
        assert a["seen"][:done] + b["seen"] == c["seen"]
        assert b["weights"].keys() == c["weights"].keys()
        assert all(torch.equal(b["weights"][k], c["weights"][k]) for k in c["weights"])
    trajectory = [[(r["epoch"], r["train_loss"], r["val_loss"], r["lr"]) for r in res["rows"][k]]
                  for k in ("ref", "resumed")]  # fmt: skip
    assert trajectory[0] == trajectory[1]


@pytest.mark.parametrize("kind", KINDS)
def test_a_resume_at_another_world_size_continues_at_the_same_global_sample(runs, kind):
    res = runs(kind)
    done = int(res["checkpoints"][-1].removeprefix("step"))  # the stop's global step
    ref = _global_batches(res["ref"])
    at_2 = _global_batches(res["resumed_at_2"])
    assert sorted(at_2) == list(range(done, 2 * STEPS))  # from the checkpoint's global step on
    assert all(at_2[g] == ref[g] for g in at_2)  # the same windows in every global batch
    for r in res["resumed_at_2"]:
        assert all(len(rows) == BATCH // 2 for _, rows in r["seen"])
        for k, w in res["ref"][0]["weights"].items():  # the same training but for the order of float sums
            torch.testing.assert_close(r["weights"][k], w, rtol=1e-4, atol=1e-5, msg=k)
    assert res["rows"]["resumed_at_2"][-1]["world_size"] == 2
    assert res["rows"]["resumed_at_2"][-1]["val_loss"] == pytest.approx(res["rows"]["ref"][-1]["val_loss"], abs=1e-4)
