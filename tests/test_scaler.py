"""LossScaler: apex's dynamic rule, bounds, static scaling, state."""

import pytest
import torch

from amp.scaling.scaler import LossScaler, OverflowFlag, check_state


def apex_trajectory(overflows, init=2.0**16, window=2000, min_scale=None, max_scale=2.0**24):
    """apex.amp's update_scale, step by step (the reference for the device-side rule)."""
    scale = min(max_scale, init) if max_scale is not None else init
    if min_scale is not None:
        scale = max(min_scale, scale)
    unskipped, trajectory = 0, []
    for overflow in overflows:
        if overflow:
            scale = max(min_scale, scale / 2.0) if min_scale else scale / 2.0
            unskipped = 0
        else:
            unskipped += 1
            if unskipped == window:
                scale = min(max_scale, scale * 2.0) if max_scale is not None else scale * 2.0
                unskipped = 0
        trajectory.append((scale, unskipped))
    return trajectory


def run(scaler, overflows):
    trajectory = []
    for overflow in overflows:
        flag = OverflowFlag("cpu")
        flag.tensor.fill_(float(overflow))
        scaler.update(flag)
        trajectory.append((scaler.loss_scale(), scaler.unskipped()))
    return trajectory


@pytest.mark.parametrize(
    "overflows,kwargs",
    [
        ([0] * 7, dict(growth_interval=3)),
        ([1, 1, 0, 0, 0, 1, 0, 0, 0, 0], dict(growth_interval=3)),
        ([1] * 40, dict(min_loss_scale=8.0, growth_interval=3)),
        ([0] * 30, dict(max_loss_scale=2.0**18, growth_interval=2)),
        ([1, 0, 1, 0, 0, 0, 0, 1, 0], dict(init_scale=4.0, growth_interval=2)),
    ],
)
def test_dynamic_trajectory_is_apexs(overflows, kwargs):
    init = kwargs.pop("init_scale", 2.0**16)
    window = kwargs.pop("growth_interval")
    scaler = LossScaler("dynamic", init_scale=init, growth_interval=window, **kwargs)
    expected = apex_trajectory(
        overflows,
        init=init,
        window=window,
        min_scale=kwargs.get("min_loss_scale"),
        max_scale=kwargs.get("max_loss_scale", 2.0**24),
    )
    assert run(scaler, overflows) == expected


def test_defaults_are_apexs():
    scaler = LossScaler("dynamic")
    assert scaler.loss_scale() == 65536.0 and scaler.growth_interval == 2000
    assert LossScaler("dynamic", max_loss_scale=1024.0).loss_scale() == 1024.0
    assert LossScaler("dynamic", min_loss_scale=2.0**20).loss_scale() == 2.0**20


def test_two_thousand_clean_steps_double_the_scale():
    scaler = LossScaler("dynamic")
    trajectory = run(scaler, [0] * 2000)
    assert trajectory[1998] == (65536.0, 1999) and trajectory[1999] == (131072.0, 0)


def test_floor_and_ceiling_hold_for_long_runs():
    scaler = LossScaler("dynamic", min_loss_scale=1.0, max_loss_scale=4.0, growth_interval=1)
    assert max(scale for scale, _ in run(scaler, [0] * 50)) == 4.0
    assert min(scale for scale, _ in run(scaler, [1] * 50)) == 1.0


def test_static_scaler_never_changes():
    scaler = LossScaler(128.0)
    assert run(scaler, [1, 0, 1]) == [(128.0, 0)] * 3
    assert not scaler.dynamic and not scaler.is_identity and LossScaler(1.0).is_identity
    loss = torch.tensor(2.0, dtype=torch.float16)
    scaled = scaler.scale(loss)
    assert scaled.dtype is torch.float32 and scaled.item() == 256.0


def test_scale_and_inverse_live_on_the_loss_device():
    scaler = LossScaler("dynamic")
    assert scaler._scale is None  # made on the device of the first loss
    scaled = scaler.scale(torch.tensor(3.0, dtype=torch.bfloat16, requires_grad=True))
    assert scaled.dtype is torch.float32 and scaled.item() == 3.0 * 65536
    assert scaler._scale.device == torch.device("cpu")
    assert scaler.inv_scale("cpu").item() == 2.0**-16


def test_state_round_trip_and_validation():
    scaler = LossScaler("dynamic", growth_interval=3)
    run(scaler, [0, 0, 0, 0, 1, 0])
    other = LossScaler("dynamic")
    other.load_state_dict(check_state("loss_scaler0", scaler.state_dict()))
    assert other.state_dict() == scaler.state_dict()
    assert scaler.state_dict() == {"loss_scale": 65536.0, "unskipped": 1, "dynamic": True}
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
        [1.0, 0],
    ):
        with pytest.raises((ValueError, TypeError)):
            check_state("loss_scaler0", bad)


def test_flag_is_read_once():
    flag = OverflowFlag("cpu")
    assert flag.is_set() is False
    flag.tensor.fill_(1.0)
    assert flag.is_set() is False  # the decision was taken; the flag is not read again


def test_inverse_scale_follows_updates_and_loads():
    scaler = LossScaler("dynamic", growth_interval=2, min_loss_scale=0.25, max_loss_scale=2.0**17)
    for overflow in [0, 0, 0, 0] + [1] * 25:
        ((scale, _),) = run(scaler, [overflow])
        assert scaler.inv_scale("cpu").item() == 1.0 / scale
    scaler.load_state_dict({"loss_scale": 1000.0, "unskipped": 0})
    assert scaler.inv_scale("cpu").item() == torch.tensor(1.0 / 1000.0, dtype=torch.float32).item()
    static = LossScaler(128.0)
    assert (
        static.inv_scale("cpu") is static.inv_scale("cpu")
        and static.inv_scale("cpu").item() == 1 / 128
    )
