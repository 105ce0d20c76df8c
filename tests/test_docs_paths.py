"""Every repository path the README, the docs pages, CONTRIBUTING.md and CHANGELOG.md name
exists.

A path is a word starting with ``src/``, ``examples/``, ``benchmarks/``, ``scripts/`` or
``tests/`` (``src/fxamp/passes/softmax.py``, ``tests/data/trt/``); a test file named alone
(``test_inplace.py``, ``test_audit.py::test_norm_eps``) must be in ``tests/``, with the test
function when one is named.
"""
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", ROOT / "CHANGELOG.md",
         *sorted((ROOT / "docs").glob("*.md"))]
PATH = re.compile(r"(?<![\w./-])((?:src|examples|benchmarks|scripts|tests)/[\w./-]*[\w/])")
TEST_FILE = re.compile(r"(?<![\w./-])(test_\w+\.py)(?:::(\w+))?")


def _ids(pages):
    return [str(p.relative_to(ROOT)) for p in pages]


def test_the_pages_are_found():
    names = _ids(PAGES)
    assert "README.md" in names and "docs/index.md" in names and "docs/api.md" in names


@pytest.mark.parametrize("page", PAGES, ids=_ids(PAGES))
def test_every_path_a_page_names_exists(page):
    text = page.read_text(encoding="utf-8")
    named = sorted({m.group(1) for m in PATH.finditer(text)})
    missing = [p for p in named if not (ROOT / p).exists()]
    assert not missing, f"{page.relative_to(ROOT)} names paths that do not exist: {missing}"


@pytest.mark.parametrize("page", PAGES, ids=_ids(PAGES))
def test_every_test_a_page_names_exists(page):
    text = page.read_text(encoding="utf-8")
    missing = []
    for m in TEST_FILE.finditer(text):
        path = ROOT / "tests" / m.group(1)
        if not path.is_file():
            missing.append(m.group(0))
        elif m.group(2) and not re.search(rf"^\s*def {m.group(2)}\(", path.read_text(
                encoding="utf-8"), re.M):
            missing.append(m.group(0))
    assert not missing, f"{page.relative_to(ROOT)} names tests that do not exist: {missing}"


def test_the_pattern_finds_our_paths_and_only_ours():
    """Paths in prose, code spans and commands are found; paths inside other paths are not."""
    text = ("see `src/fxamp/plan.py`, run python benchmarks/nope.py; "
            "BASE/src/x.py and mypkg/examples/y.py are not ours; tests/data/trt/.")
    assert [m.group(1) for m in PATH.finditer(text)] == [
        "src/fxamp/plan.py", "benchmarks/nope.py", "tests/data/trt/"]
    assert (ROOT / "src/fxamp/plan.py").exists() and not (ROOT / "benchmarks/nope.py").exists()
