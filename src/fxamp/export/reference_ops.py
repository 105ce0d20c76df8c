"""``onnx.reference`` with PyTorch kernels for Conv, ConvTranspose, MaxPool, MatMul and Gemm:
the true-FP16 run, faster; and GatherElements as the ONNX spec defines it.

The true-FP16 check (``verify.check_true_fp16``) runs the exported file with
``onnx.reference.ReferenceEvaluator``, every op in its declared type. Its Conv is an
``im2col`` in numpy followed by a matrix product, and its MaxPool a Python loop over the
output: on a ResNet-18 at 64x64 they are 0.9 s of the check's 1 s. :func:`evaluator` gives
the same evaluator with these ops computed by PyTorch, to the same numbers:

- Conv: numpy's FP16 matrix product rounds the inputs' FP16 values, sums the products in
  FP32 and rounds the sum to FP16; the bias is then added in FP16. Here the FP16 input and
  weight are widened to FP32 (exact), convolved in FP32, the result rounded to FP16, and
  the bias added in FP16: the same roundings, the terms summed in another order.
- MaxPool: a max rounds nothing; computed on the widened values and narrowed back, exactly.
- ConvTranspose: onnx.reference multiplies in FP16 (FP32 sums, one rounding), then adds
  the overlapping kernel positions into an FP16 image (``col2im``: one more rounding per
  overlap) and the bias in FP16; here the widened inputs are transposed-convolved in FP32,
  rounded once, and the bias added in FP16. Where kernel positions do not overlap (kernel
  <= stride: a UNet's 2x2 up-sampling) the roundings are the same; where they do, this one
  rounds less (0.4 s of a two-level UNet's 0.43 s check before).
- MatMul (FP16): numpy's FP16 product sums in FP32 and rounds once, as the Conv's does;
  here the widened inputs are multiplied in FP32 and the result rounded to FP16 (0.2 s of a
  ViT-Tiny's 0.29 s check before).
- Gemm (FP16, 2-D): the product as MatMul's, then ``alpha`` and the bias in FP16 as
  onnx.reference adds them (GPT-2 small's 48 Gemms were 109 s of its 113 s check).
- GatherElements: onnx.reference (1.23) gathers with ``np.choose``, which takes at most 64
  choices (32 with numpy 1): a gathered axis longer than that raises, and its 2-D fallback
  reads one index per row (BERT's ``token_type_ids`` buffer gathered at the position ids,
  a (1, 512) gather of (1, 128) indices: "cannot reshape array of size 1 into shape
  (1,128)"; a (N, 1) gather along axis 0 is silently wrong). It also refuses indices
  smaller than the data on the other axes, which the spec (and onnxruntime) accept, and
  wraps an out-of-range index around. Here it is a plain gather, the spec's
  ``out[i][j] = data[indices[i][j]][j]`` (axis 0): ``np.take_along_axis`` on the data cut
  to the indices' extent on the other axes, negative indices counted from the end, an
  index out of range an error (as onnxruntime's). No arithmetic: every dtype, exactly.

Anything these kernels do not cover (``auto_pad`` SAME_*, MaxPool's indices output,
asymmetric pool or transposed-convolution pads, ConvTranspose's ``output_shape``, other
dtypes) runs onnx.reference's own implementation.
"""
from __future__ import annotations

import functools
from typing import Any, List, Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F

#: the dtypes the kernels take (others run onnx.reference's own)
_FLOATS = (np.float16, np.float32)


def _explicit_pads(auto_pad: Any, pads: Optional[Sequence[int]], dims: int
                   ) -> Optional[List[int]]:
    """ONNX ``pads`` (begins, then ends) for ``auto_pad`` NOTSET / VALID, None otherwise."""
    mode = auto_pad.decode() if isinstance(auto_pad, bytes) else (auto_pad or "NOTSET")
    if mode == "VALID":
        return [0] * (2 * dims)
    if mode != "NOTSET":
        return None
    return list(pads) if pads is not None else [0] * (2 * dims)


def _conv(x: np.ndarray, w: np.ndarray, b: Optional[np.ndarray], auto_pad: Any,
          dilations: Any, group: Any, pads: Any, strides: Any) -> Optional[np.ndarray]:
    """The Conv in PyTorch (see the module doc), or None where it does not apply."""
    dims = x.ndim - 2
    if x.dtype.type not in _FLOATS or w.dtype != x.dtype or not 1 <= dims <= 3 \
            or (b is not None and b.dtype != x.dtype):
        return None
    explicit = _explicit_pads(auto_pad, pads, dims)
    if explicit is None:
        return None
    xt = torch.from_numpy(np.array(x, dtype=np.float32))  # (a writable FP32 copy)
    if any(explicit):  # F.pad takes (last dim begin, end, ..., first dim begin, end)
        xt = F.pad(xt, [p for d in reversed(range(dims)) for p in (explicit[d],
                                                                    explicit[d + dims])])
    conv = (F.conv1d, F.conv2d, F.conv3d)[dims - 1]
    out = conv(xt, torch.from_numpy(np.array(w, dtype=np.float32)), None,
               stride=list(strides) if strides is not None else 1,
               dilation=list(dilations) if dilations is not None else 1,
               groups=int(group) if group else 1).numpy().astype(x.dtype)
    if b is not None:
        out = out + (b if b.size == 1 else b.reshape((1, -1) + (1,) * dims))
    return out.astype(x.dtype)


