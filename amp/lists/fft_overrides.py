"""Casting policy for functions in `torch.fft`. Data only: read by amp/lists/__init__.py.

Low-precision FFTs are restricted (CUDA: power-of-two sizes; CPU: not implemented), so they run
in FP32, as torch's CPU autocast does.
"""

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

MODULE = "torch.fft"

FP16_FUNCS = ()

FP32_FUNCS = (
    "fft",
    "ifft",
    "fft2",
    "ifft2",
    "fftn",
    "ifftn",
    "rfft",
    "irfft",
    "rfft2",
    "irfft2",
    "rfftn",
    "irfftn",
    "hfft",
    "ihfft",
)

CASTS = ()

SEQUENCE_CASTS = ()

PROMOTED_BY_TORCH = ()

INPUT_DTYPE_FUNCS = ()

BANNED_FUNCS = ()
