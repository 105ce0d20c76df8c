"""Blocks: an in-place rewrite without example inputs keeps the model's module tree.

``amp_rewrite(model, config=..., inplace=True)`` with no example inputs, on a model
that has blocks, rewrites each block in place (torchao's module swap, without the swap: the
block stays the same object of the same class, its ``forward`` computes with its own
rewritten graphs, planned on its first call from that call's real arguments, see
:class:`.inplace.InplaceForward`). The model's own ``forward`` (the glue between the blocks:
embeddings, masks, the final norm, the head, the loss) is planned as a region too where
torch.fx traces it (:mod:`.glue`), else it runs under ``torch.autocast`` of the plan's
dtype, so each of its ops gets autocast's dtype; either way it calls the blocks as modules:
hooks on a block fire (FSDP2's per-block ``fully_shard``, checkpoint wrappers, regional
``torch.compile``, the user's, registered before or after the rewrite).

A block is an entry of a ``ModuleList`` or ``Sequential`` whose class (not one of
``torch.nn``'s) is repeated there, or a module whose class the model names in
``_no_split_modules`` (Hugging Face's decoder layers); the outermost ones. A block's graph
takes its inputs as the glue gives them (autocast's dtypes) and gives its outputs in the
dtypes its plan computes (``output=keep``), as autocast would.
"""
from __future__ import annotations

import ast
import dataclasses
import enum
import fnmatch
import functools
import inspect
import logging
import sys
import textwrap
import types
import weakref
from collections import Counter
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch
import torch.nn as nn

