"""The loss scaler (amp/scaling/scaler.py): apex's dynamic rule, bounds, static scaling, its state,
and amp.load_state_dict's checks of loss-scaler checkpoints (validate everything, then write)."""

import pytest
import torch

import amp
from helpers.state import scaled_step
from amp.scaling.scaler import LossScaler
from amp.scaling.values import check_state
from helpers.models import loss_of
from helpers.o2 import static_o2
from helpers.state import assert_same, everything, step_cleanly


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


def _linear_at_o1(**kwargs):
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return amp.initialize(model, optimizer, opt_level="O1", verbosity=0, **kwargs)


# -- amp.load_state_dict: loss-scaler checkpoints are checked whole before anything is written ----


@pytest.mark.parametrize("first_step", [False, True])
def test_a_scale_that_underflows_float32_is_refused_and_changes_nothing(trained, first_step):
    model, optimizer = trained("O1")
    if first_step:
        step_cleanly(model, optimizer)
    before = everything(model, optimizer)
    with pytest.raises(ValueError, match="does not fit a float32 loss scale"):
        amp.load_state_dict({"loss_scaler0": {"loss_scale": 1e-46, "unskipped": 0}})
    assert_same(before, everything(model, optimizer))
    step_cleanly(model, optimizer, 1)
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("first_step", [False, True])
@pytest.mark.parametrize(
    "bad", [{"loss_scale": 8.0, "unskipped": 2**31}, {"loss_scale": 1e39, "unskipped": 0}]
)
def test_a_load_is_all_or_nothing(trained, first_step, bad):
    model, optimizer = trained("O1", num_losses=2)
    if first_step:
        step_cleanly(model, optimizer)
    before = everything(model, optimizer)
    with pytest.raises(ValueError, match="does not fit"):
        amp.load_state_dict(
            {"loss_scaler0": {"loss_scale": 4.0, "unskipped": 3}, "loss_scaler1": bad}
        )
    assert_same(before, everything(model, optimizer))
    step_cleanly(model, optimizer, 1)  # and scale_loss still works


def test_two_keys_for_one_scaler_are_refused():
    static_o2()
    before = amp.state_dict()
    with pytest.raises(RuntimeError, match="'loss_scaler0' and 'loss_scaler00' both name"):
        amp.load_state_dict(
            {
                "loss_scaler0": {"loss_scale": 128.0, "unskipped": 0},
                "loss_scaler00": {"loss_scale": 128.0, "unskipped": 3},
            }
        )
    assert amp.state_dict() == before
    amp.deinitialize()


@pytest.mark.parametrize(
    "scale", [10**400, -(10**400), 10**5000], ids=["1e400", "-1e400", "1e5000"]
)
def test_an_int_loss_scale_too_large_for_a_float_gets_amps_error(scale):
    model, optimizer = amp.initialize(
        torch.nn.Linear(2, 2),
        torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1),
        opt_level="O1",
        verbosity=0,
    )
    before = amp.state_dict()
    with pytest.raises(ValueError, match="int of .* bits"):
        amp.load_state_dict({"loss_scaler0": {"loss_scale": scale, "unskipped": 0}})
    with pytest.raises(ValueError, match="int of .* bits"):
        amp._amp_state.loss_scalers[0]._loss_scale = scale
    assert amp.state_dict() == before
    amp.deinitialize()


def test_a_multi_element_tensor_as_loss_scale_is_refused(trained):
    model, optimizer = trained("O1")
    before = everything(model, optimizer)
    with pytest.raises(ValueError, match=r"tensor of shape \(2,\); expected a number"):
        amp.load_state_dict(
            {"loss_scaler0": {"loss_scale": torch.tensor([2.0, 4.0]), "unskipped": 0}}
        )
    assert_same(before, everything(model, optimizer))


def test_a_numpy_scalar_loads_as_a_loss_scale():
    import numpy as np

    model = torch.nn.Linear(4, 2)
    amp.initialize(model, opt_level="O1", verbosity=0)
    try:
        amp.load_state_dict({"loss_scaler0": {"loss_scale": np.float32(1024), "unskipped": 0}})
        assert amp.state_dict()["loss_scaler0"]["loss_scale"] == 1024.0
    finally:
        amp.deinitialize()


