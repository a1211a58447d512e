"""The FP8 casts on torch operations: torchao.float8's numerics (`float8_utils.amax_to_scale`,
`hp_tensor_to_float8_dynamic`) op by op, the reference the float8*.cu kernels are held to bit for
bit, and what runs where they cannot (CPU, no CuPy, torch.compile).
"""

from typing import Optional, Tuple

import torch

__all__ = ["EPS", "TENSOR", "ROW", "COLUMN", "Float8Cast", "amax_to_scale", "to_float8", "cast",
           "scale_outer_"]

# Through torch.ops.aten, never amp's wrappers (amp patches `torch.log2`, `Tensor.reciprocal`):
# the FP8 casts run in FP32 or float64 whatever policy is in force, and stay out of amp.trace().
# Dynamo traces these however it built its tables, whereas it misses the builtins behind
# `torch.log2` & co. (a graph break in the autograd Function) if it first looked while amp's
# patches were installed.
_log2 = torch.ops.aten.log2
_reciprocal = torch.ops.aten.reciprocal

# torchao.float8.float8_utils.EPS: the smallest amax a scale is computed from (an all-zero
# tensor gets a finite scale).
EPS = 1e-12

# How a layout is scaled: one scale for the tensor, one per row of the matrix, one per column.
TENSOR, ROW, COLUMN = "tensor", "row", "column"


class Float8Cast:
    """The FP8 layouts of one matrix (rows x cols) and their scales (layout = matrix * scale):
    `data` (rows x cols, row-major) with `scale` and `inverse` (1 / scale), and `data_t` (its
    transpose, cols x rows, row-major) with `scale_t` and `inverse_t`; None where not made. A
    scale is 0-dim (per tensor) or one per row of its layout, shaped (rows of the layout, 1)."""

    __slots__ = ("data", "scale", "inverse", "data_t", "scale_t", "inverse_t")

    def __init__(self, data=None, scale=None, inverse=None, data_t=None, scale_t=None,
                 inverse_t=None):
        self.data, self.scale, self.inverse = data, scale, inverse
        self.data_t, self.scale_t, self.inverse_t = data_t, scale_t, inverse_t


def amax_to_scale(amax: torch.Tensor, float8_dtype: torch.dtype, power_of_2: bool) -> torch.Tensor:
    """The FP32 scale that maps `amax` onto the largest value of `float8_dtype`.

    Computed in float64, as torchao does (eager and compiled code then agree on 1 / x), and as
    its `max / amax` runs (Tensor.__rtruediv__): a reciprocal, then a product.
    """
    amax = amax.to(torch.float64)
    scale = (_reciprocal(torch.clamp(amax, min=EPS)) * torch.finfo(float8_dtype).max).to(
        torch.float32
    )
    if power_of_2:
        scale = torch.exp2(torch.floor(_log2(scale)))
    return scale


def to_float8(
    tensor: torch.Tensor, float8_dtype: torch.dtype, dim: Optional[int], power_of_2: bool
) -> Tuple[torch.Tensor, torch.Tensor]:
    """(FP8 data, scale): `tensor` scaled from its amax (over `dim`, kept as a size-1 dimension;
    None: the whole tensor), saturated to the FP8 range, and its scale (data = tensor * scale).
    An empty tensor's amax is 0."""
    with torch.no_grad():
        magnitude = torch.abs(tensor)
        if tensor.numel() == 0:  # nothing to take the amax of: 0, as the kernels leave it
            shape = list(tensor.shape)
            if dim is not None:
                shape[dim] = 1
            amax = tensor.new_zeros(() if dim is None else shape)
        elif dim is None:
            amax = torch.max(magnitude)
        else:
            amax = torch.amax(magnitude, dim=dim, keepdim=True)
        scale = amax_to_scale(amax, float8_dtype, power_of_2)
        limit = torch.finfo(float8_dtype).max
        # Multiplied in FP32 (what a compiled graph does anyway), then clamped: eager casts
        # saturate since torch 2.12, compiled ones always did.
        data = (tensor.to(torch.float32) * scale).clamp(min=-limit, max=limit).to(float8_dtype)
    return data, scale


def cast(
    matrix: torch.Tensor,
    float8_dtype: torch.dtype,
    row_major: Optional[str],
    transposed: Optional[str],
    power_of_2: bool,
) -> Float8Cast:
    """The Float8Cast of a 2-D `matrix`: `data` scaled as `row_major` says (TENSOR, ROW or None:
    not made) and `data_t` as `transposed` says (TENSOR, COLUMN or None)."""
    matrix = matrix.contiguous()
    result = Float8Cast()
    if TENSOR in (row_major, transposed):  # one cast serves both layouts
        data, scale = to_float8(matrix, float8_dtype, None, power_of_2)
        inverse = _reciprocal(scale)
        if row_major == TENSOR:
            result.data, result.scale, result.inverse = data, scale, inverse
        if transposed == TENSOR:
            result.data_t, result.scale_t, result.inverse_t = data.t().contiguous(), scale, inverse
    if row_major == ROW:
        result.data, result.scale = to_float8(matrix, float8_dtype, -1, power_of_2)
        result.inverse = _reciprocal(result.scale)
    if transposed == COLUMN:
        data, scale = to_float8(matrix, float8_dtype, 0, power_of_2)
        result.data_t, result.scale_t = data.t().contiguous(), scale.t()
        result.inverse_t = _reciprocal(scale).t()
    return result


def scale_outer_(out: torch.Tensor, row_inverse: torch.Tensor, col_inverse: torch.Tensor) -> None:
    """out *= row_inverse * col_inverse ((rows, 1) and (1, cols)), the product in FP32 first."""
    out *= row_inverse * col_inverse
