"""apex.normalization's layer norms on torch's: FusedLayerNorm is torch.nn.LayerNorm and
FusedRMSNorm torch.nn.RMSNorm, with apex's arguments (`memory_efficient` has no effect on
results and is accepted) and apex's parameter names (`weight`, `bias`), so checkpoints load.
The Mixed* variants keep float32 parameters for low-precision input: they normalise in float32
and return the input's dtype, as apex's."""

import torch
import torch.nn.functional as F


class FusedLayerNorm(torch.nn.LayerNorm):
    def __init__(self, normalized_shape, eps=1e-5, elementwise_affine=True, memory_efficient=False):
        super().__init__(normalized_shape, eps=eps, elementwise_affine=elementwise_affine)
        self.memory_efficient = memory_efficient


class FusedRMSNorm(torch.nn.RMSNorm):
    def __init__(self, normalized_shape, eps=1e-5, elementwise_affine=True, memory_efficient=False):
        super().__init__(normalized_shape, eps=eps, elementwise_affine=elementwise_affine)
        self.memory_efficient = memory_efficient


def _float(tensor):
    return None if tensor is None else tensor.float()


class MixedFusedLayerNorm(FusedLayerNorm):
    def forward(self, input):
        out = F.layer_norm(
            input.float(), self.normalized_shape, _float(self.weight), _float(self.bias), self.eps
        )
        return out.to(input.dtype)


class MixedFusedRMSNorm(FusedRMSNorm):
    def forward(self, input):
        out = F.rms_norm(input.float(), self.normalized_shape, _float(self.weight), self.eps)
        return out.to(input.dtype)
