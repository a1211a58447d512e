"""Opt levels O0-O3 as data, and validation of user overrides with apex's rules and messages."""

import dataclasses
import math
from typing import Mapping, Optional

import torch

from .lists.float8_recipes import check_recipe_name

__all__ = [
    "DYNAMIC",
    "LOW_PRECISION_DTYPES",
    "LOW_PRECISION",
    "OPTION_NAMES",
    "Properties",
    "OptLevel",
    "OPT_LEVELS",
    "check_opt_level",
    "check_low_precision_dtype",
    "defaults",
    "check_float8",
    "COMPACT",
    "OPTIMIZER_STATES",
    "check_optimizer_state",
    "resolve",
    "check_verbosity",
    "check_loss_scale",
    "format_options",
]

DYNAMIC = "dynamic"
COMPACT = "compact"  # master_weights: a bf16 weight and an 8-bit correction, no FP32 copy
OPTIMIZER_STATES = ("fp32", "bf16", "int8")  # how O2's fused step keeps the optimizer's moments
LOW_PRECISION_DTYPES = (torch.float16, torch.bfloat16)

# Placeholder in the table for "the low-precision dtype the user chose" (float16 by default).
LOW_PRECISION = "low_precision"

# The order apex validates and prints options in.
OPTION_NAMES = (
    "enabled",
    "opt_level",
    "cast_model_type",
    "patch_torch_functions",
    "keep_batchnorm_fp32",
    "master_weights",
    "loss_scale",
)


@dataclasses.dataclass(frozen=True)
class Properties:
    """The resolved options of one `amp.initialize` call."""

    enabled: bool
    opt_level: str
    cast_model_type: object  # a torch.dtype, or None / False for "do not cast the model"
    patch_torch_functions: bool
    keep_batchnorm_fp32: object  # True, False or None
    master_weights: object  # True, False, None, or COMPACT
    loss_scale: object  # a positive float, or "dynamic"
    dtype: torch.dtype = torch.float16
    float8: Optional[str] = None  # a recipe of amp/lists/float8_recipes.py, or None (off)
    optimizer_state: str = "fp32"  # one of OPTIMIZER_STATES

    def options(self):
        """The options as (name, value) pairs in apex's order, then dtype (and optimizer_state
        and float8 where they are not the default)."""
        options = [(name, getattr(self, name)) for name in OPTION_NAMES] + [("dtype", self.dtype)]
        if self.optimizer_state != "fp32":
            options.append(("optimizer_state", self.optimizer_state))
        if self.float8 is not None:
            options.append(("float8", self.float8))
        return options

    @property
    def compact(self):
        """O2's step keeps compact state: compact masters, or moments not in FP32."""
        return self.master_weights == COMPACT or self.optimizer_state != "fp32"


@dataclasses.dataclass(frozen=True)
class OptLevel:
    name: str
    brief: str  # apex's line, with {low} where apex says FP16: the low-precision dtype in use
    defaults: Mapping[str, object]

    def describe(self, dtype=torch.float16):
        """The level's line for the "Selected optimization level" message, naming `dtype`."""
        return self.brief.format(low=_SHORT_NAMES[dtype])


_SHORT_NAMES = {torch.float16: "FP16", torch.bfloat16: "BF16"}


# apex.amp's property table (apex/amp/frontend.py), with the low-precision type left open.
OPT_LEVELS = {
    level.name: level
    for level in (
        OptLevel(
            "O0",
            "O0:  Pure FP32 training.\n",
            dict(
                cast_model_type=torch.float32,
                patch_torch_functions=False,
                keep_batchnorm_fp32=None,
                master_weights=False,
                loss_scale=1.0,
            ),
        ),
        OptLevel(
            "O1",
            "O1:  Insert automatic casts around Pytorch functions and Tensor methods.\n",
            dict(
                cast_model_type=None,
                patch_torch_functions=True,
                keep_batchnorm_fp32=None,
                master_weights=None,
                loss_scale=DYNAMIC,
            ),
        ),
        OptLevel(
            "O2",
            "O2:  {low} training with FP32 batchnorm and FP32 master weights.\n",
            dict(
                cast_model_type=LOW_PRECISION,
                patch_torch_functions=False,
                keep_batchnorm_fp32=True,
                master_weights=True,
                loss_scale=DYNAMIC,
            ),
        ),
        OptLevel(
            "O3",
            "O3:  Pure {low} training.",
            dict(
                cast_model_type=LOW_PRECISION,
                patch_torch_functions=False,
                keep_batchnorm_fp32=False,
                master_weights=False,
                loss_scale=1.0,
            ),
        ),
    )
}


