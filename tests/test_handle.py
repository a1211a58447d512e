"""scale_loss, master weights and checkpoints: gradients by injection, skipped steps, exact resume."""

import copy
import gc
import logging
import os
import subprocess
import sys
import weakref

import pytest
import torch

import amp
from amp._state import amp_state
from conftest import DTYPES, OPT_LEVELS

HERE = os.path.dirname(__file__)


def make_model(seed=0, batch_norm=False):
    torch.manual_seed(seed)
    layers = [torch.nn.Linear(4, 8)]
    if batch_norm:
        layers.append(torch.nn.BatchNorm1d(8))
    layers += [torch.nn.ReLU(), torch.nn.Linear(8, 2)]
    return torch.nn.Sequential(*layers)


def batch(step, seed=100):
    generator = torch.Generator().manual_seed(seed + step)
    return torch.randn(16, 4, generator=generator), torch.randn(16, 2, generator=generator)


def loss_of(model, step, seed=100):
    x, y = batch(step, seed)
    return ((model(x).float() - y) ** 2).mean()


def inject(param, kind):
    param.grad.view(-1)[0] = float("inf") if kind == "inf" else float("nan")


def snapshot(model, optimizer):
    return copy.deepcopy((model.state_dict(), optimizer.state_dict()))


def assert_equal_states(a, b):
    (model_a, opt_a), (model_b, opt_b) = a, b
    for key in model_a:
        assert torch.equal(model_a[key], model_b[key]), key
    for index in opt_a["state"]:
        for name, value in opt_a["state"][index].items():
            other = opt_b["state"][index][name]
            assert torch.equal(value, other) if isinstance(value, torch.Tensor) else value == other
    masters_a, masters_b = opt_a.get("amp_master_params", {}), opt_b.get("amp_master_params", {})
    assert masters_a.keys() == masters_b.keys()
    for index in masters_a:
        assert torch.equal(masters_a[index], masters_b[index])


# -- exactness against an FP32 reference ------------------------------------------------------------


@pytest.mark.parametrize("delay_first", [False, True])
def test_accumulated_gradients_are_exact(delay_first):
    """O0 with dynamic scaling: two losses per step, unscaled and accumulated bit for bit.

    With delay_unscale the two scaled gradients are summed before one unscale, so gradients that
    existed before are added in another order: exact only without them (as in apex).
    """
    outside_gradients = not delay_first
    model, reference = make_model(), make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    amp.initialize(model, optimizer, opt_level="O0", loss_scale="dynamic", verbosity=0)
    try:
        for step in range(4):
            if outside_gradients:  # kept apart during the scaled backward, then added exactly
                loss_of(model, step, seed=7).backward()
                loss_of(reference, step, seed=7).backward()
            with amp.scale_loss(
                loss_of(model, step), optimizer, delay_unscale=delay_first
            ) as scaled:
                scaled.backward()
            with amp.scale_loss(loss_of(model, step, seed=200), optimizer) as scaled:
                scaled.backward()
            loss_of(reference, step).backward()
            loss_of(reference, step, seed=200).backward()
            for p, q in zip(model.parameters(), reference.parameters()):
                assert torch.equal(p.grad, q.grad)
            optimizer.step()
            reference_optimizer.step()
            optimizer.zero_grad()
            reference_optimizer.zero_grad()
        for p, q in zip(model.parameters(), reference.parameters()):
            assert torch.equal(p, q)
    finally:
        amp.deinitialize()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_o2_master_gradients_are_unscaled_model_gradients(dtype):
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, optimizer, opt_level="O2", dtype=dtype, verbosity=0)
    try:
        reference = copy.deepcopy(model)  # the same low-precision model, no amp
        for hook in list(reference._forward_hooks) + list(reference._forward_pre_hooks):
            reference._forward_hooks.pop(hook, None)
            reference._forward_pre_hooks.pop(hook, None)
        x, y = batch(0)
        ((reference(x.to(dtype)).float() - y) ** 2).mean().backward()
        with amp.scale_loss(loss_of(model, 0), optimizer) as scaled:
            scaled.backward()
        for master, ref in zip(amp.master_params(optimizer), reference.parameters()):
            assert master.grad.dtype is torch.float32
            torch.testing.assert_close(master.grad, ref.grad.float(), rtol=1e-2, atol=1e-3)
        assert all(p.grad is None for p in model.parameters())  # moved into the masters
    finally:
        amp.deinitialize()


