"""fxamp's import graph is acyclic.

Every module's imports are read with ``ast`` (the module level and inside functions, absolute
and relative; ``from . import x`` is an edge to the submodule ``x``, ``from pkg import name``
an edge to the package ``pkg`` itself when ``name`` is no submodule), the same reading
``tests/test_layers.py`` checks the layer order with. An import of ``pkg.a`` is an edge to
``pkg.a`` only: ``pkg.a`` importing ``pkg.b`` is no cycle even though Python runs
``pkg/__init__`` first, but ``pkg/__init__`` importing ``pkg.a`` while ``pkg.a`` imports a
name from ``pkg`` is one. Each strongly connected component of more than one module is a
cycle; the test names its modules and its edges.
"""
from __future__ import annotations

import pathlib
from typing import Dict, List

import networkx as nx

from test_layers import imports_of, modules


def import_graph(files: Dict[str, pathlib.Path]) -> "nx.DiGraph":
    """module -> the fxamp modules it imports, over ``files`` (module name -> path)."""
    known = {**modules(), **files}
    graph = nx.DiGraph()
    for name, path in files.items():
        graph.add_node(name)
        graph.add_edges_from((name, target) for target in imports_of(name, path, known)
                             if target != name and target in files)
    return graph


def cycles(graph: "nx.DiGraph") -> List[str]:
    """One line per import cycle (a strongly connected component of several modules):
    its modules, then its edges."""
    out = []
    for component in nx.strongly_connected_components(graph):
        if len(component) < 2:
            continue
        edges = sorted(graph.subgraph(component).edges())
        out.append(", ".join(sorted(component)) + ": "
                   + "; ".join(f"{a} -> {b}" for a, b in edges))
    return sorted(out)


def test_the_import_graph_has_no_cycle():
    found = cycles(import_graph(modules()))
    assert not found, (f"{len(found)} import cycle(s); move what both sides need into a lower "
                       "module instead of importing inside a function:\n" + "\n".join(found))


def _package(tmp_path: pathlib.Path, sources: Dict[str, str]) -> Dict[str, pathlib.Path]:
    """Write ``sources`` (path under a fake ``fxamp/pkg`` -> text); module name -> path."""
    files = {}
    for rel, text in sources.items():
        path = tmp_path / "pkg" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        stem = rel[:-3].replace("/", ".")
        files["fxamp.pkg" + ("" if stem == "__init__" else "." + stem)] = path
    return files


def test_the_check_sees_cycles_in_every_spelling(tmp_path):
    """The checker itself: a function-level relative import closing a loop, an absolute
    one, ``from . import x`` of a submodule, and a three-module ring are cycles."""
    files = _package(tmp_path, {
        "__init__.py": "",
        "a.py": "from .b import f\n",
        "b.py": "def g():\n    from .a import h\n",           # a <-> b, inside a function
        "c.py": "import fxamp.pkg.d as d\n",
        "d.py": "from fxamp.pkg.c import x\n",                 # c <-> d, absolute
        "e.py": "from . import f\n",
        "f.py": "from . import e\n",                           # e <-> f, submodule imports
        "r1.py": "from . import r2\n", "r2.py": "from .r3 import y\n",
        "r3.py": "def k():\n    from .r1 import z\n",         # r1 -> r2 -> r3 -> r1
    })
    got = cycles(import_graph(files))
    assert [line.split(":")[0] for line in got] == [
        "fxamp.pkg.a, fxamp.pkg.b", "fxamp.pkg.c, fxamp.pkg.d", "fxamp.pkg.e, fxamp.pkg.f",
        "fxamp.pkg.r1, fxamp.pkg.r2, fxamp.pkg.r3"], got
    assert "fxamp.pkg.b -> fxamp.pkg.a" in got[0]


def test_a_package_init_is_a_module_of_its_own(tmp_path):
    """``pkg/__init__`` re-exporting ``pkg.a`` while ``pkg.a`` reads a name defined in the
    ``__init__`` is a cycle; ``pkg.a`` importing its sibling ``pkg.b`` (which Python loads
    after ``pkg/__init__``) is not, nor is ``pkg/__init__`` re-exporting both."""
    clean = _package(tmp_path / "clean", {
        "__init__.py": "from .a import f\nfrom .b import g\n",
        "a.py": "from . import b\nfrom .b import g\n", "b.py": "g = 1\n"})
    assert cycles(import_graph(clean)) == []
    looped = _package(tmp_path / "looped", {
        "__init__.py": "from .a import f\nLIMIT = 3\n",
        "a.py": "from . import LIMIT\n"})
    assert cycles(import_graph(looped)) == [
        "fxamp.pkg, fxamp.pkg.a: fxamp.pkg -> fxamp.pkg.a; fxamp.pkg.a -> fxamp.pkg"]


if __name__ == "__main__":  # print the cycles
    print("\n".join(cycles(import_graph(modules()))) or "no import cycle")
