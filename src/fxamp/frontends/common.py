"""What the front ends share: the training-flag save/restore around a trace in the other mode,
the warning when two modes cannot be aligned, and the merging of nested plans (a submodule
rewritten on its own, by partial tracing or under an eager root) into the parent's lines."""
from __future__ import annotations

import contextlib
import dataclasses
import logging
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch
import torch.nn as nn

from .._torch import tree_map
from ..ir import Rule
from ..plan import NodePrecision, Plan
from ..policy import Policy


def as_tuple(inputs: Any) -> tuple:
    """Positional inputs as a tuple: a tuple as is, a list as a tuple, anything else as the
    one input."""
    if isinstance(inputs, tuple):
        return inputs
    if isinstance(inputs, list):
        return tuple(inputs)
    return (inputs,)

log = logging.getLogger(__name__)


@contextlib.contextmanager
def training_flags(model: nn.Module, mode: Optional[bool] = None) -> Iterator[None]:
    """Run the block with ``model.train(mode)`` (flags unchanged when ``mode`` is None) and
    put every module's own flag back afterwards: a frozen BatchNorm inside a training model
    stays frozen."""
    flags = [(m, m.training) for m in model.modules()]
    try:
        if mode is not None:
            model.train(mode)
        yield
    finally:
        for module, flag in flags:
            module.training = flag


#: ``GraphModule.meta`` key of a captured graph that holds one training mode only (True:
#: train, False: eval): its two modes trace differently and only this one was kept
MODE = "fxamp_mode"


def warn_one_mode(model: nn.Module, gm: Any, mode: bool, how: str = "traces") -> None:
    """The graphs of the two modes differ beyond constants: ``gm``, the graph of ``mode``
    (True: train), is kept, marked as that mode's alone (a call in the other mode never
    runs it)."""
    gm.meta[MODE] = mode  # (no hazard: a call in the other mode never runs it)
    log.info("%s %s differently in train and eval mode: the rewritten graph is for %s "
                "mode only; the first call in %s mode is planned on that call "
                "(in place, or by a returned module)", type(model).__name__, how,
                _MODES[mode], _MODES[not mode])


def warn_mode_only(model: nn.Module, gm: Any, mode: bool, err: Exception,
                   how: str = "traces") -> None:
    """Only one mode (``mode``) could be captured: its graph ``gm`` is kept, marked as that
    mode's alone."""
    gm.meta[MODE] = mode
    log.info("%s %s in %s mode only (%s); the rewritten graph is for that mode only",
                type(model).__name__, how, _MODES[mode], str(err).splitlines()[0])


_MODES = {True: "train", False: "eval"}


def in_output_dtype(out: Any, dtype: Optional[torch.dtype]) -> Any:
    """``out`` (a model's output: a tensor or a pytree of them) with its floating tensors in
    ``dtype``, the policy's output dtype (None: as they are).

    Args:
        out: what the model's own forward returned (under autocast, in an eager root or in
            block mode).
        dtype: the policy's ``output_dtype``.
    """
    if dtype is None:
        return out

    def cast(t: Any) -> Any:
        return t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() \
            and t.dtype != dtype else t

    if type(out) is torch.Tensor:  # (the common case, without a walk of the pytree)
        return cast(out)
    if isinstance(out, dict) and dataclasses.is_dataclass(out):
        # a Hugging Face ModelOutput, made by this call: its fields are set in place, as
        # HF's own code sets them (rebuilding one runs its dataclass machinery per call)
        for key, value in list(out.items()):
            new = cast(value) if isinstance(value, torch.Tensor) else tree_map(cast, value)
            if new is not value:
                out[key] = new
        return out
    return tree_map(cast, out)


def nested_lines(nested: Dict[str, Plan]) -> Dict[str, Any]:
    """Each nested plan's lines under ``path/``, their module paths prefixed by ``path``."""
    nodes: Dict[str, Any] = {}
    for path, sub_plan in nested.items():
        nodes.update({f"{path}/{name}": dataclasses.replace(
            p, module=f"{path}.{p.module}" if p.module else path,
            reason=_nested_reason(p.reason, path, name))
            for name, p in sub_plan.nodes.items()})
    return nodes


def _nested_reason(reason: str, path: str, name: str) -> str:
    """A nested plan line's reason under ``path/``: "its nodes are the plan lines name/*"
    names them by their full plan names, ``path/name/*``."""
    return reason.replace(f"plan lines {name}/*", f"plan lines {path}/{name}/*")


def nested_header(header: Dict[str, str], runtime: "list[str] | tuple" = (),
                  nested: Optional[Dict[str, Plan]] = None) -> Dict[str, str]:
    """``header`` with the runtime leaves and the nested plans' front ends recorded."""
    header = dict(header)
    nested = nested or {}
    runtime = [leaf for leaf in runtime if leaf not in nested]
    if runtime:
        header["runtime leaves"] = " ".join(runtime)
    if nested:
        header["nested"] = " ".join(f"{path}={plan.header['frontend']}"
                                    for path, plan in nested.items())
    return header


