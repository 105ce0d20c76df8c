"""PyTorch's own autocast test lists as fxamp agreement cases.

``torch/testing/_internal/autocast_test_lists.py`` holds the ops and arguments PyTorch tests
autocast with: ``AutocastTestLists`` (CUDA) and ``AutocastCPUTestLists`` (CPU). Each entry is
called here in every spelling that reaches the op — ``torch.X``, ``torch._C._nn.X``,
``torch._C._linalg.X``, ``torch._VF.X``, ``F.X``, ``torch.linalg.X`` and the Tensor method —
inside a tiny ``nn.Module`` whose forward takes the entry's tensors as inputs (other
arguments are constants), so that ``fxamp.amp_rewrite`` can be compared with real autocast.

The lists module imports ``torch.testing._internal.common_utils`` only for ``TEST_WITH_ROCM``
and ``TestCase``; importing that module changes global torch flags and needs ``expecttest``,
so :func:`load_lists` runs the lists' source with a stand-in for those two names.
"""
from __future__ import annotations

import importlib.util
import sys
import types
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.fx
import torch.nn as nn
import torch.nn.functional as F

from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from autocast_truth import _fake_cuda_autocast, _fake_cuda_copy, _fake_cuda_like, _map_tensors

_LISTS = "torch.testing._internal.autocast_test_lists"
_COMMON = "torch.testing._internal.common_utils"

#: cases: (target, autocast dtype) -> which PyTorch class holds its lists
CASES = (("cpu", torch.bfloat16), ("cpu", torch.float16), ("cuda", torch.float16))
DTYPE_IDS = {torch.bfloat16: "bf16", torch.float16: "fp16"}


def load_lists() -> types.ModuleType:
    """The autocast test lists module, loaded without importing ``common_utils``."""
    spec = importlib.util.find_spec(_LISTS)
    if spec is None or spec.origin is None:
        raise ImportError(f"{_LISTS} is not shipped with torch {torch.__version__}")
    stub = types.ModuleType(_COMMON)
    stub.TEST_WITH_ROCM = False  # type: ignore[attr-defined]
    stub.TestCase = object  # type: ignore[attr-defined]
    saved = sys.modules.get(_COMMON)
    sys.modules[_COMMON] = stub
    try:
        own = importlib.util.spec_from_file_location("fxamp_autocast_test_lists", spec.origin)
        module = importlib.util.module_from_spec(own)
        own.loader.exec_module(module)  # type: ignore[union-attr]
    finally:
        if saved is None:
            del sys.modules[_COMMON]
        else:
            sys.modules[_COMMON] = saved
    return module


@dataclass
class Entry:
    """One entry of one list: the op, its arguments, and which modules PyTorch calls it in."""

    target: str
    dtype: torch.dtype
    list_name: str
    op: str
    args: tuple
    kwargs: Dict[str, Any] = field(default_factory=dict)
    module: Any = torch  # PyTorch's test calls getattr(module, op) when it has it


