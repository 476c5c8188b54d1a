"""The memory plan at launch made once (distlib/runner/training/plan_cache.py, docs/memory_plan.md):
kept for a rerun or a resume under a key of what it depends on, made by local rank 0 alone."""

from __future__ import annotations

import dataclasses
import re
import threading
import time

import pytest

from distlib.runner.config import Config, load_config
from distlib.runner.tasks.chunked_loss import chunks_applied
from distlib.runner.training import memory_plan, plan_cache
from tests.conftest import ROOT


@pytest.fixture(autouse=True)
def _in_root(monkeypatch, world_size_1, tmp_path):
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(plan_cache, "cache_dir", lambda cfg: str(tmp_path / "plans"))  # the test's own plans


def _counted(monkeypatch) -> list[int]:
    """The plans made (``_plan_here`` calls) from here on."""
    made: list[int] = []
    real = memory_plan._plan_here

    def counting(*args):
        made.append(args[1])  # the world size
        return real(*args)

    monkeypatch.setattr(memory_plan, "_plan_here", counting)
    return made


def _tiny(*overrides: str):
    return load_config("recipes/gpt_demo.yaml", ["train.batch_size=16", "run.memory_plan=on", *overrides])


def test_a_rerun_or_a_resume_takes_the_plan_and_a_setting_that_shapes_the_step_makes_a_new_one(
    monkeypatch, tmp_path, capfd
):
    made = _counted(monkeypatch)
    memory_plan.check_before_launch(_tiny())
    first = capfd.readouterr().err
    assert len(made) == 1 and "memory plan: " in first and "earlier run" not in first, first
    # what the plan never reads: where the run writes, how long it trains, its rate, its seed
    memory_plan.check_before_launch(_tiny(f"run.out_dir={tmp_path / 'other'}", "train.lr=0.01", "train.epochs=3",
                                          "train.seed=7", "data.root=elsewhere.txt", "run.resume=false"))  # fmt: skip
    again = capfd.readouterr().err
    assert len(made) == 1, "planned again for a setting the plan does not read"
    verdict = next(line for line in first.splitlines() if "memory plan: " in line)
    assert verdict in again and "(the plan of an earlier run" in again, again
    for changed in (["train.batch_size=8"], ["train.activation_checkpointing=full"], ["model.args.n_layer=3"],
                    ["train.precision=bf16"], ["dist.shard=optimizer"]):  # fmt: skip
        memory_plan.check_before_launch(_tiny(*changed))
    assert len(made) == 6
    monkeypatch.setenv("WORLD_SIZE", "2")  # another world size: another plan
    memory_plan.check_before_launch(_tiny())
    assert made[-1] == 2 and len(made) == 7


def test_a_refusal_is_kept_too(monkeypatch):
    """A GPU of 1 MiB: refused, and refused again without planning (what would fit included)."""
    monkeypatch.setattr(memory_plan, "device_bytes", lambda index=None: 2**20)
    with pytest.raises(memory_plan.MemoryRefused) as first:
        memory_plan.check_before_launch(_tiny())
    monkeypatch.setattr(memory_plan, "_plan_here", lambda *a: pytest.fail("planned again"))
    monkeypatch.setattr(memory_plan, "_plan_in_child", lambda *a: pytest.fail("planned again"))
    with pytest.raises(memory_plan.MemoryRefused) as again:
        memory_plan.check_before_launch(_tiny())
    assert str(again.value) == str(first.value) and "does not fit the device's 1.0 MiB" in str(first.value)
    monkeypatch.setattr(memory_plan, "device_bytes", lambda index=None: 2**40)  # another GPU: planned anew
    with pytest.raises(pytest.fail.Exception, match="planned again"):
        memory_plan.check_before_launch(_tiny())


