"""amp._amp_state (amp/apex_interop/apex_state.py): apex's internal state as scripts read and write
it, `loss_scalers[0]._loss_scale`, `._unskipped`, `opt_properties`, and the writes it refuses."""

import pytest
import torch

import amp
from helpers.state import scaled_step
from helpers import OPT_LEVELS
from helpers.models import loss_of, make_model


# -- reads ------------------------------------------------------------------------------------


def test_reads_before_initialize_are_apexs_defaults():
    state = amp._amp_state
    assert state.loss_scalers == ()
    assert state.opt_properties.enabled is False
    assert state.opt_properties.opt_level is None
    assert state.opt_properties.loss_scale == 1.0
    assert "_amp_state" not in amp.__all__


@pytest.mark.parametrize("opt_level", OPT_LEVELS)
def test_reads_follow_initialize(opt_level):
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(
        model,
        optimizer,
        opt_level=opt_level,
        num_losses=3,
        verbosity=2,
        dtype=torch.bfloat16,
        max_loss_scale=2.0**20,
    )
    try:
        state = amp._amp_state
        dynamic = opt_level in ("O1", "O2")
        assert len(state.loss_scalers) == 3
        for scaler in state.loss_scalers:
            assert scaler.dynamic is dynamic
            assert scaler.loss_scale() == scaler._loss_scale == (2.0**16 if dynamic else 1.0)
            assert scaler._unskipped == 0
        properties = state.opt_properties
        assert properties.enabled is True
        assert properties.opt_level == opt_level
        assert properties.loss_scale == ("dynamic" if dynamic else 1.0)
        assert (
            properties.master_weights
            == {"O0": False, "O1": None, "O2": True, "O3": False}[opt_level]
        )
        assert properties.dtype is torch.bfloat16
        assert properties.options["opt_level"] == opt_level
        assert state.verbosity == 2
        assert state.max_loss_scale == 2.0**20 and state.min_loss_scale is None
    finally:
        amp.deinitialize()
    assert amp._amp_state.loss_scalers == ()


# -- writes of _loss_scale -------------------------------------------------------------------


@pytest.mark.parametrize("initialized", OPT_LEVELS, indirect=True)
def test_a_written_scale_is_the_one_the_next_step_uses(initialized):
    """As apex's L0 tests do at every level: force the scale, then train with it."""
    model, optimizer = initialized
    reference = make_model()
    scaler = amp._amp_state.loss_scalers[0]
    scaler._loss_scale = 4.0
    assert scaler._loss_scale == scaler.loss_scale() == 4.0
    assert amp.state_dict()["loss_scaler0"]["loss_scale"] == 4.0
    loss = loss_of(model)
    with amp.scale_loss(loss, optimizer) as scaled:
        assert scaled.item() == loss.float().item() * 4.0
        scaled.backward()
    loss_of(reference).backward()
    for param, ref in zip(amp.master_params(optimizer), reference.parameters()):
        # Unscaled by the written scale: the gradient the plain model gets (low precision aside).
        torch.testing.assert_close(param.grad.float(), ref.grad, rtol=2e-2, atol=2e-3)
    optimizer.step()
    assert amp._amp_state.loss_scalers[0].loss_scale() == 4.0


@pytest.mark.parametrize(
    "value",
    [float("inf"), float("nan"), 0.0, -4.0, 1e39, 1e-39, True, "1024", None, torch.ones(2)],
    ids=repr,
)
@pytest.mark.parametrize("initialized", ["O1", "O3"], indirect=True)
def test_invalid_scale_writes_are_refused_and_change_nothing(initialized, value):
    model, optimizer = initialized
    scaler = amp._amp_state.loss_scalers[0]
    scaler._loss_scale = 8.0
    before = amp.state_dict()
    with pytest.raises(ValueError, match=r"_loss_scale must be a finite positive number"):
        scaler._loss_scale = value
    assert amp.state_dict() == before
    loss = loss_of(model)
    with amp.scale_loss(loss, optimizer) as scaled:
        assert scaled.item() == loss.float().item() * 8.0
        scaled.backward()


def test_a_written_dynamic_scale_keeps_backing_off_and_growing(initialized):
    model, optimizer = initialized
    scaler = amp._amp_state.loss_scalers[0]
    scaler._loss_scale = 2.0**24
    with amp.scale_loss(loss_of(model) * 1e30, optimizer) as scaled:
        scaled.backward()  # overflows at this scale
    optimizer.step()
    assert scaler.loss_scale() == 2.0**23 and scaler._unskipped == 0
    with pytest.raises(ValueError, match="within min_loss_scale=None and max_loss_scale=16777216"):
        scaler._loss_scale = 2.0**25  # above the dynamic scaler's bound
    assert scaler.loss_scale() == 2.0**23


# -- _unskipped ------------------------------------------------------------------------------


