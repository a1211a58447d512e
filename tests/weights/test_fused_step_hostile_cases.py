"""Hostile cases for O2's fused master step: what the optimizer's own step would do on the FP32
masters, whatever the user reaches the masters through."""

import pytest
import torch

import amp
from helpers.floats import ulps
from helpers.models import loss_of, make_model
from helpers.o2 import general_path


def _train(general, clip_through, steps=4, cls=torch.optim.AdamW, options=None):
    options = options or dict(lr=0.01, fused=True)  # bit for bit with the kernel (one thread)
    model = make_model(inputs=16, hidden=32, outputs=16)
    optimizer = cls(model.parameters(), **options)
    with general_path(general):
        model, optimizer = amp.initialize(
            model, optimizer, opt_level="O2", dtype=torch.bfloat16, verbosity=0
        )
    norms = []
    for step in range(steps):
        optimizer.zero_grad()
        with amp.scale_loss(loss_of(model, step, inputs=16, outputs=16), optimizer) as scaled:
            scaled.backward()
        params = clip_through(optimizer)
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, 1e-3)))
        optimizer.step()
    masters = [p.detach().clone() for p in amp.master_params(optimizer)]
    return masters, norms


def _through_param_groups(optimizer):
    return [p for group in optimizer.param_groups for p in group["params"]]


