"""torch's private API is reached through ``fxamp._torch`` alone: every private name it
wraps exists on the installed torch (CI also runs this on the oldest supported torch with
``pytest -m floor``), its wrappers do what their docstrings say, and no other module of
fxamp uses a private torch name.

The last check reads every module with ``ast`` and resolves what each name is bound to:
``import torch.utils.checkpoint as cp`` makes ``cp._checkpoint_impl`` the private
``torch.utils.checkpoint._checkpoint_impl``; ``from torch import _C as C``,
``getattr(torch, "_C")`` (a literal name), ``importlib.import_module("torch._dynamo")``, a
name assigned a torch value (``g = torch.fx.Graph()``, then ``g._nodes``) and string
annotations are resolved the same way. Any component of a resolved path, or of an import,
that starts with one underscore (dunders are public) is private. ATen op spellings
(``torch.ops.aten._to_copy.default``: the namespace, op and overload after ``torch.ops``)
are names a node is matched against, not API. A few private attributes of torch objects
(``Graph._codegen``, ``OpOverload._schema``...) are read off values whose origin a file does
not show (a parameter, ``self.scaler``): :data:`PRIVATE_ATTRS` flags them on any object.
The private attributes of torch.fx's own objects (``node._erased``,
``graph._graph_namespace``: every private name a ``Node``, ``Graph`` or ``GraphModule`` has
on the installed torch, less ``nn.Module``'s) are flagged the same way, on any value but a
class's own ``self`` (see :data:`FX_PRIVATE_ATTRS`)."""
from __future__ import annotations

import ast
import importlib
import pathlib
from typing import Dict, List, Optional, Set, Tuple

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
    ("torch.utils._python_dispatch", "TorchDispatchMode"), ("torch._ops", "OpOverload"),
    ("torch._ops", "OpOverloadPacket"),
    ("torch._C", "_set_grad_enabled"), ("torch._C", "is_grad_enabled"),
    ("torch._C", "_dispatch_has_kernel_for_dispatch_key"), ("torch._C", "_storage_Use_Count"),
    ("torch._C", "_len_torch_dispatch_stack"), ("torch._C", "_is_torch_function_mode_enabled"),
    ("torch._C", "_functorch.is_functorch_wrapped_tensor"), ("torch", "_foreach_copy_"),
    ("torch", "Tensor._use_count"), ("torch.fx", "Graph._codegen"),
    ("torch.amp", "GradScaler._found_inf_per_device"),
    ("torch.nn.modules.batchnorm", "_BatchNorm"),
    ("torch.nn.modules.instancenorm", "_InstanceNorm"),
    ("torch.nn.modules.conv", "_ConvNd"),
    ("torch.nn.modules.conv", "_ConvTransposeNd"),
]

