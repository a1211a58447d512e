"""What a loss scale and a count may be (amp/scaling/values.py): each check returns the value as it
will be held or raises a clear error naming what it checked; nothing else."""

import numpy as np
import pytest
import torch

from amp.scaling.scaler import LossScaler
from amp.scaling.values import (
    FLOAT32_MAX,
    SCALE_FLOOR,
    check_count,
    check_loss_scale,
    check_state,
    float32,
)


def test_float32_rounds_to_nearest_even_as_a_python_float():
    assert float32(1 / 3) == torch.tensor(1 / 3, dtype=torch.float32).item() != 1 / 3
    assert float32(2.0**-10) == 2.0**-10 and type(float32(3)) is float


@pytest.mark.parametrize(
    "value, expected",
    [(128, 128.0), (0.5, 0.5), (torch.tensor(4.0), 4.0), (np.float32(8.0), 8.0)],
    ids=["int", "float", "tensor", "numpy"],
)
def test_a_loss_scale_is_taken_as_a_float(value, expected):
    held = check_loss_scale(value, "the scale")
    assert held == expected and type(held) is float


@pytest.mark.parametrize(
    "value, match",
    [
        (0.0, "finite positive"),
        (-2.0, "finite positive"),
        (float("inf"), "finite positive"),
        (True, "finite positive"),
        ("1", "finite positive"),
        (SCALE_FLOOR / 2, "does not fit"),
        (FLOAT32_MAX * 2, "finite positive"),
        (10**400, "bits"),
        (torch.ones(2), "tensor of shape"),
    ],
    ids=["zero", "negative", "inf", "bool", "str", "below-floor", "above-max", "huge-int", "tensor"],
)
def test_a_loss_scale_that_float32_cannot_hold_is_refused_by_name(value, match):
    with pytest.raises(ValueError, match=match) as raised:
        check_loss_scale(value, "the scale")
    assert str(raised.value).startswith("the scale")


def test_a_count_must_be_a_non_negative_int_below_the_growth_interval():
    assert check_count(5, "count") == 5 and check_count(torch.tensor(3), "count") == 3
    for bad in (-1, 1.5, True, 2**31):
        with pytest.raises(ValueError, match="count"):
            check_count(bad, "count")
    scaler = LossScaler("dynamic", growth_interval=10)
    assert check_count(9, "count", scaler) == 9
    with pytest.raises(ValueError, match="growth interval"):
        check_count(10, "count", scaler)


def test_a_state_entry_is_checked_whole():
    assert check_state("k", {"loss_scale": torch.tensor(4.0), "unskipped": torch.tensor(2)}) == {
        "loss_scale": 4.0,
        "unskipped": 2,
        "from_static": False,
    }
    for bad in (
        {"loss_scale": 0.0, "unskipped": 0},
        {"loss_scale": 1.0, "unskipped": 1.5},
        {"loss_scale": "1", "unskipped": 0},
        {"unskipped": 0},
        {"loss_scale": 1.0, "unskipped": 0, "dynamic": "yes"},
        [1.0, 0],
    ):
        with pytest.raises((ValueError, TypeError), match="loss_scaler0"):
            check_state("loss_scaler0", bad)


def test_a_static_entry_starts_a_dynamic_scaler_from_its_scale_counting_from_zero():
    scaler = LossScaler("dynamic", growth_interval=100)
    entry = check_state("k", {"loss_scale": 1 / 3, "unskipped": 500, "dynamic": False}, scaler)
    assert entry == {"loss_scale": float32(1 / 3), "unskipped": 0, "from_static": True}
    static = LossScaler(128.0)
    with pytest.raises(ValueError, match="comes from a dynamic loss scaler"):
        check_state("k", {"loss_scale": 128.0, "unskipped": 0, "dynamic": True}, static)
    with pytest.raises(ValueError, match="never replaces"):
        check_state("k", {"loss_scale": 64.0, "unskipped": 0, "dynamic": False}, static)
