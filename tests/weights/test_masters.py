"""O2's FP32 master weights (amp/weights/masters.py): the model is its masters rounded after every
step, master gradients are the unscaled model gradients, new parameter groups get masters, and a
write into the model from outside amp (a broadcast, a mask, a clamp, new data) reaches them."""

import copy

import pytest
import torch

import amp
from helpers.o2 import linear_o2
from helpers import DTYPES
from helpers.models import batch, loss_of, make_model
from helpers.o2 import optimizer_params, train_step, trained_o2
from helpers.state import step_cleanly

pytestmark = pytest.mark.usefixtures("deinitialized")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_o2_master_gradients_are_unscaled_model_gradients(dtype):
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, optimizer, opt_level="O2", dtype=dtype, verbosity=0)
    try:
        reference = copy.deepcopy(model)  # the same low-precision model, no amp
        for hook in list(reference._forward_hooks) + list(reference._forward_pre_hooks):
            reference._forward_hooks.pop(hook, None)
            reference._forward_pre_hooks.pop(hook, None)
        x, y = batch(0)
        ((reference(x.to(dtype)).float() - y) ** 2).mean().backward()
        with amp.scale_loss(loss_of(model, 0), optimizer) as scaled:
            scaled.backward()
        for master, ref in zip(amp.master_params(optimizer), reference.parameters()):
            assert master.grad.dtype is torch.float32
            torch.testing.assert_close(master.grad, ref.grad.float(), rtol=1e-2, atol=1e-3)
        if dtype is torch.bfloat16:  # unscaled in place (exact): the gradients the step reads
            assert all(p.grad.dtype is dtype for p in model.parameters())
        else:  # moved into the FP32 master gradients
            assert all(p.grad is None for p in model.parameters())
    finally:
        amp.deinitialize()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_o2_model_is_masters_rounded_after_every_step(dtype):
    model = make_model(batch_norm=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    fp32_weights = {k: v.clone() for k, v in model.state_dict().items()}
    amp.initialize(model, optimizer, opt_level="O2", dtype=dtype, verbosity=0)
    try:
        state = model.state_dict()
        for key, value in fp32_weights.items():
            assert state[key].dtype is value.dtype and torch.equal(state[key], value)  # exact
        assert model[1].weight.dtype is torch.float32 and model[0].weight.dtype is dtype
        for step in range(3):
            with amp.scale_loss(loss_of(model, step), optimizer) as scaled:
                scaled.backward()
            optimizer.step()
            optimizer.zero_grad()
        masters = list(amp.master_params(optimizer))
        for param, master in zip(model.parameters(), masters):
            assert torch.equal(param, master.to(param.dtype))
        assert torch.equal(model.state_dict()["0.weight"], masters[0])  # the masters, not upcasts
        assert model(batch(0)[0]).dtype is torch.float32
    finally:
        amp.deinitialize()


def test_o2_add_param_group_creates_masters_and_zero_grad():
    model = make_model()
    fp32_weight = model[2].weight.detach().clone()
    optimizer = torch.optim.SGD(model[0].parameters(), lr=0.1, momentum=0.9)
    amp.initialize(model, optimizer, opt_level="O2", verbosity=0)
    try:
        optimizer.add_param_group({"params": model[2].parameters(), "lr": 0.05})
        assert list(optimizer.param_groups[1]["params"]) == list(model[2].parameters())
        masters = list(amp.master_params(optimizer))[2:]
        assert all(m.dtype is torch.float32 for m in masters)
        assert torch.equal(masters[0], fp32_weight)  # the exact FP32 value, kept while frozen
        with pytest.raises(TypeError, match="ordered collections"):
            optimizer.add_param_group({"params": {torch.nn.Parameter(torch.ones(1))}})
        for step in range(2):
            with amp.scale_loss(loss_of(model, step), optimizer) as scaled:
                scaled.backward()
            masters = list(amp.master_params(optimizer))[2:]
            assert all(m.grad is not None for m in masters)
            optimizer.step()
        assert torch.equal(model[2].weight, list(amp.master_params(optimizer))[2].half())
        with amp.scale_loss(loss_of(model, 3), optimizer) as scaled:
            scaled.backward()
        optimizer.zero_grad(set_to_none=False)
        assert all(m.grad is None or not m.grad.any() for m in amp.master_params(optimizer))
    finally:
        amp.deinitialize()


def test_sparse_adam_steps_sparse_master_gradients_at_o2():
    torch.manual_seed(0)
    embedding = torch.nn.Embedding(20, 4, sparse=True)
    reference = copy.deepcopy(embedding)
    optimizer = torch.optim.SparseAdam(embedding.parameters(), lr=0.01)
    reference_optimizer = torch.optim.SparseAdam(reference.parameters(), lr=0.01)
    amp.initialize(embedding, optimizer, opt_level="O2", verbosity=0)
    try:
        tokens = torch.tensor([[1, 2, 2], [7, 1, 0]])
        for _ in range(3):
            with amp.scale_loss(embedding(tokens).float().square().mean(), optimizer) as scaled:
                scaled.backward()
            assert all(m.grad.is_sparse for m in amp.master_params(optimizer))
            optimizer.step()
            optimizer.zero_grad()
            reference(tokens).square().mean().backward()
            reference_optimizer.step()
            reference_optimizer.zero_grad()
        torch.testing.assert_close(embedding.weight.float(), reference.weight, rtol=0, atol=1e-3)
    finally:
        amp.deinitialize()


# -- writes from outside amp -------------------------------------------------------------------------


def test_o2_masters_follow_writes_from_outside_amp():
    """DataParallel's initial broadcast or a user's copy_ write the FP16 model after initialize."""
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, optimizer, opt_level="O2", verbosity=0)
    try:
        with torch.no_grad():
            model[0].weight.copy_(torch.full_like(model[0].weight, 0.25))
        exact = {k: v.clone() for k, v in make_model(3).state_dict().items()}
        with amp.scale_loss(loss_of(model, 0), optimizer) as scaled:
            masters = list(amp.master_params(optimizer))
            assert torch.equal(masters[0], torch.full_like(masters[0], 0.25))
            scaled.backward()
        optimizer.step()
        model.load_state_dict(exact)  # a load is amp's own write: the masters stay exact
        with amp.scale_loss(loss_of(model, 1), optimizer) as scaled:
            for master, key in zip(amp.master_params(optimizer), exact):
                assert torch.equal(master, exact[key])
            scaled.backward()
    finally:
        amp.deinitialize()


