"""The optimizer's table (amp/weights/table.py): what amp writes into the model at a step is marked
in one batch, a write from outside amp still reaches the FP32 masters wherever they are read
(the next step, amp.master_params, the state dicts), the FP32 side wins a conflict, and the host
work does not grow with the number of parameters."""

import cProfile
import functools
import pstats

import pytest
import torch

import amp
from amp.weights.table import ParamTable, find
from helpers.models import make_stack
from helpers.o2 import (
    one_step,
    optimizer_params,
    stepped_stack,
    train_step,
    trained_o2,
    two_trained_optimizers,
)
from helpers.profiling import AMP_DIR, profile_calls

pytestmark = pytest.mark.usefixtures("deinitialized")


def amp_calls_per_step(opt_level, layers):
    """Python calls made in amp's own code during one warmed-up training step."""
    model = make_stack(layers)
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
        counts[1] for (filename, _, _), counts in stats.items() if filename.startswith(AMP_DIR)
    )


@pytest.mark.parametrize("opt_level", ["O2", "O3"])
def test_amp_bookkeeping_per_step_is_constant_in_the_parameter_count(opt_level):
    # 4 and 40 parameter tensors: master weights, shadows and gradients are handled in batches.
    assert amp_calls_per_step(opt_level, 2) == amp_calls_per_step(opt_level, 20)


def test_a_write_into_one_parameter_is_taken_into_its_master_alone():
    model = make_stack(3)
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


@pytest.mark.parametrize("where", ["state_dict", "next step"])
def test_a_write_into_the_model_after_a_step_wins_over_the_batched_marks(where):
    """A write into a model parameter after the step (its marks still batched) is taken into the
    master, by a state dict or by the next step; it is never overwritten from the master."""
    model, optimizer = stepped_stack(lr=0.0)
    try:
        with torch.no_grad():
            model[2].weight.mul_(2)  # a power of two: exact in bfloat16
        written = model[2].weight.detach().clone()
        if where == "state_dict":
            assert torch.equal(model.state_dict()["2.weight"], written.float())
        else:
            one_step(model, optimizer)  # lr=0: the master keeps what it took
        assert torch.equal(model[2].weight, written)
        masters = list(amp.master_params(optimizer))
        assert torch.equal(masters[2], written.float())
    finally:
        amp.deinitialize()


# -- two optimizers, deinitialize, conflicts -------------------------------------------------------


def test_writes_into_two_optimizers_models_survive_one_flush_of_both_batches():
    """Two optimizers' loads (a resume) leave two batches of marks waiting; a state dict of one
    model writes both into their shadows. A write into each model made before that (a broadcast
    after the resume) is still taken into its own masters at its next step, exactly."""
    first, second, opt_first, opt_second = two_trained_optimizers()
    states = [optimizer.state_dict() for optimizer in (opt_first, opt_second)]
    for optimizer, state in zip((opt_first, opt_second), states):
        for group in state["param_groups"]:
            group["lr"] = 0.0
        optimizer.load_state_dict(state)  # amp's own write into the model: marked in a batch
    with torch.no_grad():
        first[0].weight.mul_(2)
        second[2].bias.mul_(2)
    written = first[0].weight.detach().float(), second[2].bias.detach().float()
    second.state_dict()  # writes both batches into their shadows
    train_step(first, opt_first, seed=20)
    train_step(second, opt_second, seed=21)
    assert torch.equal(optimizer_params(opt_first)[0], written[0])
    assert torch.equal(optimizer_params(opt_second)[3], written[1])


def test_two_optimizers_keep_their_batches_step_after_step():
    """Each optimizer's step checks its own table; one finding nothing must not look at the
    other's row by row (they took turns writing each other's out, and every step of both did the
    full per-parameter check). A step of the first costs the same amp calls whether or not the
    second's model was written; the second's next read takes the write in."""
    first, second, opt_first, opt_second = two_trained_optimizers()
    steady = [
        profile_calls(functools.partial(train_step, first, opt_first, seed=seed))[0]
        for seed in (2, 3)
    ]
    assert steady[0] == steady[1]
    with torch.no_grad():
        second[0].weight.mul_(2)  # an outside write: that optimizer's step checks in full
    written = second[0].weight.detach().float()
    assert profile_calls(lambda: train_step(first, opt_first, seed=5))[0] == steady[0]
    opt_second.zero_grad()
    assert torch.equal(list(amp.master_params(opt_second))[0], written)


