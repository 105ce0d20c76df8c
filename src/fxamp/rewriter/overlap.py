"""A model's in-place rewrites as the rest of fxamp sees them, and rewrites that overlap.

This is the one module that asks which shape a model's rewrite has: block mode (its
regions rewritten in place, ``rewriter/blocks.py``), one graph in place
(``rewriter/inplace.py``), or none. The tools (the ONNX export, ``audit``, the search, a
rewrite of a model rewritten before) ask it for what they need, the model's FP32 form
(:func:`fp32_form`), its one graph (:func:`one_graph`, :func:`rewritten`) or what a new
rewrite does (:func:`rewritten_before`), not for the shape.

Overlapping in-place rewrites: a module rewritten in place, and a part of it or a module
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
import logging
from typing import Any, Callable, Iterator, List, Optional, Tuple

import torch.fx as fx
import torch.nn as nn

from ..config import RewriteConfig
from ..errors import FxampError, OverlappingRewriteError, UnsupportedModelError
from ..frontends.shadow import Shadow
from ..policy import Policy, dtype_name
from ..result import RESULT, Pending, has_result, result_of
from ..weight_cache import INPLACE_GRAPH
from .blocks import BlocksRoot, uninstall_blocks
from .inplace import InplaceForward, installed, reinstall, take, uninstalled
from .inputs import check_model
from .stored import store_weights

log = logging.getLogger(__name__)


def is_blocks(model: nn.Module) -> bool:
    """Whether ``model`` computes in block mode.

    Args:
        model: any module.
    """
    return isinstance(model.__dict__.get("forward"), BlocksRoot)


def is_inplace(model: nn.Module) -> bool:
    """Whether ``model`` computes with one graph of an in-place rewrite (a block of a model
    in block mode too).

    Args:
        model: any module.
    """
    return INPLACE_GRAPH in model.__dict__


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
    undo(shadow.root)  # (in block mode, the shadows' blocks: the model's keep their forwards)
    return shadow


def undo(model: nn.Module) -> None:
    """Take ``model``'s in-place rewrite off: in block mode its root's and its blocks' own
    forwards back, else its root's.

    Args:
        model: a model rewritten in place.
    """
    if is_blocks(model):
        uninstall_blocks(model)
    else:
        take(model)


@contextlib.contextmanager
def fp32_form(model: Any) -> Iterator[Any]:
    """``model`` as a tool that reads its FP32 code sees it (the tolerance search,
    ``audit``, the ONNX export of a model in block mode): itself, or, for a model rewritten
    in place (in block mode or with one graph), the root of :func:`own_forwards`' shadow,
    released after. The model keeps its rewrite.

    Args:
        model: what the tool was given (any object: only a module can be rewritten).

    Yields:
        The FP32 model to reference, trace and rewrite.
    """
    if not isinstance(model, nn.Module) or not (is_blocks(model) or is_inplace(model)):
        yield model
        return
    view = own_forwards(model)
    try:
        yield view.root
    finally:
        view.release()


def one_graph(model: nn.Module, inputs: tuple, rewrite: Callable[..., nn.Module]
              ) -> nn.Module:
    """The one rewritten module of ``model`` (what the ONNX export writes): itself (a module
    ``amp_rewrite`` returned), the graph an in-place rewrite computes with
    (:func:`rewritten`), or, in block mode, a flat rewrite of its FP32 form with its
    config, made by ``rewrite`` on ``inputs`` (the model keeps its block mode).

    Args:
        model: a rewritten model.
        inputs: the example's positional arguments.
        rewrite: ``amp_rewrite``.

    Raises:
        NotPlannedError: an in-place model planned on its first call, not called yet.
    """
    if is_blocks(model):
        config = model.__dict__["forward"].config.replace(partition="flat")  # (one graph)
        with fp32_form(model) as fp32:
            flat = rewrite(fp32, inputs, config)
        log.info("%s is in block mode (its blocks rewritten in place, its own forward under "
                 "autocast): a flat rewrite of it with its config (%s) made on the example "
                 "inputs", type(model).__name__, config.policy)
        return flat
    if is_inplace(model) and not isinstance(model, fx.GraphModule):
        return rewritten(model)
    return model


def rewritten(model: nn.Module) -> nn.Module:
    """The rewritten module an in-place rewrite put inside ``model`` (``model`` itself
    when it is a rewritten module already).

    Args:
        model: a model ``amp_rewrite(..., inplace=True)`` rewrote, or a module it returned.

    Returns:
        The rewritten module whose graph the model's forward runs.

    Raises:
        NotPlannedError: ``model`` is planned on its first call and has not been called.
        FxampError: ``amp_rewrite`` did not rewrite ``model``, or rewrote it in block mode.
    """
    if is_blocks(model):
        paths = model.__dict__["forward"].paths
        raise FxampError(
            f"{type(model).__name__} is rewritten in block mode (in place, its blocks "
            f"regions of their own): each block ({paths[0]} ...) computes with its own graph "
            "and the model's own forward runs between them, so there is no one rewritten "
            f"module. what to do: fxamp.rewritten(model.get_submodule({paths[0]!r})) for a "
            "block's graph (once planned); or rewrite with example inputs and "
            "RewriteConfig.make(..., partition='flat') for one graph of the whole model")
    if isinstance(model.__dict__.get(RESULT), Pending):
        result_of(model)  # (raises NotPlannedError: planned on its first call)
    gm = model.__dict__.get(INPLACE_GRAPH)
    if gm is not None:
        return gm
    if has_result(model):
        return model
    raise FxampError(f"{type(model).__name__} was not rewritten by fxamp.amp_rewrite; what "
                     "to do: call fxamp.amp_rewrite(model, example_inputs, inplace=True)")


def same_policy(a: Optional[Policy], b: Optional[Policy]) -> bool:
    """One policy but for the output dtype (a part's values flow on in their dtype).

    Args:
        a: a policy (None: none).
        b: another.
    """
    if a is None or b is None:
        return a is b
    return dataclasses.replace(a, output_dtype=None) == dataclasses.replace(b, output_dtype=None)


def rewritten_before(model: nn.Module, example_inputs: Any, config: RewriteConfig,
                     pol: Policy, inplace: bool, rewrite: Callable[..., nn.Module],
                     planner: Callable[..., nn.Module]) -> Optional[nn.Module]:
    """What a rewrite of a model fxamp rewrote before gives: itself (the same config or
    policy), a flat rewrite of its FP32 form (a block-mode model, ``inplace=False``), or its
    new rewrite (an in-place model, a new policy); None where it was not rewritten (or its
    block mode was undone to rewrite it in place again). Checks the model either way.

    Args:
        model: the model ``amp_rewrite`` was given.
        example_inputs: its example inputs (None: planned on its first call).
        config: the rewrite's config.
        pol: its policy, the target resolved.
        inplace: whether the rewrite is in place.
        rewrite: ``amp_rewrite`` with its config made (``pipeline._amp_rewrite``).
        planner: what plans an in-place model on a call (``pipeline._plan_call``).
    """
    lazy = inplace and example_inputs is None and not config.example_kwargs
    if is_blocks(model):  # rewritten in block mode before: that rewrite is undone first
        if lazy and model.__dict__["forward"].config == config:
            log.info("model was already rewritten in place with the same config")
            return model
        if not inplace:  # (a flat rewrite of its FP32 form: the model keeps its block mode)
            with fp32_form(model) as fp32:
                return rewrite(fp32, example_inputs, config, False)
        uninstall_blocks(model)
    check_model(model)
    if is_inplace(model):  # its own forward is rewritten again (a new policy, healing)
        earlier = result_of(model).policy if has_result(model) else inplace_policy(model)
        if inplace and (earlier == pol or same_policy(earlier, pol) and owners(model)):
            # (a part of an in-place model: its values flow on in their dtype, so the
            # output dtype aside, the policy is the one it has)
            log.info("model was already rewritten in place with the same policy")
            return model
        if lazy and earlier is not None and earlier.weights != "stored":
            take(model)  # (a new policy, planned on its first call)
            return rewrite(model, None, config, inplace)
        # (a shadow with its own forward back: the model keeps computing with its rewrite
        # for other threads until the new one is in place)
        shadow = uninstalled(model)
        try:
            gm = rewrite(shadow.root, example_inputs, config, False)
        finally:
            shadow.release()
        if inplace and pol.weights == "stored":
            store_weights(model, gm)
        return reinstall(model, gm, planner) if inplace else gm
    if has_result(model):
        if result_of(model).policy == pol:
            log.info("model was already rewritten with the same policy; returning it")
            return model
        raise UnsupportedModelError(
            f"this model was already rewritten by fxamp with policy "
            f"{result_of(model).policy}; asked for {pol}. what to do: rewrite the "
            "original FP32 model instead")
    return None


def _own_blocks(model: nn.Module) -> Tuple[str, ...]:
    return tuple(model.__dict__["forward"].paths) if is_blocks(model) else ()


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
