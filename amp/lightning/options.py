"""AmpPrecision's arguments: checked when the plugin is made, and Lightning's name for them."""

import inspect
from typing import Any, Dict

import torch

import amp

__all__ = ["LOW_PRECISION", "check", "precision_name"]

_OPT_LEVELS = ("O0", "O1", "O2", "O3")
# The low-precision types the plugin takes, and how Lightning's precision names spell them.
LOW_PRECISION = {torch.float16: "16", torch.bfloat16: "bf16"}
# amp.initialize's own arguments that the plugin fills in itself.
_TAKEN = ("models", "optimizers", "opt_level", "dtype")


def check(opt_level: str, dtype: torch.dtype, initialize_kwargs: Dict[str, Any]) -> None:
    """Refuse what amp.initialize would not take, saying what was wrong, before any set-up."""
    if opt_level not in _OPT_LEVELS:
        raise ValueError(
            f"AmpPrecision: unexpected opt_level {opt_level!r}; expected one of "
            f"{', '.join(_OPT_LEVELS)} (the letter O, not zero)."
        )
    if dtype not in LOW_PRECISION:
        raise ValueError(
            f"AmpPrecision: dtype must be torch.float16 or torch.bfloat16; got {dtype!r}."
        )
    accepted = set(inspect.signature(amp.initialize).parameters) - set(_TAKEN)
    unknown = sorted(set(initialize_kwargs) - accepted)
    if unknown:
        raise TypeError(
            f"AmpPrecision: {', '.join(unknown)} is not an argument of amp.initialize; "
            f"accepted: {', '.join(sorted(accepted))}."
        )


def precision_name(opt_level: str, dtype: torch.dtype) -> str:
    """Lightning's name for what the model computes in (ModelSummary, ThroughputMonitor read it)."""
    if opt_level == "O0":
        return "32-true"
    return f"{LOW_PRECISION[dtype]}-{'true' if opt_level == 'O3' else 'mixed'}"
