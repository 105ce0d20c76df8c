"""The IR: one typed record per fx node, the only thing the passes share.

Every pass reads and writes a node's precision facts through :func:`get` / :func:`set`
(and the few helpers below); nothing else in fxamp writes ``node.meta`` keys of its own.
The record is frozen: :func:`set` stores a new one, so graph copies (``Graph.node_copy``
copies ``node.meta`` shallowly) never share a mutable record.

Fields of :class:`NodeIR`:

* ``precision`` — the plan line (:class:`fxamp.plan.NodePrecision`: output dtype, input
  dtype, rule, reason, op label, module path), written by annotate for every node with a
  floating output, and for a node with a floating input whose output is complex (an FFT:
  the dtype of its real and imaginary parts) or another tensor its inputs' dtype decides
  (``linalg.matrix_rank``: the dtype it computes in);
* ``value`` — what carries the floating output: ``"tensor"`` or ``"seq"`` (tuple, list, ...),
  ``"other"`` for those complex or integer outputs (nothing floating to cast);
* ``shape`` — the shape of the first floating tensor of the output;
* ``fixed`` — a decision made by a rule outside the op tables (numerics rules, ranges,
  placement, the tolerance search, hooks), honoured by every later annotate run;
* ``cast`` — True on the cast nodes the casts pass inserts;
* ``layout`` — ``"channels_last"`` on the inputs the layout pass converts on entry;
* ``region`` — True on the calls of regions planned on their own (block mode's glue).

:class:`Rule` names who decided a node; its values are the words of the plan text.
"""
from __future__ import annotations

import dataclasses
import enum
from typing import TYPE_CHECKING, Any, Optional, Tuple

import torch
import torch.fx as fx

if TYPE_CHECKING:
    from .plan import NodePrecision

__all__ = ["Rule", "Decision", "NodeIR", "get", "set", "clear", "clear_annotation", "precision",
           "fixed", "fix", "is_cast", "mark_cast", "copy_foreign_meta", "KEY"]

#: the one node.meta key fxamp writes
KEY = "fxamp_ir"


class Rule(str, enum.Enum):
    """Who decided a node's precision (the plan's ``rule`` column).

    A ``str`` enum: ``Rule.USER == "user"`` and ``str(Rule.USER) == "user"``, so plan text,
    plans parsed from files and the enum compare equal."""

    AUTOCAST = "autocast"      # torch.autocast's op tables (or observed autocast)
    USER = "user"              # a policy override
    RUNTIME = "runtime"        # an opaque call run under torch.autocast at run time
    BANNED = "banned"          # an op autocast refuses in the low dtype
    NESTED = "nested"          # a submodule rewritten on its own
    NORM_EPS = "norm_eps"      # numerics: a norm's eps the low dtype loses
    LOSS = "loss"              # numerics: a loss kept in fp32
    JOINS = "joins"            # numerics: mixed-dtype joins promoted
    SOFTMAX = "softmax"        # numerics: stable softmax
    CUSTOM_OPS = "custom_ops"  # numerics: custom ops fenced
    RANGES = "ranges"          # calibration: values out of the low dtype's range
    PLACEMENT = "placement"    # casts moved to the cheaper side of a value-preserving op
    SEARCH = "search"          # the tolerance search
    BISECT = "bisect"          # the bisection baseline of the search
    DEPLOY = "deploy"          # a deployment target's plan: low precision unless a number
                               # or the engine needs fp32
    HEAL = "heal"              # fxamp.train moved an overflowing node to fp32
    MASK_FILL = "mask_fill"    # numerics: a deployment plan's attention-mask fill in fp16
    # (new members go at the end: Model Explorer numbers the rules by position)

    __hash__ = str.__hash__  # hashes as its word: {"user"} finds Rule.USER

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


@dataclasses.dataclass(frozen=True)
class Decision:
    """A node's planned input dtype, rule and reason, before its output dtype is known.
    ``label``: the op label ("" when a rule records it); ``runtime``: run under autocast."""

    inputs: Optional[torch.dtype]
    rule: str
    reason: str
    label: str = ""
    runtime: bool = False


@dataclasses.dataclass(frozen=True)
class NodeIR:
    """Everything fxamp knows about one node (see the module docstring)."""

    precision: Optional["NodePrecision"] = None
    value: Optional[str] = None
    shape: Optional[Tuple[int, ...]] = None
    fixed: Optional[Decision] = None
    cast: bool = False
    layout: Optional[str] = None
    #: a call of a region planned on its own (block mode's glue calls its blocks so): a
    #: plain module call (its plan casts inside it; annotate runs it under autocast, as
    #: autocast would), and its outputs' dtypes are its plan's, known at run time, so every
    #: cast of them, and of what ops that follow their inputs make of them, is kept
    region: bool = False


_EMPTY = NodeIR()


def get(node: fx.Node) -> NodeIR:
    """The node's record (an empty one when fxamp has written nothing on it)."""
    record = node.meta.get(KEY)
    return record if isinstance(record, NodeIR) else _EMPTY


def set(node: fx.Node, **fields: Any) -> NodeIR:  # noqa: A001 - the accessor pair get/set
    """Replace the given fields of the node's record; returns the new record."""
    record = dataclasses.replace(get(node), **fields)
    node.meta[KEY] = record
    return record


def clear(node: fx.Node, *names: str) -> None:
    """Reset the named fields (all of them when none is named)."""
    if not names:
        node.meta.pop(KEY, None)
        return
    set(node, **{name: getattr(_EMPTY, name) for name in names})


def clear_annotation(node: fx.Node) -> None:
    """Forget what annotate wrote (precision, value, shape); rules' decisions stay."""
    if KEY in node.meta:
        clear(node, "precision", "value", "shape")


def precision(node: fx.Node) -> Optional["NodePrecision"]:
    """The node's plan line, or None (no floating output, or not annotated yet)."""
    return get(node).precision


def fixed(node: fx.Node) -> Optional[Decision]:
    """The decision a rule fixed for the node, or None."""
    return get(node).fixed


def fix(node: fx.Node, inputs: Optional[torch.dtype], rule: str, reason: str) -> bool:
    """Record a rule's decision for ``node``; True if it changed anything."""
    old = get(node).fixed
    if old is not None and (old.inputs, old.rule, old.reason) == (inputs, rule, reason):
        return False
    set(node, fixed=Decision(inputs, rule, reason))
    return True


def is_cast(node: fx.Node) -> bool:
    """Whether the casts pass inserted this node."""
    return get(node).cast


def cast_dtype(node: fx.Node) -> Optional[torch.dtype]:
    """The dtype of a plan cast ``x.to(dtype)`` of a rewritten graph, or None for any other
    node."""
    if node.op == "call_method" and node.target == "to" and len(node.args) == 2 \
            and not node.kwargs and isinstance(node.args[1], torch.dtype):
        return node.args[1]
    return None


def mark_cast(node: fx.Node) -> None:
    """Mark a node the casts pass inserted."""
    set(node, cast=True)


def copy_foreign_meta(src: fx.Node, dst: fx.Node) -> None:
    """Copy ``src``'s meta (stack trace, module stack, ...) to ``dst``, without fxamp's record."""
    dst.meta.update({k: v for k, v in src.meta.items() if k != KEY})
