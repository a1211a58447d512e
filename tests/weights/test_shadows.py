"""O2's shadows of the model's parameters (amp/weights/shadows.py): what amp writes into the model
at a step is marked in one batch, and a write from outside amp still reaches the FP32 masters
wherever they are read (the next step, amp.master_params, the state dicts, a copy of the model),
with host work that does not grow with the number of parameters."""

import cProfile
import copy
import pstats
import weakref

import pytest
import torch

import amp
from amp.weights import table
from helpers.models import make_stack
from helpers.o2 import optimizer_params, saved, train_step, trained_o2, two_trained_optimizers
from helpers.profiling import AMP_DIR

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


def _o2_stepped(lr):
    """An O2 model and its SGD after one step (its marks batched)."""
    model = make_stack(3)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    model, optimizer = amp.initialize(
        model, optimizer, opt_level="O2", dtype=torch.bfloat16, verbosity=0
    )
    _o2_step(model, optimizer)
    return model, optimizer


def _o2_step(model, optimizer):
    loss = model(torch.randn(8, 4)).float().sum()
    with amp.scale_loss(loss, optimizer) as scaled:
        scaled.backward()
    optimizer.step()


def test_after_a_step_the_state_dict_and_the_masters_keep_the_fp32_values():
    """After a step amp marks its own write into the model in one batch; read back, the batch
    is what marks made one by one give: no parameter is taken for written from outside, so the
    state dict and the masters keep the FP32 values (not the model's rounded ones), and a step
    that changes nothing leaves them bit for bit."""
    model, optimizer = _o2_stepped(lr=0.1)
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
        _o2_step(model, optimizer)
        assert all(torch.equal(a, b) for a, b in zip(amp.master_params(optimizer), masters))
        assert all(torch.equal(a, b) for a, b in zip(optimizer_params(optimizer), masters))
    finally:
        amp.deinitialize()


@pytest.mark.parametrize("where", ["state_dict", "next step"])
def test_a_write_into_the_model_after_a_step_wins_over_the_batched_marks(where):
    """A write into a model parameter after the step (its marks still batched) is taken into the
    master, by a state dict or by the next step; it is never overwritten from the master."""
    model, optimizer = _o2_stepped(lr=0.0)
    try:
        with torch.no_grad():
            model[2].weight.mul_(2)  # a power of two: exact in bfloat16
        written = model[2].weight.detach().clone()
        if where == "state_dict":
            assert torch.equal(model.state_dict()["2.weight"], written.float())
        else:
            _o2_step(model, optimizer)  # lr=0: the master keeps what it took
        assert torch.equal(model[2].weight, written)
        masters = list(amp.master_params(optimizer))
        assert torch.equal(masters[2], written.float())
    finally:
        amp.deinitialize()


# -- two optimizers, deinitialize, conflicts, copies ---------------------------------------------------


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


def optimizer_params_live(optimizer):
    return [p for group in optimizer.param_groups for p in group["params"]]


def test_two_optimizers_keep_their_batches_step_after_step(monkeypatch):
    """Each optimizer's step checks its own table; one finding nothing must not look at the
    other's row by row (they took turns writing each other's out, and every step of both did the
    full per-parameter check)."""
    first, second, opt_first, opt_second = two_trained_optimizers()
    rows_checked = []
    original = table.ParamTable.sync_row
    monkeypatch.setattr(
        table.ParamTable,
        "sync_row",
        lambda self, row: rows_checked.append((self, row)) or original(self, row),
    )
    for seed in range(2, 5):
        train_step(first, opt_first, seed=seed)
        train_step(second, opt_second, seed=seed + 10)
    assert rows_checked == []
    with torch.no_grad():
        second[0].weight.mul_(2)  # an outside write: that optimizer's step checks in full
    written = second[0].weight.detach().float()
    train_step(first, opt_first, seed=5)
    opt_second.zero_grad()
    assert torch.equal(list(amp.master_params(opt_second))[0], written)
    checked = [checked_table.masters[row] for checked_table, row in rows_checked]
    assert list(map(id, checked)) == list(map(id, optimizer_params_live(opt_second)))


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


