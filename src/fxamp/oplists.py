"""The map from torch-level calls onto autocast's ATen op tables (:mod:`.autocast_tables`).

The ATen tables (re-exported here) mirror ``aten/src/ATen/autocast_mode.cpp`` of the installed
torch (2.14): ``tests/test_oplists.py`` checks that every op named here has an autocast kernel
for its target, that every op with an autocast kernel is named here, and that the categories agree
with what ``torch.autocast`` really does (CPU for real, CUDA on fake tensors).

A torch-level call (an ``nn.Module`` type, a ``torch.*`` / ``F.*`` function, a tensor method or
a Python operator) maps to the ATen ops it runs, in order; the first of those that a target's
tables list decides the call's category for that target. Calls that map to nothing are on no
list and follow their inputs.
"""
from __future__ import annotations

import dataclasses
import operator
from typing import Callable, Dict, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from ._torch import OpOverload, OpOverloadPacket, op_schema, overload_name
from .op_args import INTERPOLATE as _INTERPOLATE, arg, einsum_ops, interpolate_ops, pad_ops
from .autocast_tables import (ATEN_TABLES, BANNED, FOLLOW, FP32, FP32_OPT,  # noqa: F401
                              LOWER, PROMOTE, TARGETS, aten_category)


# ---------------------------------------------------------------------------------------
# torch-level calls -> ATen ops
# ---------------------------------------------------------------------------------------
_LOSSES = {
    "mse_loss": "mse_loss", "l1_loss": "l1_loss", "smooth_l1_loss": "smooth_l1_loss",
    "huber_loss": "huber_loss", "kl_div": "kl_div", "nll_loss": "nll_loss",
    "poisson_nll_loss": "poisson_nll_loss", "cosine_embedding_loss": "cosine_embedding_loss",
    "hinge_embedding_loss": "hinge_embedding_loss", "margin_ranking_loss": "margin_ranking_loss",
    "multilabel_margin_loss": "multilabel_margin_loss", "soft_margin_loss": "soft_margin_loss",
    "triplet_margin_loss": "triplet_margin_loss", "multi_margin_loss": "multi_margin_loss",
    "binary_cross_entropy_with_logits": "binary_cross_entropy_with_logits",
    "binary_cross_entropy": "binary_cross_entropy", "ctc_loss": "ctc_loss.IntList",
    "gaussian_nll_loss": "log",
}

#: module type -> ATen ops its forward runs, in order.
MODULE_OPS: Dict[type, Tuple[str, ...]] = {
    nn.Linear: ("linear",), nn.Conv1d: ("conv1d",), nn.Conv2d: ("conv2d",),
    nn.Conv3d: ("conv3d",), nn.ConvTranspose1d: ("conv_transpose1d",),
    nn.ConvTranspose2d: ("conv_transpose2d.input",),
    nn.ConvTranspose3d: ("conv_transpose3d.input",), nn.PReLU: ("prelu",),
    nn.Bilinear: ("bilinear",), nn.LayerNorm: ("layer_norm",), nn.GroupNorm: ("group_norm",),
    nn.Softmax: ("softmax.int",), nn.Softmin: ("softmax.int",), nn.Softmax2d: ("softmax.int",),
    nn.LogSoftmax: ("log_softmax.int",), nn.Softplus: ("softplus",),
    nn.CosineSimilarity: ("cosine_similarity",), nn.PairwiseDistance: ("norm.ScalarOpt_dim",),
    nn.MSELoss: ("mse_loss",), nn.L1Loss: ("l1_loss",), nn.SmoothL1Loss: ("smooth_l1_loss",),
    nn.HuberLoss: ("huber_loss",), nn.KLDivLoss: ("kl_div",), nn.NLLLoss: ("nll_loss",),
    nn.CrossEntropyLoss: ("cross_entropy_loss", "log_softmax.int"),
    nn.BCELoss: ("binary_cross_entropy",),
    nn.BCEWithLogitsLoss: ("binary_cross_entropy_with_logits",),
    nn.PoissonNLLLoss: ("poisson_nll_loss",), nn.GaussianNLLLoss: ("log",),
    nn.CosineEmbeddingLoss: ("cosine_embedding_loss",),
    nn.HingeEmbeddingLoss: ("hinge_embedding_loss",),
    nn.MarginRankingLoss: ("margin_ranking_loss",),
    nn.MultiLabelMarginLoss: ("multilabel_margin_loss",),
    nn.SoftMarginLoss: ("soft_margin_loss",), nn.TripletMarginLoss: ("triplet_margin_loss",),
    nn.MultiMarginLoss: ("multi_margin_loss",), nn.CTCLoss: ("ctc_loss.IntList",),
    nn.AvgPool3d: ("avg_pool3d",), nn.MaxPool3d: ("max_pool3d",),
    nn.AdaptiveAvgPool3d: ("adaptive_avg_pool3d",), nn.AdaptiveMaxPool3d: ("adaptive_max_pool3d",),
    nn.FractionalMaxPool2d: ("fractional_max_pool2d",),
    nn.FractionalMaxPool3d: ("fractional_max_pool3d",),
    nn.MaxUnpool2d: ("max_unpool2d",), nn.MaxUnpool3d: ("max_unpool3d",),
    nn.ReflectionPad1d: ("reflection_pad1d",), nn.ReflectionPad2d: ("reflection_pad2d",),
    nn.ReplicationPad1d: ("replication_pad1d",), nn.ReplicationPad2d: ("replication_pad2d",),
    nn.ReplicationPad3d: ("replication_pad3d",),
}
if hasattr(nn, "RMSNorm"):
    MODULE_OPS[nn.RMSNorm] = ("rms_norm",)