from ..config import RewriteConfig
from ..ir import Rule
from ..ops import module_label
from ..plan import NOT_PLANNED, PLANNED_KEY, NodePrecision, Plan
from ..errors import FxampError, PolicyError
from ..result import RESULT, Pending, Rewritten, has_result, plan_of, result_of, set_result
from ..runtime import CALL_HOOK_DICTS, CALL_HOOKS, device_autocast, device_type
from ..frontends.common import in_output_dtype, nested_header, nested_lines
from ..frontends.aten_inputs import takes
from ..frontends.eager import PARTS, bound_copy, is_eager_root
from .._version import __version__
from .glue import Glue, output_dtypes
from .inplace import (INPLACE_GRAPH, InplaceForward, Planner, check_own_forward, install, register,
                      take)
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
    """The model's ``forward`` in block mode: its glue (:class:`.glue.Glue`: its own code
    as a planned graph, or under ``torch.autocast`` of the plan's dtype), calling the
    blocks as modules; the floating outputs in the policy's output dtype. Its plan
    (``plan_of(model)``) is composed from the glue's and the blocks' plans after each call
    that planned one; before the first call ``plan_of`` gives its skeleton
    (:meth:`skeleton`)."""

    def __init__(self, model: nn.Module, paths: List[str], config: RewriteConfig,
                 plan: Planner) -> None:
        self.model = model
        self.paths = paths
        self.config = config
        self.planned = 0  # blocks' plans made so far (counted by :meth:`planner`)
        self.composed: Any = None  # (the :meth:`_state` the composed plan was made at)
        self.glue = Glue(model, paths, config, plan)  # (the model's own forward)
        # (each block's container, its name there and the block installed: a block replaced
        # since is seen on the next call, in a few dict lookups)
        self.slots: List[Tuple[nn.Module, str, nn.Module]] = []
        self.planner_of: Optional[Planner] = None  # (what installs a replacement)
        # (a block's share_key -> the first block planned with it and its graph)
        self.shared: Dict[tuple, tuple] = {}
        # (a block path -> the first block with the same plan, as the composed plan says)
        self.shares: Dict[str, str] = {}
        try:  # what inspect.signature(model.forward) tells a caller (HF Trainer reads it)
            self.__signature__ = inspect.signature(type(model).forward.__get__(model))
        except (TypeError, ValueError):
            pass

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__dict__.update(state)
        register(self.model)  # (a copy of a model in block mode)

    def __getstate__(self) -> Dict[str, Any]:
        state = dict(self.__dict__)
        state["shared"] = {}  # (its keys hold the blocks' objects: a copy shares anew)
        return state

    def planner(self, plan: Planner) -> "SharedPlanner":
        """``plan`` for the blocks (:class:`SharedPlanner`)."""
        return SharedPlanner(self, plan)

    def install(self, plan: Planner) -> None:
        """Rewrite the blocks in place, each planned on its first call by ``plan`` with its
        own overrides (:func:`block_overrides`)."""
        self.planner_of = plan
        inner = self.config.for_part()
        named = named_glue_parts(self.model, self.paths, inner.policy.overrides)
        if self.config.partition == "auto" and self.glue.traced() is not None:
            named += [p for p in own_glue_parts(self.model, self.paths) if p not in named]
        if named and self.glue.traced() is not None:  # (under autocast: they are regions)
            order = {path: i for i, (path, _) in enumerate(self.model.named_modules())}
            self.paths = self.glue.paths = sorted(self.paths + named, key=order.__getitem__)
            log.info("%s: the glue runs under torch.autocast, and its modules %s are regions "
                     "of their own", type(self.model).__name__, ", ".join(named))
        routed, self.glue.overrides, self.glue.elsewhere, loose = block_overrides(
            self.model, self.paths, inner.policy.overrides, self.glue.traced)
        self.slots = []
        for path in self.paths:
            parent, _, name = path.rpartition(".")
            container = self.model.get_submodule(parent)
            block = container._modules[name]
            if not isinstance(block.__dict__.get("forward"), InplaceForward) or \
                    block.__dict__["forward"].plan is not plan:
                if isinstance(block.__dict__.get("forward"), InplaceForward):
                    take(block)  # (its own rewrite, of this policy)
                mine = inner.replace(policy=dataclasses.replace(
                    inner.policy, overrides=tuple(routed[path])),
                    elsewhere=self.glue.elsewhere + loose)
                install(block, None, plan, mine)
                block.__dict__["forward"].enclosing = self.model  # (unregistered_parameters)
            note = block.__dict__.get(NOTE)
            if not (isinstance(note, BlockState) and note.root is self and note.path == path):
                block.__dict__[NOTE] = BlockState(self, path, block, _own_note(block))
            self.slots.append((container, name, block))
        if not self.__dict__.get("noted_shared"):
            self.noted_shared = True
            _note_shared_modules(self.model, self.paths)

    def _replaced(self) -> None:
        """Blocks replaced since the last call (``model.blocks[1] = Block(...)``): the
        new ones are rewritten, each planned on its next call, the old ones get their own
        forward back, and the plan is composed anew (it says which are not planned yet)."""
        old = [block for _, _, block in self.slots]
        assert self.planner_of is not None
        self.install(self.planner_of)
        now = {id(block) for _, _, block in self.slots}
        for block in old:
            if id(block) not in now and isinstance(block.__dict__.get("forward"),
                                                   InplaceForward):
                take(block)
                drop_note(block)
        log.warning("%s: a block was replaced since its last call; the new one is planned "
                    "on its first call", type(self.model).__name__)
        self.glue.reset()
        self.composed = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        for container, name, block in self.slots:
            if container._modules.get(name) is not block:
                self._replaced()
                break
        out = self.glue(args, kwargs, self._autocast)
        if self.composed != self._state():
            self.compose()
        return in_output_dtype(out, self.config.policy.output_dtype)

    def _autocast(self, args: tuple, kwargs: Dict[str, Any]) -> Any:
        """The model's own forward on this call under ``torch.autocast`` of the plan's
        dtype (the glue where fx does not take it)."""
        model = self.model
        with device_autocast(device_type((args, kwargs)), self.config.policy.compute):
            return type(model).forward(model, *args, **kwargs)

    def _state(self) -> tuple:
        """What the composed plan is made from: the blocks' plans made so far and the
        glue's first graph."""
        return (self.planned, id(self.glue.first))

    def compose(self) -> None:
        """The model's plan from its blocks' plans (:meth:`blocks_plan`), stored as its
        result; PolicyError where an override given to several regions (an op label)
        matches no node of any region planned (each call raises it again until one
        does: the plan is not composed)."""
        self._check_anywhere()
        plan, self.shares = self.blocks_plan()
        config = self.config.for_model(self.model)
        self.model.__dict__[RESULT] = Rewritten(plan, config.policy,
                                                module_label(self.model), config)
        self.composed = self._state()

    def _check_anywhere(self) -> None:
        """The overrides given to every region (:func:`block_overrides`) each match a node
        of some region's plan, as one of the flat plan would."""
        anywhere = self.glue.elsewhere
        if not anywhere:
            return
        policy = self.config.policy
        graphs = [(f"{p}.", self.model.get_submodule(p).__dict__.get(INPLACE_GRAPH))
                  for p in self.paths]
        graphs.append(("", self.glue.first))
        matched = set()
        for prefix, gm in graphs:  # (a region's lines name its modules by their paths there)
            if gm is None or not has_result(gm):
                continue
            for name, line in plan_of(gm).nodes.items():
                module = (prefix + line.module if line.module else prefix[:-1])
                matched.update(policy.overrides_matching(name, module,
                                                         module + "." if module else "",
                                                         line.op))
        missing = [o for o in anywhere if o not in matched]
        if missing:
            glue = ("" if self.glue.off is None and self.glue.first is not None else
                    f" (its own forward between the blocks runs under torch.autocast: "
                    f"{self.glue.header()})")
            raise PolicyError(
                "; ".join(f"policy override '{o}'" for o in missing) + " matches no node "
                f"of {type(self.model).__name__}'s blocks or glue{glue}\n  what to do: "
                "write a pattern that matches a node name, module path or op label of the "
                "plan (see fxamp.plan_of(model) after a call), or drop the override")

    def skeleton(self) -> Plan:
        """The model's plan before its first call (``plan_of`` returns it then): the header
        with ``planned: no`` and one line per block, not planned yet (a block planned
        by a first call that failed lists its lines)."""
        plan, _ = self.blocks_plan()
        plan.header[PLANNED_KEY] = NOT_PLANNED
        return plan

    def blocks_plan(self) -> Tuple[Plan, Dict[str, str]]:
        """The plan composed from the blocks' plans: one line per block, and the nodes of
        each distinct plan once, under the first block that has it (the others' lines name
        it); and each block path whose plan is another's -> that block's path.

        Returns:
            The plan and the shares.
        """
        model = self.model
        config = self.config.for_model(model)  # (no target given: the device it ran on)
        policy = config.policy
        lines: Dict[str, Dict[str, NodePrecision]] = {}  # (each block's, by its path)
        first: Dict[str, str] = {}  # a plan's lines (repr) -> the first block path with it
        shares: Dict[str, str] = {}
        nested: Dict[str, Plan] = {}
        outputs: Dict[str, Any] = {}  # (each planned region's output dtypes)
        # (after a call of the model, a region still not planned is one its calls skip:
        # T5's `shared` embedding, whose weight the stacks' own embeddings share)
        unused = ("; the model's calls so far did not call it"
                  if self.planned or self.glue.first is not None else "")
        for path in self.paths:
            block = model.get_submodule(path)
            gm = block.__dict__.get(INPLACE_GRAPH)
            nodes = lines[path] = {}
            if gm is None or not has_result(gm):  # (not called yet: replaced, or unused)
                nodes[path] = NodePrecision(
                    torch.float32, Rule.NESTED, "not planned yet: planned on its first call "
                    f"(a region, called as a module){unused}", module_label(block), path)
                continue
            plan = plan_of(gm)
            outputs[path] = output_dtypes(gm)
            text = repr(list(plan.nodes.items()))  # (identical blocks: identical lines)
            label = module_label(block)
            out = next(reversed(plan.nodes.values()), None)
            dtype = out.dtype if out is not None else torch.float32
            if text in first:
                # (fxamp.plan's diff reads this reason: "the same plan as P (its lines P/*)")
                nodes[path] = NodePrecision(
                    dtype, Rule.NESTED, f"a block, called as a module: the same plan as "
                    f"{first[text]} (its lines {first[text]}/*)", label, path)
                shares[path] = first[text]
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
                                "glue": self.glue.header()}, (), nested)
        return Plan(nodes=self.glue.lines(lines, outputs), header=header), shares


