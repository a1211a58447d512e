"""Hostile checks of O2's batched marks (shadows.ParamMarks): what amp writes into the model at a
step is marked in one batch, and a write from outside amp must still reach the FP32 masters
wherever they are read: the next step, amp.master_params, the state dicts, a copy of the model."""

import copy
import io

import pytest
import torch

import amp
from amp._state import amp_state


@pytest.fixture(autouse=True)
def clean_amp():
    yield
    if amp_state.initialized:
        amp.deinitialize()


def make_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 4))


def setup(optimizer_class=torch.optim.Adam, dtype=torch.float16, **kwargs):
    model = make_model()
    optimizer = optimizer_class(model.parameters(), lr=0.01)
    return amp.initialize(model, optimizer, opt_level="O2", dtype=dtype, verbosity=0, **kwargs)


def train_step(model, optimizer, seed=1, scale=1.0):
    optimizer.zero_grad()
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(seed))
    loss = model(x).float().square().mean() * scale
    with amp.scale_loss(loss, optimizer) as scaled:
        scaled.backward()
    optimizer.step()


def optimizer_params(optimizer):
    """The masters as the optimizer holds them, read without any amp call."""
    return [p.detach().clone() for group in optimizer.param_groups for p in group["params"]]


def saved(state):
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return buffer


@pytest.mark.parametrize("skipped", [False, True], ids=["after-a-step", "after-a-skipped-step"])
def test_an_optimizer_checkpoint_saved_first_holds_a_write_into_the_model(skipped):
    """A write into the model after a step (a mask, a broadcast) is the masters' value from then
    on. An optimizer checkpoint serialized before the model's state dict is looked at must hold
    it, or the resumed run steps from masters without it (not bit-exact with the run that went
    on). Before the check moved from scale_loss to step, a skipped step took the write in."""
    model, optimizer = setup()
    train_step(model, optimizer)
    with torch.no_grad():
        model[0].weight.mul_(0.5)
    if skipped:
        train_step(model, optimizer, seed=2, scale=1e30)  # FP16 gradients overflow
        assert amp.last_overflow() is not None
    optimizer_file = saved(optimizer.state_dict())
    model_file = saved(model.state_dict())
    amp_state_dict = amp.state_dict()
    train_step(model, optimizer, seed=3)
    went_on = optimizer_params(optimizer)
    amp.deinitialize()

    model, optimizer = setup()
    model.load_state_dict(torch.load(model_file))
    optimizer.load_state_dict(torch.load(optimizer_file))
    amp.load_state_dict(amp_state_dict)
    train_step(model, optimizer, seed=3)
    for resumed, expected in zip(optimizer_params(optimizer), went_on):
        assert torch.equal(resumed, expected)


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