class _Masked(torch.nn.Module):
    """A Linear and two FP32 buffers: a causal mask (0 and -inf, exact in low precision) and a
    table of thirds (not exact)."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)
        self.register_buffer("mask", torch.triu(torch.full((4, 4), float("-inf")), 1))
        self.register_buffer("thirds", torch.arange(4.0) / 3)

    def forward(self, x):
        return self.linear(x) + self.mask.nan_to_num(-1.0).sum(0) + self.thirds


@pytest.mark.parametrize("opt_level", ["O2", "O3"])
def test_a_buffer_held_exactly_in_low_precision_is_held_once(opt_level):
    """O2/O3 release the FP32 original of a buffer whose values the low precision holds bit for
    bit; the state dict and deinitialize give its FP32 values back (the original object), and a
    buffer that is not exact keeps its FP32 copy."""
    model = _Masked()
    # Weak references: a strong one would hold the buffer, which amp then leaves as it is.
    mask, thirds = weakref.ref(model.mask), weakref.ref(model.thirds)
    originals = {"mask": model.mask.clone(), "thirds": model.thirds.clone()}
    model = amp.initialize(model, opt_level=opt_level, dtype=torch.bfloat16, verbosity=0)
    assert model.mask.dtype is torch.bfloat16
    assert mask().untyped_storage().nbytes() == 0 and thirds().untyped_storage().nbytes() > 0
    state = model.state_dict()
    for name, value in originals.items():
        assert state[name].dtype is torch.float32 and torch.equal(state[name], value)
    amp.deinitialize()
    assert model.mask is mask() and model.thirds is thirds()
    for name, value in originals.items():
        assert torch.equal(getattr(model, name), value)


@pytest.mark.parametrize("loaded", [1 / 3, 0.5], ids=["inexact", "exact"])
def test_a_write_into_an_exact_buffer_or_a_load_into_it_keeps_the_fp32_values(loaded):
    models = [_Masked(), _Masked()]
    original = weakref.ref(models[1].mask)
    models = amp.initialize(models, opt_level="O2", dtype=torch.bfloat16, verbosity=0)
    models[0].mask.fill_(2.0)  # the model writes its low-precision buffer
    assert torch.equal(models[0].state_dict()["mask"], torch.full((4, 4), 2.0))
    state = {**_Masked().state_dict(), "mask": torch.full((4, 4), loaded)}
    models[1].load_state_dict(state)
    # Values the low precision holds need no FP32 copy; others are kept in the original.
    assert (original().untyped_storage().nbytes() == 0) == (loaded == 0.5)
    assert torch.equal(models[1].state_dict()["mask"], state["mask"])
    amp.deinitialize()
    assert torch.equal(models[0].mask, torch.full((4, 4), 2.0))
    assert torch.equal(models[1].mask, state["mask"])


def test_a_buffer_two_modules_share_comes_back_shared_with_its_values():
    shared = torch.zeros(3)
    first, second = torch.nn.Linear(3, 3), torch.nn.Linear(3, 3)
    first.register_buffer("offset", shared)
    second.register_buffer("offset", shared)
    model = torch.nn.Sequential(first, second)
    model = amp.initialize(model, opt_level="O2", dtype=torch.bfloat16, verbosity=0)
    assert torch.equal(model[1].offset, torch.zeros(3, dtype=torch.bfloat16))
    amp.deinitialize()
    assert model[0].offset is shared and model[1].offset is shared
    assert torch.equal(shared, torch.zeros(3))


def test_a_copy_of_a_model_with_an_exact_buffer_gives_its_fp32_values():
    model = amp.initialize(_Masked(), opt_level="O2", dtype=torch.bfloat16, verbosity=0)
    expected = _Masked().mask
    for copied in (copy.deepcopy(model), _pickled(model)):
        assert torch.equal(copied.state_dict()["mask"], expected)


def _pickled(model):
    import io

    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


class _Sharing(torch.nn.Module):
    """A Linear and a batch norm (kept FP32 at O2) holding one exact buffer, and an alias of it."""

    def __init__(self, alias=False):
        super().__init__()
        scale = torch.ones(4)
        self.linear, self.norm = torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4)
        self.linear.register_buffer("scale", scale)
        self.norm.register_buffer("scale", scale)
        self.alias = scale if alias else None

    def forward(self, x):
        scale = self.alias if self.alias is not None else self.norm.scale
        return self.norm(self.linear(x) * self.linear.scale) * scale.to(x.dtype)


@pytest.mark.parametrize("alias", [False, True], ids=["batch-norm", "alias"])
def test_an_exact_buffer_something_else_holds_keeps_its_memory(alias):
    """Released, the buffer would be empty for the module kept FP32 or for the alias."""
    model = amp.initialize(_Sharing(alias), opt_level="O2", dtype=torch.bfloat16, verbosity=0)
    assert model.norm.scale.shape == (4,) and model.norm.scale.dtype is torch.float32
    if alias:
        assert torch.equal(model.alias, torch.ones(4))
    assert model(torch.randn(3, 4)).shape == (3, 4)


def test_an_exact_buffer_two_models_share_keeps_its_memory():
    first, second = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    shared = torch.ones(4)
    first.register_buffer("mask", shared)
    second.register_buffer("mask", shared)
    del shared
    models = amp.initialize([first, second], opt_level="O2", dtype=torch.bfloat16, verbosity=0)
    for model in models:
        assert torch.equal(model.state_dict()["mask"], torch.ones(4))


def test_an_exact_buffer_replaced_after_initialize_comes_back_as_the_new_value():
    model = _Masked()
    original = weakref.ref(model.mask)
    model = amp.initialize(model, opt_level="O2", dtype=torch.bfloat16, verbosity=0)
    model.mask = torch.full((4, 4), 3.0, dtype=torch.bfloat16)
    assert torch.equal(model.state_dict()["mask"], torch.full((4, 4), 3.0))
    amp.deinitialize()
    assert torch.equal(model.mask, torch.full((4, 4), 3.0)) and model.mask is not original()


def test_an_exact_buffer_on_memory_torch_does_not_own_keeps_it():
    """A buffer on numpy's memory stays shared with the array through initialize and after."""
    import numpy

    array = numpy.array([0.0, 1.0, 2.0, 4.0], dtype=numpy.float32)
    model = torch.nn.Linear(4, 4)
    model.register_buffer("offset", torch.from_numpy(array))
    del array  # only the buffer holds it now
    model = amp.initialize(model, opt_level="O2", dtype=torch.bfloat16, verbosity=0)
    amp.deinitialize()
    assert model.offset.untyped_storage().resizable() is False  # still numpy's


@pytest.mark.parametrize("where", ["meta", "fake"])
def test_buffers_without_values_are_cast_and_kept_as_before(where):
    """A model on the meta device or made under FakeTensorMode (device_work.py counts real sizes
    so) has no values to compare: its buffers keep their FP32 shadows."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    if where == "meta":
        with torch.device("meta"):
            model = _Masked()
        model = amp.initialize(model, opt_level="O2", dtype=torch.bfloat16, verbosity=0)
        assert model.mask.dtype is torch.bfloat16 and model.mask.is_meta
        return
    with FakeTensorMode():
        model = amp.initialize(_Masked(), opt_level="O2", dtype=torch.bfloat16, verbosity=0)
        assert model.mask.dtype is torch.bfloat16
        assert model.state_dict()["mask"].dtype is torch.float32