# -- overflow: skipped steps change nothing, the scale follows apex's rule ---------------------------


@pytest.mark.parametrize("opt_level", ["O0", "O1", "O2"])
@pytest.mark.parametrize("kind", ["inf", "nan"])
def test_injected_overflows_skip_exactly_those_steps(opt_level, kind):
    model = make_model(batch_norm=True)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    overrides = dict(loss_scale="dynamic") if opt_level == "O0" else {}
    amp.initialize(model, optimizer, opt_level=opt_level, verbosity=0, **overrides)
    try:
        amp_state.loss_scalers[0].growth_interval = 3
        inject_at = {1: "0.weight", 2: "1.bias", 6: "3.bias"}  # two in a row, then one more
        params = dict(model.named_parameters())
        scales = []
        for step in range(9):
            model.eval()  # batch-norm statistics must not move between the snapshots
            with amp.scale_loss(loss_of(model, step), optimizer) as scaled:
                scaled.backward()
                if step in inject_at:
                    inject(params[inject_at[step]], kind)
            before = snapshot(model, optimizer)
            optimizer.step()
            optimizer.zero_grad()
            scales.append(amp.state_dict()["loss_scaler0"])
            if step in inject_at:
                assert_equal_states(before, snapshot(model, optimizer))
                assert amp.last_overflow().params == (inject_at[step],)
                assert amp.last_overflow().loss_id == 0
        expected, scale, unskipped = [], 65536.0, 0
        for step in range(9):
            if step in inject_at:
                scale, unskipped = scale / 2, 0
            else:
                unskipped += 1
                if unskipped == 3:
                    scale, unskipped = scale * 2, 0
            expected.append({"loss_scale": scale, "unskipped": unskipped, "dynamic": True})
        assert scales == expected
    finally:
        amp.deinitialize()


def test_skipped_steps_match_a_reference_that_never_took_them():
    model, reference = make_model(), make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    amp.initialize(model, optimizer, opt_level="O0", loss_scale="dynamic", verbosity=0)
    try:
        for step in range(6):
            with amp.scale_loss(loss_of(model, step), optimizer) as scaled:
                scaled.backward()
                if step in (1, 4):
                    inject(model[0].weight, "nan")
            optimizer.step()
            optimizer.zero_grad()
            if step not in (1, 4):
                loss_of(reference, step).backward()
                reference_optimizer.step()
                reference_optimizer.zero_grad()
        for p, q in zip(model.parameters(), reference.parameters()):
            assert torch.equal(p, q)
    finally:
        amp.deinitialize()


def test_static_scale_never_skips():
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, optimizer, opt_level="O0", loss_scale=128.0, verbosity=0)
    try:
        with amp.scale_loss(loss_of(model, 0), optimizer) as scaled:
            assert scaled.item() == pytest.approx(128 * loss_of(model, 0).item())
            scaled.backward()
            inject(model[0].weight, "inf")
        optimizer.step()
        assert not torch.isfinite(model[0].weight).all()  # static scaling applies what it gets
        assert amp.last_overflow() is None
    finally:
        amp.deinitialize()


def test_identity_scale_yields_the_loss_itself():
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, optimizer, opt_level="O3", verbosity=0)
    try:
        loss = loss_of(model, 0)
        with amp.scale_loss(loss, optimizer) as scaled:
            assert scaled.dtype is torch.float32 and torch.equal(scaled, loss.float())
    finally:
        amp.deinitialize()


# -- several losses and optimizers ---------------------------------------------------------------------


