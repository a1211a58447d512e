"""The FP32 values of a model's cast buffers (amp/weights/buffers.py): a buffer the low precision
holds exactly is held once, its FP32 values come back in state dicts, loads, copies and
deinitialize, and its memory is released only where nothing else holds it."""

import copy
import weakref

import pytest
import torch

import amp

pytestmark = pytest.mark.usefixtures("deinitialized")


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
