"""Produce the documentation's real-output blocks from the commands that print them, or check them.

The pages are README.md and docs/*.md (PAGES). A block is marked by an HTML comment (invisible
on GitHub and on the docs site) on the line just before it:

    <!-- output: python examples/numerics.py -->
    ```
    ...exactly what the command prints (stdout)...
    ```

* ``<!-- output: COMMAND -->`` before a fenced block: the block is COMMAND's stdout. COMMAND
  is a bash command line (pipes allowed, e.g. ``| cut -c1-150`` for an excerpt that says so).
* ``<!-- output: session -->`` before a fenced block: the block's ``$ `` lines are the
  commands; each runs in turn (in one scratch directory, so files carry over) and is followed
  by its output.
* A marker whose next line is not a fence covers the Markdown up to ``<!-- end output -->``
  (a table to render): the block is COMMAND's stdout, as Markdown.
* ``<!-- output (decimals within 3%): COMMAND -->``: numbers with a decimal point (a loss, a
  grad norm, an accuracy) may differ from the block's by that relative tolerance, for output
  whose last digits depend on the CPU's kernels; the rest (text, integers) must match exactly
  and the block must hold as many decimals. ``--write`` leaves such a block as written while
  it is within the tolerance.

Each block runs in a fresh scratch directory holding the repository's ``examples/`` (so
``python examples/x.py``, ``examples.audit_demo:build`` and source lines read
``examples/...``), with the repository's ``src`` on PYTHONPATH, ``fxamp`` and ``python``
meaning this interpreter, one thread, no GPU (CUDA_VISIBLE_DEVICES=""), no progress bars and
PYTHONHASHSEED=0; the examples seed torch themselves. Exit status 0 and 1 (fxamp's "found
something" / "differs") are accepted; any other, or a traceback on stderr, is an error.

The only text compared loosely is VOLATILE: the ``# fxamp: X`` and ``# torch: X`` version
lines of a plan header, and the decimals of a block whose marker states a tolerance.
Everything else must match exactly (trailing spaces and trailing blank lines aside).

    python scripts/readme_outputs.py --check    # exit 1 and a diff when a block drifted
    python scripts/readme_outputs.py --write    # regenerate the blocks in place
    python scripts/readme_outputs.py --check docs/plan.md   # only the pages named
"""
from __future__ import annotations

import argparse
import difflib
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Tuple

ROOT = Path(__file__).resolve().parents[1]
#: the pages whose blocks are checked: the README and every page of the docs site
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARKER = re.compile(r"^<!-- output(?: \(decimals within (?P<tol>\d+(?:\.\d+)?)%\))?: "
                    r"(?P<command>.+?) -->\s*$")
DECIMAL = re.compile(r"(?<![\w.])[-+]?\d+\.\d+(?:[eE][-+]?\d+)?(?![\w.])")
END = "<!-- end output -->"
FENCE = re.compile(r"^```")
VOLATILE = [(re.compile(r"^# (fxamp|torch): \S+$", re.M), r"# \1: <version>")]
TIMEOUT_S = 300


@dataclass
class Block:
    """One marked block: ``command`` at line ``line`` (1-based) of the page ``page`` (its
    name, e.g. ``README.md`` or ``docs/plan.md``); ``start``/``end`` index the lines of its
    content (``lines[start:end]``); ``rel_tol`` is the relative tolerance of its decimals
    (0: exact)."""

    line: int
    command: str
    fenced: bool
    start: int
    end: int
    content: str
    rel_tol: float = 0.0
    page: str = "README.md"


def page_name(path: Path) -> str:
    """``path`` relative to the repository (``docs/plan.md``), or its file name outside it."""
    try:
        return str(Path(path).resolve().relative_to(ROOT))
    except ValueError:
        return Path(path).name


class ReadmeOutputError(Exception):
    """A marker without its block, or a command that failed."""


