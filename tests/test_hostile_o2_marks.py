"""Hostile checks of O2's batched marks (shadows.ParamMarks): what amp writes into the model at a
step is marked in one batch, and a write from outside amp must still reach the FP32 masters
wherever they are read: the next step, amp.master_params, the state dicts, a copy of the model."""

import copy
import io

import pytest
import torch

import amp
from amp._state import amp_state
from amp.weights import shadows


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


def _trained(steps=2, **kwargs):
    model, optimizer = setup(**kwargs)
    for seed in range(steps):
        train_step(model, optimizer, seed=seed)
    return model, optimizer


def test_a_mask_between_backward_and_step_is_taken_exactly_where_it_changed_the_weight():
    """Steady state (the marks batched since the last step): a pruning mask applied between
    backward and step zeroes those masters; every other master keeps its FP32 value, not the
    low-precision one."""
    model, optimizer = _trained(optimizer_class=torch.optim.SGD)
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
    model, optimizer = _trained(optimizer_class=torch.optim.SGD)
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


def two_trained_optimizers():
    """Two O2 models, each with its SGD, after two steps of each: both batches of marks wait."""
    first, second = make_model(0), make_model(1)
    opt_first = torch.optim.SGD(first.parameters(), lr=0.1)
    opt_second = torch.optim.SGD(second.parameters(), lr=0.1)
    (first, second), (opt_first, opt_second) = amp.initialize(
        [first, second], [opt_first, opt_second], opt_level="O2", verbosity=0
    )
    for seed in range(2):
        train_step(first, opt_first, seed=seed)
        train_step(second, opt_second, seed=seed + 10)
    return first, second, opt_first, opt_second


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
    assert len(shadows._lagging) == 2
    with torch.no_grad():
        first[0].weight.mul_(2)
        second[2].bias.mul_(2)
    written = first[0].weight.detach().float(), second[2].bias.detach().float()
    second.state_dict()  # writes both batches into their shadows
    train_step(first, opt_first, seed=20)
    train_step(second, opt_second, seed=21)
    assert torch.equal(optimizer_params(opt_first)[0], written[0])
    assert torch.equal(optimizer_params(opt_second)[3], written[1])


def test_two_optimizers_keep_their_batches_step_after_step(monkeypatch):
    """Each optimizer's step checks its own batch; one finding nothing must not write out the
    other's (they took turns writing each other's out, and every step of both did the full
    per-parameter check)."""
    first, second, opt_first, opt_second = two_trained_optimizers()
    full_checks = []
    original = shadows.sync_params
    monkeypatch.setattr(
        "amp.weights.masters.sync_params", lambda s: full_checks.append(s) or original(s)
    )
    for seed in range(2, 5):
        train_step(first, opt_first, seed=seed)
        train_step(second, opt_second, seed=seed + 10)
    assert full_checks == []
    with torch.no_grad():
        second[0].weight.mul_(2)  # an outside write: that optimizer's step checks in full
    written = second[0].weight.detach().float()
    train_step(first, opt_first, seed=5)
    opt_second.zero_grad()
    assert torch.equal(list(amp.master_params(opt_second))[0], written)
    assert len(full_checks) == 1


def test_deinitialize_with_batched_marks_keeps_a_pending_write_and_initializes_again():
    model, optimizer = _trained(optimizer_class=torch.optim.SGD)
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
    model, optimizer = _trained(optimizer_class=torch.optim.SGD)
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


@pytest.mark.parametrize("how", ["prune.remove", "data assignment"])
def test_a_weight_given_new_data_of_its_shape_is_taken_into_its_master(how):
    """`param.data = tensor` keeps the parameter's version counter, and the shape: the new
    storage is what tells. torch.nn.utils.prune.remove makes a pruning permanent that way; the
    next step copied the unpruned master back into the model."""
    import torch.nn.utils.prune as prune

    model, optimizer = _trained(optimizer_class=torch.optim.SGD)
    weight = model[2].weight
    if how == "prune.remove":
        prune.l1_unstructured(model[2], "weight", amount=0.5)
        train_step(model, optimizer, seed=3)
        prune.remove(model[2], "weight")
        assert model[2].weight is weight
    else:
        weight.data = weight.data.masked_fill(torch.eye(4, dtype=torch.bool), 0.0)
    pruned = weight.detach().float()
    masters = optimizer_params(optimizer)
    assert not torch.equal(masters[2].half().float(), pruned)
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    train_step(model, optimizer, seed=4)
    expected = torch.where(pruned != masters[2].half().float(), pruned, masters[2])
    assert torch.equal(optimizer_params(optimizer)[2], expected)
    assert torch.equal(weight.float(), pruned)
    assert torch.equal(model.state_dict()["2.weight"], expected)


class _Int(int):
    pass


@pytest.mark.parametrize(
    "loss_id",
    [2, -1, -2, True, False, 2**70, -(2**70), 1.0, "0", None, torch.tensor(1), "np.int64"],
)
def test_a_loss_id_that_is_no_int_below_num_losses_is_refused_and_changes_nothing(loss_id):
    """The check was rewritten around an IndexError: bools, negative ids (which a list would
    index from the end), ids too large for an index, and non-ints stay refused, before any
    gradient is taken; an int subclass below num_losses is taken."""
    if loss_id == "np.int64":
        np = pytest.importorskip("numpy")
        loss_id = np.int64(1)
    model, optimizer = setup(optimizer_class=torch.optim.SGD, num_losses=2)
    train_step(model, optimizer)
    loss = model(torch.randn(8, 4)).float().sum()
    loss.backward(retain_graph=True)
    grads = [p.grad.clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=r"num_losses=2, so use 0 to 1"):
        with amp.scale_loss(loss, optimizer, loss_id=loss_id) as scaled:
            scaled.backward()
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads))
    assert not optimizer._amp_record.stash.frames
    optimizer.zero_grad()
    with amp.scale_loss(loss, optimizer, loss_id=_Int(1)) as scaled:
        scaled.backward()
    optimizer.step()
