"""What large runs under dist.shard=full need, from the recipe: dist.offload (FSDP2's CPU offload),
dist.reshard_after_forward, dist.accumulate=sharded, and run.final_checkpoint (full, weights or
none). Each trains the tiny GPT demo on gloo ranks to the losses of the default full-sharding run,
step by step, and is seen to be applied (FSDP2's offload policy and post-forward resharding, the
step's accumulation); a run whose final checkpoint is its weights alone exports as the trained
model; the keys are ConfigErrors outside full sharding.
"""

from __future__ import annotations

import os

import pytest
import torch

from distlib.runner.config import ConfigError, load_config
from tests.conftest import run_ranks
from tests.runner.conftest import checkpoints
from tests.runner.test_sharding import DEMO, SMALL_GPT, Recorded
from tests.runner.test_trainer import built

FULL = [*SMALL_GPT, "dist.shard=full", "train.grad_accum=2"]


@pytest.mark.parametrize("key", ["dist.offload=true", "dist.reshard_after_forward=false", "dist.accumulate=sharded"])
def test_the_full_sharding_keys_are_config_errors_in_the_other_modes(key):
    with pytest.raises(ConfigError) as e:
        load_config(DEMO, [key, "dist.shard=optimizer"])
    (problem,) = e.value.problems
    assert key in problem and "dist.shard=full" in problem, problem


def _trained(ctx, overrides: list[str]) -> dict:
    """This rank's loss at every step, what FSDP2 and the step were given, the final weights."""
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule

    cfg = load_config(DEMO, [*FULL, *overrides])
    losses: list[float] = []
    with built(cfg, ctx) as trainer:
        groups = [m._get_fsdp_state()._fsdp_param_group for m in trainer.model.modules() if isinstance(m, FSDPModule)]
        seen = {
            "offload": all(isinstance(g.offload_policy, CPUOffloadPolicy) for g in groups),
            # a unit resharded after forward has a post-forward mesh (the last block never has one)
            "resharded": sum(g.post_forward_mesh_info is not None for g in groups),
            "accumulate": trainer.step_fn.sync.accumulate,
        }
        trainer.step_fn = Recorded(trainer.step_fn, losses)
        assert trainer.fit() == 0
        final = {k: v.full_tensor().detach().clone() for k, v in trainer.model.state_dict().items()}
    return {"losses": losses, "seen": seen, "final": final}


@pytest.mark.parametrize(
    ("world_size", "option", "seen"),
    [
        (2, "dist.offload=true", {"offload": True}),
        (3, "dist.reshard_after_forward=false", {"resharded": 0}),
        (3, "dist.accumulate=sharded", {"accumulate": "sharded"}),
    ],
)
def test_each_full_sharding_option_trains_as_the_default(tmp_path, world_size, option, seen):
    """Two micro-batches a step: each option's losses equal the default full-sharding run's within
    1e-5 relative, and the option is applied (the default: no offload, every unit but the last
    block resharded after forward, unsharded accumulation)."""
    ref = run_ranks(_trained, world_size, [f"run.out_dir={tmp_path / 'ref'}"], timeout=240)
    got = run_ranks(_trained, world_size, [option, f"run.out_dir={tmp_path / 'got'}"], timeout=240)
    assert ref[0]["seen"]["offload"] is False and ref[0]["seen"]["accumulate"] == "unsharded"
    assert ref[0]["seen"]["resharded"] > 0
    for key, value in seen.items():
        assert got[0]["seen"][key] == value, (key, got[0]["seen"])
    for r in range(world_size):
        assert len(got[r]["losses"]) == 8
        assert got[r]["losses"] == pytest.approx(ref[r]["losses"], rel=1e-5), r


def test_the_final_checkpoint_is_the_weights_alone_or_nothing(tmp_path):
    """run.final_checkpoint=weights: the model alone in <run>/weights/step<N>/ (no optimizer state),
    beside the periodic checkpoints of <run>/checkpoints (steps 3 and 6, older: none at the end), and
    python -m distlib.runner.export writes the trained weights from the newest (the final weights,
    not a periodic checkpoint's); =none: neither."""
    from distlib.runner.hf.dcp_tensors import CheckpointTensors
    from distlib.runner.models.export import export, load_gpt

    out = tmp_path / "weights"
    overrides = ["run.final_checkpoint=weights", "run.checkpoint_every_steps=3", f"run.out_dir={out}"]
    (r0, _) = run_ranks(_trained, 2, overrides, timeout=240)
    assert checkpoints(out) == ["step000000003", "step000000006"]
    (step,) = os.listdir(out / "weights")
    assert step == "step000000008", step
    names = CheckpointTensors(str(out / "weights" / step), "").shapes
    assert names and all(n.startswith("model.") for n in names), sorted(names)
    export(str(out), str(tmp_path / "exported"), dtype="fp32")
    exported = load_gpt(str(tmp_path / "exported")).state_dict()
    for k, v in r0["final"].items():
        torch.testing.assert_close(exported[k], v, rtol=0, atol=0, msg=k)

    none = tmp_path / "none"
    run_ranks(_trained, 2, ["run.final_checkpoint=none", f"run.out_dir={none}"], timeout=240)
    assert checkpoints(none) == [] and not os.path.exists(none / "weights")
