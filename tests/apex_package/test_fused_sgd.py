"""apex.optimizers.FusedSGD under amp, checked as apex's own amp tests checked it
(tests/L0/run_amp/test_fused_sgd.py): several models, losses and optimizers whose parameter groups
each set their own lr (so FusedSGD gets no `lr`), at O0-O3, with one or two loss scalers, the
gradients zeroed three ways, and an inf put into one gradient of one backward. The gradients amp
hands the optimizer on every step that is not skipped, and the weights at the end, must be those
of plain torch.optim.SGD in FP32 that skips the same optimizers' steps.

Written for this repository. apex's models held one FP16 weight (`cast_model_type=False` with
`allow_incoming_model_not_fp32`); amp takes FP32 models, so both weights start FP32 here and
O2/O3 cast them. The values are small dyadic numbers, exact in float16."""

import dataclasses
import itertools

import pytest
import torch
from apex.optimizers import FusedSGD
from torch import nn

import amp
from helpers import OPT_LEVELS


class TwoWeights(nn.Module):
    def __init__(self, unique):
        super().__init__()
        self.weight0 = nn.Parameter(unique + torch.arange(2, dtype=torch.float32))
        self.weight1 = nn.Parameter(1.0 + unique + torch.arange(2, dtype=torch.float32))

    def forward(self, x):
        return ((x * self.weight0.float()) * self.weight1.float()).sum()


@dataclasses.dataclass(frozen=True)
class Setup:
    """models: how many; optimizers: per optimizer, its groups as (model, lr) and its momentum;
    losses: per loss, the models summed into it and the optimizers its scale_loss is given."""

    models: int
    optimizers: tuple
    losses: tuple


SETUPS = {
    "2models2losses1optimizer": Setup(
        2, ((((0, 0.25), (1, 0.5)), 0.125),), (((0,), (0,)), ((1,), (0,)))
    ),
    "3models2losses1optimizer": Setup(
        3, ((((0, 0.25), (1, 0.5), (2, 0.125)), 0.125),), (((0, 2), (0,)), ((1, 2), (0,)))
    ),
    "2models2losses2optimizers": Setup(
        2, ((((0, 0.25),), 0.125), (((1, 0.5),), 0.25)), (((0,), (0,)), ((1,), (1,)))
    ),
    "3models2losses2optimizers": Setup(
        3,
        ((((0, 0.25), (1, 1.0)), 0.5), (((2, 0.5),), 0.25)),
        (((0, 1), (0,)), ((2, 1), (0, 1))),
    ),
}


def _build(setup, optimizer_class, **options):
    models = [TwoWeights(unique) for unique in range(1, setup.models + 1)]
    optimizers = [
        optimizer_class(
            [{"params": models[m].parameters(), "lr": lr} for m, lr in groups],
            momentum=momentum,
            **options,
        )
        for groups, momentum in setup.optimizers
    ]
    return models, optimizers


def _params(models):
    return [p for model in models for p in model.parameters()]


def _reference(setup, x, skip_at, skipped):
    """FP32 torch.optim.SGD for `iterations`, stepping no optimizer in `skipped` at iteration
    `skip_at`: the gradients of every step taken, and the final weights."""
    models, optimizers = _build(setup, torch.optim.SGD)
    gradients = []
    for i in range(3 if skip_at >= 0 else 2):
        for optimizer in optimizers:
            optimizer.zero_grad()
        for model_indices, _ in setup.losses:
            sum(models[m](x) for m in model_indices).backward()
        if i != skip_at:
            gradients.append([p.grad.clone() for p in _params(models)])
        for index, optimizer in enumerate(optimizers):
            if i != skip_at or index not in skipped:
                optimizer.step()
    return gradients, [p.detach().clone() for p in _params(models)]


def _injections(setup, opt_level):
    """(iteration, loss, model, weight) to put an inf into; apex injected at O1 and O2, where the
    loss scale is dynamic. (-1, ...) is the clean run."""
    yield -1, None, None, None
    if opt_level not in ("O1", "O2"):
        return
    for iteration, loss in itertools.product((0, 1), range(len(setup.losses))):
        for model, weight in itertools.product(setup.losses[loss][0], ("weight0", "weight1")):
            yield iteration, loss, model, weight