#: torch.nn modules that are on no list (they run one op that follows its inputs).
FOLLOW_MODULES: Tuple[type, ...] = (
    nn.ReLU, nn.ReLU6, nn.GELU, nn.SiLU, nn.Mish, nn.Hardswish, nn.Hardsigmoid, nn.Sigmoid,
    nn.Tanh, nn.ELU, nn.CELU, nn.SELU, nn.LeakyReLU, nn.Hardtanh, nn.Softsign, nn.Tanhshrink,
    nn.Threshold, nn.GLU, nn.LogSigmoid, nn.Softshrink, nn.Hardshrink,
    nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout,
    nn.FeatureAlphaDropout, nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm,
    nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d,
    nn.MaxPool1d, nn.MaxPool2d, nn.AvgPool1d, nn.AvgPool2d, nn.AdaptiveAvgPool1d,
    nn.AdaptiveAvgPool2d, nn.AdaptiveMaxPool1d, nn.AdaptiveMaxPool2d,
    nn.Flatten, nn.Unflatten, nn.Identity, nn.Embedding, nn.EmbeddingBag, nn.ZeroPad1d,
    nn.ZeroPad2d, nn.ZeroPad3d, nn.ConstantPad1d, nn.ConstantPad2d, nn.ConstantPad3d,
    nn.CircularPad1d, nn.CircularPad2d, nn.CircularPad3d, nn.ReflectionPad3d,
    nn.PixelShuffle, nn.PixelUnshuffle, nn.ChannelShuffle, nn.Fold, nn.Unfold,
)

