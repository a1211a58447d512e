"""The `apex` distribution backed by amp (compat/apex): apex.amp is amp, the installed metadata,
never shadowing another apex silently, apex's optimizers against formulas written here from the
published algorithms, LARC, SyncBatchNorm, the layer norms, DistributedDataParallel's arguments,
and apex-style scripts (tests/apex_scripts/) at O0-O3, resumed from their checkpoints, and under
DDP with two gloo ranks."""

import copy
import importlib.metadata
import importlib.util
import math
import os
import subprocess
import sys

import pytest
import torch

import amp
from ranks import run_two_ranks

try:
    import apex
except ImportError as error:  # make test installs it; a bare `pip install -e .` does not
    raise ImportError(
        "tests/test_apex_package.py needs amp's apex package: pip install -e ./compat/apex"
    ) from error

from apex.optimizers import FusedAdam, FusedLAMB, FusedSGD
from apex.parallel import DistributedDataParallel, SyncBatchNorm, convert_syncbn_model
from apex.parallel.LARC import LARC

SCRIPTS = os.path.join(os.path.dirname(__file__), "apex_scripts")
sys.path.insert(0, SCRIPTS)
import ddp as ddp_script  # noqa: E402
import two_models  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# --- the package -----------------------------------------------------------------------------


def test_apex_amp_is_the_amp_module_with_its_state():
    from apex import amp as from_apex
    import apex.amp as apex_amp
    from apex.amp import _amp_state
    from apex.amp._amp_state import _amp_state as state, master_params
    from apex.amp.amp import register_half_function
    from apex.amp.frontend import initialize, load_state_dict, state_dict
    from apex.amp.handle import disable_casts, scale_loss

    assert from_apex is amp and apex_amp is amp and apex.amp is amp
    assert _amp_state is state is amp._amp_state
    assert (initialize, state_dict, load_state_dict) == (
        amp.initialize,
        amp.state_dict,
        amp.load_state_dict,
    )
    assert (scale_loss, disable_casts, master_params, register_half_function) == (
        amp.scale_loss,
        amp.disable_casts,
        amp.master_params,
        amp.register_half_function,
    )
    assert amp._amp_state is state  # importing apex.amp._amp_state did not replace it


@pytest.mark.parametrize("name", ["scaler", "casting", "frontend_typo"])
def test_other_apex_amp_modules_raise_and_never_load_a_second_amp(name):
    with pytest.raises(ModuleNotFoundError, match=r"apex\.amp\._amp_state, apex\.amp\.frontend"):
        importlib.import_module(f"apex.amp.{name}")
    loaded = {key for key in sys.modules if key.startswith("apex.amp.")}
    assert loaded == {f"apex.amp.{module}" for module in apex._amp_alias.SUBMODULES}


def test_installed_metadata_is_visible_and_pins_this_amp():
    distribution = importlib.metadata.distribution("apex")
    assert distribution.version == f"{amp.__version__}+amp"
    assert f"amp=={amp.__version__}" in distribution.requires
    assert "backed by amp" in distribution.metadata["Summary"]
    # What Lightning (module_available("apex.amp")) and transformers (is_apex_available) check.
    assert importlib.util.find_spec("apex") is not None
    assert importlib.util.find_spec("apex.amp") is not None


