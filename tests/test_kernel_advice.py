"""amp.initialize warns once when O2's compact state or a bf16 model's exact masters will be stepped
on CUDA without amp's CuPy kernels (amp/kernel_advice.py). No CUDA device exists here, so the
check's two inputs are faked: whether the models are on CUDA (kernel_advice._on_cuda) and the
backend amp.kernels chose (amp_state.cuda_kernels, which amp.kernels.cuda_backend() returns once
probed)."""

import warnings

import pytest
import torch

import amp
from amp import kernel_advice, kernels
from amp._state import amp_state
from amp.kernels import _torch_backend
from helpers.models import make_model

# What the probe says on a GPU machine without CuPy (amp/kernels/__init__.py).
WITHOUT_CUPY = kernels.BackendChoice(
    "torch", _torch_backend, "CuPy cannot be used (ModuleNotFoundError: No module named 'cupy')"
)
WITH_CUPY = kernels.BackendChoice("cupy", None, "CuPy 14.2.0, NVRTC 13.0")

COMPACT_SET_UPS = [
    {"master_weights": "compact"},
    {"optimizer_state": "int8"},
    {"optimizer_state": "bf16"},
    {"master_weights": "compact", "optimizer_state": "int8"},
]


@pytest.fixture
def on_cuda(monkeypatch):
    """The models count as on CUDA, and the backend is `choose(choice)`'s."""
    monkeypatch.setattr(kernel_advice, "_on_cuda", lambda models: True)
    return lambda choice: monkeypatch.setattr(amp_state, "cuda_kernels", choice)


def advice(**options):
    """The warnings about the missing kernels that an O2 bf16 initialize gives, as caught."""
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        amp.initialize(
            model, optimizer, opt_level="O2", dtype=torch.bfloat16, verbosity=0, **options
        )
    amp.deinitialize()
    return [w for w in caught if "CuPy kernels" in str(w.message)]


@pytest.mark.parametrize("options", COMPACT_SET_UPS, ids=lambda o: ",".join(o.values()))
def test_compact_state_on_cuda_without_cupy_is_warned_once_with_the_cost(on_cuda, options):
    on_cuda(WITHOUT_CUPY)
    (warning,) = advice(**options)
    text = str(warning.message)
    assert warning.category is UserWarning
    assert warning.filename == __file__  # points at the initialize call
    assert "418 ms against 42 ms" in text and "10x" in text
    assert "pip install 'amp[cuda]'" in text and "'amp[cuda13]'" in text
    assert text.endswith(f"The CuPy backend is not in use: {WITHOUT_CUPY.reason}.")
    for name, value in options.items():
        assert f"{name}={value!r}" in text


def test_with_cupy_in_use_nothing_is_said(on_cuda):
    on_cuda(WITH_CUPY)
    assert advice(master_weights="compact", optimizer_state="int8") == []
    assert advice() == []  # exact bf16 masters


def test_exact_bf16_masters_without_cupy_are_warned_once_with_the_counts(on_cuda):
    on_cuda(WITHOUT_CUPY)
    (warning,) = advice()  # a bf16 model's exact masters: its weights and int16 remainders
    text = str(warning.message)
    assert warning.filename == __file__
    assert "exact masters" in text and "2,406 kernel launches" in text and "counted" in text
    assert "pip install 'amp[cuda]'" in text
    assert text.endswith(f"The CuPy backend is not in use: {WITHOUT_CUPY.reason}.")


def test_fp32_masters_without_cupy_are_not_warned(on_cuda, monkeypatch):
    on_cuda(WITHOUT_CUPY)
    monkeypatch.setenv("AMP_FUSED_STEP", "0")  # the optimizer's own step on FP32 masters
    assert advice() == []
    monkeypatch.delenv("AMP_FUSED_STEP")
    assert advice(master_weights=False) == []  # no masters: torch's own step of the weights


def test_exact_fp16_masters_without_cupy_are_not_warned(on_cuda):
    on_cuda(WITHOUT_CUPY)
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        amp.initialize(model, optimizer, opt_level="O2", dtype=torch.float16, verbosity=0)
    amp.deinitialize()
    assert not [w for w in caught if "CuPy kernels" in str(w.message)]  # FP32 masters: fast


def test_models_on_the_cpu_are_not_warned_and_the_backend_is_not_probed(monkeypatch):
    monkeypatch.setattr(amp_state, "cuda_kernels", None)
    assert advice(master_weights="compact", optimizer_state="int8") == []
    assert amp_state.cuda_kernels is None  # the probe compiles CuPy's kernels: only for CUDA