def _entries(target: str, dtype: torch.dtype) -> List[Entry]:
    """Every entry PyTorch's autocast tests run for (target, dtype), with the arguments and
    module their test_autocast_* functions use."""
    lists = load_lists()
    torch.manual_seed(0)
    out: List[Entry] = []
    if target == "cpu":
        cpu = lists.AutocastCPUTestLists("cpu")
        # the promote lists hold (op, bf16 arguments, fp16 arguments[, out type])
        pick = 0 if dtype == torch.bfloat16 else 1
        for name, module in (("torch_expect_builtin_promote", torch),
                             ("methods_expect_builtin_promote", None),
                             ("torch_need_autocast_promote", torch)):
            for op, *rest in getattr(cpu, name, []):
                out.append(Entry(target, dtype, name, op, rest[pick], module=module))
        for name, module in (("torch_16", torch), ("torch_fp32", torch),
                             ("nn_16", torch._C._nn), ("nn_fp32", torch._C._nn)):
            for item in getattr(cpu, name, []):
                kwargs = item[2] if len(item) > 2 else {}
                out.append(Entry(target, dtype, name, item[0], item[1], dict(kwargs),
                                 module=module))
        return out
    cuda = lists.AutocastTestLists("cpu")  # built on cpu, moved to (fake) cuda per test
    for op, args, _ in cuda.torch_expect_builtin_promote:
        out.append(Entry(target, dtype, "torch_expect_builtin_promote", op, args))
    for op, args, _ in cuda.methods_expect_builtin_promote:
        out.append(Entry(target, dtype, "methods_expect_builtin_promote", op, args, module=None))
    for item in cuda.torch_fp16:
        op, args = item[0], item[1]
        if op == "einsum":  # the list's entry is (op, equation, operands): a 3-tuple that
            # PyTorch's test reads as "skip"; run it with an equation the 2-d operands fit
            out.append(Entry(target, dtype, "torch_fp16", op, ("ij,jk->ik",) + item[2]))
            continue
        out.append(Entry(target, dtype, "torch_fp16", op, args))
    for name, module in (("torch_fp32", torch), ("torch_need_autocast_promote", torch),
                         ("nn_fp16", torch._C._nn), ("nn_fp32", torch._C._nn),
                         ("linalg_fp16", torch._C._linalg), ("methods_fp16", None),
                         ("methods_fp32", None)):
        for item in getattr(cuda, name, []):
            kwargs = item[2] if len(item) > 2 else {}
            out.append(Entry(target, dtype, name, item[0], item[1], dict(kwargs), module=module))
    for op, args, module in getattr(cuda, "banned", []):
        out.append(Entry(target, dtype, "banned", op, args, module=module))
    return out


# --------------------------------------------------------------------------
# spellings
# --------------------------------------------------------------------------

_NAMESPACES: Tuple[Tuple[str, Any], ...] = (
    ("torch", torch),
    ("torch._C._nn", torch._C._nn),
    ("torch._C._linalg", torch._C._linalg),
    ("torch._VF", torch._VF),
    ("F", F),
    ("torch.linalg", torch.linalg),
)


def _function(namespace: Any, op: str) -> Optional[Tuple[str, Callable[..., Any]]]:
    """(attribute name, function) of ``op`` in ``namespace``, or None."""
    names = [op]
    if namespace is torch.linalg and op.startswith("linalg_"):
        names.append(op[len("linalg_"):])  # linalg_vecdot -> torch.linalg.vecdot
    for name in names:
        fn = getattr(namespace, name, None)
        if callable(fn) and not isinstance(fn, type):
            return name, fn
    return None


def spellings(entry: Entry) -> List[Tuple[str, Callable[..., Any], bool]]:
    """(label, call(args, kwargs), PyTorch's own test uses it) for each way to call the op."""
    found: List[Tuple[str, Callable[..., Any], bool]] = []
    seen: set = set()
    for name, namespace in _NAMESPACES:
        found_fn = _function(namespace, entry.op)
        if found_fn is None:
            continue
        attr, fn = found_fn
        label = f"{name}.{attr}"
        if label in seen:
            continue
        seen.add(label)
        own = entry.module is namespace
        found.append((label, (lambda a, k, fn=fn: fn(*a, **k)), own))
    if hasattr(torch.Tensor, entry.op):
        found.append((f"Tensor.{entry.op}",
                      (lambda a, k, op=entry.op: getattr(a[0], op)(*a[1:], **k)), True))
    return found


# --------------------------------------------------------------------------
# the module under test
# --------------------------------------------------------------------------


class _Slot:
    """Marks where the i-th forward input goes in the argument structure."""

    def __init__(self, index: int) -> None:
        self.index = index


def _template(value: Any, tensors: List[torch.Tensor]) -> Any:
    """``value`` with each tensor replaced by a _Slot; the tensors are appended to ``tensors``."""
    if isinstance(value, torch.Tensor):
        tensors.append(value)
        return _Slot(len(tensors) - 1)
    if isinstance(value, (list, tuple)):
        return type(value)(_template(v, tensors) for v in value)
    if isinstance(value, dict):
        return {k: _template(v, tensors) for k, v in value.items()}
    return value


