"""amp's host work per training step does not grow with the number of parameters.

Python calls counted by cProfile: a load-independent figure (no timings in tests).
"""

import cProfile
import os
import pstats

import pytest
import torch

import amp

AMP_DIR = os.path.dirname(amp.__file__)


def make_model(layers):
    torch.manual_seed(0)
    modules = []
    for _ in range(layers):
        modules += [torch.nn.Linear(4, 4), torch.nn.ReLU()]
    return torch.nn.Sequential(*modules)


def amp_calls_per_step(opt_level, layers):
    """Python calls made in amp's own code during one warmed-up training step."""
    model = make_model(layers)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model, optimizer = amp.initialize(
        model, optimizer, opt_level=opt_level, dtype=torch.bfloat16, verbosity=0
    )
    x = torch.randn(8, 4)

    def step():
        optimizer.zero_grad(set_to_none=True)
        loss = model(x).float().square().mean()
        with amp.scale_loss(loss, optimizer) as scaled:
            scaled.backward()
        optimizer.step()

    try:
        for _ in range(3):
            step()
        profile = cProfile.Profile()
        profile.enable()
        step()
        profile.disable()
    finally:
        amp.deinitialize()
    stats = pstats.Stats(profile).stats
    return sum(
        counts[1]
        for (filename, _, _), counts in stats.items()
        if filename.startswith(AMP_DIR)
    )


@pytest.mark.parametrize("opt_level", ["O2", "O3"])
def test_amp_bookkeeping_per_step_is_constant_in_the_parameter_count(opt_level):
    # 4 and 40 parameter tensors: master weights, shadows and gradients are handled in batches.
    assert amp_calls_per_step(opt_level, 2) == amp_calls_per_step(opt_level, 20)


def test_a_write_into_one_parameter_is_taken_into_its_master_alone():
    model = make_model(3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    model, optimizer = amp.initialize(
        model, optimizer, opt_level="O2", dtype=torch.bfloat16, verbosity=0
    )
    try:
        masters = amp.master_params(optimizer)
        before = [master.detach().clone() for master in masters]
        with torch.no_grad():
            model[2].weight.mul_(2)  # a power of two: exact in bfloat16
        loss = model(torch.randn(8, 4)).float().sum()
        with amp.scale_loss(loss, optimizer) as scaled:
            scaled.backward()
        optimizer.step()
        for index, (old, master) in enumerate(zip(before, masters)):
            if index == 2:  # the written weight: its master took the write
                assert torch.equal(master, model[2].weight.float())
                assert not torch.equal(master, old)
            else:  # the others keep their exact FP32 values (lr=0: no step changes them)
                assert torch.equal(master, old)
    finally:
        amp.deinitialize()


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_gradients_are_never_compared_with_equality(monkeypatch, opt_level):
    """`None in grads` or `grads.count(None)` runs Tensor.__eq__ per gradient (some 20 us each):
    amp tests for absent gradients by identity."""
    model = make_model(3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model, optimizer = amp.initialize(
        model, optimizer, opt_level=opt_level, dtype=torch.bfloat16, verbosity=0
    )
    compared = []
    original = torch.Tensor.__eq__

    def counting(self, other):
        compared.append(other)
        return original(self, other)

    try:
        monkeypatch.setattr(torch.Tensor, "__eq__", counting)
        for _ in range(2):  # the second block finds the first one's gradients (accumulation)
            loss = model(torch.randn(8, 4)).float().square().mean()
            with amp.scale_loss(loss, optimizer) as scaled:
                scaled.backward()
        optimizer.step()
        monkeypatch.undo()
        assert compared == []
    finally:
        amp.deinitialize()
