"""The import direction: no fxamp module imports a layer above its own.

Every module's imports (top-level and inside functions) are read with ``ast``, resolved to
fxamp modules, and checked against the declared layer order; an upward import fails the test
and names the edge (``module (layer) -> imported (layer)``). Run this file alone to see the
edges: ``pytest -q tests/test_layers.py -s``.
"""
from __future__ import annotations

import ast
import pathlib
from typing import Dict, List, Tuple

import pytest

import fxamp

SRC = pathlib.Path(fxamp.__file__).resolve().parent

#: the layers, lowest first; a module may import its own layer and the ones before it.
#: A module is in the first layer with a prefix that names it or a package above it.
LAYERS: List[Tuple[str, Tuple[str, ...]]] = [
    ("core", ("fxamp._version", "fxamp._torch", "fxamp.errors", "fxamp.policy",
              "fxamp.plan_records", "fxamp.plan_text", "fxamp.plan", "fxamp.fileio",
              "fxamp.autocast_tables", "fxamp.oplists",
              "fxamp.perf", "fxamp.runtime",
              "fxamp.overrides", "fxamp.config", "fxamp.progress", "fxamp.weight_cache",
              "fxamp.ir", "fxamp.ops", "fxamp.rules", "fxamp.structure", "fxamp.program",
              "fxamp.result",
              "fxamp.op_args", "fxamp.graph_run")),
    ("passes", ("fxamp.passes",)),
    ("frontends", ("fxamp.frontends",)),
    ("rewriter", ("fxamp.rewriter",)),
    ("stages", ("fxamp.export", "fxamp.train", "fxamp.show", "fxamp.model_explorer")),
    ("top", ("fxamp.demo", "fxamp.cli", "fxamp.__main__", "fxamp")),
]

#: modules split out of a larger one, with the layer each must stay in: the
#: ONNX op tables and the trainer's mixins are stages, the command's package is the top,
#: the audit and placement subpackages are passes.
SPLIT_MODULES = {
    "fxamp.export.predict": "stages", "fxamp.export.tensorrt_ops": "stages",
    "fxamp.export.ort_cuda_ops": "stages",
    "fxamp.train.trainer": "stages", "fxamp.train.nonfinite": "stages",
    "fxamp.train.healing": "stages", "fxamp.train.checkpoint": "stages",
    "fxamp.cli": "top", "fxamp.cli.__main__": "top", "fxamp.cli.factory": "top",
    "fxamp.cli.plans": "top", "fxamp.cli.show": "top", "fxamp.cli.audit": "top",
    "fxamp.cli.export": "top", "fxamp.cli.demo": "top",
    "fxamp.passes.audit": "passes", "fxamp.passes.audit.graph": "passes",
    "fxamp.passes.audit.findings": "passes", "fxamp.passes.audit.checks": "passes",
    "fxamp.passes.audit.numerics": "passes", "fxamp.passes.audit.results": "passes",
    "fxamp.passes.audit.context": "passes", "fxamp.passes.placement": "passes",
    "fxamp.passes.placement.cut": "passes", "fxamp.passes.placement.free": "passes",
    "fxamp.passes.placement.model": "passes",
}


def module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> Dict[str, pathlib.Path]:
    return {module_name(p): p for p in sorted(SRC.rglob("*.py"))}


def layer_of(module: str) -> int:
    for index, (_, prefixes) in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes if p != "fxamp"):
            return index
    assert module == "fxamp", f"{module} is in no declared layer: add it to LAYERS"
    return len(LAYERS) - 1


