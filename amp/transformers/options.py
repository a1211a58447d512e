"""AmpTrainer's `amp_options`: checked, and completed into amp.initialize's keyword arguments."""

import inspect
from typing import Any, Dict, Mapping, Optional

import torch

import amp

__all__ = ["DEFAULTS", "initialize_kwargs"]

# What AmpTrainer uses where amp_options does not say (as amp.lightning.AmpPrecision does): a
# bfloat16 model stepped through FP32 master weights.
DEFAULTS: Mapping[str, Any] = {"opt_level": "O2", "dtype": torch.bfloat16}

_OPT_LEVELS = ("O0", "O1", "O2", "O3")
_DTYPES = (torch.float16, torch.bfloat16)
# amp.initialize's arguments that AmpTrainer fills in itself, or that would make it not amp.
_TAKEN = {
    "models": "the Trainer's model is set up by AmpTrainer",
    "optimizers": "the Trainer's optimizer (or the one passed as optimizers=) is set up by "
    "AmpTrainer",
    "enabled": "for a run without amp use transformers.Trainer",
}


def initialize_kwargs(amp_options: Optional[Mapping[str, Any]]) -> Dict[str, Any]:
    """amp.initialize's keyword arguments for `amp_options` (None: the defaults).

    ``opt_level`` defaults to ``"O2"`` and ``dtype`` to ``torch.bfloat16``; any other argument of
    ``amp.initialize`` passes through (``float8``, ``fp32_modules``, ``master_weights``,
    ``loss_scale``, ``verbosity``, ...: whatever its signature takes). At O1 the model's outputs
    are cast to FP32 unless ``cast_model_outputs`` says otherwise, as the Trainer's own mixed
    precision returns them (O2 and O3 do so already).

    Raises:
        TypeError: `amp_options` is not a mapping, or names something amp.initialize does not take.
        ValueError: an unknown opt level or a dtype other than float16 and bfloat16.
    """
    if amp_options is not None and not isinstance(amp_options, Mapping):
        raise TypeError(
            f"AmpTrainer: amp_options must be a dict of amp.initialize arguments, e.g. "
            f'{{"opt_level": "O2", "dtype": torch.bfloat16}}; got {type(amp_options).__name__}.'
        )
    options = {**DEFAULTS, **(amp_options or {})}
    taken = sorted(set(options) & set(_TAKEN))
    if taken:
        raise TypeError(
            f"AmpTrainer: amp_options may not contain {', '.join(taken)}: "
            + "; ".join(_TAKEN[name] for name in taken)
            + "."
        )
    accepted = set(inspect.signature(amp.initialize).parameters) - set(_TAKEN)
    unknown = sorted(set(options) - accepted)
    if unknown:
        raise TypeError(
            f"AmpTrainer: amp_options {unknown} are not arguments of amp.initialize; accepted: "
            f"{', '.join(sorted(accepted))}."
        )
    if options["opt_level"] not in _OPT_LEVELS:
        raise ValueError(
            f"AmpTrainer: amp_options opt_level {options['opt_level']!r}; expected one of "
            f"{', '.join(_OPT_LEVELS)} (the letter O, not zero)."
        )
    if options["dtype"] not in _DTYPES:
        raise ValueError(
            f"AmpTrainer: amp_options dtype {options['dtype']!r}; expected torch.float16 or "
            "torch.bfloat16."
        )
    if options["opt_level"] == "O1":
        options.setdefault("cast_model_outputs", torch.float32)
    return options
