"""The rules annotate asks for each node during its fake run, in order; the first that
applies decides (:func:`decide`).

Each is a :class:`~fxamp.passes.rule.DecisionRule`; unlike the decision rules run after
annotate, ``decide`` also gets the node's input values (fake tensors), because autocast's
promote and fp32-unless-a-dtype lists depend on them.

1. :class:`GraphInputRule` — placeholders and get_attr (FP32 master weights) stay as they are;
2. :class:`UserOverrideRule` — a policy override (``fp32:encoder.*``) wins (rule "user");
3. :class:`FixedRule` — a decision an earlier rule recorded in the IR (``ir.fix``);
4. :class:`GuardsRule` — torch.export's input-shape check;
5. :class:`NestedRule` — a submodule rewritten on its own gets the inputs it was planned for
   (rule "nested");
6. :class:`RuntimeRule` — an opaque call runs under torch.autocast at run time;
7. :class:`AutocastRule` — autocast's op tables for the target (always applies: last); for a
   deployment target, :class:`~fxamp.passes.deploy.DeployRule` instead.
"""
from __future__ import annotations

from typing import Any, Optional, Tuple, Type

import torch
import torch.fx as fx
import torch.nn as nn
from .._torch import is_input_guard, tree_flatten

from .. import ir, ops
from ..ir import Decision, Rule
from ..result import has_result, result_of
from ..policy import Policy, dtype_name, is_deploy
from .. import overrides
from . import observe
from .manager import PassContext
from .annotate_rule import AnnotateRule
from .deploy import DeployRule, RecurrentRule


def module_path(node: fx.Node) -> str:
    """The module a node belongs to: its target for call_module, else the innermost module."""
    if node.op == "call_module":
        return str(node.target)
    if node.op == "get_attr":
        return str(node.target).rpartition(".")[0]
    stack = node.meta.get("nn_module_stack") or {}
    return next(reversed(stack.values()))[0] if stack else ""


class GraphInputRule(AnnotateRule):
    """Model inputs and FP32 master weights or buffers are left as they are."""

    name = Rule.AUTOCAST

    def applies(self, node: fx.Node) -> bool:
        return node.op in ("placeholder", "get_attr")

    def decision(self, node: fx.Node, args: tuple, kwargs: dict) -> Decision:
        if node.op == "placeholder":
            return Decision(None, self.name, "model input", "placeholder")
        return Decision(None, self.name, "FP32 master weight or buffer", "get_attr")


class UserOverrideRule(AnnotateRule):
    """A policy override matching the node's name, module path or op label."""

    name = Rule.USER

    def _override(self, node: fx.Node) -> Optional[Tuple[object, str]]:
        label = self.label(node)
        # "encoder.layer.0.*" covers the layer's own functional ops as well as its submodules
        scope = self.ctx.scope
        found = overrides.match(self.policy, scope, *overrides.node_names(
            node.name, module_path(node), label, scope))
        return None if found is None else (found, label)

    def applies(self, node: fx.Node) -> bool:
        return bool(self.policy.overrides) and self._override(node) is not None

    def decision(self, node: fx.Node, args: tuple, kwargs: dict) -> Decision:
        found = self._override(node)
        assert found is not None
        override, label = found
        return Decision(override.dtype, self.name,  # type: ignore[attr-defined]
                        f"policy override {override}", label)


class FixedRule(AnnotateRule):
    """A decision a rule recorded in the IR: numerics, ranges, placement, search, hooks."""

    name = Rule.AUTOCAST  # (the recorded decision carries its own rule)

    def applies(self, node: fx.Node) -> bool:
        return ir.fixed(node) is not None

    def decision(self, node: fx.Node, args: tuple, kwargs: dict) -> Decision:
        fixed = ir.fixed(node)
        assert fixed is not None
        return Decision(fixed.inputs, fixed.rule, fixed.reason, self.label(node), fixed.runtime)


class GuardsRule(AnnotateRule):
    """torch.export's check of the input shapes computes nothing."""

    name = Rule.AUTOCAST

    def applies(self, node: fx.Node) -> bool:
        return is_input_guard(node)

    def decision(self, node: fx.Node, args: tuple, kwargs: dict) -> Decision:
        return Decision(None, self.name, "torch.export's check of the input shapes",
                        self.label(node))


class NestedRule(AnnotateRule):
    """A submodule rewritten on its own gets the inputs it was planned for: FP32 inputs when
    its call was recorded on the FP32 model; its inputs as they come, in autocast's dtypes,
    when this graph's inputs are low precision (a child of a rewritten model: its
    submodules' calls were recorded under torch.autocast, as they run)."""

    name = Rule.NESTED

    def applies(self, node: fx.Node) -> bool:
        return node.op == "call_module" and has_result(self.gm.get_submodule(node.target))

    def decision(self, node: fx.Node, args: tuple, kwargs: dict) -> Decision:
        source = result_of(self.gm.get_submodule(node.target)).source or self.label(node)
        what = "rewritten on its own (a submodule the whole-model trace could not take)"
        if _low_precision(self.ctx.inputs):
            return Decision(None, self.name, f"{what}, planned for the inputs it gets under "
                            f"torch.autocast; its nodes are the plan lines {node.target}/*",
                            source)
        return Decision(torch.float32, self.name, f"{what}, planned for FP32 inputs; its "
                        f"nodes are the plan lines {node.target}/*", source)