def imports_of(name: str, path: pathlib.Path, known: Dict[str, pathlib.Path]) -> List[str]:
    """The fxamp modules ``name`` imports, anywhere in the file."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.split(".")[0] == "fxamp"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package.split(".")
                base_parts = base_parts[:len(base_parts) - (node.level - 1)]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            if base.split(".")[0] != "fxamp":
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.append(sub if sub in known else base)
    return [m for m in found if m in known]


def upward_edges() -> List[str]:
    known = modules()
    bad = []
    for name, path in known.items():
        mine = layer_of(name)
        for target in imports_of(name, path, known):
            theirs = layer_of(target)
            if theirs > mine:
                bad.append(f"{name} ({LAYERS[mine][0]}) -> {target} ({LAYERS[theirs][0]})")
    return bad


def test_every_module_is_in_a_layer():
    for name in modules():
        layer_of(name)


def test_split_modules_are_in_their_layer():
    known = modules()
    for name, layer in SPLIT_MODULES.items():
        assert name in known, f"{name} is gone: update SPLIT_MODULES"
        assert LAYERS[layer_of(name)][0] == layer, (name, LAYERS[layer_of(name)][0], layer)


@pytest.mark.slow
def test_no_module_imports_a_layer_above_it():
    bad = upward_edges()
    assert not bad, "upward imports:\n" + "\n".join(bad)


def test_the_check_sees_upward_imports(tmp_path):
    """The checker itself: a passes module importing the rewriter is caught (the edge the
    code had before the layering), and relative imports resolve to the right modules."""
    known = dict(modules())
    fake = SRC / "passes" / "annotate.py"
    text = "from ..rewriter import runtime\nfrom . import observe\nfrom .. import oplists\n"
    probe = tmp_path / "annotate.py"
    probe.write_text(text)
    got = imports_of("fxamp.passes.annotate", probe, known)
    assert got == ["fxamp.rewriter", "fxamp.passes.observe", "fxamp.oplists"]
    assert layer_of("fxamp.rewriter") > layer_of("fxamp.passes.annotate")
    assert fake.exists()


#: the modules that may import the op tables (``fxamp.oplists`` and the ATen tables it builds
#: on, ``fxamp.autocast_tables``); every other module asks the op vocabulary, ``fxamp.ops``,
#: which op a node is
OPLISTS_READERS = {"fxamp.ops"}
TABLES = ("fxamp.oplists", "fxamp.autocast_tables")


def oplists_readers(files: Dict[str, pathlib.Path]) -> List[str]:
    """The modules among ``files`` (module name -> path) that import ``fxamp.oplists``."""
    known = modules()
    return sorted(name for name, path in files.items()
                  if name not in TABLES and set(TABLES) & set(imports_of(name, path, known)))


@pytest.mark.slow
def test_only_the_vocabulary_reads_the_op_tables():
    """Passes, front ends, the rewriter and the stages ask ``fxamp.ops`` which op a node is;
    only ``ops`` reads the tables in ``oplists``."""
    extra = set(oplists_readers(modules())) - OPLISTS_READERS
    assert not extra, f"import fxamp.oplists outside {sorted(OPLISTS_READERS)}: {sorted(extra)}" \
        " (ask fxamp.ops instead, adding what you need there)"


@pytest.mark.slow
def test_the_vocabulary_check_sees_a_planted_import(tmp_path):
    """The check itself: every way of spelling an import of the op tables is caught, in a
    pass and in a front end, and importing ``ops`` is not."""
    spellings = ["from ..oplists import call_name\n", "from .. import oplists\n",
                 "from .. import ir, oplists, ops\n", "import fxamp.oplists\n",
                 "from fxamp.oplists import node_ops as n\n",
                 "def f():\n    from ..oplists import MODULE_OPS\n",
                 "from ..autocast_tables import ATEN_TABLES\n"]
    for i, text in enumerate(spellings):
        for package in ("passes", "frontends"):
            probe = tmp_path / f"{package}_{i}.py"
            probe.write_text(text)
            name = f"fxamp.{package}.probe{i}"
            assert oplists_readers({name: probe}) == [name], text
    clean = tmp_path / "clean.py"
    clean.write_text("from .. import ir, ops\nfrom ..ops import module_label\n")
    assert oplists_readers({"fxamp.passes.clean": clean}) == []
    assert "fxamp.ops" in oplists_readers(modules())  # the vocabulary itself reads them


def test_no_module_shadows_the_standard_library():
    import sys

    names = {p.stem for p in SRC.rglob("*.py")} - {"__init__", "__main__"}
    assert not names & set(sys.stdlib_module_names), names & set(sys.stdlib_module_names)


if __name__ == "__main__":  # print the edges and the layers
    for edge in upward_edges():
        print(edge)
