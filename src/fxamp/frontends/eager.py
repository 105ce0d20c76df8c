"""Eager root: a model whose own ``forward`` no tracer takes, with its children rewritten.

Detection models loop over lists of images and branch on box counts in their top-level
``forward``; neither torch.fx nor torch.export takes that code, but their backbones and heads
are ordinary graphs. Here the model's own ``forward`` stays Python and runs under
``torch.autocast``. The front end (:class:`EagerFrontend`) captures no graph: it records the
children's first calls and returns them as :class:`.base.Children`; the rewriter rewrites
each child on its own (any front end, recursively) and hands the results to
:func:`eager_root`. A rewritten child runs with autocast switched off, as its plan says; a
child nothing takes stays the original module and runs under the autocast around it
(``rule="runtime"``).

The result is a shallow copy of the model (same class, same Parameters and buffers) whose
children are the rewritten modules; attributes a rewritten child lacks (``out_channels``,
helper methods such as ``transform.postprocess``) are read from the original child.
"""
from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import logging
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn
from .. import _torch
from .._torch import reparametrize_module, tree_flatten, tree_map, tree_unflatten

from ..errors import FxampError, InputShapeError
from ..ir import Rule
from ..config import RewriteConfig
from ..ops import module_label
from ..passes.annotate import first_float
from ..plan import NodePrecision, Plan
from ..result import RESULT, Rewritten, one_mode, plan_of, result_of, set_result
from ..policy import Policy, dtype_name
from ..runtime import device_autocast, device_type
from .base import Children, Request
from .checkpointing import LAYER_FLAGS, call_layer, is_checkpointing_layer
from ..graph_run import own_copies
from .common import in_output_dtype, nested_header, nested_lines, top_header
from .aten_inputs import check_in_forward
from .copies import bound_to, refuse_copies
from .hooks import CALL_HOOK_DICTS, share_call_hooks, without_call_hooks
from .shadow import real_of

log = logging.getLogger(__name__)

#: an eager root's ``__dict__`` key: how each rewritten child is called, by path (whether
#: it takes FP32 inputs, the input dtypes it was planned for, the dtypes its outputs are
#: cast to), read by :func:`rebound` to make the same root for an identical module
PARTS = "fxamp_eager_parts"
#: where an eager root notes that a child refused a call by a size its export fixed (the
#: child ran as autocast runs it): the module planned on its calls that computes with the
#: root plans anew on its next call, that size symbolic (``rewriter/inplace.py``)
MISSED = "fxamp_eager_missed"


def low_dtype(values: Any) -> Optional[torch.dtype]:
    """The low-precision floating dtype (FP16 or BF16) of the first such tensor among
    ``values``' leaves, or None when all are FP32 or not floating."""
    leaves, _ = tree_flatten(values)
    return next((v.dtype for v in leaves if isinstance(v, torch.Tensor)
                 and v.dtype in (torch.float16, torch.bfloat16)), None)


def regular_path() -> "contextlib.AbstractContextManager":
    """torch.nn's fused fast path (``nn.TransformerEncoderLayer``, ``nn.MultiheadAttention``,
    taken in eval mode without grad) off on this thread: a recording run without grad gets
    the dtypes of the regular path, the one a plan computes and autocast takes with grad
    and in training (under autocast the fast path gives bf16 where the regular path gives
    FP32, and a child would get its output cast to bf16 in every mode; a model first called
    in eval, as Lightning's sanity check does, then trained with wrong gradients)."""
    return _torch.patched("mha_fastpath", lambda original: False)