_F = {
    # lower precision
    "linear": ("linear",), "conv1d": ("conv1d",), "conv2d": ("conv2d",), "conv3d": ("conv3d",),
    "conv_tbc": ("conv_tbc",), "conv_transpose1d": ("conv_transpose1d",),
    "conv_transpose2d": ("conv_transpose2d.input",),
    "conv_transpose3d": ("conv_transpose3d.input",), "prelu": ("prelu",),
    "scaled_dot_product_attention": ("scaled_dot_product_attention",),
    "matmul": ("matmul",), "mm": ("mm",), "bmm": ("bmm",), "baddbmm": ("baddbmm",),
    "addmm": ("addmm",), "addbmm": ("addbmm",), "addmv": ("addmv",), "addr": ("addr",),
    "mv": ("mv",), "einsum": ("einsum", "bmm"),
    # composites: on CPU they decompose into mm/bmm, which CPU autocast lowers
    "chain_matmul": ("chain_matmul", "mm"), "multi_dot": ("linalg_multi_dot", "mm"),
    "vecdot": ("linalg_vecdot",),
    # fp32
    "exp": ("exp",), "expm1": ("expm1",), "log": ("log",), "log10": ("log10",),
    "log2": ("log2",), "log1p": ("log1p",), "reciprocal": ("reciprocal",), "rsqrt": ("rsqrt",),
    "acos": ("acos",), "arccos": ("acos",), "asin": ("asin",), "arcsin": ("asin",),
    "cosh": ("cosh",), "sinh": ("sinh",), "tan": ("tan",), "erfinv": ("erfinv",),
    "pow": ("pow.Tensor_Scalar",), "float_power": (), "softplus": ("softplus",),
    "layer_norm": ("layer_norm",), "group_norm": ("group_norm",), "rms_norm": ("rms_norm",),
    "cosine_similarity": ("cosine_similarity",), "pairwise_distance": ("norm.ScalarOpt_dim",),
    "dist": ("dist",), "cdist": ("cdist",), "pdist": ("pdist",), "renorm": ("renorm",),
    "logsumexp": ("logsumexp",), "frobenius_norm": ("frobenius_norm.dim",),
    "nuclear_norm": ("nuclear_norm",), "normalize": ("norm.ScalarOpt_dim",),
    "matrix_power": ("matmul",), "inner": ("tensordot", "mm"),
    "cross_entropy": ("cross_entropy_loss", "log_softmax.int"),
    "avg_pool3d": ("avg_pool3d",), "max_pool3d": ("max_pool3d",),
    "adaptive_avg_pool3d": ("adaptive_avg_pool3d",),
    "adaptive_max_pool3d": ("adaptive_max_pool3d",),
    "max_unpool2d": ("max_unpool2d",), "max_unpool3d": ("max_unpool3d",),
    "stft": ("stft",), "quantile": ("quantile",), "nanquantile": ("nanquantile",),
    "trace": ("trace",), "polar": ("polar",), "inverse": ("inverse",), "pinverse": ("pinverse",),
    # fp32 unless a dtype is given
    "softmax": ("softmax.int",), "softmin": ("softmax.int",),
    "log_softmax": ("log_softmax.int",), "sum": ("sum",), "cumsum": ("cumsum",),
    "cumprod": ("cumprod",), "prod": ("prod",), "norm": ("norm.ScalarOpt_dim",),
    "vector_norm": ("linalg_vector_norm",), "matrix_norm": ("linalg_matrix_norm",),
    # promote
    "addcdiv": ("addcdiv",), "addcmul": ("addcmul",), "atan2": ("atan2",),
    "arctan2": ("atan2",), "bilinear": ("bilinear",), "cross": ("cross",), "dot": ("dot",),
    "vdot": ("vdot",), "grid_sample": ("grid_sampler",), "index_put": ("index_put",),
    "tensordot": ("tensordot", "mm"), "scatter_add": ("scatter_add",), "cat": ("cat",),
    "concat": ("cat",), "concatenate": ("cat",), "stack": ("stack",),
    "index_copy": ("index_copy",),
}
_F.update({name: (aten,) for name, aten in _LOSSES.items()})

#: tensor methods -> ATen ops (in-place methods are never intercepted by autocast).
METHOD_OPS: Dict[str, Tuple[str, ...]] = {
    name: ops for name, ops in _F.items()
    if name in {
        "matmul", "mm", "bmm", "baddbmm", "addmm", "addbmm", "addmv", "addr", "mv", "exp",
        "expm1", "log", "log10", "log2", "log1p", "reciprocal", "rsqrt", "acos", "arccos",
        "asin", "arcsin", "cosh", "sinh", "tan", "erfinv", "pow", "renorm", "logsumexp",
        "softmax", "log_softmax", "sum", "cumsum", "cumprod", "prod", "norm", "addcdiv",
        "addcmul", "atan2", "arctan2", "cross", "dot", "vdot", "index_put", "scatter_add",
        "index_copy", "dist", "inverse", "pinverse", "trace", "quantile", "nanquantile",
        "stft", "prelu",
    }
}
METHOD_OPS["__rpow__"] = ("pow.Scalar",)
METHOD_OPS["__rtruediv__"] = ("reciprocal",)
METHOD_OPS["__rdiv__"] = ("reciprocal",)


