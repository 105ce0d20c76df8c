"""The real-output blocks of the README and of the docs pages (docs/*.md) are what their
commands print now (no drift).

Each marked block (``<!-- output: COMMAND -->``, see scripts/readme_outputs.py) is one test,
so ``pytest -v tests/test_readme_outputs.py`` lists the blocks it checked. Only the plan
header's ``# fxamp:`` / ``# torch:`` version lines are compared loosely, and the decimals of a
block whose marker states a tolerance (``<!-- output (decimals within 3%): COMMAND -->``).
"""
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "readme_outputs.py"
_spec = importlib.util.spec_from_file_location("readme_outputs", SCRIPT)
ro = importlib.util.module_from_spec(_spec)
sys.modules["readme_outputs"] = ro  # its dataclass looks its module up
_spec.loader.exec_module(ro)

PAGES = ro.PAGES
PAGE_IDS = [ro.page_name(p) for p in PAGES]
BLOCKS = [b for page in PAGES for b in ro.page_blocks(page)]


def test_the_pages_are_the_readme_and_the_docs():
    assert PAGE_IDS[0] == "README.md" and "docs/plan.md" in PAGE_IDS
    assert set(PAGE_IDS[1:]) == {f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md")}
    assert {b.page for b in BLOCKS} >= {"README.md", "docs/plan.md"}


@pytest.mark.slow
@pytest.mark.parametrize("block", BLOCKS,
                         ids=[f"{b.page}:L{b.line}:{b.command[:60]}" for b in BLOCKS])
def test_block_is_what_its_command_prints(block):
    ok, diff = ro.check_block(block)
    assert ok, (f"{block.page}:{block.line} is not what `{block.command}` prints now:\n{diff}\n"
                "if the new output is right: python scripts/readme_outputs.py --write")


@pytest.mark.parametrize("page", PAGES, ids=PAGE_IDS)
def test_every_real_output_claim_has_a_marked_block(page):
    """A sentence that introduces real output ("Real output of ...:") is followed by a
    marked block, so no block can claim to be real without being checked."""
    text = page.read_text(encoding="utf-8")
    name = ro.page_name(page)
    lines = text.split("\n")
    claims = 0
    for m in re.finditer(r"real\s+(output|excerpt|report)", text, re.IGNORECASE):
        line = text.count("\n", 0, m.start())
        colon = next((i for i in range(line, min(line + 4, len(lines)))
                      if lines[i].rstrip().endswith(":")), None)
        if colon is None:  # prose about real output, not an introduction of a block
            continue
        claims += 1
        after = next(i for i in range(colon + 1, len(lines)) if lines[i].strip())
        assert ro.MARKER.match(lines[after]), (
            f"{name}:{line + 1} introduces real output, but line {after + 1} is not an "
            "<!-- output: COMMAND --> marker")
    # most blocks are introduced as real output (a few share an introduction or show a file)
    assert claims >= len([b for b in BLOCKS if b.page == name]) - 2


def test_help_does_not_run_anything():
    r = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0 and "--check" in r.stdout and "--write" in r.stdout


def _cli(*args):
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True,
                          text=True, timeout=120)