@pytest.mark.parametrize("opt_level", OPT_LEVELS)
def test_apexs_scheduler_gate_steps_at_every_level(opt_level):
    """`if loss_scalers[0]._unskipped != 0: scheduler.step()` (transformers' apex examples)."""
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = amp.initialize(model, optimizer, opt_level=opt_level, verbosity=0)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    try:
        for step in range(3):
            with amp.scale_loss(loss_of(model, step), optimizer) as scaled:
                scaled.backward()
            optimizer.step()
            if amp._amp_state.loss_scalers[0]._unskipped != 0:
                scheduler.step()
            optimizer.zero_grad()
        assert scheduler.last_epoch == 3
        assert amp._amp_state.loss_scalers[0]._unskipped == 3
        # amp's own state dict keeps 0 for static scalers (CHANGELOG), apex's view counts.
        assert amp.state_dict()["loss_scaler0"]["unskipped"] == (
            3 if opt_level in ("O1", "O2") else 0
        )
    finally:
        amp.deinitialize()


def test_unskipped_resets_on_overflow_and_a_write_moves_the_growth(initialized):
    model, optimizer = initialized
    scaler = amp._amp_state.loss_scalers[0]
    with amp.scale_loss(loss_of(model), optimizer) as scaled:
        scaled.backward()
        model[0].weight.grad.view(-1)[0] = float("inf")
    optimizer.step()
    assert scaler._unskipped == 0 and scaler.loss_scale() == 2.0**15
    scaler._unskipped = 1999  # one clean step from the growth interval (2000)
    assert scaler._unskipped == 1999
    with amp.scale_loss(loss_of(model), optimizer) as scaled:
        scaled.backward()
    optimizer.step()
    assert scaler.loss_scale() == 2.0**16 and scaler._unskipped == 0
    with pytest.raises(ValueError, match="non-negative int"):
        scaler._unskipped = -1
    assert scaler._unskipped == 0


@pytest.mark.parametrize("after_first_step", [False, True])
@pytest.mark.parametrize("value", [2**31, 2000, -1, 1.5])
def test_an_unskipped_write_out_of_range_is_refused_and_changes_nothing(value, after_first_step):
    model = torch.nn.Linear(4, 2)
    model, optimizer = amp.initialize(
        model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O1", verbosity=0
    )
    if after_first_step:
        scaled_step(model, optimizer)
    before = amp.state_dict()
    with pytest.raises(ValueError, match="_unskipped"):
        amp._amp_state.loss_scalers[0]._unskipped = value
    assert amp.state_dict() == before
    scaled_step(model, optimizer)  # scale_loss still works, and the state round-trips
    amp.load_state_dict(amp.state_dict())
    amp._amp_state.loss_scalers[0]._loss_scale = 8.0
    amp._amp_state.loss_scalers[0]._unskipped = 1999  # the largest count: it grows next step
    scaled_step(model, optimizer)
    assert amp.state_dict()["loss_scaler0"] == {"loss_scale": 16.0, "unskipped": 0, "dynamic": True}
    amp.deinitialize()


@pytest.mark.parametrize("scale", [1e39, 1e-39])
def test_load_state_dict_refuses_a_scale_float32_cannot_hold(initialized, scale):
    before = amp.state_dict()
    with pytest.raises(ValueError, match="float32"):
        amp.load_state_dict({"loss_scaler0": {"loss_scale": scale, "unskipped": 0}})
    assert amp.state_dict() == before


def test_a_static_count_loaded_from_apex_continues(initialized):
    amp.load_state_dict({"loss_scaler0": {"loss_scale": 128.0, "unskipped": 500}})
    assert amp._amp_state.loss_scalers[0]._unskipped == 500


# -- what cannot be written ------------------------------------------------------------------


def test_other_writes_raise_and_verbosity_is_writable(initialized, caplog):
    state = amp._amp_state
    with pytest.raises(AttributeError, match="opt_properties.loss_scale cannot be set"):
        state.opt_properties.loss_scale = 128.0
    with pytest.raises(AttributeError, match="dynamic cannot be set"):
        state.loss_scalers[0].dynamic = False
    with pytest.raises(AttributeError, match="cannot be set"):
        state.loss_scalers = []
    with pytest.raises(AttributeError, match="amp.deinitialize"):
        state.handle  # noqa: B018
    with pytest.raises(AttributeError, match="no 'fused'"):
        state.opt_properties.fused  # noqa: B018
    assert state.hard_override is False
    with pytest.raises(RuntimeError, match="not supported"):
        state.allow_incoming_model_not_fp32 = True
    state.hard_override = False  # what a script sets to stay safe is accepted
    for wrong in ("loud", 7, -1):
        with pytest.raises(ValueError, match="verbosity must be 0, 1 or 2"):
            state.verbosity = wrong
    assert state.verbosity == 0
    state.verbosity = 1
    model, optimizer = initialized
    with amp.scale_loss(loss_of(model) * float("inf"), optimizer) as scaled:
        scaled.backward()
    with caplog.at_level("INFO", logger="amp"):
        optimizer.step()
    assert "Gradient overflow.  Skipping step" in caplog.text