def test_o2_keeps_a_write_to_the_model_between_backward_and_step():
    model, optimizer = linear_o2(lr=0.0)
    try:
        with amp.scale_loss(model(torch.randn(3, 4)).float().mean(), optimizer) as scaled:
            scaled.backward()
        with torch.no_grad():
            model.weight.fill_(0.5)  # a mask or a constraint, applied before the step
        optimizer.step()
        assert (model.weight == 0.5).all()
        assert (next(iter(amp.master_params(optimizer))) == 0.5).all()
    finally:
        amp.deinitialize()


def test_a_mask_between_backward_and_step_is_taken_exactly_where_it_changed_the_weight():
    """Steady state (the marks batched since the last step): a pruning mask applied between
    backward and step zeroes those masters; every other master keeps its FP32 value, not the
    low-precision one."""
    model, optimizer = trained_o2(optimizer_class=torch.optim.SGD)
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    before = optimizer_params(optimizer)[2]
    assert not torch.equal(before, before.half().float())  # FP32 digits the model lacks
    mask = (torch.arange(16).reshape(4, 4) % 2).bool()
    optimizer.zero_grad()
    loss = model(torch.randn(8, 4)).float().square().mean()
    with amp.scale_loss(loss, optimizer) as scaled:
        scaled.backward()
    with torch.no_grad():
        model[2].weight.masked_fill_(mask, 0.0)
    optimizer.step()
    master = optimizer_params(optimizer)[2]
    assert torch.equal(master, before.masked_fill(mask, 0.0))
    assert torch.equal(model[2].weight, master.half())


def test_a_write_after_a_skipped_step_shows_in_master_params_and_is_stepped_from():
    """The check for outside writes runs at step() and in amp.master_params: a write followed by
    a skipped step is in the masters amp.master_params yields, and the next step starts from it."""
    model, optimizer = trained_o2(optimizer_class=torch.optim.SGD)
    with torch.no_grad():
        model[0].weight.mul_(0.5)  # a power of two: exact in FP16
    written = model[0].weight.detach().float()
    train_step(model, optimizer, seed=5, scale=1e30)  # FP16 gradients overflow: skipped
    assert amp.last_overflow() is not None
    assert torch.equal(list(amp.master_params(optimizer))[0].detach(), written)
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    train_step(model, optimizer, seed=6)
    assert torch.equal(optimizer_params(optimizer)[0], written)


@pytest.mark.parametrize("how", ["prune.remove", "data assignment"])
def test_a_weight_given_new_data_of_its_shape_is_taken_into_its_master(how):
    """`param.data = tensor` keeps the parameter's version counter, and the shape: the new
    storage is what tells. torch.nn.utils.prune.remove makes a pruning permanent that way; the
    next step copied the unpruned master back into the model."""
    import torch.nn.utils.prune as prune

    model, optimizer = trained_o2(optimizer_class=torch.optim.SGD)
    weight = model[2].weight
    if how == "prune.remove":
        prune.l1_unstructured(model[2], "weight", amount=0.5)
        train_step(model, optimizer, seed=3)
        masters = optimizer_params(optimizer)
        prune.remove(model[2], "weight")
        assert model[2].weight is weight
    else:
        masters = optimizer_params(optimizer)
        weight.data = weight.data.masked_fill(torch.eye(4, dtype=torch.bool), 0.0)
    pruned = weight.detach().float()
    assert not torch.equal(masters[2].half().float(), pruned)
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    train_step(model, optimizer, seed=4)
    expected = torch.where(pruned != masters[2].half().float(), pruned, masters[2])
    assert torch.equal(optimizer_params(optimizer)[2], expected)
    assert torch.equal(weight.float(), pruned)
    assert torch.equal(model.state_dict()["2.weight"], expected)


def test_a_value_preserving_clamp_keeps_the_fp32_masters():
    masters = {}
    for clamp in (False, True):
        model = make_model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        amp.initialize(model, optimizer, opt_level="O2", verbosity=0)
        try:
            for step in range(3):
                if clamp:
                    with torch.no_grad():
                        for param in model.parameters():
                            param.clamp_(-10, 10)  # WGAN weight clipping that clips nothing
                step_cleanly(model, optimizer, step)
            masters[clamp] = [m.detach().clone() for m in amp.master_params(optimizer)]
        finally:
            amp.deinitialize()
    assert all(torch.equal(a, b) for a, b in zip(masters[False], masters[True]))
    assert not all(torch.equal(m, m.half().float()) for m in masters[True])  # still FP32
