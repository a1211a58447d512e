"""apex.normalization.fused_layer_norm on torch's layer and RMS norms: apex's modules, its
functional API and its autograd Functions (as `.apply`, how apex-era code calls them: BERT's
`FusedLayerNormAffineFunction.apply(x, weight, bias, shape, eps)`).

FusedLayerNorm is torch.nn.LayerNorm and FusedRMSNorm torch.nn.RMSNorm, with apex's arguments
(`memory_efficient` has no effect on results and is accepted) and apex's parameter names
(`weight`, `bias`), so checkpoints load. Under autocast (torch's, or amp's casting, which torch's
readers report) they do what apex's did: input and parameters are cast to the autocast dtype
and normalised there with autocast off, so the output is in the autocast dtype
(torch.nn.LayerNorm alone would run in FP32 and return FP32). The mixed-dtype variants normalise
in float32 and return the weight's dtype, as apex's mixed-dtype kernels.
"""

import contextlib
import numbers

import torch
import torch.nn.functional as F

from .._ignored import warn_ignored


def _autocast_dtype(tensor: torch.Tensor) -> torch.dtype | None:
    """The autocast dtype for `tensor`'s device, or None where autocast is off."""
    device_type = tensor.device.type
    if not torch.is_autocast_enabled(device_type):
        return None
    return torch.get_autocast_dtype(device_type)


def _cast_if_autocast_enabled(input: torch.Tensor, *tensors: torch.Tensor | None) -> tuple:
    """apex's `_cast_if_autocast_enabled` on any device: the input and parameters in the
    autocast dtype of the input's device, or as they are where autocast is off there."""
    dtype = _autocast_dtype(input)
    if dtype is None:
        return (input, *tensors)
    return tuple(None if t is None else t.to(dtype) for t in (input, *tensors))


def _no_autocast(input: torch.Tensor) -> contextlib.AbstractContextManager:
    # apex's kernels took their tensors as they came; torch's norm would be cast by autocast.
    if torch.is_autocast_enabled(input.device.type):
        return torch.autocast(input.device.type, enabled=False)
    return contextlib.nullcontext()


def _shape(normalized_shape) -> tuple:
    if isinstance(normalized_shape, numbers.Integral):
        return (normalized_shape,)
    return tuple(normalized_shape)


def _float(tensor: torch.Tensor | None) -> torch.Tensor | None:
    return None if tensor is None else tensor.float()


# --- apex's autograd Functions: `.apply(...)`, autograd through torch's norms ---------------------


class FusedLayerNormAffineFunction:
    @staticmethod
    def apply(input, weight, bias, normalized_shape, eps, memory_efficient=False):
        with _no_autocast(input):
            return F.layer_norm(input, _shape(normalized_shape), weight, bias, eps)


class FusedLayerNormFunction:
    @staticmethod
    def apply(input, normalized_shape, eps, memory_efficient=False):
        return FusedLayerNormAffineFunction.apply(input, None, None, normalized_shape, eps)


class FusedRMSNormAffineFunction:
    @staticmethod
    def apply(input, weight, normalized_shape, eps, memory_efficient=False):
        with _no_autocast(input):
            return F.rms_norm(input, _shape(normalized_shape), weight, eps)


class FusedRMSNormFunction:
    @staticmethod
    def apply(input, normalized_shape, eps, memory_efficient=False):
        return FusedRMSNormAffineFunction.apply(input, None, normalized_shape, eps)


class FusedLayerNormAffineMixedDtypesFunction(FusedLayerNormAffineFunction):
    @staticmethod
    def apply(input, weight, bias, normalized_shape, eps, memory_efficient=False):
        dtype = input.dtype if weight is None else weight.dtype
        out = FusedLayerNormAffineFunction.apply(
            input.float(), _float(weight), _float(bias), normalized_shape, eps
        )
        return out.to(dtype)


class FusedRMSNormAffineMixedDtypesFunction(FusedRMSNormAffineFunction):
    @staticmethod
    def apply(input, weight, normalized_shape, eps, memory_efficient=False):
        dtype = input.dtype if weight is None else weight.dtype
        out = FusedRMSNormAffineFunction.apply(input.float(), _float(weight), normalized_shape, eps)
        return out.to(dtype)