def test_a_refusal_of_the_plain_loss_names_the_loss_in_chunks_where_that_fits(monkeypatch, capsys):
    """A GPT whose logits (vocabulary 8192) make most of its step, on a device between the peak with the
    loss in chunks and the plain loss's: refused, and the refusal names loss.chunks=8 with its peak;
    kept with the plan for a rerun; a recipe already in chunks is not told so."""
    over = ["model.args.vocab_size=8192", "run.memory_margin_gib=0", "run.memory_margin_fraction=0",
            "loss.chunks_when_needed=false"]  # fmt: skip
    own = dict(shards=("none",), checkpointing=("none",), batches=False)
    plain = memory_plan.plan(_tiny(*over), 1, **own).peak()
    chunked = memory_plan.plan(_tiny(*over, "loss.chunks=8"), 1, **own).peak()
    assert chunked < 0.8 * plain, (chunked, plain)
    monkeypatch.setattr(memory_plan, "device_bytes", lambda index=None: (chunked + plain) // 2)
    with pytest.raises(memory_plan.MemoryRefused) as refused:
        memory_plan.check_before_launch(_tiny(*over))
    said = str(refused.value)
    named = re.search(r"; loss\.chunks=8 \(the output layer and the loss in chunks\) would \(([\d.]+) MiB\)$", said)
    assert "does not fit" in said and named, said
    assert float(named.group(1)) * 2**20 <= (chunked + plain) // 2, said
    # python -m distlib.runner.plan says it too, on a device of that size
    gib = (chunked + plain) // 2 / 2**30
    assert memory_plan.main(["recipes/gpt_demo.yaml", "train.batch_size=16", *over, "--gpu-gib", f"{gib:.6f}"]) == 0
    printed = capsys.readouterr().out
    assert "does not fit" in printed and "; loss.chunks=8 (the output layer and the loss in chunks) would (" in printed
    assert "a launch takes" not in printed, printed
    monkeypatch.setattr(memory_plan, "_plan_here", lambda *a: pytest.fail("planned again"))
    monkeypatch.setattr(memory_plan, "_plan_in_child", lambda *a: pytest.fail("planned again"))
    with pytest.raises(memory_plan.MemoryRefused) as again:
        memory_plan.check_before_launch(_tiny(*over))
    assert str(again.value) == said
    monkeypatch.undo()
    monkeypatch.setattr(plan_cache, "cache_dir", lambda cfg: "/nonexistent/plans")  # nothing kept: planned now
    monkeypatch.setattr(memory_plan, "device_bytes", lambda index=None: chunked // 2)
    with pytest.raises(memory_plan.MemoryRefused) as in_chunks:
        memory_plan.check_before_launch(_tiny(*over, "loss.chunks=8"))
    assert "loss.chunks" not in str(in_chunks.value), str(in_chunks.value)


def test_where_only_the_loss_in_chunks_fits_the_run_takes_it(monkeypatch, capfd):
    """The same GPT on a device between the two peaks, loss.chunks_when_needed on (the default): not
    refused; the run's config takes loss.chunks=8, its log says so, and the plan returned is the
    chunked recipe's own; a rerun plans nothing again. Below the chunked peak it is refused still."""
    over = ["model.args.vocab_size=8192", "run.memory_margin_gib=0", "run.memory_margin_fraction=0"]
    own = dict(shards=("none",), checkpointing=("none",), batches=False)
    plain = memory_plan.plan(_tiny(*over), 1, **own).peak()
    chunked = memory_plan.plan(_tiny(*over, "loss.chunks=8"), 1, **own).peak()
    assert chunked < 0.8 * plain, (chunked, plain)
    monkeypatch.setattr(memory_plan, "device_bytes", lambda index=None: (chunked + plain) // 2)
    cfg = _tiny(*over)
    assert cfg.loss.chunks == 0 and cfg.loss.chunks_when_needed
    result = memory_plan.check_before_launch(cfg)
    assert cfg.loss.chunks == memory_plan.CHUNKED == 8
    # the chunked recipe's own plan (the launch's: no warm-up copy on a CPU), which fits where the plain one did not
    assert result is not None and result.fits() and result.peak() < 0.8 * plain, (result and result.peak(), plain)
    said = capfd.readouterr().err
    assert "does not fit" in said and "loss.chunks=8 (the output layer and the loss in chunks) would (" in said, said
    assert "the run takes it (loss.chunks_when_needed=false stops here instead)" in said, said
    gib = (chunked + plain) // 2 / 2**30  # python -m distlib.runner.plan says so, on a device of that size
    assert memory_plan.main(["recipes/gpt_demo.yaml", "train.batch_size=16", *over, "--gpu-gib", f"{gib:.6f}"]) == 0
    assert "a launch takes loss.chunks=8 instead (loss.chunks_when_needed=false refuses it)" in capfd.readouterr().out
    monkeypatch.setattr(memory_plan, "_plan_here", lambda *a: pytest.fail("planned again"))
    monkeypatch.setattr(memory_plan, "_plan_in_child", lambda *a: pytest.fail("planned again"))
    again = _tiny(*over)
    assert memory_plan.check_before_launch(again).peak() == result.peak() and again.loss.chunks == 8
    monkeypatch.undo()
    monkeypatch.setattr(plan_cache, "cache_dir", lambda cfg: "/nonexistent/plans")  # nothing kept: planned now
    monkeypatch.setattr(memory_plan, "device_bytes", lambda index=None: chunked // 2)
    small = _tiny(*over)
    with pytest.raises(memory_plan.MemoryRefused) as refused:
        memory_plan.check_before_launch(small)
    assert small.loss.chunks == 0 and "loss.chunks=8" not in str(refused.value), str(refused.value)


def test_the_plan_counts_the_loss_in_chunks_where_the_run_applies_it_and_not_elsewhere():
    """The plan asks the task's own rule (``chunks_applied``): under a whole-model compile the loss in
    chunks runs (its Function outside the model's graph) and is planned lower than the plain loss; a
    loss of the user's own is never taken in chunks."""
    over = ["model.args.vocab_size=8192", "run.memory_margin_gib=0", "run.memory_margin_fraction=0"]
    own = dict(shards=("none",), checkpointing=("none",), batches=False)
    whole = _tiny(*over, "train.compile=model", "loss.chunks=8")
    assert chunks_applied(whole) == 8
    plain = memory_plan.plan(_tiny(*over, "train.compile=model"), 1, **own).peak()
    assert memory_plan.plan(whole, 1, **own).peak() < 0.8 * plain
    custom = _tiny(*over, "loss.chunks=8")
    custom.loss = dataclasses.replace(custom.loss, name="mylosses:focal")  # a loss of the user's own
    assert chunks_applied(custom) == 0


def test_the_plan_is_keyed_by_the_code_and_the_versions(monkeypatch):
    cfg = _tiny()
    key = plan_cache.plan_key(cfg, 1, "", None, False, {})
    assert plan_cache.plan_key(cfg, 1, "", None, False, {}) == key
    assert plan_cache.plan_key(cfg, 1, "NVIDIA H100 80GB HBM3", None, False, {}) != key
    monkeypatch.setattr(plan_cache, "code_hash", lambda cfg: "edited")
    assert plan_cache.plan_key(cfg, 1, "", None, False, {}) != key
    monkeypatch.undo()
    monkeypatch.setattr(plan_cache, "_version", lambda package: "9.9")
    assert plan_cache.plan_key(cfg, 1, "", None, False, {}) != key


def test_every_setting_left_out_of_the_key_is_a_setting():
    cfg = Config()
    for section, names in plan_cache.UNPLANNED.items():
        fields = {f.name for f in dataclasses.fields(getattr(cfg, section))}
        assert set(names) <= fields, (section, set(names) - fields)


def _rank(results: dict, made: list, directory: str, rank: int, delay: float = 0.0, world: int = 3) -> None:
    time.sleep(delay)

    def make():
        made.append(rank)
        time.sleep(0.5)
        return "ok", {"peak": 12345, "by": rank}, True

    results[rank] = plan_cache.shared_plan(directory, "k", make, local_rank=rank, local_world=world)


def test_the_other_local_ranks_take_local_rank_0s_plan(tmp_path):
    results, made = {}, []
    threads = [threading.Thread(target=_rank, args=(results, made, str(tmp_path), r, 0.3 if r == 0 else 0.0))
               for r in (2, 1, 0)]  # fmt: skip
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert made == [0], made  # planned once, by local rank 0, although the others asked first
    assert results[0] == ("ok", {"peak": 12345, "by": 0}, "planned")
    assert results[1] == results[2] == ("ok", {"peak": 12345, "by": 0}, "local rank 0")
    results, made = {}, []
    _rank(results, made, str(tmp_path), 0)  # the next launch: from the file, planned by nobody
    assert made == [] and results[0][2] == "cache"


def test_a_plan_not_kept_serves_its_own_launch_only(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "launch-a")
    out = plan_cache.shared_plan(str(tmp_path), "k", lambda: ("died", "BrokenProcessPool: ...", False))
    assert out[2] == "planned"
    same = plan_cache.shared_plan(str(tmp_path), "k", lambda: pytest.fail("planned"), local_rank=1, local_world=2)
    assert same[:2] == ("died", "BrokenProcessPool: ...")  # another rank of the launch: its outcome
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "launch-b")
    assert plan_cache.shared_plan(str(tmp_path), "k", lambda: ("ok", 1, True))[:2] == ("ok", 1)


def test_a_local_rank_0_that_cannot_write_its_plan_keeps_no_one_waiting(tmp_path, monkeypatch):
    """A full disk: local rank 0 plans, cannot write, gives up its claim; the others plan on their own
    as soon as it is done, not after minutes."""
    monkeypatch.setattr(plan_cache, "_write", lambda path, entry: False)
    results, made = {}, []
    threads = [threading.Thread(target=_rank, args=(results, made, str(tmp_path), r, 0.0 if r == 0 else 0.2, 2))
               for r in (0, 1)]  # fmt: skip
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert sorted(made) == [0, 1] and time.monotonic() - t0 < 5
    assert results[1] == ("ok", {"peak": 12345, "by": 1}, "planned")