def test_python_m_amp_reports_the_compat_package():
    result = subprocess.run([sys.executable, "-m", "amp"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    line = result.stdout.splitlines()[-1]
    assert line.startswith(f"apex compatibility package: installed (apex {amp.__version__}+amp at ")
    assert os.path.realpath(os.path.dirname(apex.__file__)) in line


def _fake_apex(root, with_amp):
    package = root / "apex"
    package.mkdir()
    (package / "__init__.py").write_text("")
    if with_amp:
        (package / "amp").mkdir()
        (package / "amp" / "__init__.py").write_text("")
    return package


@pytest.mark.parametrize("with_amp", [True, False])
def test_import_amp_says_when_an_apex_with_its_own_amp_would_be_imported(tmp_path, with_amp):
    package = _fake_apex(tmp_path, with_amp)
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    code = "import warnings; warnings.simplefilter('always'); import amp"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr
    warned = "an apex with its own apex.amp is importable" in result.stderr
    assert warned is with_amp, result.stderr
    if with_amp:
        assert str(package) in result.stderr and "pip install ./compat/apex" in result.stderr
    report = subprocess.run(
        [sys.executable, "-m", "amp"], capture_output=True, text=True, env=env
    ).stdout.splitlines()[-1]
    assert report.startswith("apex compatibility package: not installed; `import apex` gives")
    assert str(package) in report and ("with its own apex.amp" in report) is with_amp


def test_the_compat_package_says_when_it_shadows_another_apex(tmp_path, monkeypatch):
    package = _fake_apex(tmp_path, with_amp=True)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.warns(UserWarning, match="shadows another apex package at") as warned:
        apex._shadowing.warn_about_other_apex(apex.__path__)
    assert str(package) in str(warned[0].message)
    assert "pip uninstall apex" in str(warned[0].message)


def test_importing_the_compat_package_alone_warns_nothing():
    result = subprocess.run(
        [sys.executable, "-W", "error", "-c", "import apex, amp; assert apex.amp is amp"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr


def test_names_not_provided_import_and_refuse_naming_the_replacement():
    names = {}
    exec("from apex.fp16_utils import *", names)  # as apex's imagenet example does
    from apex.fp16_utils import FP16_Optimizer, network_to_half
    from apex.multi_tensor_apply import multi_tensor_applier
    from apex.optimizers import FusedNovoGrad

    assert names["to_python_float"](torch.tensor([2.5])) == 2.5
    with pytest.raises(RuntimeError, match=r"FP16_Optimizer is not provided.*opt_level='O2'"):
        FP16_Optimizer(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1))
    with pytest.raises(RuntimeError, match="network_to_half is not provided"):
        network_to_half(torch.nn.Linear(2, 2))
    with pytest.raises(RuntimeError, match="FusedNovoGrad is not provided"):
        FusedNovoGrad([torch.zeros(1, requires_grad=True)])
    assert multi_tensor_applier.available is False  # code that checks it takes its torch path
    with pytest.raises(RuntimeError, match=r"amp_C.*torch\._foreach_mul_"):
        multi_tensor_applier(print, torch.zeros(1, dtype=torch.int), [[torch.ones(2)]], 2.0)


# --- optimizers, against the published algorithms written out per tensor, in float64 ----------


def _params_and_grads(dtype, seed=0, shapes=((4, 3), (5,), (2, 2, 2))):
    generator = torch.Generator().manual_seed(seed)
    params = [torch.randn(s, generator=generator).to(dtype).requires_grad_() for s in shapes]
    grads = [
        [torch.randn(s, generator=generator).to(dtype) for s in shapes] for _ in range(3)
    ]  # three steps
    return params, grads


def _run(optimizer, params, grads):
    for step_grads in grads:
        for param, grad in zip(params, step_grads):
            param.grad = grad.clone()
        optimizer.step()
    return [p.detach().double() for p in params]


def _reference_adam(params, grads, lr, betas, eps, weight_decay, decoupled, bias_correction):
    beta1, beta2 = betas
    p = [t.detach().double() for t in params]
    m = [torch.zeros_like(t) for t in p]
    v = [torch.zeros_like(t) for t in p]
    for step, step_grads in enumerate(grads, start=1):
        c1 = 1 - beta1**step if bias_correction else 1.0
        c2 = 1 - beta2**step if bias_correction else 1.0
        for i, grad in enumerate(step_grads):
            g = grad.double()
            if not decoupled:
                g = g + weight_decay * p[i]
            m[i] = beta1 * m[i] + (1 - beta1) * g
            v[i] = beta2 * v[i] + (1 - beta2) * g * g
            update = (m[i] / c1) / ((v[i] / c2).sqrt() + eps)
            if decoupled:
                update = update + weight_decay * p[i]
            p[i] = p[i] - lr * update
    return p


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("adam_w_mode", [True, False])
@pytest.mark.parametrize("bias_correction", [True, False])
def test_fused_adam_is_apex_adam(dtype, adam_w_mode, bias_correction):
    params, grads = _params_and_grads(dtype)
    options = dict(lr=0.01, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.1)
    optimizer = FusedAdam(
        params, adam_w_mode=adam_w_mode, bias_correction=bias_correction, **options
    )
    expected = _reference_adam(
        params, grads, **options, decoupled=adam_w_mode, bias_correction=bias_correction
    )
    found = _run(optimizer, params, grads)
    tolerance = dict(rtol=1e-6, atol=1e-6) if dtype is torch.float32 else dict(rtol=1e-3, atol=1e-3)
    for f, e in zip(found, expected):
        torch.testing.assert_close(f, e, **tolerance)
    assert all(p.dtype is dtype for p in params)
    assert optimizer.param_groups[0]["step"] == 3  # apex's layout: the step per group
    assert all(optimizer.state[p]["exp_avg"].dtype is dtype for p in params)


def test_fused_adam_defaults_are_apex_adamw_and_zero_grad_sets_none():
    params, grads = _params_and_grads(torch.float32)
    optimizer = FusedAdam(params, weight_decay=0.1)
    expected = _reference_adam(params, grads, 1e-3, (0.9, 0.999), 1e-8, 0.1, True, True)
    found = _run(optimizer, params, grads)
    for f, e in zip(found, expected):
        torch.testing.assert_close(f, e, rtol=1e-6, atol=1e-7)
    optimizer.zero_grad()
    assert all(p.grad is None for p in params)  # set_grad_none=True
    kept = FusedAdam(params, set_grad_none=False)
    params[0].grad = torch.ones_like(params[0])
    kept.zero_grad()
    assert torch.equal(params[0].grad, torch.zeros_like(params[0]))


def test_fused_adam_checkpoint_round_trip_continues_exactly():
    params, grads = _params_and_grads(torch.float32)
    optimizer = FusedAdam(params, lr=0.01)
    _run(optimizer, params, grads[:2])
    saved = copy.deepcopy(optimizer.state_dict())  # as torch.save would: no shared tensors
    copies = [p.detach().clone().requires_grad_() for p in params]
    resumed = FusedAdam(copies, lr=0.01)
    resumed.load_state_dict(saved)
    assert torch.equal(_run(optimizer, params, grads[2:])[0], _run(resumed, copies, grads[2:])[0])


def _reference_lamb(
    groups, grads, betas, eps, adam_w_mode, grad_averaging, max_grad_norm, use_nvlamb
):
    """LAMB as apex computed it: global-norm pre-normalisation, Adam moments with bias
    correction, L2 or decoupled decay, then the trust ratio |p| / |update|."""
    beta1, beta2 = betas
    beta3 = 1 - beta1 if grad_averaging else 1.0
    p = [[t.detach().double() for t in group["params"]] for group in groups]
    m = [[torch.zeros_like(t) for t in g] for g in p]
    v = [[torch.zeros_like(t) for t in g] for g in p]
    flat = 0
    for step, step_grads in enumerate(grads, start=1):
        step_grads = [g.double() for g in step_grads]
        norm = math.sqrt(sum(float((g * g).sum()) for g in step_grads))
        divisor = norm / max_grad_norm if norm > max_grad_norm else 1.0
        flat = 0
        for gi, group in enumerate(groups):
            lr, wd = group["lr"], group["weight_decay"]
            for i in range(len(p[gi])):
                g = step_grads[flat] / divisor
                flat += 1
                if not adam_w_mode:
                    g = g + wd * p[gi][i]
                m[gi][i] = beta1 * m[gi][i] + beta3 * g
                v[gi][i] = beta2 * v[gi][i] + (1 - beta2) * g * g
                update = (m[gi][i] / (1 - beta1**step)) / (
                    (v[gi][i] / (1 - beta2**step)).sqrt() + eps
                )
                if adam_w_mode:
                    update = update + wd * p[gi][i]
                ratio = lr
                p_norm, u_norm = float(p[gi][i].norm()), float(update.norm())
                if (use_nvlamb or wd != 0) and p_norm != 0 and u_norm != 0:
                    ratio = lr * p_norm / u_norm
                p[gi][i] = p[gi][i] - ratio * update
    return [t for g in p for t in g]


@pytest.mark.parametrize("adam_w_mode", [True, False])
@pytest.mark.parametrize("grad_averaging", [True, False])
@pytest.mark.parametrize("max_grad_norm", [0.5, 100.0])  # pre-normalisation on, and off
@pytest.mark.parametrize("use_nvlamb", [False, True])
def test_fused_lamb_is_apex_lamb(adam_w_mode, grad_averaging, max_grad_norm, use_nvlamb):
    params, grads = _params_and_grads(torch.float32)
    groups = [
        {"params": params[:2], "lr": 0.02, "weight_decay": 0.1},
        {"params": params[2:], "lr": 0.05, "weight_decay": 0.0},  # no trust ratio unless nvlamb
    ]
    options = dict(betas=(0.8, 0.9), eps=1e-6, max_grad_norm=max_grad_norm)
    optimizer = FusedLAMB(
        groups,
        adam_w_mode=adam_w_mode,
        grad_averaging=grad_averaging,
        use_nvlamb=use_nvlamb,
        **options,
    )
    expected = _reference_lamb(
        groups,
        grads,
        adam_w_mode=adam_w_mode,
        grad_averaging=grad_averaging,
        use_nvlamb=use_nvlamb,
        **options,
    )
    found = _run(optimizer, params, grads)
    for f, e in zip(found, expected):
        torch.testing.assert_close(f, e, rtol=1e-5, atol=1e-6)


def test_fused_sgd_is_torch_sgd_bit_for_bit():
    params, grads = _params_and_grads(torch.float32)
    twins = [p.detach().clone().requires_grad_() for p in params]
    options = dict(lr=0.1, momentum=0.9, weight_decay=0.01, nesterov=True)
    found = _run(FusedSGD(params, **options), params, grads)
    expected = _run(torch.optim.SGD(twins, **options), twins, grads)
    assert all(torch.equal(f, e) for f, e in zip(found, expected))
    optimizer = FusedSGD(params, lr=0.1)
    optimizer.zero_grad()
    assert all(torch.equal(p.grad, torch.zeros_like(p)) for p in params)  # set_grad_none=False


@pytest.mark.parametrize("optimizer_class", [FusedAdam, FusedLAMB])
def test_a_refused_parameter_in_a_later_group_changes_nothing(optimizer_class):
    good, bad = (
        torch.ones(2, requires_grad=True),
        torch.ones(2, dtype=torch.float64, requires_grad=True),
    )
    optimizer = optimizer_class([{"params": [good]}, {"params": [bad]}], lr=0.1)
    good.grad, bad.grad = torch.ones(2), torch.ones(2, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="got torch.float64"):
        optimizer.step()
    assert torch.equal(good, torch.ones(2)) and "step" not in optimizer.param_groups[0]


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda p: FusedAdam(p, amsgrad=True), "AMSGrad"),
        (lambda p: FusedLAMB(p, amsgrad=True), "AMSGrad"),
        (lambda p: FusedAdam(p, master_weights=True), "opt_level='O2'"),
        (lambda p: FusedLAMB(p, max_grad_norm=0.0), "max_grad_norm must be positive"),
        (lambda p: FusedSGD(p, lr=0.1, wd_after_momentum=True), "wd_after_momentum"),
        (lambda p: FusedAdam(p).step(scale=128.0), r"step\(\) takes no scale"),
    ],
)
def test_apex_optimizer_arguments_that_change_results_are_refused(make, match):
    params = [torch.ones(2, requires_grad=True)]
    with pytest.raises((RuntimeError, ValueError), match=match):
        make(params)
    assert torch.equal(params[0], torch.ones(2))


