"""FP8 linear layers: the traced autograd Function, the scaled matmul's operand layouts, and the
choice between it and the eager one.

A linear `y = x @ w.T` makes three matmuls, each run by `torch._scaled_mm` on FP8 operands:
forward `x @ w.T`, grad-input `dy @ w` and grad-weight `dy.T @ x`. Every operand is cast with a
scale from its current amax (no history), per tensor or per row, as the recipe (data in
amp/lists/float8_recipes.py) says. The numerics follow torchao.float8 0.18
(`matmul_with_hp_or_float8_args`, `float8_utils.amax_to_scale`,
`float8_ops.addmm_float8_unwrapped`) operation by operation, down to the memory layouts handed to
`_scaled_mm`, so the results are its `Float8Linear`'s bit for bit.

Two Functions compute the same bits. Under torch.compile, `Float8Linear` (here): it saves the
high-precision input and weight and casts them again in backward, torch operations that the
compiler fuses. Eager, `float8_eager.Float8LinearEager`: fused casts that write both layouts of a
tensor in one read, FP8 layouts saved for backward, weights cast once per optimizer step.
Nothing FP8 is stored in the model or a checkpoint.
"""

from typing import Optional

import torch
from torch.autograd.function import once_differentiable

from ..kernels import float8 as kernels8
from ..kernels.float8 import EPS, amax_to_scale, to_float8
from ..lists.float8_recipes import RECIPES, Float8Recipe  # noqa: F401 (RECIPES: for callers)
from . import float8_eager

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

_reciprocal = torch.ops.aten.reciprocal  # not amp's patched Tensor.reciprocal
_compiling = torch.compiler.is_compiling

# The multiple that FP8 tensor cores (cuBLASLt) need of every dimension they are given: in and
# out features, and the tokens of a call (the inner dimension of the grad-weight matmul).
ALIGNMENT = 16


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
    """`(a / a_scale) @ (b / b_scale)` in `out_dtype` (kernels.float8.matmul), as torchao's
    `preprocess_addmm` lays the operands out: `a` made row-major and `b` column-major."""
    if not _is_row_major(a):
        a = a.contiguous()
    if _is_row_major(b):
        b = b.t().contiguous().t()
    return kernels8.matmul(
        a, _reciprocal(a_scale), b, _reciprocal(b_scale), out_dtype, fast_accum
    )


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
    if _compiling() or not float8_eager.takes(input, weight):
        out = Float8Linear.apply(input, weight, recipe)
    else:
        out = float8_eager.Float8LinearEager.apply(input, weight, recipe, torch.is_grad_enabled())
    if bias is not None:
        out = out + bias.to(out.dtype)
    return out


def fits(input: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether FP8 tensor cores take this linear: in features, out features and tokens all
    multiples of ALIGNMENT (and none of them 0)."""
    if weight.dim() != 2 or input.dim() == 0:
        return False
    out_features, in_features = weight.shape
    if input.shape[-1] != in_features:
        return False
    tokens = input.numel() // in_features if in_features else 0
    return (
        in_features % ALIGNMENT == 0
        and out_features % ALIGNMENT == 0
        and out_features > 0
        and tokens > 0
        and tokens % ALIGNMENT == 0
    )
