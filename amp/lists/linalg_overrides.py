"""Casting policy for functions in `torch.linalg`. Data only: read by amp/lists/__init__.py."""

__all__ = [
    "MODULE",
    "FP16_FUNCS",
    "FP32_FUNCS",
    "CASTS",
    "SEQUENCE_CASTS",
    "PROMOTED_BY_TORCH",
    "INPUT_DTYPE_FUNCS",
    "BANNED_FUNCS",
]

MODULE = "torch.linalg"

FP16_FUNCS = (
    "vecdot",
    "multi_dot",
)

FP32_FUNCS = (
    "vector_norm",
    "matrix_norm",
    "norm",
    "cond",
    "matrix_rank",
    "solve",
    "cholesky",
    "cholesky_ex",
    "svdvals",
    "eigvals",
    "eigvalsh",
    "inv",
    "inv_ex",
    "householder_product",
    "tensorinv",
    "tensorsolve",
    "qr",
    "svd",
    "eig",
    "eigh",
    "lstsq",
)

CASTS = ()

SEQUENCE_CASTS = ()

PROMOTED_BY_TORCH = ()

INPUT_DTYPE_FUNCS = ()

BANNED_FUNCS = ()
