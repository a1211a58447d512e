"""The CuPy build's AdamW / Adam (step_math.cu under AMP_TORCH_CUDA_ADAM, which
amp/kernels/_sources.py's GPU options define): torch's CUDA fused kernel's arithmetic
(aten/src/ATen/native/cuda/fused_adam_utils.cuh, torch 2.11 to 2.13), on the emulated grid,
against a reference written here with torch operations that rounds as that kernel rounds:

- the hyperparameters cast to float; the bias corrections 1 - beta**step in float from powf (the
  C library's here, as a 0-dim torch.pow and the kernel compiled for the CPU both call it; CUDA's
  on a GPU, for torch and for amp alike), the second one's square root in float;
- AdamW's decay p - (lr wd) p and Adam's g + p wd as one fused multiply-add each (nvcc fuses
  them: read off the SASS of the .cuh's adam_math), the moments' lerps as the .cuh's explicit
  fmas: m = fma(b1, m, fma(-b1, g, g)), v = fma(b2, v, fma(-b2, g g, g g));
- d = sqrt(v) / sqrt(1 - b2**t) + eps and p - (lr / (1 - b1**t)) m / d, each operation rounded.

The GPU check is tests/kernels/test_backends.py's test_cuda_exact_bf16_masters_are_torchs_fused_
step_on_fp32_copies: amp's masters against torch's own CUDA fused AdamW.
"""

import pytest
import torch

from amp import kernels
from helpers import fake_cupy
from helpers.cuda_emulation import build
from helpers.floats import bits

pytestmark = pytest.mark.skipif(build.compiler() is None, reason="needs g++ for the emulated grid")

SIZES = [1, 7, 33, 4096 + 5, 65536 + 3]  # elementwise: any size (no CPU vector body here)
INV = 2.0**-10


@pytest.fixture
def cuda_formula(monkeypatch):
    """The CuPy backend on the kernels as the CuPy build compiles them (torch's CUDA formula)."""
    module, launches = fake_cupy.install(
        monkeypatch, kernels="compiled", order="shuffled", seed=5, torch_cuda_adam=True
    )
    module.launched = lambda: [name for name, _, _ in launches.calls]
    return module


def fma32(a, b, c):
    """a * b + c for float32 tensors with one rounding: in double, where the product is exact and
    the sum's own rounding error is recovered (TwoSum), so a sum that lands on a tie between two
    floats is rounded by the side of its error (plain double rounding would misround it)."""
    a, b, c = torch.broadcast_tensors(a.double(), b.double(), c.double())
    product = a * b
    total = product + c
    virtual = total - product
    error = (product - (total - virtual)) + (c - virtual)
    rounded = total.float()
    toward = torch.where(total > rounded.double(), float("inf"), float("-inf")).float()
    other = torch.nextafter(rounded, toward)
    tie = (total == (rounded.double() + other.double()) / 2) & (error != 0)
    up, down = torch.maximum(rounded, other), torch.minimum(rounded, other)
    return torch.where(tie, torch.where(error > 0, up, down), rounded)


def sqrt32(x):
    """The correctly rounded float32 square root (float64's rounded: innocuous double rounding)."""
    return x.double().sqrt().float()


def torch_cuda_adam(p, g, m, v, step, options):
    """One step of torch's CUDA adam_math on float32 tensors at step `step` (after its +1)."""
    f32 = torch.float32
    lr, beta1, beta2, eps, wd = (
        torch.tensor(x, dtype=f32)
        for x in (options.lr, options.beta1, options.beta2, options.eps, options.weight_decay)
    )
    count = torch.tensor(step, dtype=f32)
    bias_correction1 = 1 - torch.pow(beta1, count)  # 0-dim: the C library's powf
    bias_correction2_sqrt = sqrt32(1 - torch.pow(beta2, count))
    step_size = lr / bias_correction1
    if options.weight_decay != 0:
        if options.decoupled:
            p = fma32(-(lr * wd), p, p)
        else:
            g = fma32(p, wd, g)
    m = fma32(beta1, m, fma32(-beta1, g, g))
    g2 = g * g
    v = fma32(beta2, v, fma32(-beta2, g2, g2))
    d = sqrt32(v) / bias_correction2_sqrt + eps
    p = p - (step_size * m) / d
    return p, m, v


def state(sizes, grad_dtype, seed=0):
    generator = torch.Generator().manual_seed(seed)

    def randn(n, scale):
        return torch.randn(n, generator=generator) * scale

    masters = [randn(n, 0.1) for n in sizes]
    for master in masters:
        master[3::11] = 0.0
        master[5::13] = 1e-39  # subnormal: nothing flushes
    grads = [randn(n, 1000.0).to(grad_dtype) for n in sizes]
    return {
        "grads": grads,
        "masters": masters,
        "m": [randn(n, 0.01) for n in sizes],
        "v": [randn(n, 0.01).square() for n in sizes],
        "steps": [torch.tensor(float(3 + 40 * i)) for i in range(len(sizes))],
    }


