"""O2's master gradients: made slice by slice at scale_loss's exit, each slice's low-precision
gradients freed before the next is made, bit for bit what unscaling them all at once gives."""

import contextlib
import weakref

import pytest
import torch

import amp
from amp.scaling import grad_stash
from conftest import DTYPES


def make_model(width=8, layers=6):
    torch.manual_seed(0)
    modules = []
    for _ in range(layers):
        modules += [torch.nn.Linear(width, width), torch.nn.Tanh()]
    return torch.nn.Sequential(*modules)


def loss_of(model, seed):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(16, 8, generator=generator)
    return model(x).float().square().mean()


@pytest.fixture
def small_chunks(monkeypatch):
    """Slices of at most 100 elements: a Linear(8, 8)'s weight and bias (72) fill one."""
    monkeypatch.setattr(grad_stash, "CHUNK_ELEMENTS", 100, raising=False)


def initialized(dtype):
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return amp.initialize(model, optimizer, opt_level="O2", dtype=dtype, verbosity=0)


def unscaled(grads, inv_scale):
    """What torch's unscale kernel makes of each low-precision gradient, in FP32."""
    return [grad.float() * inv_scale for grad in grads]


@pytest.mark.parametrize("dtype", DTYPES)
def test_master_grads_are_the_model_grads_unscaled_bit_for_bit(dtype, small_chunks):
    model, optimizer = initialized(dtype)
    params = list(model.parameters())
    try:
        with amp.scale_loss(loss_of(model, 0), optimizer) as scaled:
            scaled.backward()
            grads = [param.grad.clone() for param in params]
        inv_scale = amp.state_dict()["loss_scaler0"]["loss_scale"] ** -1
        masters = amp.master_params(optimizer)
        expected = unscaled(grads, torch.tensor(inv_scale, dtype=torch.float32))
        for master, want in zip(masters, expected):
            assert master.grad.dtype is torch.float32
            assert torch.equal(master.grad, want)
        assert all(param.grad is None for param in params)
    finally:
        amp.deinitialize()


@pytest.mark.parametrize("dtype", DTYPES)
def test_accumulated_master_grads_add_bit_for_bit(dtype, small_chunks):
    """A second block adds its unscaled gradients to the master gradients of the first."""
    model, optimizer = initialized(dtype)
    params = list(model.parameters())
    try:
        per_block = []
        for seed in (0, 1):
            with amp.scale_loss(loss_of(model, seed), optimizer) as scaled:
                scaled.backward()
                per_block.append([param.grad.clone() for param in params])
        inv_scale = torch.tensor(amp.state_dict()["loss_scaler0"]["loss_scale"] ** -1)
        first, second = (unscaled(grads, inv_scale) for grads in per_block)
        for master, a, b in zip(amp.master_params(optimizer), first, second):
            assert torch.equal(master.grad, a + b)
    finally:
        amp.deinitialize()


def test_low_precision_grads_are_freed_slice_by_slice(monkeypatch, small_chunks):
    """When each slice is unscaled, the gradients of the slices before it are gone: the FP16
    gradients and the FP32 master gradients are never alive in full together."""
    model, optimizer = initialized(torch.float16)
    params = list(model.parameters())
    alive_at_each_slice = []
    original = amp.kernels.unscale_to_

    def watching(sources, destinations, *args, **kwargs):
        alive_at_each_slice.append((len(sources), sum(ref() is not None for ref in refs)))
        return original(sources, destinations, *args, **kwargs)

    try:
        with amp.scale_loss(loss_of(model, 0), optimizer) as scaled:
            scaled.backward()
            refs = [weakref.ref(param.grad) for param in params]
            monkeypatch.setattr(amp.kernels, "unscale_to_", watching)
        monkeypatch.setattr(amp.kernels, "unscale_to_", original)
        assert len(alive_at_each_slice) == 6  # six Linear layers, one slice each
        remaining = len(params)
        for size, alive in alive_at_each_slice:
            assert alive == remaining  # this slice and those after it; none before
            remaining -= size
        assert remaining == 0
        assert all(ref() is None for ref in refs)
        optimizer.step()
    finally:
        amp.deinitialize()


