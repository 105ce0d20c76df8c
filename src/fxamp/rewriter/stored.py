"""The policy ``weights=stored``: each weight kept at rest in the dtype its nodes compute in.

For inference and serving. After the rewrite has built its graphs (which cast every weight,
as ``weights=cast`` does), :func:`store_weights` reads, per Parameter, the dtypes the graphs
read it in, and stores it so:

- read only in one low dtype (a Linear's weight under bf16): the Parameter is replaced, in
  every module that holds it, by a Parameter of that dtype (its FP32 values rounded once,
  ``Tensor.to``: what autocast's per-call cast gives), and the graphs read it directly;
- read in FP32 only (a norm's weight in an FP32 island): it stays as it is;
- read in FP32 and in a low dtype (a tied embedding / head): it stays FP32 and one
  low-precision copy is kept, a non-persistent buffer ``<name>_fxamp_<dtype>`` next to it,
  that the graphs read instead of casting.

No cast of a stored weight runs per call. The plan's header says which weights were stored
(``stored``) and which keep FP32 plus a copy (``stored_copies``). A weight read by code that
is not a rewritten graph (an eager root's own code, a module run under autocast) stays
FP32, as autocast needs it.

Loading: ``load_state_dict`` copies into the stored Parameters (converting the dtype); a
pre-hook converts the entries of stored weights first (so ``assign=True`` assigns the stored
dtype too), and a post-hook re-casts the copies from their FP32 masters.

Training is refused: a graph output that requires grad goes through :func:`guard_output`,
which raises :class:`~fxamp.errors.StoredWeightsError` on a forward with grad in train mode,
and on any backward through it.
"""
from __future__ import annotations

import contextlib
import logging
import weakref
from typing import Any, Dict, Iterator, List, Optional, Set, Tuple

import torch
import torch.fx as fx
import torch.nn as nn

from .._torch import recompile
from ..errors import StoredWeightsError, UnsupportedModelError
from ..policy import dtype_name
from ..result import has_result, result_of
from ..runtime import call_with_params

log = logging.getLogger(__name__)

#: where the model keeps the record of its stored weights (its ``__dict__``)
STORED_RECORD = "_fxamp_stored"
_LOW = (torch.float16, torch.bfloat16)
_WHAT_TO_DO = ("what to do: rewrite the FP32 model with the default policy weights=cast "
               "for training (FP32 master weights, cast per call, as autocast does)")


def _refuse_backward(grad: torch.Tensor) -> None:
    """A tensor hook on an output: a backward that reaches it is refused."""
    raise StoredWeightsError(
        "backward through a model rewritten with policy weights=stored: its weights are "
        "stored in low precision, with no FP32 master to train. " + _WHAT_TO_DO)


def guard_output(value: Any, training: bool) -> Any:
    """A graph output of a model with stored weights: as it is without grad; with grad, a
    forward in train mode is refused, and a backward that reaches the output is refused (a
    tensor hook: the output itself is returned, not a view of it).

    Args:
        value: the output (anything; only a tensor that requires grad is guarded).
        training: the module's training flag.
    """
    if not torch.is_grad_enabled() or not isinstance(value, torch.Tensor) \
            or not value.requires_grad:
        return value
    if training:
        raise StoredWeightsError(
            "a forward with grad in train mode through a model rewritten with policy "
            "weights=stored: its weights are stored in low precision and cannot be trained. "
            "For evaluation call it under torch.no_grad() or torch.inference_mode() (or in "
            "eval mode). " + _WHAT_TO_DO)
    value.register_hook(_refuse_backward)
    return value


class StoredRecord:
    """What :func:`store_weights` did to a model: the stored Parameters by name (the first
    module path that holds each: its dtype) and the names of the weights kept in FP32 with a
    low-precision copy. Names, not objects: a deepcopy of the model keeps it true."""

    def __init__(self) -> None:
        self.stored: Dict[str, torch.dtype] = {}
        self.copied: List[str] = []