def _zero(how, models, optimizers):
    for model in models:
        for p in model.parameters():
            if how == "none":
                p.grad = None
    if how == "model":
        for model in models:
            model.zero_grad()
    elif how == "optimizer":
        for optimizer in optimizers:
            optimizer.zero_grad()


def _train_and_check(setup, opt_level, x, how_to_zero, losses_scaled, injection, materialize):
    inject_at, inject_loss, inject_model, inject_weight = injection
    skipped = set(setup.losses[inject_loss][1]) if inject_at >= 0 else set()
    expected_grads, expected_final = _reference(setup, x, inject_at, skipped)
    models, optimizers = _build(setup, FusedSGD, materialize_master_grads=materialize)
    models, optimizers = amp.initialize(
        models, optimizers, opt_level=opt_level, num_losses=losses_scaled, verbosity=0
    )
    try:
        amp._amp_state.loss_scalers[0]._loss_scale = 4.0
        if losses_scaled == 2:
            amp._amp_state.loss_scalers[1]._loss_scale = 16.0
        taken = 0
        for i in range(len(expected_grads) + (inject_at >= 0)):
            _zero(how_to_zero, models, optimizers)
            for loss_index, (model_indices, optimizer_indices) in enumerate(setup.losses):
                loss = sum(models[m](x) for m in model_indices)
                chosen = [optimizers[o] for o in optimizer_indices]
                loss_id = loss_index if losses_scaled == 2 else 0
                with amp.scale_loss(loss, chosen, loss_id=loss_id) as scaled_loss:
                    scaled_loss.backward()
                    if i == inject_at and loss_index == inject_loss:
                        getattr(models[inject_model], inject_weight).grad[0] = float("inf")
            if i != inject_at:
                masters = [p for o in optimizers for p in amp.master_params(o)]
                for master, expected in zip(masters, expected_grads[taken]):
                    torch.testing.assert_close(master.grad.float(), expected)
                taken += 1
            for optimizer in optimizers:
                optimizer.step()
        masters = [p for o in optimizers for p in amp.master_params(o)]
        for param, master, expected in zip(_params(models), masters, expected_final):
            torch.testing.assert_close(param.float(), expected)
            torch.testing.assert_close(param, master.to(param.dtype))
    finally:
        amp.deinitialize()


# apex's no-op arguments are passed on purpose: ApexCompatWarning is tested in
# test_ignored_arguments.py (in a fresh process: it warns once per argument and process).
@pytest.mark.filterwarnings("ignore::apex.ApexCompatWarning")
@pytest.mark.parametrize("opt_level", OPT_LEVELS)
@pytest.mark.parametrize("setup", list(SETUPS))
def test_fused_sgd_with_an_lr_per_group_trains_as_torch_sgd_skipping_what_overflowed(
    setup, opt_level
):
    x = torch.ones(2)
    # Every way of zeroing with one and two scalers for the clean run; each injection takes the
    # next of these in turn (apex ran the whole product: 12 times as long, for the same paths).
    ways = list(itertools.product(("none", "model", "optimizer"), (1, 2)))
    runs = [(-1, None, None, None)] * len(ways) + list(_injections(SETUPS[setup], opt_level))[1:]
    for k, injection in enumerate(runs):
        how_to_zero, losses_scaled = ways[k % len(ways)]
        _train_and_check(
            SETUPS[setup], opt_level, x, how_to_zero, losses_scaled, injection, k % 2 == 0
        )


def test_fused_sgd_needs_lr_only_for_a_group_without_one():
    a, b = torch.ones(2, requires_grad=True), torch.ones(2, requires_grad=True)
    optimizer = FusedSGD([{"params": [a], "lr": 0.25}, {"params": [b], "lr": 0.5}])
    assert [group["lr"] for group in optimizer.param_groups] == [0.25, 0.5]
    with pytest.raises(ValueError, match="group 1 didn't specify .* lr"):
        FusedSGD([{"params": [a], "lr": 0.25}, {"params": [b]}])
    with pytest.raises(ValueError, match="group 0 didn't specify .* lr"):
        FusedSGD([a])
    with pytest.raises(ValueError, match="didn't specify .* lr"):
        optimizer.add_param_group({"params": [torch.ones(1, requires_grad=True)]})
    assert FusedSGD([a], 0.1).param_groups[0]["lr"] == 0.1  # apex's positional lr