#: the block attribute that shows its state in ``print(model)`` (:class:`BlockState`)
NOTE = "extra_repr"


def _own_note(block: nn.Module) -> Optional[Callable[[], str]]:
    """An ``extra_repr`` the block held as an instance attribute before (None: its
    class's)."""
    note = block.__dict__.get(NOTE)
    if isinstance(note, BlockState):
        return note.inner
    return note


class BlockState:
    """A block's ``extra_repr`` in block mode, held as an instance attribute (the block
    keeps its class; ``nn.Module.__repr__`` calls ``self.extra_repr()``): the class's own
    text, then the block's state, ``fxamp: planned on its first call``, ``fxamp: planned``
    or ``fxamp: planned (shares model.layers.0's plan)``. Not part of the share key
    (:data:`_ROOT_SKIP`); an object, not a closure, so the model pickles.

    Args:
        root: the model's :class:`BlocksRoot`.
        path: the block's path in the model.
        block: the block.
        inner: an ``extra_repr`` the block held as an instance attribute before (None: its
            class's).
    """

    def __init__(self, root: BlocksRoot, path: str, block: nn.Module,
                 inner: Optional[Callable[[], str]] = None) -> None:
        self.root = root
        self.path = path
        self.block = block
        self.inner = inner

    def state(self) -> str:
        """The block's state: planned on its first call, planned, or sharing a plan."""
        gm = self.block.__dict__.get(INPLACE_GRAPH)
        if gm is None or not has_result(gm):
            return "fxamp: planned on its first call"
        first = getattr(self.root, "shares", {}).get(self.path)
        return f"fxamp: planned (shares {first}'s plan)" if first else "fxamp: planned"

    def __call__(self) -> str:
        """The block's ``extra_repr``: its own text, then its state (one line each)."""
        own = self.inner() if self.inner is not None else type(self.block).extra_repr(
            self.block)
        return f"{own}\n{self.state()}" if own else self.state()


def drop_note(module: nn.Module) -> None:
    """Take a block's :class:`BlockState` off (an ``extra_repr`` it held before back).

    Args:
        module: a block, or a module made from one (its rewritten module).
    """
    note = module.__dict__.get(NOTE)
    if isinstance(note, BlockState):
        if note.inner is not None:
            module.__dict__[NOTE] = note.inner
        else:
            del module.__dict__[NOTE]


def _note_shared_modules(model: nn.Module, paths: List[str]) -> None:
    """One warning naming the modules with Parameters that several blocks register (one
    module in each of them): each block's graph casts their weights on its own, so their
    gradients sum in FP32, where autocast's cast cache sums them in low precision."""
    owners: Dict[int, List[str]] = {}
    names: Dict[int, str] = {}
    for path in paths:
        for sub, module in model.get_submodule(path).named_modules():
            if next(module.parameters(recurse=False), None) is None:
                continue
            where = f"{path}.{sub}" if sub else path
            owners.setdefault(id(module), []).append(where)
            names.setdefault(id(module), type(module).__name__)
    shared = [(names[k], v) for k, v in owners.items() if len(v) > 1]
    if shared:
        log.warning(
            "%s: %s registered in several blocks (%s); each block's graph casts its weights "
            "on its own, so its gradients sum in FP32, where torch.autocast's cast cache "
            "sums them in low precision: those gradients may differ from autocast's by a "
            "rounding (docs/coverage.md, 'cast cache')", type(model).__name__,
            ", ".join(f"a {cls}" for cls, _ in shared[:3]),
            "; ".join(", ".join(where) for _, where in shared[:3]))


def glue_parts(model: nn.Module, blocks: List[str]) -> List[str]:
    """The glue's modules: the outermost modules of ``model`` outside its ``blocks`` and
    holding none, that hold Parameters or buffers (an embedding, a final norm, a head,
    rotary tables); containers without a forward of their own are looked into. Planned as
    regions of their own, they get plan lines, the numerics rules and overrides, while the
    model's own code between them (masks, reshapes, a loss) runs under ``torch.autocast``.

    Args:
        model: the model.
        blocks: its blocks' paths.
    """
    found: List[str] = []

    def walk(module: nn.Module, prefix: str) -> None:
        for name, child in module.named_children():
            path = f"{prefix}{name}"
            if path in blocks:
                continue
            if any(b.startswith(path + ".") for b in blocks) or \
                    type(child).forward is nn.Module.forward:
                walk(child, f"{path}.")
            elif next(child.parameters(), None) is not None or \
                    next(child.buffers(), None) is not None:
                found.append(path)

    walk(model, "")
    return found