class _ConvertOnLoad:
    """A load_state_dict pre-hook: the entry of a stored weight converted to its dtype
    first (in the load's own copy of the dict), so ``assign=True`` assigns that dtype too.

    Args:
        name: the weight's attribute name in the module the hook is on.
        dtype: its stored dtype.
    """

    def __init__(self, name: str, dtype: torch.dtype) -> None:
        self.name, self.dtype = name, dtype

    def __call__(self, module: nn.Module, state_dict: Dict[str, Any], prefix: str,
                 *rest: Any) -> None:
        key = prefix + self.name
        value = state_dict.get(key)
        if isinstance(value, torch.Tensor) and value.is_floating_point() \
                and value.dtype != self.dtype:
            state_dict[key] = value.to(self.dtype)


class _RecastOnLoad:
    """A load_state_dict post-hook of a module holding a weight kept in FP32 with a copy:
    the copy re-cast from the weight as loaded. An object (not a closure), so that a
    deepcopy of the model re-casts the copy's own copy.

    Args:
        name: the FP32 weight's attribute name in the module the hook is on.
        holder: the module that holds the copy (a buffer).
        buffer: the copy's buffer name.
        dtype: the copy's dtype.
    """

    def __init__(self, name: str, holder: nn.Module, buffer: str, dtype: torch.dtype) -> None:
        self.name, self.holder, self.buffer, self.dtype = name, holder, buffer, dtype

    def __call__(self, module: nn.Module, incompatible: Any) -> None:
        master = module._parameters.get(self.name)
        if master is None:
            return
        with torch.no_grad():
            copy = self.holder._buffers.get(self.buffer)
            if copy is not None and copy.shape == master.shape and \
                    copy.device == master.device:
                copy.copy_(master)
            else:
                self.holder._buffers[self.buffer] = master.detach().to(self.dtype)


def _parts(gm: nn.Module) -> List[Tuple[str, fx.GraphModule]]:
    """(path, graph module) for every graph part of ``gm``."""
    return [(p, m) for p, m in gm.named_modules(remove_duplicate=False)
            if isinstance(m, fx.GraphModule)]


def _resolve(root: nn.Module, target: str) -> Tuple[Optional[nn.Module], str, Any]:
    """(owner module, attribute name, value) of ``target`` read from ``root``."""
    owner_path, _, name = target.rpartition(".")
    try:
        owner = root.get_submodule(owner_path) if owner_path else root
    except AttributeError:
        return None, name, None
    return owner, name, getattr(owner, name, None)


def _under(path: str, prefix: str) -> bool:
    """Whether module path ``path`` is ``prefix`` or below it ("" is the root)."""
    return prefix == "" or path == prefix or path.startswith(prefix + ".")


def _join(a: str, b: str) -> str:
    """Two dotted paths joined (either may be empty)."""
    return f"{a}.{b}" if a and b else a or b


class _Reads:
    """Every read of a Parameter in the graph parts: its get_attr nodes, the casts of each
    (by dtype) and whether it is read as it is."""

    def __init__(self) -> None:
        self.param: Optional[nn.Parameter] = None
        self.nodes: List[Tuple[fx.GraphModule, fx.Node]] = []
        self.casts: Dict[torch.dtype, List[Tuple[fx.GraphModule, fx.Node]]] = {}
        self.direct = False


def _is_cast(user: fx.Node, node: fx.Node) -> Optional[torch.dtype]:
    """The low dtype ``user`` casts ``node`` (a weight's read) to, if it is such a cast."""
    if user.op == "call_method" and user.target == "to" and user.args[:1] == (node,) \
            and len(user.args) == 2 and not user.kwargs and user.args[1] in _LOW:
        return user.args[1]
    return None


def _collect(gm: nn.Module) -> Tuple[Dict[int, _Reads], List[str], List[str]]:
    """The Parameter reads of ``gm``'s graph parts (a module the graph calls reads its own
    Parameters as they are); the parts' paths; the paths of the modules the parts run under
    autocast (their own code reads their Parameters, to be cast by autocast)."""
    reads: Dict[int, _Reads] = {}
    parts = _parts(gm)
    opaque: List[str] = []
    for path, part in parts:
        for node in part.graph.nodes:
            if node.op == "call_module":  # (it reads its Parameters as they are)
                _, _, module = _resolve(part, str(node.target))
                for param in module.parameters() if isinstance(module, nn.Module) else ():
                    record = reads.setdefault(id(param), _Reads())
                    record.param, record.direct = param, True
                continue
            if node.op != "get_attr":
                continue
            _, _, value = _resolve(part, str(node.target))
            if isinstance(value, nn.Module):
                if any(u.target is not call_with_params for u in node.users) \
                        and not isinstance(value, fx.GraphModule):
                    opaque.append(_join(path, str(node.target)))
                continue
            if not isinstance(value, nn.Parameter):
                continue
            record = reads.setdefault(id(value), _Reads())
            record.param = value
            record.nodes.append((part, node))
            for user in node.users:
                dtype = _is_cast(user, node)
                if dtype is None:
                    record.direct = True
                else:
                    record.casts.setdefault(dtype, []).append((part, user))
    return reads, [p for p, _ in parts], opaque


