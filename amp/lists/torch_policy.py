"""torch's own autocast policy (torch 2.13), per device type, as data: the aten ops torch
registers for autocast and what it does to each. Read by amp/lists/agreement.py, which compares
amp's tables with it; tests/lists/test_agreement.py checks it against the installed torch's
dispatcher (the same ops, no more, no fewer) and runs samples of each kind.

Sources: aten/src/ATen/autocast_mode.cpp and autocast_mode.h (torch 2.13), through
../shared/reference/torch_amp.md §3 and autocast_registered_ops_torch2.13.json. An op is named
by its base name: every overload of it torch registers has the same kind.
"""

__all__ = [
    "PARTIAL",
    "UNCAST_OVERLOADS",
    "LOWER_PRECISION_FP",
    "FP32",
    "FP32_SET_OPT_DTYPE",
    "FP32_APPEND_DTYPE",
    "PROMOTE",
    "BANNED",
    "POLICY",
]

# torch's kinds (at::autocast::CastPolicy).
LOWER_PRECISION_FP = "lower_precision_fp"  # every eligible tensor to the region's dtype
FP32 = "fp32"  # every eligible tensor to float32, whatever dtype= says
FP32_SET_OPT_DTYPE = "fp32_set_opt_dtype"  # dtype=float32 unless the call names a dtype
FP32_APPEND_DTYPE = "fp32_append_dtype"  # redispatched to the overload taking dtype=float32
PROMOTE = "promote"  # the widest eligible floating type; fp16 with bf16 raises
BANNED = "banned"  # raises whatever the inputs

_CUDA_LOWER_PRECISION_FP = (
    "_convolution",
    "conv1d",
    "conv2d",
    "conv3d",
    "conv_tbc",
    "conv_transpose1d",
    "conv_transpose2d",
    "conv_transpose3d",
    "convolution",
    "cudnn_convolution",
    "cudnn_convolution_transpose",
    "prelu",
    "addmm",
    "addmv",
    "addr",
    "matmul",
    "einsum",
    "mm",
    "mv",
    "linalg_vecdot",
    "linear",
    "addbmm",
    "baddbmm",
    "bmm",
    "chain_matmul",
    "linalg_multi_dot",
    "_thnn_fused_lstm_cell",
    "_thnn_fused_gru_cell",
    "lstm_cell",
    "gru_cell",
    "rnn_tanh_cell",
    "rnn_relu_cell",
    "_scaled_dot_product_flash_attention",
    "scaled_dot_product_attention",
)

_CUDA_FP32 = (
    "acos",
    "asin",
    "cosh",
    "erfinv",
    "exp",
    "expm1",
    "log",
    "log10",
    "log2",
    "log1p",
    "reciprocal",
    "rsqrt",
    "sinh",
    "tan",
    "pow",
    "softplus",
    "layer_norm",
    "native_layer_norm",
    "rms_norm",
    "group_norm",
    "frobenius_norm",
    "nuclear_norm",
    "cosine_similarity",
    "poisson_nll_loss",
    "cosine_embedding_loss",
    "nll_loss",
    "nll_loss2d",
    "hinge_embedding_loss",
    "kl_div",
    "l1_loss",
    "smooth_l1_loss",
    "huber_loss",
    "mse_loss",
    "margin_ranking_loss",
    "multilabel_margin_loss",
    "soft_margin_loss",
    "triplet_margin_loss",
    "multi_margin_loss",
    "binary_cross_entropy_with_logits",
    "dist",
    "pdist",
    "cdist",
    "renorm",
    "logsumexp",
    "upsample_nearest1d",
    "_upsample_nearest_exact1d",
    "upsample_nearest2d",
    "_upsample_nearest_exact2d",
    "upsample_nearest3d",
    "_upsample_nearest_exact3d",
    "upsample_linear1d",
    "upsample_bilinear2d",
    "_upsample_bilinear2d_aa",
    "upsample_trilinear3d",
    "upsample_bicubic2d",
    "_upsample_bicubic2d_aa",
)

_CUDA_FP32_SET_OPT_DTYPE = (
    "prod",
    "softmax",
    "log_softmax",
    "cumprod",
    "cumsum",
    "linalg_vector_norm",
    "linalg_matrix_norm",
    "sum",
)

_CUDA_PROMOTE = (
    "addcdiv",
    "addcmul",
    "atan2",
    "bilinear",
    "cross",
    "dot",
    "vdot",
    "grid_sampler",
    "index_put",
    "tensordot",
    "scatter_add",
)