@pytest.mark.usefixtures("deinitialized")
@pytest.mark.parametrize("through", ["param_groups", "model"])
def test_clipping_the_optimizers_own_params_clips_what_the_fused_step_steps(through):
    """The optimizer's parameters at O2 are the model's bf16 ones, whose `.grad` hold the unscaled
    gradients the step uses: clipping them through `optimizer.param_groups` or the model, as plain
    PyTorch scripts do, clips the step (AdamW's first moment after a first step is a tenth of the
    gradient it stepped)."""
    model = make_model(inputs=16, hidden=32, outputs=16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    model, optimizer = amp.initialize(
        model, optimizer, opt_level="O2", dtype=torch.bfloat16, verbosity=0
    )
    with amp.scale_loss(loss_of(model, 0, inputs=16, outputs=16), optimizer) as scaled:
        scaled.backward()
    params = _through_param_groups(optimizer) if through == "param_groups" else model.parameters()
    params = list(params)
    norm = torch.nn.utils.clip_grad_norm_(params, 1e-3)
    assert norm > 1e-2  # the unscaled gradients were there to clip
    clipped = [p.grad.float() for p in params]
    optimizer.step()
    for param, grad in zip(params, clipped):
        first_moment = optimizer.state[param]["exp_avg"]
        torch.testing.assert_close(first_moment, 0.1 * grad, rtol=1e-6, atol=0.0)


@pytest.mark.usefixtures("deinitialized")
def test_clipping_a_list_of_master_params_taken_once_clips_every_step(emulated_cupy, one_thread):
    listed = {}

    def taken_once(optimizer):
        if "params" not in listed:
            listed["params"] = list(amp.master_params(optimizer))
        return listed["params"]

    ours, our_norms = _train(False, taken_once)
    amp.deinitialize()
    listed.clear()
    theirs, their_norms = _train(True, taken_once)
    assert our_norms == their_norms
    for a, b in zip(ours, theirs, strict=True):
        assert torch.equal(a, b)


def _stepped(model, cls, options, general, steps=3):
    """The masters and the optimizer's state tensors after `steps` O2 steps of `model`: amp's
    fused step, or (`general`) the optimizer's own (AMP_FUSED_STEP=0)."""
    optimizer = cls(model.parameters(), **options)
    with general_path(general):
        model, optimizer = amp.initialize(
            model, optimizer, opt_level="O2", dtype=torch.bfloat16, verbosity=0
        )
    for step in range(steps):
        optimizer.zero_grad()
        with amp.scale_loss(loss_of(model, step), optimizer) as scaled:
            scaled.backward()
        optimizer.step()
    masters = [p.detach().clone() for p in amp.master_params(optimizer)]
    params = [p for group in optimizer.param_groups for p in group["params"]]
    state = [  # torch's keys, in the order of the parameters
        value.clone()
        for param in params
        for key, value in sorted(optimizer.state.get(param, {}).items())
        if value is not None and not key.startswith("master") and key != "step"
    ]
    return masters, state


@pytest.mark.usefixtures("deinitialized")
def test_o2_sgd_with_momentum_is_within_an_ulp_of_the_default_for_loop_sgd(one_thread):
    """The contract (README, kernels.sgd_step_): bit for bit torch's fused SGD
    (tests/weights/test_fused_step.py), within an ulp of its for-loop / foreach SGD, whose
    rounding differs from the fused op's scalar loop over a tensor's tail (three fused steps
    after the first; make_model's biases of 8 and 2 elements go through that loop)."""
    options = dict(lr=0.1, momentum=0.9, weight_decay=0.01)
    ours = _stepped(make_model(), torch.optim.SGD, options, False, steps=4)
    amp.deinitialize()
    theirs = _stepped(make_model(), torch.optim.SGD, options, True, steps=4)
    distances = [
        int(ulps(a, b).max()) for a, b in zip(ours[0] + ours[1], theirs[0] + theirs[1], strict=True)
    ]
    assert max(distances) == 1  # not 0: the case reaches the scalar loop


class _WithAComplexParameter(torch.nn.Module):
    """A cast Linear and a complex parameter (plain: O2 casts only real floating parameters)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.linear = torch.nn.Linear(4, 2)
        self.phase = torch.nn.Parameter(torch.randn(2, dtype=torch.complex64))

    def forward(self, x):
        return (self.linear(x).float() * self.phase).real


@pytest.mark.usefixtures("deinitialized")
@pytest.mark.parametrize(
    "cls, options",
    [
        (torch.optim.AdamW, dict(lr=0.01, weight_decay=0.1)),
        (torch.optim.Adam, dict(lr=0.01)),
        (torch.optim.SGD, dict(lr=0.1, momentum=0.9)),
    ],
    ids=["adamw", "adam", "sgd"],
)
def test_a_complex_parameter_is_stepped_as_the_optimizer_steps_it(cls, options):
    """torch's for-loop optimizers step complex parameters as their real views, and so does the
    fused step (its fused op on the views): within an ulp of them (the fused op's vector body
    and torch's for-loop round the last update apart, as for real parameters)."""
    ours, _ = _stepped(_WithAComplexParameter(), cls, options, False)
    amp.deinitialize()
    theirs, _ = _stepped(_WithAComplexParameter(), cls, options, True)
    for a, b in zip(ours, theirs, strict=True):
        assert a.dtype == b.dtype
        a, b = (torch.view_as_real(t) if t.is_complex() else t for t in (a, b))
        assert int(ulps(a, b).max()) <= 1


class _WithAFloat64Parameter(torch.nn.Module):
    """A cast Linear, a batch norm kept FP32 and a float64 parameter: the group's plain
    parameters have two dtypes."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.linear = torch.nn.Linear(4, 2)
        self.norm = torch.nn.BatchNorm1d(2)
        self.offset = torch.nn.Parameter(torch.randn(2, dtype=torch.float64))

    def forward(self, x):
        return self.norm(self.linear(x)).float() + self.offset.float()


@pytest.mark.usefixtures("deinitialized")
@pytest.mark.parametrize(
    "cls, options",
    [
        (torch.optim.AdamW, dict(lr=0.01, weight_decay=0.1, fused=True)),
        (torch.optim.SGD, dict(lr=0.1, momentum=0.9, fused=True)),
    ],
    ids=["adamw", "sgd"],
)
def test_plain_parameters_of_two_dtypes_in_one_group_are_stepped_as_the_optimizer_does(
    cls, options
):
    """A plain parameter is stepped in its own dtype (the torch backend made FP32 copies of every
    gradient of a call that was not all FP32, and torch's fused op raised "expected scalar type
    Double but found Float" from the second step on)."""
    ours = _stepped(_WithAFloat64Parameter(), cls, options, False)
    amp.deinitialize()
    theirs = _stepped(_WithAFloat64Parameter(), cls, options, True)
    for a, b in zip(ours[0] + ours[1], theirs[0] + theirs[1], strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)


@pytest.mark.usefixtures("deinitialized")
def test_a_users_wrapper_of_the_step_runs_at_every_step():
    """A wrapper the user put on `optimizer.step` before initialize (functools.wraps over the
    class's step, as LR schedulers do) is the optimizer's step: amp's fused step must not take
    its place (only an LR scheduler's own wrapper, which just marks the call, may be passed)."""
    import functools

    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    ran = []
    own_step = type(optimizer).step

    @functools.wraps(own_step)
    def step(*args, **kwargs):
        ran.append(True)
        return own_step(optimizer, *args, **kwargs)

    optimizer.step = step
    model, optimizer = amp.initialize(
        model, optimizer, opt_level="O2", dtype=torch.bfloat16, verbosity=0
    )
    for index in range(4):
        optimizer.zero_grad()
        with amp.scale_loss(loss_of(model, index), optimizer) as scaled:
            scaled.backward()
        optimizer.step()
    assert len(ran) == 4