def find_blocks(text: str, page: str = "README.md") -> List[Block]:
    """The marked blocks of a page's text, in order (``page``: its name, for messages)."""
    lines = text.split("\n")
    blocks: List[Block] = []
    i = 0
    while i < len(lines):
        m = MARKER.match(lines[i])
        if not m:
            i += 1
            continue
        command = m.group("command").strip()
        rel_tol = float(m.group("tol")) / 100 if m.group("tol") else 0.0
        if i + 1 < len(lines) and FENCE.match(lines[i + 1]):
            start = i + 2
            end = next((j for j in range(start, len(lines)) if lines[j].rstrip() == "```"), None)
            if end is None:
                raise ReadmeOutputError(f"{page}:{i + 1}: the fenced block after the marker "
                                        "is not closed")
            fenced = True
        else:
            start = i + 1
            end = next((j for j in range(start, len(lines)) if lines[j].strip() == END), None)
            if end is None:
                raise ReadmeOutputError(f"{page}:{i + 1}: a marker not followed by a fenced "
                                        f"block needs {END} after its Markdown")
            fenced = False
        if command == "session" and not fenced:
            raise ReadmeOutputError(f"{page}:{i + 1}: a session must be a fenced block")
        blocks.append(Block(i + 1, command, fenced, start, end, "\n".join(lines[start:end]),
                            rel_tol, page))
        i = end + 1
    return blocks


def _scratch(tmp: str) -> dict:
    """Fill the scratch directory; return the environment the commands run in."""
    os.symlink(ROOT / "examples", Path(tmp) / "examples")
    bindir = Path(tmp) / ".bin"
    bindir.mkdir()
    for name, args in (("fxamp", "-m fxamp"), ("python", "")):
        shim = bindir / name
        shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" {args} "$@"\n')
        shim.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FXAMP_", "PYTHON"))}
    env.update(PYTHONPATH=str(ROOT / "src"), PYTHONHASHSEED="0", OMP_NUM_THREADS="1",
               MKL_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", FXAMP_PROGRESS="off",
               COLUMNS="100", LC_ALL="C.UTF-8", PATH=f"{bindir}{os.pathsep}"
               f"{os.environ.get('PATH', '')}")
    return env


def _run(command: str, cwd: str, env: dict) -> str:
    r = subprocess.run(["bash", "-o", "pipefail", "-c", command], cwd=cwd, env=env,
                       capture_output=True, text=True, timeout=TIMEOUT_S)
    if r.returncode not in (0, 1) or "Traceback (most recent call last)" in r.stderr:
        raise ReadmeOutputError(f"`{command}` exited {r.returncode}:\n{r.stderr[-3000:]}")
    return r.stdout


def produce(block: Block) -> str:
    """What the block should contain now: its command(s) run afresh."""
    with tempfile.TemporaryDirectory(prefix="readme-output-") as tmp:
        env = _scratch(tmp)
        if block.command != "session":
            return _tidy(_run(block.command, tmp, env))
        commands = [line[2:] for line in block.content.split("\n") if line.startswith("$ ")]
        if not commands:
            raise ReadmeOutputError(f"{block.page}:{block.line}: a session block needs `$ ` lines")
        return _tidy("".join(f"$ {c}\n" + _run(c, tmp, env) for c in commands))


def _tidy(text: str) -> str:
    return "\n".join(line.rstrip() for line in text.split("\n")).strip("\n")


def normalise(text: str) -> str:
    """The text with VOLATILE parts (version numbers in plan headers) made equal."""
    text = _tidy(text)
    for pattern, replacement in VOLATILE:
        text = pattern.sub(replacement, text)
    return text


