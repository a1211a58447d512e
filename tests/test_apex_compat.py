"""amp._amp_state (apex's internal state, as scripts use it) and optimizer wrappers like LARC."""

import copy

import pytest
import torch

import amp
from conftest import DTYPES, OPT_LEVELS
from larc_like import TrustRatio


def make_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


def loss_of(model, step=0):
    generator = torch.Generator().manual_seed(100 + step)
    x, y = torch.randn(16, 4, generator=generator), torch.randn(16, 2, generator=generator)
    return ((model(x).float() - y) ** 2).mean()


@pytest.fixture
def initialized(request):
    """amp.initialize(model, SGD) at the parametrized level; yields (model, optimizer)."""
    level = getattr(request, "param", "O1")
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, optimizer, opt_level=level, verbosity=0)
    try:
        yield model, optimizer
    finally:
        amp.deinitialize()


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
    with pytest.raises(ValueError, match="non-negative int"):
        state.verbosity = "loud"
    assert state.verbosity == 0
    state.verbosity = 1
    model, optimizer = initialized
    with amp.scale_loss(loss_of(model) * float("inf"), optimizer) as scaled:
        scaled.backward()
    with caplog.at_level("INFO", logger="amp"):
        optimizer.step()
    assert "Gradient overflow.  Skipping step" in caplog.text


# -- optimizer wrappers ----------------------------------------------------------------------


class NoStep:
    def __init__(self, optimizer):
        self.optim = optimizer
        self.param_groups = optimizer.param_groups
        self.state = optimizer.state

    def zero_grad(self):
        self.optim.zero_grad()


class Slotted:
    __slots__ = ("optim",)

    def __init__(self, optimizer):
        self.optim = optimizer

    param_groups = property(lambda self: self.optim.param_groups)
    state = property(lambda self: self.optim.state)
    step = property(lambda self: self.optim.step)
    zero_grad = property(lambda self: self.optim.zero_grad)
    state_dict = property(lambda self: self.optim.state_dict)
    load_state_dict = property(lambda self: self.optim.load_state_dict)


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda opt: object(), "has no param_groups, state, step, zero_grad, state_dict"),
        (NoStep, "it has no step, state_dict, load_state_dict"),
        (Slotted, "without an instance __dict__"),
    ],
    ids=["object", "no-step", "slots"],
)
def test_objects_that_are_not_optimizers_are_refused_and_nothing_changes(make, message):
    model = make_model()
    weights = copy.deepcopy(model.state_dict())
    with pytest.raises(TypeError, match=message):
        amp.initialize(model, make(torch.optim.SGD(model.parameters(), lr=0.1)), opt_level="O2")
    assert all(p.dtype is torch.float32 for p in model.parameters())
    assert not model._forward_pre_hooks and not model._forward_hooks
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in weights.items())


def test_scale_loss_refuses_a_wrapper_amp_did_not_see(initialized):
    model, _ = initialized
    stranger = TrustRatio(torch.optim.SGD(make_model().parameters(), lr=0.1))
    with pytest.raises(TypeError, match="TrustRatio was not passed to amp.initialize"):
        with amp.scale_loss(loss_of(model), stranger):
            pass


def _trust_ratio_run(opt_level, dtype, steps=3, inject_at=None):
    model = make_model()
    optimizer = TrustRatio(torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.5))
    model, optimizer = amp.initialize(
        model, optimizer, opt_level=opt_level, dtype=dtype, verbosity=0
    )
    snapshots = []
    try:
        for step in range(steps):
            with amp.scale_loss(loss_of(model, step), optimizer) as scaled:
                scaled.backward()
                if step == inject_at:
                    next(model.parameters()).grad.view(-1)[0] = float("inf")
            snapshots.append(copy.deepcopy((model.state_dict(), optimizer.state_dict())))
            optimizer.step()
            optimizer.zero_grad()
            assert all(p.grad is None for p in amp.master_params(optimizer))
        final = copy.deepcopy((model.state_dict(), optimizer.state_dict()))
        return model, optimizer, snapshots, final
    finally:
        amp.deinitialize()