def test_a_static_checkpoint_starts_a_dynamic_scaler_at_its_scale(caplog):
    source, optimizer = static_o2()  # loss_scale=128.0: static
    scaled_step(source, optimizer)
    saved = amp.state_dict()
    assert saved["loss_scaler0"]["dynamic"] is False
    amp.deinitialize()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    model, optimizer = amp.initialize(
        model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O2", loss_scale="dynamic"
    )
    with caplog.at_level("INFO", logger="amp"):
        amp.load_state_dict(saved)
    assert "comes from a static loss scale" in caplog.text
    assert amp.state_dict()["loss_scaler0"] == {
        "loss_scale": 128.0,
        "unskipped": 0,
        "dynamic": True,
    }
    scaled_step(model, optimizer, overflow=True)  # an overflow: dynamic backs off
    assert amp.state_dict()["loss_scaler0"]["loss_scale"] == 64.0
    scaled_step(model, optimizer)
    assert amp.state_dict()["loss_scaler0"]["unskipped"] == 1
    amp.deinitialize()


def test_a_static_checkpoint_outside_the_dynamic_bounds_is_refused():
    _linear_at_o1(max_loss_scale=1024.0)
    before = amp.state_dict()
    with pytest.raises(ValueError, match="outside min_loss_scale=None and max_loss_scale=1024.0"):
        amp.load_state_dict(
            {"loss_scaler0": {"loss_scale": 4096.0, "unskipped": 0, "dynamic": False}}
        )
    assert amp.state_dict() == before
    amp.deinitialize()


def test_a_dynamic_checkpoint_into_a_static_scale_set_at_o1_is_refused():
    _linear_at_o1(loss_scale=128.0)
    entry = {"loss_scale": 128.0, "unskipped": 0, "dynamic": True}
    with pytest.raises(ValueError, match="from a dynamic loss scaler, but this run's is static"):
        amp.load_state_dict({"loss_scaler0": entry})
    amp.deinitialize()


@pytest.mark.parametrize("kind", [False, None])
def test_a_refused_static_scale_says_where_the_checkpoint_comes_from(kind):
    _linear_at_o1(loss_scale=128.0)
    entry = {"loss_scale": 64.0, "unskipped": 0}
    if kind is not None:
        entry["dynamic"] = kind  # amp's static checkpoint; without the key, apex's (kind unknown)
    with pytest.raises(ValueError, match="static loss scale 128.0") as refused:
        amp.load_state_dict({"loss_scaler0": entry})
    amp.deinitialize()
    message = str(refused.value)
    assert "dynamic run" not in message
    if kind is False:
        assert "comes from a static run with another scale" in message
    else:
        assert "does not say whether its scaler was static or dynamic" in message


def test_a_dynamic_checkpoint_into_o3s_static_scaler_is_refused_and_changes_nothing(trained):
    source, source_optimizer = trained("O1")
    saved = amp.state_dict()
    amp.deinitialize()
    model, optimizer = trained("O3")
    before = everything(model, optimizer)
    with pytest.raises(ValueError, match="from a dynamic loss scaler.*loss_scale='dynamic'"):
        amp.load_state_dict(saved)
    unmarked = {"loss_scaler0": {k: v for k, v in saved["loss_scaler0"].items() if k != "dynamic"}}
    with pytest.raises(ValueError, match="static loss scale 1.0.*loss_scale='dynamic'"):
        amp.load_state_dict(unmarked)  # an apex checkpoint has no kind: the scale still tells
    assert_same(before, everything(model, optimizer))
    amp.load_state_dict({"loss_scaler0": {"loss_scale": 1.0, "unskipped": 0}})  # its own: fine
    step_cleanly(model, optimizer)
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_an_apex_static_count_into_a_dynamic_run_starts_counting_from_zero():
    _linear_at_o1()
    amp.load_state_dict({"loss_scaler0": {"loss_scale": 128.0, "unskipped": 50000}})  # apex O3
    expected = {"loss_scale": 128.0, "unskipped": 0, "dynamic": True}
    assert amp.state_dict()["loss_scaler0"] == expected
    with pytest.raises(ValueError, match="growth interval"):  # amp's own dynamic dict: damaged
        amp.load_state_dict(
            {"loss_scaler0": {"loss_scale": 128.0, "unskipped": 5000, "dynamic": True}}
        )
    amp.deinitialize()


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
