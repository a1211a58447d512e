"""apex-style training scripts, end to end (tests/helpers/apex_style.py), at O0-O3 in fp16 and
bf16: two models, two optimizers (one wrapped LARC-style), two losses with their own scalers, the
second loss reaching both models, scales forced through `amp._amp_state`, the LR scheduler gated on
`_unskipped`. Their checkpoints resume bit for bit: tests/programs/test_resume.py."""

import pytest
import torch

from helpers import DTYPES, OPT_LEVELS
from helpers.apex_style import run


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("opt_level", OPT_LEVELS)
def test_apex_script_trains_with_the_forced_scales(opt_level, dtype):
    straight = run(opt_level, dtype, steps=8)
    assert all(map(torch.isfinite, map(torch.tensor, straight["losses"])))
    assert sum(straight["losses"][-2:]) < 0.9 * sum(straight["losses"][:2])
    assert straight["scheduler steps"] == 8 and straight["wrapper steps"] == 8
    assert straight["scales"] == [4.0, 16.0]  # the forced scales, used all along


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_apex_script_overflow_skips_the_step_of_both_optimizers_of_that_loss(opt_level, dtype):
    result = run(opt_level, dtype, steps=4, inject_at=2)
    assert result["wrapper steps"] == 3  # step 2 skipped, LARC-style wrapper included
    assert result["scales"] == [4.0, 8.0]  # only loss 1's scaler backed off
    assert result["scheduler steps"] == 3  # the _unskipped gate held the scheduler back once
    assert result["overflow"].loss_id == 1 and result["overflow"].params == ("model1.3.weight",)


def test_o0_script_is_plain_pytorch_bit_for_bit():
    """O0 with forced scales 4 and 16: scaling by powers of two and back changes no bit."""
    with_amp = run("O0", torch.float16, steps=4)
    plain = run("O0", None, steps=4, use_amp=False)
    for key, value in plain["state"].items():
        assert torch.equal(value, with_amp["state"][key]), key
    assert with_amp["losses"] == plain["losses"]


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_apex_script_zeroing_ways_agree(opt_level):
    """optimizer.zero_grad(), model.zero_grad() or grads set to None, as apex's L0 tests loop."""
    runs = [
        run(opt_level, torch.float16, steps=3, zero=way) for way in ("optimizer", "model", "none")
    ]
    for other in runs[1:]:
        for key, value in runs[0]["state"].items():
            assert torch.equal(value, other["state"][key]), key
