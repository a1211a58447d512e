"""The owner of an O2 optimizer's state (amp/weights/owner.py) and the gradients it holds for
the step: a bf16 model's in its `.grad` (unscaled in place at the exit), an fp16 model's kept
low precision and scaled on the CuPy path or made FP32 master gradients, amp.master_params'
values carrying them; what a clipping, a zero_grad, a copy or a deinitialize between the exit
and the step sees and leaves. Each against the general path (the optimizer's own step) bit for
bit."""

import sys

import pytest
import torch

import amp
from helpers import ROOT
from helpers.fused import ADAMS, SGDS, assert_bitwise_states, state_of, train
from helpers.models import inject, loss_of, make_model
from helpers.o2 import general_path

sys.path.insert(0, str(ROOT / "benchmarks"))
import device_work  # noqa: E402
import kernel_work  # noqa: E402


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
    and the state and writes them back (benchmarks/kernel_work.py's kernel_traffic); torch's own
    ops there do not grow with the model (the scale update, the flags' copy to the host). Adam's
    step count is read and counted per tensor (`per_tensor` bytes)."""
    found = {}
    for width in (16, 32):
        model, optimizer = train(cls, options, steps=2, batch_norm=False, width=width)
        params = list(model.parameters())
        count = sum(p.numel() for p in params)
        counter = device_work.DeviceWork()
        with kernel_work.kernel_traffic() as kernels, counter:
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


# -- clipping what the step steps -----------------------------------------------------------------


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
