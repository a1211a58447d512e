"""Casting policy for functions in `torch`. Data only: read by amp/lists/__init__.py.

Sources: apex.amp's lists (apex/amp/lists/torch_overrides.py) and the ops torch registers for
autocast on CUDA and CPU (torch 2.13, ../shared/reference/autocast_registered_ops_torch2.13.json).
"""

__all__ = [
    "MODULE",
    "FP16_FUNCS",
    "FP32_FUNCS",
    "CASTS",
    "PROMOTED_BY_TORCH",
    "INPUT_DTYPE_FUNCS",
    "SEQUENCE_CASTS",
    "BANNED_FUNCS",
]

MODULE = "torch"

FP16_FUNCS = (
    # Convolutions
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
    # BLAS
    "addmm",
    "addmv",
    "addr",
    "matmul",
    "einsum",
    "mm",
    "mv",
    "bmm",
    "baddbmm",
    "addbmm",
    "chain_matmul",
    "_addmm_activation",
    # RNN cells
    "lstm_cell",
    "gru_cell",
    "rnn_tanh_cell",
    "rnn_relu_cell",
    # Attention
    "_scaled_dot_product_flash_attention",
    "_native_multi_head_attention",
)

FP32_FUNCS = (
    # Pointwise functions that lose accuracy or overflow in low precision
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
    "polar",
    # Normalisation
    "layer_norm",
    "native_layer_norm",
    "rms_norm",
    "group_norm",
    "norm",
    "frobenius_norm",
    "nuclear_norm",
    "renorm",
    "cosine_similarity",
    # Reductions (an explicit dtype= runs as asked)
    "softmax",
    "log_softmax",
    "logsumexp",
    "sum",
    "prod",
    "cumsum",
    "cumprod",
    "var",
    "dist",
    "pdist",
    "cdist",
    "trace",
    "quantile",
    "nanquantile",
    # Losses
    "poisson_nll_loss",
    "cosine_embedding_loss",
    "hinge_embedding_loss",
    "kl_div",
    "margin_ranking_loss",
    "triplet_margin_loss",
    "binary_cross_entropy_with_logits",
    "ctc_loss",
    # Linear algebra and spectral ops without low-precision kernels
    "stft",
    "cholesky",
    "cholesky_inverse",
    "cholesky_solve",
    "inverse",
    "pinverse",
    "lu_solve",
    "orgqr",
    "ormqr",
    "geqrf",
    "qr",
    "svd",
    "triangular_solve",
    # Pooling and quantisation that torch's CPU autocast runs in FP32
    "max_pool3d",
    "fake_quantize_per_tensor_affine",
)

CASTS = (
    "addcdiv",
    "addcmul",
    "atan2",
    "bilinear",
    "cross",
    "dot",
    "vdot",
    "grid_sampler",
    "index_put",
    "index_copy",
    "scatter_add",
    "tensordot",
    "equal",  # torch.equal is False for equal values of different dtypes
)

# apex patched these too. torch's own type promotion already runs them in the widest floating
# type, bit for bit as a cast would, so amp leaves them unpatched: a wrapper on every `a + b`
# would cost time and change nothing (tests/test_lists.py checks that they promote).
PROMOTED_BY_TORCH = (
    "add",
    "div",
    "mul",
    "eq",
    "ge",
    "gt",
    "le",
    "lt",
    "ne",
)

# apex ran std in FP32. torch's kernels accumulate float16 and bfloat16 inputs in FP32 and round
# once (a standard deviation stays within its input's range), as torch.autocast leaves it. `var`
# stays FP32: its result is squared, and float16 overflows from a deviation of 256.
# view_as_complex stays a view of its input: torch's CPU autocast would cast it to FP32 first,
# turning the view into a copy. _scaled_mm (FP8 matmuls, amp's float8 path) takes its operands
# and their scales as given: its CPU kernel's inner mm is not cast.
INPUT_DTYPE_FUNCS = ("std", "view_as_complex", "_scaled_mm")

SEQUENCE_CASTS = (
    "cat",
    "stack",
)

BANNED_FUNCS = ()
