"""The FP8 recipes of the FLOAT8 policy kind, as data: torchao.float8's `Float8LinearConfig` for
each `Float8LinearRecipeName` amp offers, reduced to the fields that decide the numerics.

amp/casting/float8.py reads them; `float8=` arguments name them.
"""

import dataclasses

import torch

__all__ = ["Float8Recipe", "RECIPES", "check_recipe_name"]


@dataclasses.dataclass(frozen=True)
class Float8Recipe:
    """One of torchao's `Float8LinearRecipeName`s, as the fields of `Float8LinearConfig` that
    decide the numerics."""

    name: str
    # Scales per row (torchao: ScalingGranularity.AXISWISE) rather than one per tensor.
    rowwise: bool
    # The FP8 type of the input and the weight, in every matmul.
    input_dtype: torch.dtype
    # The FP8 type of the output gradient (torchao: cast_config_grad_output.target_dtype).
    grad_output_dtype: torch.dtype
    # Scales rounded down to a power of 2 (torchao: round_scales_to_power_of_2), so scaling
    # loses no bits.
    power_of_2_scales: bool
    # `use_fast_accum` of each matmul (torchao: gemm_config_output / _grad_input / _grad_weight).
    fast_accum_output: bool = True
    fast_accum_grad_input: bool = False
    fast_accum_grad_weight: bool = False


RECIPES = {
    # torchao's default: one scale per tensor; the output gradient in e5m2 (more range).
    "tensorwise": Float8Recipe(
        "tensorwise",
        rowwise=False,
        input_dtype=torch.float8_e4m3fn,
        grad_output_dtype=torch.float8_e5m2,
        power_of_2_scales=False,
    ),
    # torchao's ROWWISE: one scale per row of each operand, as the matmul reduces it; every
    # operand in e4m3 (the output gradient too: per-row scales give it the range), scales
    # rounded down to powers of 2.
    "rowwise": Float8Recipe(
        "rowwise",
        rowwise=True,
        input_dtype=torch.float8_e4m3fn,
        grad_output_dtype=torch.float8_e4m3fn,
        power_of_2_scales=True,
    ),
}


def check_recipe_name(value, argument="float8"):
    """`value` if it names a recipe (or is None), else a ValueError saying what to pass."""
    if value is None or (isinstance(value, str) and value in RECIPES):
        return value
    names = ", ".join(repr(name) for name in RECIPES)
    raise ValueError(
        f"{argument}={value!r} is not a float8 recipe; pass None (off) or one of {names} "
        "(torchao.float8's recipe names)."
    )
