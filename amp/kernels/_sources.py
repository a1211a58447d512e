"""The CUDA source of amp's multi-tensor kernels, by family: the files each family compiles (the
shared multi_tensor.cu first), the kernel names it instantiates, and the options of the GPU
build. A run compiles a family when it first launches one of its kernels (_cupy_device).
The FP8 casts' files too (FLOAT8_FILES, float8.cu first): one module of their own (_cupy_float8).
Importable without CuPy or CUDA: tests and benchmarks read it.
"""

import pathlib
from typing import NamedTuple

import torch

from . import _layout

__all__ = [
    "TYPE_NAMES",
    "STEP_TYPES",
    "COMPACT",
    "REMAINDER",
    "COMPACT_MASTERS",
    "MOMENT_NAMES",
    "compact_kernel",
    "Family",
    "FAMILIES",
    "STEP_FAMILIES",
    "family_of",
    "GPU_OPTIONS",
    "source",
    "source_of",
    "FLOAT8_FILES",
    "float8_source",
]

_HERE = pathlib.Path(__file__).parent
TYPE_NAMES = {torch.float32: "float", torch.float16: "__half", torch.bfloat16: "__nv_bfloat16"}
# (gradient, weight) types of the fused steps: the weight's type, or an FP32 gradient (made by a
# read of the masters' `.grad` before the step) for any weight; float32 stands for no weight.
STEP_TYPES = frozenset(
    [(t, t) for t in TYPE_NAMES] + [(torch.float32, t) for t in (torch.float16, torch.bfloat16)]
)
COMPACT = "compact"  # the master of a compact step held as a bf16 weight and an int8 correction
REMAINDER = "remainder"  # ... as a bf16 weight and an int16 remainder (an exact master)
_MASTER_NAMES = {COMPACT: "amp::Compact", REMAINDER: "amp::Remainder"}
# (gradient, master) types of the compact steps: a bf16 weight with its correction or remainder and
# any gradient type, or an FP32 master with a copy of the types the fused steps write
# (STEP_TYPES; float32: no copy).
COMPACT_MASTERS = frozenset(
    [(t, kind) for t in TYPE_NAMES for kind in _MASTER_NAMES] + list(STEP_TYPES)
)
# The moments of a compact step, by the first moment's dtype: FP32, bf16, or 8-bit codes.
MOMENT_NAMES = {torch.float32: "float", torch.bfloat16: "__nv_bfloat16", torch.int8: "amp::Codes8"}


def compact_kernel(kernel: str, grad: torch.dtype, master, moment: torch.dtype) -> str:
    """The name of compact kernel `kernel` for a gradient dtype, a master (COMPACT, REMAINDER or
    its copy's dtype) and a moment dtype (MOMENT_NAMES)."""
    master_name = _MASTER_NAMES.get(master) or f"amp::Exact<{TYPE_NAMES[master]}>"
    return f"{kernel}<{TYPE_NAMES[grad]}, {master_name}, {MOMENT_NAMES[moment]}>"


class Family(NamedTuple):
    """Kernels compiled from the same .cu files (in order): the names CuPy instantiates and looks
    up; per_kernel: a module for each name as a run first launches it (a run launches two of
    the step families' dozens), else one module for them all."""

    files: tuple
    names: tuple
    per_kernel: bool = False


def _typed(kernel, types):
    return [f"{kernel}<{TYPE_NAMES[t]}>" for t in types]


def _pairs(kernels, pairs):
    return [f"{k}<{TYPE_NAMES[a]}, {TYPE_NAMES[b]}>" for k in kernels for a, b in pairs]


_STEP_FILES = ("multi_tensor", "step_math", "codecs", "step_lists", "step_loop")
FAMILIES = {
    # unscale_ and check_: all an O1 run launches
    "unscale": Family(
        ("multi_tensor", "scale", "unscale"),
        tuple(_typed("amp_unscale", TYPE_NAMES) + _typed("amp_check", TYPE_NAMES)),
    ),
    "copies": Family(
        ("multi_tensor", "scale", "copies"),
        tuple(_pairs(("amp_scale_copy", "amp_scale_add"), _layout.DTYPE_PAIRS)),
    ),
    "norms": Family(
        ("multi_tensor", "norms"),
        tuple(_typed("amp_sum_squares", TYPE_NAMES) + ["amp_norm_finalize"]),
    ),
    "steps": Family(
        _STEP_FILES + ("steps",),
        tuple(
            _pairs(("amp_adam", "amp_sgd"), sorted(STEP_TYPES, key=str)) + ["amp_count_steps"]
        ),
        per_kernel=True,
    ),
    "compact": Family(
        _STEP_FILES + ("compact",),
        tuple(
            [
                compact_kernel(kernel, grad, master, moment)
                for kernel in ("amp_compact_adam", "amp_compact_sgd")
                for grad, master in sorted(COMPACT_MASTERS, key=str)
                for moment in MOMENT_NAMES
            ]
            + ["amp_compact_count_steps"]
        ),
        per_kernel=True,
    ),
}
STEP_FAMILIES = ("steps", "compact")
_FAMILY_OF = {name.split("<")[0]: family for family, f in FAMILIES.items() for name in f.names}
# The CuPy build steps AdamW / Adam with torch's CUDA formula (step_math.cu): on a GPU the torch
# backend's steps (and a user's torch.optim.AdamW(fused=True)) are torch's CUDA kernel's.
GPU_OPTIONS = ("-DAMP_TORCH_CUDA_ADAM",)


def family_of(name: str) -> str:
    """The family that compiles kernel `name` (a name expression of FAMILIES)."""
    return _FAMILY_OF[name.split("<")[0]]


def source_of(family: Family) -> str:
    """The source CuPy compiles a family's modules from."""
    return source((next(k for k, f in FAMILIES.items() if f is family),))


def _text(files) -> str:
    return "\n".join((_HERE / f"{name}.cu").read_text() for name in files)


def source(families=tuple(FAMILIES), instantiate=()) -> str:
    """The source text of the families' files, each file once, in order. `instantiate`: kernel
    names whose addresses a host table takes, so that nvcc compiles them (CuPy instantiates
    its name expressions itself); True: every name of the families."""
    text = _text(dict.fromkeys(f for family in families for f in FAMILIES[family].files))
    if instantiate is True:
        instantiate = [name for family in families for name in FAMILIES[family].names]
    if instantiate:
        addresses = "".join(f"    reinterpret_cast<const void*>(&{n}),\n" for n in instantiate)
        text += "\n// nvcc: the kernels to compile (external: nothing warns it is unread)\n"
        text += "extern const void* const amp_instances[];\n"
        text += "const void* const amp_instances[] = {\n" + addresses + "};\n"
    return text


# The FP8 casts' module (amp/kernels/float8.py): the shared part (jobs, Meta, tile loads), the
# amax kernel, the FP8 formats and scales, the cast kernel, the rowwise output scaling. No
# multi_tensor.cu; the files instantiate their kernels themselves (nvcc compiles them as they are).
FLOAT8_FILES = ("float8", "float8_amax", "float8_formats", "float8_cast", "float8_scale_outer")


def float8_source() -> str:
    """The source CuPy compiles the FP8 casts' module from: FLOAT8_FILES, in order."""
    return _text(FLOAT8_FILES)
