"""The FP32 values a state dict lends for rows without an FP32 tensor (amp/weights/lent.py): exact
masters' (bf16 weights and int16 remainders) and compact ones'. The tensor a state dict hands out
stays in step with the row across steps and writes on either side, as torch's state dict's
tensors are its parameters; reading writes nothing."""

import copy

import pytest
import torch

import amp

pytestmark = pytest.mark.usefixtures("deinitialized")

FORMS = [True, "compact"]


def setup(form):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.Tanh(), torch.nn.Linear(6, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    return amp.initialize(
        model, optimizer, opt_level="O2", dtype=torch.bfloat16, master_weights=form, verbosity=0
    )


def backward(model, optimizer, seed=1):
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(seed))
    with amp.scale_loss(model(x).float().square().mean(), optimizer) as scaled:
        scaled.backward()


def weight(model):
    return model[0].weight.detach().float().clone()


@pytest.mark.parametrize("form", FORMS, ids=["exact", "compact"])
def test_a_state_dict_taken_after_a_step_holds_the_stepped_values(form):
    model, optimizer = setup(form)
    backward(model, optimizer)
    before = model.state_dict()["0.weight"].clone()
    optimizer.step()
    after = model.state_dict()["0.weight"]
    assert not torch.equal(before, after)
    assert torch.equal(after.bfloat16(), model[0].weight.detach())


@pytest.mark.parametrize("form", FORMS, ids=["exact", "compact"])
def test_a_tensor_lent_before_a_step_shows_the_step_and_a_write_into_it_keeps_it(form):
    model, optimizer = setup(form)
    backward(model, optimizer)
    lent = model.state_dict()["0.weight"]
    optimizer.step()
    stepped = weight(model)
    assert torch.equal(lent.bfloat16().float(), stepped)
    lent.mul_(1.0)  # a write that keeps the values (an EMA with decay 1)
    model(torch.randn(2, 8))
    assert torch.equal(weight(model), stepped)


def test_a_write_into_a_lent_tensor_before_a_step_is_stepped_from_as_with_exact_masters():
    results = []
    for form in FORMS:
        model, optimizer = setup(form)
        backward(model, optimizer)
        model.state_dict()["0.weight"].mul_(0.5)
        optimizer.step()
        results.append((weight(model), model.state_dict()["0.weight"].clone()))
        amp.deinitialize()
    (exact_low, exact_fp32), (compact_low, compact_fp32) = results
    assert torch.equal(exact_low, compact_low)
    ulp = torch.finfo(torch.bfloat16).eps * exact_fp32.abs()
    assert ((compact_fp32 - exact_fp32).abs() <= ulp / 128).all()


@pytest.mark.parametrize("form", FORMS, ids=["exact", "compact"])
def test_a_write_to_the_weight_from_outside_is_seen_by_the_next_state_dict(form):
    model, optimizer = setup(form)
    model.state_dict()
    with torch.no_grad():
        model[0].weight.zero_()
    assert not model.state_dict()["0.weight"].any()


def test_deinitialize_takes_a_write_into_a_lent_tensor():
    model, optimizer = setup("compact")
    model.state_dict()["0.weight"].fill_(0.25)
    amp.deinitialize()
    assert model[0].weight.dtype is torch.float32 and (model[0].weight == 0.25).all()


@pytest.mark.parametrize("form", FORMS, ids=["exact", "compact"])
def test_a_load_after_a_write_into_a_lent_tensor_wins(form):
    model, optimizer = setup(form)
    checkpoint = {key: value.clone() for key, value in model.state_dict().items()}
    model.state_dict()["0.weight"].add_(1.0)
    model.load_state_dict(checkpoint)
    model(torch.randn(2, 8))
    assert torch.equal(weight(model), checkpoint["0.weight"].bfloat16().float())


@pytest.mark.parametrize("form", FORMS, ids=["exact", "compact"])
def test_a_state_dict_kept_across_forwards_and_steps_stays_in_step_both_ways(form):
    model, optimizer = setup(form)
    kept = model.state_dict()
    for seed in (1, 2):
        backward(model, optimizer, seed)
        optimizer.step()
        assert torch.equal(kept["0.weight"].bfloat16().float(), weight(model))
    kept["0.weight"].fill_(0.5)
    model(torch.randn(2, 8))
    assert (weight(model) == 0.5).all()


def test_a_lent_tensor_no_one_holds_is_let_go_at_the_next_forward():
    import weakref

    model, optimizer = setup("compact")
    lent = weakref.ref(model.state_dict()["0.weight"])
    assert lent() is not None  # held until its writes are taken
    model(torch.randn(2, 8))
    assert lent() is None


@pytest.mark.parametrize("form", FORMS, ids=["exact", "compact"])
def test_a_write_into_a_lent_tensor_not_yet_taken_is_in_a_checkpoint_taken_before(form):
    """optimizer.state_dict() only reads: the write stays untaken (the model computes with its
    weight until its next forward or step), yet the checkpoint holds the value the state dict
    shows, and loads into a fresh run as it."""
    model, optimizer = setup(form)
    model.state_dict()["0.weight"].fill_(0.5)
    saved_model = {key: value.clone() for key, value in model.state_dict().items()}
    saved_optimizer = copy.deepcopy(optimizer.state_dict())
    assert not (model[0].weight == 0.5).all()  # nothing was taken in by reading
    amp.deinitialize()
    model, optimizer = setup(form)
    model.load_state_dict(saved_model)
    optimizer.load_state_dict(saved_optimizer)
    assert (model[0].weight == 0.5).all()
    assert (model.state_dict()["0.weight"] == 0.5).all()
