"""amp's fused master step at O2 (amp/weights/fused_step.py, owner.py): torch.optim's AdamW,
Adam and SGD stepped in one pass that leaves masters and optimizer state as the optimizer's own
step on FP32 masters would (the general path, AMP_FUSED_STEP=0), the model's weights their
rounding (exact ties away from zero for a bf16 model's exact masters); the general path for
everything else; no host read where the device decides (the skip is learned later); the CuPy path
keeps gradients low precision until the step."""

import sys

import pytest
import torch

import amp
from helpers import ROOT
from helpers.floats import bits
from helpers.models import inject, loss_of, make_model
from helpers.o2 import general_path

sys.path.insert(0, str(ROOT / "benchmarks"))
import device_work  # noqa: E402

ADAMS = [
    (torch.optim.AdamW, dict(lr=0.01, weight_decay=0.1)),
    (torch.optim.Adam, dict(lr=0.01, weight_decay=0.1)),
    (torch.optim.Adam, dict(lr=0.01)),
]
SGDS = [
    (torch.optim.SGD, dict(lr=0.1, momentum=0.9, weight_decay=0.01)),
    (torch.optim.SGD, dict(lr=0.1, momentum=0.9, nesterov=True)),
    (torch.optim.SGD, dict(lr=0.1, momentum=0.8, dampening=0.25)),
    (torch.optim.SGD, dict(lr=0.1)),
]
IDS = ["adamw", "adam-l2", "adam", "sgd-momentum", "sgd-nesterov", "sgd-dampening", "sgd"]


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


def train(
    cls,
    options,
    steps=4,
    dtype=torch.bfloat16,
    general=False,
    batch_norm=True,
    hook=None,
    inside=None,
    width=None,
):
    """An O2 model trained `steps` steps; `general` forces the general path (AMP_FUSED_STEP=0). The
    optimizer is torch's fused implementation, the one amp's torch backend runs, so that its own
    steps (the first, and the general path's) compute what the fused step does."""
    sizes = dict(inputs=width, hidden=2 * width, outputs=width) if width else {}
    model = make_model(batch_norm=batch_norm, **sizes)
    loss_sizes = dict(inputs=width, outputs=width) if width else {}
    fused = {"fused": True} if cls in (torch.optim.AdamW, torch.optim.Adam, torch.optim.SGD) else {}
    optimizer = cls(model.parameters(), **options, **fused)
    with general_path(general):
        model, optimizer = amp.initialize(
            model, optimizer, opt_level="O2", dtype=dtype, verbosity=0
        )
    for step in range(steps):
        optimizer.zero_grad()
        with amp.scale_loss(loss_of(model, step, **loss_sizes), optimizer) as scaled:
            scaled.backward()
            if inside is not None:  # the model's gradients, still scaled
                inside(step, model, optimizer)
        if hook is not None:
            hook(step, model, optimizer)
        optimizer.step()
    return model, optimizer


def state_of(model, optimizer):
    weights = [p.detach().clone() for p in model.parameters()]
    masters = [p.detach().clone() for p in amp.master_params(optimizer)]
    return weights, masters, optimizer.state_dict()


_RESTS = ("master", "master_remainder", "master_correction")


def assert_bitwise_states(a, b):
    """The same masters and moments bit for bit; the same weights, but where an exact master's
    weight took a tie away from zero and an FP32 master's to even (their masters agree)."""
    (weights_a, masters_a, opt_a), (weights_b, masters_b, opt_b) = a, b
    for x, y in zip(masters_a, masters_b, strict=True):
        assert x.dtype == y.dtype and torch.equal(bits(x), bits(y))
    for x, y in zip(weights_a, weights_b, strict=True):
        assert x.dtype == y.dtype
        if not torch.equal(x, y):  # only at ties: a master whose low 16 bits are 0x8000
            master = next(m for m in masters_a if m.shape == x.shape and torch.equal(
                m.to(x.dtype)[x == y], x[x == y]))
            assert ((bits(master) & 0xFFFF)[x != y] == 0x8000).all()
    for index, state in opt_a["state"].items():
        theirs = opt_b["state"].get(index, {})
        for key, value in state.items():
            if key in _RESTS:  # the master's form: compared as the masters above
                continue
            if key == "step" and key not in theirs:  # an exact master's entry never stepped
                assert value.item() == 0 and not set(state) - {"step", *_RESTS}, index
                continue
            other = theirs[key]
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(other)), (index, key)


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
    from amp.scaling.scaler import Check

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