# --- LARC ------------------------------------------------------------------------------------


def _reference_larc_sgd(params, grads, lr, weight_decay, trust, clip, eps):
    """LARC (arXiv:1708.03888) around plain SGD: weight decay folded into the gradient and the
    step size lr * min(local_lr / lr, 1) (clip) or lr * local_lr (scale)."""
    p = [t.detach().double() for t in params]
    for step_grads in grads:
        for i, grad in enumerate(step_grads):
            g = grad.double()
            p_norm, g_norm = float(p[i].norm()), float(g.norm())
            if p_norm != 0 and g_norm != 0:
                local_lr = trust * p_norm / (g_norm + p_norm * weight_decay + eps)
                factor = min(local_lr / lr, 1.0) if clip else local_lr
                g = (g + weight_decay * p[i]) * factor
            p[i] = p[i] - lr * g
    return p


@pytest.mark.parametrize("clip", [True, False])
def test_larc_is_the_published_algorithm_and_restores_weight_decay(clip):
    params, grads = _params_and_grads(torch.float32)
    grads[1][1] = torch.zeros_like(grads[1][1])  # a zero gradient norm: plain SGD step, no decay
    options = dict(lr=0.5, weight_decay=0.01)
    expected = _reference_larc_sgd(params, grads, trust=0.02, clip=clip, eps=1e-8, **options)
    optimizer = LARC(torch.optim.SGD(params, **options), trust_coefficient=0.02, clip=clip)
    found = _run(optimizer, params, grads)
    for f, e in zip(found, expected):
        torch.testing.assert_close(f, e, rtol=1e-6, atol=1e-7)
    assert optimizer.param_groups[0]["weight_decay"] == 0.01
    assert optimizer.state_dict()["param_groups"][0]["weight_decay"] == 0.01


