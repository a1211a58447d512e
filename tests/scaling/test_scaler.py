"""The loss scaler (amp/scaling/scaler.py): apex's dynamic rule, bounds, static scaling, its state,
a block's check on the device and what the host learns from its copy."""

import pytest
import torch

import amp
from amp.scaling.scaler import LossScaler
from amp.scaling.values import check_state
from helpers.models import loss_of
from helpers.state import step_cleanly


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


def update(scaler, overflow=False, bad_loss=False):
    """One update as a block's exit makes it: the gradients' flag set by the unscale, then the
    update on the device with the block's loss."""
    check = scaler.open_check(0, torch.device("cpu"))
    check.found.fill_(float(overflow or bad_loss))
    scaler.update(check, torch.tensor(float("inf") if bad_loss else 1.0))
    return check


def run(scaler, overflows):
    trajectory = []
    for overflow in overflows:
        if scaler.dynamic:  # a static scaler is never updated
            update(scaler, overflow)
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
    scaled = scaler.scale(torch.tensor(3.0, dtype=torch.bfloat16, requires_grad=True))
    assert scaled.dtype is torch.float32 and scaled.item() == 3.0 * 65536
    assert scaled.device == torch.device("cpu")  # made on the device of the loss
    assert scaler.inv_scale("cpu").device == torch.device("cpu")
    assert scaler.inv_scale("cpu").item() == 2.0**-16


def test_state_round_trip():
    scaler = LossScaler("dynamic", growth_interval=3)
    run(scaler, [0, 0, 0, 0, 1, 0])
    other = LossScaler("dynamic")
    other.load_state_dict(check_state("loss_scaler0", scaler.state_dict()))
    assert other.state_dict() == scaler.state_dict()
    assert scaler.state_dict() == {"loss_scale": 65536.0, "unskipped": 1, "dynamic": True}


def test_the_host_learns_a_block_from_its_copy_without_reading_the_device(monkeypatch):
    scaler = LossScaler("dynamic", growth_interval=2)
    check = update(scaler, overflow=True)
    monkeypatch.setattr(torch.Tensor, "item", lambda self: pytest.fail("a device read"))
    assert check.is_set() is True
    check.found.fill_(0.0)  # a write to the device state after the copy
    assert check.is_set() is True  # the host keeps what arrived
    assert scaler.loss_scale() == 32768.0 and scaler.unskipped() == 0
    assert check.scale_after == 32768.0  # learned from the inverse scale the device left


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


@pytest.mark.parametrize(
    "start, kwargs",
    [(3.0, {}), (2.0**16, {"max_loss_scale": 3.0 * 2.0**17}), (1000.0, {"min_loss_scale": 999.0})],
    ids=["odd-start", "odd-ceiling", "odd-floor"],
)
def test_the_host_learns_the_scale_the_device_left_exactly(start, kwargs):
    """The host reads the inverse scale the device computed and writes the scale as the rule
    would (an anchor times a power of two), even where the inverse of the scale is not exact in
    float32 and where a clamp took it to a bound."""
    scaler = LossScaler("dynamic", init_scale=start, growth_interval=1, **kwargs)
    scale, floor = start, max(kwargs.get("min_loss_scale", 0.0), 2.0**-126)
    ceiling = kwargs.get("max_loss_scale", 2.0**24)
    for overflow in [0, 0, 0, 1, 1, 1, 1, 0, 1, 0, 0, 0]:
        scale = max(scale * 0.5, floor) if overflow else min(scale * 2.0, ceiling)
        check = update(scaler, overflow=bool(overflow))
        assert check.scale_after == scale == scaler.loss_scale()


# -- the scale in a run ------------------------------------------------------------------------------


def test_the_dynamic_scale_never_reaches_zero(trained):
    model, optimizer = trained("O1")
    amp.load_state_dict({"loss_scaler0": {"loss_scale": 2.0**-124, "unskipped": 0}})
    for step in range(4):  # overflows halve the scale down to the floor, not to 0
        with amp.scale_loss(loss_of(model, step), optimizer) as scaled:
            scaled.backward()
            model[0].weight.grad.view(-1)[0] = float("inf")
        optimizer.step()
        optimizer.zero_grad()
    assert amp.state_dict()["loss_scaler0"]["loss_scale"] == 2.0**-126
    step_cleanly(model, optimizer, 5)
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("delay", [False, True])
def test_the_loss_scale_cannot_change_under_pending_scaled_gradients(delay):
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O1", verbosity=0)
    try:
        x = torch.randn(3, 4)
        saved = amp.state_dict()
        with amp.scale_loss(model(x).float().mean(), optimizer, delay_unscale=delay) as scaled:
            scaled.backward()
            if not delay:
                with pytest.raises(RuntimeError, match="cannot change while gradients"):
                    amp._amp_state.loss_scalers[0]._loss_scale = 128.0
        if delay:  # between the blocks of an accumulation
            with pytest.raises(RuntimeError, match="cannot change while gradients"):
                amp._amp_state.loss_scalers[0]._loss_scale = 128.0
            with pytest.raises(RuntimeError, match="cannot change while gradients"):
                amp.load_state_dict({"loss_scaler0": {"loss_scale": 128.0, "unskipped": 0}})
            with amp.scale_loss(model(x).float().mean(), optimizer) as scaled:
                scaled.backward()
        assert amp.state_dict()["loss_scaler0"]["loss_scale"] == saved["loss_scaler0"]["loss_scale"]
        optimizer.step()
        amp._amp_state.loss_scalers[0]._loss_scale = 128.0  # between steps: fine
        assert amp.state_dict()["loss_scaler0"]["loss_scale"] == 128.0
    finally:
        amp.deinitialize()