# -- the CuPy path: gradients low precision until the step ---------------------------------------


@pytest.mark.usefixtures("deinitialized")
@pytest.mark.parametrize("batch_norm", [False, True], ids=["masters", "masters-and-plain"])
@pytest.mark.parametrize("cls, options", [ADAMS[0], SGDS[1]], ids=["adamw", "sgd-nesterov"])
def test_the_cupy_path_unscales_in_place_at_the_exit_and_steps_the_models_gradients(
    emulated_cupy, one_thread, cls, options, batch_norm
):
    """Bit for bit the torch backend's steps where torch's CPU op has no scalar loop (one
    thread, sizes of whole vectors: tests/kernels/test_fused_step.py). The exit unscales the bf16
    gradients in place (exact: a power of two) and leaves them in the model's `.grad`, which the
    step reads: no FP32 master gradient is made. A group holding the batch norm's plain FP32
    parameters too steps them from their own (FP32, unscaled) gradients."""
    seen = []

    def look(step, model, optimizer):
        params = [p for g in optimizer.param_groups for p in g["params"]]
        seen.append([p.grad.dtype for p in params[:2]])

    model, optimizer = train(cls, options, steps=4, batch_norm=batch_norm, hook=look, width=16)
    names = [name for name, _, _ in emulated_cupy.calls]
    assert seen[3] == [torch.bfloat16] * 2  # the model's own, unscaled: no FP32 made
    assert "amp_unscale<__nv_bfloat16>" in names
    steps = ("amp_compact_adam<__nv_bfloat16, amp::Remainder", "amp_compact_sgd<__nv_bfloat16, "
             "amp::Remainder")
    assert any(name.startswith(steps) for name in names)
    ours = state_of(model, optimizer)
    amp.deinitialize()
    reference = state_of(
        *train(cls, options, steps=4, batch_norm=batch_norm, general=True, width=16)
    )
    assert_bitwise_states(ours, reference)


def _read_and_drop_one(seen):
    """A hook between the exit and the step: every master's gradient read through
    amp.master_params, the first master's set to None (it is not stepped then)."""

    def hook(step, model, optimizer):
        masters = list(amp.master_params(optimizer))
        seen.append([m.grad.clone() for m in masters])
        masters[0].grad = None

    return hook


@pytest.mark.usefixtures("deinitialized")
@pytest.mark.parametrize("batch_norm", [False, True], ids=["masters", "masters-and-plain"])
@pytest.mark.parametrize("cls, options", [ADAMS[0], SGDS[0]], ids=["adamw", "sgd-momentum"])
def test_a_kept_gradient_read_or_written_through_master_params_is_the_fp32_one(
    emulated_cupy, one_thread, cls, options, batch_norm
):
    """The masters' gradients read through amp.master_params between the exit and the step are
    the FP32 unscaled gradients the general path has there, and a write to them counts for the
    step; the param groups hold the model's parameters throughout."""
    ours_seen, theirs_seen = [], []
    model, optimizer = train(
        cls, options, batch_norm=batch_norm, width=16, hook=_read_and_drop_one(ours_seen)
    )
    held = [p for g in optimizer.param_groups for p in g["params"]]
    assert all(any(p is q for q in model.parameters()) for p in held)
    ours = state_of(model, optimizer)
    amp.deinitialize()
    model, optimizer = train(
        cls,
        options,
        batch_norm=batch_norm,
        width=16,
        general=True,
        hook=_read_and_drop_one(theirs_seen),
    )
    theirs = state_of(model, optimizer)
    for a, b in zip(sum(ours_seen, []), sum(theirs_seen, []), strict=True):
        assert a.dtype == b.dtype == torch.float32 and torch.equal(a, b)
    assert_bitwise_states(ours, theirs)


@pytest.mark.usefixtures("deinitialized")
def test_zero_grad_drops_kept_gradients_without_making_them(emulated_cupy):
    made = []

    def dropped(step, model, optimizer):
        original = amp.kernels.unscale_to_
        amp.kernels.unscale_to_ = lambda *args, **kwargs: (
            made.append(1) or original(*args, **kwargs)
        )
        try:
            optimizer.zero_grad()
        finally:
            amp.kernels.unscale_to_ = original
        masters = list(amp.master_params(optimizer))
        made.append([m.grad for m in masters] == [None] * len(masters))

    train(torch.optim.AdamW, dict(lr=0.01), batch_norm=False, hook=dropped)
    assert made == [True] * 4