#: composites whose pieces fall in different lists per target (pow, avg_pool3d ...):
#: autocast decides inside them at run time.
RUNTIME_FUNCTIONS = {F.local_response_norm, F.lp_pool1d, F.lp_pool2d,
                     getattr(F, "lp_pool3d", F.lp_pool2d)}
#: the polar decomposition (not ``torch.polar``) runs ``linalg_svd`` (fp32 on CPU) and then
#: ``matmul`` (lower): autocast decides inside it
if hasattr(torch.linalg, "polar"):
    RUNTIME_FUNCTIONS.add(torch.linalg.polar)
#: the same composites as ATen ops (a torch.export graph keeps them whole)
RUNTIME_ATEN = frozenset({"linalg_polar"})
#: prefixes of ATen composites that are another name of a listed op
#: (``aten.special_softmax`` runs ``softmax.int``, ``aten.linalg_norm`` runs ``norm``)
_ALIAS_PREFIXES = ("special_", "linalg_")
RUNTIME_MODULES = tuple(m for m in (nn.LocalResponseNorm, nn.LPPool1d, nn.LPPool2d,
                                    getattr(nn, "LPPool3d", None)) if m is not None)


#: per deployment target, the ATen ops that export to an ONNX op the engine has no FP16 kernel
#: for (its published operator table: ``export/tensorrt_ops.py``), with that ONNX op
ENGINE_FP32_OPS: Dict[str, Dict[str, str]] = {"tensorrt": {"stft": "STFT"}}
#: reductions whose depth (values reduced per output) the deployment plan checks
REDUCTION_OPS = frozenset({"sum", "mean", "var", "std", "var_mean", "std_mean", "norm",
                           "linalg_vector_norm", "prod", "cumsum", "cumprod", "logsumexp",
                           "nansum", "nanmean"})
#: calls on no autocast list that move values without computing (getitem, views, splits)
MOVE_OPS = frozenset({"getitem", "view", "reshape", "flatten", "permute", "transpose",
                      "contiguous", "expand", "squeeze", "unsqueeze", "chunk", "split",
                      "size", "unbind", "narrow", "select", "t", "clone", "detach"})
#: the model's own dtype conversions (``x.float()``, ``x.to(dtype)``)
CONVERSION_METHODS = frozenset({"to", "float", "double", "half", "bfloat16", "type",
                                "type_as"})


def _function_table() -> Dict[Callable, Tuple[str, ...]]:
    table: Dict[Callable, Tuple[str, ...]] = {}
    namespaces = (F, torch, torch.linalg, torch.special, torch.fft)
    for name, ops in _F.items():
        for ns in namespaces:
            fn = getattr(ns, name, None)
            if callable(fn) and fn not in table:
                table[fn] = ops
    for name in dir(torch.fft):
        if f"fft_{name}" in ATEN_TABLES["cpu"]:
            table[getattr(torch.fft, name)] = (f"fft_{name}",)
    for name in ("svd", "qr", "cholesky", "eig", "eigh", "eigvals", "eigvalsh", "inv", "solve",
                 "lstsq", "svdvals", "cond", "matrix_rank", "householder_product",
                 "tensorinv", "tensorsolve", "cholesky_ex", "inv_ex"):
        fn = getattr(torch.linalg, name, None)
        if fn is not None:
            table[fn] = (f"linalg_{name}",)
    table[torch.linalg.norm] = ("linalg_vector_norm",)
    table[operator.matmul] = ("matmul",)
    table[operator.pow] = ("pow.Tensor_Scalar",)
    table[torch.Tensor.__rpow__] = ("pow.Scalar",)
    return table


#: torch / F / operator functions -> ATen ops.
FUNCTION_OPS: Dict[Callable, Tuple[str, ...]] = _function_table()