@pytest.mark.parametrize("num_losses", [1, 2])
def test_overflow_skips_only_the_optimizers_of_that_loss(num_losses):
    m0, m1 = make_model(0), make_model(1)
    o0 = torch.optim.SGD(m0.parameters(), lr=0.1, momentum=0.5)
    o1 = torch.optim.SGD(m1.parameters(), lr=0.2, momentum=0.25)
    r0, r1 = make_model(0), make_model(1)
    ro0 = torch.optim.SGD(r0.parameters(), lr=0.1, momentum=0.5)
    ro1 = torch.optim.SGD(r1.parameters(), lr=0.2, momentum=0.25)
    amp.initialize(
        [m0, m1], [o0, o1], opt_level="O0", loss_scale="dynamic", num_losses=num_losses, verbosity=0
    )
    try:
        loss_ids = (0, num_losses - 1)
        overflow_in = {1: 0, 3: 1}  # step -> which loss overflows
        for step in range(5):
            loss0 = loss_of(m0, step) + loss_of(m1, step, seed=300) * 0  # loss0: model 0 only
            with amp.scale_loss(loss0, o0, loss_id=loss_ids[0]) as scaled:
                scaled.backward()
                if overflow_in.get(step) == 0:
                    inject(m0[0].weight, "inf")
            loss1 = loss_of(m1, step, seed=400) + loss_of(m0, step, seed=500)
            with amp.scale_loss(loss1, [o0, o1], loss_id=loss_ids[1]) as scaled:
                scaled.backward()
                if overflow_in.get(step) == 1:
                    inject(m1[2].bias, "nan")
            o0.step()
            o1.step()
            o0.zero_grad()
            o1.zero_grad()
            # reference: an overflow in loss0 skips optimizer 0; in loss1, both
            (loss_of(r0, step) + loss_of(r1, step, seed=300) * 0).backward()
            (loss_of(r1, step, seed=400) + loss_of(r0, step, seed=500)).backward()
            if step not in overflow_in:
                ro0.step()
            if overflow_in.get(step) != 1:
                ro1.step()
            ro0.zero_grad()
            ro1.zero_grad()
        for p, q in zip(
            list(m0.parameters()) + list(m1.parameters()),
            list(r0.parameters()) + list(r1.parameters()),
        ):
            assert torch.equal(p, q)
        scales = [entry["loss_scale"] for entry in amp.state_dict().values()]
        assert scales == ([65536.0 / 4] if num_losses == 1 else [65536.0 / 2, 65536.0 / 2])
    finally:
        amp.deinitialize()


def test_exception_in_the_block_puts_gradients_back():
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, optimizer, opt_level="O0", loss_scale="dynamic", verbosity=0)
    try:
        loss_of(model, 0).backward()
        kept = [p.grad.clone() for p in model.parameters()]
        with pytest.raises(RuntimeError, match="boom"):
            with amp.scale_loss(loss_of(model, 1), optimizer) as scaled:
                scaled.backward()
                raise RuntimeError("boom")
        for param, grad in zip(model.parameters(), kept):
            assert torch.equal(param.grad, grad)
        record = amp_state.optimizers[0]
        assert record.skips.pending == [] and record.stash.frames == []
        assert amp.state_dict()["loss_scaler0"]["loss_scale"] == 65536.0
    finally:
        amp.deinitialize()


# -- errors ---------------------------------------------------------------------------------------------


