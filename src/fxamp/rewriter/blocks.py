"""Blocks: an in-place rewrite without example inputs keeps the model's module tree.

``amp_rewrite(model, config=..., inplace=True)`` with no example inputs, on a model
that has blocks, rewrites each block in place (torchao's module swap, without the swap: the
block stays the same object of the same class, its ``forward`` computes with its own
rewritten graphs, planned on its first call from that call's real arguments, see
:class:`.inplace.InplaceForward`). The model's own ``forward`` (the glue between the blocks:
embeddings, masks, the final norm, the head, the loss) runs under ``torch.autocast`` of the
plan's dtype, so each of its ops gets autocast's dtype, and it calls the blocks as modules:
hooks on a block fire (FSDP2's per-block ``fully_shard``, checkpoint wrappers, regional
``torch.compile``, the user's, registered before or after the rewrite).

A block is an entry of a ``ModuleList`` or ``Sequential`` whose class (not one of
``torch.nn``'s) is repeated there, or a module whose class the model names in
``_no_split_modules`` (Hugging Face's decoder layers); the outermost ones. A block's graph
takes its inputs as the glue gives them (autocast's dtypes) and gives its outputs in the
dtypes its plan computes (``output=keep``), as autocast would.
"""
from __future__ import annotations

import copy
import inspect
import logging
from collections import Counter
from typing import Any, Dict, List, Optional

import torch
import torch.nn as nn

from ..config import RewriteConfig
from ..ir import Rule
from ..ops import module_label
from ..plan import NodePrecision, Plan
from ..errors import FxampError
from ..result import ATTR as RESULT, Pending, Rewritten, has_result, plan_of, result_of
from ..runtime import device_autocast, device_type
from ..frontends.common import in_output_dtype, nested_header, nested_lines
from .._version import __version__
from .inplace import ATTR, InplaceForward, Planner, install, register, take
from .stored import store_like

log = logging.getLogger(__name__)

_CONTAINERS = (nn.ModuleList, nn.Sequential)


def _own_class(module: nn.Module) -> bool:
    """A class of the model's code, not one of torch.nn's layers."""
    return not type(module).__module__.startswith("torch.")


def block_paths(model: nn.Module) -> List[str]:
    """The paths of ``model``'s blocks (see the module docstring), outermost first.

    Args:
        model: the model.
    """
    named = set(getattr(model, "_no_split_modules", None) or ())
    found: List[str] = []

    def walk(module: nn.Module, prefix: str) -> None:
        counts = (Counter(type(c) for c in module.children())
                  if isinstance(module, _CONTAINERS) else Counter())
        for name, child in module.named_children():
            path = f"{prefix}{name}"
            if type(child).__name__ in named or (
                    counts[type(child)] >= 2 and _own_class(child)
                    and type(child).forward is not nn.Module.forward):
                found.append(path)
            else:
                walk(child, f"{path}.")

    walk(model, "")
    return found