def test_deinitialize_with_batched_marks_keeps_a_pending_write_and_initializes_again():
    model, optimizer = trained_o2(optimizer_class=torch.optim.SGD)
    masters = optimizer_params(optimizer)
    mask = torch.eye(4, dtype=torch.bool)
    with torch.no_grad():
        model[0].weight.masked_fill_(mask, 0.0)
    amp.deinitialize()
    assert model[0].weight.dtype is torch.float32
    assert torch.equal(model[0].weight.detach(), masters[0].masked_fill(mask, 0.0))
    assert torch.equal(model[2].weight.detach(), masters[2])
    model, optimizer = amp.initialize(model, optimizer, opt_level="O2", verbosity=0)
    train_step(model, optimizer, seed=7)
    with torch.no_grad():
        model[2].weight.mul_(0.5)
    written = model[2].weight.detach().float()
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    train_step(model, optimizer, seed=8)
    assert torch.equal(optimizer_params(optimizer)[2], written)


def test_a_conflict_with_batched_marks_is_won_by_the_fp32_side():
    """A held state dict written while the model parameter was written too: the FP32 value
    reaches the model before the next forward and stays the master's."""
    model, optimizer = trained_o2(optimizer_class=torch.optim.SGD)
    held = model.state_dict()
    train_step(model, optimizer, seed=3)  # the marks batched again
    with torch.no_grad():
        model[0].weight.mul_(2)
        held["0.weight"].fill_(0.25)
    model(torch.randn(2, 4))
    assert torch.equal(model[0].weight, torch.full((4, 4), 0.25, dtype=torch.float16))
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    train_step(model, optimizer, seed=4)
    assert torch.equal(optimizer_params(optimizer)[0], torch.full((4, 4), 0.25))


# -- the table's own facts -------------------------------------------------------------------


def _rows():
    """A table with two master rows (a, b) beside a plain FP32 parameter, and its groups."""
    table = ParamTable()
    a, b = (torch.nn.Parameter(torch.randn(3).bfloat16()) for _ in range(2))
    masters = [torch.nn.Parameter(p.detach().float()) for p in (a, b)]
    for model_param, master in zip((a, b), masters):
        table.add_master(model_param, master)
    plain = torch.nn.Parameter(torch.randn(2))
    return table, (a, b), masters, plain, [{"params": [masters[0], plain]}, {"params": [masters[1]]}]


def test_the_table_knows_which_parameters_are_masters_and_of_what():
    table, (a, b), (ma, mb), plain, groups = _rows()
    assert table.models_of([mb, plain, ma]) == [b, None, a]
    assert table.plain_params(groups) == [plain]
    assert table.grad_holders(groups) == [plain, a, b]
    assert find(b, [ParamTable(frozen=True), table]) == (table, 1)
    assert find(plain, [table]) == (None, None)
    assert table.pop_master(a) == (ma, None)
    assert table.models_of([ma, mb]) == [None, b] and find(b, [table]) == (table, 0)


def test_the_table_names_a_parameter_by_its_place_in_the_model_or_in_the_groups():
    table, (a, b), (ma, mb), plain, groups = _rows()
    module = torch.nn.Module()
    module.register_parameter("weight", a)
    table.anchor([a, plain, b], {id(a): (module._parameters, "weight", "layer.weight", a, module)})
    assert table.name_of(ma, groups) == "layer.weight"  # a master: its model parameter's name
    assert table.name_of(mb, groups) == "param_groups[1]['params'][0]"
    assert table.name_of(plain, groups) == "param_groups[0]['params'][1]"
    assert table.in_place()
    module.weight = torch.nn.Parameter(torch.zeros(3))  # replaced: no longer where it was
    assert not table.in_place()


def test_writing_the_models_rounds_the_masters_marks_and_drops_their_gradients():
    table, (a, b), masters, _, _ = _rows()
    table.mark()
    with torch.no_grad():
        for master in masters:
            master.add_(1 / 3)
            master.grad = torch.ones_like(master)
    assert not table.unchanged()  # the masters were written
    table.write_models()
    assert all(torch.equal(p, m.to(torch.bfloat16)) for p, m in zip((a, b), masters))
    assert table.unchanged() and all(m.grad is None for m in masters)
