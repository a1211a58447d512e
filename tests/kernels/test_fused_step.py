"""The fused master steps and the check (amp.kernels.adam_step_ / sgd_step_ / check_): the
numerics contract, on the torch backend and on multi_tensor.cu compiled for the CPU
(tests/helpers/cuda_emulation) behind the CuPy backend's own host code.

The contract: every element follows torch's formula operation by operation in float32, with the
fused multiply-adds torch's CPU kernels use. Against torch.optim on FP32 copies of the masters,
given the gradients unscaled in float32:
- AdamW / Adam: bit for bit with `fused=True`, which the torch backend calls; torch's for-loop
  and foreach implementations round the last update differently (`p + (-lr/bc1) * (m/d)` against
  the fused `p - (lr/bc1 * m) / d`): the moments are the same bits, the weights within 4 ulps of
  the larger of the weight and its update.
- SGD: bit for bit with the for-loop and foreach implementations and with `fused=True`.
- Torch's fused CPU ops compute the few elements of their scalar loop (the end of each thread's
  range that does not fill a vector) partly in double: there they may differ from the kernel by
  an ulp. On one thread, with sizes that fill whole vectors, the two are equal bit for bit.
"""

import pytest
import torch

from amp import kernels
from amp.kernels import _layout, _torch_backend
from helpers import fake_cupy
from helpers.floats import bits, ulps
from helpers.cuda_emulation import build

emulated = pytest.mark.skipif(build.compiler() is None, reason="needs g++ for the emulated grid")
LOW = [torch.float16, torch.bfloat16]
SIZES = [64, 4096, 65536 + 128]  # whole vectors of torch's CPU kernels: no scalar loop
ODD_SIZES = [1, 5, 4099, 65537]


@pytest.fixture
def kernel(monkeypatch):
    """The CuPy backend on multi_tensor.cu compiled for the CPU; `.launched()` names its kernels."""
    module, launches = fake_cupy.install(monkeypatch, kernels="compiled", order="shuffled", seed=3)
    module.launched = lambda: [name for name, _, _ in launches.calls]
    return module


def adam_state(sizes, low_dtype, seed=0):
    generator = torch.Generator().manual_seed(seed)

    def randn(n, scale):
        return torch.randn(n, generator=generator) * scale

    masters = [randn(n, 0.1) for n in sizes]
    state = {
        "grads": [(randn(n, 1000.0)).to(low_dtype) for n in sizes],
        "masters": masters,
        "exp_avgs": [randn(n, 0.01) for n in sizes],
        "exp_avg_sqs": [randn(n, 1e-2).square() for n in sizes],
        "steps": [torch.tensor(float(3 + i)) for i in range(len(sizes))],
        "lows": [m.to(low_dtype) for m in masters],
    }
    return state


def copied(state):
    return {
        key: None if value is None else [t if t is None else t.clone() for t in value]
        for key, value in state.items()
    }


ADAM = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.05)
SGD = [
    dict(lr=0.1, momentum=0.9, dampening=0.0, weight_decay=0.01, nesterov=False),
    dict(lr=0.1, momentum=0.9, dampening=0.0, weight_decay=0.0, nesterov=True),
    dict(lr=0.3, momentum=0.8, dampening=0.25, weight_decay=0.1, nesterov=False),
    dict(lr=0.1, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False),
]
INV = 2.0**-10


def _lows(state):
    """The backends' `lows`: a list (None: a row without a copy)."""
    lows = state["lows"]
    return [None] * len(state["grads"]) if lows is None else lows


def run_adam(module, state, decoupled, found=0.0, inv=INV):
    state = copied(state)
    module.adam_step_(
        state["grads"],
        _lows(state),
        state["masters"],
        state["exp_avgs"],
        state["exp_avg_sqs"],
        state["steps"],
        None,
        None if inv is None else torch.tensor(inv),
        torch.tensor(found),
        kernels.AdamOptions(**ADAM, decoupled=decoupled),
    )
    return state


