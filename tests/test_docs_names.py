"""Every fxamp name the README, CONTRIBUTING.md and the docs pages write in backticks exists.

Which backticked strings count (inline code spans; fenced code blocks are examples, checked
by running them elsewhere). A span is cut at its first ``(``: ``fxamp.plan_of(gm).to_text()``
names ``fxamp.plan_of``. What is left counts when it is

1. **a dotted name starting with** ``fxamp.``: ``fxamp.train.Trainer``,
   ``fxamp.export.weight_view``. It is imported and read attribute by attribute. The keys
   fxamp writes into an ONNX file's metadata (``fxamp.true_fp16_error``) are strings, not
   names: such a span counts as existing when the quoted key is in fxamp's source.
2. **a dotted name whose leading part is a fxamp module named relative to the package**:
   ``runtime.CALL_HOOKS``, ``frontends.hooks.ROOT_HOOKS``, ``_torch.patched``, or by the
   end of its path (``blocks.share_key`` is ``fxamp.rewriter.blocks.share_key``; ``findings``
   is ``fxamp.passes.audit.findings``). It exists when one module so named has the rest.
   Leading names the docs also use for torch's objects or for variables are left out
   (:data:`NOT_MODULES`: ``fx.wrap``, ``aten.linear``, ``plan.nodes``, ``model.eval``):
   write ``fxamp.plan.Plan``, not ``plan.Plan``, to have those checked.
3. **a dotted name whose first part is a class defined at the top level of a fxamp module**:
   ``Plan.from_text``, ``RewriteConfig.make``, ``_Builder.cast``. The class (any fxamp
   class of that name) must have the attribute: a class attribute or method, a dataclass
   field or annotation, or an attribute its methods set on ``self``.
4. **a bare exception name** (``TraceError``, ``ScaleUnderflowError``): an exception class
   of fxamp, or a Python built-in.
5. **a module file named without its root**, ``rewriter/inplace.py`` or ``late_hooks.py``:
   a file under ``src/fxamp`` (or ``src``) with that relative path, or for a bare file
   name one of that name under ``src/fxamp``, ``scripts``, ``benchmarks`` or
   ``examples``. (Paths from the repository root, ``src/...``, and test files are
   tests/test_docs_paths.py's.)
6. **a bare name starting with** ``fxamp_`` (an attribute or key fxamp sets on a user's
   object, ``fxamp_result``): the word must occur in fxamp's source.

Anything else (``torch.autocast``, ``nn.Linear``, ``amp_rewrite``, ``eps=off``) is not
checked. ``docs/benchmarks.md`` is a dated log of past runs and is left out: its entries
name what existed then.
"""
import ast
import builtins
import collections
import functools
import importlib
import inspect
import re
from pathlib import Path
from typing import Any, Dict, List, Optional, Set, Tuple

import pytest

import fxamp

ROOT = Path(__file__).resolve().parents[1]
SRC = Path(fxamp.__file__).resolve().parent
PAGES = [ROOT / "README.md", ROOT / "CONTRIBUTING.md",
         *sorted(p for p in (ROOT / "docs").glob("*.md") if p.name != "benchmarks.md")]

#: leading names that, in the docs, are torch's objects or variables more often than fxamp
#: modules (``fx.wrap``, ``aten.linear``, ``F.softmax``, ``plan.nodes``, ``model.eval()``,
#: ``config.replace(...)``, ``result.to(...)``, ``graph.nodes``)
NOT_MODULES = frozenset({"fx", "aten", "F", "plan", "model", "config", "result", "graph",
                         "torch", "nn", "gm", "onnx", "export"})

_FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
_SPAN = re.compile(r"(?<!`)`([^`\n]+)`(?!`)")
_DOTTED = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+")
_ERROR = re.compile(r"[A-Z]\w*Error")
_MODULE_FILE = re.compile(r"(?:[\w]+/)*\w+\.py")


def spans(text: str) -> List[str]:
    """The inline code spans of a Markdown text, fenced blocks left out."""
    return [m.group(1).strip() for m in _SPAN.finditer(_FENCE.sub("", text))]


def _modules() -> Dict[str, str]:
    """Dotted path relative to ``fxamp`` (``rewriter.blocks``) -> absolute module name."""
    out = {}
    for path in SRC.rglob("*.py"):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if parts:
            out[".".join(parts)] = ".".join(["fxamp"] + parts)
    return out


MODULES = _modules()


def _classes() -> Dict[str, List[str]]:
    """Top-level class name -> the modules defining one of that name."""
    out: Dict[str, List[str]] = collections.defaultdict(list)
    for rel, name in MODULES.items():
        path = SRC.joinpath(*rel.split("."))
        path = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if isinstance(node, ast.ClassDef):
                out[node.name].append(name)
    return out


CLASSES = _classes()