def _holders(root: nn.Module) -> Dict[int, List[Tuple[str, nn.Module, str]]]:
    """Per Parameter id: (module path, module, name) of every module that holds it."""
    out: Dict[int, List[Tuple[str, nn.Module, str]]] = {}
    for path, module in root.named_modules(remove_duplicate=False):
        for name, p in module._parameters.items():
            if p is not None:
                out.setdefault(id(p), []).append((path, module, name))
    return out


def _owned(places: List[Tuple[str, nn.Module, str]], parts: List[str],
           opaque: List[str]) -> bool:
    """Whether every read of a Parameter held at ``places`` is a graph part's."""
    for path, _, _ in places:
        if not any(_under(path, p) for p in parts):
            return False  # (read by code no graph replaced: an eager root's, say)
        if any(_under(path, o) for o in opaque):
            return False  # (read by a module run as a call)
    return True


def _replace_everywhere(roots: List[nn.Module], old: nn.Parameter, new: nn.Parameter) -> None:
    """Every ``_parameters`` entry that holds ``old`` in the modules of ``roots`` holds ``new``."""
    seen: Set[int] = set()
    for root in roots:
        for module in root.modules():
            if id(module) in seen:
                continue
            seen.add(id(module))
            for name, p in list(module._parameters.items()):
                if p is old:
                    module._parameters[name] = new


def store_weights(model: nn.Module, gm: nn.Module,
                  enclosing: Optional[nn.Module] = None) -> StoredRecord:
    """Store ``model``'s weights in the dtypes ``gm``'s graphs read them in (see the module
    docstring); the graphs then read them without a cast. Returns the model's record.

    Args:
        model: the model ``gm`` was rewritten from (its Parameters are replaced in place).
        gm: its rewritten module (its graph parts are changed and recompiled).
        enclosing: the whole model, where ``model`` is a region of it planned on its own
            (block mode): a Parameter a module outside ``model`` holds too (a head's weight
            tied to the embedding) is read there by another region or by code no graph
            replaced, so it stays as it is and ``gm`` casts it (the tie kept).
    """
    record: StoredRecord = model.__dict__.setdefault(STORED_RECORD, StoredRecord())
    reads, parts, opaque = _collect(gm)
    holders = _holders(model)
    if enclosing is not None and enclosing is not model:
        mine = {id(m) for m in model.modules()}
        outside = {id(p) for m in enclosing.modules() if id(m) not in mine
                   for p in m._parameters.values() if p is not None}
        holders = {pid: places for pid, places in holders.items() if pid not in outside}
    roots = [model] if gm is model else [model, gm]
    stored: List[str] = []
    copied: List[str] = []
    changed: Set[int] = set()
    made: Set[Tuple[int, str]] = set()
    for pid, read in reads.items():
        param = read.param
        assert param is not None
        places = holders.get(pid, [])
        if not read.casts or not places or not _owned(places, parts, opaque):
            continue
        path, module, name = places[0]
        label = _join(path, name)
        if not read.direct and len(read.casts) == 1 and param.dtype == torch.float32:
            (dtype, casts), = read.casts.items()
            with torch.no_grad():
                new = nn.Parameter(param.detach().to(dtype), requires_grad=param.requires_grad)
            _replace_everywhere(roots, param, new)
            _MADE_LOW[id(new)] = new
            for _, mod, attr in places:
                mod.register_load_state_dict_pre_hook(_ConvertOnLoad(attr, dtype))
            for part, cast in casts:
                cast.replace_all_uses_with(cast.args[0])
                part.graph.erase_node(cast)
                changed.add(id(part))
            record.stored[label] = dtype
            stored.append(label)
            continue
        for dtype, casts in read.casts.items():
            for part, cast in casts:
                owner, attr, _ = _resolve(part, str(cast.args[0].target))
                assert owner is not None
                buffer = f"{attr}_fxamp_{dtype_name(dtype)}"
                if (id(owner), buffer) not in made:  # (cast anew: a replan after .float())
                    made.add((id(owner), buffer))
                    old = owner._buffers.get(buffer)
                    with torch.no_grad():
                        owner.register_buffer(buffer, param.detach().to(dtype), persistent=False)
                    for _, mod, name in places if old is None else ():  # (else: there)
                        mod.register_load_state_dict_post_hook(
                            _RecastOnLoad(name, owner, buffer, dtype))
                owner_path = str(cast.args[0].target).rpartition(".")[0]
                with part.graph.inserting_before(cast):
                    node = part.graph.get_attr(_join(owner_path, buffer))
                cast.replace_all_uses_with(node)
                part.graph.erase_node(cast)
                changed.add(id(part))
            copied.append(f"{label} ({'+'.join(dtype_name(d) for d in read.casts)})")
            record.copied.append(label)
    for _, part in _parts(gm):
        if id(part) in changed or _reads_stored(part):
            _guard_outputs(part)
            part.graph.lint()
            recompile(part)
    _note(gm, stored, copied)
    for module in (gm, *(part for _, part in _parts(gm))):  # (not a region it calls: a
        structure = getattr(result_of(module), "structure", None) \
            if has_result(module) else None  # block's own check must see a change)
        if structure is not None:
            structure.take()  # (the model's Parameters as they are now)
    log.info("%s: weights=stored: %d weights stored in low precision, %d kept in FP32 with "
             "a low-precision copy", type(model).__name__, len(stored), len(copied))
    return record