def sgd_state(sizes, low_dtype, seed=0):
    state = adam_state(sizes, low_dtype, seed)
    return {
        "grads": state["grads"],
        "masters": state["masters"],
        "buffers": state["exp_avgs"],
        "lows": state["lows"],
    }


def run_sgd(module, state, options, found=0.0):
    state = copied(state)
    module.sgd_step_(
        state["grads"],
        _lows(state),
        state["masters"],
        state["buffers"],
        None,
        torch.tensor(INV),
        torch.tensor(found),
        kernels.SGDOptions(**options),
        False,
    )
    return state


def assert_same_bits(a, b):
    for key in a:
        for x, y in zip(a[key] or (), b[key] or (), strict=True):
            assert torch.equal(bits(x), bits(y)), key


def assert_within_an_ulp(a, b):
    for key in a:
        for x, y in zip(a[key], b[key], strict=True):
            if x.dtype is torch.float32:
                assert ulps(x, y).max() <= 1, key
            else:  # low precision: the rounding of masters an ulp apart
                assert (x.float() - y.float()).abs().max() <= x.float().abs().max() * 2**-7, key


# -- the emulated kernel against the torch backend ---------------------------------------------


@emulated
@pytest.mark.parametrize("decoupled", [True, False], ids=["AdamW", "Adam"])
@pytest.mark.parametrize("low_dtype", LOW, ids=str)
def test_the_adam_kernel_is_the_torch_backend_bit_for_bit(kernel, one_thread, decoupled, low_dtype):
    state = adam_state(SIZES, low_dtype)
    by_kernel = run_adam(kernel, state, decoupled)
    assert_same_bits(by_kernel, run_adam(_torch_backend, state, decoupled))
    name = fake_cupy.TYPE_NAMES[low_dtype]
    assert kernel.launched() == [f"amp_adam<{name}, {name}>", "amp_count_steps"]
    assert [s.item() for s in by_kernel["steps"]] == [4.0, 5.0, 6.0]


@emulated
@pytest.mark.parametrize("options", SGD, ids=["momentum", "nesterov", "dampening", "plain"])
@pytest.mark.parametrize("low_dtype", LOW, ids=str)
def test_the_sgd_kernel_is_the_torch_backend_bit_for_bit(kernel, one_thread, options, low_dtype):
    state = sgd_state(SIZES, low_dtype)
    assert_same_bits(run_sgd(kernel, state, options), run_sgd(_torch_backend, state, options))


@emulated
def test_sizes_that_leave_torchs_scalar_loop_work_are_within_an_ulp(kernel):
    adam, sgd = adam_state(ODD_SIZES, torch.bfloat16), sgd_state(ODD_SIZES, torch.bfloat16)
    assert_within_an_ulp(run_adam(kernel, adam, True), run_adam(_torch_backend, adam, True))
    assert_within_an_ulp(run_sgd(kernel, sgd, SGD[1]), run_sgd(_torch_backend, sgd, SGD[1]))


@emulated
@pytest.mark.parametrize("module", ["kernel", "torch"])
def test_a_row_without_a_low_precision_copy_is_stepped_as_the_others(kernel, one_thread, module):
    """A None in `lows` (a plain FP32 parameter in a group of masters): its master and state are
    stepped as with a copy, and the other rows' copies written."""
    module = kernel if module == "kernel" else _torch_backend
    adam, sgd = adam_state(SIZES, torch.bfloat16), sgd_state(SIZES, torch.bfloat16)
    for state, run in (
        (adam, lambda s: run_adam(module, s, True)),
        (sgd, lambda s: run_sgd(module, s, SGD[0])),
    ):
        state["grads"][1] = state["grads"][1].float()  # a plain FP32 parameter's gradient
        whole = run(state)
        state["lows"][1] = None
        without = run(state)
        assert without["lows"][1] is None
        whole["lows"][1] = None
        for key in whole:
            for x, y in zip(whole[key], without[key], strict=True):
                assert (x is None and y is None) or torch.equal(bits(x), bits(y)), key