def own_glue_parts(model: nn.Module, paths: List[str]) -> List[str]:
    """The glue's modules (:func:`glue_parts`) that the default partition makes regions
    where the glue runs under ``torch.autocast``, so the plan has lines for a Hugging Face
    model's embeddings, final norm and head: each module once (one module may be reached by
    several paths), and none a region calls too (a module held inside a block as
    well: each region would cast its weight on its own, where autocast's cast cache casts it
    once for the whole forward).

    Args:
        model: the model in block mode.
        paths: its regions.
    """
    inner = {id(m) for p in paths for m in model.get_submodule(p).modules()}
    seen: set = set()
    found: List[str] = []
    for path in glue_parts(model, paths):
        module = model.get_submodule(path)
        if id(module) not in seen and id(module) not in inner:
            seen.add(id(module))
            found.append(path)
    return found


def named_glue_parts(model: nn.Module, paths: List[str], overrides: Any) -> List[str]:
    """The modules of the glue that the ``overrides`` name by their absolute paths
    (``fp32:lm_head``, ``fp32:model.norm``, ``fp32:transformer.drop``), outside every
    region: where the glue runs under ``torch.autocast``, each becomes a region of its own,
    so the override takes its plan lines (:meth:`BlocksRoot.install`). Each is the glue's
    module with weights holding the one named (:func:`glue_parts`), else the outermost one
    named. An override naming a module that holds a region (``fp32:model``) names none.

    Args:
        model: the model in block mode.
        paths: its regions.
        overrides: the policy's overrides.
    """
    parts = glue_parts(model, paths)
    modules = [name for name, _ in model.named_modules() if name]
    found: List[str] = []
    for override in overrides:
        owner, absolute, relative = _named_by(model, paths, modules, override.pattern)
        named = _outside(model, paths, absolute)
        if owner is not None or relative or not named or any(
                p.startswith(m + ".") for m in named for p in paths):
            continue
        held = [next((p for p in parts if m == p or m.startswith(p + ".")), m) for m in named]
        found.extend(m for m in held if m not in found and not any(
            m.startswith(o + ".") for o in held))
    return found


def _named_by(model: nn.Module, paths: List[str], modules: List[str], pattern: str
              ) -> Tuple[Optional[str], List[str], bool]:
    """What an override's ``pattern`` names in block mode: the region whose path it spells
    or starts with (None: none), else the ``modules`` it matches by absolute path, and
    whether it matches a module's path inside a region (relative to it)."""
    owner = next((p for p in paths if pattern == p or pattern.startswith(p + ".")), None)
    if owner is not None:
        return owner, [], False
    return None, [m for m in modules if fnmatch.fnmatchcase(m, pattern)], any(
        fnmatch.fnmatchcase(rel, pattern) for p in paths
        for rel, _ in model.get_submodule(p).named_modules() if rel)


def _outside(model: nn.Module, paths: List[str], modules: List[str]) -> List[str]:
    """Those of ``modules`` outside every region, but the containers of regions that run no
    code of their own (an ``nn.ModuleList`` of blocks)."""
    return [m for m in modules if m not in paths and not any(m.startswith(p + ".")
                                                             for p in paths)
            and not (any(p.startswith(m + ".") for p in paths)
                     and type(model.get_submodule(m)).forward is nn.Module.forward)]


