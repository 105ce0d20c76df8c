"""The user's model is left as it was: a snapshot of every submodule's attributes, restored
after tracing, with the Python side effects the forward had while fxamp ran it reported.

Tracing runs ``forward`` in Python: a cache filled in forward (timm LeViT's attention-bias
dict) would keep fx Proxies, a counter would count the trace, an old-style ``weight_norm``
pre-hook run on fake tensors would leave a FakeTensor as the module's ``weight``. The
snapshot holds each submodule's ``__dict__`` (which attribute holds which object: training
flags, plain tensors, the ``_parameters`` / ``_buffers`` / ``_modules`` / hook dicts) and the
contents of the dicts, lists and sets it holds (two levels deep); restoring puts them back in
place, so the objects keep their identity and the rewritten module still shares the
model's Parameters. Buffer *values* are not copied: fxamp's real runs of the model use
copies of the buffers.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import operator
import sys
from typing import Any, Dict, Iterable, Iterator, List, Optional, Tuple

import torch
import torch.nn as nn

from .._torch import patched
from ..errors import is_library_file, short_path
from ..runtime import has_call_hooks
from ..structure import inside

log = logging.getLogger(__name__)

_DEPTH = 2  # containers inside containers inside attributes


def _is_container(value: Any) -> bool:
    return isinstance(value, (dict, list, set)) and not isinstance(value, nn.Module)


def _contents(value: Any) -> Any:
    if isinstance(value, dict):
        return list(value.items())
    if isinstance(value, list):
        return list(value)
    return set(value)


def _same(a: Any, b: Any) -> bool:
    """Whether two snapshots of a container's contents hold the same objects."""
    if isinstance(a, set) or isinstance(b, set):
        return a == b
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if isinstance(x, tuple) and isinstance(y, tuple):  # dict items
            if x[0] != y[0] or x[1] is not y[1]:
                return False
        elif x is not y:
            return False
    return True


#: caches torch.nn's own modules rebuild whenever they are called (RNNs' flat weights): not
#: the model's side effects
_TORCH_CACHES = frozenset({"_flat_weights", "_flat_weight_refs"})

_SCALARS = (str, bytes, int, float, complex, bool, type(None), torch.dtype, torch.device)


def _plain(value: Any, depth: int = 4) -> bool:
    """A value made of Python scalars, strings and containers of them (compared by ``==``)."""
    if isinstance(value, _SCALARS):
        return True
    if depth and isinstance(value, (tuple, list, set, frozenset)):
        return all(_plain(v, depth - 1) for v in value)
    if depth and isinstance(value, dict):
        return all(_plain(k, depth - 1) and _plain(v, depth - 1) for k, v in value.items())
    if depth and dataclasses.is_dataclass(value) and not isinstance(value, type):
        return all(_plain(getattr(value, f.name), depth - 1)  # a config (PEFT's LoraConfig)
                   for f in dataclasses.fields(value))
    return False


def _equal(a: Any, b: Any) -> bool:
    """The same object, equal plain values of one type (a tuple put back as an equal
    tuple, a dict of strings rebuilt), or a list, tuple or dict of one type holding the
    same objects (torch.export puts a module's attributes back as pytree copies: a dict of
    helper modules rebuilt): nothing that matters changed."""
    if a is b:
        return True
    if type(a) is not type(b):
        return False
    x, y = (list(a.keys()) + list(a.values()), list(b.keys()) + list(b.values())) \
        if isinstance(a, dict) else (a, b)
    if isinstance(x, (list, tuple)) and len(x) == len(y) and all(map(operator.is_, x, y)):
        return True
    return _plain(a) and _plain(b) and a == b


def _put_back(container: Any, contents: Any) -> None:
    if isinstance(container, dict):
        container.clear()
        container.update(contents)
    elif isinstance(container, list):
        container[:] = contents
    else:
        container.clear()
        container.update(contents)


class _Watch:
    """The snapshots noting where ``nn.Module.__setattr__`` is called from (on the
    tracing thread: see ``_torch.patched``)."""

    active: List["ModelState"] = []


def _watched_setattr(original: Any, module: nn.Module, name: str, value: Any) -> None:
    # Python values only (a counter, a flag, a cache): torch sets tensors and modules on
    # every functional call, and a plain tensor attribute is reported without its line
    if not isinstance(value, (torch.Tensor, nn.Module)):
        for state in _Watch.active:
            state.note_setattr(module, name)
    original(module, name, value)


def _user_line() -> str:
    frame = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename
        if not is_library_file(path) and not path.startswith("<"):
            return f'File "{short_path(path)}", line {frame.f_lineno}, in {frame.f_code.co_name}'
        frame = frame.f_back
    return ""