#: the torch losses (the loss pass gives them fp32 inputs): nn modules, F functions, and the
#: ATen ops a torch.export graph names them by (those the modules and functions run, e.g.
#: ``binary_cross_entropy`` for ``F.binary_cross_entropy`` / ``nn.BCELoss``, plus the ATen
#: losses with no such table entry)
_LOSS_SUFFIXES = ("_loss", "cross_entropy", "kl_div")
LOSS_MODULES: Tuple[type, ...] = tuple(cls for cls in MODULE_OPS
                                       if cls.__name__.endswith("Loss"))
LOSS_FUNCTIONS = frozenset(fn for fn in FUNCTION_OPS
                           if getattr(fn, "__name__", "").endswith(_LOSS_SUFFIXES))
ATEN_LOSSES = frozenset({
    "cross_entropy_loss", "mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss", "kl_div",
    "nll_loss", "nll_loss2d", "binary_cross_entropy_with_logits", "poisson_nll_loss",
    "soft_margin_loss", "margin_ranking_loss", "hinge_embedding_loss",
    "multilabel_margin_loss", "multi_margin_loss"} | {
    name.split(".")[0] for table in ([FUNCTION_OPS[fn] for fn in LOSS_FUNCTIONS]
                                     + [MODULE_OPS[cls] for cls in LOSS_MODULES])
    for name in table if name.split(".")[0].endswith(_LOSS_SUFFIXES)})

def category_of(ops: Tuple[str, ...], target: str) -> Tuple[str, Optional[str]]:
    """The category that decides a call running ``ops`` on ``target``, and the deciding op."""
    for op in ops:
        category = aten_category(op, target)
        if category is not None:
            return category, op
    return FOLLOW, None


# ---------------------------------------------------------------------------------------
# fx nodes -> torch-level label and ATen ops
# ---------------------------------------------------------------------------------------
_FOLLOW_NAMESPACES = ("torch", "operator", "_operator", "builtins", "math")

#: callables fxamp can see into no further than their call (custom Functions, fx.wrap'ed
#: functions, custom ops): their decision is left to autocast at run time.
RUNTIME = None


def module_label(module: nn.Module) -> str:
    """``nn.Linear`` for torch.nn modules, else the class's module and qualified name."""
    cls = type(module)
    if cls.__module__.startswith("torch.nn"):
        return f"nn.{cls.__name__}"
    return f"{cls.__module__}.{cls.__qualname__}"


def is_aten(fn: object) -> bool:
    """Whether ``fn`` is an ATen op overload (the targets of a torch.export graph)."""
    return isinstance(fn, OpOverload) and fn.namespace == "aten"


def aten_name(fn: OpOverload) -> str:
    """``pow.Tensor_Scalar`` / ``linear`` for an ATen overload (``default`` dropped)."""
    base = op_schema(fn).name.split("::", 1)[-1]
    overload = overload_name(fn)
    return base if overload == "default" else f"{base}.{overload}"


def call_name(node: "torch.fx.Node") -> str:
    """A call's bare function or method name (``exp``, ``add``); "" for modules and non-calls.

    ATen overloads give their op name (``aten.sum.dim_IntList`` -> ``sum``), so passes that
    match hand-written patterns by name see fx and torch.export graphs alike."""
    if node.op == "call_method":
        return str(node.target)
    if node.op == "call_function":
        if is_aten(node.target):
            return op_schema(node.target).name.split("::", 1)[-1]
        return getattr(node.target, "__name__", str(node.target))
    return ""


