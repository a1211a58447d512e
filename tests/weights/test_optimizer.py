"""The optimizer amp sets up (amp/weights/optimizer.py): its step after a plain backward at O2,
closures, and LR schedulers that wrap it."""

import pytest
import torch

import amp
from helpers.models import inject, loss_of, make_model


def test_o2_step_after_a_plain_backward_steps_the_masters(trained):
    model, optimizer = trained("O2", momentum=0.0)
    masters = [m.detach().clone() for m in amp.master_params(optimizer)]
    loss_of(model, 0).backward()
    gradients = [p.grad.float() for p in model.parameters()]
    optimizer.step()
    for master, before, grad in zip(amp.master_params(optimizer), masters, gradients):
        assert torch.equal(master, before - 0.1 * grad)


def test_closures_are_refused():
    model = make_model()
    optimizer = torch.optim.LBFGS(model.parameters())
    amp.initialize(model, optimizer, opt_level="O2", verbosity=0)
    try:
        with pytest.raises(RuntimeError, match="does not support closure"):
            optimizer.step(lambda: loss_of(model, 0))
    finally:
        amp.deinitialize()


@pytest.mark.parametrize("scheduler_first", [False, True])
def test_lr_scheduler_sees_no_overridden_step(recwarn, scheduler_first):
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    if scheduler_first:
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    amp.initialize(model, optimizer, opt_level="O2", verbosity=0)
    try:
        if not scheduler_first:
            scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        for step in range(3):
            with amp.scale_loss(loss_of(model, step), optimizer) as scaled:
                scaled.backward()
                if step == 0:
                    inject(model[0].weight, "inf")  # a skipped first step
            optimizer.step()
            scheduler.step()
        assert optimizer.param_groups[0]["lr"] == 0.1 * 0.5**3
    finally:
        amp.deinitialize()
    assert not [
        w for w in recwarn if "lr_scheduler" in str(w.message) or "overridden" in str(w.message)
    ]
    assert "step" not in vars(optimizer) or getattr(optimizer.step, "_wrapped_by_lr_sched", False)


@pytest.mark.usefixtures("deinitialized")
def test_o2_add_param_group_refuses_a_parameter_an_optimizer_steps_already():
    """torch refuses a parameter in two groups; at O2 the group holds the master, so the cast
    parameter itself must be refused too (it joined as a second group whose hyperparameters were
    ignored, and after deinitialize a step moved it twice). Nothing changes."""
    model = make_model()
    first = torch.optim.SGD(model[0].parameters(), lr=0.1)
    second = torch.optim.SGD(model[2].parameters(), lr=0.1)
    amp.initialize(model, [first, second], opt_level="O2", verbosity=0)
    groups = [list(group["params"]) for group in first.param_groups]
    with pytest.raises(ValueError, match="more than one parameter group"):
        first.add_param_group({"params": [model[0].weight], "lr": 0.5})
    with pytest.raises(ValueError, match="stepped by another optimizer"):
        first.add_param_group({"params": [model[2].bias]})
    assert [list(group["params"]) for group in first.param_groups] == groups
    amp.deinitialize()
    assert sum(p is model[0].weight for g in first.param_groups for p in g["params"]) == 1


class _TwoHeads(torch.nn.Module):
    """A shared body and two heads; `use_b` says whether head b takes part in a step."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body, self.a, self.b = (torch.nn.Linear(4, 4) for _ in range(3))
        self.use_b = True

    def forward(self, x):
        hidden = self.body(x)
        out = self.a(hidden)
        return out + self.b(hidden) if self.use_b else out


def _head_b_moves(opt_level, zero_kwargs):
    model = _TwoHeads()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    if opt_level is not None:
        model, optimizer = amp.initialize(
            model, optimizer, opt_level=opt_level, dtype=torch.bfloat16, verbosity=0
        )
    moves = []
    for step in range(3):
        model.use_b = step == 0  # head b is unused from the second step on (an idle expert)
        optimizer.zero_grad(**zero_kwargs)
        loss = model(torch.randn(8, 4, generator=torch.Generator().manual_seed(step))).float()
        before = model.b.weight.detach().float().clone()
        if opt_level is None:
            loss.square().mean().backward()
        else:
            with amp.scale_loss(loss.square().mean(), optimizer) as scaled:
                scaled.backward()
        optimizer.step()
        moves.append((model.b.weight.detach().float() - before).abs().max().item())
    if opt_level is not None:
        amp.deinitialize()
    return moves


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_a_parameter_unused_in_a_step_moves_as_torch_moves_it(opt_level):
    """With zero_grad(set_to_none=False) torch keeps a zero gradient for a parameter a step does
    not use, so momentum, the moments and weight decay still move it; O2 kept no master gradient
    after a step and left it where it was (0.0 where FP32 moved 0.128 by the third step)."""
    fp32 = _head_b_moves(None, {"set_to_none": False})
    ours = _head_b_moves(opt_level, {"set_to_none": False})
    assert fp32[2] > 0.001 and ours[2] == pytest.approx(fp32[2], rel=0.05)
    # zero_grad(set_to_none=True) (the default): torch leaves the unused parameter alone
    assert _head_b_moves(None, {})[2] == 0.0 == _head_b_moves(opt_level, {})[2]


@pytest.mark.usefixtures("deinitialized")
def test_compact_state_is_made_by_a_step_known_taken_waiting_for_the_device_until_then(monkeypatch):
    """Where the host has not read a step's check yet (a GPU), a plan over compact state would
    make the state of a first step that may be skipped: those steps wait for the check, later
    ones do not."""
    from amp.scaling.device_scale import Check

    waits = []
    arrived = Check.arrived

    def in_flight(self, wait=False):  # as on a GPU: a copy arrives only when waited for
        if wait and not self.learned:
            waits.append(self)
        return arrived(self, wait) if wait else False

    monkeypatch.setattr(Check, "arrived", in_flight)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, dampening=0.5)
    model, optimizer = amp.initialize(
        model,
        optimizer,
        opt_level="O2",
        dtype=torch.bfloat16,
        master_weights="compact",
        verbosity=0,
    )
    counts = []
    for step in range(3):
        optimizer.zero_grad()
        with amp.scale_loss(model(torch.randn(8, 4)).float().square().mean(), optimizer) as s:
            s.backward()
            if step == 0:
                model[0].weight.grad.view(-1)[0] = float("inf")
        optimizer.step()
        made = [set(entry) - {"master_correction"} for entry in optimizer.state.values()]
        counts.append((len(waits), sum(map(bool, made))))
    # skipped: no state but the masters' corrections (from amp.initialize on); the first taken
    # one waited
    assert counts == [(1, 0), (2, 4), (2, 4)]