def _max_pool(x: np.ndarray, auto_pad: Any, ceil_mode: Any, dilations: Any,
              kernel_shape: Any, pads: Any, storage_order: Any, strides: Any
              ) -> Optional[np.ndarray]:
    """The MaxPool in PyTorch, or None where it does not apply."""
    dims = x.ndim - 2
    if x.dtype.type not in _FLOATS or not 1 <= dims <= 3 or storage_order \
            or kernel_shape is None:
        return None
    explicit = _explicit_pads(auto_pad, pads, dims)
    if explicit is None or explicit[:dims] != explicit[dims:] \
            or any(2 * p > k for p, k in zip(explicit, kernel_shape)):
        return None  # (PyTorch pads symmetrically, by at most half the kernel)
    pool = (F.max_pool1d, F.max_pool2d, F.max_pool3d)[dims - 1]
    out = pool(torch.from_numpy(np.array(x, dtype=np.float32)), list(kernel_shape),
               stride=list(strides) if strides is not None else 1,  # (ONNX: 1)
               padding=explicit[:dims],
               dilation=list(dilations) if dilations is not None else 1,
               ceil_mode=bool(ceil_mode))
    return out.numpy().astype(x.dtype)


def _conv_transpose(x: np.ndarray, w: np.ndarray, b: Optional[np.ndarray], auto_pad: Any,
                    dilations: Any, group: Any, output_padding: Any, output_shape: Any,
                    pads: Any, strides: Any) -> Optional[np.ndarray]:
    """The ConvTranspose in PyTorch (see the module doc), or None where it does not apply:
    symmetric explicit pads, no ``output_shape``."""
    dims = x.ndim - 2
    if x.dtype.type not in _FLOATS or w.dtype != x.dtype or not 1 <= dims <= 3 \
            or (b is not None and b.dtype != x.dtype) or output_shape is not None:
        return None
    explicit = _explicit_pads(auto_pad, pads, dims)
    if explicit is None or explicit[:dims] != explicit[dims:]:
        return None
    conv = (F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d)[dims - 1]
    out = conv(torch.from_numpy(np.array(x, dtype=np.float32)),
               torch.from_numpy(np.array(w, dtype=np.float32)), None,
               stride=list(strides) if strides is not None else 1, padding=explicit[:dims],
               output_padding=list(output_padding) if output_padding is not None else 0,
               groups=int(group) if group else 1,
               dilation=list(dilations) if dilations is not None else 1).numpy().astype(x.dtype)
    if b is not None:
        out = out + b.reshape((1, -1) + (1,) * dims)
    return out.astype(x.dtype)


def _matmul(a: np.ndarray, b: np.ndarray) -> Optional[np.ndarray]:
    """The FP16 MatMul in PyTorch (see the module doc), or None where it does not apply."""
    if a.dtype != np.float16 or b.dtype != np.float16 or a.ndim == 0 or b.ndim == 0:
        return None
    out = torch.matmul(torch.from_numpy(np.array(a, dtype=np.float32)),
                       torch.from_numpy(np.array(b, dtype=np.float32)))
    return out.numpy().astype(np.float16)


def _gemm(a: np.ndarray, b: np.ndarray, c: Optional[np.ndarray], alpha: Any, beta: Any,
          trans_a: Any, trans_b: Any) -> Optional[np.ndarray]:
    """The FP16 Gemm in PyTorch, or None where it does not apply: onnx.reference's
    ``np.dot`` of FP16 matrices (no BLAS: 2 s for one of GPT-2's 2x128x768x3072 products)
    sums in FP32 and rounds once, as :func:`_matmul`; the scaling by ``alpha`` and the
    bias (``beta * c``) then follow in numpy as onnx.reference writes them, the same
    roundings."""
    if a.ndim != 2 or b.ndim != 2:
        return None
    product = _matmul(a.T if trans_a else a, b.T if trans_b else b)
    if product is None:
        return None
    o = product * alpha
    if c is not None and beta != 0:
        o += c * beta
    return o.astype(a.dtype)


