"""The eager FP8 linear (float8_eager.Float8LinearEager) against the traced one
(float8.Float8Linear, what torch.compile runs; test_float8_numerics.py holds it to torchao): the
same bits, with FP8 layouts saved for backward instead of the input, on torch operations and on
the float8*.cu kernels (the emulated grid)."""

import pytest
import torch

from amp.casting import float8, float8_eager, float8_weights
from amp.kernels import float8 as kernels8
from helpers import fake_cupy
from helpers.cuda_emulation import build

RECIPES = ["tensorwise", "rowwise"]
GRADS = [(True, True), (True, False), (False, True)]  # (input, weight) require grad


@pytest.fixture(autouse=True)
def empty_weight_cache():
    yield
    float8_weights.CACHE.clear()


def _same(actual, expected, what):
    assert actual.dtype == expected.dtype, what
    assert torch.equal(actual, expected), (what, (actual.float() - expected.float()).abs().max())


def _run(function, x, w, recipe, grad, *extra):
    """(output, input grad, weight grad) of `function` on copies of x and w."""
    x = x.detach().clone().requires_grad_(x.requires_grad)
    w = w.detach().clone().requires_grad_(w.requires_grad)
    out = function.apply(x, w, float8.RECIPES[recipe], *extra)
    out.backward(grad)
    return out, x.grad, w.grad


def _inputs(dtype, x_grad=True, w_grad=True, shape=(2, 16, 48), out_features=64, seed=0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=generator) * torch.logspace(-2, 2, shape[-1])
    w = torch.randn(out_features, shape[-1], generator=generator) * 0.1
    grad = torch.randn(*shape[:-1], out_features, generator=generator)
    return (x.to(dtype).requires_grad_(x_grad), w.to(dtype).requires_grad_(w_grad),
            grad.to(dtype))


def assert_matches_traced(x, w, grad, recipe):
    got = _run(float8_eager.Float8LinearEager, x, w, recipe, grad, True)
    want = _run(float8.Float8Linear, x, w, recipe, grad)
    for name, a, b in zip(("output", "input grad", "weight grad"), got, want):
        if b is None:
            assert a is None, name
        else:
            _same(a, b, name)
    return got


@pytest.mark.parametrize("grads", GRADS, ids=["both", "input", "weight"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("recipe", RECIPES)
def test_eager_computes_the_traced_functions_bits(recipe, dtype, grads):
    x, w, grad = _inputs(dtype, *grads)
    out, x_grad, w_grad = assert_matches_traced(x, w, grad, recipe)
    assert out.dtype is dtype and (x_grad is not None) == grads[0]
    assert not torch.equal(out, torch.nn.functional.linear(x, w))  # FP8, not the input's dtype


@pytest.mark.parametrize("recipe", RECIPES)
def test_an_output_gradient_of_any_layout(recipe):
    """out.sum()'s gradient is an expanded tensor (stride 0): cast as its values."""
    x, w, _ = _inputs(torch.bfloat16)
    grad = torch.ones(()).to(torch.bfloat16).expand(2, 16, 64)
    assert_matches_traced(x, w, grad, recipe)


@pytest.mark.parametrize("recipe", RECIPES)
def test_backward_holds_fp8_layouts_not_the_input(recipe):
    x, w, grad = _inputs(torch.bfloat16)
    saved = []

    def pack(tensor):
        saved.append(tensor)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = float8.linear(x, w, None, float8.RECIPES[recipe])
    assert not any(t.data_ptr() == x.data_ptr() for t in saved)
    kinds = sorted(str(t.dtype) for t in saved)
    # the weight (for autograd's check), the input's and the weight's transposed layouts
    assert kinds == sorted(["torch.bfloat16"] + ["torch.float8_e4m3fn"] * 2 + ["torch.float32"] * 2)
    out.backward(grad)


def test_calls_without_grad_make_no_backward_layout(monkeypatch):
    asked = []
    cast = kernels8.cast

    def recording(matrices, float8_dtype, row_major, transposed, power_of_2):
        asked.append((row_major, transposed))
        return cast(matrices, float8_dtype, row_major, transposed, power_of_2)

    monkeypatch.setattr(kernels8, "cast", recording)
    x, w, _ = _inputs(torch.bfloat16)
    with torch.no_grad():
        float8.linear(x, w, None, float8.RECIPES["tensorwise"])
    assert asked == [(kernels8.TENSOR, None)] * 2  # the input, the weight (not from the cache)
    assert len(float8_weights.CACHE) == 0


def test_traced_and_subclassed_tensors_take_the_traced_function():
    x, w, _ = _inputs(torch.bfloat16)
    assert float8_eager.takes(x, torch.nn.Parameter(w))

    class Sub(torch.Tensor):
        pass

    assert not float8_eager.takes(x.as_subclass(Sub), w)


@pytest.mark.skipif(build.compiler() is None, reason="needs g++ for the emulated grid")
@pytest.mark.parametrize("recipe", RECIPES)
def test_on_float8_cu_as_on_torch_operations(monkeypatch, recipe):
    """Every cast and the rowwise output scaling on the kernels (CPU tensors on the emulated
    grid): the traced Function's bits."""
    x, w, grad = _inputs(torch.bfloat16, shape=(3, 16, 48), out_features=80, seed=1)
    want = _run(float8.Float8Linear, x, w, recipe, grad)  # all torch operations
    module, launches = fake_cupy.install_float8(monkeypatch)
    got = _run(float8_eager.Float8LinearEager, x, w, recipe, grad, True)
    names = [name for name, _, _ in launches.calls]
    for name, a, b in zip(("output", "input grad", "weight grad"), got, want):
        _same(a, b, name)
    assert names.count("amp_f8_amax<__nv_bfloat16>") == 3  # x, w, grad: none on torch ops
    assert names.count("amp_f8_cast<__nv_bfloat16, 0>") == 2 + (recipe == "rowwise")
    assert names.count("amp_f8_scale_outer") == (2 if recipe == "rowwise" else 0)


@pytest.mark.cuda
@pytest.mark.parametrize("recipe", RECIPES)
def test_on_a_gpu_the_eager_linear_computes_the_traced_bits(recipe):
    from amp import kernels

    if kernels.cuda_backend().name != "cupy":
        pytest.skip(f"CuPy is not used: {kernels.cuda_backend().reason}")
    x, w, grad = _inputs(torch.bfloat16, shape=(4, 512, 1024), out_features=2048, seed=3)
    x, w = (t.detach().cuda().requires_grad_() for t in (x, w))
    assert kernels8._cupy_for(x) is not None
    assert_matches_traced(x, w, grad.cuda(), recipe)
