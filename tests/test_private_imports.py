"""No fxamp module imports another module's ``_private`` name: what one module needs from
another is a public helper there. Read with ``ast`` (imports inside functions too): a
``from x import _name`` of another fxamp module, and ``x._name`` on a module imported as
``x``, fail the test, naming ``module -> other._name``. A package's own ``_version`` /
``_torch`` modules are modules, not names, and may be imported."""
from __future__ import annotations

import ast
import pathlib
from typing import Dict, List

from test_layers import SRC, modules

#: private modules imported as a whole (their names are their public API)
PRIVATE_MODULES = {"fxamp._version", "fxamp._torch"}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _base(name: str, path: pathlib.Path, node: ast.ImportFrom) -> str:
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    if not node.level:
        return node.module or ""
    parts = package.split(".")
    parts = parts[:len(parts) - (node.level - 1)]
    return ".".join(parts + ([node.module] if node.module else []))


def private_imports(name: str, path: pathlib.Path, known: Dict[str, pathlib.Path]) -> List[str]:
    """``name -> other._private`` for each private name of another fxamp module ``name``
    (at ``path``) imports or reads off an imported module."""
    tree = ast.parse(path.read_text(), str(path))
    bad: List[str] = []
    aliases: Dict[str, str] = {}  # local name -> fxamp module it is bound to
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = _base(name, path, node)
            if base.split(".")[0] != "fxamp":
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                if sub in known:  # a module
                    aliases[alias.asname or alias.name] = sub
                    if _private(alias.name) and sub not in PRIVATE_MODULES:
                        bad.append(f"{name} -> {sub} (a private module)")
                elif _private(alias.name) and base != name:
                    bad.append(f"{name} -> {base}.{alias.name}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in known and alias.asname:
                    aliases[alias.asname] = alias.name
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id in aliases and _private(node.attr)
                and aliases[node.value.id] != name):
            target = aliases[node.value.id]
            if f"{target}.{node.attr}" not in known:
                bad.append(f"{name} -> {target}.{node.attr}")
    return sorted(set(bad))


def all_private_imports() -> List[str]:
    known = modules()
    return [edge for name, path in known.items() for edge in private_imports(name, path, known)]


def test_no_module_imports_another_modules_private_names():
    bad = all_private_imports()
    assert not bad, ("imports of another module's private names (make a public helper "
                     "there):\n" + "\n".join(bad))


def test_the_check_sees_private_imports(tmp_path):
    """The checker itself: a relative ``from .x import _name``, a module alias read for a
    private attribute, and a function-local import are caught; dunders and the module's own
    names are not."""
    known = dict(modules())
    probe = tmp_path / "probe.py"
    probe.write_text("from .casts import _mutated, PassResult\nfrom . import casts\n"
                     "def f():\n    from ..plan_text import _escape\n    return casts._x\n"
                     "from .. import _torch\nx = casts.__name__\n")
    got = private_imports("fxamp.passes.probe", probe, known)
    assert got == ["fxamp.passes.probe -> fxamp.passes.casts._mutated",
                   "fxamp.passes.probe -> fxamp.passes.casts._x",
                   "fxamp.passes.probe -> fxamp.plan_text._escape"], got
    assert SRC.exists()
