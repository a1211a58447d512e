"""The CUDA source of amp's multi-tensor kernels as CuPy's NVRTC compiles it: the options the GPU
build passes. Importable without CuPy or CUDA (tests and benchmarks read it)."""

import pathlib
import re

__all__ = ["STEP_FAMILIES", "GPU_OPTIONS", "source", "step_elements"]

_HERE = pathlib.Path(__file__).parent
STEP_FAMILIES = ("multi_tensor",)
GPU_OPTIONS = ()  # -D options of the CuPy build beside the layout's


def source(families=STEP_FAMILIES):
    """The source text the families compile from."""
    return "\n".join((_HERE / f"{name}.cu").read_text() for name in families)


def step_elements():
    """Elements a thread steps per trip of a fused step's loop (the source's kStepElements)."""
    found = re.search(r"constexpr int kStepElements = (\d+);", source())
    return int(found.group(1)) if found else 1