def _set_on_self(cls: type) -> Set[str]:
    names: Set[str] = set()
    for klass in cls.__mro__:
        if not klass.__module__.startswith("fxamp"):
            continue
        try:
            tree = ast.parse(inspect.getsource(klass).lstrip())  # (a nested class is indented)
        except (OSError, TypeError, SyntaxError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and \
                    node.value.id == "self" and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                names.add(node.target.id)
    return names


def has(obj: Any, attr: str) -> Tuple[bool, Any]:
    """Whether ``obj`` has ``attr`` (for a class, also an instance attribute), and its value
    when it can be read."""
    try:
        return True, getattr(obj, attr)
    except AttributeError:
        pass
    if inspect.isclass(obj):
        fields = set(getattr(obj, "__dataclass_fields__", {}))
        notes = {n for k in obj.__mro__ for n in getattr(k, "__annotations__", {})}
        if attr in fields | notes | _set_on_self(obj):
            return True, None
    return False, None


def _walk(obj: Any, parts: List[str]) -> bool:
    """Whether ``obj.parts[0].parts[1]...`` exists (a submodule is imported)."""
    for part in parts:
        if obj is None:  # an instance attribute: its own attributes are not known
            return True
        found, value = has(obj, part)
        if not found and inspect.ismodule(obj):
            try:
                found, value = True, importlib.import_module(f"{obj.__name__}.{part}")
            except ImportError:
                pass
        if not found:
            return False
        obj = value
    return True


@functools.lru_cache(maxsize=None)
def _sources() -> Tuple[str, ...]:
    return tuple(p.read_text(encoding="utf-8") for p in SRC.rglob("*.py"))


def _metadata_key(name: str) -> bool:
    return any(f'"{name}"' in text for text in _sources())


def _in_source(word: str) -> bool:
    pattern = re.compile(rf"\b{re.escape(word)}\b")
    return any(pattern.search(text) for text in _sources())


def check(span: str) -> Optional[bool]:
    """None when ``span`` is not a fxamp name by the rules above, else whether it exists."""
    name = span.split("(", 1)[0].strip()
    if re.fullmatch(r"fxamp_\w+", name):
        return _in_source(name)
    if _MODULE_FILE.fullmatch(name) and not name.startswith(("src/", "tests/", "test_")):
        if "/" in name:
            return any((d / name).is_file() for d in (SRC, SRC.parent, ROOT))
        return any(any(d.rglob(name)) for d in (SRC, ROOT / "scripts", ROOT / "benchmarks",
                                                 ROOT / "examples"))
    if _ERROR.fullmatch(name):
        return isinstance(getattr(builtins, name, None), type) or any(
            _walk(importlib.import_module(m), [name]) for m in CLASSES.get(name, []))
    if not _DOTTED.fullmatch(name):
        return None
    parts = name.split(".")
    if parts[0] == "fxamp":
        return _walk(fxamp, parts[1:]) or _metadata_key(name)
    if parts[0] not in NOT_MODULES:
        for k in range(len(parts) - 1, 0, -1):
            prefix = ".".join(parts[:k])
            found = [m for rel, m in MODULES.items()
                     if rel == prefix or rel.endswith("." + prefix)]
            if found:
                return any(_walk(importlib.import_module(m), parts[k:]) for m in found)
    if parts[0] in CLASSES:
        return any(_walk(importlib.import_module(m), parts) for m in CLASSES[parts[0]])
    return None


@functools.lru_cache(maxsize=None)
def checked_names() -> Dict[str, List[Tuple[str, bool]]]:
    """Page -> (span, exists) for every span that counts."""
    out = {}
    for page in PAGES:
        rows = []
        for span in spans(page.read_text(encoding="utf-8")):
            result = check(span)
            if result is not None:
                rows.append((span, result))
        out[str(page.relative_to(ROOT))] = rows
    return out


def test_the_rules_pick_fxamp_names_and_only_those():
    text = ("`fxamp.plan_of(gm).to_text()`, `runtime.CALL_HOOKS`, `Plan.from_text`, "
            "`TraceError`, `rewriter/inplace.py`, `late_hooks.py`, `torch.autocast`, "
            "`fx.wrap`, `amp_rewrite`, `eps=off`, `plan.nodes`\n"
            "```python\nfxamp.nothing_here\n```\n`fxamp.no_such_name`, `blocks.no_such`, "
            "`Plan.no_such`, `NoSuchError`, `fxamp.true_fp16_error`, `frontends.hooks`, "
            "`fxamp_result`, `fxamp_calls`")
    got = {s: check(s) for s in spans(text)}
    assert got == {
        "fxamp.plan_of(gm).to_text()": True, "runtime.CALL_HOOKS": True,
        "Plan.from_text": True, "TraceError": True, "rewriter/inplace.py": True,
        "late_hooks.py": False, "torch.autocast": None, "fx.wrap": None,
        "amp_rewrite": None, "eps=off": None, "plan.nodes": None,
        "fxamp.no_such_name": False, "blocks.no_such": False, "Plan.no_such": False,
        "NoSuchError": False, "fxamp.true_fp16_error": True, "frontends.hooks": True,
        "fxamp_result": True, "fxamp_calls": False}


def test_enough_names_are_checked():
    """The rules are not vacuous: the pages name well over 50 fxamp names."""
    n = sum(len(rows) for rows in checked_names().values())
    print(f"{n} backticked fxamp names checked in {len(PAGES)} pages")
    assert n > 50, n


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_every_fxamp_name_a_page_writes_exists(page):
    rows = checked_names()[str(page.relative_to(ROOT))]
    missing = sorted({span for span, ok in rows if not ok})
    assert not missing, f"{page.relative_to(ROOT)} names what fxamp does not have: {missing}"
