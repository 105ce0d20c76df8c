"""What no front end can take, refused before any of them tries, naming it and what to do:
a quantized model (:func:`check_not_quantized`), example inputs on device ``meta`` for a
model on another device (:func:`check_example_device`) and Parameters already in FP16 /
BF16 (:func:`check_parameter_dtypes`, naming FSDP2's ``MixedPrecisionPolicy`` where its
``param_dtype`` is the cause)."""
from __future__ import annotations

import itertools
from typing import Any, Dict, Optional

import torch
import torch.fx as fx
import torch.nn as nn

from .._torch import fsdp_param_dtype, tree_flatten
from ..errors import ExampleInputError, UnsupportedModelError

#: the packages of torch's quantized modules: static, dynamic and reference quantized
#: layers, and the fused (intrinsic) quantized ones; ``torch.nn.quantized`` is an alias
QUANTIZED_PACKAGES = ("torch.ao.nn.quantized", "torch.ao.nn.intrinsic.quantized",
                      "torch.nn.quantized", "torch.nn.intrinsic.quantized",
                      "torch.ao.nn.sparse.quantized")
#: torch functions that make quantized tensors (a ``quantize_fx`` module's graph calls them)
QUANTIZE_CALLS = (torch.quantize_per_tensor, torch.quantize_per_channel,
                  torch.quantize_per_tensor_dynamic)
#: the operator namespaces of quantized kernels (``torch.ops.quantized.*``, PT2E's
#: ``torch.ops.quantized_decomposed.*``)
QUANTIZED_NAMESPACES = ("quantized", "quantized_decomposed")


def quantized_part(model: nn.Module) -> Optional[str]:
    """What makes ``model`` quantized, in words (a quantized layer by path and class, else
    a quantize / dequantize stub, a quantized tensor, or a quantizing call of a graph), or
    None for a floating-point model."""
    modules = [(path, m) for path, m in model.named_modules()
               if type(m).__module__.startswith(QUANTIZED_PACKAGES)]
    stubs = ("Quantize", "DeQuantize")
    for path, module in sorted(modules, key=lambda pm: type(pm[1]).__name__ in stubs):
        cls = type(module)
        return (f"{path!r} is {cls.__module__}.{cls.__qualname__}" if path else
                f"it is {cls.__module__}.{cls.__qualname__}")
    for name, t in itertools.chain(model.named_parameters(), model.named_buffers()):
        if t.is_quantized:
            return f"{name!r} is a quantized tensor ({t.dtype})"
    for path, module in model.named_modules():
        if not isinstance(module, fx.GraphModule):
            continue
        for node in module.graph.find_nodes(op="call_function"):
            target = node.target
            namespace = getattr(target, "namespace", None) or str(target).split(".")[0]
            if target in QUANTIZE_CALLS or namespace in QUANTIZED_NAMESPACES:
                shown = (f"torch.{target.__name__}" if target in QUANTIZE_CALLS
                         else str(target))
                where = f" of {path!r}" if path else ""
                return f"its graph{where} calls {shown} (node {node.name})"
    return None


def check_not_quantized(model: nn.Module) -> None:
    """Refuse a quantized model (eager static or dynamic quantization's ``convert``
    output, a ``quantize_fx`` / PT2E module): its layers compute on quantized integer
    tensors, which neither autocast nor a floating-point plan covers.

    Raises:
        UnsupportedModelError: naming the quantized module (or tensor, or call) and what
            to do.
    """
    part = quantized_part(model)
    if part is None:
        return
    raise UnsupportedModelError(
        f"{type(model).__name__} is quantized: {part}, which computes on quantized integer "
        "tensors. fxamp plans floating-point models (each op in FP16/BF16 or FP32, as "
        "torch.autocast does); a quantized model has its precision chosen already and runs "
        "without fxamp. what to do: give amp_rewrite the floating-point model, before "
        "torch.ao.quantization's prepare / convert (or quantize_fx's prepare_fx / "
        "convert_fx); mixed precision and int8 quantization are two ways to lower a "
        "model's precision, so quantize the float model, not the rewritten one")


