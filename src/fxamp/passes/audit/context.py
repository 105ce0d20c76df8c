"""Audit checks that need more than the model: the optimizer, the GradScaler, a data batch
and an exported ONNX file (the training and deployment checkpoints of an AMP setup).

Finding codes (stable):

* ``params-not-fp32`` (error): the optimizer holds fp16/bf16 parameters: the update rounds
  away small steps, and ``GradScaler.unscale_`` refuses fp16 gradients. fxamp keeps FP32
  master weights; build the optimizer over the FP32 model.
* ``optimizer-eps-underflow`` (warning): an Adam-style ``eps`` that is 0 in the dtype of the
  parameters it updates (only when those are fp16/bf16).
* ``no-grad-scaler`` (warning): an optimizer for fp16 compute and no GradScaler given.
* ``scaler-disabled`` (warning): fp16 compute with a GradScaler that is disabled (e.g.
  ``torch.amp.GradScaler()`` — device "cuda" — on a machine without CUDA), or made for another
  device than the model's parameters: gradients then go unscaled.
* ``scaler-growth-interval`` (info): ``growth_interval`` longer than ``steps_per_epoch``:
  after a backoff the scale takes more than an epoch to grow again.
* ``batch-low-precision`` (warning): a floating tensor of the data batch is already
  fp16/bf16: the input and its normalisation constants lose precision before the model's
  first op; feed FP32 (fxamp casts per op).
* ``batch-out-of-range`` (warning): a floating input with values past the low dtype's max
  (inf once cast) / (info) values above 255 suggest an unnormalised image batch.
* ``onnx-old-opset`` (warning): the ONNX file's default-domain opset is below 17 (no
  LayerNormalization op: the norm is decomposed and its reduction may run in fp16).
* ``onnx-static-batch`` (info): every graph input has a fixed first dimension: the engine
  takes only that batch size.
"""
from __future__ import annotations

import logging
from typing import Any, List, Optional

import torch
import torch.nn as nn
from ..._torch import tree_leaves

from ...errors import FxampError
from ...policy import Policy, dtype_name
from .findings import Finding

log = logging.getLogger(__name__)

_LOW = (torch.float16, torch.bfloat16)
#: opset of the ONNX default domain from which LayerNormalization is an op
LAYERNORM_OPSET = 17


def _optimizer(optimizer: Any, policy: Policy, scaler: Any) -> List[Finding]:
    out: List[Finding] = []
    low = set()
    for gi, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            if p.dtype in _LOW:
                low.add(p.dtype)
        eps = group.get("eps")
        if isinstance(eps, (int, float)) and not isinstance(eps, bool) and low:
            for dtype in sorted(low, key=str):
                if eps > 0 and torch.tensor(float(eps), dtype=dtype).item() == 0:
                    out.append(Finding(
                        "warning", "optimizer-eps-underflow", f"optimizer.param_groups[{gi}]",
                        "", f"{type(optimizer).__name__} eps={eps:g} is 0 in "
                        f"{dtype_name(dtype)}, the dtype of the parameters it updates: the "
                        "update divides by sqrt(v) + 0 (inf/NaN where v is 0)",
                        "keep FP32 parameters (fxamp's master weights) or use eps >= 1e-4"))
    if low:
        names = ", ".join(dtype_name(d) for d in sorted(low, key=str))
        out.append(Finding(
            "error", "params-not-fp32", "optimizer", "",
            f"{type(optimizer).__name__} updates {names} parameters: small updates round "
            "away and GradScaler.unscale_ refuses fp16 gradients",
            "build the optimizer over the FP32 model's parameters (fxamp.amp_rewrite keeps "
            "them FP32 and shares them)"))
    if scaler is None and policy.compute == torch.float16:
        out.append(Finding(
            "warning", "no-grad-scaler", "optimizer", "",
            "training in fp16 without a GradScaler: small gradients flush to 0 in fp16",
            "pass a torch.amp.GradScaler for the model's device (fxamp.train does this), "
            "or use bf16"))
    return out


def _param_device(model: Any) -> Optional[str]:
    if not isinstance(model, nn.Module):
        return None
    for p in model.parameters():
        return p.device.type
    return None


