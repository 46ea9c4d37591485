"""The README and docs/ point at things that exist: every relative link, every test a guarantee names,
every experiment's page; and the README stays a front page."""

from __future__ import annotations

import re

import pytest

from helpers import REPO

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
# docs/reliability.md abbreviates the test files its guarantees table names
ABBREVIATIONS = {
    "R": "tests/test_reliability.py",
    "C": "tests/test_checkpoint.py",
    "I": "tests/test_checkpoint_integrity.py",
}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_relative_link_exists(page):
    for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", page.read_text()):
        assert (page.parent / target).exists(), f"{page.name} links to {target}, which does not exist"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_test_named_exists(page):
    for path, name in re.findall(r"`((?:tests/\w+\.py)|[RCI])::(\w+)", page.read_text()):
        source = (REPO / ABBREVIATIONS.get(path, path)).read_text()
        assert f"def {name}(" in source, f"{page.name} names {path}::{name}, which does not exist"


def test_every_experiment_has_its_row_and_page():
    readme = (REPO / "README.md").read_text()
    for script in sorted((REPO / "experiments").glob("*.py")):
        if script.name == "__init__.py":
            continue
        name = script.stem
        page = "collectives" if name == "collectives_bench" else name
        assert f"[`{name}`](docs/{page}.md)" in readme and (REPO / "docs" / f"{page}.md").exists(), name


def test_the_readme_is_a_front_page():
    assert len((REPO / "README.md").read_text().splitlines()) <= 250