@pytest.mark.slow
def test_check_finds_drift_and_write_fixes_it(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(
        "# t\n\n<!-- output: echo hello; echo '# torch: 9.9' -->\n```\nhullo\n# torch: 1.0\n```\n"
        "\n<!-- output: session -->\n```\n$ echo a\nold\n$ printf 'b\\nc\\n'\n```\n"
        "\n<!-- output: printf '| x |\\n|---|\\n| 1 |\\n' -->\n<!-- end output -->\ntail\n")
    r = _cli("--check", str(readme))
    assert r.returncode == 1, r.stdout + r.stderr
    assert "DRIFT README.md:3" in r.stdout and "-hullo" in r.stdout and "+hello" in r.stdout
    r = _cli("--write", str(readme))
    assert r.returncode == 0 and "3 block(s) updated" in r.stdout, r.stdout + r.stderr
    text = readme.read_text()
    assert "```\nhello\n# torch: 9.9\n```" in text
    assert "```\n$ echo a\na\n$ printf 'b\\nc\\n'\nb\nc\n```" in text
    assert "-->\n\n| x |\n|---|\n| 1 |\n\n<!-- end output -->\ntail\n" in text
    r = _cli("--check", str(readme))
    assert r.returncode == 0 and "3 block(s) checked, 0 drifted" in r.stdout, r.stdout
    readme.write_text(text.replace("# torch: 9.9", "# torch: 2.99"))  # a version: loose
    assert _cli("--check", str(readme)).returncode == 0


def test_a_stated_tolerance_loosens_only_the_decimals(tmp_path, capsys):
    """``(decimals within 3%)``: a decimal may move by 3 %, not more; the text, the integers
    and the number of decimals must match; ``--write`` keeps a block within it as written."""
    readme = tmp_path / "README.md"
    now = "steps 270, grad norm 1.08, acc 0.9583"
    block = f"<!-- output (decimals within 3%): echo '{now}' -->\n```\n{{}}\n```\n"
    for written, ok in (("steps 270, grad norm 1.051, acc 0.9556", True),  # 2.7 %, 0.3 %
                        (now, True),
                        ("steps 270, grad norm 1.04, acc 0.9583", False),  # 3.7 %
                        ("steps 271, grad norm 1.08, acc 0.9583", False),  # an integer
                        ("steps 270, grad norm 1.08, accuracy 0.9583", False),  # the text
                        ("steps 270, grad norm 1.08, acc 0.9583 0.1", False)):  # a decimal more
        readme.write_text(block.format(written))
        assert ro.main(["--check", str(readme)]) == (0 if ok else 1), written
        assert ro.main(["--write", str(readme)]) == 0
        assert f"{0 if ok else 1} block(s) updated" in capsys.readouterr().out, written
        assert f"```\n{written if ok else now}\n```" in readme.read_text(), written
    readme.write_text(block.replace(" (decimals within 3%)", "").format(
        "steps 270, grad norm 1.081, acc 0.9583"))  # no tolerance stated: exact
    assert ro.main(["--check", str(readme)]) == 1
    assert "DRIFT README.md:1" in capsys.readouterr().out


def test_several_pages_are_checked_and_written_by_name(tmp_path):
    """Pages named on the command line are checked together, each block reported as
    PAGE:LINE; ``--write`` fixes only the page that drifted."""
    good, bad = tmp_path / "good.md", tmp_path / "bad.md"
    good.write_text("# g\n\n<!-- output: echo same -->\n```\nsame\n```\n")
    bad.write_text("# b\n\n<!-- output: echo new -->\n```\nold\n```\n")
    r = _cli("--check", str(good), str(bad))
    assert r.returncode == 1, r.stdout + r.stderr
    assert "ok    good.md:3" in r.stdout and "DRIFT bad.md:3" in r.stdout
    assert "2 block(s) checked, 1 drifted" in r.stdout
    r = _cli("--write", str(good), str(bad))
    assert r.returncode == 0 and "updated bad.md:3" in r.stdout and "1 block(s) updated" in r.stdout
    assert bad.read_text().endswith("```\nnew\n```\n") and "same" in good.read_text()
    assert _cli("--check", str(good), str(bad)).returncode == 0


def test_a_failing_command_is_an_error_not_a_block(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text("<!-- output: echo partial; exit 3 -->\n```\npartial\n```\n")
    r = _cli("--check", str(readme))
    assert r.returncode == 2 and "exited 3" in r.stderr, r.stdout + r.stderr
    readme.write_text("<!-- output: python -c 'raise SystemExit(1 / 0)' -->\n```\n```\n")
    r = _cli("--write", str(readme))
    assert r.returncode == 2 and "ZeroDivisionError" in r.stderr
    readme.write_text("<!-- output: echo x -->\nno fence and no end marker\n")
    r = _cli("--check", str(readme))
    assert r.returncode == 2 and "end output" in r.stderr
