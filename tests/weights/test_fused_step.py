"""amp's fused master step at O2 (amp/weights/fused_step.py): torch.optim's AdamW, Adam and SGD
stepped in one pass that leaves masters and optimizer state as the optimizer's own step on FP32
masters would (the general path, AMP_FUSED_STEP=0), the model's weights their rounding (exact
ties away from zero for a bf16 model's exact masters); the general path for everything else; no
host read where the device decides (the skip is learned later); hooks and profilers as around
torch's step; plain parameters of other dtypes and complex ones stepped as torch steps them."""

import math

import pytest
import torch

import amp
from helpers.floats import bits, ulps
from helpers.fused import ADAMS, IDS, SGDS, assert_bitwise_states, state_of, train
from helpers.models import inject, loss_of, make_model
from helpers.o2 import general_path


@pytest.fixture
def fused_calls(monkeypatch):
    """The number of fused steps amp ran (amp.kernels.adam_step_ / sgd_step_ calls)."""
    calls = []
    for name in ("adam_step_", "sgd_step_"):
        original = getattr(amp.kernels, name)

        def counting(*args, _original=original, **kwargs):
            calls.append(1)
            return _original(*args, **kwargs)

        monkeypatch.setattr(amp.kernels, name, counting)
    return calls


@pytest.mark.usefixtures("deinitialized")
@pytest.mark.parametrize("cls, options", ADAMS + SGDS, ids=IDS)
def test_the_fused_step_is_the_optimizers_own_step_bit_for_bit(cls, options, fused_calls):
    try:
        fused = state_of(*train(cls, options))
    finally:
        amp.deinitialize()
    # Every step fused, the first making the state, one call a step for the masters and the
    # batch norm's plain FP32 parameters of the one group.
    assert len(fused_calls) == 4
    fused_calls.clear()
    general = state_of(*train(cls, options, general=True))
    assert fused_calls == []
    assert_bitwise_states(fused, general)


@pytest.mark.usefixtures("deinitialized")
@pytest.mark.parametrize(
    "cls, options",
    [
        (torch.optim.AdamW, dict(lr=0.01, amsgrad=True)),
        (torch.optim.AdamW, dict(lr=0.01, maximize=True)),
        (torch.optim.AdamW, dict(lr=torch.tensor(0.01))),
        (torch.optim.SGD, dict(lr=0.1, maximize=True)),
        (torch.optim.RMSprop, dict(lr=0.01)),
    ],
    ids=["amsgrad", "maximize", "tensor-lr", "sgd-maximize", "another-class"],
)
def test_what_the_fused_step_does_not_compute_takes_the_general_path(cls, options, fused_calls):
    train(cls, options, steps=3)
    assert fused_calls == []


@pytest.mark.usefixtures("deinitialized")
def test_clipping_through_master_params_is_stepped_from(fused_calls):
    def clip(step, model, optimizer):
        if step == 2:
            torch.nn.utils.clip_grad_norm_(amp.master_params(optimizer), 1e-3)

    model, optimizer = train(torch.optim.AdamW, dict(lr=0.01), steps=4, hook=clip)
    assert len(fused_calls) == 4  # the clipped FP32 master gradients are stepped from
    clipped = state_of(model, optimizer)
    amp.deinitialize()
    reference = state_of(*train(torch.optim.AdamW, dict(lr=0.01), steps=4, hook=clip, general=True))
    assert_bitwise_states(clipped, reference)


@pytest.mark.usefixtures("deinitialized")
def test_hyperparameters_are_read_at_every_step_and_groups_added_later_step_too(fused_calls):
    def schedule(step, model, optimizer):
        for group in optimizer.param_groups:
            group["lr"] = 0.01 / (step + 1)
            group["weight_decay"] = 0.05 * step

    model, optimizer = train(torch.optim.AdamW, dict(lr=0.01), hook=schedule)
    assert len(fused_calls) == 4
    scheduled = state_of(model, optimizer)
    amp.deinitialize()
    reference = state_of(*train(torch.optim.AdamW, dict(lr=0.01), hook=schedule, general=True))
    assert_bitwise_states(scheduled, reference)