def test_scale_loss_errors():
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(RuntimeError, match="must be called before `with amp.scale_loss`"):
        with amp.scale_loss(loss_of(model, 0), optimizer):
            pass
    amp.initialize(model, optimizer, verbosity=0)
    try:
        stranger = torch.optim.SGD(make_model(1).parameters(), lr=0.1)
        with pytest.raises(TypeError, match="was not passed to amp.initialize"):
            with amp.scale_loss(loss_of(model, 0), stranger):
                pass
        with pytest.raises(ValueError, match="num_losses=1"):
            with amp.scale_loss(loss_of(model, 0), optimizer, loss_id=1):
                pass
        with pytest.raises(TypeError, match="optimizers must be"):
            with amp.scale_loss(loss_of(model, 0), "optimizer"):
                pass
    finally:
        amp.deinitialize()


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_trace_of_a_training_step_shows_only_the_models_ops(opt_level):
    """amp's own arithmetic (scaling, unscaling, the scale update, master copies) never goes
    through its patches, so a user's trace of a step lists the model's ops and nothing else."""
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = amp.initialize(model, optimizer, opt_level=opt_level, verbosity=0)
    try:
        for step in range(2):
            with amp.trace() as trace:
                optimizer.zero_grad()
                with amp.scale_loss(loss_of(model, step), optimizer) as scaled:
                    scaled.backward()
                optimizer.step()
            assert trace.ops() == (
                ["torch.nn.functional.linear"] * 2 + ["torch.Tensor.__pow__"]
                if opt_level == "O1"
                else []
            )
    finally:
        amp.deinitialize()


@pytest.mark.parametrize("dtype", DTYPES)
def test_backward_frees_the_weight_casts_as_it_goes(dtype):
    """The forward's weight casts are not held through backward: autograd frees each one once
    its node has run, as under torch.autocast (lower peak memory)."""
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, optimizer, opt_level="O1", dtype=dtype, verbosity=0)
    try:
        saved = []

        def keep_a_weakref(tensor):
            if tensor.dtype is dtype:
                saved.append(weakref.ref(tensor))
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(keep_a_weakref, lambda tensor: tensor):
            loss = loss_of(model, 0)
        assert len(amp_state.cast_cache) == 4  # two weights, two biases
        with amp.scale_loss(loss, optimizer) as scaled:
            assert len(amp_state.cast_cache) == 0
            scaled.backward()
            gc.collect()
            assert len(saved) >= 2 and all(ref() is None for ref in saved)
    finally:
        amp.deinitialize()


def test_closures_are_refused():
    model = make_model()
    optimizer = torch.optim.LBFGS(model.parameters())
    amp.initialize(model, optimizer, opt_level="O2", verbosity=0)
    try:
        with pytest.raises(RuntimeError, match="does not support closure"):
            optimizer.step(lambda: loss_of(model, 0))
    finally:
        amp.deinitialize()