def block_overrides(model: nn.Module, paths: List[str], overrides: Any,
                    glue: Callable[[], Optional[str]]
                    ) -> Tuple[Dict[str, list], list, Tuple[Any, ...], Tuple[Any, ...]]:
    """Each region's overrides in block mode, where each region is planned on its own: an
    override naming a module inside one region by its absolute path
    (``fp32:model.layers.1.mlp.*``, ``fp32:lm_head``) goes to that region alone, made
    relative to it (``fp32:mlp.*``); one naming modules by absolute paths in several
    (``fp32:model.norm*``) to each of them, as the paths there of the modules it names; one
    naming modules inside the blocks by their path there (``fp32:mlp.down_proj``) to every
    block (the repeated ones; the glue's modules, regions too, take only their own paths').
    One naming modules outside every region goes to the glue (the model's own forward,
    :mod:`.glue`) where torch.fx traces it; else it is refused now, not on every call
    (where it names the glue's modules with weights, :meth:`BlocksRoot.install` has made them
    regions first: :func:`named_glue_parts`). One naming no module (an op label,
    ``fp32:nn.LayerNorm``; a node name) goes to every region and to the glue where fx
    traces it, as the flat plan applies it to every node it matches: it may match in some of them
    only (the composed plan checks that it matches somewhere, :meth:`BlocksRoot.compose`).

    Args:
        model: the model in block mode.
        paths: its blocks.
        overrides: the policy's overrides.
        glue: says why torch.fx cannot trace the glue (None: it can); asked once, for an
            override outside every region.

    Returns:
        The overrides of each region, by path; the glue's; those that several regions may
        match (a name no module has, a pattern naming modules in several), each checked on
        the composed plan; and the regions' forms of the latter, which a region may not
        match.

    Raises:
        PolicyError: an override that names only modules outside the blocks, where the
            glue runs under torch.autocast.
    """
    routed: Dict[str, list] = {path: [] for path in paths}
    glued: list = []
    anywhere: list = []
    loose: list = []
    modules = [name for name, _ in model.named_modules() if name]
    repeated = set(block_paths(model))
    blocks = [p for p in paths if p in repeated] or paths
    for override in overrides:
        pattern = override.pattern
        owner, absolute, relative = _named_by(model, paths, modules, pattern)
        if owner is not None:
            rest = pattern[len(owner) + 1:] or "*"
            routed[owner].append(dataclasses.replace(override, pattern=rest))
            continue
        inside = [m for m in absolute if any(m == p or m.startswith(p + ".") for p in paths)]
        if not absolute and not relative:  # (an op label or a node name: every region)
            anywhere.append(override)
            for path in paths:
                routed[path].append(override)
            if glue() is None:
                glued.append(override)
            continue
        outside = _outside(model, paths, absolute)
        if absolute and not relative:  # (by absolute paths: each region it names them in,
            exact = absolute == [pattern]  # as its own paths there; the glue, those outside)
            for m in inside:
                if any(m.startswith(o + ".") for o in inside):
                    continue  # (inside another one it names)
                owner = next(p for p in paths if m == p or m.startswith(p + "."))
                mine = dataclasses.replace(override, pattern=m[len(owner) + 1:] or "*")
                routed[owner].append(mine)
                if not exact:  # (a module it names may run no node: checked as a whole)
                    loose.append(mine)
            if not exact:
                anywhere.append(override)
            why = glue() if outside else None
            if why is None:
                if outside:
                    glued.append(override)
                continue
            raise PolicyError(
                f"policy override '{override}' names {', '.join(outside[:3])}, outside "
                f"every region of the model in block mode ({paths[0]} ...): the model's own "
                f"code between its regions runs under torch.autocast ({why}), and a module "
                "holding regions is no region of its own, so no plan line can take its own "
                f"code. what to do: name the modules inside it ('{override}.*': each module "
                "of the glue named so is a region of its own); or drop the override")
        for path in blocks:
            routed[path].append(override)
    return routed, glued, tuple(anywhere), tuple(loose)


class SharedPlanner:
    """The blocks' planner: a block identical to one planned already (:func:`share_key`)
    gets a copy of that one's graphs bound to its own modules instead of a new trace; each
    plan made is counted (the composed plan is made anew after). An object, not a closure,
    so a model in block mode pickles (``torch.save``, a spawn worker). ``plan`` is the
    pipeline's, given the whole model (``enclosing``) too."""

    def __init__(self, root: BlocksRoot, plan: Callable[..., nn.Module]) -> None:
        self.root = root
        self.plan = plan

    def __call__(self, block: nn.Module, args: tuple, kwargs: Dict[str, Any], config: Any,
                 why: Optional[str]) -> nn.Module:
        shared = self.root.shared
        key = live = known = None  # (live, with a KV cache: an eager root's, read live)
        if why is None:  # (its own overrides; symbols grown on its calls)
            tail = (str(config.policy), str(config.dynamic_shapes))
            if _has_object((args, kwargs)):  # (looser: looked up first, once it holds)
                live = (share_key(block, args, kwargs, live_index=True), *tail, "live")
                known = shared.get(live)
            if known is None:
                key = (share_key(block, args, kwargs), *tail)
                known = shared.get(key)
        gm = None
        if known is not None and not takes(known[1], args, kwargs):
            known = None  # (a size its graph fixed differs: planned on its own)
        if known is not None:
            try:
                if config.policy.weights == "stored":  # (its graphs read stored weights)
                    store_like(known[0], block)
                gm = bound_copy(known[1], known[0], block)
            except FxampError as err:  # (a result that refuses copies)
                log.info("%s: planned on its own: %s", type(block).__name__, err)
        if gm is None:
            gm = without_call_values(self.plan(block, args, kwargs, config, why,
                                               enclosing=self.root.model))
            if key is not None and key not in shared:
                shared[key] = (block, gm)
            if live is not None and live not in shared and _index_live(gm, block):
                shared[live] = (block, gm)
        if gm is not block:  # (an eager root is a copy of the block: the note is the block's)
            drop_note(gm)
        self.root.planned += 1
        return gm

    def forget(self, gm: nn.Module) -> None:
        """Share ``gm`` no more (its first call failed: the next identical block plans)."""
        shared = self.root.shared
        for key in [k for k, (_, known) in shared.items() if known is gm]:
            del shared[key]


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


#: plain values a call may pass (:func:`_has_object`: anything else is an object, a KV cache)
_PLAIN = (bool, int, float, str, type(None), torch.dtype)
#: the attribute HF decoder layers hold their index in: it is read only to index a KV cache
#: (``past_key_values.update(k, v, self.layer_idx)``), so a call without one does not read it
#: when the code of the block's modules reads it nowhere else (:func:`_reads_index`)
_CACHE_INDEX = "layer_idx"
#: the hook dicts whose hooks run when a module is called, and their per-hook flags (keyed by
#: the hooks' handle ids, which differ from block to block for the same hook)
_HOOKS = CALL_HOOKS
_HOOK_FLAGS = CALL_HOOK_DICTS[len(CALL_HOOKS):]
#: a module's entries the key reads otherwise (its Parameters, buffers, children, mode and
#: call hooks) or that no call reads (its state-dict hooks)
_SKIP = frozenset({"_parameters", "_buffers", "_modules", "training", "_state_dict_hooks",
                   "_state_dict_pre_hooks", "_load_state_dict_pre_hooks",
                   "_load_state_dict_post_hooks", *_HOOKS, *_HOOK_FLAGS})
