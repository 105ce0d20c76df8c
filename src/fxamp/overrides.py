"""Policy overrides that match nothing are errors, not silent no-ops.

A rewrite records which overrides matched at least one node while it annotated, in its
:class:`Scope` (the pass context carries it to the rules). Rewrites
nest (a submodule no tracer takes whole is rewritten on its own; the eager front end
rewrites each child): a nested rewrite matches overrides against the names the top-level
plan shows for its nodes (``leaf/node`` and the full module path ``leaf.sub.module``) as
well as its own, and its matches count for the top-level rewrite only when it succeeds.
The top-level rewrite checks, once all nodes are annotated, that every override of the
policy matched something; if not, :class:`PolicyError` names the closest node names and
module paths (``difflib``), so ``fp32:encoder.layer.0.*`` on a model whose paths start
with ``bert.`` says ``did you mean bert.encoder.layer.0.*``. An override that matches only
nodes with no plan line (``fp32:size``: nothing floating to keep in a dtype) is refused too.

A rewrite planned on the model's first call traces nothing at ``amp_rewrite`` time; there,
:func:`check_paths` refuses at once an override that can only be a module path and names no
module of the model (``fp32:blocks.7.*`` on a model with blocks 0 to 3), or that is spelled
as one of torch's op labels and names no op (``fp32:nn.Lineer``), so a typo is refused
where it is written, not on the first training step.
"""
from __future__ import annotations

import difflib
import fnmatch
import sys
from dataclasses import dataclass, field
from typing import Any, FrozenSet, Iterable, List, Optional, Set, Tuple

from .errors import PolicyError
from .policy import Override, Policy, dtype_name


@dataclass
class Scope:
    """One rewrite's record: where it sits under the top-level model, what matched."""

    paths: Tuple[str, ...] = ()
    matched: Set[Override] = field(default_factory=set)
    #: overrides another region of the model may match instead (``RewriteConfig.elsewhere``):
    #: not refused here when they match nothing
    elsewhere: FrozenSet[Override] = frozenset()

    @property
    def top(self) -> bool:
        """Whether this is the top-level rewrite (the one that checks)."""
        return not self.paths

    def child(self, path: str) -> "Scope":
        """The scope of the rewrite of submodule ``path`` (its matches join this scope's
        through :meth:`join` when that rewrite succeeds)."""
        return Scope(self.paths + (path,))

    def join(self, child: "Scope") -> None:
        """Count a finished nested rewrite's matches here."""
        self.matched |= child.matched


def node_names(name: str, module: str, label: str, scope: Optional[Scope] = None
               ) -> Tuple[str, ...]:
    """The names an override pattern is matched against for one node: its name, module path
    (and ``path.``, so ``encoder.layer.0.*`` covers the layer's own functional ops), op
    label, and inside a nested rewrite the same names as the top-level plan shows them."""
    names = [name, module, module + "." if module else "", label]
    if scope is not None and scope.paths:
        full = ".".join(scope.paths) + ("." + module if module else "")
        names += ["/".join(scope.paths) + "/" + name, full, full + "."]
    return tuple(names)


def match(policy: Policy, scope: Optional[Scope], *names: str) -> Optional[Override]:
    """``policy.override_for(*names)``, recording in ``scope`` every override that matches
    (not only the one that wins)."""
    found = policy.overrides_matching(*names)
    if scope is not None:
        scope.matched.update(found)
    return found[-1] if found else None


def _candidates(lines: Iterable[Tuple[str, str, str]]) -> List[str]:
    """Node names, module paths, each module path's enclosing paths as ``path.*``, and op
    labels of the (name, module, label) triples, without repeats, in order."""
    seen: dict = {}
    for name, module, label in lines:
        seen.setdefault(name, None)
        if module:
            parts = module.split(".")
            for i in range(1, len(parts)):
                seen.setdefault(".".join(parts[:i]) + ".*", None)
            seen.setdefault(module, None)
        if label:
            seen.setdefault(label, None)
    return [c for c in seen if c]


def check_matched(policy: Policy, scope: Scope,
                  lines: Iterable[Tuple[str, str, str]]) -> None:
    """Raise PolicyError when an override of ``policy`` matched no node in ``scope``.
    ``lines`` are the (name, module path, op label) of every node of the top-level plan."""
    lines = list(lines)
    planned = {o for name, module, label in lines
               for o in policy.overrides_matching(name, module, module + "." if module else "",
                                                  label)}
    idle = [o for o in policy.overrides if o in scope.matched and o not in planned
            and o not in scope.elsewhere]
    if idle:
        raise PolicyError(
            "\n".join(f"policy override '{o}' matches only nodes with no floating-point input "
                       "or output (sizes, shapes, integer arithmetic): no dtype changes them"
                       for o in idle) + "\n  what to do: name a node of the plan (see `fxamp "
            "plan`): the op that makes the floating value, or drop the override")
    unmatched = [o for o in policy.overrides
                 if o not in scope.matched and o not in scope.elsewhere]
    if not unmatched:
        return
    candidates = _candidates(lines)
    parts, example = [], ""
    for override in unmatched:
        pattern = override.pattern
        close = difflib.get_close_matches(pattern, candidates, n=5, cutoff=0.5)
        bare = pattern.rstrip("*").rstrip(".")  # "encoder.layer.0" in "bert.encoder.layer.0"
        if bare and not close:
            close = [c for c in candidates if c.endswith("." + bare + ".*") or
                     c.endswith("." + bare)][:5]
        unreached = [n for n, m, lab in lines if any(
            fnmatch.fnmatchcase(v, pattern) for v in (n, m, lab) if v)]
        example = example or (f"{dtype_name(override.dtype)}:{close[0]}" if close else "")
        text = f"policy override '{override}' matches no node of the model"
        if unreached:
            text += (f" that fxamp plans: it names only {', '.join(unreached[:5])}, which "
                     "run(s) under torch.autocast at run time (rule 'runtime')")
        text += (f"; closest node names / module paths: {', '.join(close)}" if close else
                 "; no node name or module path is close to it")
        parts.append(text)
    raise PolicyError(
        "\n".join(parts) + "\n  what to do: write a pattern that matches a node name, module "
        "path or op label of the plan (see `fxamp plan`)" +
        (f", e.g. '{example}'" if example else "") + ", or drop the override")


