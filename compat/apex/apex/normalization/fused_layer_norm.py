"""apex.normalization's layer norms on torch's: FusedLayerNorm is torch.nn.LayerNorm and
FusedRMSNorm torch.nn.RMSNorm, with apex's arguments (`memory_efficient` has no effect on
results and is accepted) and apex's parameter names (`weight`, `bias`), so checkpoints load.

Under autocast (torch's, or amp's casting, which torch's readers report) they do what apex's
did: input and parameters are cast to the autocast dtype and normalised there with autocast off,
so the output is in the autocast dtype (torch.nn.LayerNorm alone would run in FP32 and return
FP32). The Mixed* variants normalise in float32 and return the parameters' dtype, as apex's
mixed-dtype kernels."""

import contextlib

import torch
import torch.nn.functional as F


def _autocast_dtype(tensor: torch.Tensor) -> torch.dtype | None:
    """The autocast dtype for `tensor`'s device, or None where autocast is off (apex's
    `_cast_if_autocast_enabled`, on any device)."""
    device_type = tensor.device.type
    if not torch.is_autocast_enabled(device_type):
        return None
    return torch.get_autocast_dtype(device_type)


def _to(tensor: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    return None if tensor is None else tensor.to(dtype)


class FusedLayerNorm(torch.nn.LayerNorm):
    def __init__(self, normalized_shape, eps=1e-5, elementwise_affine=True, memory_efficient=False):
        super().__init__(normalized_shape, eps=eps, elementwise_affine=elementwise_affine)
        self.memory_efficient = memory_efficient

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        dtype = _autocast_dtype(input)
        if dtype is None:
            return super().forward(input)
        with torch.autocast(input.device.type, enabled=False):
            return F.layer_norm(
                input.to(dtype),
                self.normalized_shape,
                _to(self.weight, dtype),
                _to(self.bias, dtype),
                self.eps,
            )


class FusedRMSNorm(torch.nn.RMSNorm):
    def __init__(self, normalized_shape, eps=1e-5, elementwise_affine=True, memory_efficient=False):
        super().__init__(normalized_shape, eps=eps, elementwise_affine=elementwise_affine)
        self.memory_efficient = memory_efficient

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        dtype = _autocast_dtype(input)
        if dtype is None:
            return super().forward(input)
        with torch.autocast(input.device.type, enabled=False):
            return F.rms_norm(input.to(dtype), self.normalized_shape, _to(self.weight, dtype), self.eps)


def _float(tensor: torch.Tensor | None) -> torch.Tensor | None:
    return None if tensor is None else tensor.float()


def _mixed_arguments(module: torch.nn.Module, input: torch.Tensor):
    """(input, weight, bias, output dtype, region) of apex's mixed-dtype path: under autocast
    apex cast the input and parameters to the autocast dtype first; its kernels normalise in
    float32 and write the output in the weight's dtype."""
    weight, bias = module.weight, getattr(module, "bias", None)
    dtype = _autocast_dtype(input)
    region = contextlib.nullcontext()
    if dtype is not None:
        input, weight, bias = input.to(dtype), _to(weight, dtype), _to(bias, dtype)
        region = torch.autocast(input.device.type, enabled=False)
    output_dtype = input.dtype if weight is None else weight.dtype
    return input.float(), _float(weight), _float(bias), output_dtype, region


class MixedFusedLayerNorm(FusedLayerNorm):
    def forward(self, input: torch.Tensor) -> torch.Tensor:
        input, weight, bias, dtype, region = _mixed_arguments(self, input)
        with region:
            out = F.layer_norm(input, self.normalized_shape, weight, bias, self.eps)
        return out.to(dtype)


class MixedFusedRMSNorm(FusedRMSNorm):
    def forward(self, input: torch.Tensor) -> torch.Tensor:
        input, weight, _, dtype, region = _mixed_arguments(self, input)
        with region:
            out = F.rms_norm(input, self.normalized_shape, weight, self.eps)
        return out.to(dtype)
