"""apex.normalization from the apex package: the fused layer and RMS norms are torch's norms with
apex's arguments, and under autocast they do what apex's did."""

import itertools

import pytest
import torch
import torch.nn.functional as F
from apex.normalization import FusedLayerNorm, FusedRMSNorm, MixedFusedLayerNorm, MixedFusedRMSNorm

import amp


# apex's no-op arguments are passed on purpose: ApexCompatWarning is tested in
# test_ignored_arguments.py (in a fresh process: it warns once per argument and process).
@pytest.mark.filterwarnings("ignore::apex.ApexCompatWarning")
def test_fused_norms_are_torch_norms_with_apex_arguments():
    x = torch.randn(3, 5, 8)
    layer = FusedLayerNorm(8, eps=1e-6, memory_efficient=True)
    assert torch.equal(layer(x), torch.nn.functional.layer_norm(x, (8,), eps=1e-6))
    assert sorted(layer.state_dict()) == ["bias", "weight"]
    rms = FusedRMSNorm([5, 8], elementwise_affine=False)
    assert torch.equal(rms(x), torch.nn.functional.rms_norm(x, (5, 8), eps=1e-5))
    assert rms.state_dict() == {}
    half = x.half()
    mixed = MixedFusedLayerNorm(8)
    # apex's mixed-dtype kernels normalise in float32 and write the weight's dtype.
    assert mixed.weight.dtype is torch.float32 and mixed(half).dtype is torch.float32
    assert MixedFusedLayerNorm(8).half()(half).dtype is torch.float16
    torch.testing.assert_close(mixed(half), layer(half.float()), rtol=1e-3, atol=2e-3)
    torch.testing.assert_close(
        MixedFusedRMSNorm(8)(half), FusedRMSNorm(8)(half.float()), rtol=1e-3, atol=2e-3
    )


# apex's test_autocast_fused_layer_norm / _rms_norm, rewritten: an FP32 fused norm under autocast
# against the native norm in the autocast dtype, with apex's tolerances; apex compared values
# only, amp checks the dtype too (apex returned the autocast dtype).
_TOLERANCES = {
    torch.float16: ({}, {}),
    torch.bfloat16: (dict(rtol=1.6e-2, atol=3e-4), dict(rtol=1.6e-2, atol=3e-3)),
}


def _region(kind, dtype):
    return torch.autocast("cpu", dtype=dtype) if kind == "torch" else amp.autocast(dtype=dtype)


@pytest.mark.filterwarnings("ignore::apex.ApexCompatWarning")  # memory_efficient=True
@pytest.mark.parametrize("region", ["torch", "amp"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("norm", ["layer", "rms"])
def test_fused_norms_under_autocast_compute_in_and_return_the_autocast_dtype(norm, dtype, region):
    fused_class, native_class = {
        "layer": (FusedLayerNorm, torch.nn.LayerNorm),
        "rms": (FusedRMSNorm, torch.nn.RMSNorm),
    }[norm]
    forward_tolerance, backward_tolerance = _TOLERANCES[dtype]
    generator = torch.Generator().manual_seed(0)
    for affine, memory_efficient in itertools.product((True, False), (True, False)):
        native = native_class([32, 16], elementwise_affine=affine).to(dtype)
        fused = fused_class([32, 16], elementwise_affine=affine, memory_efficient=memory_efficient)
        x = torch.randn(16, 32, 16, generator=generator)
        native_x = x.to(dtype).requires_grad_()
        fused_x = x.to(dtype).requires_grad_()
        expected = native(native_x)
        with _region(region, dtype):
            actual = fused(fused_x)
        assert actual.dtype is dtype
        torch.testing.assert_close(actual, expected, **forward_tolerance)
        gradient = torch.rand_like(expected)
        expected.backward(gradient)
        actual.backward(gradient)
        torch.testing.assert_close(fused_x.grad, native_x.grad, **backward_tolerance)
        if affine:
            assert fused.weight.grad.dtype is torch.float32  # FP32 parameters get FP32 gradients
    amp.deinitialize()


@pytest.mark.parametrize("mixed_class", [MixedFusedLayerNorm, MixedFusedRMSNorm])
def test_mixed_fused_norms_under_autocast_return_the_autocast_dtype(mixed_class):
    x = torch.randn(4, 8)
    with amp.autocast(dtype=torch.bfloat16):
        assert mixed_class(8)(x).dtype is torch.bfloat16
    amp.deinitialize()


def test_apex_functional_layer_norm_api_is_torch_norms_with_apex_defaults():
    """BERT and timm import apex's functional API and fall back silently when it is missing."""
    from apex.normalization import fused_layer_norm as apex_ln

    x = torch.randn(3, 8, requires_grad=True)
    weight = torch.rand(8, requires_grad=True)
    bias = torch.rand(8, requires_grad=True)
    shape = torch.Size([8])
    # BERT's BertLayerNorm.forward
    out = apex_ln.FusedLayerNormAffineFunction.apply(x, weight, bias, shape, 1e-12)
    assert torch.equal(out, F.layer_norm(x, (8,), weight, bias, 1e-12))
    out.sum().backward()
    assert weight.grad is not None and bias.grad is not None and x.grad is not None
    expected = {
        "fused_layer_norm_affine": F.layer_norm(x, (8,), weight, bias, 1e-6),
        "fused_layer_norm": F.layer_norm(x, (8,), eps=1e-6),
        "fused_rms_norm_affine": F.rms_norm(x, (8,), weight, 1e-6),
        "fused_rms_norm": F.rms_norm(x, (8,), eps=1e-6),
    }
    found = {
        "fused_layer_norm_affine": apex_ln.fused_layer_norm_affine(x, weight, bias, shape),
        "fused_layer_norm": apex_ln.fused_layer_norm(x, 8),
        "fused_rms_norm_affine": apex_ln.fused_rms_norm_affine(x, weight, [8]),
        "fused_rms_norm": apex_ln.fused_rms_norm(x, shape),
    }
    for name, value in found.items():
        assert torch.equal(value, expected[name]), name
    assert torch.equal(
        apex_ln.FusedRMSNormFunction.apply(x, shape, 1e-5), F.rms_norm(x, (8,), eps=1e-5)
    )
    half = x.detach().half()
    mixed = apex_ln.mixed_dtype_fused_layer_norm_affine(half, weight, bias, shape)
    assert mixed.dtype is torch.float32  # the weight's dtype, as apex's mixed-dtype kernel
    torch.testing.assert_close(mixed, F.layer_norm(half.float(), (8,), weight, bias, 1e-6))
    assert apex_ln.mixed_dtype_fused_rms_norm_affine(half, weight.half(), shape).dtype is (
        torch.float16
    )
    with amp.autocast(dtype=torch.bfloat16):
        assert apex_ln.fused_layer_norm_affine(x, weight, bias, shape).dtype is torch.bfloat16
        assert apex_ln.fused_rms_norm(x, shape).dtype is torch.bfloat16
        # The Function takes its tensors as given, as apex's kernel: not cast by autocast.
        assert apex_ln.FusedLayerNormAffineFunction.apply(
            half, weight, bias, shape, 1e-5
        ).dtype is (torch.float16)
    amp.deinitialize()