# -- O2 master weights ---------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_o2_model_is_masters_rounded_after_every_step(dtype):
    model = make_model(batch_norm=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    fp32_weights = {k: v.clone() for k, v in model.state_dict().items()}
    amp.initialize(model, optimizer, opt_level="O2", dtype=dtype, verbosity=0)
    try:
        state = model.state_dict()
        for key, value in fp32_weights.items():
            assert state[key].dtype is value.dtype and torch.equal(state[key], value)  # exact
        assert model[1].weight.dtype is torch.float32 and model[0].weight.dtype is dtype
        for step in range(3):
            with amp.scale_loss(loss_of(model, step), optimizer) as scaled:
                scaled.backward()
            optimizer.step()
            optimizer.zero_grad()
        masters = list(amp.master_params(optimizer))
        for param, master in zip(model.parameters(), masters):
            assert torch.equal(param, master.to(param.dtype))
        assert torch.equal(model.state_dict()["0.weight"], masters[0])  # the masters, not upcasts
        assert model(batch(0)[0]).dtype is torch.float32
    finally:
        amp.deinitialize()


def test_o2_add_param_group_creates_masters_and_zero_grad():
    model = make_model()
    fp32_weight = model[2].weight.detach().clone()
    optimizer = torch.optim.SGD(model[0].parameters(), lr=0.1, momentum=0.9)
    amp.initialize(model, optimizer, opt_level="O2", verbosity=0)
    try:
        optimizer.add_param_group({"params": model[2].parameters(), "lr": 0.05})
        masters = optimizer.param_groups[1]["params"]
        assert all(m.dtype is torch.float32 for m in masters)
        assert torch.equal(masters[0], fp32_weight)  # the exact FP32 value, kept while frozen
        with pytest.raises(TypeError, match="ordered collections"):
            optimizer.add_param_group({"params": {torch.nn.Parameter(torch.ones(1))}})
        for step in range(2):
            with amp.scale_loss(loss_of(model, step), optimizer) as scaled:
                scaled.backward()
            assert all(m.grad is not None for m in masters)
            optimizer.step()
        assert torch.equal(model[2].weight, masters[0].half())
        with amp.scale_loss(loss_of(model, 3), optimizer) as scaled:
            scaled.backward()
        optimizer.zero_grad(set_to_none=False)
        assert all(m.grad is None or not m.grad.any() for m in amp.master_params(optimizer))
    finally:
        amp.deinitialize()


@pytest.mark.parametrize("scheduler_first", [False, True])
def test_lr_scheduler_sees_no_overridden_step(recwarn, scheduler_first):
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    if scheduler_first:
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    amp.initialize(model, optimizer, opt_level="O2", verbosity=0)
    try:
        if not scheduler_first:
            scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        for step in range(3):
            with amp.scale_loss(loss_of(model, step), optimizer) as scaled:
                scaled.backward()
                if step == 0:
                    inject(model[0].weight, "inf")  # a skipped first step
            optimizer.step()
            scheduler.step()
        assert optimizer.param_groups[0]["lr"] == 0.1 * 0.5**3
    finally:
        amp.deinitialize()
    assert not [
        w for w in recwarn if "lr_scheduler" in str(w.message) or "overridden" in str(w.message)
    ]
    assert "step" not in vars(optimizer) or getattr(optimizer.step, "_wrapped_by_lr_sched", False)


def test_verbosity_two_names_the_parameters(caplog):
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, optimizer, opt_level="O2", verbosity=2)
    try:
        with caplog.at_level(logging.INFO, logger="amp"):
            with amp.scale_loss(loss_of(model, 0), optimizer) as scaled:
                scaled.backward()
                inject(model[2].weight, "inf")
            optimizer.step()
    finally:
        amp.deinitialize()
    assert (
        "Gradient overflow.  Skipping step, loss scaler 0 reducing loss scale to 32768.0; "
        "non-finite gradients in: 2.weight" in caplog.text
    )


# -- checkpoints -----------------------------------------------------------------------------------------


def test_optimizer_state_dict_carries_masters_and_malformed_ones_change_nothing():
    model = make_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    amp.initialize(model, optimizer, opt_level="O2", verbosity=0)
    try:
        with amp.scale_loss(loss_of(model, 0), optimizer) as scaled:
            scaled.backward()
        optimizer.step()
        saved = copy.deepcopy(optimizer.state_dict())
        assert set(saved["amp_master_params"]) == {0, 1, 2, 3}
        before = snapshot(model, optimizer)
        bad = copy.deepcopy(saved)
        bad["amp_master_params"][1] = torch.zeros(3)
        with pytest.raises(ValueError, match="master weight 1 has shape"):
            optimizer.load_state_dict(bad)
        bad["amp_master_params"] = {9: torch.zeros(8, 4)}
        with pytest.raises(ValueError, match="not an O2 master here"):
            optimizer.load_state_dict(bad)
        assert_equal_states(before, snapshot(model, optimizer))
        with amp.scale_loss(loss_of(model, 1), optimizer) as scaled:
            scaled.backward()
        optimizer.step()
        optimizer.load_state_dict(saved)
        assert_equal_states(before, snapshot(model, optimizer))
    finally:
        amp.deinitialize()