def _reference_run(steps=3):
    model = make_model()
    optimizer = TrustRatio(torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.5))
    for step in range(steps):
        loss_of(model, step).backward()
        optimizer.step()
        optimizer.zero_grad()
    return model


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("opt_level", OPT_LEVELS)
def test_a_larc_style_wrapper_trains_at_every_level(opt_level, dtype):
    model, optimizer, _, (model_state, optimizer_state) = _trust_ratio_run(opt_level, dtype)
    assert optimizer.steps_taken == 3
    reference = _reference_run()
    plain = make_model()  # the same steps without the trust ratio: far from both
    plain_optimizer = torch.optim.SGD(plain.parameters(), lr=0.5, momentum=0.5)
    for step in range(3):
        loss_of(plain, step).backward()
        plain_optimizer.step()
        plain_optimizer.zero_grad()
    exact = opt_level == "O0"
    for key, ref in reference.state_dict().items():
        got = model_state[key].float()
        if exact:
            assert torch.equal(got, ref), key
        else:
            torch.testing.assert_close(got, ref, rtol=0.05, atol=0.02)
        assert not torch.allclose(got, plain.state_dict()[key], atol=0.02), key
    assert ("amp_master_params" in optimizer_state) is (opt_level == "O2")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_a_wrapper_step_after_overflow_is_skipped_and_changes_nothing(opt_level, dtype):
    _, optimizer, snapshots, final = _trust_ratio_run(opt_level, dtype, steps=2, inject_at=1)
    assert optimizer.steps_taken == 1
    (model_before, optimizer_before), (model_after, optimizer_after) = snapshots[1], final
    for key in model_before:
        assert torch.equal(model_before[key], model_after[key]), key
    for index, state in optimizer_before["state"].items():
        assert torch.equal(
            state["momentum_buffer"], optimizer_after["state"][index]["momentum_buffer"]
        )
    masters_before = optimizer_before.get("amp_master_params", {})
    for index, master in masters_before.items():
        assert torch.equal(master, optimizer_after["amp_master_params"][index])


def test_a_wrapper_at_o2_steps_the_masters_and_round_trips_its_state_dict():
    model = make_model()
    inner = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.5)
    optimizer = TrustRatio(inner)
    amp.initialize(model, optimizer, opt_level="O2", verbosity=0)
    try:
        masters = list(amp.master_params(optimizer))
        assert all(m.dtype is torch.float32 for m in masters)
        assert inner.param_groups[0]["params"][0] is masters[0]  # the wrapped optimizer steps them
        with amp.scale_loss(loss_of(model), optimizer) as scaled:
            scaled.backward()
        optimizer.step()
        for param, master in zip(model.parameters(), masters):
            assert torch.equal(param, master.to(param.dtype))
        saved = copy.deepcopy(optimizer.state_dict())
        with amp.scale_loss(loss_of(model, 1), optimizer) as scaled:
            scaled.backward()
        optimizer.step()
        optimizer.load_state_dict(saved)
        for master, value in zip(masters, saved["amp_master_params"].values()):
            assert torch.equal(master, value)
    finally:
        amp.deinitialize()
    assert "step" not in vars(optimizer) and "_amp_record" not in vars(optimizer)
    assert [p for p in inner.param_groups[0]["params"]] == list(model.parameters())
    assert all(p.dtype is torch.float32 for p in model.parameters())


def test_a_wrapper_without_add_param_group_is_accepted():
    model = make_model()
    optimizer = NoStep(torch.optim.SGD(model.parameters(), lr=0.1))
    optimizer.step = optimizer.optim.step
    optimizer.state_dict = optimizer.optim.state_dict
    optimizer.load_state_dict = optimizer.optim.load_state_dict
    amp.initialize(model, optimizer, opt_level="O2", verbosity=0)
    try:
        with amp.scale_loss(loss_of(model), optimizer) as scaled:
            scaled.backward()
        optimizer.step()
        assert not hasattr(optimizer, "add_param_group")
    finally:
        amp.deinitialize()


def test_a_scheduler_on_the_wrapped_optimizer_does_not_warn_when_the_first_step_is_skipped(
    recwarn,
):
    model = make_model()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    optimizer = TrustRatio(inner)
    amp.initialize(model, optimizer, opt_level="O1", verbosity=0)
    scheduler = torch.optim.lr_scheduler.StepLR(inner, step_size=1)  # as with apex's LARC
    try:
        with amp.scale_loss(loss_of(model) * float("inf"), optimizer) as scaled:
            scaled.backward()
        optimizer.step()  # skipped
        scheduler.step()
        assert optimizer.steps_taken == 0
        assert not [w for w in recwarn if "lr_scheduler.step()" in str(w.message)]
    finally:
        amp.deinitialize()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_grad_scaler_steps_a_wrapper_and_skips_it_on_overflow(dtype):
    model = make_model()
    optimizer = TrustRatio(torch.optim.SGD(model.parameters(), lr=0.5))
    scaler = amp.GradScaler(init_scale=4.0)
    for step in range(2):
        with amp.autocast(dtype=dtype):
            loss = loss_of(model, step)
        scaler.scale(loss).backward()
        if step == 1:
            next(model.parameters()).grad.view(-1)[0] = float("inf")
        before = copy.deepcopy(model.state_dict())
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
    assert optimizer.steps_taken == 1 and scaler.get_scale() == 2.0
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