@pytest.mark.usefixtures("deinitialized")
def test_the_state_dict_keeps_torchs_format_and_loads_into_a_plain_optimizer():
    model, optimizer = train(torch.optim.AdamW, dict(lr=0.01), steps=3)
    saved = optimizer.state_dict()
    masters = [m.detach().clone() for m in amp.master_params(optimizer)]
    amp.deinitialize()
    for state in saved["state"].values():  # torch's keys, and a cast parameter's remainder
        assert set(state) - {"master_remainder"} == {"step", "exp_avg", "exp_avg_sq"}
        assert state["exp_avg"].dtype is torch.float32
    plain = torch.optim.AdamW([torch.nn.Parameter(m.clone()) for m in masters], lr=0.01)
    plain.load_state_dict(saved)  # the remainders come along, unread by torch's step
    for state in plain.state_dict()["state"].values():
        assert state["step"].item() == 3.0 and state["exp_avg"].dtype is torch.float32
    for param in plain.param_groups[0]["params"]:
        param.grad = torch.ones_like(param)
    plain.step()


# -- the device decides: no host read, the skip learned later ----------------------------------


@pytest.fixture
def copies_in_flight(monkeypatch):
    """The host copies of the blocks' flags have not arrived by the step (as on a GPU), so that
    the step either hands the flag to the device or reads it (counted by Tensor.item)."""
    from amp.scaling.device_scale import Check

    arrived = Check.arrived
    monkeypatch.setattr(
        Check, "arrived", lambda self, wait=False: arrived(self, wait) if wait else False
    )
    reads = []
    item = torch.Tensor.item
    monkeypatch.setattr(torch.Tensor, "item", lambda t: reads.append(t) or item(t))
    return reads


@pytest.mark.usefixtures("deinitialized")
@pytest.mark.parametrize("cls, options", [ADAMS[0], SGDS[0]], ids=["adamw", "sgd"])
def test_the_fused_step_reads_nothing_and_skips_on_the_device(copies_in_flight, cls, options):
    reference = state_of(*train(cls, options, steps=2))
    amp.deinitialize()

    def overflow(step, model, optimizer):
        if step == 2:
            inject(model[0].weight)

    def first_step_read(step, model, optimizer):
        if step >= 1:  # the first step makes the state: it waits for the flag
            copies_in_flight.clear()

    model, optimizer = train(cls, options, steps=3, inside=overflow, hook=first_step_read)
    assert copies_in_flight == []  # steps 1 and 2: nothing read from the device
    assert_bitwise_states(state_of(model, optimizer), reference)  # step 2 changed nothing
    report = amp.last_overflow()  # asked: learned now
    # On the torch backend the master gradients are gone by then: no names (the CuPy path
    # keeps its check's flags, test_the_cupy_path_names_...).
    assert report is not None and report.loss_id == 0 and report.params == ()


@pytest.mark.usefixtures("deinitialized")
def test_o1_with_a_fused_torch_optimizer_reads_nothing(copies_in_flight):
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, fused=True)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O1", verbosity=0)
    for step in range(3):
        if step == 1:
            copies_in_flight.clear()  # the first step makes the scaler's state: reads of the host
        optimizer.zero_grad()
        with amp.scale_loss(loss_of(model, step), optimizer) as scaled:
            scaled.backward()
            if step == 2:
                inject(model[0].weight)
        before = [p.detach().clone() for p in model.parameters()]
        optimizer.step()
    assert copies_in_flight == []
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # skipped
    assert amp.last_overflow().loss_scale == 2.0**15
    assert amp.state_dict()["loss_scaler0"]["loss_scale"] == 2.0**15


