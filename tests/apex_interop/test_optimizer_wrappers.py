"""Optimizer wrappers like apex's LARC (amp/apex_interop/optimizer_wrappers.py): accepted by
amp.initialize, stepped or skipped with the masters at every level, refused when they are no
optimizer at all; tests/helpers/larc_like.py is the wrapper."""

import copy

import pytest
import torch

import amp
from helpers import DTYPES, OPT_LEVELS
from helpers.larc_like import TrustRatio
from helpers.models import loss_of, make_model
from helpers.state import saved_masters


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
    assert bool(saved_masters(optimizer_state)) is (opt_level == "O2")


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
    masters_after = saved_masters(optimizer_after)
    for index, master in saved_masters(optimizer_before).items():
        assert torch.equal(master, masters_after[index])


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
        for master, value in zip(masters, saved_masters(saved).values(), strict=True):
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