#: the block's own entries that are none of its code's: fxamp's forward (its plan while
#: planned), result and state note (``extra_repr``, :class:`BlockState`), torch.compile's
#: call, FSDP2's state (``fully_shard`` per block). The
#: block is called as a module, so its own hooks run around its graph, never in it
_ROOT_SKIP = frozenset({"forward", INPLACE_GRAPH, RESULT, "_compiled_call_impl", NOTE})
_ROOT_PREFIXES = ("__composable_api_state_key",)
#: how deep a value's containers and dataclasses are compared by value (deeper: by identity)
_DEPTH = 4
#: the most elements a tensor held as a plain attribute is compared by value with
_SMALL = 1024
#: the marks of a use of ``layer_idx`` that only passes it to a cache (a call's or a
#: subscript's source text holds one: ``cache.update(k, v, self.layer_idx)``,
#: ``past_key_value.get_seq_length(self.layer_idx)``, ``layer_past.update(...)``,
#: ``cache.layers[self.layer_idx]``; or the call is an ``update``)
_CACHE_MARKS = ("cache", "past")


class _Same:
    """An object compared by identity in a share key (held, so that its id is not reused). A
    pickled or deep-copied key's is a new object alike to none: a copy of a model in block
    mode plans its blocks not planned yet on their own."""

    __slots__ = ("obj",)

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Same) and other.obj is self.obj

    def __hash__(self) -> int:
        return id(self.obj)

    def __reduce__(self) -> tuple:
        return (object, ())


def _tensor_key(value: torch.Tensor) -> tuple:
    """A tensor a module holds as a plain attribute (a trace bakes it in as a constant): its
    class, dtype, shape, device, and its bytes when small, else the tensor itself."""
    head = (type(value), value.dtype, tuple(value.shape), value.device, value.requires_grad)
    if value.numel() <= _SMALL:
        try:
            flat = value.detach().reshape(-1).contiguous().cpu()
            return (*head, flat.view(torch.uint8).numpy().tobytes())
        except Exception:  # (meta, fake, sharded, quantized: no bytes to read)
            pass
    return (*head, _Same(value))


def _value_key(value: Any, paths: Dict[int, str], depth: int = 0) -> Any:
    """What a trace may read of a value a module holds: scalars, strings, dtypes and devices
    by value; tuples, lists, dicts, sets, ``functools.partial`` objects and dataclasses by
    their items (to :data:`_DEPTH`);
    a small tensor by its bytes (:func:`_tensor_key`); a module or a bound method of the
    block's own by its path in the block (alike from block to block); a module outside the
    block without Parameters, buffers or children (``kernels``' per-layer ``Func``) by its
    class and attributes; Enum members, functions and any other object by identity (an
    object all blocks hold, HF's config, is alike).

    Args:
        value: the value.
        paths: the block's modules (id -> path).
        depth: how deep in containers ``value`` is.
    """
    if isinstance(value, enum.Enum):  # (before int and str: IntEnum, StrEnum)
        return _Same(value)
    if isinstance(value, float):  # (by repr: -0.0 is not 0.0)
        return (type(value), repr(value))
    if isinstance(value, (bool, int, str, bytes, type(None), torch.dtype, torch.device,
                          torch.layout, torch.memory_format)):
        return (type(value), value)
    if isinstance(value, torch.Tensor):
        return _tensor_key(value)
    if isinstance(value, nn.Module):
        if id(value) in paths:
            return ("module", paths[id(value)])
        if depth < _DEPTH and _stateless(value):  # (a per-block helper: kernels' Func)
            return (value.training, *_module_key(value, paths, depth + 1, lambda _: True))
        return _Same(value)  # (one with state outside the block: only the same one is alike)
    if isinstance(value, types.MethodType) and id(value.__self__) in paths:
        return ("method", _Same(value.__func__), paths[id(value.__self__)])
    if depth >= _DEPTH:
        return _Same(value)
    if isinstance(value, (tuple, list)):
        return (type(value), tuple(_value_key(v, paths, depth + 1) for v in value))
    if isinstance(value, dict):
        return (type(value), tuple((_value_key(k, paths, depth + 1),
                                    _value_key(v, paths, depth + 1)) for k, v in value.items()))
    if isinstance(value, (set, frozenset)):
        return (type(value), frozenset(_value_key(v, paths, depth + 1) for v in value))
    if isinstance(value, functools.partial):  # (HF's GELUTanh: one per module)
        return (type(value), _value_key(value.func, paths, depth + 1),
                _value_key(value.args, paths, depth + 1),
                _value_key(value.keywords, paths, depth + 1),
                _value_key(vars(value), paths, depth + 1))
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = (vars(value) if hasattr(value, "__dict__")
                  else {f.name: getattr(value, f.name) for f in dataclasses.fields(value)})
        return (type(value), _value_key(fields, paths, depth + 1))
    return _Same(value)


def _hooks_key(module: nn.Module) -> tuple:
    """The call hooks of a module in a block (they run only when it stays a call in the
    graph): each hook by identity, with its flags (with kwargs, always called)."""
    flags = [getattr(module, kind, None) or {} for kind in _HOOK_FLAGS]
    return tuple((kind, tuple((_Same(hook), tuple(handle in f for f in flags))
                              for handle, hook in hooks.items()))
                 for kind in _HOOKS if (hooks := getattr(module, kind, None)))