def _fill(value: Any, inputs: tuple) -> Any:
    if isinstance(value, _Slot):
        return inputs[value.index]
    if isinstance(value, (list, tuple)):
        return type(value)(_fill(v, inputs) for v in value)
    if isinstance(value, dict):
        return {k: _fill(v, inputs) for k, v in value.items()}
    return value


class OpModule(nn.Module):
    """``forward(x0, ..., xn)`` calls one spelling of one op with the entry's arguments."""

    def __init__(self, call: Callable[..., Any], args_template: tuple,
                 kwargs_template: Dict[str, Any]) -> None:
        super().__init__()
        self.call, self.args_template, self.kwargs_template = call, args_template, kwargs_template

    def forward(self, *inputs: torch.Tensor) -> Any:
        return self.call(_fill(self.args_template, inputs), _fill(self.kwargs_template, inputs))


def _with_arity(module: OpModule, n: int) -> nn.Module:
    """A module whose forward has exactly ``n`` named inputs (fx does not trace ``*args``)."""
    names = ", ".join(f"x{i}" for i in range(n))
    namespace: Dict[str, Any] = {}
    exec(f"def forward(self, {names}):\n    return self.inner({names})\n", namespace)
    cls = type(f"Op{n}", (nn.Module,), {"forward": namespace["forward"]})
    wrapper = cls()
    wrapper.inner = module
    return wrapper


@dataclass
class Case:
    """One (target, dtype, entry, spelling) to check."""

    entry: Entry
    label: str
    call: Callable[..., Any]
    own: bool  # a spelling PyTorch's own autocast test uses

    @property
    def id(self) -> str:
        return f"{self.entry.target}-{DTYPE_IDS[self.entry.dtype]}-{self.label}"

    def build(self) -> Tuple[nn.Module, tuple]:
        """(module, its inputs): the entry's tensors, copied, become the forward's inputs."""
        tensors: List[torch.Tensor] = []
        args = _template(self.entry.args, tensors)
        kwargs = _template(self.entry.kwargs, tensors)
        model = _with_arity(OpModule(self.call, args, kwargs), len(tensors))
        return model, tuple(t.clone() for t in tensors)


def _callable_under_autocast(case: Case) -> bool:
    """Whether this spelling takes the list's arguments: a call under CPU autocast (the
    CUDA lists' arguments are built on cpu; CPU autocast bans nothing) that raises means
    it has another signature (``F.poisson_nll_loss`` vs ``torch.poisson_nll_loss``).
    PyTorch's own spellings always count."""
    if case.own:
        return True
    model, inputs = case.build()
    try:
        with torch.no_grad(), torch.autocast("cpu", dtype=case.entry.dtype), \
                warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model(*inputs)
    except Exception:  # noqa: BLE001 - any failure means the spelling takes other arguments
        return False
    return True


def all_cases(target: str, dtype: torch.dtype) -> List[Case]:
    """Every (entry, spelling) for (target, dtype), with duplicate ids numbered."""
    cases: List[Case] = []
    for entry in _entries(target, dtype):
        if entry.target == "cuda" and entry.op.startswith("cudnn_"):
            own = [Case(entry, label, call, o) for label, call, o in spellings(entry) if o]
            cases += own  # CUDA-only: PyTorch's spelling, never run on cpu here
            continue
        cases += [c for c in (Case(entry, label, call, o) for label, call, o in spellings(entry))
                  if _callable_under_autocast(c)]
    counts: Dict[str, int] = {}
    for case in cases:
        counts[case.id] = counts.get(case.id, 0) + 1
    seen: Dict[str, int] = {}
    for case in cases:
        if counts[case.id] > 1:
            seen[case.id] = seen.get(case.id, 0) + 1
            case.label = f"{case.label}#{seen[case.id]}"
    return cases


