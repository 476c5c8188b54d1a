"""The runner as an installed package: a non-editable install of the project into a fresh virtual
environment, used from a folder outside the checkout with no PYTHONPATH, trains a recipe of the user's
own through ``python -m distlib.runner`` and the ``distlib-train`` script."""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys

import pytest

from tests.conftest import ROOT


def _environment(tmp_path) -> tuple[str, str]:
    """A virtual environment with this project installed from a copy of its sources (pip builds in the
    source tree: the checkout stays clean), and the test environment's packages (torch, pyyaml...)
    visible below its own. ``venv --system-site-packages`` would show the base interpreter's packages,
    not a virtual environment's: a .pth line adds the test environment's site folders (their own .pth
    files, an editable install of distlib among them, are not run). Returns (python, bin folder)."""
    src = tmp_path / "src"
    src.mkdir()
    shutil.copy(os.path.join(ROOT, "pyproject.toml"), src)
    shutil.copytree(os.path.join(ROOT, "distlib"), src / "distlib", ignore=shutil.ignore_patterns("__pycache__"))
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    own = subprocess.run([python, "-c", "import site; print(site.getsitepackages()[0])"], capture_output=True,
                         text=True, check=True).stdout.strip()  # fmt: skip
    with open(os.path.join(own, "test_environment.pth"), "w") as f:
        f.write("\n".join(site.getsitepackages()) + "\n")
    subprocess.run([python, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index", str(src)],
                   check=True, env=_env(), cwd=tmp_path, timeout=300)  # fmt: skip
    return python, str(venv / "bin")


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSTARTUP")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return {**env, **extra}


@pytest.mark.slow
def test_the_installed_package_trains_a_users_recipe_from_any_folder(tmp_path):
    python, bin_dir = _environment(tmp_path)
    work = tmp_path / "work"  # the user's folder: their data and recipe, no checkout
    (work / "data").mkdir(parents=True)
    text = "".join(f"line {i}: the quick brown fox jumps over the lazy dog {i * 7 % 13}.\n" for i in range(400))
    (work / "data" / "words.txt").write_text(text)
    (work / "tiny.yaml").write_text(
        "data: {name: byte_text, root: data/words.txt, args: {block_size: 16}}\n"
        "model: {name: gpt, args: {n_layer: 1, n_head: 2, n_embd: 16}}\n"
        "train: {epochs: 0, max_steps: 3, batch_size: 4, sample_tokens: 0}\n"
        "run: {progress: plain, curves: off}\n"
    )
    # the package is the installed copy, not the checkout
    where = subprocess.run([python, "-c", "import distlib.runner.main as m; print(m.__file__)"], cwd=work,
                           env=_env(), capture_output=True, text=True, check=True).stdout  # fmt: skip
    assert where.startswith(str(tmp_path / "venv")), where
    for name, cmd in (
        ("module", [python, "-m", "distlib.runner"]),
        ("script", [os.path.join(bin_dir, "distlib-train")]),
    ):
        out_dir = work / "runs" / name
        run = subprocess.run([*cmd, "tiny.yaml", f"run.out_dir={out_dir}", "train.seed=3"], cwd=work,
                             env=_env(PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}"), capture_output=True,
                             text=True, timeout=300)  # fmt: skip
        assert run.returncode == 0, (name, run.stderr[-3000:])
        rows = [json.loads(line) for line in open(out_dir / "metrics.jsonl")]
        steps = [r["step"] for r in rows if "train_loss" in r or "loss" in r]
        assert steps and max(steps) == 3, rows
    # bad input: one line, exit 2, from the script as from launch.py
    bad = subprocess.run([os.path.join(bin_dir, "distlib-train"), "tiny.yaml", "train.nope=1"], cwd=work, env=_env(),
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert bad.returncode == 2 and "error:" in bad.stderr and "Traceback" not in bad.stderr, bad.stderr
