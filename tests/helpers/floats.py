"""Floating-point comparisons the numerics tests share: the bits of a tensor, and the distance of
two float32 tensors in units in the last place."""

import torch


def bits(tensor):
    return tensor.view({2: torch.int16, 4: torch.int32}[tensor.element_size()])


def ulps(a, b):
    """Distance of float32 tensors in units in the last place (across zero too)."""
    a, b = bits(a).long(), bits(b).long()
    a = torch.where(a < 0, -(a & 0x7FFFFFFF), a)
    b = torch.where(b < 0, -(b & 0x7FFFFFFF), b)
    return (a - b).abs()