# --- SyncBatchNorm and the layer norms --------------------------------------------------------


def test_sync_batchnorm_alone_is_batchnorm_with_apex_channel_last_and_fuse_relu():
    torch.manual_seed(0)
    plain = torch.nn.BatchNorm2d(3)
    synced = SyncBatchNorm(3)
    last = SyncBatchNorm(3, channel_last=True)
    fused = SyncBatchNorm(3, fuse_relu=True)
    x, z = torch.randn(4, 3, 5, 5), torch.randn(4, 3, 5, 5)
    expected = plain(x)
    assert torch.equal(synced(x), expected)
    assert torch.equal(last(x.permute(0, 2, 3, 1)), expected.permute(0, 2, 3, 1))
    assert torch.equal(fused(x, z), torch.relu(expected + z))
    for module in (synced, last, fused):
        assert torch.equal(module.running_mean, plain.running_mean)
        assert torch.equal(module.running_var, plain.running_var)


def test_convert_syncbn_model_keeps_statistics_and_weights_and_skips_instance_norm():
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.InstanceNorm2d(4, affine=True)
    )
    model[1].running_mean.fill_(0.5)
    with torch.no_grad():
        model[1].weight.fill_(2.0)
    model.eval()
    before = model(torch.randn(2, 3, 6, 6, generator=torch.Generator().manual_seed(1)))
    converted = convert_syncbn_model(model, channel_last=False)
    assert type(converted[1]) is SyncBatchNorm and isinstance(converted[2], torch.nn.InstanceNorm2d)
    assert converted[1].running_mean is model[1].running_mean and not converted[1].training
    after = converted(torch.randn(2, 3, 6, 6, generator=torch.Generator().manual_seed(1)))
    assert torch.equal(before, after)
    assert type(convert_syncbn_model(torch.nn.BatchNorm1d(3))) is SyncBatchNorm