def _reads_stored(part: fx.GraphModule) -> bool:
    """Whether ``part`` reads a low-precision Parameter (a stored one: a model is rewritten
    with FP32 Parameters only)."""
    for node in part.graph.nodes:
        if node.op == "get_attr":
            _, _, value = _resolve(part, str(node.target))
            if isinstance(value, nn.Parameter) and value.dtype in _LOW:
                return True
    return False


def _guard_outputs(part: fx.GraphModule) -> None:
    """Each output of ``part`` through :func:`guard_output` (once)."""
    graph = part.graph
    output = next(n for n in reversed(graph.nodes) if n.op == "output")
    if any(n.op == "call_function" and n.target is guard_output for n in graph.nodes):
        return
    with graph.inserting_before(output):
        training = graph.create_node("get_attr", "training", (), {}, "fxamp_training")

        def wrap(node: fx.Node) -> fx.Node:
            with graph.inserting_before(output):
                return graph.call_function(guard_output, (node, training))
        output.args = fx.node.map_arg(output.args, wrap)


def _note(gm: nn.Module, stored: List[str], copied: List[str]) -> None:
    """The plan's header says what was stored."""
    if not has_result(gm):
        return
    header = result_of(gm).plan.header
    if stored:
        header["stored"] = f"{len(stored)} weights in low precision"
    if copied:
        header["stored_copies"] = ("FP32 plus one low-precision copy (read in both): "
                                   + ", ".join(copied))


def record_of(model: nn.Module) -> Optional[StoredRecord]:
    """The record of ``model``'s stored weights, if any.

    Args:
        model: a model rewritten with ``weights=stored``.
    """
    return model.__dict__.get(STORED_RECORD)


#: every Parameter fxamp stored in low precision (held weakly): a module planned later that
#: shares one (blocks sharing an ``nn.Linear``) is planned with an FP32 stand-in for it too
_MADE_LOW: "weakref.WeakValueDictionary[int, nn.Parameter]" = weakref.WeakValueDictionary()


