"""FP8 linear layers: dynamic scales, the scaled matmul, and the autograd Function.

A linear `y = x @ w.T` makes three matmuls, each run by `torch._scaled_mm` on FP8 operands:
forward `x @ w.T`, grad-input `dy @ w` and grad-weight `dy.T @ x`. Every operand is cast with a
scale from its current amax (no history), per tensor or per row, as the recipe (data in
amp/lists/float8_recipes.py) says. The numerics follow torchao.float8 0.18
(`matmul_with_hp_or_float8_args`, `float8_utils.amax_to_scale`,
`float8_ops.addmm_float8_unwrapped`) operation by operation, down to the memory layouts handed to
`_scaled_mm`, so the results are its `Float8Linear`'s bit for bit. Nothing FP8 outlives a call:
the Function saves the high-precision input and weight, and backward casts them again.
"""

from typing import Optional, Tuple

import torch
from torch.autograd.function import once_differentiable

from ..lists.float8_recipes import RECIPES, Float8Recipe  # noqa: F401 (RECIPES: for callers)

__all__ = [
    "EPS",
    "ALIGNMENT",
    "amax_to_scale",
    "to_float8",
    "scaled_mm",
    "Float8Linear",
    "linear",
    "fits",
]

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

# The multiple that FP8 tensor cores (cuBLASLt) need of every dimension they are given: in and
# out features, and the tokens of a call (the inner dimension of the grad-weight matmul).
ALIGNMENT = 16


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
    None: the whole tensor), saturated to the FP8 range, and its scale (data = tensor * scale)."""
    with torch.no_grad():
        if dim is None:
            amax = torch.max(torch.abs(tensor))
        else:
            amax = torch.amax(torch.abs(tensor), dim=dim, keepdim=True)
        scale = amax_to_scale(amax, float8_dtype, power_of_2)
        limit = torch.finfo(float8_dtype).max
        # Multiplied in FP32 (what a compiled graph does anyway), then clamped: eager casts
        # saturate since torch 2.12, compiled ones always did.
        data = (tensor.to(torch.float32) * scale).clamp(min=-limit, max=limit).to(float8_dtype)
    return data, scale


def _is_row_major(tensor: torch.Tensor) -> bool:
    stride = tensor.stride()
    return stride[0] > stride[1] and stride[1] == 1


def scaled_mm(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    out_dtype: torch.dtype,
    fast_accum: bool,
) -> torch.Tensor:
    """`(a / a_scale) @ (b / b_scale)` in `out_dtype` by `torch._scaled_mm`, as torchao's
    `preprocess_addmm` and `addmm_float8_unwrapped` do it: `a` row-major and `b` column-major
    (cuBLASLt takes no other layout); rowwise scales without fast accumulation applied after a
    matmul with unit scales (torchao finds CUTLASS's rowwise kernel too slow without it); rowwise
    results made in bfloat16 when float32 or float16 is asked (`_scaled_mm` has no rowwise
    float32 output) and cast after."""
    if not _is_row_major(a):
        a = a.contiguous()
    if _is_row_major(b):
        b = b.t().contiguous().t()
    a_inverse = _reciprocal(a_scale)
    b_inverse = _reciprocal(b_scale)
    rowwise = a_scale.shape == (a.shape[0], 1) and b_scale.shape == (1, b.shape[1])
    post_scale = None
    if rowwise and not fast_accum:
        post_scale = a_inverse * b_inverse
        a_inverse = a_inverse.new_ones(())
        b_inverse = a_inverse.new_ones(())
    mm_dtype = out_dtype
    if rowwise and out_dtype in (torch.float16, torch.float32):
        mm_dtype = torch.bfloat16
    out = torch._scaled_mm(
        a, b, scale_a=a_inverse, scale_b=b_inverse, out_dtype=mm_dtype, use_fast_accum=fast_accum
    )
    if post_scale is not None:
        out *= post_scale
    if mm_dtype is not out_dtype:
        out = out.to(out_dtype)
    return out


def _dim(recipe: Float8Recipe, dim: int) -> Optional[int]:
    return dim if recipe.rowwise else None


class Float8Linear(torch.autograd.Function):
    """`input @ weight.T` with its three matmuls in FP8 (no bias: the caller adds it in the
    output's dtype, as torchao's Float8Linear does). The output, and the input's gradient, come
    in the input's dtype; the weight's gradient in the output gradient's, cast to the weight's."""

    @staticmethod
    def forward(ctx, input: torch.Tensor, weight: torch.Tensor, recipe: Float8Recipe):
        ctx.save_for_backward(input, weight)
        ctx.recipe = recipe
        shape = input.shape
        x = input.reshape(-1, shape[-1])
        # torchao casts weight.t() (in, out) with its amax over dim 0: one scale per output row.
        weight_t = weight.t()
        x8, x_scale = to_float8(x, recipe.input_dtype, _dim(recipe, -1), recipe.power_of_2_scales)
        w8, w_scale = to_float8(
            weight_t, recipe.input_dtype, _dim(recipe, 0), recipe.power_of_2_scales
        )
        out = scaled_mm(x8, x_scale, w8, w_scale, input.dtype, recipe.fast_accum_output)
        return out.reshape(*shape[:-1], out.shape[-1])

    @staticmethod
    @once_differentiable  # no FP8 double backward: a clear error rather than wrong second grads
    def backward(ctx, grad_output: torch.Tensor):
        input, weight = ctx.saved_tensors
        recipe = ctx.recipe
        pow2 = recipe.power_of_2_scales
        shape = grad_output.shape
        grad = grad_output.reshape(-1, shape[-1])
        grad_input = grad_weight = g8 = None
        if ctx.needs_input_grad[0]:
            # dy @ w: dy scaled per row (over out features), w per column (over out features).
            g8, g_scale = to_float8(grad, recipe.grad_output_dtype, _dim(recipe, -1), pow2)
            wt8, wt_scale = to_float8(weight.t(), recipe.input_dtype, _dim(recipe, -1), pow2)
            grad_input = scaled_mm(
                g8, g_scale, wt8.t(), wt_scale.t(), grad.dtype, recipe.fast_accum_grad_input
            )
            grad_input = grad_input.reshape(*shape[:-1], grad_input.shape[-1])
        if ctx.needs_input_grad[1]:
            # dy.T @ x: both scaled per column (over tokens), the dimension the matmul reduces.
            x = input.reshape(-1, input.shape[-1])
            if g8 is None or recipe.rowwise:  # one scale per tensor: the cast above serves
                g8, g_scale = to_float8(grad, recipe.grad_output_dtype, _dim(recipe, 0), pow2)
            x8, x_scale = to_float8(x, recipe.input_dtype, _dim(recipe, 0), pow2)
            grad_weight = scaled_mm(
                g8.t(), g_scale.t(), x8, x_scale, grad.dtype, recipe.fast_accum_grad_weight
            )
            if grad_weight.dtype is not weight.dtype:
                grad_weight = grad_weight.to(weight.dtype)
        return grad_input, grad_weight, None


def linear(
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    recipe: Float8Recipe,
) -> torch.Tensor:
    """`F.linear(input, weight, bias)` with its matmuls in FP8, output in the input's dtype."""
    out = Float8Linear.apply(input, weight, recipe)
    if bias is not None:
        out = out + bias.to(out.dtype)
    return out


def fits(input: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether FP8 tensor cores take this linear: in features, out features and tokens all
    multiples of ALIGNMENT (and at least one token)."""
    if weight.dim() != 2 or input.dim() == 0:
        return False
    out_features, in_features = weight.shape
    if input.shape[-1] != in_features:
        return False
    tokens = input.numel() // in_features if in_features else 0
    return (
        in_features % ALIGNMENT == 0
        and out_features % ALIGNMENT == 0
        and tokens > 0
        and tokens % ALIGNMENT == 0
    )