def _low_precision(values: Any) -> bool:
    """Whether any tensor among ``values``' leaves is float16 or bfloat16."""
    leaves, _ = tree_flatten(values)
    return any(isinstance(v, torch.Tensor) and v.dtype in (torch.float16, torch.bfloat16)
               for v in leaves)


class RuntimeRule(AnnotateRule):
    """An opaque call (a module or function fxamp cannot see into) runs under
    torch.autocast at run time."""

    name = Rule.RUNTIME

    def applies(self, node: fx.Node) -> bool:
        return ops.is_runtime(node, self.gm)

    def decision(self, node: fx.Node, args: tuple, kwargs: dict) -> Decision:
        return Decision(None, self.name, "opaque call: torch.autocast decides inside it at "
                        "run time", self.label(node), runtime=True)


class AutocastRule(AnnotateRule):
    """torch.autocast's op tables for the target: lower precision, fp32, fp32 unless a
    dtype is given, promote to the widest input, banned; on no list: follows its inputs."""

    name = Rule.AUTOCAST

    def applies(self, node: fx.Node) -> bool:
        return True

    def decision(self, node: fx.Node, args: tuple, kwargs: dict) -> Decision:
        target, low = self.policy.target, self.policy.compute
        category, op, label = ops.autocast_entry(node, self.gm, target)
        if category == ops.LOWER:
            return Decision(low, self.name,
                            f"{op} is on autocast's lower-precision list for {target}", label)
        if category == ops.FP32:
            return Decision(torch.float32, self.name,
                            f"{op} is on autocast's fp32 list for {target}", label)
        if category == ops.FP32_OPT:
            explicit = kwargs.get("dtype") is not None or any(isinstance(a, torch.dtype)
                                                              for a in args[1:])
            if explicit:
                return Decision(None, self.name, f"{op} runs in the dtype it is given", label)
            return Decision(torch.float32, self.name,
                            f"{op} runs in fp32 under autocast for {target} (no dtype given)",
                            label)
        if category == ops.PROMOTE:
            leaves, _ = tree_flatten((args, kwargs))
            dtypes = [v.dtype for v in leaves
                      if isinstance(v, torch.Tensor) and v.is_floating_point()]
            if node.op == "call_module":
                dtypes += [p.dtype for p in self.gm.get_submodule(node.target).parameters()
                           if p.is_floating_point()]
            widest = observe.widest(dtypes)
            return Decision(widest, self.name, f"{op} runs in the widest dtype of its inputs "
                            f"({dtype_name(widest)}) under autocast for {target}", label)
        if category == ops.BANNED:
            return Decision(None, Rule.BANNED, f"{op} is unsafe in {dtype_name(low)} and "
                            "torch.autocast refuses it", label)
        return Decision(None, self.name, "on no autocast list: follows its inputs", label)


#: in order: the first rule that applies decides
ANNOTATE_RULES: Tuple[Type[AnnotateRule], ...] = (
    GraphInputRule, UserOverrideRule, FixedRule, GuardsRule, NestedRule, RuntimeRule,
    AutocastRule)


def make_rules(root: nn.Module, policy: Policy, scope: Optional[overrides.Scope] = None,
               inputs: tuple = ()) -> Tuple[AnnotateRule, ...]:
    """The annotate rules for one graph module and policy: for a deployment target
    (``target="tensorrt"``) :class:`~fxamp.passes.deploy.DeployRule` decides last instead of
    autocast's tables. ``scope``: the rewrite's override record; ``inputs``: the graph's
    input values (real or fake)."""
    ctx = PassContext(policy, inputs, scope=scope)
    classes = ANNOTATE_RULES
    if is_deploy(policy.target):
        at = classes.index(RuntimeRule)  # an RNN module is no opaque call in a deployment
        classes = classes[:at] + (RecurrentRule,) + classes[at:-1] + (DeployRule,)
    return tuple(cls(root, ctx) for cls in classes)  # type: ignore[arg-type]


def decide(node: fx.Node, rules: Tuple[AnnotateRule, ...], args: tuple, kwargs: dict
           ) -> Decision:
    """What autocast (or the policy, or an earlier rule) does with ``node`` given its input
    values: the decision of the first rule that applies."""
    for rule in rules:
        if rule.applies(node):
            return rule.decision(node, args, kwargs)
    raise AssertionError("the last rule (AutocastRule or DeployRule) applies to every node")