#: what to do when a packed sequence stops a tracer (its batch sizes are tensor values)
PACKED_ADVICE = (
    "a packed sequence (torch.nn.utils.rnn.pack_padded_sequence / PackedSequence) cannot be "
    "traced: its batch sizes are computed from the lengths' values on the CPU; run the RNN on "
    "the padded batch (no packing; mask or gather the padded steps instead), or rewrite the "
    "model's other submodules with amp_rewrite and keep the packed RNN under torch.autocast")


def packed_sequence_failure(exc: BaseException) -> bool:
    """Whether ``exc`` was raised while packing a sequence or running an RNN on one."""
    from torch.nn.utils.rnn import PackedSequence

    for error in (exc, exc.__cause__, exc.__context__):
        tb = error.__traceback__ if error is not None else None
        while tb is not None:
            frame = tb.tb_frame
            if frame.f_code.co_filename.replace("\\", "/").endswith("nn/utils/rnn.py") or any(
                    isinstance(v, PackedSequence) for v in frame.f_locals.values()):
                return True
            tb = tb.tb_next
    return False


#: the plan header field naming the modules whose eval under autocast takes PyTorch's fused
#: fast path (:func:`fast_path_note`)
FAST_PATH = "fast_path"
#: the torch.nn modules whose forward takes a fused kernel ("fast path") in eval under no_grad
_FAST_PATH_MODULES = (nn.TransformerEncoderLayer, nn.MultiheadAttention)


def fast_path_modules(model: nn.Module, nodes: Dict[str, NodePrecision]
                      ) -> List[Tuple[str, str]]:
    """The modules that take PyTorch's fused fast path in eval under ``no_grad``
    (``nn.TransformerEncoderLayer``, and ``nn.MultiheadAttention`` outside one) and whose
    ops the plan computes: (path, class name) pairs. A module the plan keeps as a call, or
    that sits inside one (``rule="runtime"``: fx keeps torch.nn modules so), runs under
    autocast, fast path and all, and is not named.

    Args:
        model: the model being rewritten.
        nodes: its plan's nodes.

    Returns:
        The pairs, outermost first.
    """
    calls = [p.module for p in nodes.values() if p.rule == Rule.RUNTIME and p.module]
    found: List[Tuple[str, str]] = []
    for path, module in model.named_modules():
        if not isinstance(module, _FAST_PATH_MODULES) or any(
                not p or path == p or path.startswith(p + ".")
                for p in [*calls, *(p for p, _ in found)]):
            continue
        found.append((path, type(module).__name__))
    return found


def fast_path_note(model: nn.Module, nodes: Dict[str, NodePrecision]) -> str:
    """The plan header's note on the modules of :func:`fast_path_modules`; "" when there is
    none.

    Their fast-path guard asks ``torch.is_autocast_enabled()`` without a device, which is
    False inside ``torch.autocast("cpu")`` (True inside CUDA's, so only a "cpu" plan gets
    the note): such a call under CPU autocast runs the fused kernel, inside which no plan
    reaches. So a rewritten model in place (or a block of one) holding such a module runs
    an eval call without grad on the CPU under autocast too, as autocast runs it
    (``InplaceForward``); a returned module computes their regular path (the one autocast
    takes in training and with grad), whose eval outputs differ by low-precision rounding
    (docs/behaviour.md, "Limits", gives the measured size).

    Args:
        model: the model being rewritten.
        nodes: its plan's nodes.

    Returns:
        The header value: the module paths and why, or "".
    """
    found = fast_path_modules(model, nodes)
    if not found:
        return ""
    names = " ".join(f"{p or '(root)'}={kind}" for p, kind in found)
    return (f"{names}: in eval under no_grad, torch.autocast runs PyTorch's fused fast path "
            "for these, which no plan reaches into; a model rewritten in place runs such a "
            "call on the CPU under torch.autocast too (a returned module computes their "
            "regular path, autocast's with grad and in training: eval outputs differ by "
            "rounding); torch.backends.mha.set_fastpath_enabled(False) keeps the plan "
            "there, and autocast takes the regular path too")


def top_header(model: nn.Module, policy: Policy, header: Dict[str, str],
               nodes: Dict[str, NodePrecision]) -> Dict[str, str]:
    """A top-level plan's header: ``header`` with, for a "cpu" plan, the note on the modules
    that take PyTorch's fused fast path in eval (:func:`fast_path_note`; inside
    ``torch.autocast("cuda")`` the guard sees autocast: no fast path, no note).

    Args:
        model: the model being rewritten.
        policy: the rewrite's policy.
        header: the plan header made so far.
        nodes: the plan's nodes.

    Returns:
        The header (a new dict when a note is added).
    """
    note = fast_path_note(model, nodes) if policy.target == "cpu" else ""
    return dict(header, **{FAST_PATH: note}) if note else header


