"""What `amp.initialize` says when a set-up will step far slower than it could: O2's compact state
on CUDA without amp's CuPy kernels.

The torch backend steps compact state with torch operations, about 150 passes over each piece of
2**20 elements; on a GPU that is tens of thousands of small launches a step, where the CuPy kernel
makes one pass. Nothing is wrong with the numbers (both backends give the same bits), so this is a
warning, once at initialize rather than a message every step; the probe of the backend (which
compiles CuPy's kernels) runs only for such a set-up.
"""

import warnings

from . import kernels
from .properties import COMPACT

__all__ = ["warn_if_slow"]

# Measured on an H200 (shared/gpu/2026-11-28.md): GPT-2 small, batch 8 x 1024, compact masters
# and int8 moments, with AMP_DISABLE_KERNELS=1 against the CuPy kernels.
_MEASURED = (
    "GPT-2 small (124M parameters) with compact masters and int8 moments steps in 418 ms "
    "against 42 ms with them (10x, 31,402 kernel launches a step; H200, 2026-11-28)"
)


def _on_cuda(models):
    return any(p.device.type == "cuda" for model in models for p in model.parameters())


def warn_if_slow(properties, models):
    """Warn if O2's compact state (`properties.compact`) will be stepped on CUDA by the torch
    backend: `models` on CUDA and `amp.kernels.cuda_backend()` not CuPy."""
    if not properties.compact or not _on_cuda(models):
        return
    choice = kernels.cuda_backend()
    if choice.name == "cupy":
        return
    options = [f"master_weights={COMPACT!r}"] if properties.master_weights == COMPACT else []
    if properties.optimizer_state != "fp32":
        options.append(f"optimizer_state={properties.optimizer_state!r}")
    warnings.warn(
        f"amp.initialize: compact state ({', '.join(options)}) on CUDA is stepped without amp's "
        f"CuPy kernels, about 10x slower: {_MEASURED}. Install them with "
        "pip install 'amp[cuda]' (or 'amp[cuda13]' for a CUDA 13 build of torch). The CuPy "
        f"backend is not in use: {choice.reason}.",
        UserWarning,
        stacklevel=3,
    )