def test_parameters_without_gradient_leave_the_others_sliced(monkeypatch, small_chunks):
    """Parameters this backward did not reach keep no master gradient; the others are still
    unscaled slice by slice, bit for bit."""
    model, optimizer = initialized(torch.bfloat16)
    reached = set(model[:4].parameters())  # two of the six Linear layers
    calls = []
    original = amp.kernels.unscale_to_

    def watching(sources, destinations, *args, **kwargs):
        calls.append(len(sources))
        return original(sources, destinations, *args, **kwargs)

    try:
        x = torch.randn(16, 8, dtype=torch.bfloat16)
        with amp.scale_loss(model[:4](x).float().square().mean(), optimizer) as scaled:
            scaled.backward()
            grads = {param: param.grad.clone() for param in reached}
            monkeypatch.setattr(amp.kernels, "unscale_to_", watching)
        monkeypatch.setattr(amp.kernels, "unscale_to_", original)
        inv_scale = torch.tensor(amp.state_dict()["loss_scaler0"]["loss_scale"] ** -1)
        assert calls == [2, 2]  # a Linear's weight and bias (72 elements) in each slice
        for param, master in zip(model.parameters(), amp.master_params(optimizer)):
            if param in reached:
                assert torch.equal(master.grad, grads[param].float() * inv_scale)
            else:
                assert master.grad is None
    finally:
        amp.deinitialize()


def test_skipped_step_with_slices_changes_nothing(small_chunks):
    model, optimizer = initialized(torch.float16)
    try:
        before = [param.detach().clone() for param in model.parameters()]
        masters = [master.detach().clone() for master in amp.master_params(optimizer)]
        with amp.scale_loss(loss_of(model, 0), optimizer) as scaled:
            scaled.backward()
            list(model.parameters())[-1].grad.view(-1)[0] = float("inf")
        optimizer.step()
        assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
        assert all(torch.equal(a, b) for a, b in zip(masters, amp.master_params(optimizer)))
    finally:
        amp.deinitialize()


def _forward_backward_peak(opt_level):
    """Bytes above those live at its start that a forward + backward of a small pre-norm
    transformer in bfloat16 holds at its peak (the CPU allocator's own events), after a step."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile, record_function

    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(
        32, 4, 64, dropout=0.0, batch_first=True, norm_first=True
    )
    model = torch.nn.Sequential(
        torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False), torch.nn.Linear(32, 8)
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = amp.initialize(
        model,
        optimizer,
        opt_level=opt_level,
        dtype=torch.bfloat16,
        verbosity=0,
        loss_scale="dynamic",
    )
    x = torch.randn(4, 16, 32, generator=torch.Generator().manual_seed(1))

    def step(mark=None):
        optimizer.zero_grad(set_to_none=True)
        with record_function(mark) if mark else contextlib.nullcontext():
            loss = model(x).float().square().mean()
            block = amp.scale_loss(loss, optimizer)
            block.__enter__().backward()
        block.__exit__(None, None, None)
        optimizer.step()

    try:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiler:
            step()
            step("measured")
    finally:
        amp.deinitialize()
    events = list(profiler.profiler.kineto_results.events())
    (mark,) = [e for e in events if e.name() == "measured"]
    begin, end = mark.start_ns(), mark.start_ns() + mark.duration_ns()
    changes = sorted(
        (e.start_ns(), e.nbytes())
        for e in events
        if e.name() == "[memory]" and e.device_type() == DeviceType.CPU
    )
    live = peak = 0
    for when, change in changes:
        if when >= begin:
            if when > end:
                break
            live += change
            peak = max(peak, live)
    return peak


def test_o2_adds_no_memory_to_the_forward_and_backward_of_the_low_precision_model():
    """O2 runs the same bfloat16 model as O3: its forward and backward hold the same bytes above
    what lives between steps (the FP32 masters and their state are all it holds more, and only
    between and at steps). The floor of O2's peak; a regression here (a cast copy kept, gradients
    held twice) shows as a difference."""
    o2, o3 = _forward_backward_peak("O2"), _forward_backward_peak("O3")
    assert o3 > 64 * 1024  # the activations are measured at all
    assert abs(o2 - o3) <= 1024, (o2, o3)  # a few scalars: the loss scale, the finite-loss flag