# --- apex's functional API: cast under autocast, then the Function ------------------------------


def fused_layer_norm_affine(
    input, weight, bias, normalized_shape, eps=1e-6, memory_efficient=False
):
    input, weight, bias = _cast_if_autocast_enabled(input, weight, bias)
    return FusedLayerNormAffineFunction.apply(input, weight, bias, normalized_shape, eps)


def fused_layer_norm(input, normalized_shape, eps=1e-6, memory_efficient=False):
    (input,) = _cast_if_autocast_enabled(input)
    return FusedLayerNormFunction.apply(input, normalized_shape, eps)


def mixed_dtype_fused_layer_norm_affine(
    input, weight, bias, normalized_shape, eps=1e-6, memory_efficient=False
):
    input, weight, bias = _cast_if_autocast_enabled(input, weight, bias)
    return FusedLayerNormAffineMixedDtypesFunction.apply(input, weight, bias, normalized_shape, eps)


def fused_rms_norm_affine(input, weight, normalized_shape, eps=1e-6, memory_efficient=False):
    input, weight = _cast_if_autocast_enabled(input, weight)
    return FusedRMSNormAffineFunction.apply(input, weight, normalized_shape, eps)


def fused_rms_norm(input, normalized_shape, eps=1e-6, memory_efficient=False):
    (input,) = _cast_if_autocast_enabled(input)
    return FusedRMSNormFunction.apply(input, normalized_shape, eps)


def mixed_dtype_fused_rms_norm_affine(
    input, weight, normalized_shape, eps=1e-6, memory_efficient=False
):
    input, weight = _cast_if_autocast_enabled(input, weight)
    return FusedRMSNormAffineMixedDtypesFunction.apply(input, weight, normalized_shape, eps)


# --- the modules ----------------------------------------------------------------------------


def _warn_memory_efficient(name, memory_efficient):
    warn_ignored(
        f"apex.normalization.{name}",
        "apex's kernel recomputed from the output to save memory; torch's norm gives the same "
        "results",
        dict(memory_efficient=memory_efficient),
        dict(memory_efficient=False),
    )


class FusedLayerNorm(torch.nn.LayerNorm):
    def __init__(self, normalized_shape, eps=1e-5, elementwise_affine=True, memory_efficient=False):
        super().__init__(normalized_shape, eps=eps, elementwise_affine=elementwise_affine)
        _warn_memory_efficient(type(self).__name__, memory_efficient)
        self.memory_efficient = memory_efficient

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return fused_layer_norm_affine(
            input, self.weight, self.bias, self.normalized_shape, self.eps
        )


class FusedRMSNorm(torch.nn.RMSNorm):
    def __init__(self, normalized_shape, eps=1e-5, elementwise_affine=True, memory_efficient=False):
        super().__init__(normalized_shape, eps=eps, elementwise_affine=elementwise_affine)
        _warn_memory_efficient(type(self).__name__, memory_efficient)
        self.memory_efficient = memory_efficient

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return fused_rms_norm_affine(input, self.weight, self.normalized_shape, self.eps)


class MixedFusedLayerNorm(FusedLayerNorm):
    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return mixed_dtype_fused_layer_norm_affine(
            input, self.weight, self.bias, self.normalized_shape, self.eps
        )


class MixedFusedRMSNorm(FusedRMSNorm):
    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return mixed_dtype_fused_rms_norm_affine(
            input, self.weight, self.normalized_shape, self.eps
        )


__all__ = [
    "FusedLayerNorm",
    "FusedRMSNorm",
    "MixedFusedLayerNorm",
    "MixedFusedRMSNorm",
    "FusedLayerNormAffineFunction",
    "FusedLayerNormFunction",
    "FusedRMSNormAffineFunction",
    "FusedRMSNormFunction",
    "FusedLayerNormAffineMixedDtypesFunction",
    "FusedRMSNormAffineMixedDtypesFunction",
    "fused_layer_norm_affine",
    "fused_layer_norm",
    "mixed_dtype_fused_layer_norm_affine",
    "fused_rms_norm_affine",
    "fused_rms_norm",
    "mixed_dtype_fused_rms_norm_affine",
]
