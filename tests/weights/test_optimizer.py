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
