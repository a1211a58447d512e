"""apex.normalization from the apex package: the fused layer and RMS norms are torch's norms with
apex's arguments."""

import torch


def test_fused_norms_are_torch_norms_with_apex_arguments():
    from apex.normalization import (
        FusedLayerNorm,
        FusedRMSNorm,
        MixedFusedLayerNorm,
        MixedFusedRMSNorm,
    )

    x = torch.randn(3, 5, 8)
    layer = FusedLayerNorm(8, eps=1e-6, memory_efficient=True)
    assert torch.equal(layer(x), torch.nn.functional.layer_norm(x, (8,), eps=1e-6))
    assert sorted(layer.state_dict()) == ["bias", "weight"]
    rms = FusedRMSNorm([5, 8], elementwise_affine=False)
    assert torch.equal(rms(x), torch.nn.functional.rms_norm(x, (5, 8), eps=1e-5))
    assert rms.state_dict() == {}
    half = x.half()
    mixed = MixedFusedLayerNorm(8)
    assert mixed.weight.dtype is torch.float32 and mixed(half).dtype is torch.float16
    torch.testing.assert_close(mixed(half).float(), layer(half.float()), rtol=1e-3, atol=2e-3)
    torch.testing.assert_close(
        MixedFusedRMSNorm(8)(half).float(), FusedRMSNorm(8)(half.float()), rtol=1e-3, atol=2e-3
    )