def test_amp_o2_keeps_apex_sync_batchnorm_in_float32():
    model = convert_syncbn_model(
        torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O2", verbosity=0)
    try:
        assert model[0].weight.dtype is torch.float16 and model[1].weight.dtype is torch.float32
        assert torch.isfinite(model(torch.randn(8, 4))).all()
    finally:
        amp.deinitialize()


def test_fused_norms_are_torch_norms_with_apex_arguments():
    from apex.normalization import (
        FusedLayerNorm,
        FusedRMSNorm,
        MixedFusedLayerNorm,
        MixedFusedRMSNorm,
    )

    x = torch.randn(3, 5, 8)
    layer = FusedLayerNorm(8, eps=1e-6, memory_efficient=True)
    assert torch.equal(layer(x), torch.nn.functional.layer_norm(x, (8,), eps=1e-6))
    assert sorted(layer.state_dict()) == ["bias", "weight"]
    rms = FusedRMSNorm([5, 8], elementwise_affine=False)
    assert torch.equal(rms(x), torch.nn.functional.rms_norm(x, (5, 8), eps=1e-5))
    assert rms.state_dict() == {}
    half = x.half()
    mixed = MixedFusedLayerNorm(8)
    assert mixed.weight.dtype is torch.float32 and mixed(half).dtype is torch.float16
    torch.testing.assert_close(mixed(half).float(), layer(half.float()), rtol=1e-3, atol=2e-3)
    torch.testing.assert_close(
        MixedFusedRMSNorm(8)(half).float(), FusedRMSNorm(8)(half.float()), rtol=1e-3, atol=2e-3
    )


# --- DistributedDataParallel in one process, then with two gloo ranks --------------------------


def _ddp_gradients(**arguments):
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(4, 2), **arguments)
    model(torch.ones(3, 4)).sum().backward()
    return model, model.module.weight.grad


