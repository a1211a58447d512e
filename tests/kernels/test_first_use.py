"""What a run compiles on CUDA (amp/kernels/_cupy_device.py, _sources.py): the family of a kernel
when the run first launches it, the step families a kernel at a time, so an O1 run compiles the
unscale and check kernels alone. Counted on the fake CuPy: the name expressions of each
RawModule the backend makes are what NVRTC would compile on a GPU."""

import pytest
import torch

import amp
import amp.kernels
from amp.kernels import _sources
from helpers import fake_cupy
from helpers.cuda_emulation import build

pytestmark = [
    pytest.mark.skipif(build.compiler() is None, reason="needs g++ for the emulated grid"),
    pytest.mark.usefixtures("deinitialized"),
]
UNSCALE = _sources.FAMILIES["unscale"].names


@pytest.fixture
def modules(monkeypatch):
    """The CuPy backend (compiled kernels) for CPU tensors, as on a GPU; returns the name
    expressions of each module it makes, in order."""
    backend, launches = fake_cupy.install(monkeypatch, kernels="compiled")
    monkeypatch.setattr(amp.kernels, "_torch_backend", backend)
    monkeypatch.setattr(amp.kernels, "fuses", lambda device: True)
    return launches.modules


def _train(opt_level, dtype, steps=3, **options):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    model, optimizer = amp.initialize(
        model, optimizer, opt_level=opt_level, dtype=dtype, verbosity=0, **options
    )
    for _ in range(steps):
        x = torch.randn(8, 16)
        with amp.scale_loss(model(x.to(dtype) if opt_level != "O1" else x).float().square().mean(),
                            optimizer) as scaled:
            scaled.backward()
        optimizer.step()
        optimizer.zero_grad()
    amp.deinitialize()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_an_o1_run_compiles_the_unscale_family_alone(modules, dtype):
    _train("O1", dtype)
    assert modules == [UNSCALE]


@pytest.mark.parametrize(
    "dtype, options, steps",
    [
        (torch.bfloat16, {}, ["amp_compact_adam<__nv_bfloat16, amp::Remainder, float>"]),
        (torch.float16, {}, ["amp_adam<__half, __half>"]),
        (
            torch.bfloat16,
            dict(master_weights="compact", optimizer_state="int8"),
            [  # codes for [4, 32] (its rows a block each), FP32 moments for the others
                "amp_compact_adam<__nv_bfloat16, amp::Compact, amp::Codes8>",
                "amp_compact_adam<__nv_bfloat16, amp::Compact, float>",
            ],
        ),
    ],
    ids=["o2-bf16-exact", "o2-fp16", "o2-compact-int8"],
)
def test_an_o2_run_compiles_the_unscale_family_and_its_step_kernels(
    modules, dtype, options, steps
):
    """Its first step is the optimizer's own (it makes the state); then one module per step
    kernel and per step count."""
    _train("O2", dtype, **options)
    assert modules[0] == UNSCALE
    count = "amp_adam" in steps[0] and "amp_count_steps" or "amp_compact_count_steps"
    assert sorted(name for module in modules[1:] for name in module) == sorted(steps + [count])
    assert all(len(module) == 1 for module in modules[1:])
