"""README.md stays true: its config reference is the generated one, its commands exist."""

from __future__ import annotations

import os
import re

from distlib.runner.config import REFERENCE_BEGIN, REFERENCE_END, reference_table
from tests.conftest import ROOT


def read(name: str) -> str:
    with open(os.path.join(ROOT, name)) as f:
        return f.read()


def test_config_reference_is_current():
    text = read("README.md")
    assert REFERENCE_BEGIN in text and REFERENCE_END in text
    table = text.split(REFERENCE_BEGIN, 1)[1].split(REFERENCE_END, 1)[0].strip()
    assert table == reference_table().strip(), "README's config reference is stale: run `make reference`"


def test_every_key_is_in_the_reference():
    table = reference_table()
    for key in ("train.epochs", "run.out_dir", "dist.timeout_s", "dist.backend", "data.root"):
        assert f"| `{key}` |" in table


def test_the_two_commands_are_make_targets_and_ci_runs_the_test_command():
    readme, makefile, ci = read("README.md"), read("Makefile"), read(".ci/run")
    for target in ("demo", "test"):
        assert f"make {target}" in readme
        assert re.search(rf"^{target}:", makefile, re.M)
    assert re.search(r"^PYTEST_ADDOPTS=.* make test$", ci, re.M)