def _path_only(pattern: str, children: Iterable[str]) -> bool:
    """Whether ``pattern`` can only be a module path of a model whose direct children are
    ``children``: dotted, its first part one of them (no wildcard there), no ``/`` (a
    nested plan line's name), and that first part no Python module's name (an op label,
    ``mypkg.MyBlock``, starts with one)."""
    head = pattern.split(".", 1)[0]
    return ("." in pattern and "/" not in pattern and head in set(children)
            and not any(c in head for c in "*?[") and head not in sys.modules)


def check_paths(model: Any, policy: Policy) -> None:
    """Refuse, before any trace, each override of ``policy`` that can only be a module path
    of ``model`` (:func:`_path_only`) and matches none of its modules' paths (``path`` or
    ``path.``, as :func:`node_names` matches them), naming the closest paths, and each one
    spelled as one of torch's op labels that names no op (:func:`_unknown_label`; for
    ``nn.<Name>`` where the model has modules of its own class ``Name``, their paths).

    Args:
        model: the model being rewritten (an ``nn.Module``).
        policy: the rewrite's policy.

    Raises:
        PolicyError: naming each such override and the closest paths or labels.
    """
    if not policy.overrides:
        return
    children = [name for name, _ in model.named_children()]
    named = [(name, m) for name, m in model.named_modules() if name]
    paths = [name for name, _ in named]
    parts = []
    candidates: Optional[List[str]] = None  # (the paths' patterns, made once if needed)
    for override in policy.overrides:
        pattern = override.pattern
        if not _path_only(pattern, children) or any(
                fnmatch.fnmatchcase(p, pattern) or fnmatch.fnmatchcase(p + ".", pattern)
                for p in paths):
            continue
        if candidates is None:
            candidates = _candidates(("", p, "") for p in paths)
        close = difflib.get_close_matches(pattern, candidates, n=5, cutoff=0.5)
        parts.append(f"policy override '{override}' names no module of "
                     f"{type(model).__name__}: no module path matches it"
                     + (f"; closest module paths: {', '.join(close)}" if close else ""))
    for override in policy.overrides:
        unknown = _unknown_label(override.pattern)
        name = override.pattern.partition(".")[2]
        mine = [p for p, m in named if type(m).__name__ == name]
        if unknown and override.pattern.startswith("nn.") and mine:
            unknown += (f"; the model's own {name} modules are at {', '.join(mine[:3])}"
                        + (" ..." if len(mine) > 3 else "") + ": name them by their paths")
        if unknown:
            parts.append(f"policy override '{override}' {unknown}")
    if parts:
        raise PolicyError("\n".join(parts) + "\n  what to do: write the path of a module of "
                          "the model (see model.named_modules()) or an op label of torch's "
                          "(aten.linear, nn.LayerNorm), or drop the override")


def _unknown_label(pattern: str) -> str:
    """Why ``pattern`` names no op label, where it is spelled as one of the labels plan
    lines give torch's ops (``aten.<op>``, ``F.<fn>``, ``torch.<fn>``, ``operator.<fn>``,
    ``Tensor.<method>``, ``nn.<Module>``; no wildcard in the name) and there is no such
    op, function or module class; "" where it may name one."""
    import operator

    import torch

    space, _, rest = pattern.partition(".")
    name = rest.split(".", 1)[0]
    spaces = {"aten": torch.ops.aten, "F": torch.nn.functional, "torch": torch,
              "operator": operator, "Tensor": torch.Tensor}
    if space not in (*spaces, "nn") or not name or any(c in name for c in "*?["):
        return ""
    if space in spaces:
        if hasattr(spaces[space], name):
            return ""
        close = difflib.get_close_matches(name, dir(spaces[space]), n=3)
        return (f"names no op: no {space}.{name}"
                + (f"; closest: {', '.join(f'{space}.{c}' for c in close)}" if close else ""))
    known = _torch_nn_classes(torch.nn.Module)
    if name in known:
        return ""
    close = difflib.get_close_matches(name, sorted(known), n=3)
    return (f"names no torch.nn module: torch.nn has no {name}"
            + (f"; closest: {', '.join('nn.' + c for c in close)}" if close else ""))


def _torch_nn_classes(cls: type) -> Set[str]:
    """The names of the loaded torch.nn module classes under ``cls`` (the ``nn.<Name>``
    labels plan lines give them, ``oplists.module_label``)."""
    names: Set[str] = set()
    todo = [cls]
    while todo:
        klass = todo.pop()
        if klass.__module__.startswith("torch.nn"):
            names.add(klass.__name__)
        todo.extend(type.__subclasses__(klass))
    return names