@contextlib.contextmanager
def planning_in_fp32(model: nn.Module) -> Iterator[Dict[int, nn.Parameter]]:
    """``model`` with FP32 stand-ins for its stored Parameters while it is planned again (a
    new mode or call structure): the plan is made as for the FP32 model; yields the
    stand-ins by id, mapped to the stored Parameters :func:`restore_stored` puts back.

    Args:
        model: a model rewritten in place with ``weights=stored``.
    """
    record = record_of(model)
    names = list(record.stored) if record is not None else []
    names += [name for name, p in model.named_parameters()  # (stored planning another)
              if _MADE_LOW.get(id(p)) is p and name not in names]
    if not names:
        yield {}
        return
    swaps: Dict[int, nn.Parameter] = {}
    done: List[Tuple[nn.Parameter, nn.Parameter]] = []
    for name in names:
        try:
            param = model.get_parameter(name)
        except AttributeError:
            continue  # (deleted since: the new plan reads what is there)
        if param.dtype not in _LOW:
            continue  # (made FP32 again since, model.float(): planned and stored anew)
        with torch.no_grad():
            stand_in = nn.Parameter(param.detach().float(), requires_grad=param.requires_grad)
        _replace_everywhere([model], param, stand_in)
        swaps[id(stand_in)] = param
        done.append((param, stand_in))
    try:
        yield swaps
    finally:
        for param, stand_in in done:
            _replace_everywhere([model], stand_in, param)


def restore_stored(model: nn.Module, gm: nn.Module, swaps: Dict[int, nn.Parameter]) -> None:
    """After a plan made with :func:`planning_in_fp32`: ``gm``'s graphs read the stored
    Parameters directly (a stand-in read in another dtype than its stored one is refused).

    Args:
        model: the model.
        gm: the new rewritten module.
        swaps: the stand-ins by id, and the stored Parameters they stood for.
    """
    if not swaps:
        return
    reads, _, _ = _collect(gm)
    for pid, param in swaps.items():
        read = reads.get(pid)
        if read is None:
            continue
        dtype = param.dtype
        if read.direct or set(read.casts) - {dtype}:
            name = next((n for n, p in model.named_parameters() if p is param), "a weight")
            raise UnsupportedModelError(
                f"{name} is stored in {dtype_name(dtype)} "
                "(weights=stored), but the model's new plan (a new mode or call structure) "
                "reads it in another dtype, and its FP32 values are gone. what to do: "
                "rewrite the FP32 model with weights=stored and example inputs of that call")
        for part, cast in read.casts.get(dtype, []):
            cast.replace_all_uses_with(cast.args[0])
            part.graph.erase_node(cast)
        assert read.param is not None
        _replace_everywhere([gm], read.param, param)


def store_like(source: nn.Module, block: nn.Module) -> None:
    """Store ``block``'s weights as :func:`store_weights` stored those of ``source``, an
    identical block whose graphs ``block`` is about to share (``rewriter/blocks.py``):
    the same Parameters in the same low dtypes, the same copies next to the same weights.

    Args:
        source: a block rewritten with ``weights=stored``.
        block: an identical block, not rewritten yet.
    """
    record = record_of(source)
    if record is None:
        return
    mine: StoredRecord = block.__dict__.setdefault(STORED_RECORD, StoredRecord())
    holders = _holders(block)
    for name, dtype in record.stored.items():
        param = block.get_parameter(name)
        with torch.no_grad():
            new = nn.Parameter(param.detach().to(dtype), requires_grad=param.requires_grad)
        for _, module, attr in holders.get(id(param), []):
            module.register_load_state_dict_pre_hook(_ConvertOnLoad(attr, dtype))
        _replace_everywhere([block], param, new)
        _MADE_LOW[id(new)] = new
        mine.stored[name] = dtype
    theirs = dict(block.named_modules(remove_duplicate=False))
    for path, module in source.named_modules(remove_duplicate=False):
        for buffer, value in list(module._buffers.items()):
            attr, sep, _ = buffer.rpartition("_fxamp_")
            other = theirs.get(path)
            if not sep or value is None or other is None or buffer in other._buffers:
                continue
            master = getattr(other, attr)
            with torch.no_grad():
                other.register_buffer(buffer, master.detach().to(value.dtype),
                                      persistent=False)
            for _, holder, name in _holders(block).get(id(master), []):
                holder.register_load_state_dict_post_hook(
                    _RecastOnLoad(name, other, buffer, value.dtype))
    mine.copied = list(record.copied)