def submodule_calls(model: nn.Module, paths: Sequence[str], args: tuple,
                    kwargs: Dict[str, Any], autocast: Optional[torch.dtype] = None
                    ) -> Dict[str, Tuple[tuple, dict, Any]]:
    """(args, kwargs, output) of each submodule's first call when the model runs on the
    example inputs: one forward without grad (FP32, or under ``torch.autocast`` of
    ``autocast``), on copies of the buffers and a forked RNG, with the modules' own call
    hooks off, so no state changes and no hook of the user's runs.

    Inputs in a low-precision dtype (a child of a rewritten model, planned for the bf16
    activations it gets under autocast) are run under ``torch.autocast`` of that dtype when
    ``autocast`` is None: FP32 weights take them only there (a conv reading a bf16 input
    with an FP32 bias raises outside), and that is how the child's submodules get them."""
    if autocast is None:
        autocast = low_dtype((args, kwargs))
    seen: Dict[str, Tuple[tuple, dict, Any]] = {}
    entered: Dict[str, Tuple[tuple, dict]] = {}
    buffers = {name: b.clone() for name, b in model.named_buffers()}
    with without_call_hooks(list(model.modules())):  # (no hook of the user's runs here)
        hooks = []
        for path in paths:
            def pre(_m: nn.Module, a: tuple, kw: dict, path: str = path) -> None:
                if path not in entered:  # (its arguments as they were before the call)
                    entered[path] = (own_copies(a), own_copies(kw))

            def hook(_m: nn.Module, a: tuple, kw: dict, out: Any, path: str = path) -> None:
                if path not in seen:
                    seen[path] = (*entered.get(path, (a, kw)), out)
            hooks.append(model.get_submodule(path).register_forward_pre_hook(
                pre, with_kwargs=True))
            hooks.append(model.get_submodule(path).register_forward_hook(hook,
                                                                         with_kwargs=True))
        try:
            with torch.no_grad(), torch.random.fork_rng(devices=[]), regular_path(), \
                    reparametrize_module(model, buffers, strict=False), \
                    (device_autocast(device_type((args, kwargs)), autocast) if autocast
                     else contextlib.nullcontext()):
                model(*own_copies(tuple(args)), **own_copies(dict(kwargs)))
        finally:
            for h in hooks:
                h.remove()
    return seen