def _stateless(module: nn.Module) -> bool:
    """Whether a module holds no Parameter, buffer or child."""
    return not module._modules and all(
        v is None for kind in (module._parameters, module._buffers) for v in kind.values())


def _module_key(module: nn.Module, paths: Dict[int, str], depth: int,
                keep: Callable[[str], bool]) -> tuple:
    """A module's class and class ``forward``, the attributes it holds that ``keep`` keeps
    (:func:`_value_key`, an instance ``forward`` too) and its call hooks.

    Args:
        module: the module.
        paths: the block's modules (id -> path).
        depth: how deep in containers the module is.
        keep: whether an attribute's name counts.
    """
    held = tuple((name, _value_key(value, paths, depth)) for name, value in vars(module).items()
                 if name not in _SKIP and keep(name))
    return (type(module), _Same(type(module).forward), held, _hooks_key(module))


#: class -> whether its code reads ``layer_idx`` other than for a cache (see _reads_index)
_READS: "weakref.WeakKeyDictionary[type, bool]" = weakref.WeakKeyDictionary()
#: a module's name -> whether its functions (outside classes) read ``layer_idx`` so
_READS_IN_MODULE: Dict[str, bool] = {}
#: a module's name -> the syntax tree of its source
_TREES: Dict[str, ast.Module] = {}
#: the libraries whose classes' code never reads ``layer_idx`` (torch's, Python's own)
_LIBRARIES = frozenset({"torch", *sys.stdlib_module_names})


def _walk(tree: ast.AST, skip_init: bool) -> Iterator[ast.AST]:
    """The nodes of ``tree``, without the ``__init__`` methods' when ``skip_init``."""
    todo = [tree]
    while todo:
        node = todo.pop()
        if skip_init and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) \
                and node.name == "__init__":
            continue
        yield node
        todo.extend(ast.iter_child_nodes(node))


def _reads_in(tree: ast.AST, skip_init: bool) -> bool:
    """Whether code in ``tree`` reads an attribute ``layer_idx`` other than as an argument
    of a cache's call or an index into a cache (see :data:`_CACHE_MARKS`).

    Args:
        tree: a class's or a function's syntax tree.
        skip_init: leave out the ``__init__`` methods (they compute settings, held apart).
    """
    nodes = list(_walk(tree, skip_init))
    parents = {child: node for node in nodes for child in ast.iter_child_nodes(node)}
    for node in nodes:
        if isinstance(node, ast.Constant) and node.value == _CACHE_INDEX:
            return True  # (getattr(self, "layer_idx"), vars(self)["layer_idx"] ...)
        if not (isinstance(node, ast.Attribute) and node.attr == _CACHE_INDEX
                and isinstance(node.ctx, ast.Load)):
            continue
        parent = parents.get(node)
        if isinstance(parent, ast.Call) and node in (
                *parent.args, *(k.value for k in parent.keywords)):
            if isinstance(parent.func, ast.Attribute) and parent.func.attr == "update":
                continue
            user = parent.func
        elif isinstance(parent, ast.Subscript) and node is parent.slice:
            user = parent.value
        else:
            return True
        if not any(mark in ast.unparse(user).lower() for mark in _CACHE_MARKS):
            return True
    return False


def _module_tree(name: str) -> ast.Module:
    """The syntax tree of the source of the Python module ``name`` (parsed once)."""
    tree = _TREES.get(name)
    if tree is None:
        if len(_TREES) >= 8:  # (a model's classes come from a few modules)
            _TREES.clear()
        tree = _TREES[name] = ast.parse(inspect.getsource(sys.modules[name]))
    return tree


def _class_tree(cls: type) -> ast.AST:
    """The syntax tree of the class statement of ``cls``: found by its qualified name in its
    module's tree, else (a class made in a function, or under an ``if``) by
    ``inspect.getsource``."""
    node: Any = _module_tree(cls.__module__)
    for part in cls.__qualname__.split("."):
        node = next((n for n in reversed(node.body)
                     if isinstance(n, ast.ClassDef) and n.name == part), None)
        if node is None:
            return ast.parse(textwrap.dedent(inspect.getsource(cls)))
    return node


def _class_reads_index(cls: type) -> bool:
    """Whether the code of ``cls`` (its methods but ``__init__``, and the functions of its
    module outside classes: HF's ``eager_attention_forward(module, ...)``) reads
    ``layer_idx`` other than for a cache; True when its source cannot be read."""
    known = _READS.get(cls)
    if known is not None:
        return known
    try:
        name = cls.__module__
        if name not in _READS_IN_MODULE:
            _READS_IN_MODULE[name] = any(
                _reads_in(node, False) for node in _module_tree(name).body
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)))
        reads = _READS_IN_MODULE[name] or _reads_in(_class_tree(cls), True)
    except (OSError, TypeError, SyntaxError, KeyError) as err:
        log.debug("%s: its source cannot be read (%s): layer_idx counts", cls.__name__, err)
        reads = True
    _READS[cls] = reads
    return reads


def _reads_index(block: nn.Module) -> bool:
    """Whether the code of the block's modules (their classes and base classes, but
    torch's and Python's) may read ``layer_idx`` other than to index a cache."""
    return any(_class_reads_index(cls) for cls in {
        c for m in block.modules() for c in type(m).__mro__
        if c.__module__.split(".")[0] not in _LIBRARIES})


