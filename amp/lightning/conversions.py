"""The dtypes of what crosses the model's edge: batches in (convert_input), outputs out
(convert_output).

At O2/O3 a batch's floating tensors reach the model in its dtype, as with Lightning's "bf16-true";
outputs leave in FP32, as from Lightning's mixed plugins. float64 stays float64 both ways.
lightning_utilities is imported by each call: this module loads with the plugin, before the
plugin has checked that Lightning is installed.
"""

from typing import Any

import torch

from .options import LOW_PRECISION

__all__ = ["to_model_dtype", "to_default_dtype"]


def to_model_dtype(data: Any, dtype: torch.dtype) -> Any:
    """`data` with its floating tensors (not float64) in `dtype`."""
    from lightning_utilities import apply_to_collection

    return apply_to_collection(data, torch.Tensor, _cast_floating, dtype)


def to_default_dtype(data: Any) -> Any:
    """`data` with its float16 and bfloat16 tensors in torch's default dtype."""
    from lightning_utilities import apply_to_collection

    default = torch.get_default_dtype()
    return apply_to_collection(data, torch.Tensor, _cast_low_precision, default)


def _cast_floating(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if tensor.is_floating_point() and tensor.dtype is not torch.float64:
        return tensor.to(dtype)
    return tensor


def _cast_low_precision(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return tensor.to(dtype) if tensor.dtype in LOW_PRECISION else tensor