@pytest.mark.usefixtures("deinitialized")
def test_a_skip_learned_later_is_reported_when_it_arrives_or_is_asked_for(copies_in_flight, caplog):
    model, optimizer = train(torch.optim.AdamW, dict(lr=0.01), steps=2)
    amp._amp_state.verbosity = 1
    optimizer.zero_grad()
    with amp.scale_loss(loss_of(model, 2), optimizer) as scaled:
        scaled.backward()
        inject(model[0].weight)
    copies_in_flight.clear()
    with caplog.at_level("INFO", logger="amp"):
        optimizer.step()  # the device skips; the host does not know yet
        optimizer.zero_grad()  # still on its way
    assert "Skipping step" not in caplog.text
    with caplog.at_level("INFO", logger="amp"):
        assert amp.last_overflow() is not None  # asked: it waits for the copy
    assert (
        "Gradient overflow.  Skipping step, loss scaler 0 reducing loss scale to 32768.0"
        in caplog.text
    )
    assert copies_in_flight == []


@pytest.mark.usefixtures("deinitialized")
def test_step_hooks_run_around_the_fused_step_as_around_torchs(fused_calls):
    """A step hook (a profiler, a logger, a callback; the optimizer's own or torch's global one)
    keeps the fused step (it turned it off: 163 ops a step for 8 layers instead of 3) and runs
    as torch's step runs it: pre-hooks, the step, post-hooks, once a step, not on a skip."""
    from torch.optim.optimizer import register_optimizer_step_post_hook

    calls = []
    handles = []

    def hook(kind):
        return lambda optimizer, args, kwargs: calls.append((kind, len(fused_calls), args))

    def register(step, model, optimizer):
        if step == 0:
            handles.append(optimizer.register_step_pre_hook(hook("pre")))
            handles.append(optimizer.register_step_post_hook(hook("post")))
            handles.append(register_optimizer_step_post_hook(hook("global post")))

    def overflow(step, model, optimizer):
        if step == 2:
            inject(model[0].weight)

    try:
        model, optimizer = train(
            torch.optim.AdamW, dict(lr=0.01), steps=4, hook=register, inside=overflow
        )
    finally:
        for handle in handles:
            handle.remove()
    # Steps 0, 1 and 3 fused; 2 skipped (no hook runs).
    assert len(fused_calls) == 3
    fused = [(kind, count) for kind, count, _ in calls]
    assert fused == [("pre", 0), ("post", 1), ("global post", 1)] + [
        ("pre", 1),
        ("post", 2),
        ("global post", 2),
    ] + [("pre", 2), ("post", 3), ("global post", 3)]
    assert all(args == (optimizer,) for _, _, args in calls)


@pytest.mark.usefixtures("deinitialized")
def test_a_pre_hook_that_passes_arguments_to_the_fused_step_is_refused():
    model, optimizer = train(torch.optim.AdamW, dict(lr=0.01), steps=2)
    optimizer.register_step_pre_hook(lambda opt, args, kwargs: (args, {"closure": print}))
    with amp.scale_loss(loss_of(model, 5), optimizer) as scaled:
        scaled.backward()
    with pytest.raises(RuntimeError, match="takes none of"):
        optimizer.step()


