"""Decision rules: the base class of fxamp's own rules and of the user's (``fxamp.DecisionRule``).

A decision rule is an object with ``applies(node)`` (a cheap filter) and ``decide(node)``
(the decisions it makes, ``{node: Decision}``; an empty dict decides nothing). It reads the
graph and the IR and writes neither, so it can be tested alone; a pass
(``fxamp.passes.rule``) records its decisions.

fxamp's own rules are made per graph (``Rule(gm, ctx)``) and named by a member of
``fxamp.ir.Rule``. A user's rule is an instance given in the config
(``RewriteConfig.make(rules=[...])``), named ``"user:WORD"``; the rewrite binds a copy of
it to each graph it plans (``DecisionRule.bind``) and runs it after fxamp's own decisions
(docs/rules.md).
"""
from __future__ import annotations

import copy
import itertools
from typing import Any, Dict, Iterable, List, Optional, Tuple, Union

import torch
import torch.fx as fx

from . import ir, ops
from .errors import RuleError
from .ir import Decision, Rule
from .plan_records import NodePrecision
from .policy import Policy, check_user_rule_name, is_user_rule

#: the dtypes a decision may cast a node's inputs to (None: left as they come)
DECISION_DTYPES = (None, torch.float32, torch.float16, torch.bfloat16)


class DecisionRule:
    """Base class of decision rules: subclass it, set ``name``, write ``applies`` and
    ``decide``.

    A user's rule is named ``"user:WORD"`` (the plan's rule column shows it) and given to
    ``amp_rewrite(model, inputs, RewriteConfig.make(rules=[MyRule()]))``. While it runs,
    ``self.gm`` is the graph module being planned and ``self.policy`` the rewrite's
    ``fxamp.Policy`` (``self.policy.compute``: the low dtype). ``reads``, ``label`` and
    ``precision`` read a node; ``verdict`` makes a decision.

    Args:
        gm: the graph module to decide for (fxamp's own rules are made per graph; a user's
            rule is made without it and bound by the rewrite).
        ctx: the rewrite's pass context (``fxamp.passes.manager.PassContext``).

    Attributes:
        name: the plan's rule column for what this rule decides: ``"user:WORD"`` for a
            user's rule, a member of ``fxamp.ir.Rule`` for fxamp's own.
        gm: the ``torch.fx.GraphModule`` being planned (None until bound).
        policy: the rewrite's policy (None until bound).
    """

    name: Union[Rule, str]

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        name = getattr(cls, "name", None)  # (an abstract base may have none yet)
        if name is not None and not isinstance(name, Rule):
            check_user_rule_name(name, f"{cls.__qualname__}.name", RuleError)

    def __init__(self, gm: Optional[fx.GraphModule] = None, ctx: Any = None) -> None:
        self.gm, self.ctx = gm, ctx
        self.policy: Optional[Policy] = None if ctx is None else ctx.policy

    def bind(self, gm: fx.GraphModule, ctx: Any) -> "DecisionRule":
        """A copy of this rule for one graph of one rewrite (the rule object given to
        ``amp_rewrite`` stays as it is).

        Args:
            gm: the graph module being planned.
            ctx: the rewrite's pass context.

        Returns:
            A shallow copy with ``gm``, ``ctx`` and ``policy`` set.
        """
        bound = copy.copy(self)
        bound.gm, bound.ctx, bound.policy = gm, ctx, ctx.policy
        return bound

    def applies(self, node: fx.Node) -> bool:
        """Whether the rule looks at ``node`` (cheap: no decision is made here).

        Args:
            node: an op node of ``self.gm`` (call_function, call_method or call_module).

        Returns:
            True to have ``decide`` called for it.
        """
        raise NotImplementedError

    def decide(self, node: fx.Node) -> Dict[fx.Node, Decision]:
        """The decisions for ``node`` (and the nodes it fences along with it).

        Args:
            node: a node ``applies`` said yes to.

        Returns:
            ``{node: self.verdict(dtype, reason)}`` for each node decided; ``{}`` for none.
        """
        raise NotImplementedError

    def verdict(self, inputs: Optional[torch.dtype], reason: str) -> Decision:
        """A decision of this rule.

        Args:
            inputs: the dtype the node's floating inputs are cast to (``torch.float32``
                keeps it in FP32; ``self.policy.compute`` in the low dtype), or None to
                leave them as they come.
            reason: one sentence the plan shows: why.

        Returns:
            The decision, named by this rule.
        """
        return Decision(inputs, self.name, reason)

    def reads(self, node: fx.Node) -> List[str]:
        """The dotted names of the parameters, buffers and constant tensors ``node`` reads
        directly: its ``get_attr`` inputs (``"block.out_scale"``), and for a module call
        the module's own (``"proj.weight"``). The same under the fx and torch.export front
        ends; paths are relative to the module being planned (a block planned on its own:
        the block).

        Args:
            node: a node of ``self.gm``.

        Returns:
            The names, in argument order.
        """
        names = [str(a.target) for a in node.all_input_nodes if a.op == "get_attr"]
        if node.op == "call_module" and self.gm is not None:
            module = self.gm.get_submodule(str(node.target))
            names += [f"{node.target}.{name}" for name, _ in
                      itertools.chain(module.named_parameters(), module.named_buffers())]
        return names

    def label(self, node: fx.Node) -> str:
        """The op label the plan shows for ``node`` (``F.linear``, ``mul``, ``nn.Linear``,
        ``aten.mm``).

        Args:
            node: a node of ``self.gm``.

        Returns:
            The label.
        """
        return ops.label(node, self.gm)

    def precision(self, node: fx.Node) -> Optional[NodePrecision]:
        """The node's plan line as planned so far (autocast's decision, or a rule's).

        Args:
            node: a node of ``self.gm``.

        Returns:
            Its ``fxamp.NodePrecision`` (``.dtype``, ``.rule``, ``.reason``), or None
            for a node without a floating output.
        """
        return ir.precision(node)


