"""README.md and docs/ stay true: the configuration page is the generated one, the two commands
exist, the README stays a front door, and every relative link leads to a file."""

from __future__ import annotations

import glob
import os
import re

from distlib.runner.config import CONFIGURATION_DOC, configuration_page
from tests.conftest import ROOT

README_MAX_LINES = 200
# [text](target) outside code; the target up to the first space, ")" or "#"
LINK = re.compile(r"\[[^\]]*\]\(([^)\s#]*)(?:#[^)\s]*)?(?:\s[^)]*)?\)")


def read(name: str) -> str:
    with open(os.path.join(ROOT, name)) as f:
        return f.read()


def test_configuration_page_is_what_the_generator_writes():
    assert read(CONFIGURATION_DOC) == configuration_page(), f"{CONFIGURATION_DOC} is stale: run `make reference`"


def test_make_reference_writes_the_configuration_page():
    assert re.search(rf"^reference:.*\n\t.*--write-docs {re.escape(CONFIGURATION_DOC)}$", read("Makefile"), re.M)


def test_the_two_commands_are_make_targets_and_ci_runs_the_test_command():
    readme, makefile, ci = read("README.md"), read("Makefile"), read(".ci/run")
    for target in ("demo", "test"):
        assert f"make {target}" in readme
        assert re.search(rf"^{target}:", makefile, re.M)
    assert re.search(r"^PYTEST_ADDOPTS=.* make test$", ci, re.M)


def test_readme_is_a_front_door():
    lines = read("README.md").count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines (at most {README_MAX_LINES}): move text to docs/"


def links(text: str) -> list[str]:
    """Relative link targets of a markdown text, fenced code blocks left out."""
    prose = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    return [t for t in LINK.findall(prose) if t and not re.match(r"[a-z][a-z0-9+.-]*:", t)]


def test_links_finds_relative_targets_only():
    text = "[a](docs/x.md) [b](https://e.org) [c](y.md#part) [d](#top)\n```\n[e](z.md)\n```\n"
    assert links(text) == ["docs/x.md", "y.md"]


def test_every_relative_link_leads_to_a_file():
    pages = ["README.md"] + sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))
    assert len(pages) > 1, "docs/ has no pages"
    broken = []
    for page in pages:
        for target in links(read(page)):
            path = os.path.normpath(os.path.join(ROOT, os.path.dirname(page), target))
            if not os.path.exists(path):
                broken.append(f"{page}: {target}")
    assert not broken, "links to missing files:\n" + "\n".join(broken)


# `tests/...py::name` in prose (a parametrized id such as `name[x]` names the function `name`)
TEST_REF = re.compile(r"`(tests/[\w/]+\.py)::(\w+)(?:\[[^\]`]*\])?`")


def missing_test_refs(text: str) -> list[str]:
    """The `tests/FILE.py::NAME` references of ``text`` whose file lacks ``def NAME(``."""
    missing = []
    for path, name in TEST_REF.findall(text):
        full = os.path.join(ROOT, path)
        source = open(full).read() if os.path.isfile(full) else ""
        if not re.search(rf"^\s*def {name}\(", source, re.M):
            missing.append(f"{path}::{name}")
    return missing


def test_missing_test_refs_finds_what_is_not_there():
    text = "`tests/runner/test_readme.py::test_readme_is_a_front_door` `tests/runner/test_readme.py::no_such_test` "
    text += "`tests/no_such_file.py::test_x` `tests/runner/test_readme.py::test_readme_is_a_front_door[1]`"
    assert missing_test_refs(text) == ["tests/runner/test_readme.py::no_such_test", "tests/no_such_file.py::test_x"]


def test_every_test_named_in_the_testing_page_exists():
    text = read(os.path.join("docs", "testing.md"))
    assert len(TEST_REF.findall(text)) > 20, "docs/testing.md names no tests (the pattern no longer matches?)"
    missing = missing_test_refs(text)
    assert not missing, "docs/testing.md names tests that do not exist:\n" + "\n".join(missing)


def test_the_errors_the_readme_names_are_distlib_errors():
    """The README's promise: every error distlib raises for bad input is a DistlibError, exported."""
    import distlib

    row = next(line for line in read("README.md").splitlines() if line.startswith("| `DistlibError`"))
    names = re.findall(r"`(\w+)`", row.split("|")[1])
    assert len(names) >= 5, row
    for name in names:
        assert name in distlib.__all__, f"the README names distlib.{name}, which distlib does not export"
        assert issubclass(getattr(distlib, name), distlib.DistlibError), f"distlib.{name} is not a DistlibError"


def test_the_readme_api_table_names_every_export():
    import distlib

    section = read("README.md").split("## API at a glance", 1)[1].split("\n## ", 1)[0]
    code = " ".join(re.findall(r"`([^`]*)`", section))
    missing = [name for name in distlib.__all__ if not re.search(rf"\b{name}\b", code)]
    assert not missing, f"README.md's API table does not name these exports of distlib: {missing}"
