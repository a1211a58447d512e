"""Diagnostics with FP8 layers: amp.audit(..., float8=...) finds the layer FP8 hurts, and the
overflow origin names an FP8 layer whose output overflows."""

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


def test_the_overflow_origin_names_the_fp8_layer():
    """float16 at O2 + float8: an FP8 matmul's float16 output overflows; amp skips the step,
    watches the next one and names the layer."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.Linear(32, 16))
    with torch.no_grad():
        model[2].weight.mul_(3e4)  # its output is beyond float16's 65504
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    model, optimizer = amp.initialize(
        model, optimizer, opt_level="O2", float8="tensorwise", verbosity=0
    )
    x = torch.randn(16, 16) * 10
    try:
        with pytest.warns(amp.NonFiniteLossWarning, match="module '2' in forward"):
            for _ in range(2):
                with amp.trace() as trace:
                    loss = model(x).float().square().mean()
                with amp.scale_loss(loss, optimizer) as scaled:
                    scaled.backward()
                optimizer.step()
                optimizer.zero_grad()
        report = amp.last_overflow()
    finally:
        amp.deinitialize()
    assert [r.ran_in for r in trace.records][:2] == [torch.float8_e4m3fn] * 2
    origin = report.origin
    assert (origin.module, origin.phase, origin.op) == ("2", "forward", "Linear")
    assert origin.dtype is torch.float16 and origin.kind == "inf"