@pytest.mark.parametrize(
    "arguments, factor",
    [
        (dict(), 1.0),
        (dict(delay_allreduce=True, message_size=1, num_allreduce_streams=2, prof=True), 1.0),
        (dict(gradient_predivide_factor=4.0), 1.0),  # divided by 4, then times 4 / world size
        (dict(gradient_average=False, gradient_predivide_factor=4.0), 0.25),  # apex's warning
        (dict(gradient_average_split_factor=2.0, gradient_average=False), 0.5),
        (dict(allreduce_always_fp32=True), 1.0),
    ],
)
def test_ddp_honours_apex_gradient_arithmetic(one_rank_group, arguments, factor):
    _, expected = _ddp_gradients()
    _, found = _ddp_gradients(**arguments)
    torch.testing.assert_close(found, expected * factor, rtol=0, atol=0)


def test_sync_batchnorm_on_cpu_in_a_one_rank_group_is_batchnorm(one_rank_group):
    # torch's SyncBatchNorm raises on CPU once a process group exists, whatever its size.
    torch.manual_seed(0)
    plain, synced = torch.nn.BatchNorm1d(3), SyncBatchNorm(3)
    x = torch.randn(6, 3)
    assert torch.equal(synced(x), plain(x))
    assert torch.equal(synced.running_var, plain.running_var)


def test_ddp_refuses_what_it_cannot_honour_and_toggles_allreduce(one_rank_group):
    module = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="shared_param is not supported"):
        DistributedDataParallel(module, shared_param=True)
    with pytest.raises(ValueError, match="retain_allreduce_buffers=True is not supported"):
        DistributedDataParallel(module, retain_allreduce_buffers=True)
    with pytest.raises(ValueError, match="only valid with delay_allreduce=False"):
        DistributedDataParallel(
            module, delay_allreduce=True, allreduce_trigger_params=[module.weight]
        )
    with pytest.raises(ValueError, match="gradient_predivide_factor must be positive"):
        DistributedDataParallel(module, gradient_predivide_factor=0)
    model = DistributedDataParallel(module, find_unused_parameters=True)  # torch's, passed on
    model.disable_allreduce()
    assert model.require_backward_grad_sync is False
    model.enable_allreduce()
    assert model.require_backward_grad_sync is True


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """Both ranks' results of every scenario of tests/apex_scripts/ddp.py, from one gloo job."""
    out = tmp_path_factory.mktemp("apex_ddp")
    run_two_ranks(os.path.join(SCRIPTS, "ddp.py"), out)
    return [torch.load(out / f"rank{rank}.pt", weights_only=True) for rank in (0, 1)]