def test_o2_checkpoint_loads_into_plain_fp32_training():
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    amp.initialize(model, optimizer, opt_level="O2", verbosity=0)
    try:
        with amp.scale_loss(loss_of(model, 0), optimizer) as scaled:
            scaled.backward()
        optimizer.step()
        model_state, optimizer_state = copy.deepcopy((model.state_dict(), optimizer.state_dict()))
        masters = [m.detach().clone() for m in amp.master_params(optimizer)]
    finally:
        amp.deinitialize()
    plain = make_model(5)
    plain_optimizer = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9)
    plain.load_state_dict(model_state)
    plain_optimizer.load_state_dict(optimizer_state)
    for param, master in zip(plain.parameters(), masters):
        assert torch.equal(param, master)


@pytest.mark.parametrize("opt_level", OPT_LEVELS)
def test_resume_in_a_fresh_process_is_bit_identical(tmp_path, opt_level):
    from resume_helper import train

    uninterrupted = train(opt_level, steps=range(0, 8))
    checkpoint = tmp_path / "checkpoint.pt"
    train(opt_level, steps=range(0, 4), save_to=checkpoint)
    result = tmp_path / "result.pt"
    completed = subprocess.run(
        [
            sys.executable,
            os.path.join(HERE, "resume_helper.py"),
            opt_level,
            str(checkpoint),
            str(result),
        ],
        capture_output=True,
        text=True,
        cwd=HERE,
    )
    assert completed.returncode == 0, completed.stderr
    resumed = torch.load(result, weights_only=True)
    assert all(torch.isfinite(v).all() for v in uninterrupted["model"].values())
    assert resumed["amp"] == uninterrupted["amp"]
    for key, value in uninterrupted["model"].items():
        assert torch.equal(resumed["model"][key], value), key
    for key, value in uninterrupted["masters"].items():
        assert torch.equal(resumed["masters"][key], value), key


def test_o2_masters_follow_writes_from_outside_amp():
    """DataParallel's initial broadcast or a user's copy_ write the FP16 model after initialize."""
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, optimizer, opt_level="O2", verbosity=0)
    try:
        with torch.no_grad():
            model[0].weight.copy_(torch.full_like(model[0].weight, 0.25))
        exact = {k: v.clone() for k, v in make_model(3).state_dict().items()}
        with amp.scale_loss(loss_of(model, 0), optimizer) as scaled:
            masters = list(amp.master_params(optimizer))
            assert torch.equal(masters[0], torch.full_like(masters[0], 0.25))
            scaled.backward()
        optimizer.step()
        model.load_state_dict(exact)  # a load is amp's own write: the masters stay exact
        with amp.scale_loss(loss_of(model, 1), optimizer) as scaled:
            for master, key in zip(amp.master_params(optimizer), exact):
                assert torch.equal(master, exact[key])
            scaled.backward()
    finally:
        amp.deinitialize()


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_sparse_gradients(opt_level):
    torch.manual_seed(0)
    embedding = torch.nn.Embedding(20, 4, sparse=True)
    reference = copy.deepcopy(embedding)
    optimizer = torch.optim.SGD(embedding.parameters(), lr=0.5)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.5)
    amp.initialize(embedding, optimizer, opt_level=opt_level, verbosity=0)
    try:
        tokens = torch.tensor([[1, 2, 2], [7, 1, 0]])
        for step in range(3):
            embedding(tokens[:1]).float().square().sum().backward()  # kept apart, added back
            with amp.scale_loss(embedding(tokens).float().square().mean(), optimizer) as scaled:
                scaled.backward()
                if step == 1:
                    grad = embedding.weight.grad
                    (grad._values() if grad.is_sparse else grad).view(-1)[0] = float("nan")
            optimizer.step()
            optimizer.zero_grad()
            if step != 1:
                reference(tokens[:1]).float().square().sum().backward()
                reference(tokens).float().square().mean().backward()
                reference_optimizer.step()
            reference_optimizer.zero_grad()
        assert amp.last_overflow().params == ("weight",)
        tolerance = dict(rtol=0, atol=0) if opt_level == "O1" else dict(rtol=2e-3, atol=2e-3)
        torch.testing.assert_close(embedding.weight.float(), reference.weight, **tolerance)
    finally:
        amp.deinitialize()
