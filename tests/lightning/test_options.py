"""AmpPrecision's arguments (amp/lightning/options.py): refused with what was wrong when the
plugin is made."""

import pytest
import torch

pytest.importorskip("lightning.pytorch")  # installed by `make test` (the `lightning` extra)

from amp.lightning import AmpPrecision  # noqa: E402


def test_arguments_are_checked_when_the_plugin_is_made():
    with pytest.raises(ValueError, match="the letter O"):
        AmpPrecision(opt_level="02")
    with pytest.raises(ValueError, match="float16 or torch.bfloat16"):
        AmpPrecision(dtype=torch.float32)
    with pytest.raises(TypeError, match="lossscale is not an argument of amp.initialize"):
        AmpPrecision(lossscale=128.0)