# --------------------------------------------------------------------------
# what autocast does
# --------------------------------------------------------------------------


def run_autocast(model: nn.Module, inputs: tuple, target: str, dtype: torch.dtype,
                 device: Optional[str] = None) -> Any:
    """``model(*inputs)`` under real autocast for ``target``: CPU autocast on the inputs as
    they are; for "cuda", real CUDA when ``device`` is "cuda", else fake CUDA tensors with
    the CUDA autocast flags set by hand. Raises what autocast raises (banned ops)."""
    if target == "cpu":
        with torch.no_grad(), torch.autocast("cpu", dtype=dtype):
            return model(*inputs)
    if device == "cuda":
        with torch.no_grad(), torch.autocast("cuda", dtype=dtype):
            return model.to("cuda")(*[t.to("cuda") for t in inputs])
    with FakeTensorMode():
        work = _fake_cuda_copy(model)
        fake = _map_tensors(inputs, _fake_cuda_like)
        with torch.no_grad(), _fake_cuda_autocast(dtype):
            return work(*fake)


def output_dtypes(value: Any) -> List[torch.dtype]:
    """The dtypes of every tensor in a (nested) output, in order."""
    if isinstance(value, torch.Tensor):
        return [value.dtype]
    if isinstance(value, (list, tuple)):
        return [d for v in value for d in output_dtypes(v)]
    return []


def equal(a: Any, b: Any) -> bool:
    """Bit-identical (nested) outputs: same dtypes and values."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(
            equal(x, y) for x, y in zip(a, b))
    return a == b


class _Received(TorchDispatchMode):
    """Records the floating dtype each ATen op receives (below autocast, so after its casts)."""

    def __init__(self) -> None:
        super().__init__()
        self.last: Optional[torch.dtype] = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        if func is not torch.ops.aten._to_copy.default:
            floats = [t.dtype for t in tree_leaves((args, kwargs))
                      if isinstance(t, torch.Tensor) and t.is_floating_point()]
            returns_tensor = any(str(r.type).startswith("Tensor") for r in func._schema.returns)
            if floats and returns_tensor:  # (aten.equal returns a bool: no floating output)
                self.last = floats[0]
        return func(*args, **kwargs)


class _Partial(torch.fx.Interpreter):
    """Records each node's floating output dtype; at the node whose fake kernel cannot run
    (a CUDA-only op, or one that falls back to a real kernel), records the dtype autocast
    handed that op instead, and stops."""

    def __init__(self, gm: torch.fx.GraphModule, received: _Received) -> None:
        super().__init__(gm)
        self.received = received
        self.dtypes: Dict[str, torch.dtype] = {}

    def run_node(self, n: torch.fx.Node) -> Any:
        self.received.last = None
        try:
            result = super().run_node(n)
        except Exception as err:  # noqa: BLE001 - whatever the fake kernel raised
            if self.received.last is not None:
                self.dtypes[n.name] = self.received.last
            raise _Stop from err
        if n.op != "output":
            dtype = next((d for d in output_dtypes(result) if d.is_floating_point), None)
            if dtype is not None:
                self.dtypes[n.name] = dtype
        return result


class _Stop(Exception):
    pass


def fake_cuda_received_dtypes(gm: torch.fx.GraphModule, inputs: tuple,
                              dtype: torch.dtype) -> Dict[str, torch.dtype]:
    """node name -> dtype under CUDA autocast on fake CUDA tensors, up to and including the
    first node the fake kernels cannot run; for that node, the dtype autocast cast its
    floating inputs to (its output dtype, for the convolutions and RNN cells it is used for).
    """
    mode = FakeTensorMode()
    with mode:
        work = _fake_cuda_copy(gm)
        fake = _map_tensors(inputs, _fake_cuda_like)
    received = _Received()
    interp = _Partial(work, received)
    with mode, received, torch.no_grad(), _fake_cuda_autocast(dtype):
        try:
            interp.run(*fake)
        except _Stop:
            pass
    return interp.dtypes