@emulated
@pytest.mark.parametrize("low_dtype", LOW, ids=str)
def test_fp32_gradients_with_low_precision_weights_are_stepped_by_the_kernels(
    kernel, one_thread, low_dtype
):
    """The masters' gradients made FP32 before the step (a clipping read them): the same step,
    on the kernels built for that pair of types."""
    adam, sgd = adam_state(SIZES, low_dtype), sgd_state(SIZES, low_dtype)
    for state in (adam, sgd):
        state["grads"] = [grad.float() for grad in state["grads"]]
    assert_same_bits(run_adam(kernel, adam, True), run_adam(_torch_backend, adam, True))
    assert_same_bits(run_sgd(kernel, sgd, SGD[0]), run_sgd(_torch_backend, sgd, SGD[0]))
    name = fake_cupy.TYPE_NAMES[low_dtype]
    assert kernel.launched() == [
        f"amp_adam<float, {name}>",
        "amp_count_steps",
        f"amp_sgd<float, {name}>",
    ]


@emulated
def test_rows_amp_adam_is_not_built_for_go_to_the_compact_kernel(kernel, one_thread):
    """A low-precision gradient of an FP32 parameter stepped without a copy (no amp_adam for that
    pair): the compact kernel's FP32 master, whose copy's pointer is null."""
    state = adam_state(SIZES, torch.bfloat16)
    state["lows"] = None
    assert_same_bits(run_adam(kernel, state, True), run_adam(_torch_backend, state, True))
    assert kernel.launched() == [
        "amp_compact_adam<__nv_bfloat16, amp::Exact<__nv_bfloat16>, float>",
        "amp_compact_count_steps",
    ]


@emulated
@pytest.mark.parametrize("module", ["kernel", "torch"])
def test_a_set_flag_changes_nothing(kernel, module):
    module = kernel if module == "kernel" else _torch_backend
    adam, sgd = adam_state(SIZES, torch.float16), sgd_state(SIZES, torch.float16)
    assert_same_bits(run_adam(module, adam, True, found=1.0), adam)
    assert_same_bits(run_sgd(module, sgd, SGD[0], found=1.0), sgd)


@emulated
def test_float32_gradients_without_a_scale_and_without_low_weights(kernel, one_thread):
    """The optimizer's parameters that have no master (kept FP32): the step on them alone."""
    state = adam_state(SIZES, torch.float32)
    state["lows"] = None
    results = []
    for module in (kernel, _torch_backend):
        copy = {k: [t.clone() for t in v] for k, v in state.items() if v is not None}
        module.adam_step_(
            copy["grads"],
            [None] * len(copy["grads"]),
            copy["masters"],
            copy["exp_avgs"],
            copy["exp_avg_sqs"],
            copy["steps"],
            None,
            None,
            None,
            kernels.AdamOptions(**ADAM, decoupled=True),
        )
        results.append(copy)
    assert_same_bits(*results)
    assert kernel.launched()[0] == "amp_adam<float, float>"


@emulated
@pytest.mark.parametrize("found", [0.0, 1.0], ids=["stepped", "skipped"])
def test_an_empty_parameters_step_is_counted_as_torch_counts_it(kernel, one_thread, found):
    """torch's fused AdamW counts the step of a 0-element parameter too (its state dict says so);
    the launches leave empty tensors out, so those go to the torch backend."""
    state = adam_state([64, 0, 5], torch.bfloat16)
    ours, theirs = (run_adam(m, state, True, found=found) for m in (kernel, _torch_backend))
    assert [s.item() for s in ours["steps"]] == [s.item() for s in theirs["steps"]]
    assert ours["steps"][1].item() == state["steps"][1].item() + (1 - found)
    full = [0, 2]  # the rows with elements, as the kernel steps them
    assert_within_an_ulp(*({k: [v[i] for i in full] for k, v in x.items()} for x in (ours, theirs)))


