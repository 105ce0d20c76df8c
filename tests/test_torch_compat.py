"""torch's private API is reached through ``fxamp._torch`` alone: every private name it
wraps exists on the installed torch (CI also runs this on the oldest supported torch with
``pytest -m floor``), its wrappers do what their docstrings say, and no other module of
fxamp uses a private torch name (the op vocabulary's op spellings are data and stay there)."""
from __future__ import annotations

import ast
import importlib
import pathlib
import re

import pytest
import torch
import torch.nn as nn

import fxamp
from fxamp import _torch

SRC = pathlib.Path(fxamp.__file__).resolve().parent

#: every private torch name ``fxamp._torch`` wraps, as module path + attribute path
WRAPPED = [
    ("torch.utils._pytree", "tree_flatten"), ("torch.utils._pytree", "tree_unflatten"),
    ("torch.utils._pytree", "tree_map"), ("torch.utils._pytree", "tree_leaves"),
    ("torch.utils._pytree", "keystr"), ("torch.utils._pytree", "tree_flatten_with_path"),
    ("torch.utils._pytree", "register_pytree_node"),
    ("torch.fx._pytree", "tree_flatten_spec"),
    ("torch.nn.utils.stateless", "_reparametrize_module"),
    ("torch._subclasses.fake_tensor", "DataDependentOutputException"),
    ("torch._subclasses.fake_tensor", "DynamicOutputShapeException"),
    ("torch._subclasses.fake_tensor", "FakeTensorMode"),
    ("torch._subclasses.fake_tensor", "unset_fake_temporarily"),
    ("torch.utils._python_dispatch", "TorchDispatchMode"), ("torch._ops", "OpOverload"), ("torch._ops", "OpOverloadPacket"),
    ("torch._C", "_set_grad_enabled"), ("torch._C", "is_grad_enabled"),
    ("torch._C", "_dispatch_has_kernel_for_dispatch_key"), ("torch._C", "_storage_Use_Count"),
    ("torch._C", "_len_torch_dispatch_stack"), ("torch._C", "_is_torch_function_mode_enabled"),
    ("torch._C", "_functorch.is_functorch_wrapped_tensor"), ("torch", "_foreach_copy_"),
    ("torch", "Tensor._use_count"), ("torch.fx", "Graph._codegen"),
]

#: the modules that may spell private torch names: the wrapper itself and the op vocabulary
#: (whose ``torch._C._nn.linear`` and the like are targets a node is matched against)
ALLOWED = {"_torch.py", "oplists.py", "autocast_tables.py"}

#: a use of a private torch name in code (docstrings, comments and strings are not read)
#: (``torch.ops.aten._to_copy`` and the like are op spellings; dunders are public)
PRIVATE = re.compile(r"(?<![\w.])torch(\.(?!ops\b)[A-Za-z]\w*)*\._(?!_)\w+"
                     r"|_reparametrize_module|\._codegen\b|\._use_count\b")


def _resolve(module: str, attr: str) -> object:
    obj: object = importlib.import_module(module)
    for part in attr.split("."):
        if part == "_codegen":  # an instance attribute: read it off a graph
            return getattr(torch.fx.Graph(), part)
        obj = getattr(obj, part)
    return obj


@pytest.mark.floor
@pytest.mark.parametrize("module,attr", WRAPPED, ids=[f"{m}.{a}" for m, a in WRAPPED])
def test_every_wrapped_private_name_exists_on_this_torch(module, attr):
    assert _resolve(module, attr) is not None, f"{module}.{attr} is gone: mend fxamp._torch"


@pytest.mark.floor
def test_every_wrapper_is_exported_and_documented():
    for name in _torch.__all__:
        obj = getattr(_torch, name)
        if callable(obj) and getattr(obj, "__module__", "") == "fxamp._torch":
            assert obj.__doc__, f"fxamp._torch.{name} has no docstring"


@pytest.mark.floor
def test_the_wrappers_do_what_they_say():
    t = torch.randn(3)
    assert _torch.tensor_use_count(t) == 1
    assert _torch.storage_use_count(t) == 2  # t and the storage handle the count reads
    view = t[1:]
    assert _torch.storage_use_count(t) == 3
    del view
    assert _torch.has_kernel_for_dispatch_key("aten::mm", "AutocastCPU")
    assert not _torch.has_kernel_for_dispatch_key("aten::relu", "AutocastCPU")
    assert not _torch.in_dispatch_or_function_mode()
    assert not _torch.is_functorch_wrapped(t)
    seen = []
    for patch in _torch.TRACE_PATCHES.values():  # every patched attribute is still there
        assert patch.attribute in vars(patch.owner()), patch.name
    with _torch.patched("set_grad_enabled", lambda original, mode: seen.append(mode)):
        with torch.no_grad():
            pass
    assert seen == [False, True] and torch.is_grad_enabled()
    dst = [torch.zeros(2)]
    _torch.foreach_copy_(dst, [torch.ones(2)])
    assert dst[0].tolist() == [1.0, 1.0]
    gm = torch.fx.symbolic_trace(nn.Linear(2, 2))
    assert _torch.graph_codegen(gm.graph) is gm.graph._codegen
    flat, spec = _torch.tree_flatten({"a": t, "b": (t,)})
    assert len(flat) == 2 and _torch.tree_unflatten(flat, spec)["b"][0] is t


def private_uses(path: pathlib.Path) -> list:
    """``line: text`` of each code line of ``path`` that names a private torch name."""
    tree = ast.parse(path.read_text())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Attribute, ast.Name, ast.ImportFrom, ast.Import)):
            text = ast.unparse(node)
            if isinstance(node, ast.ImportFrom):
                text = f"from {node.module} import " + ", ".join(a.name for a in node.names)
            if PRIVATE.search(text):
                found.append(node.lineno)
    lines = path.read_text().splitlines()
    return [f"{n}: {lines[n - 1].strip()}" for n in sorted(set(found))]


def test_no_module_but_the_wrapper_uses_private_torch_names():
    bad = {str(p.relative_to(SRC)): private_uses(p) for p in sorted(SRC.rglob("*.py"))
           if p.name not in ALLOWED or p.parent != SRC}
    bad = {k: v for k, v in bad.items() if v}
    assert not bad, ("private torch API outside fxamp._torch (add a wrapper there): "
                     f"{bad}")


def test_the_check_sees_private_uses(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("import torch\nfrom torch.utils._pytree import tree_map\n"
                     "x = torch._C._set_grad_enabled\ny = g._codegen\n"
                     "'''torch._C in a docstring'''\n")
    got = private_uses(probe)
    assert [g.split(":")[0] for g in got] == ["2", "3", "4"], got