@pytest.mark.usefixtures("deinitialized")
def test_the_cupy_path_names_the_overflowing_parameters_from_its_check(emulated_cupy):
    def overflow(step, model, optimizer):
        if step == 3:
            inject(model[2].weight, "nan")

    train(torch.optim.AdamW, dict(lr=0.01), batch_norm=False, inside=overflow)
    assert amp.last_overflow().params == ("2.weight",)


@pytest.mark.usefixtures("deinitialized")
@pytest.mark.parametrize(
    "cls, options, kernel_bytes, per_tensor",
    [(torch.optim.AdamW, dict(lr=0.01), 4 + 26, 12), (torch.optim.SGD, SGDS[0][1], 4 + 18, 0)],
    ids=["adamw", "sgd-momentum"],
)
def test_the_cupy_path_moves_the_bytes_of_one_pass_per_parameter(
    emulated_cupy, cls, options, kernel_bytes, per_tensor
):
    """After backward the kernels unscale each BF16 gradient in place at the exit (read and
    written once) and read it once in the step, which reads the BF16 weight, its int16 remainder
    and the state and writes them back (benchmarks/device_work.py's kernel_traffic); torch's own
    ops there do not grow with the model (the scale update, the flags' copy to the host). Adam's
    step count is read and counted per tensor (`per_tensor` bytes)."""
    found = {}
    for width in (16, 32):
        model, optimizer = train(cls, options, steps=2, batch_norm=False, width=width)
        params = list(model.parameters())
        count = sum(p.numel() for p in params)
        counter = device_work.DeviceWork()
        with device_work.kernel_traffic() as kernels, counter:
            optimizer.zero_grad()
            with amp.scale_loss(loss_of(model, 2, inputs=width, outputs=width), optimizer) as s:
                s.backward()
            optimizer.step()
        assert kernels.bytes == kernel_bytes * count + per_tensor * len(params)
        found[width] = counter.phases["after backward"].bytes
        amp.deinitialize()
    assert found[16] == found[32]


@pytest.mark.usefixtures("deinitialized")
def test_deinitialize_between_the_exit_and_the_step_hands_the_gradients_back(emulated_cupy):
    """The FP32 model the undo gives back holds the unscaled gradients the general path's masters
    held, deferred or not."""
    found = []
    for general in (False, True):
        model, optimizer = train(
            torch.optim.AdamW, dict(lr=0.01), batch_norm=False, general=general
        )
        optimizer.zero_grad()
        with amp.scale_loss(loss_of(model, 5), optimizer) as scaled:
            scaled.backward()
        amp.deinitialize()
        found.append([p.grad for p in model.parameters()])
    for ours, theirs in zip(*found, strict=True):
        assert ours.dtype == torch.float32 and torch.equal(ours, theirs)


@pytest.mark.usefixtures("deinitialized")
@pytest.mark.parametrize("clip", [False, True], ids=["deferred", "clipped"])
def test_the_cupy_path_packs_its_step_launches_once_for_masters_and_plain_parameters(
    emulated_cupy, monkeypatch, clip
):
    """The step kernels' launch plans (amp.kernels' CuPy backend keeps them by the tensors they
    cover) are reused from step to step when a group holds masters and batch norm's plain
    parameters, and when a clipping made the masters' gradients FP32 (one call with rows without
    a copy): packed at the first step only."""
    from amp.kernels import _cupy_device

    packed = []
    original = _cupy_device._layout.plan

    def plan(*args, **kwargs):
        packed.append(len(marks))
        return original(*args, **kwargs)

    def step_planned(*args, _planned=_cupy_device.planned):
        with monkeypatch.context() as patch:
            patch.setattr(_cupy_device._layout, "plan", plan)
            return _planned(*args)

    monkeypatch.setattr(_cupy_device, "planned", step_planned)
    marks = []

    def mark(step, model, optimizer):
        marks.append(step)
        if clip:
            torch.nn.utils.clip_grad_norm_(amp.master_params(optimizer), 1.0)

    train(torch.optim.AdamW, dict(lr=0.01), steps=5, batch_norm=True, hook=mark)
    assert packed == [1, 1]  # the masters' rows and the plain parameters', at the first step