def expected(s, options):
    out = {"masters": [], "m": [], "v": []}
    for grad, p, m, v, step in zip(s["grads"], s["masters"], s["m"], s["v"], s["steps"]):
        g = grad.float() * INV
        p, m, v = torch_cuda_adam(p, g, m, v, step.item() + 1.0, options)
        out["masters"].append(p)
        out["m"].append(m)
        out["v"].append(v)
    return out


def assert_same_bits(actual, wanted, what):
    for i, (x, y) in enumerate(zip(actual, wanted, strict=True)):
        assert torch.equal(bits(x), bits(y)), (what, i, (bits(x) != bits(y)).nonzero()[:5])


OPTIONS = [
    kernels.AdamOptions(1e-3, 0.9, 0.999, 1e-8, 0.01, True),
    kernels.AdamOptions(3e-2, 0.8, 0.95, 1e-6, 0.05, False),
    kernels.AdamOptions(1e-3, 0.9, 0.999, 1e-8, 0.0, True),
]
OPTION_IDS = ["adamw", "adam", "no-decay"]


@pytest.mark.parametrize("options", OPTIONS, ids=OPTION_IDS)
@pytest.mark.parametrize("low_dtype", [torch.bfloat16, torch.float16], ids=str)
def test_fp32_masters_step_as_torchs_cuda_fused_adam(cuda_formula, options, low_dtype):
    """amp_adam (FP32 masters and moments, a low-precision copy written)."""
    s = state(SIZES, low_dtype)
    want = expected(s, options)
    lows = [m.to(low_dtype) for m in s["masters"]]
    cuda_formula.adam_step_(
        s["grads"], lows, s["masters"], s["m"], s["v"], s["steps"], None,
        torch.tensor(INV), torch.tensor(0.0), options,
    )
    assert set(cuda_formula.launched()) >= {f"amp_adam<{fake_cupy.TYPE_NAMES[low_dtype]}, "
                                            f"{fake_cupy.TYPE_NAMES[low_dtype]}>"}
    for key in ("masters", "m", "v"):
        assert_same_bits(s[key], want[key], key)
    assert_same_bits(lows, [p.to(low_dtype) for p in want["masters"]], "lows")
    assert [t.item() for t in s["steps"]] == [4.0 + 40 * i for i in range(len(SIZES))]


@pytest.mark.parametrize("options", OPTIONS[:2], ids=OPTION_IDS[:2])
def test_exact_bf16_masters_step_as_torchs_cuda_fused_adam_on_their_fp32_values(
    cuda_formula, options
):
    """amp_compact_adam<bf16, Remainder, float>: O2 bf16's exact masters (the weight and an int16
    remainder) step as torch's CUDA kernel steps their FP32 values; the GPU test of this is the
    one xfail of the H200's run (2026-11-28), up to 64 ulps apart with the CPU formula."""
    s = state(SIZES, torch.bfloat16)
    want = expected(s, options)
    lows, remainders = map(list, zip(*map(kernels.remainder_encode, s["masters"])))
    cuda_formula.adam_step_(
        s["grads"], lows, remainders, s["m"], s["v"], s["steps"], None,
        torch.tensor(INV), torch.tensor(0.0), options,
    )
    assert "amp_compact_adam<__nv_bfloat16, amp::Remainder, float>" in cuda_formula.launched()
    decoded = [kernels.remainder_decode(w, r) for w, r in zip(lows, remainders)]
    assert_same_bits(decoded, want["masters"], "masters")
    for key in ("m", "v"):
        assert_same_bits(s[key], want[key], key)


def test_the_reference_differs_from_the_cpu_formula():
    """The two formulas round differently (else the tests above would hold either): on the same
    state, torch's CPU fused AdamW and the CUDA reference part in some elements."""
    s = state([65536], torch.bfloat16)
    options = OPTIONS[0]
    want = expected(s, options)["masters"][0]
    p = s["masters"][0].clone()
    torch._fused_adamw_(
        [p], [s["grads"][0].float() * INV], [s["m"][0].clone()], [s["v"][0].clone()], [],
        [s["steps"][0].clone() + 1], lr=options.lr, beta1=options.beta1, beta2=options.beta2,
        weight_decay=options.weight_decay, eps=options.eps, amsgrad=False, maximize=False,
    )
    assert (bits(p) != bits(want)).any()


def test_fma32_rounds_once():
    """(1 + 2**-12) * 2**-24 (1 - 2**-12 + 2**-24) + 1 = 1 + 2**-24 + 2**-60: just above the tie
    between 1 and 1 + 2**-23. In double the sum rounds onto the tie, which then rounds to even."""
    a = torch.tensor([1.0 + 2.0**-12])
    b = torch.tensor([2.0**-24 * (1.0 - 2.0**-12 + 2.0**-24)])
    one = torch.tensor([1.0])
    assert (a.double() * b.double() + 1.0).float().item() == 1.0  # rounded twice
    assert fma32(a, b, one).item() == 1.0 + 2.0**-23
    assert fma32(-a, b, one).item() == 1.0 - 2.0**-24  # 1 - 2**-24 - 2**-60: nearest 1 - 2**-24