@pytest.mark.usefixtures("deinitialized")
def test_a_profiler_sees_the_fused_step_under_torchs_name(fused_calls):
    model, optimizer = train(torch.optim.AdamW, dict(lr=0.01), steps=2)
    with amp.scale_loss(loss_of(model, 5), optimizer) as scaled:
        scaled.backward()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        optimizer.step()
    assert len(fused_calls) == 3  # the two training steps and this one
    assert "Optimizer.step#AdamW.step" in {event.name for event in profile.events()}


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
    """The contract (docs/o2.md, kernels.sgd_step_): bit for bit torch's fused SGD
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


# -- exact masters against torch's own fused step -------------------------------------------------

# Halfway between bf16 neighbours: torch's cast takes the first two to the even neighbour toward
# zero, the third to the even one away from zero (where ties away from zero take it too).
_TIES = [1.0 + 2.0**-8, -(1.0 + 2.0**-8), 1.0 + 2.0**-7 + 2.0**-8]


def _two_groups(kind, params):
    groups = [{"params": params[:2]}, {"params": params[2:], "lr": 0.003, "weight_decay": 0.0}]
    if kind == "adamw":
        return torch.optim.AdamW(groups, lr=0.01, weight_decay=0.1, fused=True)
    return torch.optim.SGD(groups, lr=0.05, momentum=0.9, weight_decay=0.01, fused=True)


def _weights_off_torchs_cast(weights, masters):
    """(weights one bf16 ulp from torch's cast of their master, the masters at a tie that torch's
    round-to-nearest-even takes toward zero): the two counts are equal where the weights are the
    masters rounded with ties away from zero."""
    off = ties = 0
    for weight, master in zip(weights, masters, strict=True):
        cast = master.to(torch.bfloat16)
        off += int((weight != cast).sum())
        at_tie = (bits(master) & 0xFFFF) == 0x8000
        ties += int((at_tie & (cast.float().abs() < master.abs())).sum())
    return off, ties


@pytest.mark.usefixtures("deinitialized")
@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_exact_masters_are_torchs_fused_step_on_fp32_copies_at_every_step(kind):
    """amp.master_params after each step equal, bit for bit, torch's fused AdamW / SGD stepping
    FP32 copies with the FP32 gradients amp.master_params reported after the scale_loss block (two
    groups, a skipped step between). The model's weights are the masters rounded to nearest, ties
    away from zero: they differ from torch's cast exactly at the ties it rounds to even toward
    zero (planted at the start: none is met by chance here)."""
    model = make_model(inputs=16, hidden=32, outputs=16)
    with torch.no_grad():
        model[0].weight.view(-1)[: len(_TIES)] = torch.tensor(_TIES)
    optimizer = _two_groups(kind, list(model.parameters()))
    model, optimizer = amp.initialize(
        model, optimizer, opt_level="O2", dtype=torch.bfloat16, verbosity=0
    )
    copies = [m.detach().clone() for m in amp.master_params(optimizer)]
    reference = _two_groups(kind, copies)
    counts = [_weights_off_torchs_cast(list(model.parameters()), copies)]
    assert counts[0] == (2, 2)
    for step in range(6):
        optimizer.zero_grad()
        with amp.scale_loss(loss_of(model, step, inputs=16, outputs=16), optimizer) as scaled:
            scaled.backward()
            if step == 2:
                inject(model[0].weight)  # skipped: neither side steps
        if step != 2:
            for copy, master in zip(copies, amp.master_params(optimizer)):
                copy.grad = master.grad.detach().clone()
            reference.step()
        optimizer.step()
        masters = [m.detach() for m in amp.master_params(optimizer)]
        for ours, theirs in zip(masters, copies, strict=True):
            assert torch.equal(bits(ours), bits(theirs)), step
        off, ties = _weights_off_torchs_cast(list(model.parameters()), copies)
        assert off == ties, step
        counts.append((off, ties))
    assert counts[1:] == [(0, 0)] * 6


# -- what a step refuses, and what it takes ------------------------------------------------------


def _sgd_run(refuse_first, steps=3):
    """O2 bf16 SGD with momentum over two groups; with `refuse_first`, the first step finds a
    tensor lr in the second group (a scheduler's), is refused, and the user puts a number back."""
    model = make_model(inputs=16, hidden=32, outputs=16)
    params = list(model.parameters())
    optimizer = torch.optim.SGD(
        [{"params": params[:2]}, {"params": params[2:]}], lr=0.1, momentum=0.9
    )
    model, optimizer = amp.initialize(
        model, optimizer, opt_level="O2", dtype=torch.bfloat16, verbosity=0
    )
    for step in range(steps):
        optimizer.zero_grad()
        with amp.scale_loss(loss_of(model, step, inputs=16, outputs=16), optimizer) as scaled:
            scaled.backward()
        if refuse_first and step == 0:
            optimizer.param_groups[1]["lr"] = torch.tensor(0.1)
            before = [p.detach().clone() for p in model.parameters()]
            with pytest.raises(RuntimeError, match=r"param_groups\[1\].*Nothing was changed"):
                optimizer.step()
            assert not optimizer.state  # no state made for the first group either
            assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
            optimizer.param_groups[1]["lr"] = 0.1
        optimizer.step()
    return state_of(model, optimizer)


@pytest.mark.usefixtures("deinitialized")
def test_a_step_refused_for_a_later_group_changes_nothing_and_the_next_is_a_first_step():
    """Every group is planned before any state is made (SGD's momentum was half a clean run's
    after a first step refused for the second group)."""
    refused = _sgd_run(refuse_first=True)
    amp.deinitialize()
    assert_bitwise_states(refused, _sgd_run(refuse_first=False))


@pytest.mark.usefixtures("deinitialized")
def test_numpy_floats_are_numbers_to_the_fused_step(fused_calls):
    """np.float64 hyperparameters and a LambdaLR computing with np.cos are stepped by the fused
    step as torch's step takes them (as floats), bit for bit with Python floats."""
    import numpy as np

    def run(number):
        model = make_model(inputs=16, hidden=32, outputs=16)
        optimizer = torch.optim.AdamW(
            model.parameters(), lr=number(0.01), betas=(number(0.9), number(0.99)),
            weight_decay=number(0.1),
        )
        model, optimizer = amp.initialize(
            model, optimizer, opt_level="O2", dtype=torch.bfloat16, verbosity=0
        )
        cosine = np.cos if number is np.float64 else math.cos
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: cosine(s / 10))
        for step in range(3):
            optimizer.zero_grad()
            with amp.scale_loss(loss_of(model, step, inputs=16, outputs=16), optimizer) as scaled:
                scaled.backward()
            optimizer.step()
            scheduler.step()
        return state_of(model, optimizer)

    with_numpy = run(np.float64)
    assert len(fused_calls) == 3
    amp.deinitialize()
    assert_bitwise_states(with_numpy, run(float))