@pytest.mark.slow
def test_apex_reducer_averages_over_ranks(ranks):
    for rank in ranks:
        assert torch.equal(rank["reducer"][0], torch.full((3,), 1.5))
        assert torch.equal(rank["reducer"][1], torch.full((2,), 5.0))


@pytest.mark.slow
@pytest.mark.parametrize("scenario", list(ddp_script.SCENARIOS))
def test_apex_ddp_with_sync_batchnorm_matches_one_process(ranks, scenario):
    """Two ranks of B samples with apex's DDP and SyncBatchNorm train as one process on 2B:
    the batch statistics (running_mean/var) are the global batch's."""
    rank0, rank1 = ranks[0][scenario], ranks[1][scenario]
    expected = ddp_script.train(scenario)
    assert sorted(rank0) == sorted(rank1) == sorted(expected)
    for name, value in expected.items():
        assert torch.equal(rank0[name], rank1[name]), name
        # FP16 gradients summed per rank vs over the global batch: a few FP16 ulps apart.
        torch.testing.assert_close(rank0[name], value, rtol=1e-3, atol=5e-4, msg=name)


# --- an apex-style script: two models, three losses ------------------------------------------


@pytest.fixture(scope="module")
def o0_runs():
    return {
        name: two_models.main(["--opt-level", "O0", "--optimizer", name])
        for name in ("adam", "lamb")
    }


@pytest.mark.parametrize("opt_level", ["O0", "O1", "O2", "O3"])
@pytest.mark.parametrize("optimizer", ["adam", "lamb"])
def test_apex_style_script_trains_at_every_level_close_to_o0(o0_runs, opt_level, optimizer):
    found = two_models.main(["--opt-level", opt_level, "--optimizer", optimizer])
    reference = o0_runs[optimizer]
    losses = torch.tensor(found["losses"])
    assert torch.isfinite(losses).all()
    # The same three batches come back every three steps: each loss falls from one pass to the next.
    assert (losses[3:] < losses[:3]).all(), losses
    torch.testing.assert_close(losses, torch.tensor(reference["losses"]), rtol=1e-2, atol=1e-2)
    for name, value in reference["params"].items():
        torch.testing.assert_close(found["params"][name], value, rtol=2e-2, atol=1e-2, msg=name)


@pytest.mark.parametrize("opt_level", ["O0", "O1", "O2", "O3"])
def test_apex_style_script_resumes_bit_for_bit(tmp_path, opt_level):
    checkpoint = str(tmp_path / "checkpoint.pt")
    straight = two_models.main(
        ["--opt-level", opt_level, "--save-at", "3", "--checkpoint", checkpoint]
    )
    resumed = two_models.main(["--opt-level", opt_level, "--resume", checkpoint])
    assert resumed["losses"] == straight["losses"][3:]
    assert resumed["scales"] == straight["scales"][3:]
    for name, value in straight["params"].items():
        assert torch.equal(resumed["params"][name], value), name


def test_apex_style_script_runs_as_a_program_with_the_lamb_optimizer():
    result = subprocess.run(
        [
            sys.executable,
            os.path.join(SCRIPTS, "two_models.py"),
            "--opt-level",
            "O2",
            "--optimizer",
            "lamb",
        ],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    assert len(result.stdout.split()) == 3 and all(
        math.isfinite(float(v)) for v in result.stdout.split()
    )
