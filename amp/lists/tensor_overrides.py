"""Casting policy for methods of `torch.Tensor`. Data only: read by amp/lists/__init__.py.

In-place methods (`add_`, `__iadd__`, ...) are not listed: amp casts out-of-place calls only, as
torch.amp does, so an in-place call always runs in its tensor's own dtype.
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

MODULE = "torch.Tensor"

FP16_FUNCS = (
    "__matmul__",
    "__rmatmul__",
    "matmul",
    "mm",
    "mv",
    "bmm",
    "addmm",
    "addmv",
    "addr",
    "baddbmm",
    "addbmm",
    "_addmm_activation",
    "prelu",
)

FP32_FUNCS = (
    # Pointwise
    "__pow__",
    "__rpow__",
    "pow",
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
    # Reductions and normalisation (an explicit dtype= runs as asked)
    "softmax",
    "log_softmax",
    "logsumexp",
    "sum",
    "prod",
    "cumsum",
    "cumprod",
    "norm",
    "renorm",
    "dist",
    "var",
    "trace",
    "quantile",
    "nanquantile",
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
    # Cast to FP32 before a transfer to the CPU (apex)
    "cpu",
)

CASTS = (
    "addcdiv",
    "addcmul",
    "atan2",
    "cross",
    "dot",
    "vdot",
    "index_put",
    "index_copy",
    "scatter_add",
    "equal",  # Tensor.equal is False for equal values of different dtypes
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
    "__add__",
    "__radd__",
    "__sub__",
    "__rsub__",
    "__mul__",
    "__rmul__",
    "__div__",
    "__rdiv__",
    "__truediv__",
    "__rtruediv__",
    "__eq__",
    "__ne__",
    "__ge__",
    "__gt__",
    "__le__",
    "__lt__",
)

# In its input's dtype, as torch.std (torch_overrides.py says why).
INPUT_DTYPE_FUNCS = ("std",)

SEQUENCE_CASTS = ()

BANNED_FUNCS = ()
