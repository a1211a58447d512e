"""Hostile round on the apex package and the diagnostics: each test is a defect a user hit."""

import warnings

import pytest
import torch

import amp
from amp._state import amp_state

apex = pytest.importorskip("apex", reason="needs amp's apex package: pip install -e ./compat/apex")
from apex.parallel import convert_syncbn_model  # noqa: E402


@pytest.fixture(autouse=True)
def clean_amp():
    yield
    amp.deinitialize()
    amp_state.origin_watch.disarm()
    amp_state.last_overflow = None


# --- apex.parallel.convert_syncbn_model ------------------------------------------------------


def test_convert_syncbn_model_keeps_the_layers_dtype_and_frozen_weights():
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(4, 6), torch.nn.Sequential(torch.nn.BatchNorm1d(6), torch.nn.ReLU())
    ).double()
    model[1][0].weight.requires_grad_(False)
    x = torch.randn(5, 4, dtype=torch.float64)
    expected = model(x)  # training mode: batch statistics, running stats updated once
    model[1][0].running_mean.zero_()
    model[1][0].running_var.fill_(1.0)
    model[1][0].num_batches_tracked.zero_()
    converted = convert_syncbn_model(model)
    bn = converted[1][0]
    assert type(bn) is apex.parallel.SyncBatchNorm
    assert bn.weight.dtype is bn.bias.dtype is torch.float64
    assert not bn.weight.requires_grad and bn.bias.requires_grad
    assert torch.equal(converted(x), expected)
    assert [p for p in converted.parameters() if p.requires_grad] == [
        converted[0].weight,
        converted[0].bias,
        bn.bias,
    ]