def _scaler(scaler: Any, model: Any, policy: Policy,
            steps_per_epoch: Optional[int]) -> List[Finding]:
    out: List[Finding] = []
    enabled = bool(scaler.is_enabled())
    device = str(getattr(scaler, "_device", "") or "")
    params = _param_device(model)
    if policy.compute == torch.float16 and (not enabled or (
            params and device and params != "meta" and device != params)):
        why = "is disabled" if not enabled else f"is for {device!r}"
        out.append(Finding(
            "warning", "scaler-disabled", "scaler", "",
            f"the GradScaler {why} while the model's parameters are on {params or '?'} and "
            "compute in fp16: gradients go unscaled, small ones flush to 0",
            f"make it with torch.amp.GradScaler({params or 'device'!r}) for the parameters' "
            "device (on a machine without CUDA, GradScaler() / 'cuda' disables itself)"))
    if enabled and steps_per_epoch is not None:
        interval = int(scaler.get_growth_interval())
        if interval > steps_per_epoch:
            out.append(Finding(
                "info", "scaler-growth-interval", "scaler", "",
                f"growth_interval={interval} is longer than an epoch ({steps_per_epoch} "
                "steps): after a skipped step the scale needs more than an epoch to grow "
                "back, while small gradients may underflow",
                f"use growth_interval <= {steps_per_epoch} (e.g. "
                f"{max(1, steps_per_epoch // 2)})"))
    return out


def _batch(batch: Any, policy: Policy) -> List[Finding]:
    out: List[Finding] = []
    low_max = torch.finfo(policy.compute).max
    leaves = [t for t in tree_leaves(batch) if isinstance(t, torch.Tensor)]
    for i, t in enumerate(leaves):
        if not t.is_floating_point() or t.device.type == "meta":
            continue
        where = f"batch[{i}]"
        if t.dtype in _LOW:
            out.append(Finding(
                "warning", "batch-low-precision", where, "",
                f"the batch tensor {i} {tuple(t.shape)} is already {dtype_name(t.dtype)}: it "
                "and its normalisation ((x - mean) / std) lose precision before the model's "
                "first op",
                "feed FP32 inputs and normalisation constants; fxamp casts per op"))
            continue
        peak = float(t.detach().abs().max()) if t.numel() else 0.0
        if peak > low_max:
            out.append(Finding(
                "warning", "batch-out-of-range", where, "",
                f"the batch tensor {i} reaches |x|={peak:.6g}, past "
                f"{dtype_name(policy.compute)}'s max {low_max:.6g}: inf wherever it is cast",
                "normalise the inputs (e.g. (x / 255 - mean) / std) before the model"))
        elif peak > 255:
            out.append(Finding(
                "info", "batch-out-of-range", where, "",
                f"the batch tensor {i} reaches |x|={peak:.6g}: unnormalised data loses "
                f"relative precision in {dtype_name(policy.compute)} sums",
                "normalise the inputs (e.g. (x / 255 - mean) / std) before the model"))
    return out


def _onnx(path: str) -> List[Finding]:
    try:
        import onnx
    except ImportError:
        raise FxampError("audit(onnx=...) needs the onnx package; what to do: pip install "
                         "'fxamp[onnx]'") from None
    try:
        model = onnx.load(path, load_external_data=False)
    except Exception as err:  # noqa: BLE001 - any unreadable file
        raise FxampError(f"cannot read the ONNX file {path!r}: {type(err).__name__}: {err}; "
                         "what to do: pass a file written by fxamp export or "
                         "torch.onnx.export") from None
    out: List[Finding] = []
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), None)
    if opset is not None and opset < LAYERNORM_OPSET:
        out.append(Finding(
            "warning", "onnx-old-opset", path, "",
            f"the file uses ONNX opset {opset}: before opset {LAYERNORM_OPSET} there is no "
            "LayerNormalization op, so norms are decomposed (ReduceMean, Pow, Sqrt) and "
            "backends may run those reductions in fp16",
            f"export with opset_version >= {LAYERNORM_OPSET} (fxamp export's default is the "
            "exporter's, currently 18+)"))
    initializers = {i.name for i in model.graph.initializer}
    inputs = [i for i in model.graph.input if i.name not in initializers]
    dims = [i.type.tensor_type.shape.dim for i in inputs if i.type.HasField("tensor_type")]
    if dims and all(len(d) and d[0].HasField("dim_value") for d in dims):
        names = ", ".join(f"{i.name}[0]={d[0].dim_value}" for i, d in zip(inputs, dims))
        out.append(Finding(
            "info", "onnx-static-batch", path, "",
            f"every input has a fixed batch dimension ({names}): an engine built from it "
            "takes only that batch size",
            "export with dynamic axes for the batch (torch.onnx.export(dynamic_shapes=...) "
            "or dynamic_axes=) if the deployment batch varies"))
    return out


def audit_context(model: Any, policy: Policy, *, optimizer: Any = None, scaler: Any = None,
                  batch: Any = None, steps_per_epoch: Optional[int] = None,
                  onnx: Optional[str] = None) -> List[Finding]:
    """The findings of the optional training / deployment context (each part only when
    given)."""
    out: List[Finding] = []
    if optimizer is not None:
        out += _optimizer(optimizer, policy, scaler)
    if scaler is not None:
        out += _scaler(scaler, model, policy, steps_per_epoch)
    if batch is not None:
        out += _batch(batch, policy)
    if onnx is not None:
        out += _onnx(str(onnx))
    return out
