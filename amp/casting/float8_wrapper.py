"""The wrapper of the FLOAT8 policy kind: `F.linear` (and functions of its signature) in FP8 where
the policy in force asks for float8 and the shapes fit; as a FP16_FUNCS entry everywhere else."""

import functools

import torch

from .._state import INHERIT, amp_state
from ..diagnostics.trace import traced_call
from ..lists import FLOAT8, LOWER_PRECISION
from ..patching import ORIGINAL_ATTRIBUTE
from . import float8
from .casts import CASTABLE
from .wrappers import make_wrapper

__all__ = ["linear_arguments", "make_float8_wrapper"]

_Tensor = torch.Tensor
_compiler = torch.compiler
_is_dynamo_compiling = torch.compiler.is_dynamo_compiling
_NAMES = ("input", "weight", "bias")


def linear_arguments(args, kwargs):
    """(input, weight, bias) of a call in F.linear's signature, or None for any other call."""
    if len(args) > 3 or (kwargs and not kwargs.keys() <= set(_NAMES[len(args) :])):
        return None
    found = list(args) + [kwargs.get(name) for name in _NAMES[len(args) :]]
    input, weight, bias = found
    if not (isinstance(input, _Tensor) and isinstance(weight, _Tensor)):
        return None
    if input.dtype not in CASTABLE or weight.dtype not in CASTABLE:
        return None  # float64 is asked for deliberately; other types are no matmul of ours
    if bias is not None and not (isinstance(bias, _Tensor) and bias.dtype in CASTABLE):
        return None
    return input, weight, bias


def make_float8_wrapper(original, name):
    """A replacement for `original` (F.linear's signature) that runs its matmuls in FP8 where the
    policy in force has a float8 recipe and `float8.fits` the shapes, and is `original`'s
    lower-precision wrapper (amp/casting/wrappers.py) otherwise.

    At O1 and in regions the input is cast to the policy's dtype first, so the output comes in
    it; the weight goes to FP8 from its own dtype (FP32 at O1, one rounding, as torchao under
    autocast), and the bias is added in the output's dtype.
    """
    lower = make_wrapper(original, LOWER_PRECISION, name)
    thread = amp_state.thread
    state = amp_state
    recipes = float8.RECIPES

    def amp_float8_wrapper(*args, **kwargs):
        if not state.active:
            return original(*args, **kwargs)
        policy = thread.policy
        if policy is INHERIT:
            policy = state.default_policy
        recipe = None if policy is None else policy.float8
        if recipe is None:
            return lower(*args, **kwargs)
        call = linear_arguments(args, kwargs)
        if call is None or not float8.fits(call[0], call[1]):
            return lower(*args, **kwargs)
        input, weight, bias = call
        recipe = recipes[recipe]
        target = policy.target_for(input)
        if target is not None and input.dtype is not target:
            input = input.to(target)
        if thread.trace is not None and not (
            _is_dynamo_compiling() or _compiler._is_compiling_flag
        ):
            new = (input, weight, bias, recipe), {}
            return traced_call(
                float8.linear, name, FLOAT8, policy, new, args, kwargs, recipe.input_dtype
            )
        return float8.linear(input, weight, bias, recipe)

    functools.update_wrapper(amp_float8_wrapper, original)
    setattr(amp_float8_wrapper, ORIGINAL_ATTRIBUTE, original)
    amp_float8_wrapper.__amp_kind__ = FLOAT8
    return amp_float8_wrapper