def checked_rules(rules: Union[None, DecisionRule, Iterable[DecisionRule]]
               ) -> Tuple[DecisionRule, ...]:
    """The user's rules as a tuple, each checked.

    Args:
        rules: None, one rule object, or an iterable of them (``amp_rewrite``'s ``rules=``).

    Returns:
        The rule objects, in order.

    Raises:
        RuleError: for an object that is no DecisionRule instance (a class is named as
            such), a name that is no ``user:WORD``, or a name given twice.
    """
    if rules is None:
        return ()
    items = [rules] if isinstance(rules, (DecisionRule, type)) else list(rules)
    seen: Dict[str, DecisionRule] = {}
    for rule in items:
        if isinstance(rule, type) and issubclass(rule, DecisionRule):
            raise RuleError(f"rules= got the class {rule.__qualname__}, not a rule object; "
                            f"what to do: pass an instance, rules=[{rule.__qualname__}()]")
        if not isinstance(rule, DecisionRule):
            raise RuleError(f"rules= got {rule!r} (a {type(rule).__name__}), which is not a "
                            "fxamp.DecisionRule; what to do: subclass fxamp.DecisionRule, "
                            "set name = 'user:WORD', write applies(node) and decide(node), "
                            "and pass an instance")
        label = f"rule {type(rule).__qualname__}"
        name = getattr(rule, "name", None)
        if name is None:
            raise RuleError(f"{label} has no name; what to do: set name = 'user:WORD' on the "
                            "class (the plan's rule column shows it)")
        if not is_user_rule(name):
            raise RuleError(f"{label} is named {str(name)!r}, which is no user rule name "
                            f"(fxamp's own rules are not given to rules=); what to do: name "
                            f"it 'user:WORD'")
        check_user_rule_name(name, f"{label}'s name", RuleError)
        if name in seen:
            raise RuleError(f"two rules are named {name!r} ({type(seen[name]).__qualname__} "
                            f"and {type(rule).__qualname__}); what to do: give each its own "
                            "name: the plan tells them apart by it")
        seen[name] = rule
    return tuple(items)