@emulated
def test_more_tensors_than_one_launch_holds_count_each_step_once(kernel, monkeypatch, one_thread):
    monkeypatch.setenv("AMP_KERNEL_PARAM_BYTES", str(_layout.PARAM_BYTES_SMALL))
    capacity = _layout.max_tensors(6, _layout.PARAM_BYTES_SMALL)
    state = adam_state([16] * (capacity + 3), torch.bfloat16)
    by_kernel = run_adam(kernel, state, True)
    assert kernel.launched().count("amp_adam<__nv_bfloat16, __nv_bfloat16>") == 2
    assert_same_bits(by_kernel, run_adam(_torch_backend, state, True))


@emulated
def test_the_packed_launches_are_reused_and_follow_new_gradients_and_moved_data(kernel, one_thread):
    state = adam_state(SIZES, torch.bfloat16)
    lists = copied(state)  # the same list objects at every step, as amp's step keeps them
    reference = copied(state)
    for step in range(3):
        grads = [(torch.randn(g.shape) * 100).to(torch.bfloat16) for g in state["grads"]]
        if step == 2:  # data given anew (`param.data = ...`): the launch must follow it
            for key in ("masters", "exp_avgs"):
                lists[key][0].data = lists[key][0].clone()
        for target in (lists, reference):
            module = kernel if target is lists else _torch_backend
            module.adam_step_(
                grads,
                target["lows"],
                *[target[k] for k in ("masters", "exp_avgs", "exp_avg_sqs", "steps")],
                None,
                torch.tensor(INV),
                torch.tensor(0.0),
                kernels.AdamOptions(**ADAM, decoupled=True),
            )
        assert_same_bits(
            {k: v for k, v in lists.items() if k != "grads"},
            {k: v for k, v in reference.items() if k != "grads"},
        )


# -- against torch.optim on FP32 copies ----------------------------------------------------------


def torch_optim_step(state, cls, inv, **options):
    """torch.optim's step on FP32 copies of the masters and state, given the gradients unscaled
    in float32 (what amp's general path steps)."""
    params = [torch.nn.Parameter(m.clone()) for m in state["masters"]]
    optimizer = cls(params, **options)
    for param, grad, m, v, step in zip(
        params, state["grads"], state["exp_avgs"], state["exp_avg_sqs"], state["steps"]
    ):
        param.grad = grad.float() * inv
        optimizer.state[param] = {
            "step": step.clone(),
            "exp_avg": m.clone(),
            "exp_avg_sq": v.clone(),
        }
    optimizer.step()
    return params, optimizer


@pytest.mark.parametrize("cls", [torch.optim.AdamW, torch.optim.Adam])
def test_the_torch_backend_is_torch_optims_fused_adam_bit_for_bit(cls):
    state = adam_state(SIZES + ODD_SIZES, torch.bfloat16)
    ours = run_adam(_torch_backend, state, cls is torch.optim.AdamW)
    options = dict(lr=ADAM["lr"], betas=(ADAM["beta1"], ADAM["beta2"]), eps=ADAM["eps"])
    params, optimizer = torch_optim_step(
        state, cls, INV, weight_decay=ADAM["weight_decay"], fused=True, **options
    )
    for param, master, low in zip(params, ours["masters"], ours["lows"]):
        assert torch.equal(bits(param.detach()), bits(master))
        assert torch.equal(bits(low), bits(master.to(low.dtype)))
    for param, m, v in zip(params, ours["exp_avgs"], ours["exp_avg_sqs"]):
        assert torch.equal(bits(optimizer.state[param]["exp_avg"]), bits(m))
        assert torch.equal(bits(optimizer.state[param]["exp_avg_sq"]), bits(v))


