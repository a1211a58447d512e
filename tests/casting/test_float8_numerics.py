"""FP8 linears against the oracle, torchao.float8's Float8Linear (CPU, torch._scaled_mm): output,
grad-input and grad-weight bit for bit, tensorwise and rowwise, several shapes and dtypes."""

import copy
import logging

import pytest
import torch

import amp
from amp.casting import float8

torchao_float8 = pytest.importorskip("torchao.float8", reason="torchao is the FP8 oracle")

RECIPES = ["tensorwise", "rowwise"]
# (leading shape of the input, in features, out features, bias)
SHAPES = [((32,), 64, 48, True), ((2, 16), 32, 96, False), ((4, 8), 128, 16, True)]


def _oracle(linear, recipe):
    """A copy of `linear` converted by torchao (its own module, its own parameters)."""
    config = torchao_float8.Float8LinearConfig.from_recipe_name(recipe)
    holder = torch.nn.Sequential(copy.deepcopy(linear))
    logging.disable(logging.WARNING)  # torchao logs about kernels this CPU build lacks
    try:
        torchao_float8.convert_to_float8_training(holder, config=config)
    finally:
        logging.disable(logging.NOTSET)
    assert type(holder[0]).__name__ == "Float8Linear"
    return holder[0]


def _same(actual, expected):
    assert actual.dtype == expected.dtype
    assert torch.equal(actual, expected), (actual - expected).abs().max()


def _inputs(leading, in_features, dtype):
    torch.manual_seed(1)
    # Spread over a wide range, so that the scales and the FP8 rounding matter.
    x = torch.randn(*leading, in_features) * torch.logspace(-2, 2, in_features)
    return x.to(dtype)


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_function_matches_torchao_bit_for_bit(recipe, dtype, shape):
    leading, in_features, out_features, bias = shape
    torch.manual_seed(0)
    linear = torch.nn.Linear(in_features, out_features, bias=bias).to(dtype)
    oracle = _oracle(linear, recipe)
    x = _inputs(leading, in_features, dtype)
    x_ao, x_amp = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_ao = oracle(x_ao)
    grad = torch.randn_like(y_ao)
    y_ao.backward(grad)
    weight = linear.weight.detach().clone().requires_grad_()
    b = linear.bias.detach().clone().requires_grad_() if bias else None
    y_amp = float8.linear(x_amp, weight, b, float8.RECIPES[recipe])
    y_amp.backward(grad)
    _same(y_amp, y_ao)
    _same(x_amp.grad, x_ao.grad)
    _same(weight.grad, oracle.weight.grad)
    if bias:
        _same(b.grad, oracle.bias.grad)
    # Not vacuous: FP8 is not the matmul in the input's dtype.
    assert not torch.equal(y_amp, torch.nn.functional.linear(x, linear.weight, linear.bias))


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("opt_level", ["O2", "O3"])
def test_o2_o3_model_matches_torchao_on_the_same_model(recipe, opt_level):
    """The model cast to bfloat16 by amp, and torchao's Float8Linear on the same bf16 weights."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 32, bias=False)
    )
    reference = copy.deepcopy(model).to(torch.bfloat16)
    oracle = torch.nn.Sequential(
        _oracle(reference[0], recipe), torch.nn.ReLU(), _oracle(reference[2], recipe)
    )
    x = _inputs((2, 16), 32, torch.float32)
    x_amp, x_ao = x.clone().requires_grad_(), x.clone().requires_grad_()
    model = amp.initialize(
        model, opt_level=opt_level, dtype=torch.bfloat16, float8=recipe, verbosity=0
    )
    try:
        y_amp = model(x_amp)
        y_amp.square().sum().backward()
        grads = [p.grad for p in model.parameters()]
    finally:
        amp.deinitialize()
    y_ao = oracle(x_ao.to(torch.bfloat16)).float()
    y_ao.square().sum().backward()
    _same(y_amp, y_ao)
    _same(x_amp.grad, x_ao.grad)
    for grad, param in zip(grads, oracle.parameters()):
        _same(grad, param.grad)


@pytest.mark.parametrize("recipe", RECIPES)
def test_o1_matches_torchao_under_autocast(recipe):
    """O1 casts the input to the low dtype and takes the FP32 weight to FP8 directly: torchao's
    Float8Linear under torch.autocast does the same (it casts only the input)."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 32)
    oracle = _oracle(linear, recipe)
    x = _inputs((16,), 64, torch.float32)
    x_amp, x_ao = x.clone().requires_grad_(), x.clone().requires_grad_()
    with amp.autocast(dtype=torch.bfloat16, float8=recipe):
        y_amp = linear(x_amp)
    y_ao = oracle(x_ao.to(torch.bfloat16))
    assert y_amp.dtype is torch.bfloat16
    grad = torch.randn_like(y_ao)
    y_amp.backward(grad)
    y_ao.backward(grad)
    _same(y_amp, y_ao)
    _same(x_amp.grad, x_ao.grad)
    _same(linear.weight.grad, oracle.weight.grad)  # FP32, as the weight
    _same(linear.bias.grad, oracle.bias.grad)


def test_scales_follow_the_recipe():
    x = torch.tensor([[1.0, -3.0], [0.5, 0.25]])
    data, scale = float8.to_float8(x, torch.float8_e4m3fn, None, power_of_2=False)
    assert scale.dtype is torch.float32 and scale.shape == ()
    assert scale == torch.tensor(448.0 / 3.0, dtype=torch.float64).float()
    assert data.dtype is torch.float8_e4m3fn and data.float().abs().max() == 448.0
    data, scale = float8.to_float8(x, torch.float8_e4m3fn, -1, power_of_2=True)
    assert scale.shape == (2, 1)
    assert scale.flatten().tolist() == [128.0, 512.0]  # 448/3 and 448/0.5, rounded down to 2**k
    # An all-zero tensor gets a finite scale (EPS) and stays zero.
    data, scale = float8.to_float8(torch.zeros(3), torch.float8_e5m2, None, power_of_2=False)
    assert torch.isfinite(scale) and not data.float().any()


def test_only_shapes_fp8_tensor_cores_take_run_in_fp8():
    assert float8.fits(torch.zeros(16, 32), torch.zeros(48, 32))
    assert float8.fits(torch.zeros(2, 8, 32), torch.zeros(16, 32))  # 16 tokens
    assert not float8.fits(torch.zeros(16, 24), torch.zeros(48, 24))  # in features
    assert not float8.fits(torch.zeros(16, 32), torch.zeros(40, 32))  # out features
    assert not float8.fits(torch.zeros(12, 32), torch.zeros(48, 32))  # tokens
    assert not float8.fits(torch.zeros(0, 32), torch.zeros(48, 32))
    assert not float8.fits(torch.zeros(32), torch.zeros(48, 32))  # one token
    assert not float8.fits(torch.zeros(16, 32), torch.zeros(0, 32))  # no out features


def test_double_backward_is_refused():
    x = torch.randn(16, 32, requires_grad=True)
    w = torch.randn(16, 32, requires_grad=True)
    out = float8.linear(x, w, None, float8.RECIPES["tensorwise"])
    (grad,) = torch.autograd.grad(out.square().sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="differentiate twice"):
        grad.sum().backward()
