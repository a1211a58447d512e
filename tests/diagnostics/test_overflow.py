"""The overflow report (amp/diagnostics/overflow.py): after a skipped step the skip message names
the parameters with inf/NaN gradients at verbosity 2. amp.last_overflow() is checked with the
skips it reports in tests/scaling/test_scale_loss.py."""

import logging

import torch

import amp
from helpers.models import inject, loss_of, make_model


def test_verbosity_two_names_the_parameters(caplog):
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, optimizer, opt_level="O2", verbosity=2)
    try:
        with caplog.at_level(logging.INFO, logger="amp"):
            with amp.scale_loss(loss_of(model, 0), optimizer) as scaled:
                scaled.backward()
                inject(model[2].weight, "inf")
            optimizer.step()
    finally:
        amp.deinitialize()
    assert (
        "Gradient overflow.  Skipping step, loss scaler 0 reducing loss scale to 32768.0; "
        "non-finite gradients in: 2.weight" in caplog.text
    )