def gather_elements(data: np.ndarray, indices: np.ndarray, axis: int = 0
                    ) -> Optional[np.ndarray]:
    """ONNX GatherElements (see the module doc), or None where the shapes are not the
    spec's (ranks differ, an index axis longer than the data's): onnx.reference's own
    then says what is wrong.

    Args:
        data: the gathered tensor, of any dtype.
        indices: integer indices along ``axis``, of ``data``'s rank; on the other axes at
            most as long as ``data``.
        axis: the gathered axis (negative: from the end).

    Returns:
        An array of ``indices``' shape and ``data``'s dtype.

    Raises:
        IndexError: an index is outside ``[-n, n)``, ``n`` the length of ``axis``.
    """
    rank = data.ndim
    if indices.ndim != rank or rank == 0 or not -rank <= axis < rank \
            or indices.dtype.kind not in "iu":
        return None
    axis %= rank
    if any(i > d for k, (i, d) in enumerate(zip(indices.shape, data.shape)) if k != axis):
        return None
    n = data.shape[axis]
    index = indices.astype(np.int64, copy=False)
    if index.size and (int(index.min()) < -n or int(index.max()) >= n):
        bad = int(index.min()) if int(index.min()) < -n else int(index.max())
        raise IndexError(f"GatherElements: index {bad} is out of range for an axis of "
                         f"length {n} (axis {axis} of data shaped {tuple(data.shape)})")
    index = np.where(index < 0, index + n, index)
    cut = tuple(slice(None) if k == axis else slice(0, size)
                for k, size in enumerate(indices.shape))
    return np.take_along_axis(data[cut], index, axis=axis)


@functools.lru_cache(maxsize=None)
def _kernels() -> List[type]:
    """The OpRun classes (built on first use: ``import fxamp`` never imports onnx)."""
    from onnx.reference.ops.op_conv import Conv as RefConv
    from onnx.reference.ops.op_conv_transpose import ConvTranspose as RefConvTranspose
    from onnx.reference.ops.op_gather_elements import GatherElements as RefGatherElements
    from onnx.reference.ops.op_gemm import Gemm_7 as RefGemm
    from onnx.reference.ops.op_matmul import MatMul as RefMatMul
    from onnx.reference.ops.op_max_pool import MaxPool as RefMaxPool

    class Conv(RefConv):
        def _run(self, X, W, B=None, auto_pad=None, dilations=None, group=None,  # noqa: N803
                 kernel_shape=None, pads=None, strides=None):
            out = _conv(X, W, B, auto_pad, dilations, group, pads, strides)
            if out is None:
                return super()._run(X, W, B, auto_pad=auto_pad, dilations=dilations,
                                    group=group, kernel_shape=kernel_shape, pads=pads,
                                    strides=strides)
            return (out,)

    class MaxPool(RefMaxPool):
        def _run(self, x, auto_pad=None, ceil_mode=None, dilations=None,
                 kernel_shape=None, pads=None, storage_order=None, strides=None):
            out = None
            if len([o for o in self.onnx_node.output if o]) == 1:  # (no Indices)
                out = _max_pool(x, auto_pad, ceil_mode, dilations, kernel_shape, pads,
                                storage_order, strides)
            if out is None:
                return super()._run(x, auto_pad=auto_pad, ceil_mode=ceil_mode,
                                    dilations=dilations, kernel_shape=kernel_shape,
                                    pads=pads, storage_order=storage_order,
                                    strides=strides)
            return (out,)

    class MatMul(RefMatMul):
        def _run(self, a, b):
            out = _matmul(a, b)
            return super()._run(a, b) if out is None else (out,)

    class ConvTranspose(RefConvTranspose):
        def _run(self, X, W, B=None, auto_pad=None, dilations=None, group=None,  # noqa: N803
                 kernel_shape=None, output_padding=None, output_shape=None, pads=None,
                 strides=None):
            out = _conv_transpose(X, W, B, auto_pad, dilations, group, output_padding,
                                  output_shape, pads, strides)
            if out is None:
                return super()._run(X, W, B, auto_pad=auto_pad, dilations=dilations,
                                    group=group, kernel_shape=kernel_shape,
                                    output_padding=output_padding,
                                    output_shape=output_shape, pads=pads, strides=strides)
            return (out,)

    class Gemm(RefGemm):
        def _run(self, a, b, c=None, alpha=None, beta=None, transA=None,  # noqa: N803
                 transB=None):
            out = _gemm(a, b, c, alpha, beta, transA, transB)
            if out is None:
                return super()._run(a, b, c, alpha=alpha, beta=beta, transA=transA,
                                    transB=transB)
            return (out,)

    class GatherElements(RefGatherElements):
        def _run(self, data, indices, axis=None):
            out = gather_elements(data, indices, 0 if axis is None else int(axis))
            return super()._run(data, indices, axis=axis) if out is None else (out,)

    return [Conv, MaxPool, MatMul, ConvTranspose, Gemm, GatherElements]


def evaluator(proto: Any) -> Any:
    """An ``onnx.reference.ReferenceEvaluator`` of ``proto`` computing every op in its
    declared type, Conv, ConvTranspose, MaxPool, FP16 MatMul and Gemm with PyTorch kernels and
    GatherElements as the spec defines it (see the module doc).

    Args:
        proto: the ONNX model (a ``ModelProto``).

    Returns:
        The evaluator.
    """
    from onnx.reference import ReferenceEvaluator

    return ReferenceEvaluator(proto, new_ops=_kernels())
