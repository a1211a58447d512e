"""FP32 state dicts of a cast model (amp/weights/model_state.py): the state dict holds the FP32
values, a copy of the model (deepcopy, pickle) takes a write not yet taken over as the original
does, and after a state dict handed out FP32 tensors a forward costs what it cost before."""

import copy

import pytest
import torch

import amp
from helpers.o2 import one_step, optimizer_params, saved, stepped_stack, train_step
from helpers.profiling import profile_calls

pytestmark = pytest.mark.usefixtures("deinitialized")


def test_after_a_step_the_state_dict_and_the_masters_keep_the_fp32_values():
    """After a step amp marks its own write into the model in one batch; read back, the batch
    is what marks made one by one give: no parameter is taken for written from outside, so the
    state dict and the masters keep the FP32 values (not the model's rounded ones), and a step
    that changes nothing leaves them bit for bit."""
    model, optimizer = stepped_stack(lr=0.1)
    try:
        masters = [m.detach().clone() for m in amp.master_params(optimizer)]
        assert all(not torch.equal(m, m.bfloat16().float()) for m in masters)  # digits to lose
        for param, master in zip(model.parameters(), masters):
            assert torch.equal(param, master.bfloat16())
        state = model.state_dict()
        for (name, _), master in zip(model.named_parameters(), masters):
            assert state[name].dtype is torch.float32 and torch.equal(state[name], master), name
        for group in optimizer.param_groups:
            group["lr"] = 0.0
        one_step(model, optimizer)
        assert all(torch.equal(a, b) for a, b in zip(amp.master_params(optimizer), masters))
        assert all(torch.equal(a, b) for a, b in zip(optimizer_params(optimizer), masters))
    finally:
        amp.deinitialize()


class RawWeight(torch.nn.Module):
    """A weight made without an in-place init: its version counter starts at 0, as a copy's."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4, 4) * 0.3)

    def forward(self, x):
        return x @ self.w


def _copy(model, how):
    if how == "deepcopy":
        return copy.deepcopy(model)
    return torch.load(saved(model), weights_only=False)


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
@pytest.mark.parametrize("side", ["model", "state_dict"])
def test_a_copy_of_the_model_takes_a_pending_write_over_as_the_original_does(how, side):
    """timm's ModelEmaV2 deep-copies the model; a write not yet taken over when it does (into a
    parameter, or into a state-dict value) is taken over in the copy as in the original. The
    copy's tensors count versions from 0: its shadows must not compare the original's counts
    (stale in the batched marks) with them, which left the copy computing with one weight while
    its state dict held another (or dropped the write)."""
    torch.manual_seed(0)
    model = RawWeight()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = amp.initialize(
        model, optimizer, opt_level="O2", dtype=torch.float16, verbosity=0
    )
    for seed in range(2):
        train_step(model, optimizer, seed=seed)
    with torch.no_grad():
        if side == "model":
            model.w.mul_(2)
        else:
            model.state_dict()["w"].mul_(2)
    twin = _copy(model, how)
    x = torch.randn(3, 4)
    assert torch.equal(twin(x), model(x))
    assert torch.equal(twin.w, model.w)
    assert torch.equal(twin.state_dict()["w"], model.state_dict()["w"])
    assert torch.equal(twin.state_dict()["w"].half(), twin.w.detach())


class _Offsets(torch.nn.Module):
    """Adds the first of `count` FP32 buffers (each cast at O2/O3, its FP32 value kept)."""

    def __init__(self, width, count):
        super().__init__()
        for index in range(count):
            self.register_buffer(f"offset{index}", torch.full((width,), 0.25 * index))

    def forward(self, x):
        return x + self.offset0


@pytest.mark.parametrize("opt_level", ["O2", "O3"])
def test_after_a_state_dict_a_forward_costs_what_it_cost_before(opt_level):
    """A state dict hands out the FP32 tensors, which may be written at any time: the forwards
    after it check them all at once, for the amp calls a forward made before (7 became 29 with
    20 buffers, for good), and a write into a held state dict still reaches the model."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), _Offsets(4, 20))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = amp.initialize(
        model, optimizer, opt_level=opt_level, dtype=torch.bfloat16, verbosity=0
    )
    x = torch.randn(2, 4)
    expected = torch.full((4,), 1 / 3).to(torch.bfloat16)
    with torch.no_grad():
        before = profile_calls(lambda: model(x))[0]
        state = model.state_dict()
        state["0.bias"].fill_(1 / 3)  # O3: its FP32 copy lives until the next forward took it
        model(x)
        assert torch.equal(model[0].bias, expected)
        assert profile_calls(lambda: model(x))[0] == before
        state["1.offset3"].fill_(1 / 3)  # a buffer's FP32 value lives on
        model(x)
    assert torch.equal(model[1].offset3, expected)