def callable_label(fn: object) -> str:
    """A short stable label for a callable: ``F.softmax``, ``torch.cat``, ``operator.add``."""
    if isinstance(fn, str):
        return f"Tensor.{fn}"
    if is_aten(fn):
        return f"aten.{aten_name(fn)}"
    name = getattr(fn, "__name__", None) or repr(fn)
    owner = getattr(fn, "fxamp_function", None)
    if isinstance(owner, type):
        return f"{owner.__module__}.{owner.__qualname__}.apply"
    for prefix, ns in (("F", F), ("torch", torch), ("torch.linalg", torch.linalg),
                       ("torch.fft", torch.fft), ("torch.special", torch.special),
                       ("operator", operator)):
        if getattr(ns, name, None) is fn:
            return f"{prefix}.{name}"
        stem = prefix.rpartition(".")[2] + "_"  # torch._C._fft.fft_rfft is torch.fft.rfft
        if prefix.startswith("torch.") and name.startswith(stem) and getattr(
                ns, name[len(stem):], None) is fn:
            return f"{prefix}.{name[len(stem):]}"
    module = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", name)
    return f"{module}.{qualname}" if module else qualname


def _is_torch_callable(fn: object) -> bool:
    if isinstance(fn, (OpOverloadPacket, OpOverload)):
        return str(fn).startswith("aten")
    module = getattr(fn, "__module__", None)
    if module is None:  # builtin methods of torch._C._VariableFunctions, etc.
        return getattr(torch, getattr(fn, "__name__", ""), None) is fn
    return module.split(".")[0] in _FOLLOW_NAMESPACES


def node_ops(node: "torch.fx.Node", root: nn.Module) -> Tuple[str, Optional[Tuple[str, ...]]]:
    """The torch-level label of ``node`` and the ATen ops it runs (None: opaque, runtime)."""
    if node.op == "call_module":
        module = root.get_submodule(node.target)
        label = module_label(module)
        if isinstance(module, nn.Upsample):
            return label, interpolate_ops(module.mode)
        ops = MODULE_OPS.get(type(module))
        if ops is not None:
            return label, ops
        if isinstance(module, RUNTIME_MODULES):
            return label, RUNTIME
        if type(module) in FOLLOW_MODULES:
            return label, ()
        for cls, ops in MODULE_OPS.items():  # subclasses that keep the forward
            if isinstance(module, cls) and type(module).forward is cls.forward:
                return label, ops
        if isinstance(module, FOLLOW_MODULES) and any(
                type(module).forward is cls.forward for cls in FOLLOW_MODULES
                if isinstance(module, cls)):
            return label, ()
        return label, RUNTIME
    if node.op == "call_method":
        return f"Tensor.{node.target}", METHOD_OPS.get(node.target, ())
    if node.op != "call_function":
        return node.op, ()
    fn = node.target
    label = callable_label(fn)
    if is_aten(fn):  # torch.export graphs: the op itself is what autocast's tables name
        name = aten_name(fn)
        if name.startswith("einsum"):
            return label, einsum_ops(node.args)
        if name.split(".")[0] in RUNTIME_ATEN:
            return label, RUNTIME
        prefix = next((p for p in _ALIAS_PREFIXES if name.startswith(p)), "")
        return label, (name, name[len(prefix):].split(".")[0]) if prefix else (name,)
    if fn in _INTERPOLATE:
        mode = arg(node, "mode", 3, "nearest")
        if fn is F.upsample_bilinear:
            mode = "bilinear"
        antialias = bool(node.kwargs.get("antialias", False))
        return label, interpolate_ops(mode if isinstance(mode, str) else "nearest", antialias)
    if fn is F.pad:
        mode = arg(node, "mode", 2, "constant")
        pad = arg(node, "pad", 1, ())
        return label, pad_ops(mode, len(pad) if isinstance(pad, (list, tuple)) else 0)
    if fn in RUNTIME_FUNCTIONS:
        return label, RUNTIME
    if isinstance(fn, type) and (dataclasses.is_dataclass(fn) or issubclass(fn, (dict, tuple))):
        return label, ()  # an output container (ModelOutput, a dataclass): holds its inputs
    if fn is torch.einsum:
        return label, einsum_ops(node.args)
    if fn is operator.truediv and node.args and not isinstance(node.args[0], torch.fx.Node):
        return label, ("reciprocal",)
    try:
        ops = FUNCTION_OPS.get(fn)
    except TypeError:  # unhashable target
        ops = None
    if ops is not None:
        return label, ops
    if _is_torch_callable(fn):
        return label, ()
    return label, RUNTIME