def check_example_device(model: nn.Module, args: tuple, kwargs: Dict[str, Any]) -> None:
    """Refuse example inputs on device ``meta`` for a model whose Parameters or buffers are
    on another device, and the other way round: the model cannot run on them (every call
    mixes two devices), so neither the op dtypes nor autocast's behaviour can be observed
    on them.

    Raises:
        ExampleInputError: naming both devices and what to pass instead.
    """
    example = {t.device.type for t in tree_flatten((args, kwargs))[0]
               if isinstance(t, torch.Tensor)}
    own = {t.device.type for t in itertools.chain(model.parameters(), model.buffers())}
    name = type(model).__name__
    if "meta" in example and own - {"meta"}:
        meta_side, other_side, other = ("the example inputs are",
                                         f"{name}'s Parameters and buffers", own - {"meta"})
        other_dev = sorted(other)[0]
        advice = (f"pass example inputs on {other_dev} (real tensors of the same shapes and "
                  f"dtypes, e.g. torch.randn(shape, device={other_dev!r})), or, for the plan "
                  "alone without allocating inputs, rewrite a copy of the model moved to meta "
                  "(copy.deepcopy(model).to('meta'), as `fxamp plan --input-shape` does)")
    elif "meta" in own and example - {"meta"}:
        meta_side, other_side, other = (f"{name}'s Parameters or buffers are",
                                         "the example inputs", example - {"meta"})
        other_dev = sorted(other)[0]
        advice = ("for the plan alone, pass example inputs on meta too (torch.empty(shape, "
                  "device='meta')); to run the rewritten model, give it its weights on "
                  f"{other_dev} first (model.to_empty(device={other_dev!r}) and "
                  "load_state_dict)")
    else:
        return
    raise ExampleInputError(
        f"{meta_side} on device meta and {other_side} on {', '.join(sorted(other))}: {name} does "
        f"not run on them (every call would mix meta and {other_dev} tensors), so its plan "
        f"cannot be made from them; what to do: {advice}")


#: the Parameter dtypes fxamp refuses: it keeps FP32 master weights and casts per op
LOW_PRECISION = (torch.float16, torch.bfloat16)


def check_parameter_dtypes(model: nn.Module) -> None:
    """Refuse a model with a floating Parameter already in FP16 / BF16: fxamp keeps FP32
    master weights and casts per op. Where FSDP2's ``fully_shard`` on the model or a
    module holding the Parameter was given ``MixedPrecisionPolicy(param_dtype=...)``, that
    policy is the cause (it all-gathers the Parameters in that dtype for forward), and the
    error says so instead of advising ``model.float()``.

    Raises:
        UnsupportedModelError: naming the Parameter, the cause and what to do.
    """
    for name, p in model.named_parameters():
        if not p.is_floating_point() or p.dtype not in LOW_PRECISION:
            continue
        parts = name.split(".")[:-1]
        owners = [".".join(parts[:i]) for i in range(len(parts), -1, -1)]
        sharded = next((path for path in owners
                        if fsdp_param_dtype(model.get_submodule(path)) == p.dtype), None)
        if sharded is None:
            raise UnsupportedModelError(
                f"parameter {name!r} is already {p.dtype}; fxamp keeps FP32 master weights "
                "and casts per op. what to do: call model.float() before amp_rewrite")
        where = repr(sharded) if sharded else _unsharded_name(model)
        err = UnsupportedModelError(
            f"parameter {name!r} is {p.dtype} in this call because FSDP2's fully_shard on "
            f"{where} was given mp_policy=MixedPrecisionPolicy(param_dtype={p.dtype}): it "
            f"all-gathers the Parameters in {str(p.dtype).replace('torch.', '')} for "
            "forward, while fxamp's plan computes from the FP32 Parameters and casts per op "
            "(the policy would run every op in low precision, autocast's FP32 ops included). "
            "what to do: leave param_dtype out of the MixedPrecisionPolicy given to "
            "fully_shard (no mp_policy, or MixedPrecisionPolicy() with param_dtype=None): "
            "the rewritten model already computes in low precision where torch.autocast "
            "would; or use FSDP2's param_dtype on the model without fxamp")
        err.cause_named = True  # type: ignore[attr-defined]  # (the whole cause: raised as is)
        raise err


def _unsharded_name(module: nn.Module) -> str:
    """The class name of ``module`` as the user wrote it: ``fully_shard`` swaps in a class
    ``FSDP<name>`` deriving from ``FSDPModule`` and the module's own class."""
    cls = type(module)
    if any(base.__name__ == "FSDPModule" for base in cls.__bases__):
        return cls.__name__.removeprefix("FSDP")
    return cls.__name__