class BlocksRoot:
    """The model's ``forward`` in block mode: its own code under ``torch.autocast`` (the
    plan's dtype, on the device of the call's inputs), calling the blocks as modules; the
    floating outputs in the policy's output dtype. Its plan (``plan_of(model)``) is
    composed from the blocks' plans after each call that planned a block."""

    def __init__(self, model: nn.Module, paths: List[str], config: RewriteConfig) -> None:
        self.model = model
        self.paths = paths
        self.config = config
        self.planned = 0  # blocks' plans made so far (counted by :meth:`planner`)
        self.composed = -1
        # (a block's share_key -> the first block planned with it and its graph)
        self.shared: Dict[tuple, tuple] = {}
        try:  # what inspect.signature(model.forward) tells a caller (HF Trainer reads it)
            self.__signature__ = inspect.signature(type(model).forward.__get__(model))
        except (TypeError, ValueError):
            pass

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__dict__.update(state)
        register(self.model)  # (a copy of a model in block mode)

    def planner(self, plan: Planner) -> Planner:
        """``plan`` for the blocks: a block identical to one planned already (same class,
        Parameter and buffer shapes and dtypes, mode, and call signature) gets a copy of
        that one's graphs bound to its own modules instead of a new trace; each plan made
        is counted (the composed plan is made anew after)."""

        def planned(block: nn.Module, args: tuple, kwargs: Dict[str, Any], config: Any,
                    why: Optional[str]) -> nn.Module:
            key = share_key(block, args, kwargs) if why is None else None
            known = self.shared.get(key) if key is not None else None
            gm = None
            if known is not None:
                try:
                    if config.policy.weights == "stored":  # (its graphs read stored weights)
                        store_like(known[0], block)
                    gm = bound_to(known[1], known[0], block)
                except FxampError as err:  # (an eager-front-end result: no copy)
                    log.info("%s: planned on its own: %s", type(block).__name__, err)
            if gm is None:
                gm = plan(block, args, kwargs, config, why)
                if key is not None and key not in self.shared:
                    self.shared[key] = (block, gm)
            self.planned += 1
            return gm

        return planned

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        model, policy = self.model, self.config.policy
        with device_autocast(device_type((args, kwargs)), policy.compute):
            out = type(model).forward(model, *args, **kwargs)
        if self.composed != self.planned:
            self.compose()
        return in_output_dtype(out, policy.output_dtype)

    def compose(self) -> None:
        """The model's plan from its blocks' plans: one line per block, and the nodes of
        each distinct plan once, under the first block that has it (the others' lines name
        it)."""
        model = self.model
        config = self.config.for_model(model)  # (no target given: the device it ran on)
        policy = config.policy
        nodes: Dict[str, NodePrecision] = {}
        first: Dict[str, str] = {}  # a plan's lines (repr) -> the first block path with it
        nested: Dict[str, Plan] = {}
        for path in self.paths:
            block = model.get_submodule(path)
            gm = block.__dict__.get(ATTR)
            if gm is None or not has_result(gm):
                continue
            plan = plan_of(gm)
            text = repr(list(plan.nodes.items()))  # (identical blocks: identical lines)
            label = module_label(block)
            out = next(reversed(plan.nodes.values()), None)
            dtype = out.dtype if out is not None else torch.float32
            if text in first:
                nodes[path] = NodePrecision(
                    dtype, Rule.NESTED, f"a block, called as a module: the same plan as "
                    f"{first[text]} (its lines {first[text]}/*)", label, path)
                continue
            first[text] = path
            nested[path] = plan
            nodes[path] = NodePrecision(
                dtype, Rule.NESTED, f"a block, called as a module and planned on its first "
                f"call; its nodes are the plan lines {path}/*", label, path)
            nodes.update(nested_lines({path: plan}))
        header = nested_header({"fxamp": __version__,
                                "torch": torch.__version__.split("+")[0],
                                "policy": str(policy), "frontend": "blocks",
                                "glue": "the model's own forward under torch.autocast"},
                               (), nested)
        result = Rewritten(Plan(nodes=nodes, header=header), policy, module_label(model),
                           config)
        model.__dict__[RESULT] = result
        self.composed = self.planned


def _signature(value: Any) -> Any:
    """What a block's trace depends on in one argument: a tensor's class, dtype, rank and
    device type; a Python scalar's value; a container's items'."""
    if isinstance(value, torch.Tensor):
        return (type(value), value.dtype, value.dim(), value.device.type, value.requires_grad)
    if isinstance(value, (bool, int, float, str, type(None))):
        return (type(value), value)
    if isinstance(value, (tuple, list)):
        return (type(value), tuple(map(_signature, value)))
    if isinstance(value, dict):
        return (type(value), tuple((k, _signature(v)) for k, v in value.items()))
    return (type(value), id(value))  # (any other object: only the same one is alike)


#: plain values a module holds that a trace may bake into its graph
_PLAIN = (bool, int, float, str, type(None), torch.dtype)
#: the attribute HF decoder layers hold their index in: it is read only to index a KV cache
#: (``past_key_values.update(k, v, self.layer_idx)``), so a call without one does not read it
_CACHE_INDEX = "layer_idx"


def _plain(value: Any) -> bool:
    """A Python value a trace may bake in: a scalar, a dtype, or a tuple/list of them."""
    if isinstance(value, (tuple, list)):
        return all(_plain(v) for v in value)
    return isinstance(value, _PLAIN)


def _settings(block: nn.Module, cache: bool) -> tuple:
    """Every plain attribute of the block's modules (a drop-path rate, a window shift, a
    flag): the values its code may read and a trace bakes in. Blocks whose settings differ
    (timm's and torchvision's stochastic depth rising with depth, Swin's shifted windows
    every other block) do not share a plan. ``cache``: the call passes an object (a KV
    cache), so HF's ``layer_idx`` counts too."""
    return tuple((path, name, tuple(value) if isinstance(value, list) else value)
                 for path, m in block.named_modules(remove_duplicate=False)
                 for name, value in vars(m).items()
                 if not name.startswith("_") and name != "training" and _plain(value)
                 and (cache or name != _CACHE_INDEX))


