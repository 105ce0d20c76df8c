"""The API page lists every argument: each public function and class has a Google-style
docstring whose ``Args:`` section names each of its parameters.

What is checked: every callable in ``fxamp.__all__``, ``fxamp.train.__all__``,
``fxamp.export.__all__`` and every object docs/api.md renders (its ``::: name`` lines; for
a module rendered with its members, ``fxamp.errors``, each public function and class
defined in it), and the public methods those classes define (``Plan.from_text``, ``Trainer.step``...). The parameters are
``inspect.signature``'s, less ``self`` / ``cls``; ``*batch`` and ``**changes`` are written
with their stars. A class is checked through its constructor (``merge_init_into_class``
renders the class and ``__init__`` docstrings as one). A dataclass's constructor
parameters are its fields: it may list them under ``Attributes:`` instead, which the page
renders as the same table. An exception class without its own ``__init__`` has no
parameters to list.
"""
import dataclasses
import importlib
import inspect
import re
from pathlib import Path
from typing import Any, Dict, List

import fxamp
import fxamp.export
import fxamp.train

ROOT = Path(__file__).resolve().parents[1]
API_PAGE = ROOT / "docs" / "api.md"

#: a section header line, then its entries: ``name (type): text`` or ``name: text``, each
#: indented one step deeper than the header (continuation lines deeper still)
_SECTION = re.compile(r"^(?P<indent>[ \t]*)(?P<title>[A-Z][A-Za-z ]*):[ \t]*$")
_ENTRY = re.compile(r"^(?P<name>\*{0,2}\w+)(?:[ \t]*\([^)]*\))?[ \t]*:")


def sections(doc: str) -> Dict[str, List[str]]:
    """Section title -> the entry names listed in it, for a Google-style docstring."""
    found: Dict[str, List[str]] = {}
    lines = inspect.cleandoc(doc).splitlines()
    i = 0
    while i < len(lines):
        m = _SECTION.match(lines[i])
        i += 1
        if not m:
            continue
        names = found.setdefault(m.group("title"), [])
        base, step = len(m.group("indent")), None
        while i < len(lines) and (not lines[i].strip() or
                                  len(lines[i]) - len(lines[i].lstrip()) > base):
            line = lines[i]
            indent = len(line) - len(line.lstrip())
            if line.strip():
                step = indent if step is None else step
                entry = _ENTRY.match(line.strip())
                if indent == step and entry:
                    names.append(entry.group("name"))
            i += 1
    return found


def _get(path: str) -> Any:
    """What ``::: path`` renders: like mkdocstrings, the longest importable module prefix
    wins over an attribute of the same name (``fxamp.train.localize`` is the module)."""
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
            break
        except ImportError:
            continue
    for part in parts[i:]:
        obj = getattr(obj, part)
    return obj


def _rendered() -> Dict[str, Any]:
    """The objects docs/api.md renders, with the members of a module it renders whole."""
    out: Dict[str, Any] = {}
    lines = API_PAGE.read_text(encoding="utf-8").splitlines()
    for i, line in enumerate(lines):
        m = re.match(r"^::: ([\w.]+)\s*$", line)
        if not m:
            continue
        obj = _get(m.group(1))
        options = "\n".join(lines[i + 1:i + 4])
        if inspect.ismodule(obj) and "members: false" not in options:
            out.update({f"{m.group(1)}.{n}": v for n, v in vars(obj).items()
                        if not n.startswith("_") and (inspect.isfunction(v) or
                                                      inspect.isclass(v))
                        and v.__module__ == obj.__name__})
        else:
            out[m.group(1)] = obj
    return out


def public_callables() -> Dict[str, Any]:
    """Dotted name -> object, for everything the API reference shows (see the module
    docstring); a method's name ends with ``()`` after its class (``fxamp.Plan.load()``)."""
    found = {**{f"fxamp.{n}": getattr(fxamp, n) for n in fxamp.__all__},
             **{f"fxamp.train.{n}": getattr(fxamp.train, n) for n in fxamp.train.__all__},
             **{f"fxamp.export.{n}": getattr(fxamp.export, n) for n in fxamp.export.__all__},
             **_rendered()}
    out: Dict[str, Any] = {}
    for name, obj in found.items():
        if not callable(obj) or not getattr(obj, "__module__", "").startswith("fxamp"):
            continue
        out[name] = obj
        if inspect.isclass(obj):
            for attr, value in vars(obj).items():
                func = value.__func__ if isinstance(value, (classmethod, staticmethod)) \
                    else value
                if not attr.startswith("_") and inspect.isfunction(func):
                    out[f"{name}.{attr}()"] = func
    return out


def _parameters(name: str, obj: Any) -> List[str]:
    if inspect.isclass(obj) and issubclass(obj, BaseException) and "__init__" not in vars(obj):
        return []
    star = {inspect.Parameter.VAR_POSITIONAL: "*", inspect.Parameter.VAR_KEYWORD: "**"}
    params = list(inspect.signature(obj).parameters.values())
    if name.endswith("()") and params and params[0].name in ("self", "cls"):
        params = params[1:]  # a method's own object
    return [star.get(p.kind, "") + p.name for p in params]


def _documented(obj: Any) -> Dict[str, List[str]]:
    doc = inspect.getdoc(obj) or ""
    if inspect.isclass(obj) and "__init__" in vars(obj) and vars(obj)["__init__"].__doc__:
        doc += "\n\n" + inspect.cleandoc(vars(obj)["__init__"].__doc__)
    return sections(doc)


def test_the_section_parser_reads_google_style():
    doc = """Do a thing.

    Args:
        model (nn.Module): the model,
            over two lines: not an entry.
        *batch: the batch.
        **changes: fields.

    Returns:
        Something: with a colon.
    """
    assert sections(doc) == {"Args": ["model", "*batch", "**changes"],
                             "Returns": ["Something"]}


def test_the_check_covers_the_api_page():
    names = public_callables()
    for expected in ("fxamp.amp_rewrite", "fxamp.Plan.from_text()", "fxamp.train.Trainer.step()",
                     "fxamp.export.export_onnx", "fxamp.errors.node_error", "fxamp.Policy"):
        assert expected in names
    assert len(names) > 50, len(names)


def test_every_public_callable_lists_each_parameter_under_args():
    missing = {}
    for name, obj in public_callables().items():
        params = _parameters(name, obj)
        if not params:
            continue
        found = _documented(obj)
        listed = found.get("Args", [])
        if dataclasses.is_dataclass(obj):
            listed = listed + found.get("Attributes", [])
        absent = [p for p in params if p not in listed]
        extra = [p for p in found.get("Args", []) if p not in params]
        if absent or extra:
            missing[name] = {"not listed": absent, "listed but no parameter": extra}
    assert not missing, "docstrings whose Args: section does not match the signature: " + \
        "; ".join(f"{n}: {v}" for n, v in missing.items())


def test_no_public_docstring_has_a_sphinx_role():
    """The page renders Markdown: ``:class:`X``` would show as text."""
    role = re.compile(r":(?:class|func|meth|attr|mod|data|exc|obj):`")
    bad = [name for name, obj in public_callables().items()
           if role.search(inspect.getdoc(obj) or "")]
    for module in (fxamp, fxamp.train, _get("fxamp.export"), _get("fxamp.errors")):
        if role.search(module.__doc__ or ""):
            bad.append(module.__name__)
    assert not bad, f"Sphinx roles in the docstrings of {bad}: write `name` instead"
