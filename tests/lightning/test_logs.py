"""amp's loss scale and skipped steps in the Trainer's logs (amp/lightning/logs.py)."""

import os
import sys

import pytest
import torch

pytest.importorskip("lightning.pytorch")  # installed by `make test` (the `lightning` extra)

sys.path.insert(0, os.path.dirname(__file__))

from amp.lightning import AmpPrecision  # noqa: E402
from lightning_helpers import Regressor, loader, trainer  # noqa: E402


def test_log_puts_the_scale_and_the_skips_into_the_trainers_metrics():
    plugin = AmpPrecision("O2", torch.bfloat16, log=True, verbosity=0)
    run = trainer(plugin, max_steps=3)  # the last step of the run logs
    run.fit(Regressor(overflow_at={1}), loader())
    assert run.callback_metrics["amp/skipped_steps"].item() == 1.0
    assert run.callback_metrics["amp/loss_scale"].item() == 32768.0
