"""Registration (amp/casting/registration.py): amp.register_*_function and the decorators put a
function under a policy, over the tables, for regions and O1 alike."""

import types

import pytest
import torch

import amp
from helpers.models import make_model


def test_decorators(registrations):
    @amp.half_function
    def half(a, b):
        return a + b

    @amp.float_function
    def full(a):
        return a * 2

    @amp.promote_function
    def widest(a, b):
        return a + b

    f, h = torch.randn(3), torch.randn(3, dtype=torch.float16)
    assert half(f, f).dtype is torch.float32  # outside a region: untouched
    with amp.autocast():
        assert half(f, f).dtype is torch.float16
        assert full(h).dtype is torch.float32
        assert widest(h, h).dtype is torch.float16 and widest(h, f).dtype is torch.float32
    assert half.__name__ == "half" and half.__wrapped__ is not None


def test_register_functions_override_the_tables_and_survive_deinitialize(registrations):
    x = torch.randn(3, 3)
    amp.register_float_function(torch, "mm")
    amp.register_half_function(torch, "sigmoid")
    with amp.autocast():
        assert torch.mm(x, x).dtype is torch.float32
        assert torch.sigmoid(x).dtype is torch.float16
    model = torch.nn.Linear(3, 3)
    amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), verbosity=0)
    assert torch.sigmoid(x).dtype is torch.float16
    amp.deinitialize()
    with amp.autocast():
        assert torch.sigmoid(x).dtype is torch.float16


def test_registration_while_patched_applies_at_once(registrations):
    x = torch.randn(3)
    with amp.autocast():
        assert torch.sigmoid(x).dtype is torch.float32
        amp.register_half_function(torch, "sigmoid")
        assert torch.sigmoid(x).dtype is torch.float16


def test_registration_errors(registrations):
    with pytest.raises(ValueError, match="No function named nope in module"):
        amp.register_half_function(torch, "nope")
    with pytest.raises(TypeError, match="string"):
        amp.register_float_function(torch, 3)
    with pytest.raises(TypeError, match="callable"):
        amp.half_function(3)


def test_a_registration_of_a_function_rules_its_c_binding_too(registrations):
    amp.register_half_function(torch.nn.functional, "mse_loss")
    x = torch.randn(4, 4)
    with amp.autocast(dtype=torch.bfloat16):
        assert torch._C._nn.mse_loss(x, x).dtype is torch.bfloat16
    amp.deinitialize()


def test_a_function_of_an_unhashable_namespace_can_be_registered(registrations):
    namespace = types.SimpleNamespace(scale=lambda x: x * 2)
    amp.register_half_function(namespace, "scale")
    amp.initialize(make_model(), opt_level="O1", verbosity=0)
    try:
        assert namespace.scale(torch.ones(2)).dtype is torch.float16
    finally:
        amp.deinitialize()
