"""Overlapping in-place rewrites: a module rewritten in place, and a part of it or a module
it is part of rewritten in place too.

Rewrites of one policy compose: the later one plans the model's own code (the parts' in-place
forwards taken off while it traces, :func:`parts_off`), so each node is computed once in the
policy's dtype, and the parts keep their own in-place rewrites for their own calls. Rewrites
of different policies (a block in fp16 inside a model in bf16) do not: the outer graph would
trace the part's casts into its own plan and round its values twice, or a block's rewrite
would be run around by the outer graph. They are refused (:class:`OverlappingRewriteError`),
naming the earlier rewrite, its path and policy, and what to do.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Iterator, List, Optional, Tuple

import torch.nn as nn

from ..errors import OverlappingRewriteError
from ..frontends.shadow import Shadow
from ..policy import Policy, dtype_name
from .blocks import BlocksRoot, uninstall_blocks
from .inplace import InplaceForward, installed, take


def inplace_policy(module: nn.Module) -> Optional[Policy]:
    """The policy of the in-place rewrite ``module`` computes with (None: none).

    Args:
        module: any module.
    """
    forward = module.__dict__.get("forward")
    if isinstance(forward, (InplaceForward, BlocksRoot)) and forward.config is not None:
        return forward.config.policy
    return None


def own_forwards(model: nn.Module) -> Shadow:
    """A shadow of ``model`` (``frontends/shadow.py``) with the model's own in-place rewrite
    taken off: in block mode its root's and its blocks' own forwards back (their shadows'),
    else its root's. The shadow computes the FP32 model and is what a tool that knows only
    the flat form (a returned rewrite, ``fxamp.audit``, the tolerance search, the
    ONNX export, the overflow replay) reads or rewrites, while the user's model keeps its
    rewrite, for this thread and the others. A rewrite of the shadow's root holds the
    user's modules (``Shadow.to_real``). The caller releases the shadow
    (``Shadow.release``) when done.

    Args:
        model: a module, rewritten in place or not.

    Returns:
        The shadow; its ``root`` stands for ``model``.
    """
    shadow = Shadow(model)
    root = shadow.root
    if isinstance(root.__dict__.get("forward"), BlocksRoot):
        uninstall_blocks(root)  # (the shadows' blocks: the model's keep their forwards)
    else:
        take(root)
    return shadow


def same_policy(a: Optional[Policy], b: Optional[Policy]) -> bool:
    """One policy but for the output dtype (a part's values flow on in their dtype).

    Args:
        a: a policy (None: none).
        b: another.
    """
    if a is None or b is None:
        return a is b
    return dataclasses.replace(a, output_dtype=None) == dataclasses.replace(b, output_dtype=None)


def _own_blocks(model: nn.Module) -> Tuple[str, ...]:
    root = model.__dict__.get("forward")
    return tuple(root.paths) if isinstance(root, BlocksRoot) else ()


def parts(model: nn.Module) -> List[Tuple[str, nn.Module, Policy]]:
    """The parts of ``model`` (not itself, nor the blocks of its own block mode) that compute
    with an in-place rewrite of their own: (path, module, policy).

    Args:
        model: the module to rewrite.
    """
    own = _own_blocks(model)
    found = []
    for path, sub in model.named_modules():
        policy = inplace_policy(sub) if path else None
        if policy is not None and path not in own:
            found.append((path, sub, policy))
    return found


def owners(module: nn.Module) -> List[Tuple[nn.Module, str, Policy]]:
    """The modules rewritten in place that ``module`` is a part of: (owner, the path of
    ``module`` in it, the owner's policy).

    Args:
        module: the module to rewrite.
    """
    found = []
    for owner in installed():
        policy = inplace_policy(owner)
        if owner is module or policy is None:
            continue
        path = next((p for p, m in owner.named_modules() if m is module and p), None)
        if path is not None:
            found.append((owner, path, policy))
    return found


def _label(module: nn.Module) -> str:
    return type(module).__name__


def _access(path: str) -> str:
    """``model.blocks[0]`` for the path ``blocks.0``."""
    out = "model"
    for name in path.split("."):
        out += f"[{name}]" if name.isdigit() else f".{name}"
    return out


def check_overlap(model: nn.Module, policy: Policy, inplace: bool) -> None:
    """Refuse a rewrite of ``model`` that overlaps an earlier in-place rewrite of another
    policy: a part of ``model`` computing with one (any rewrite of ``model`` would trace its
    casts), or, for ``inplace=True``, a module ``model`` is part of.

    Args:
        model: the module to rewrite.
        policy: the new rewrite's policy.
        inplace: whether the new rewrite is in place.

    Raises:
        OverlappingRewriteError: naming the earlier rewrite and what to do.
    """
    name = _label(model)
    for path, sub, theirs in parts(model):
        if not same_policy(theirs, policy):
            raise OverlappingRewriteError(_contains(name, path, sub, theirs, policy, inplace))
    for owner, path, theirs in owners(model) if inplace else ():
        if not same_policy(theirs, policy):
            raise OverlappingRewriteError(_inside(name, owner, path, theirs, policy))


def _contains(name: str, path: str, sub: nn.Module, theirs: Policy, policy: Policy,
              inplace: bool) -> str:
    """The error of a rewrite of a model one of whose parts (``path``) computes with an
    in-place rewrite of policy ``theirs``."""
    return (f"{name} contains {path} ({_label(sub)}), rewritten in place before with "
            f"policy {theirs}; this rewrite of {name} asks for policy {policy}. A rewrite "
            f"of {name} traces {path}'s rewritten forward, so its values would be cast to "
            f"{dtype_name(theirs.compute)} and then to {dtype_name(policy.compute)} "
            "(rounded twice, a plan neither rewrite made): in-place rewrites of different "
            f"policies do not compose. what to do: rewrite {name} with the same policy "
            f"(amp_rewrite(model, ..., '{theirs}', inplace={inplace})), or first "
            f"rewrite {path} in place with this policy, which replaces its own "
            f"(amp_rewrite({_access(path)}, ..., '{policy}', inplace=True)), "
            f"then {name}")


def _inside(name: str, owner: nn.Module, path: str, theirs: Policy, policy: Policy) -> str:
    """The error of an in-place rewrite of part ``path`` of ``owner``, rewritten in place
    with policy ``theirs``."""
    return (f"{name} is {path} of {_label(owner)}, rewritten in place before with policy "
            f"{theirs}; this in-place rewrite of {path} asks for policy {policy}. "
            f"{_label(owner)}'s graph computes {path}'s ops in "
            f"{dtype_name(theirs.compute)} itself (or would trace {path}'s rewritten "
            "forward, rounding its values twice): in-place rewrites of different policies "
            f"do not compose. what to do: rewrite {path} with inplace=False and use the "
            f"returned module (it shares the Parameters and leaves {_label(owner)}'s "
            f"rewrite as it is), or rewrite {_label(owner)} itself in place with the "
            f"policy you want, which replaces its own (amp_rewrite(model, ..., "
            f"'{policy}', inplace=True))")


@contextlib.contextmanager
def parts_off(model: nn.Module) -> Iterator[None]:
    """``model``'s parts (:func:`parts`) with their own forwards back while ``model`` is
    traced (its plan computes their nodes once; a part's graph is no submodule of the model,
    so torch.fx could not trace its call); their rewrites are put back after. ``model`` is
    the shadow a rewrite traces (``frontends/shadow.py``), so its parts are shadows too,
    private to this rewrite: the model's own parts keep their rewrites for other threads.

    Args:
        model: the module being rewritten (a shadow).
    """
    taken = [(sub, take(sub)) for _, sub, _ in parts(model)]
    try:
        yield
    finally:
        for sub, kept in taken:
            sub.__dict__.update(kept)
