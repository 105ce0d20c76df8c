"""Autocast's op tables per target, at ATen level: op overload name -> category.

They mirror ``aten/src/ATen/autocast_mode.cpp`` of the installed torch (2.14);
``tests/test_oplists.py`` checks them against the autocast kernels torch registers and against
what ``torch.autocast`` really does. Read through :mod:`fxamp.ops` (``tests/test_layers.py``
checks that only the op vocabulary imports the tables).
"""
from __future__ import annotations

from typing import Dict, Optional

LOWER = "lower"  # runs in the low-precision dtype
FP32 = "fp32"  # runs in fp32
FP32_OPT = "fp32_opt"  # runs in fp32 unless an explicit dtype is given
PROMOTE = "promote"  # runs in the widest dtype of its inputs
BANNED = "banned"  # autocast raises
FOLLOW = "follow"  # on no list: runs in whatever its inputs are

TARGETS = ("cuda", "cpu")

_UPSAMPLE = (
    "upsample_nearest1d upsample_nearest2d upsample_nearest3d upsample_linear1d "
    "upsample_bilinear2d upsample_trilinear3d upsample_bicubic2d _upsample_nearest_exact1d "
    "_upsample_nearest_exact2d _upsample_nearest_exact3d _upsample_bilinear2d_aa "
    "_upsample_bicubic2d_aa"
)

_CUDA_TEXT = {
    LOWER: (
        "_convolution _convolution.deprecated conv1d conv2d conv3d conv_tbc conv_transpose1d "
        "conv_transpose2d.input conv_transpose3d.input convolution prelu addmm addmv addr "
        "matmul einsum mm mv linalg_vecdot linear addbmm baddbmm bmm chain_matmul "
        "linalg_multi_dot _thnn_fused_lstm_cell _thnn_fused_gru_cell lstm_cell gru_cell "
        "rnn_tanh_cell rnn_relu_cell _scaled_dot_product_flash_attention "
        "scaled_dot_product_attention cudnn_convolution cudnn_convolution_transpose _cudnn_rnn"
    ),
    FP32: (
        "acos asin cosh erfinv exp expm1 log log10 log2 log1p reciprocal rsqrt sinh tan "
        "pow.Tensor_Scalar pow.Tensor_Tensor pow.Scalar softplus layer_norm native_layer_norm "
        "group_norm rms_norm frobenius_norm.dim nuclear_norm nuclear_norm.dim cosine_similarity "
        "poisson_nll_loss cosine_embedding_loss nll_loss nll_loss2d hinge_embedding_loss kl_div "
        "l1_loss smooth_l1_loss huber_loss mse_loss margin_ranking_loss multilabel_margin_loss "
        "soft_margin_loss triplet_margin_loss multi_margin_loss binary_cross_entropy_with_logits "
        "dist pdist cdist renorm logsumexp linalg_matrix_sqrth " + _UPSAMPLE
    ),
    FP32_OPT: (
        "prod prod.dim_int softmax.int log_softmax.int cumprod cumsum linalg_vector_norm "
        "linalg_matrix_norm linalg_matrix_norm.str_ord sum sum.dim_IntList "
        "norm.Scalar norm.ScalarOpt_dim"
    ),
    PROMOTE: (
        "addcdiv addcmul atan2 bilinear cross dot vdot grid_sampler index_put tensordot "
        "scatter_add"
    ),
    BANNED: "binary_cross_entropy",
}

_CPU_TEXT = {
    LOWER: (
        "conv1d conv1d.padding conv2d conv2d.padding conv3d conv3d.padding bmm mm "
        "linalg_vecdot baddbmm addmm addbmm linear _convolution.deprecated matmul conv_tbc "
        "mkldnn_rnn_layer conv_transpose1d conv_transpose2d.input conv_transpose3d.input prelu "
        "scaled_dot_product_attention _native_multi_head_attention _addmm_activation"
    ),
    FP32: (
        "avg_pool3d binary_cross_entropy grid_sampler polar prod prod.dim_int quantile "
        "quantile.scalar nanquantile nanquantile.scalar stft stft.center cdist trace "
        "view_as_complex cholesky_inverse cholesky_solve inverse lu_solve orgqr ormqr pinverse "
        "max_pool3d max_unpool2d max_unpool3d adaptive_avg_pool3d adaptive_max_pool3d "
        "reflection_pad1d reflection_pad2d replication_pad1d replication_pad2d replication_pad3d "
        "mse_loss cosine_embedding_loss nll_loss nll_loss2d hinge_embedding_loss poisson_nll_loss "
        "smooth_l1_loss cross_entropy_loss l1_loss huber_loss margin_ranking_loss soft_margin_loss "
        "triplet_margin_loss multi_margin_loss ctc_loss.IntList ctc_loss.Tensor kl_div "
        "multilabel_margin_loss binary_cross_entropy_with_logits fft_fft fft_ifft fft_fft2 "
        "fft_ifft2 fft_fftn fft_ifftn fft_rfft fft_irfft fft_rfft2 fft_irfft2 fft_rfftn "
        "fft_irfftn fft_hfft fft_ihfft linalg_cond linalg_cond.p_str linalg_matrix_rank "
        "linalg_matrix_rank.atol_rtol_float linalg_matrix_rank.atol_rtol_tensor "
        "linalg_matrix_rank.tol_tensor linalg_solve linalg_cholesky linalg_svdvals "
        "linalg_eigvals linalg_eigvalsh linalg_inv linalg_householder_product linalg_tensorinv "
        "linalg_tensorsolve fake_quantize_per_tensor_affine geqrf _lu_with_info svd "
        "triangular_solve fractional_max_pool2d fractional_max_pool3d adaptive_max_pool3d "
        "multilabel_margin_loss_forward linalg_qr linalg_cholesky_ex linalg_svd linalg_eig "
        "linalg_eigh linalg_lstsq linalg_inv_ex linalg_matrix_sqrth grid_sampler_2d "
        "grid_sampler_3d _grid_sampler_2d_cpu_fallback"
    ),
    FP32_OPT: "",
    PROMOTE: "stack cat index_copy",
    BANNED: "",
}


def _parse(text: Dict[str, str]) -> Dict[str, str]:
    table: Dict[str, str] = {}
    for category, names in text.items():
        for name in names.split():
            table[name] = category
    return table


#: ATen overload name ("pow.Tensor_Scalar", "sum") -> category, per target.
ATEN_TABLES: Dict[str, Dict[str, str]] = {"cuda": _parse(_CUDA_TEXT), "cpu": _parse(_CPU_TEXT)}


def aten_category(op: str, target: str) -> Optional[str]:
    """The category of ATen op ``op`` (overload name or base name) for ``target``, or None."""
    from .policy import autocast_device

    table = ATEN_TABLES[autocast_device(target)]
    if op in table:
        return table[op]
    base = op.split(".")[0]
    for name, category in table.items():
        if name.split(".")[0] == base:
            return category
    return None
