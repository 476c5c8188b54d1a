"""load_config: every problem reported at once, with what is wrong and where."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from distlib.runner.config import Config, ConfigError, dump_yaml, load_config
from tests.conftest import ROOT


def problems(recipe=None, overrides=()) -> list[str]:
    with pytest.raises(ConfigError) as err:
        load_config(recipe, list(overrides))
    assert str(err.value).startswith("invalid configuration:")
    return err.value.problems


def write(tmp_path, text: str, name: str = "r.yaml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_defaults_and_run_name_from_recipe(tmp_path):
    cfg = load_config(write(tmp_path, "train:\n  epochs: 3\n", "my_recipe.yaml"))
    assert cfg.train.epochs == 3
    assert cfg.train.batch_size == Config().train.batch_size  # YAML holds only what differs
    assert cfg.run.name == "my_recipe"
    assert cfg.run.out_dir == os.path.join("runs", "my_recipe")
    assert load_config(None).run.name == "default"
    assert load_config(write(tmp_path, "")).train.epochs == Config().train.epochs  # an empty recipe: defaults
    named = load_config(write(tmp_path, "", "my_recipe.yaml"), ["run.name=exp1"])
    assert named.run.out_dir == os.path.join("runs", "exp1")  # runs/<run.name>, not the recipe's name


def test_malformed_yaml(tmp_path):
    path = write(tmp_path, "train:\n  epochs: [1, 2\n")
    (p,) = problems(path)
    assert p.startswith(f"recipe {path!r}: malformed YAML:")
    assert "\n" not in p


def test_missing_recipe_file(tmp_path):
    path = str(tmp_path / "nope.yaml")
    assert problems(path) == [f"recipe {path!r}: no such file"]


def test_recipe_is_a_directory(tmp_path):
    assert problems(str(tmp_path)) == [f"recipe {str(tmp_path)!r}: is a directory, expected a YAML file"]


def test_unknown_key_gives_dotted_path_and_valid_keys(tmp_path):
    (p,) = problems(write(tmp_path, "train:\n  epoch: 3\n"))
    assert p.startswith("train.epoch: unknown key (valid keys here: epochs, max_steps, batch_size, optimizer, lr,")
    assert p.endswith("; did you mean 'epochs'?")
    (p,) = problems(write(tmp_path, "data:\n  augment:\n    flips: none\n"))
    assert p == "data.augment.flips: unknown key (valid keys here: crop_pad, flip, cutout); did you mean 'flip'?"
    (p,) = problems(write(tmp_path, "trian:\n  epochs: 3\n"))
    sections = "data, model, loss, train, dist, run, profile"
    assert p == f"trian: unknown key (valid keys here: {sections}); did you mean 'train'?"
    (p,) = problems(None, ["model.zzz=1"])  # nothing close: no guess
    assert p == "model.zzz: unknown key (valid keys here: name, args, width, num_classes, channels_last, block_class)"


def test_misspelt_keys_get_a_guess_and_every_problem_at_once():
    found = problems(None, ["train.batchsize=64", "dist.comm_group=2", "train.lr=fast", "model.widht=8"])
    assert [p.split(":")[0] for p in found] == ["train.batchsize", "dist.comm_group", "train.lr", "model.widht"]
    assert found[0].endswith("did you mean 'batch_size'?")
    assert found[1].endswith("did you mean 'comm_groups'?")
    assert found[3].endswith("did you mean 'width'?")


@pytest.mark.parametrize(
    "yaml_text, expected",
    [
        ("train:\n  epochs: ten\n", "train.epochs: expected int, got 'ten'"),
        ("train:\n  epochs: 2.5\n", "train.epochs: expected int, got 2.5"),
        ("train:\n  epochs: true\n", "train.epochs: expected int, got True"),
        ("train:\n  lr: fast\n", "train.lr: expected float, got 'fast'"),
        ("train:\n  nesterov: 1\n", "train.nesterov: expected bool, got 1"),
        ("data:\n  root: [a, b]\n", "data.root: expected str, got ['a', 'b']"),
        ("run:\n  name: yes\n", "run.name: expected str, got True"),  # YAML 1.1 reads yes as a bool
        ("dist:\n  backend: mpi\n", "dist.backend: expected one of 'auto', 'nccl', 'gloo', got 'mpi'"),
        ("train: 5\n", "train: expected a mapping of keys, got 5"),
        ("- 1\n- 2\n", "<top level>: expected a mapping of keys, got [1, 2]"),
        ("train:\n  epochs:\n", "train.epochs: expected int, got None"),
    ],
)
def test_wrong_type_names_key_expected_type_and_value(tmp_path, yaml_text, expected):
    assert problems(write(tmp_path, yaml_text)) == [expected]


def test_values_out_of_range(tmp_path):
    text = "train:\n  epochs: 0\n  warmup_frac: 1.5\n  lr: -0.1\ndist:\n  timeout_s: 0\n"
    assert problems(write(tmp_path, text)) == [
        "train.epochs: must be > 0, got 0",
        "dist.timeout_s: must be > 0, got 0.0",
        "train.lr: must be >= 0, got -0.1",
        "train.warmup_frac: must be in [0, 1), got 1.5",
    ]


def test_compile_is_refused_with_the_fallback_mode():
    assert load_config(None, ["train.compile=true"]).train.compile == "auto"
    found = problems(None, ["train.compile=true", "dist.mode=fallback"])
    assert len(found) == 1 and "train.compile=auto with dist.mode=fallback" in found[0], found


def test_precision_fp16_refuses_a_captured_cuda_graph(tmp_path):
    assert load_config(None, ["train.precision=fp16"]).train.precision == "fp16"
    assert load_config(None, ["train.precision=fp16", "train.cuda_graph=false"]).train.cuda_graph is False
    assert load_config(None, ["train.precision=bf16", "train.cuda_graph=true"]).train.cuda_graph is True
    found = problems(write(tmp_path, "train:\n  precision: fp16\n  cuda_graph: true\n"))
    assert len(found) == 1 and "train.precision=fp16 with train.cuda_graph=true" in found[0], found
    assert problems(None, ["train.precision=fp4"]) == [
        "train.precision: expected one of 'bf16', 'fp16', 'fp32', 'fp8', got 'fp4'"
    ]


def test_several_problems_reported_at_once(tmp_path):
    path = write(tmp_path, "train:\n  epoch: 3\n  lr: fast\nmodel:\n  name: vgg\n")
    found = problems(path, ["dist.timeout_s=soon", "nonsense", "train.epochs=0"])
    assert len(found) == 6, found  # the range and component checks too, beside the type errors
    assert found[0].startswith("train.epoch: unknown key")
    assert found[1] == "train.lr: expected float, got 'fast'"
    assert found[2] == "dist.timeout_s: expected float, got 'soon'"
    assert found[3] == "override 'nonsense': expected dotted.key=value"
    assert found[4] == "train.epochs: must be > 0, got 0"
    assert found[5].startswith("model.name: unknown model 'vgg': expected one of resnet18_cifar, small_cnn, gpt")
    text = str(ConfigError(found))
    assert text.count("\n  - ") == 6


def test_override_coercion():
    cfg = load_config(
        None,
        [
            "train.lr=1",  # int -> float
            "train.weight_decay=1e-4",  # YAML 1.1 reads this as a string
            "train.momentum=.8",
            "data.download=true",
            "train.nesterov=false",
            "run.name=no",  # a str key keeps the text (YAML would read False)
            "data.root=123",  # and a number as text
            "dist.backend=gloo",  # Literal
            "train.epochs=7",
            "data.cache_dir=",  # empty string
            "run.out_dir=runs/lr=0.1",  # the value may hold "=": the key ends at the first one
        ],
    )
    assert cfg.train.lr == 1.0 and isinstance(cfg.train.lr, float)
    assert cfg.train.weight_decay == 1e-4
    assert cfg.train.momentum == 0.8
    assert cfg.data.download is True and cfg.train.nesterov is False
    assert cfg.run.name == "no" and cfg.data.root == "123"
    assert cfg.dist.backend == "gloo" and cfg.train.epochs == 7 and cfg.data.cache_dir == ""
    assert cfg.run.out_dir == "runs/lr=0.1"


def test_nested_overrides_apply_after_the_recipe(tmp_path):
    path = write(tmp_path, "data:\n  augment:\n    flip: random\n    crop_pad: 2\ntrain:\n  epochs: 3\n")
    cfg = load_config(path, ["data.augment.flip=alternating", "train.epochs=5", "train.epochs=6"])
    assert cfg.data.augment.flip == "alternating"
    assert cfg.data.augment.crop_pad == 2  # untouched by the override
    assert cfg.train.epochs == 6  # the last override wins


def test_flow_values_in_overrides_and_null_removes_a_key(tmp_path):
    """An override's YAML flow mapping or list reaches its mapping as YAML (merged into the recipe's
    mapping, as the dotted form is); other text stays text; key=null removes the key, at any depth
    (what receives the mapping uses its default; the last override wins), while a recipe's own
    null is None; args=null removes every argument; a flow value for a key of another type is named."""
    text = "model:\n  name: gpt\n  args:\n    n_layer: 3\n    dropout: 0.1\n    config:\n      head_dim: 64\n"
    path = write(tmp_path, text + "      window: null\n      rope: {theta: 5.0, kind: llama3}\n")
    cfg = load_config(path, [
        "model.args.config.rope={factor: 8.0, low: [1, 2]}",  # merged: theta and kind kept
        "model.args.config.layers=[full, sliding, full]",
        "model.args.config.head_dim=null",  # removed
        "model.args.dropout=null", "model.args.dropout=0.2",  # removed, then set again
        "model.args.n_layer=null",
        "model.args.config.absent=null",  # removing what is not there: nothing
        "model.args.prompt=Question: why",  # text, not a block mapping
        "model.args.item=- x",
        "run.name={a: 1}",  # a str key keeps its text
    ], check_components=False)  # fmt: skip
    assert cfg.model.args == {
        "dropout": 0.2,
        "config": {"window": None, "rope": {"theta": 5.0, "kind": "llama3", "factor": 8.0, "low": [1, 2]},
                   "layers": ["full", "sliding", "full"]},
        "prompt": "Question: why",
        "item": "- x",
    }  # fmt: skip
    assert cfg.run.name == "{a: 1}"
    assert load_config(path, ["model.args=null"], check_components=False).model.args == {}
    assert load_config(path, ["data.args={block_size: 32}"], check_components=False).data.args == {"block_size": 32}
    assert problems(None, ["train.lr={a: 1}", "train.epochs=null"]) == [
        "train.lr: expected float, got {'a': 1}", "train.epochs: expected int, got None"]  # fmt: skip


@pytest.mark.parametrize(
    "item, expected",
    [
        ("train.epochs", "override 'train.epochs': expected dotted.key=value"),
        ("=3", "override '=3': expected dotted.key=value"),
        ("train..epochs=3", "override 'train..epochs=3': expected dotted.key=value"),
        ("train.=3", "override 'train.=3': expected dotted.key=value"),
        ("train.epochs=[1, 2]", "train.epochs: expected int, got [1, 2]"),
        ("train.epochs.x=1", "train.epochs: expected int, got {'x': 1}"),
        ("train=3", "train: expected a mapping of keys, got 3"),
        ("train.lr=1e", "train.lr: expected float, got '1e'"),
    ],
)
def test_bad_override_syntax(item, expected):
    assert problems(None, [item]) == [expected]


def test_resolved_config_round_trips(tmp_path):
    cfg = load_config(None, ["train.epochs=4", "data.augment.cutout=8"])
    again = load_config(write(tmp_path, dump_yaml(cfg)))
    assert dump_yaml(again) == dump_yaml(cfg)


def test_launch_with_a_bad_recipe_exits_2_before_anything_starts(tmp_path):
    out_dir = tmp_path / "out"
    recipe = write(tmp_path, f"run:\n  out_dir: {out_dir}\ntrain:\n  epoch: 3\n  lr: fast\n")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")}
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "launch.py"), recipe, "model.width=wide"],
        capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert "train.epoch: unknown key" in proc.stderr
    assert "train.lr: expected float, got 'fast'" in proc.stderr
    assert "model.width: expected int, got 'wide'" in proc.stderr
    assert "initialized" not in proc.stderr  # no process group, no logger set-up
    assert not out_dir.exists()
    assert os.listdir(tmp_path) == ["r.yaml"]  # nothing written anywhere


def test_a_config_error_under_torchrun_is_printed_once(tmp_path):
    """Every rank finds the same error before any process group starts: one rank prints it; the
    rank's exit status 2 is torchrun's root cause (torchrun itself exits 1 for any failed worker)."""
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")}
    proc = subprocess.run(
        [torchrun, "--standalone", "--nproc-per-node=2", os.path.join(ROOT, "launch.py"),
         os.path.join(ROOT, "recipes", "demo.yaml"), "train.bogus=1", "train.epochs=x"],
        capture_output=True, text=True, cwd=tmp_path, env=dict(env, OMP_NUM_THREADS="1"), timeout=120,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.count("error: invalid configuration") == 1, proc.stderr
    assert proc.stderr.count("train.bogus: unknown key") == 1 and proc.stderr.count("expected int, got 'x'") == 1
    root = proc.stderr.split("Root Cause", 1)[1]
    assert re.search(r"exitcode\s*: 2\b", root), proc.stderr
    assert os.listdir(tmp_path) == []  # nothing written


def test_a_config_error_on_another_local_rank_waits_for_torchrun_then_is_not_lost(monkeypatch, capsys):
    """Local rank 1 under torchrun prints nothing before torchrun would end it (local rank 0 reports
    the error); if it is not ended, it prints the error itself. Without torchrun: printed at once."""
    from distlib.reliability import stop
    from distlib.runner.training import outcome

    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    monkeypatch.setenv("LOCAL_RANK", "1")
    # torchrun's SIGTERM while the rank waits, as the run's handlers have it then: recorded, not raised
    # (an error is being handled); the wait ends at once, without a word
    stop.catch(interrupt=False)
    try:
        sent = time.monotonic()
        threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGTERM)).start()
        assert outcome.exit_code(ConfigError(["train.x: bad"]), 0.0, before_start=True) == 2
        assert time.monotonic() - sent < outcome.PEER_REPORT_WAIT_S / 2
        assert capsys.readouterr().err == ""  # no traceback, no second copy of local rank 0's message
    finally:
        stop.release()
    # not ended by torchrun: after the wait it says the error itself
    monkeypatch.setattr(outcome, "PEER_REPORT_WAIT_S", 0.3)
    assert outcome.exit_code(ConfigError(["train.x: bad"]), 0.0, before_start=True) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: invalid configuration") and err.count("train.x: bad") == 1, err
    waits: list[float] = []
    monkeypatch.setattr(outcome.time, "sleep", waits.append)
    for env in ({"LOCAL_RANK": "0"}, {"TORCHELASTIC_RUN_ID": None}):
        for k, v in env.items():
            monkeypatch.delenv(k) if v is None else monkeypatch.setenv(k, v)
        waits.clear()
        assert outcome.exit_code(ConfigError(["train.x: bad"]), 0.0, before_start=True) == 2
        assert not waits and capsys.readouterr().err.count("train.x: bad") == 1


def test_config_cli_validates_and_prints(tmp_path):
    ok = subprocess.run(
        [sys.executable, "-m", "distlib.runner.config", os.path.join(ROOT, "recipes", "demo.yaml"), "train.epochs=2"],
        capture_output=True, text=True, cwd=ROOT, timeout=120,
    )  # fmt: skip
    assert ok.returncode == 0, ok.stderr
    assert "epochs: 2" in ok.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "distlib.runner.config", "missing.yaml"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert bad.returncode == 2 and "missing.yaml" in bad.stderr and "no such file" in bad.stderr


# ---- every bounded key: at the bound, just outside, and its type ---------------------------
POSITIVE = {  # must be > 0
    "train.epochs": int, "train.batch_size": int, "train.grad_accum": int,
    "profile.active": int, "dist.timeout_s": float, "dist.bucket_mb": float, "dist.comm_groups": int,
    "model.width": int, "model.num_classes": int, "run.keep_checkpoints": int,
}  # fmt: skip
NON_NEGATIVE = {  # must be >= 0
    "train.lr": float, "train.weight_decay": float, "profile.wait": int, "profile.warmup": int,
    "data.train_subset": int, "data.augment.crop_pad": int, "data.augment.cutout": int,
    "run.checkpoint_every": int, "train.prewarm_steps": int, "train.tta_translate": int,
    "train.clip_grad_norm": float, "train.peak_tflops": float, "train.sample_tokens": int,
    "train.max_steps": int, "train.eval_every": int, "train.eval_every_steps": int, "run.checkpoint_every_steps": int,
    "loss.chunks": int, "run.memory_margin_gib": float,
}  # fmt: skip
UNIT = ["train.warmup_frac", "train.ema", "train.label_smoothing", "train.momentum", "train.beta1", "train.beta2",
        "train.min_lr_frac", "run.memory_margin_fraction"]  # in [0, 1)  # fmt: skip
UNBOUNDED = {"train.seed": int}


def _numeric_keys() -> dict[str, type]:
    import dataclasses
    import typing

    out = {}

    def walk(obj, prefix):
        hints = typing.get_type_hints(type(obj))
        for f in dataclasses.fields(obj):
            path = f"{prefix}.{f.name}" if prefix else f.name
            if dataclasses.is_dataclass(hints[f.name]):
                walk(getattr(obj, f.name), path)
            elif hints[f.name] in (int, float):
                out[path] = hints[f.name]

    walk(Config(), "")
    return out


def test_every_numeric_key_has_its_range_tested():
    expected = {**POSITIVE, **NON_NEGATIVE, **dict.fromkeys(UNIT, float), **UNBOUNDED}
    assert _numeric_keys() == expected, "a new numeric key: add it to one of the range tables above"


def test_epochs_0_is_no_limit_only_with_max_steps():
    cfg = load_config(None, ["train.epochs=0", "train.max_steps=100"])
    assert (cfg.train.epochs, cfg.train.max_steps) == (0, 100)
    assert problems(None, ["train.epochs=0"]) == ["train.epochs: must be > 0, got 0"]  # nothing would end the run
    assert problems(None, ["train.epochs=-1", "train.max_steps=100"]) == ["train.epochs: must be >= 0, got -1"]


def _get(cfg, key):
    for part in key.split("."):
        cfg = getattr(cfg, part)
    return cfg


@pytest.mark.parametrize("key", list(POSITIVE))
def test_positive_keys(key):
    assert problems(None, [f"{key}=0"]) == [f"{key}: must be > 0, got {POSITIVE[key](0)!r}"]
    assert problems(None, [f"{key}=-1"]) == [f"{key}: must be > 0, got {POSITIVE[key](-1)!r}"]
    smallest = 1 if POSITIVE[key] is int else 1e-3
    assert _get(load_config(None, [f"{key}={smallest}"]), key) == smallest


@pytest.mark.parametrize("key", list(NON_NEGATIVE))
def test_non_negative_keys(key):
    tp = NON_NEGATIVE[key]
    assert problems(None, [f"{key}=-1"]) == [f"{key}: must be >= 0, got {tp(-1)!r}"]
    assert _get(load_config(None, [f"{key}=0"]), key) == 0


@pytest.mark.parametrize("key", UNIT)
def test_unit_interval_keys(key):
    for bad in ("1.0", "1", "-0.01", "1.5"):
        assert problems(None, [f"{key}={bad}"]) == [f"{key}: must be in [0, 1), got {float(bad)!r}"], bad
    assert _get(load_config(None, [f"{key}=0"]), key) == 0.0
    assert _get(load_config(None, [f"{key}=0.999"]), key) == 0.999


@pytest.mark.parametrize("key", [*POSITIVE, *NON_NEGATIVE, *UNIT, *UNBOUNDED])
def test_numeric_keys_refuse_other_types(key, tmp_path):
    tp = {**POSITIVE, **NON_NEGATIVE, **dict.fromkeys(UNIT, float), **UNBOUNDED}[key]
    name = tp.__name__
    section, _, leaf = key.rpartition(".")
    nested = "".join(f"{'  ' * i}{part}:\n" for i, part in enumerate(section.split(".")))
    indent = "  " * len(section.split("."))
    for text, shown in (("true", "True"), ("false", "False"), ("fast", "'fast'")):  # YAML bools are no numbers
        recipe = write(tmp_path, f"{nested}{indent}{leaf}: {text}\n")
        assert problems(recipe) == [f"{key}: expected {name}, got {shown}"], text
        assert problems(None, [f"{key}={text}"]) == [f"{key}: expected {name}, got {shown}"], text
    if tp is int:
        assert problems(None, [f"{key}=1.5"]) == [f"{key}: expected int, got 1.5"]
    else:
        for text in (".nan", ".inf", "-.inf"):
            (p,) = problems(None, [f"{key}={text}"])
            assert p.startswith(f"{key}: expected a finite float, got "), p