def check_opt_level(opt_level):
    """Raise apex's RuntimeError for anything that is not one of O0-O3."""
    if not isinstance(opt_level, str) or opt_level not in OPT_LEVELS:
        raise RuntimeError(
            f"Unexpected optimization level {opt_level!r}. Options are 'O0', 'O1', 'O2', 'O3'.  "
            "Note that in `O0`, `O1`, etc., the prefix O is the letter O, not the number zero."
        )
    return OPT_LEVELS[opt_level]


def check_low_precision_dtype(dtype, argument="dtype"):
    if dtype is None:
        return torch.float16
    if dtype not in LOW_PRECISION_DTYPES:
        raise ValueError(
            f"{argument}={dtype!r} is not a low-precision type amp can train in. "
            "Pass torch.float16 or torch.bfloat16."
        )
    return dtype


def defaults(opt_level, dtype=torch.float16):
    """The Properties of an opt level before overrides."""
    level = check_opt_level(opt_level)
    values = {
        name: dtype if value == LOW_PRECISION else value for name, value in level.defaults.items()
    }
    return Properties(enabled=True, opt_level=level.name, dtype=dtype, **values)


def check_float8(float8, opt_level):
    """`float8` if it names a recipe amp can run at `opt_level` (or is None), else a ValueError."""
    float8 = check_recipe_name(float8)
    if float8 is not None and opt_level == "O0":
        raise ValueError(
            f"float8={float8!r} asks for FP8 matmuls, but opt_level='O0' trains in pure FP32 "
            "and casts nothing. Use opt_level='O1', 'O2' or 'O3' with float8, or drop float8."
        )
    return float8


def check_optimizer_state(optimizer_state):
    """`optimizer_state` if it is one of OPTIMIZER_STATES, else a ValueError."""
    if not isinstance(optimizer_state, str) or optimizer_state not in OPTIMIZER_STATES:
        raise ValueError(
            f"optimizer_state={optimizer_state!r}: expected 'fp32' (the optimizer's own FP32 "
            "moments), 'bf16' or 'int8' (8-bit, block-scaled moments kept by O2's fused step)."
        )
    return optimizer_state


def resolve(opt_level, dtype=None, float8=None, optimizer_state="fp32", **overrides):
    """Defaults of `opt_level` with every non-None override applied and validated, in apex's order.

    Returns (defaults, resolved) so callers can show both.
    """
    dtype = check_low_precision_dtype(dtype)
    base = defaults(opt_level, dtype)
    float8 = check_float8(float8, base.opt_level)
    optimizer_state = check_optimizer_state(optimizer_state)
    unknown = set(overrides) - set(_VALIDATORS)
    if unknown:
        raise TypeError(
            f"unknown amp option(s) {sorted(unknown)}; known options: {tuple(_VALIDATORS)}"
        )
    values = dataclasses.asdict(base)
    for name in _VALIDATORS:  # apex's order: cast_model_type is checked before the flags
        value = overrides.get(name)
        if value is None:
            continue
        values[name] = _VALIDATORS[name](value, values)
    values["float8"] = float8
    values["optimizer_state"] = optimizer_state
    resolved = Properties(**values)
    _check_compact(resolved)
    return base, resolved


def _check_compact(properties):
    """Compact masters need a bf16 model with masters; 8-bit or bf16 moments need masters (the
    fused step that keeps them steps masters)."""
    if properties.master_weights == COMPACT and properties.cast_model_type is not torch.bfloat16:
        raise ValueError(
            f"master_weights='compact' keeps each master as a bf16 weight and an 8-bit "
            f"correction, so the model must be cast to torch.bfloat16; opt_level="
            f"{properties.opt_level!r} casts it to {properties.cast_model_type}. float16's "
            "5-bit exponent cannot hold the masters' range: pass dtype=torch.bfloat16, or "
            "master_weights=True for FP32 masters."
        )
    if properties.optimizer_state != "fp32" and not properties.master_weights:
        raise ValueError(
            f"optimizer_state={properties.optimizer_state!r} is kept by O2's fused master step, "
            f"and opt_level={properties.opt_level!r} has no master weights: use opt_level='O2' "
            "(master_weights=True or 'compact'), or optimizer_state='fp32'."
        )