def decimals_within(written: str, now: str, rel_tol: float) -> Tuple[bool, str]:
    """Whether ``now`` is ``written`` with its decimals moved by at most ``rel_tol`` (relative
    to the larger magnitude) and nothing else changed; and, if not, why."""
    a, b = normalise(written), normalise(now)
    if DECIMAL.sub("<decimal>", a) != DECIMAL.sub("<decimal>", b):
        return False, "the text around the decimals differs"
    for x, y in zip(DECIMAL.findall(a), DECIMAL.findall(b)):
        if abs(float(x) - float(y)) > rel_tol * max(abs(float(x)), abs(float(y))):
            return False, f"{x} -> {y} is more than {rel_tol:.0%} apart"
    return True, ""


def matches(block: Block, now: str) -> Tuple[bool, str]:
    """Whether the block, as written, is what its command printed (``now``); if not, why."""
    if normalise(block.content) == normalise(now):
        return True, ""
    if block.rel_tol:
        return decimals_within(block.content, now, block.rel_tol)
    return False, "the output differs"


def check_block(block: Block) -> Tuple[bool, str]:
    """(matches, a unified diff page -> now, with the reason on its last line)."""
    now = produce(block)
    ok, why = matches(block, now)
    if ok:
        return True, ""
    diff = difflib.unified_diff(_tidy(block.content).split("\n"), now.split("\n"),
                                f"{block.page}:{block.line} (as written)", "now", lineterm="")
    return False, "\n".join(diff) + f"\n({why})"


def page_blocks(path: Path) -> List[Block]:
    """The marked blocks of the page at ``path``."""
    return find_blocks(Path(path).read_text(encoding="utf-8"), page_name(path))


def write(path: Path, only: Optional[str] = None) -> int:
    """Regenerate the page's blocks in place (atomically); return how many changed."""
    text = path.read_text(encoding="utf-8")
    lines = text.split("\n")
    changed = 0
    for block in reversed(find_blocks(text, page_name(path))):  # bottom up: indices stay
        if only and only not in block.command:
            continue
        now = produce(block)
        if block.rel_tol and matches(block, now)[0]:
            continue  # within its stated tolerance: as written
        if block.fenced and _tidy(block.content) != now:
            lines[block.start:block.end] = now.split("\n")
        elif not block.fenced and block.content != f"\n{now}\n":  # Markdown: blank lines
            lines[block.start:block.end] = ["", *now.split("\n"), ""]  # around it
        else:
            continue
        changed += 1
        print(f"updated {block.page}:{block.line}  {block.command}")
    if changed:
        sys.path.insert(0, str(ROOT / "src"))
        from fxamp.fileio import atomic_write_text

        atomic_write_text(str(path), "\n".join(lines))
    return changed


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     epilog="Marking a block: see the module docstring or "
                                            "docs/checking.md.")
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--check", action="store_true", help="compare; exit 1 on drift")
    mode.add_argument("--write", action="store_true", help="regenerate the blocks in place")
    mode.add_argument("--list", action="store_true", help="list the marked blocks")
    parser.add_argument("--only", help="only blocks whose command contains this text")
    parser.add_argument("pages", nargs="*", metavar="PAGE",
                        help="the Markdown files (default: README.md and docs/*.md)")
    args = parser.parse_args(argv)
    paths = [Path(p) for p in args.pages] or PAGES
    try:
        if args.write:
            print(f"{sum(write(path, args.only) for path in paths)} block(s) updated")
            return 0
        blocks = [b for path in paths for b in page_blocks(path)
                  if not args.only or args.only in b.command]
        if args.list:
            for b in blocks:
                print(f"{b.page}:{b.line}  {b.command}")
            return 0
        bad = 0
        for b in blocks:
            ok, diff = check_block(b)
            print(f"{'ok   ' if ok else 'DRIFT'} {b.page}:{b.line}  {b.command}")
            if not ok:
                bad += 1
                print(diff)
        print(f"{len(blocks)} block(s) checked, {bad} drifted"
              + ("; run: python scripts/readme_outputs.py --write" if bad else ""))
        return 1 if bad else 0
    except ReadmeOutputError as err:
        print(f"readme_outputs: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