def test_the_named_private_wrappers_do_what_they_say():
    """The wrappers of the block other modules use: an ATen overload's schema and overload
    name, GradScaler's found-inf flags, the checkpoint implementation swapped for a block
    (restored on an exception too), the norms' base classes."""
    op = torch.ops.aten.pow.Tensor_Scalar
    assert _torch.op_schema(op).name == "aten::pow"
    assert _torch.overload_name(op) == "Tensor_Scalar"
    assert _torch.overload_name(torch.ops.aten.relu.default) == "default"
    w = nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([w], lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    for value, found in ((1.0, 0.0), (float("inf"), 1.0)):
        opt.zero_grad()
        scaler.scale((w * value).sum()).backward()
        scaler.unscale_(opt)
        flags = _torch.found_inf_per_device(scaler, opt)
        assert [f.item() for f in flags.values()] == [found]
        scaler.step(opt)
        scaler.update()
    original = _torch.checkpoint_impl()
    assert original is not None  # (None on a torch without it: regions are then not kept)
    seen = []

    def traced(torch_own, function, args, kwargs, **options):
        seen.append(options.get("use_reentrant"))
        return torch_own(function, args, kwargs, **options)

    x = torch.ones(2, requires_grad=True)
    with _torch.patched("checkpoint_impl", traced):
        torch.utils.checkpoint.checkpoint(torch.sin, x, use_reentrant=False)
    assert seen == [False] and _torch.checkpoint_impl() is original
    with pytest.raises(RuntimeError, match="inside"):
        with _torch.patched("checkpoint_impl", traced):
            raise RuntimeError("inside")
    assert _torch.checkpoint_impl() is original
    torch.utils.checkpoint.checkpoint(torch.sin, x, use_reentrant=False)
    assert seen == [False]
    assert isinstance(nn.BatchNorm2d(3), _torch.BATCH_NORM_BASE)
    assert isinstance(nn.SyncBatchNorm(3), _torch.BATCH_NORM_BASE)
    assert isinstance(nn.InstanceNorm1d(3), _torch.INSTANCE_NORM_BASE)
    assert not isinstance(nn.LayerNorm(3), (_torch.BATCH_NORM_BASE, _torch.INSTANCE_NORM_BASE))


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
        if patch.name == "checkpoint_impl" and _torch.checkpoint_impl() is None:
            continue  # (an older torch: checkpoint regions are traced through, not kept)
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
    linear = next(n for n in gm.graph.nodes if n.op == "call_function")
    with gm.graph.inserting_before(linear):
        relu = gm.graph.call_function(torch.relu, linear.args)
    linear.replace_all_uses_with(relu)
    assert not _torch.node_erased(linear)
    gm.graph.erase_node(linear)
    assert _torch.node_erased(linear) and not _torch.node_erased(relu)
    _torch.rename_node(relu, "linear")  # the erased node's name, without a suffix
    assert relu.name == "linear" and "relu = " not in gm.recompile().src
    assert "linear = torch.relu" in gm.recompile().src
    flat, spec = _torch.tree_flatten({"a": t, "b": (t,)})
    assert len(flat) == 2 and _torch.tree_unflatten(flat, spec)["b"][0] is t


#: the module that may use torch's private API (relative to ``src/fxamp``)
WRAPPER = "_torch.py"

#: private torch names still used outside the wrapper, per file, each with the reason; an
#: entry is a debt: the test fails when a file uses another one, and when an entry is no
#: longer used (so it is removed once the code moves)
ALLOWED_USES: Dict[str, Dict[str, str]] = {}

#: private attributes of torch objects, flagged on any value (their owner is often a
#: parameter or an attribute whose origin the file does not show)
PRIVATE_ATTRS = frozenset({
    "_schema", "_overloadname", "_codegen", "_use_count", "_cdata", "_found_inf_per_device",
    "_checkpoint_impl", "_format_target", "_set_grad_enabled"})


#: calls that read an attribute named by a string literal (the object, then the name)
_NAMED_ATTR_CALLS = {"getattr", "hasattr", "setattr", "delattr"}
#: calls that import a module named by a string literal
_IMPORT_CALLS = {"importlib.import_module", "import_module", "__import__"}


def _private(part: str) -> bool:
    part = part.split("(")[0].split("[")[0]
    return part.startswith("_") and not (part.startswith("__") and part.endswith("__"))


def _fx_private_attrs() -> frozenset:
    """Every private attribute (one leading underscore) of torch.fx's objects on this torch:
    a ``Node``, a ``Graph`` and a ``GraphModule`` and their classes (``Node._erased``,
    ``Graph._graph_namespace``, ``GraphModule._code``...), less those every ``nn.Module``
    has (``_modules``, ``_parameters``: a module's state, not fx's)."""
    gm = torch.fx.symbolic_trace(nn.Linear(2, 2))
    node = next(iter(gm.graph.nodes))
    module = {a for o in (nn.Module(), nn.Module) for a in dir(o)}
    return frozenset(a for o in (node, gm.graph, gm, torch.fx.Node, torch.fx.Graph,
                                 torch.fx.GraphModule)
                     for a in dir(o) if _private(a) and a not in module)


#: the private attributes of fx objects (see :func:`_fx_private_attrs`). A node, a graph or a
#: graph module is almost always a parameter, a loop variable or an item of a list whose
#: origin the file does not show, so these names are flagged on any value: ``x._erased``,
#: ``getattr(x, "_erased")``. The one exception is an object's own attribute, ``self._x`` or
#: ``cls._x`` in a class that does not derive from a torch class: fxamp's classes may name
#: their own fields ``_args`` or ``_root``; a subclass of ``fx.Tracer`` or ``fx.GraphModule``
#: reading an inherited ``self._graph`` is flagged.
FX_PRIVATE_ATTRS = _fx_private_attrs()


def _own_receivers(tree: ast.AST, names: "TorchNames") -> Set[int]:
    """ids of the ``self`` / ``cls`` names inside the methods of classes with no torch base
    (their private attributes are the class's own)."""
    own: Set[int] = set()
    for cls in ast.walk(tree):
        if not isinstance(cls, ast.ClassDef) or any(names.resolve(b) for b in cls.bases):
            continue
        for fn in cls.body:
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                own |= {id(n) for n in ast.walk(fn)
                        if isinstance(n, ast.Name) and n.id in ("self", "cls")}
    return own


def private_prefix(path: str) -> Optional[str]:
    """The shortest private prefix of a resolved torch path (None: all public). After
    ``torch.ops`` the namespace, op and overload are op spellings, not API."""
    parts = path.split(".")
    if parts[0] != "torch":
        return None
    for i, part in enumerate(parts):
        if parts[1:2] == ["ops"] and 2 <= i <= 4:
            continue
        if _private(part):
            return ".".join(parts[:i + 1])
    return None


class TorchNames:
    """What the names of one module are bound to, as torch paths (``torch.utils.checkpoint``,
    ``torch.amp.GradScaler()`` for a call's result); one map for the whole file."""

    def __init__(self, tree: ast.AST):
        self.tree = tree
        self.aliases: Dict[str, str] = {"torch": "torch"}  # (string annotations need no import)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] == "torch":
                        if alias.asname:
                            self.aliases[alias.asname] = alias.name
                        else:
                            self.aliases[alias.name.split(".")[0]] = "torch"
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module and \
                    node.module.split(".")[0] == "torch":
                for alias in node.names:
                    self.aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
        for _ in range(3):  # assignments of torch values, in any order (a few rounds)
            for node in ast.walk(tree):
                value, targets = None, []
                if isinstance(node, ast.Assign):
                    value, targets = node.value, node.targets
                elif isinstance(node, (ast.AnnAssign, ast.NamedExpr)) and node.value is not None:
                    value, targets = node.value, [node.target]
                elif isinstance(node, ast.withitem) and node.optional_vars is not None:
                    value, targets = node.context_expr, [node.optional_vars]
                if value is None:
                    continue
                path = self.resolve(value)
                for target in targets:
                    if isinstance(target, ast.Name) and path is not None:
                        self.aliases.setdefault(target.id, path)

    def literal_call(self, node: ast.Call) -> Optional[str]:
        """The torch path a literal ``getattr(obj, "_x")`` / ``import_module("torch.x")`` reads."""
        func = ast.unparse(node.func)
        literal = [a.value for a in node.args[1:2] if isinstance(a, ast.Constant)]
        if func in _NAMED_ATTR_CALLS and func not in self.aliases and literal and \
                isinstance(literal[0], str):
            base = self.resolve(node.args[0])
            return f"{base}.{literal[0]}" if base else None
        first = node.args[0] if node.args else None
        if func in _IMPORT_CALLS and isinstance(first, ast.Constant) and \
                isinstance(first.value, str) and first.value.split(".")[0] == "torch":
            return first.value
        return None

    def resolve(self, node: ast.AST) -> Optional[str]:
        """The torch path ``node`` evaluates to, or None when it is not known to be one."""
        if isinstance(node, ast.Name):
            return self.aliases.get(node.id)
        if isinstance(node, ast.Attribute):
            base = self.resolve(node.value)
            return f"{base}.{node.attr}" if base else None
        if isinstance(node, ast.Call):
            named = self.literal_call(node)
            if named is not None:
                return named
            base = self.resolve(node.func)
            return f"{base}()" if base else None
        if isinstance(node, ast.Subscript):
            base = self.resolve(node.value)
            return f"{base}[]" if base else None
        return None


def _annotations(tree: ast.AST) -> List[Tuple[int, ast.AST]]:
    """(line, parsed expression) of each string annotation (``x: "torch._ops.OpOverload"``)."""
    found = []
    for node in ast.walk(tree):
        notes: List[Optional[ast.expr]] = []
        if isinstance(node, ast.arg):
            notes = [node.annotation]
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            notes = [node.returns]
        elif isinstance(node, ast.AnnAssign):
            notes = [node.annotation]
        for note in notes:
            if isinstance(note, ast.Constant) and isinstance(note.value, str):
                try:
                    found.append((note.lineno, ast.parse(note.value, mode="eval")))
                except SyntaxError:
                    pass
    return found


def private_torch_uses(source: str) -> List[str]:
    """``line: path`` for each private torch name the code of ``source`` uses (imports,
    attribute reads and writes, literal ``getattr``, string annotations; docstrings,
    comments and other strings are text)."""
    tree = ast.parse(source)
    names = TorchNames(tree)
    hits: Set[Tuple[int, str]] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            hits |= {(node.lineno, a.name) for a in node.names if private_prefix(a.name)}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            hits |= {(node.lineno, f"{node.module}.{a.name}") for a in node.names
                     if private_prefix(f"{node.module}.{a.name}")}
    own = _own_receivers(tree, names)
    trees = [(0, tree)] + _annotations(tree)
    for line, sub in trees:
        for node in ast.walk(sub):
            if isinstance(node, ast.Call):  # a literal getattr / import_module; other calls
                path = names.literal_call(node)  # are their callee, an attribute seen below
            elif isinstance(node, ast.Attribute):
                path = names.resolve(node)
            else:
                continue
            where = line or node.lineno
            if path is not None and private_prefix(path):
                hits.add((where, path))
            elif isinstance(node, ast.Attribute) and node.attr in PRIVATE_ATTRS:
                hits.add((where, f"{ast.unparse(node.value)}.{node.attr}"))
            elif isinstance(node, ast.Attribute) and node.attr in FX_PRIVATE_ATTRS and \
                    id(node.value) not in own:
                hits.add((where, f"{ast.unparse(node.value)}.{node.attr}"))
            elif isinstance(node, ast.Call) and ast.unparse(node.func) in _NAMED_ATTR_CALLS \
                    and len(node.args) > 1 and isinstance(node.args[1], ast.Constant) and \
                    node.args[1].value in FX_PRIVATE_ATTRS:
                hits.add((where, f"{ast.unparse(node.args[0])}.{node.args[1].value}"))
    # one line per use: drop a path another hit on its line extends (torch._C of torch._C.x)
    kept = {(n, p) for n, p in hits
            if not any(m == n and q != p and q.startswith(p) and q[len(p)] in ".(["
                       for m, q in hits)}
    return [f"{n}: {p}" for n, p in sorted(kept)]


def _module_uses() -> Dict[str, List[str]]:
    """file (relative to src/fxamp) -> its private torch uses, the wrapper left out."""
    out = {}
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        if rel != WRAPPER:
            uses = private_torch_uses(path.read_text())
            if uses:
                out[rel] = uses
    return out


def test_no_module_but_the_wrapper_uses_private_torch_names():
    bad = {}
    for rel, uses in _module_uses().items():
        allowed = ALLOWED_USES.get(rel, {})
        extra = [u for u in uses if u.split(": ", 1)[1] not in allowed]
        if extra:
            bad[rel] = extra
    assert not bad, ("private torch API outside fxamp._torch (add a named wrapper there, in "
                     "its block of names other modules use): " + "; ".join(
                         f"{rel}: {', '.join(uses)}" for rel, uses in bad.items()))


def test_every_allowed_private_use_is_still_there():
    """An allowance left after its code moved would hide a new use of the same name."""
    uses = _module_uses()
    stale = [f"{rel}: {name}" for rel, names in ALLOWED_USES.items() for name in names
             if not any(u.split(": ", 1)[1] == name for u in uses.get(rel, []))]
    assert not stale, f"remove these from ALLOWED_USES (no longer used): {stale}"


#: (snippet, the uses the checker must report): one per spelling of a private torch name
PLANTED = [
    ("import torch.utils.checkpoint as cp\nf = cp._checkpoint_impl\n",
     ["2: torch.utils.checkpoint._checkpoint_impl"]),
    ("from torch.amp import grad_scaler as gs\nf = gs.GradScaler._found_inf_per_device\n",
     ["2: torch.amp.grad_scaler.GradScaler._found_inf_per_device"]),
    ("from torch import _C as C\nC._set_grad_enabled(True)\n",
     ["1: torch._C", "2: torch._C._set_grad_enabled"]),
    ("import torch\nC = getattr(torch, '_C')\n", ["2: torch._C"]),
    ("import torch\nsetattr(torch.utils.checkpoint, '_checkpoint_impl', print)\n",
     ["2: torch.utils.checkpoint._checkpoint_impl"]),
    ("import torch\ntorch._dynamo.reset()\n", ["2: torch._dynamo.reset"]),
    ("import torch._dynamo\n", ["1: torch._dynamo"]),
    ("import torch.fx\ng = torch.fx.Graph()\nn = g._graph_namespace\n",
     ["3: torch.fx.Graph()._graph_namespace"]),
    ("import torch.nn as nn\np = nn.Linear(2, 2)._parameters\n",
     ["2: torch.nn.Linear()._parameters"]),
    ("import torch\nC = torch._C\nC._set_grad_enabled(False)\n",
     ["2: torch._C", "3: torch._C._set_grad_enabled"]),
    ("from torch.utils._pytree import tree_map\n", ["1: torch.utils._pytree.tree_map"]),
    ("import torch\nok = isinstance(f, torch._ops.OpOverloadPacket) or isinstance(\n"
     "    f, torch._ops.OpOverload)\n",
     ["2: torch._ops.OpOverloadPacket", "3: torch._ops.OpOverload"]),
    ("from torch.nn.utils.stateless import _reparametrize_module as r\n",
     ["1: torch.nn.utils.stateless._reparametrize_module"]),
    ("import importlib\nd = importlib.import_module('torch._dynamo')\n", ["2: torch._dynamo"]),
    ("def f(op: 'torch._ops.OpOverload') -> None:\n    pass\n", ["1: torch._ops.OpOverload"]),
    ("import torch\ns = torch.ops.aten.add.Tensor._schema\n",
     ["2: torch.ops.aten.add.Tensor._schema"]),
    ("def f(scaler, opt):\n    return scaler._found_inf_per_device(opt)\n",
     ["2: scaler._found_inf_per_device"]),
    ("def f(graph):\n    return graph._codegen\n", ["2: graph._codegen"]),
    # fx internals on values whose origin the file does not show
    ("def f(node):\n    return node._erased\n", ["2: node._erased"]),
    ("def f(node, name):\n    node.graph._graph_namespace._rename_object(node, name)\n",
     ["2: node.graph._graph_namespace"]),
    ("def f(parts):\n    return [p for p in parts if not getattr(p, '_erased')]\n",
     ["2: p._erased"]),
    ("def f(gm):\n    return gm._code\n", ["2: gm._code"]),
    ("import torch.fx as fx\nclass T(fx.Tracer):\n    def f(self):\n"
     "        return self._graph_namespace\n", ["4: self._graph_namespace"]),
]

#: code that names no private torch API
CLEAN = ('"""torch._C in a docstring"""\nimport torch\nimport numpy as np\n'
         "x = torch.ops.aten._to_copy.default  # an op spelling\n"
         "v = torch.__version__\ny = np._NoValue\nname = 'torch._C'\n"
         "class M(torch.nn.Module):\n    def f(self):\n        return self._modules\n"
         "class Own:\n    def f(self):\n        return self._args, self._root\n"
         "def g(module):\n    return module._modules, module._parameters\n")


@pytest.mark.parametrize("source,expected", PLANTED, ids=[p[0].split("\n")[-2][:40]
                                                       for p in PLANTED])
def test_the_check_sees_a_planted_private_use(source, expected):
    assert private_torch_uses(source) == expected


def test_the_check_passes_public_names_and_text():
    assert private_torch_uses(CLEAN) == []
