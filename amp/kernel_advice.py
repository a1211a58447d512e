"""What `amp.initialize` says when a set-up will step far slower than it could: O2 state that the
torch backend steps in many passes (compact state; a bf16 model's exact masters, held as its
weights and int16 remainders) on CUDA without amp's CuPy kernels.

The torch backend steps such state with torch operations over pieces of 2**20 elements (compact
state about 150 passes a piece, exact masters about 20: decoded to FP32, torch's fused op,
encoded back); on a GPU that is thousands of small launches a step, where the CuPy kernel makes
one pass. Nothing is wrong with the numbers (both backends give the same bits), so this is a
warning, once at initialize rather than a message every step; the probe of the backend (which
compiles CuPy's kernels) runs only for such a set-up.
"""

import warnings

from . import kernels
from ._state import amp_state
from .properties import COMPACT
from .weights.owner import StateOwner
from .weights.rows import REMAINDER

__all__ = ["warn_if_slow"]

# Measured on an H200 (shared/gpu/2026-11-28.md): GPT-2 small, batch 8 x 1024, compact masters
# and int8 moments, with AMP_DISABLE_KERNELS=1 against the CuPy kernels.
_MEASURED_COMPACT = (
    "about 10x slower: GPT-2 small (124M parameters) with compact masters and int8 moments "
    "steps in 418 ms against 42 ms with them (31,402 kernel launches a step; H200, 2026-11-28)"
)
# Counted below autograd on FakeTensors (docs/o2.md, benchmarks/device_work.py), not yet timed
# on a GPU: GPT-2 small, AdamW, the work after backward.
_COUNTED_EXACT = (
    "in many small passes: GPT-2 small (124M parameters) makes 2,406 kernel launches and moves "
    "113 bytes a parameter after backward against 10 and 30 with them (counted, not timed)"
)
_INSTALL = (
    "Install them with pip install 'amp[cuda]' (or 'amp[cuda13]' for a CUDA 13 build of torch)"
)


def _on_cuda(models):
    return any(p.device.type == "cuda" for model in models for p in model.parameters())


def _exact_remainders():
    """Whether an optimizer amp steps holds exact masters as int16 remainders."""
    return any(
        isinstance(owner, StateOwner) and owner.form.name == REMAINDER and owner.params
        for owner in amp_state.rows
    )


def _slow_state(properties):
    """(what the torch backend would step slowly, its cost) for this initialize, or None."""
    if properties.compact:
        options = [f"master_weights={COMPACT!r}"] if properties.master_weights == COMPACT else []
        if properties.optimizer_state != "fp32":
            options.append(f"optimizer_state={properties.optimizer_state!r}")
        return f"compact state ({', '.join(options)})", _MEASURED_COMPACT
    if _exact_remainders():
        return "exact masters (the bf16 weights and int16 remainders)", _COUNTED_EXACT
    return None


def warn_if_slow(properties, models):
    """Warn if O2's compact state or exact bf16 masters will be stepped on CUDA by the torch
    backend: `models` on CUDA and `amp.kernels.cuda_backend()` not CuPy."""
    if not _on_cuda(models):
        return
    slow = _slow_state(properties)
    if slow is None:
        return
    choice = kernels.cuda_backend()
    if choice.name == "cupy":
        return
    what, cost = slow
    warnings.warn(
        f"amp.initialize: {what} on CUDA is stepped without amp's CuPy kernels, {cost}. "
        f"{_INSTALL}. The CuPy backend is not in use: {choice.reason}.",
        UserWarning,
        stacklevel=3,
    )