@pytest.mark.parametrize("foreach", [False, True], ids=["for-loop", "foreach"])
@pytest.mark.parametrize("cls", [torch.optim.AdamW, torch.optim.Adam])
def test_against_torchs_other_adams_the_moments_agree_and_the_weights_within_4_ulps(
    one_thread, cls, foreach
):
    for sizes, moment_ulps in ((SIZES, 0), (ODD_SIZES, 1)):
        state = adam_state(sizes, torch.bfloat16)
        ours = run_adam(_torch_backend, state, cls is torch.optim.AdamW)
        options = dict(lr=ADAM["lr"], betas=(ADAM["beta1"], ADAM["beta2"]), eps=ADAM["eps"])
        params, optimizer = torch_optim_step(
            state, cls, INV, weight_decay=ADAM["weight_decay"], foreach=foreach, **options
        )
        for param, master, before in zip(params, ours["masters"], state["masters"]):
            update = (master - before).abs()
            largest = torch.maximum(before.abs(), update)
            ulp = torch.nextafter(largest, torch.tensor(float("inf"))) - largest
            assert ((master - param.detach()).abs() <= 4 * ulp).all()
        for param, m, v in zip(params, ours["exp_avgs"], ours["exp_avg_sqs"]):
            assert ulps(optimizer.state[param]["exp_avg"], m).max() <= moment_ulps
            assert ulps(optimizer.state[param]["exp_avg_sq"], v).max() <= moment_ulps


@pytest.mark.parametrize("options", SGD, ids=["momentum", "nesterov", "dampening", "plain"])
@pytest.mark.parametrize("implementation", ["for-loop", "foreach", "fused"])
def test_the_torch_backend_is_torch_optims_sgd(one_thread, options, implementation):
    state = sgd_state(SIZES, torch.float16)
    ours = run_sgd(_torch_backend, state, options)
    params = [torch.nn.Parameter(m.clone()) for m in state["masters"]]
    flags = {"for-loop": dict(foreach=False), "foreach": dict(foreach=True)}
    optimizer = torch.optim.SGD(params, **options, **flags.get(implementation, {"fused": True}))
    for param, grad, buffer in zip(params, state["grads"], state["buffers"]):
        param.grad = grad.float() * INV
        if options["momentum"]:
            optimizer.state[param] = {"momentum_buffer": buffer.clone()}
    optimizer.step()
    for param, master in zip(params, ours["masters"]):
        assert torch.equal(bits(param.detach()), bits(master))
    if options["momentum"]:
        for param, buffer in zip(params, ours["buffers"]):
            assert torch.equal(bits(optimizer.state[param]["momentum_buffer"]), bits(buffer))


# -- the check ---------------------------------------------------------------------------------


@emulated
@pytest.mark.parametrize("where", [None, (0, 0), (2, 65535), (2, 65536), (3, -1)])
def test_the_check_finds_what_unscale_finds_and_writes_nothing(kernel, where):
    sizes = [3, 4096, 2 * 65536 + 7, 5]
    tensors = [(torch.randn(n) * 100).to(torch.bfloat16) for n in sizes]
    if where is not None:
        tensors[where[0]][where[1]] = float("nan")
    before = [t.clone() for t in tensors]
    expected = torch.zeros(())
    torch._amp_foreach_non_finite_check_and_unscale_(
        [t.clone() for t in tensors], expected, torch.tensor(1.0)
    )
    for module in (kernel, _torch_backend):
        found = torch.zeros(())
        flags = module.check_(tensors, found)
        assert found.item() == expected.item()
        assert flags.tensors() == ([] if where is None else [where[0]])
        assert_same_bits({"t": tensors}, {"t": before})
    assert kernel.launched() == ["amp_check<__nv_bfloat16>"]


def test_the_interface_runs_the_torch_backend_on_the_cpu():
    state = adam_state([8], torch.float16)
    found = torch.zeros(())
    flags = kernels.check_(state["grads"], found)
    assert found.item() == 0.0 and flags.tensors() == []
    assert not kernels.fuses(torch.device("cpu"))
    copy = copied(state)
    kernels.adam_step_(
        copy["grads"],
        copy["lows"],
        copy["masters"],
        copy["exp_avgs"],
        copy["exp_avg_sqs"],
        copy["steps"],
        kernels.AdamOptions(**ADAM, decoupled=True),
        inv_scale=torch.tensor(INV),
        found_inf=found,
    )
    assert_same_bits(copy, run_adam(_torch_backend, state, True))