@pytest.mark.usefixtures("deinitialized")
@pytest.mark.parametrize("form", ["exact", "compact-int8", "compact-bf16"])
@pytest.mark.parametrize(
    "shape", [(64, 64), (64, 16), (32, 64)], ids=["grown", "shrunk", "same size"]
)
def test_state_made_for_another_shape_is_refused_changing_nothing(form, shape):
    """New data of another shape in a parameter (`param.data = ...`) after its state was made:
    the step raises as torch's own does, changing no state, and steps again once the state is
    dropped (with int8, rows of 16 hold FP32 moments: the codes left behind do not fit either)."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(32, 64)
    optimizer = torch.optim.AdamW(layer.parameters(), lr=1e-2)
    master, _, moments = form.partition("-")
    layer, optimizer = amp.initialize(
        layer, optimizer, opt_level="O2", dtype=torch.bfloat16, verbosity=0,
        master_weights=True if master == "exact" else "compact", optimizer_state=moments or "fp32",
    )

    def step(inputs):
        with amp.scale_loss(layer(torch.randn(4, inputs)).float().pow(2).mean(), optimizer) as s:
            s.backward()
        optimizer.step()
        optimizer.zero_grad()

    for _ in range(2):
        step(32)
    layer.weight.data = torch.randn(*shape, dtype=torch.bfloat16) * 0.1
    layer.bias.data = layer.bias.data[: shape[0]].clone()
    weight = layer.weight.detach().clone()
    state = {k: v.clone() for k, v in optimizer.state[layer.weight].items()}
    with pytest.raises(RuntimeError, match=r"made for another shape.*del optimizer\.state"):
        step(shape[1])
    assert torch.equal(layer.weight.detach(), weight)
    after = optimizer.state[layer.weight]
    assert sorted(after) == sorted(state) and all(torch.equal(after[k], state[k]) for k in state)
    del optimizer.state[layer.weight]
    if shape[0] != 64:
        del optimizer.state[layer.bias]
    step(shape[1])
    assert not torch.equal(layer.weight.detach(), weight)
