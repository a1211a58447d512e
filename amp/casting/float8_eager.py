"""The FP8 linear outside torch.compile: `Float8LinearEager` computes float8.Float8Linear's bits
with less device work.

Each high-precision tensor is cast once into every FP8 layout its matmuls take (amp/kernels/
float8.py: on CUDA one read for the amaxes, one read that writes both layouts): the input into
the forward's row-major operand and, for grad-weight, its transpose; the output gradient into
grad-input's operand and grad-weight's transposed one; the weight from the per-step cache
(float8_weights.py) in both. Backward takes the FP8 layouts saved in forward (the input's
transpose: half the bytes of the input it replaces) and casts only the output gradient.
Tensorwise, a tensor's two layouts share one scale; rowwise, the row-major layout is scaled per
row and the transposed one per column, as the two matmuls reduce them.
"""

import torch
from torch.autograd.function import once_differentiable

from ..kernels import float8 as kernels8
from ..lists.float8_recipes import Float8Recipe
from . import float8_weights

__all__ = ["takes", "Float8LinearEager"]

_PLAIN = frozenset((torch.Tensor, torch.nn.Parameter))


def takes(input: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether Float8LinearEager runs this call: plain tensors (a subclass such as DTensor or a
    FakeTensor goes through float8.Float8Linear, whose torch operations it dispatches)."""
    return type(input) in _PLAIN and type(weight) in _PLAIN


class Float8LinearEager(torch.autograd.Function):
    """`input @ weight.T` with its three matmuls in FP8, as float8.Float8Linear (no bias; the
    output and the input's gradient in the input's dtype, the weight's gradient in the output
    gradient's, cast to the weight's)."""

    @staticmethod
    def forward(
        ctx, input: torch.Tensor, weight: torch.Tensor, recipe: Float8Recipe, grad_enabled: bool
    ):
        # needs_input_grad says requires_grad, in grad mode or not: `grad_enabled` is the caller's
        # grad mode (forward runs without), so that no_grad calls make no backward layout and
        # take nothing from the weight cache.
        needs_input_grad, needs_weight_grad = (
            grad_enabled and needed for needed in ctx.needs_input_grad[:2]
        )
        by_row, by_col = float8_weights.scalings(recipe)
        shape = input.shape
        (x,) = kernels8.cast(
            [input.reshape(-1, shape[-1])],
            recipe.input_dtype,
            by_row,
            by_col if needs_weight_grad else None,
            recipe.power_of_2_scales,
        )
        w = float8_weights.layouts(
            weight, recipe, train=needs_weight_grad, transposed=needs_input_grad
        )
        out = kernels8.matmul(
            x.data, x.inverse, w.data.t(), w.inverse.t(), input.dtype, recipe.fast_accum_output
        )
        # The weight itself for autograd's check that it was not written before backward.
        ctx.save_for_backward(weight, x.data_t, x.inverse_t, w.data_t, w.inverse_t)
        ctx.recipe = recipe
        return out.reshape(*shape[:-1], out.shape[-1])

    @staticmethod
    @once_differentiable  # no FP8 double backward: a clear error rather than wrong second grads
    def backward(ctx, grad_output: torch.Tensor):
        weight, x_t, x_inverse_t, w_t, w_inverse_t = ctx.saved_tensors
        recipe = ctx.recipe
        needs_input_grad, needs_weight_grad = ctx.needs_input_grad[:2]
        by_row, by_col = float8_weights.scalings(recipe)
        shape = grad_output.shape
        grad = grad_output.reshape(-1, shape[-1])
        (g,) = kernels8.cast(
            [grad],
            recipe.grad_output_dtype,
            by_row if needs_input_grad else None,
            by_col if needs_weight_grad else None,
            recipe.power_of_2_scales,
        )
        grad_input = grad_weight = None
        if needs_input_grad:  # dy @ w
            grad_input = kernels8.matmul(
                g.data, g.inverse, w_t.t(), w_inverse_t.t(), grad.dtype,
                recipe.fast_accum_grad_input,
            )
            grad_input = grad_input.reshape(*shape[:-1], grad_input.shape[-1])
        if needs_weight_grad:  # dy.T @ x
            grad_weight = kernels8.matmul(
                g.data_t, g.inverse_t, x_t.t(), x_inverse_t.t(), grad.dtype,
                recipe.fast_accum_grad_weight,
            )
            if grad_weight.dtype is not weight.dtype:
                grad_weight = grad_weight.to(weight.dtype)
        return grad_input, grad_weight, None, None