@pytest.mark.usefixtures("deinitialized")
@pytest.mark.parametrize("cls, options", [ADAMS[0], SGDS[0]], ids=["adamw", "sgd-momentum"])
def test_the_cupy_path_unscales_by_the_scale_the_loss_had_when_the_scale_grows(
    emulated_cupy, one_thread, cls, options
):
    """The exit's update doubles the live scale before the step reads the deferred gradients:
    they are unscaled by the one their loss was scaled with (a copy the check keeps)."""
    from amp._state import amp_state

    def grow_every_step(step, model, optimizer):
        if step == 0:
            amp_state.loss_scalers[0].growth_interval = 1

    model, optimizer = train(cls, options, batch_norm=True, width=16, inside=grow_every_step)
    assert amp_state.loss_scalers[0].loss_scale() == 2.0**16 * 2**4
    ours = state_of(model, optimizer)
    amp.deinitialize()
    reference = train(cls, options, batch_norm=True, width=16, inside=grow_every_step, general=True)
    assert_bitwise_states(ours, state_of(*reference))


@pytest.mark.usefixtures("deinitialized")
@pytest.mark.parametrize("set_to_none", [True, False])
def test_zero_grad_between_the_exit_and_the_step_is_the_general_paths(
    emulated_cupy, one_thread, set_to_none
):
    """Zeroed (not dropped) gradients are stepped with, as the general path's FP32 ones are."""

    def zero(step, model, optimizer):
        if step == 2:
            optimizer.zero_grad(set_to_none=set_to_none)

    options = dict(lr=0.01, weight_decay=0.1)
    ours = state_of(*train(torch.optim.AdamW, options, hook=zero, width=16))
    amp.deinitialize()
    theirs = state_of(*train(torch.optim.AdamW, options, hook=zero, width=16, general=True))
    assert_bitwise_states(ours, theirs)


@pytest.mark.usefixtures("deinitialized")
def test_a_copy_of_the_optimizer_between_the_exit_and_the_step_holds_plain_parameters(
    emulated_cupy,
):
    import copy

    copies = []
    train(
        torch.optim.AdamW,
        dict(lr=0.01),
        batch_norm=False,
        hook=lambda step, model, optimizer: copies.append(copy.deepcopy(optimizer)),
    )
    params = [p for group in copies[-1].param_groups for p in group["params"]]
    assert {type(p) for p in params} == {torch.nn.Parameter}


def _two_optimizers_one_scaler(general, delay_overflow_check):
    """Two O2 models and optimizers sharing loss scaler 0, each its own block before the steps,
    the scale growing at every clean update; the masters after two steps."""
    from amp._state import amp_state

    sizes = dict(inputs=16, hidden=32, outputs=16)
    models = [make_model(batch_norm=False, seed=seed, **sizes) for seed in (0, 1)]
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, fused=True) for m in models]
    with general_path(general):
        models, optimizers = amp.initialize(
            models, optimizers, opt_level="O2", dtype=torch.bfloat16, verbosity=0
        )
    amp_state.loss_scalers[0].growth_interval = 1
    for step in range(3):
        for index, (model, optimizer) in enumerate(zip(models, optimizers)):
            optimizer.zero_grad()
            loss = loss_of(model, step, inputs=16, outputs=16)
            delay = delay_overflow_check and index == 0
            with amp.scale_loss(loss, optimizer, delay_overflow_check=delay) as scaled:
                scaled.backward()
        for optimizer in optimizers:
            optimizer.step()
    return [state_of(model, optimizer) for model, optimizer in zip(models, optimizers)]


@pytest.mark.usefixtures("deinitialized")
@pytest.mark.parametrize("delay_overflow_check", [False, True], ids=["checked", "delayed-check"])
def test_deferred_gradients_keep_their_scale_while_another_block_changes_it(
    emulated_cupy, one_thread, delay_overflow_check
):
    """A later block's exit (its check, its update of the shared scaler) comes between the first
    block's exit and its step: the first block's gradients are unscaled by their own scale."""
    ours = _two_optimizers_one_scaler(False, delay_overflow_check)
    amp.deinitialize()
    theirs = _two_optimizers_one_scaler(True, delay_overflow_check)
    for a, b in zip(ours, theirs, strict=True):
        assert_bitwise_states(a, b)


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