_CPU_LOWER_PRECISION_FP = (
    "conv1d",
    "conv2d",
    "conv3d",
    "bmm",
    "mm",
    "linalg_vecdot",
    "baddbmm",
    "addmm",
    "_addmm_activation",
    "addbmm",
    "linear",
    "matmul",
    "conv_tbc",
    "mkldnn_rnn_layer",
    "conv_transpose1d",
    "conv_transpose2d",
    "conv_transpose3d",
    "prelu",
    "scaled_dot_product_attention",
    "_native_multi_head_attention",
)

_CPU_FP32 = (
    "avg_pool3d",
    "binary_cross_entropy",
    "grid_sampler",
    "polar",
    "prod",
    "quantile",
    "nanquantile",
    "stft",
    "cdist",
    "grid_sampler_2d",
    "_grid_sampler_2d_cpu_fallback",
    "grid_sampler_3d",
    "trace",
    "view_as_complex",
    "cholesky",
    "cholesky_inverse",
    "cholesky_solve",
    "inverse",
    "lu_solve",
    "orgqr",
    "ormqr",
    "pinverse",
    "max_pool3d",
    "max_unpool2d",
    "max_unpool3d",
    "adaptive_avg_pool3d",
    "reflection_pad1d",
    "reflection_pad2d",
    "replication_pad1d",
    "replication_pad2d",
    "replication_pad3d",
    "mse_loss",
    "cosine_embedding_loss",
    "nll_loss",
    "nll_loss2d",
    "hinge_embedding_loss",
    "poisson_nll_loss",
    "smooth_l1_loss",
    "cross_entropy_loss",
    "l1_loss",
    "huber_loss",
    "margin_ranking_loss",
    "soft_margin_loss",
    "triplet_margin_loss",
    "multi_margin_loss",
    "ctc_loss",
    "kl_div",
    "multilabel_margin_loss",
    "binary_cross_entropy_with_logits",
    "fft_fft",
    "fft_ifft",
    "fft_fft2",
    "fft_ifft2",
    "fft_fftn",
    "fft_ifftn",
    "fft_rfft",
    "fft_irfft",
    "fft_rfft2",
    "fft_irfft2",
    "fft_rfftn",
    "fft_irfftn",
    "fft_hfft",
    "fft_ihfft",
    "linalg_cond",
    "linalg_matrix_rank",
    "linalg_solve",
    "linalg_cholesky",
    "linalg_svdvals",
    "linalg_eigvals",
    "linalg_eigvalsh",
    "linalg_inv",
    "linalg_householder_product",
    "linalg_tensorinv",
    "linalg_tensorsolve",
    "geqrf",
    "_lu_with_info",
    "qr",
    "svd",
    "triangular_solve",
    "fractional_max_pool2d",
    "fractional_max_pool3d",
    "adaptive_max_pool3d",
    "multilabel_margin_loss_forward",
    "linalg_qr",
    "linalg_cholesky_ex",
    "linalg_svd",
    "linalg_eig",
    "linalg_eigh",
    "linalg_lstsq",
    "linalg_inv_ex",
)

_CPU_PROMOTE = (
    "stack",
    "cat",
    "index_copy",
)


# Ops torch registers for autocast in one overload only, where a Python call can reach another:
# left out of POLICY (amp decides them), with the reason.
PARTIAL = {
    "cpu": {
        "_convolution": "only _convolution.deprecated, which torch._convolution's current form "
        "does not reach",
        "fake_quantize_per_tensor_affine": "not its tensor_qparams overload (scale and zero "
        "point as tensors)",
    },
}

# Overloads torch leaves out of autocast that change nothing where it registers the op: a call
# that names its output dtype (`mm(..., out_dtype)`: amp runs an explicit dtype as asked too), and
# overloads no eager call of a tensor reaches (TorchScript's number and list forms).
UNCAST_OVERLOADS = frozenset(
    (
        "dtype",
        "Scalar",
        "Scalar_Scalar",
        "int",
        "float",
        "complex",
        "bool",
        "hacked_twin",
        "quantized",
    )
)


def _kinds(*lists):
    return {name: kind for kind, names in lists for name in names}


# {device type: {aten op (base name): torch's kind}}; an op not named is not autocast there.
POLICY = {
    "cuda": _kinds(
        (LOWER_PRECISION_FP, _CUDA_LOWER_PRECISION_FP),
        (FP32, _CUDA_FP32),
        (FP32_SET_OPT_DTYPE, _CUDA_FP32_SET_OPT_DTYPE),
        (FP32_APPEND_DTYPE, ("norm",)),
        (PROMOTE, _CUDA_PROMOTE),
        (BANNED, ("binary_cross_entropy",)),
    ),
    "cpu": _kinds(
        (LOWER_PRECISION_FP, _CPU_LOWER_PRECISION_FP),
        (FP32, _CPU_FP32),
        (PROMOTE, _CPU_PROMOTE),
    ),
}