def _settings(block: nn.Module, cache: bool) -> tuple:
    """What the code of the block's modules may read besides Parameters and buffers, for
    each module: its class and class ``forward``, and every attribute it holds (a drop-path
    rate, a window shift, a flag, an ``_underscore`` value, a function, a dict, a dataclass,
    an Enum member, a tensor, a config object, an instance ``forward``: see
    :func:`_value_key`), and the call hooks of the modules inside it. Blocks whose settings
    differ (timm's and torchvision's stochastic depth rising with depth, Swin's shifted
    windows every other block, an activation chosen per block) do not share a plan.

    Args:
        block: the block.
        cache: the call passes an object (a KV cache), so HF's ``layer_idx`` counts; without
            one it counts only when the modules' code reads it (:func:`_reads_index`).
    """
    index = cache or _reads_index(block)
    paths: Dict[int, str] = {}
    for path, m in block.named_modules(remove_duplicate=False):
        paths.setdefault(id(m), path)

    def own(name: str) -> bool:  # (an attribute of a module in the block that counts)
        return index or name != _CACHE_INDEX

    def root(name: str) -> bool:
        return own(name) and name not in _ROOT_SKIP and not name.startswith(_ROOT_PREFIXES)

    out = []
    for path, m in block.named_modules(remove_duplicate=False):
        key = _module_key(m, paths, 0, own if path else root)
        out.append((path, *(key if path else key[:-1])))  # (the block's own hooks: none)
    return tuple(out)


def _has_object(value: Any) -> bool:
    """Whether an argument is or holds an object other than tensors and plain values."""
    if isinstance(value, (tuple, list)):
        return any(_has_object(v) for v in value)
    if isinstance(value, dict):
        return any(_has_object(v) for v in value.values())
    return not isinstance(value, (torch.Tensor, *_PLAIN))


def without_call_values(gm: nn.Module) -> nn.Module:
    """``gm`` (a block's graph planned on a call) with its result's config holding none of
    the call's keyword values: a block is planned again from its calls, never from its
    config's, and the values (activations) would stay alive between steps, and be copied
    with the graph for a block that shares it (a tensor computed with grad refuses the
    copy: DeBERTa-v2's ``rel_embeddings``).

    Args:
        gm: the block's rewritten module.
    """
    done = result_of(gm) if has_result(gm) else None
    if done is not None and done.config is not None and done.config.example_kwargs:
        set_result(gm, done.replace(config=done.config.replace(example_kwargs=None)))
    return gm


def _index_live(gm: nn.Module, block: nn.Module) -> bool:
    """Whether ``gm`` is an eager root that reads HF's ``layer_idx`` only where its Python
    code runs on each call (its own forward, its eager children's): none of the graphs in
    it stands for a module of ``block`` (the one it was planned for) that holds one (a
    traced attention that indexed the KV cache with it). Blocks that differ only in
    ``layer_idx`` then share it, each copy reading its own block's
    (:func:`.eager.rebound`).

    Args:
        gm: a block's rewritten module.
        block: the block it was planned for.
    """
    if not is_eager_root(gm):
        return False
    for name in gm.__dict__[PARTS]:
        sub, original = gm.get_submodule(name), block.get_submodule(name)
        if is_eager_root(sub):
            if not _index_live(sub, original):
                return False
        elif any(_CACHE_INDEX in m.__dict__ for m in original.modules()):
            return False
    return True


def share_key(block: nn.Module, args: tuple, kwargs: Dict[str, Any],
              live_index: bool = False) -> tuple:
    """The key under which identical blocks share one plan: the block's class, each
    Parameter's and buffer's name, shape and dtype, the training flags, everything else the
    code of its modules may read (:func:`_settings`) and the call's signature
    (:func:`_signature`). A block computes with another's plan only when all of these are
    equal on it: the key errs towards planning a block on its own.

    Args:
        block: the block called.
        args: the call's positional arguments.
        kwargs: the call's keyword arguments.
        live_index: HF's ``layer_idx`` does not count even with a KV cache passed (for
            a plan that reads it live: :func:`_index_live`).
    """
    return (type(block),
            tuple((n, tuple(t.shape), t.dtype, t.requires_grad)
                  for n, t in block.named_parameters()),
            tuple((n, tuple(t.shape), t.dtype) for n, t in block.named_buffers()),
            tuple(m.training for m in block.modules()),
            _settings(block, _has_object((args, kwargs)) and not live_index),
            _signature(args), _signature(kwargs))



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
    check_own_forward(model)
    root = BlocksRoot(model, paths, config, plan)
    root.install(root.planner(plan))
    model.__dict__["forward"] = root
    model.__dict__[RESULT] = Pending(config, type(model).__name__, skeleton=root.skeleton)
    register(model)
    log.info("%s: %d blocks (%s ...) rewritten in place, each planned on its first call; "
             "its own forward runs under torch.autocast", type(model).__name__, len(paths),
             paths[0])
    return model


def uninstall_blocks(model: nn.Module) -> None:
    """Undo :func:`install_blocks`: the model and its blocks get their own forwards back."""
    root = model.__dict__.get("forward")
    if not isinstance(root, BlocksRoot):
        return
    for path in root.paths:
        block = model.get_submodule(path)
        if isinstance(block.__dict__.get("forward"), InplaceForward):
            take(block)
        drop_note(block)
    for key in ("forward", RESULT):
        model.__dict__.pop(key, None)