class ModelState:
    """A snapshot of ``model``'s attributes (see the module docstring). ``calls``: paths
    of submodules whose code does not run here (kept as calls by a trace, such as block
    mode's regions while its glue is traced): what is inside them is not snapshotted."""

    def __init__(self, model: nn.Module, calls: Iterable[str] = ()) -> None:
        self.model = model
        calls = tuple(calls)
        self.paths: Dict[int, str] = {}
        self.saved: List[Tuple[nn.Module, Dict[str, Any]]] = []
        self.containers: Dict[int, Tuple[Any, Any, str]] = {}
        self.lines: Dict[Tuple[int, str], str] = {}
        self.restored: List[str] = []  # what restores (this one's, nested ones) put back
        for path, module in model.named_modules(remove_duplicate=True):
            if inside(path, calls):
                continue
            self.paths[id(module)] = path
            attrs = dict(module.__dict__)
            self.saved.append((module, attrs))
            for name, value in attrs.items():
                self._save(value, f"{path}.{name}" if path else name, _DEPTH)

    def _save(self, value: Any, where: str, depth: int) -> None:
        if not _is_container(value) or id(value) in self.containers:
            return
        contents = _contents(value)
        self.containers[id(value)] = (value, contents, where)
        if depth > 0:
            items = contents if not isinstance(value, dict) else [v for _, v in contents]
            for item in items:
                self._save(item, where, depth - 1)

    def note_setattr(self, module: nn.Module, name: str) -> None:
        key = (id(module), name)
        if id(module) in self.paths and key not in self.lines:
            self.lines[key] = _user_line()

    @contextlib.contextmanager
    def watch(self) -> Iterator[None]:
        """Record the source line of each attribute set on the model's modules (by this
        thread; holds fxamp's trace lock)."""
        with patched("module_setattr", _watched_setattr):
            _Watch.active.append(self)
            try:
                yield
            finally:
                _Watch.active.remove(self)

    def changes(self) -> List[str]:
        """The attributes that differ from the snapshot, as ``path.name`` (with the source
        line that set them, where known). Modules with hooks are left out: the rewritten
        model calls them, so what their hooks set is set again on every call."""
        out: List[str] = []
        for module, attrs in self.saved:
            if has_call_hooks(module):
                continue
            path = self.paths[id(module)]
            now = module.__dict__
            for name in sorted((set(attrs) | set(now)) - _TORCH_CACHES):
                if name not in now or name not in attrs or not _equal(now[name], attrs[name]):
                    out.append(self._describe(module, path, name, "set"))
        for container, contents, where in self.containers.values():
            now_contents = _contents(container)
            if not _same(contents, now_contents) and not _equal(contents, now_contents):
                out.append(f"{where} (changed in place)")
        return out

    def _changed(self) -> bool:
        for module, attrs in self.saved:
            now = module.__dict__
            if set(now) != set(attrs) or any(now[k] is not v for k, v in attrs.items()):
                return True
        return any(not _same(contents, _contents(container))
                   for container, contents, _ in self.containers.values())

    def _describe(self, module: nn.Module, path: str, name: str, how: str) -> str:
        key = (id(module), name)
        line = next((s.lines[key] for s in [self] + _Watch.active if key in s.lines), "")
        text = f"{path}.{name}" if path else name
        return f"{text} ({how} at {line})" if line else text

    def restore(self) -> List[str]:
        """Put every attribute and container back; return what had changed."""
        if not self._changed():
            return []
        changed = self.changes()
        for state in [self] + _Watch.active:  # the watching (outer) snapshots hear of it
            state.restored += [c for c in changed if c not in state.restored]
        for module, attrs in self.saved:
            now = module.__dict__
            if any(now.get(k, attrs) is not v for k, v in attrs.items()) or set(now) != set(attrs):
                now.clear()
                now.update(attrs)
        for container, contents, _ in self.containers.values():
            if not _same(contents, _contents(container)):
                _put_back(container, contents)
        return changed


def report_side_effects(model: nn.Module, changed: List[str],
                        where: Optional[str] = None) -> None:
    """Warn once that ``model``'s forward changed its own attributes while fxamp ran it."""
    if not changed:
        return
    log.warning("%s changed its own state while fxamp traced it%s: %s. fxamp restored it; "
                "the rewritten graph does not repeat these Python side effects (keep state "
                "changes out of forward, or make them tensor ops on buffers)",
                type(model).__name__, f" ({where})" if where else "", "; ".join(changed))
