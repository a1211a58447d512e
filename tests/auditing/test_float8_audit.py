"""amp.audit(..., float8=...): finds the layer FP8 hurts and says what to keep out of FP8."""

import pytest
import torch
from torch import nn

import amp


class Sink(nn.Module):
    """Massive activations, as attention sinks make them: channel 0 of every 8th token at 1e5."""

    def forward(self, x):
        x = x.clone()
        x[::8, 0] = 1e5
        return x


def outlier_model():
    """Four FP8-sized linears; the input of '3' carries the sink's outliers, in a channel its
    weight ignores (so in FP32 they change nothing), and FP8's scale must span them."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(64, 128),
        nn.GELU(),
        Sink(),
        nn.Linear(128, 128),
        nn.GELU(),
        nn.Linear(128, 128),
        nn.GELU(),
        nn.Linear(128, 32),
    )
    with torch.no_grad():
        model[3].weight[:, 0] = 0
    x, y = torch.randn(64, 64), torch.randint(0, 32, (64,))
    return model, lambda: nn.functional.cross_entropy(model(x).float(), y)


def test_the_float8_audit_ranks_the_outlier_layer_worst_and_says_what_to_do():
    model, loss = outlier_model()
    before = [p.clone() for p in model.parameters()]
    try:
        tensorwise = amp.audit(loss, model, dtype="float8")
        rowwise = amp.audit(loss, model, dtype=torch.bfloat16, float8="rowwise")
    finally:
        amp.deinitialize()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert tensorwise.float8 == "tensorwise" and tensorwise.dtype is torch.bfloat16
    worst = tensorwise.rows[0]
    assert (worst.module, worst.op) == ("3", "Linear") and worst.relative_error > 0.25
    # The other linears lose what FP8's three mantissa bits lose, and no more: each module runs
    # on its FP32 inputs, so '5' and '7' do not inherit '3''s error.
    others = [tensorwise.row(name).relative_error for name in ("0", "5", "7")]
    assert max(others) < 0.06
    assert rowwise.rows[0].module == "3"
    assert rowwise.row("3").relative_error < worst.relative_error / 2  # 7 rows in 8 are clean
    assert tensorwise.keep_fp32() == ["3"]
    advice = tensorwise.suggest()
    assert "fp32_modules=['3']" in advice and "float8='rowwise'" in advice
    assert "float8 (tensorwise, bfloat16 around it) against float32" in str(tensorwise)


def test_the_advice_applied_keeps_that_layer_out_of_fp8():
    model, loss = outlier_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    amp.initialize(
        model,
        optimizer,
        opt_level="O2",
        dtype=torch.bfloat16,
        float8="tensorwise",
        fp32_modules=["3"],
        verbosity=0,
    )
    try:
        with amp.trace() as trace:
            loss()
    finally:
        amp.deinitialize()
    ran_in = [r.ran_in for r in trace.records if r.op.endswith("functional.linear")]
    assert ran_in == [torch.float8_e4m3fn, torch.float32, torch.float8_e4m3fn, torch.float8_e4m3fn]


def test_a_healthy_model_needs_nothing():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16))
    x = torch.randn(32, 32)
    try:
        report = amp.audit(lambda: model(x).square().mean(), model, float8="tensorwise")
    finally:
        amp.deinitialize()
    assert report.keep_fp32() == []
    assert "every module fits float8 (tensorwise)" in report.suggest()


def test_bad_float8_arguments():
    model, loss = outlier_model()
    with pytest.raises(ValueError, match="not a float8 recipe"):
        amp.audit(loss, model, float8="delayed")
    with pytest.raises(ValueError, match='or "float8"'):
        amp.audit(loss, model, dtype="float4")