def _has_object(value: Any) -> bool:
    """Whether an argument is or holds an object other than tensors and plain values."""
    if isinstance(value, (tuple, list)):
        return any(_has_object(v) for v in value)
    if isinstance(value, dict):
        return any(_has_object(v) for v in value.values())
    return not isinstance(value, (torch.Tensor, *_PLAIN))


def share_key(block: nn.Module, args: tuple, kwargs: Dict[str, Any]) -> tuple:
    """The key under which identical blocks share one plan: the block's class, each
    Parameter's and buffer's name, shape and dtype, the training flags, the modules' plain
    settings (:func:`_settings`) and the call's signature (:func:`_signature`).

    Args:
        block: the block called.
        args: the call's positional arguments.
        kwargs: the call's keyword arguments.
    """
    return (type(block),
            tuple((n, tuple(t.shape), t.dtype, t.requires_grad)
                  for n, t in block.named_parameters()),
            tuple((n, tuple(t.shape), t.dtype) for n, t in block.named_buffers()),
            tuple(m.training for m in block.modules()),
            _settings(block, _has_object((args, kwargs))),
            _signature(args), _signature(kwargs))


def bound_to(gm: nn.Module, source: nn.Module, block: nn.Module) -> nn.Module:
    """A copy of ``gm`` (a rewritten graph of ``source``) reading ``block``'s modules,
    Parameters and buffers at the same paths instead: the same plan, no new trace.

    Args:
        gm: the rewritten module of ``source``.
        source: the block it was planned for.
        block: an identical block (same :func:`share_key`).
    """
    memo: Dict[int, Any] = {}
    if has_result(gm):  # (the plan is frozen: the copies share it, and warn once for it)
        plan = result_of(gm).plan
        memo[id(plan)] = plan
    theirs = dict(block.named_modules(remove_duplicate=False))
    for path, mine in source.named_modules(remove_duplicate=False):
        other = theirs[path]
        memo[id(mine)] = other
        for kind in ("_parameters", "_buffers"):
            for name, value in getattr(mine, kind).items():
                if value is not None:
                    memo[id(value)] = getattr(other, kind)[name]
    return copy.deepcopy(gm, memo)


def install_blocks(model: nn.Module, paths: List[str], plan: Planner,
                   config: RewriteConfig) -> nn.Module:
    """Rewrite ``model``'s blocks in place, each planned on its first call, and make the
    model's forward a :class:`BlocksRoot`; returns ``model``.

    Args:
        model: the user's model.
        paths: its blocks (:func:`block_paths`).
        plan: what plans a block on a call (the pipeline's).
        config: the rewrite's config (a block's plan keeps its outputs' dtypes).
    """
    if "forward" in model.__dict__:
        raise FxampError(
            f"{type(model).__name__} has a forward of its own set on the instance "
            f"({model.__dict__['forward']!r}); inplace=True replaces it. what to do: "
            "rewrite with inplace=False and use the returned module")
    root = BlocksRoot(model, paths, config)
    inner = config.for_part()
    counted = root.planner(plan)
    for path in paths:
        block = model.get_submodule(path)
        if isinstance(block.__dict__.get("forward"), InplaceForward):
            take(block)  # (its own rewrite, of this policy)
        install(block, None, counted, inner)
    model.__dict__["forward"] = root
    model.__dict__[RESULT] = Pending(config, type(model).__name__)
    register(model)
    log.info("%s: %d blocks (%s ...) rewritten in place, each planned on its first call; "
             "its own forward runs under torch.autocast", type(model).__name__, len(paths),
             paths[0])
    return model


def is_blocks(model: nn.Module) -> bool:
    """Whether ``model`` computes in block mode."""
    return isinstance(model.__dict__.get("forward"), BlocksRoot)


def uninstall_blocks(model: nn.Module) -> None:
    """Undo :func:`install_blocks`: the model and its blocks get their own forwards back."""
    root = model.__dict__.get("forward")
    if not isinstance(root, BlocksRoot):
        return
    for path in root.paths:
        block = model.get_submodule(path)
        if isinstance(block.__dict__.get("forward"), InplaceForward):
            take(block)
    for key in ("forward", RESULT):
        model.__dict__.pop(key, None)


def config_of_blocks(model: nn.Module) -> Optional[RewriteConfig]:
    """The config of a model in block mode (None: not in block mode)."""
    root = model.__dict__.get("forward")
    return root.config if isinstance(root, BlocksRoot) else None
