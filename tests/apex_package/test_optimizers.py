"""apex.optimizers and apex.parallel.LARC from the apex package, against formulas written here
from the published algorithms (per tensor, in float64)."""

import copy
import math

import pytest
import torch
from apex.optimizers import FusedAdam, FusedLAMB, FusedSGD
from apex.parallel.LARC import LARC


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