def _bool_option(name, value):
    # apex accepts the strings "True"/"False" for keep_batchnorm_fp32; we accept them for every flag.
    if value in ("True", "False"):
        return value == "True"
    if isinstance(value, bool):
        return value
    raise TypeError(f"{name} must be True, False, 'True', 'False' or None; got {value!r}.")


def _cast_model_type(value, values):
    if values["opt_level"] == "O1" and value not in (None, False, torch.float32):
        raise RuntimeError(
            "O1 inserts casts around Torch functions rather than model weights, so with O1, the "
            "model weights themselves should remain FP32. If you wish to cast the model to a "
            f"different type, use opt_level='O2' or 'O3'. cast_model_type was {value}"
        )
    if value is False:
        return False
    if value not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(
            f"cast_model_type={value!r} is not supported; pass torch.float16, torch.bfloat16, "
            "torch.float32, or False to leave the model as it is."
        )
    return value


def _patch_torch_functions(value, values):
    value = _bool_option("patch_torch_functions", value)
    if value and values["opt_level"] != "O1":
        raise RuntimeError(
            "Currently, patch_torch_functions=True should only be set by selecting opt_level='O1'."
        )
    return value


def _keep_batchnorm_fp32(value, values):
    if values["opt_level"] == "O1":
        raise RuntimeError(
            "With opt_level O1, batchnorm functions are automatically patched to run in FP32, so "
            f"keep_batchnorm_fp32 should be None. keep_batchnorm_fp32 was {value}"
        )
    if value in ("True", "False") or isinstance(value, bool):
        return _bool_option("keep_batchnorm_fp32", value)
    raise ValueError(
        "keep_batchnorm_fp32 must be a boolean, the string 'True' or 'False', or None, "
        f"found keep_batchnorm_fp32={value}"
    )


def _master_weights(value, values):
    if values["opt_level"] == "O1":
        raise RuntimeError(
            "It doesn't make sense to use master_weights with O1. With O1, your model weights "
            "themselves should be FP32."
        )
    if value == COMPACT:
        return COMPACT
    try:
        return _bool_option("master_weights", value)
    except TypeError:
        raise TypeError(
            f"master_weights must be True, False, 'True', 'False', 'compact' or None; got "
            f"{value!r}."
        ) from None


def _loss_scale(value, values):
    return check_loss_scale(value)


def check_verbosity(value: object, what: str) -> int:
    """0 (quiet), 1 (amp's messages) or 2 (with detail: the parameters a skip was due to)."""
    if isinstance(value, bool) or not isinstance(value, int) or value not in (0, 1, 2):
        raise ValueError(f"{what} must be 0, 1 or 2; got {value!r}.")
    return value


def check_loss_scale(value):
    """'dynamic', or a number (or numeric string such as "128.0") that is finite and positive."""
    if value == DYNAMIC:
        return DYNAMIC
    if isinstance(value, bool):
        raise TypeError(f"loss_scale must be 'dynamic' or a positive number; got {value!r}.")
    try:
        scale = float(value)
    except (TypeError, ValueError):
        raise ValueError(
            f"loss_scale must be 'dynamic' or a positive number (e.g. 128.0 or \"128.0\"); "
            f"got {value!r}."
        ) from None
    if not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"loss_scale must be finite and positive; got {value!r}.")
    return scale


_VALIDATORS = {
    "cast_model_type": _cast_model_type,
    "patch_torch_functions": _patch_torch_functions,
    "keep_batchnorm_fp32": _keep_batchnorm_fp32,
    "master_weights": _master_weights,
    "loss_scale": _loss_scale,
}


def format_options(properties):
    """apex's option dump: one '{name:22} : {value}' line per option."""
    return "\n".join(f"{name:22} : {value}" for name, value in properties.options())