def _fp32(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.dtype in (torch.float16, torch.bfloat16):
        return value.float()
    return value


def _planned_dtypes(call: Optional[Tuple[tuple, dict, Any]]) -> List[Optional[torch.dtype]]:
    """The floating dtype of each input leaf of a recorded call (None: not floating)."""
    if call is None:
        return []
    leaves, _ = tree_flatten((call[0], call[1]))
    return [v.dtype if isinstance(v, torch.Tensor) and v.is_floating_point() else None
            for v in leaves]


def _to_planned(values: Any, planned: List[Optional[torch.dtype]]) -> Any:
    """Floating inputs cast to the dtypes the child was planned for, where they differ (a
    rewritten sibling before it may give FP32 where autocast gave bf16). A call whose
    arguments are all tensors is read without pytree (the common case, once per call)."""
    leaves, rebuild = _leaves(values)
    if len(leaves) != len(planned) or all(
            d is None or not isinstance(v, torch.Tensor) or not v.is_floating_point()
            or v.dtype == d for v, d in zip(leaves, planned)):
        return values
    return rebuild([
        v.to(d) if d is not None and isinstance(v, torch.Tensor) and v.is_floating_point()
        and v.dtype != d else v for v, d in zip(leaves, planned)])


def _leaves(values: Any) -> Tuple[Sequence[Any], Callable[[List[Any]], Any]]:
    """``values``' leaves, as pytree flattens them, and what rebuilds ``values`` from new
    leaves: for a call ``(args, kwargs)`` whose arguments are all tensors, its positional
    ones then its keyword values, with no pytree call."""
    if type(values) is tuple and len(values) == 2 and type(values[0]) is tuple \
            and type(values[1]) is dict:
        args, kwargs = values
        given = (*args, *kwargs.values())
        if all(isinstance(v, torch.Tensor) for v in given):
            return given, lambda new: (tuple(new[:len(args)]), dict(zip(kwargs,
                                                                        new[len(args):])))
    leaves, spec = tree_flatten(values)
    return leaves, lambda new: tree_unflatten(new, spec)


def _as_planned(module: nn.Module, fp32_inputs: bool, planned: Sequence[Optional[torch.dtype]],
                original: nn.Module, root: nn.Module) -> None:
    """Make ``module`` (a rewritten child with explicit casts) run with autocast off. It was
    planned with the inputs the model's forward gives it under the root's autocast (a bf16
    activation stays bf16, as under autocast: ``planned``, each input's dtype, which its
    inputs are cast to), or, where that plan failed, with the FP32 model's inputs
    (``fp32_inputs``: its low-precision inputs are cast to FP32). When ``original`` (the
    child it replaces) is an HF layer that checkpoints itself, the call is checkpointed as
    the layer's flag says at run time (:func:`.checkpointing.call_layer`).

    In a root planned on its module's calls (:func:`notes_misses`), a call the child
    refuses by a size its export fixed runs ``original`` under the root's autocast, as
    autocast runs it, and is noted on ``root`` (:data:`MISSED`): the code of the root that
    ran before it (a KV cache appended to, batch-norm statistics) is not run again, and
    the root's module plans anew on its next call. A child that is an eager root passes
    its own note on to ``root``. Elsewhere (a returned module) the refusal is raised, as
    an exported graph's is."""
    forward = module.forward
    dtypes = list(planned)
    check = check_in_forward(module)

    def planned_call(*args: Any, **kwargs: Any) -> Any:
        if check is not None:
            try:
                check(module, args, kwargs, True)
            except InputShapeError as err:
                if getattr(err, "program", None) is not module or MISSED not in root.__dict__:
                    raise  # (a bound the model's code set; a root no forward plans again)
                root.__dict__[MISSED] = err
                return type(original).forward(original, *args, **kwargs)
        if fp32_inputs:
            args, kwargs = tree_map(_fp32, (args, kwargs))
        elif any(dtypes):
            args, kwargs = _to_planned((args, kwargs), dtypes)
        with torch.autocast(device_type((args, kwargs)), enabled=False):
            out = forward(*args, **kwargs)
        miss = module.__dict__.get(MISSED)  # (an eager child's own note)
        if miss is not None:
            module.__dict__[MISSED] = None
            root.__dict__[MISSED] = miss
        return out

    layer = original if is_checkpointing_layer(original) else None

    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        if layer is None:
            return planned_call(*args, **kwargs)
        return call_layer(layer, module.training, planned_call, args, kwargs)

    module.forward = run  # type: ignore[method-assign]


def _reading_from(module: nn.Module, original: nn.Module) -> None:
    """Attributes ``module`` lacks are read from ``original`` (the child it replaces); the
    ones that say how it is called (whether a full backward hook is registered, an HF
    layer's checkpointing flag and function) are ``original``'s, read and written through
    (``model.gradient_checkpointing_enable()`` on either reaches both)."""
    cls = type(module)

    def __getattr__(self: nn.Module, name: str) -> Any:
        try:
            return cls.__getattr__(self, name)
        except AttributeError:
            return getattr(original, name)

    shared = ("_is_full_backward_hook",) + (
        LAYER_FLAGS if is_checkpointing_layer(original) else ())
    # (its qualname is the class's: a copy of a graph module, which torch makes from the
    # class below any named like its own per-instance class, is a plain one again)
    attrs: Dict[str, Any] = {"__getattr__": __getattr__, "__qualname__": cls.__qualname__}
    attrs.update({name: _through(original, name) for name in shared})
    module.__class__ = type(cls.__name__, (cls,), attrs)


def _through(original: nn.Module, name: str) -> property:
    """A property reading and writing ``original``'s attribute ``name``."""
    return property(lambda self: getattr(original, name, None),
                    lambda self, value: setattr(original, name, value))


#: the rules of a child's plan lines that follow autocast (a child planned otherwise, by an
#: override or a numerics pass, keeps the output dtype its plan gives)
_AS_AUTOCAST = (Rule.AUTOCAST, Rule.NESTED, Rule.RUNTIME, Rule.PLACEMENT)


def _float_dtypes(value: Any) -> List[Optional[torch.dtype]]:
    leaves, _ = tree_flatten(value)
    return [v.dtype if isinstance(v, torch.Tensor) and v.is_floating_point() else None
            for v in leaves]


def _output_casts(result: nn.Module, nested: Dict[str, Plan],
                  autocast_calls: Dict[str, Tuple[tuple, dict, Any]],
                  outs: Dict[str, Tuple[tuple, dict, Any]]) -> Dict[str, str]:
    """Cast the outputs of each rewritten child whose output dtypes (``outs``: a run of
    the rewritten model) differ from those it gives under ``torch.autocast``
    (``autocast_calls``) to autocast's, where its plan follows autocast. That is a cast the
    model writes in terms of a dtype it reads at run time, which the trace (in FP32) baked
    in: PEFT's LoRA ``result.to(torch_result_dtype)``, with ``torch_result_dtype`` read
    from the base layer's output (bf16 under autocast, FP32 in the trace). Returns the
    plan-line note of each child recast."""
    done: Dict[str, str] = {}
    for name, plan in nested.items():
        if name not in autocast_calls or name not in outs or any(
                p.rule not in _AS_AUTOCAST for p in plan.nodes.values()):
            continue
        want, got = _float_dtypes(autocast_calls[name][2]), _float_dtypes(outs[name][2])
        if len(want) != len(got) or want == got or None in [
                w for w, g in zip(want, got) if w != g] + [
                g for w, g in zip(want, got) if w != g]:
            continue
        sub = result.get_submodule(name)
        _cast_outputs(sub, want)
        result.__dict__[PARTS][name]["recast"] = want
        names = sorted({dtype_name(w) for w, g in zip(want, got) if w != g and w})
        done[name] = (f"; its output is cast to {', '.join(names)}, its dtype under "
                      "torch.autocast (the model casts it to a dtype read at run time, "
                      "which the FP32 trace fixed)")
        log.info("%s: output cast to %s, as under torch.autocast", name, ", ".join(names))
    return done


def _cast_outputs(module: nn.Module, dtypes: List[Optional[torch.dtype]]) -> None:
    """``module``'s floating outputs cast to ``dtypes`` (one per output leaf)."""
    forward = module.forward

    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        return _to_planned(forward(*args, **kwargs), dtypes)

    module.forward = run  # type: ignore[method-assign]


def _warn_fp32_plans(model: nn.Module, names: Sequence[str],
                     autocast_calls: Dict[str, Tuple[tuple, dict, Any]], pol: Policy) -> None:
    """Warn, naming each, of the children planned for the FP32 model's inputs because no
    front end could plan them for the ones they get under the root's torch.autocast: on
    entry their low-precision inputs are cast to FP32, so the ops in them that autocast
    leaves alone run in FP32 where autocast runs them in the low dtype."""
    for name in names:
        if name not in autocast_calls:
            why = ("it is not called when the model runs under torch.autocast on the example "
                   "inputs, so it is planned for the inputs it gets without")
        else:
            low = sorted({dtype_name(d) for d in _planned_dtypes(autocast_calls[name])
                          if d in (torch.float16, torch.bfloat16)})
            why = ("no front end could plan it for " + (
                f"its {'/'.join(low)} inputs under torch.autocast" if low else
                "the inputs it gets under torch.autocast") + " (the reason is logged at INFO)")
        log.warning("%s.%s (%s) is planned for FP32 inputs: %s. Its inputs are cast to FP32 "
                    "on entry, so the ops in it on no autocast list run in FP32 where "
                    "torch.autocast runs them in %s: its numbers differ from autocast's",
                    type(model).__name__, name, module_label(model.get_submodule(name)),
                    why, dtype_name(pol.compute))


def call_paths(module: nn.Module, prefix: str = "") -> List[str]:
    """The paths of the submodules a forward calls: the children, with the items of a
    container that has no forward of its own (``ModuleList``, ``ModuleDict``: a decoder's
    blocks) in its place."""
    paths: List[str] = []
    for name, child in module.named_children():
        path = f"{prefix}{name}"
        if type(child).forward is nn.Module.forward:
            paths += call_paths(child, f"{path}.")
        else:
            paths.append(path)
    return paths


def _put(result: nn.Module, model: nn.Module, path: str, sub: nn.Module) -> None:
    """Put ``sub`` at ``path`` of ``result`` (a shallow copy of ``model``), copying the
    containers on the way so that ``model`` keeps its own."""
    *parents, name = path.split(".")
    holder, original = result, model
    for part in parents:
        original = original._modules[part]
        if holder._modules[part] is original:
            copied = copy.copy(original)
            copied._modules = dict(original._modules)
            holder._modules[part] = copied
        holder = holder._modules[part]
    holder._modules[name] = sub


def _call_as_planned(result: nn.Module, model: nn.Module, name: str, sub: nn.Module,
                     part: Dict[str, Any]) -> None:
    """Put ``sub`` (the rewritten child ``name`` of ``model``) into ``result`` (its eager
    root), called as ``part`` says: its inputs in the dtypes it was planned for, autocast
    off, attributes and call hooks read from the user's child, outputs recast."""
    child = real_of(model.get_submodule(name))  # (the user's: read and shared after)
    _as_planned(sub, part["fp32"], part["planned"], child, result)
    _reading_from(sub, child)
    share_call_hooks(sub, child)
    _put(result, model, name, sub)
    if part["recast"] is not None:
        _cast_outputs(sub, part["recast"])


def _eager_forward(result: nn.Module, model: nn.Module, pol: Policy) -> None:
    """Set ``result``'s forward: ``model``'s class's own, run under ``torch.autocast`` of the
    policy's compute dtype, its output in the policy's output dtype."""
    original = type(model).forward
    low = pol.compute
    out_dtype = pol.output_dtype

    def forward(*a: Any, **kw: Any) -> Any:
        with device_autocast(device_type((a, kw)), low):
            out = original(result, *a, **kw)
        return in_output_dtype(out, out_dtype)

    try:  # what a caller reading the signature sees (HF Trainer drops other columns)
        forward.__signature__ = inspect.signature(model.forward)  # type: ignore[attr-defined]
    except (TypeError, ValueError):
        pass
    result.forward = forward  # type: ignore[method-assign]


def notes_misses(gm: nn.Module) -> None:
    """Make ``gm``, where it is an eager root, and the eager roots inside it note a size
    one of their exported children refuses (:data:`MISSED`, see :func:`_as_planned`)
    instead of raising it: ``gm`` is planned on its module's calls, which plan anew.

    Args:
        gm: a rewritten module.
    """
    if PARTS in gm.__dict__:
        gm.__dict__[MISSED] = None
        for name in gm.__dict__[PARTS]:
            notes_misses(gm.get_submodule(name))


def is_eager_root(module: nn.Module) -> bool:
    """Whether ``module`` is an eager root (:func:`eager_root`'s result)."""
    return PARTS in module.__dict__


def bound_copy(gm: nn.Module, source: nn.Module, block: nn.Module) -> nn.Module:
    """A copy of ``gm`` (a rewritten module, planned for ``source``) reading ``block``'s
    modules, Parameters and buffers at the same paths instead: the same plan, no new trace
    (an eager root made anew for ``block``, :func:`rebound`; a graph, ``copies.bound_to``).

    Args:
        gm: the rewritten module of ``source``.
        source: the module it was planned for.
        block: an identical module (the same share key, ``rewriter/blocks.py``).
    """
    return rebound(gm, source, block) if is_eager_root(gm) else bound_to(gm, source, block)


def rebound(result: nn.Module, source: nn.Module, block: nn.Module) -> nn.Module:
    """The eager root ``result`` (rewritten from ``source``) made for ``block``, a module
    proved identical to ``source`` (the same share key, ``rewriter/blocks.py``): a shallow
    copy of ``block`` whose rewritten children are copies of ``result``'s bound to
    ``block``'s modules (an eager child made the same way), each called as in ``result``;
    the same plan, no recording run and no trace. Its Python forward reads ``block``'s own
    attributes (an HF layer's ``layer_idx``).

    Args:
        result: an eager root.
        source: the user's module it was made from.
        block: the user's module to make it for.

    Returns:
        ``block``'s eager root.
    """
    done = result_of(result)
    new = copy.copy(block)
    for name in ("forward", RESULT):  # (an in-place block's own: none of its code's)
        new.__dict__.pop(name, None)
    for kind in CALL_HOOK_DICTS:  # (they run around it, as a block planned on a call's)
        if getattr(block, kind, None):
            new.__dict__[kind] = type(getattr(block, kind))()
    new._modules = dict(block._modules)
    parts = result.__dict__[PARTS]
    for name, part in parts.items():
        sub, mine, theirs = (result.get_submodule(name), source.get_submodule(name),
                             block.get_submodule(name))
        # (a graph's copy has none of the wrapping forward, which is set up anew)
        made = bound_copy(sub, mine, theirs)
        _call_as_planned(new, block, name, made, part)
    new.__dict__[PARTS] = parts
    _eager_forward(new, block, done.policy)
    set_result(new, done)
    refuse_copies(new, "eager")
    return new


def eager_root(model: nn.Module, args: tuple, kwargs: Dict[str, Any], pol: Policy,
               calls: Dict[str, Tuple[tuple, dict, Any]], children: Dict[str, nn.Module],
               header: Dict[str, str], fp32_inputs: Sequence[str] = (),
               autocast_calls: Optional[Dict[str, Tuple[tuple, dict, Any]]] = None,
               why: Optional[str] = None, config: Optional[RewriteConfig] = None
               ) -> nn.Module:
    """The model with its own forward eager under autocast and its children rewritten.
    ``calls`` are the children's first calls (:func:`submodule_calls`), ``children`` the
    rewritten ones by name (those missing stay under autocast, ``rule="runtime"``);
    ``fp32_inputs``: the children planned for the FP32 model's inputs; ``autocast_calls``:
    the children's first calls with the model under ``torch.autocast`` (a child whose
    rewritten output has another dtype gets its output cast to autocast's:
    :func:`_output_casts`); ``why``: why no tracer took the model, for the plan
    (default: its forward is not traceable); ``config``: a top-level rewrite's config, kept
    on the result (an eager root takes no calibration: it is kept as given)."""
    why = why or "the model's forward is not traceable"
    result = copy.copy(model)
    result._modules = dict(model._modules)
    _warn_fp32_plans(model, [name for name in fp32_inputs if name in children],
                     autocast_calls or {}, pol)
    nested: Dict[str, Plan] = {}
    runtime: List[str] = [name for name in calls if name not in children]
    parts: Dict[str, Dict[str, Any]] = {}
    for name, sub in children.items():
        parts[name] = {"fp32": name in fp32_inputs, "planned": _planned_dtypes(calls.get(name)),
                       "recast": None}
        _call_as_planned(result, model, name, sub, parts[name])
        nested[name] = plan_of(sub)
    if not nested:
        raise FxampError(f"none of {type(model).__name__}'s children could be rewritten")
    result.__dict__[PARTS] = parts
    _eager_forward(result, model, pol)
    # the children's dtypes under the rewritten model, from one run on the example inputs
    outs = submodule_calls(result, list(calls), args, kwargs)
    recast: Dict[str, str] = {}
    for _ in range(len(nested)):  # (a child recast may change what the next ones get)
        found = _output_casts(result, nested, autocast_calls or {}, outs)
        if not found:
            break
        recast.update(found)
        outs = submodule_calls(result, list(calls), args, kwargs)
    nodes: Dict[str, NodePrecision] = {}
    for name in calls:
        value = first_float(outs.get(name, (None, None, None))[2])
        label = module_label(model.get_submodule(name))
        dtype = value.dtype if value is not None else torch.float32
        if name in nested:
            given = ("FP32 inputs" if name in fp32_inputs
                     else "the inputs it gets under the root's torch.autocast")
            first = first_float(calls[name][:2])
            inputs = torch.float32 if first is None or name in fp32_inputs else first.dtype
            nodes[name] = NodePrecision(dtype, Rule.NESTED, f"rewritten on its own ({why}), "
                                        f"planned for {given}; "
                                        f"its nodes are the plan lines {name}/*"
                                        + recast.get(name, ""), label, name, inputs)
            nodes.update(nested_lines({name: nested[name]}))
        else:
            nodes[name] = NodePrecision(dtype, Rule.RUNTIME, "not traceable: runs under "
                                        f"torch.autocast ({dtype_name(pol.compute)}) at run time",
                                        label, name)
    header = nested_header(dict(header, frontend="eager"), runtime, nested)
    if config is not None:  # (the top-level rewrite)
        header = top_header(model, pol, header, nodes)
    set_result(result, Rewritten(Plan(nodes=nodes, header=header), pol,
                                 module_label(model), config,
                                 mode=one_mode(children.values())))
    return result


class EagerFrontend:
    """eager (a fallback after the graph front ends): no graph of the model; its children's
    first calls on the example inputs, for the rewriter to rewrite each child on its own
    and assemble them with :func:`eager_root`."""

    name = "eager"
    fallback = True
    graph = False

    def capture(self, model: nn.Module, request: Request) -> Children:
        names = call_paths(model)
        calls = submodule_calls(model, names, request.args, request.kwargs)
        uncalled = [path for path in names if path not in calls]
        while uncalled:  # a forward that reaches past a child (PEFT calls base_model.model)
            deeper = [q for p in uncalled
                      for q in call_paths(model.get_submodule(p), f"{p}.")]
            found = submodule_calls(model, deeper, request.args, request.kwargs)
            calls.update(found)
            names += [q for q in deeper if q in found]
            uncalled = [q for q in deeper if q not in found]
        return Children(self.name, names, calls, None)

