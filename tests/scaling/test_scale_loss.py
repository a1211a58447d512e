"""amp.scale_loss (amp/scaling/handle.py) and the skip it decides: gradients by injection,
skipped steps that change nothing, several losses and optimizers, sparse and complex gradients,
refused arguments, and what a step costs in Python calls."""

import copy
import sys

import pytest
import torch

import amp
from amp._state import amp_state
from helpers import ROOT
from helpers.models import inject, loss_of, make_model, make_stack
from helpers.o2 import setup, train_step
from helpers.state import assert_equal_states, assert_same, everything, grads, snapshot
from helpers.state import step_cleanly


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


def test_static_scale_never_skips(trained):
    model, optimizer = trained("O0", momentum=0.0, loss_scale=128.0)
    with amp.scale_loss(loss_of(model, 0), optimizer) as scaled:
        assert scaled.item() == pytest.approx(128 * loss_of(model, 0).item())
        scaled.backward()
        inject(model[0].weight, "inf")
    optimizer.step()
    assert not torch.isfinite(model[0].weight).all()  # static scaling applies what it gets
    assert amp.last_overflow() is None


def test_identity_scale_yields_the_loss_itself(trained):
    model, optimizer = trained("O3", momentum=0.0)
    loss = loss_of(model, 0)
    with amp.scale_loss(loss, optimizer) as scaled:
        assert scaled.dtype is torch.float32 and torch.equal(scaled, loss.float())


def test_an_overflow_then_an_interrupt_does_not_skip_the_next_clean_step(trained):
    model, optimizer = trained("O1")
    try:
        with amp.scale_loss(loss_of(model, 0), optimizer) as scaled:
            scaled.backward()
            model[0].weight.grad.view(-1)[0] = float("inf")
        raise KeyboardInterrupt  # Ctrl-C before optimizer.step()
    except KeyboardInterrupt:
        pass
    optimizer.zero_grad()
    before = [p.detach().clone() for p in model.parameters()]
    step_cleanly(model, optimizer, 1)
    assert all(not torch.equal(p, b) for p, b in zip(model.parameters(), before))
    assert amp.last_overflow() is None


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
        assert amp.state_dict()["loss_scaler0"]["loss_scale"] == 65536.0
        # Nothing of the failed block is left pending: the next block adds its gradients to the
        # kept ones exactly, and its step is taken.
        reference = make_model()
        loss_of(reference, 2).backward()
        with amp.scale_loss(loss_of(model, 2), optimizer) as scaled:
            scaled.backward()
        for param, grad, extra in zip(model.parameters(), kept, reference.parameters()):
            assert torch.equal(param.grad, grad + extra.grad)
        weights = [param.detach().clone() for param in model.parameters()]
        optimizer.step()
        assert amp.last_overflow() is None
        assert all(not torch.equal(p, w) for p, w in zip(model.parameters(), weights))
        assert amp.state_dict()["loss_scaler0"] == {
            "loss_scale": 65536.0,
            "unskipped": 1,
            "dynamic": True,
        }
    finally:
        amp.deinitialize()


# -- sparse and complex gradients ----------------------------------------------------------------------


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


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_complex_parameters_are_unscaled_and_checked(opt_level):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    model.phase = torch.nn.Parameter(torch.randn(4, dtype=torch.complex64))
    reference = copy.deepcopy(model)

    def loss_of_complex(module):
        out = module(torch.ones(2, 4)).float()
        return (out * module.phase).abs().mean()

    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, optimizer, opt_level=opt_level, verbosity=0)
    try:
        with amp.scale_loss(loss_of_complex(model), optimizer) as scaled:
            scaled.backward()
        loss_of_complex(reference).backward()
        torch.testing.assert_close(model.phase.grad, reference.phase.grad, rtol=1e-2, atol=1e-3)
        for grad in grads(model, optimizer):
            if grad is not None:
                assert grad.abs().max() < 100  # unscaled, not 65536 times too large
        optimizer.zero_grad()
        before = model.phase.detach().clone()
        with amp.scale_loss(loss_of_complex(model), optimizer) as scaled:
            scaled.backward()
            model.phase.grad[0] = complex(float("inf"), 0.0)
        optimizer.step()
        assert torch.equal(model.phase, before) and amp.last_overflow().params == ("phase",)
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


def test_scale_loss_before_initialize_says_so_with_matched_quotes():
    with pytest.raises(RuntimeError) as refused:
        with amp.scale_loss(torch.ones(()), torch.optim.SGD([torch.ones(1)], lr=0.1)):
            pass
    message = str(refused.value)
    assert message.startswith("Invoked `with amp.scale_loss`, but")
    assert message.count("`") % 2 == 0 and "'" not in message.split(",")[0]


def test_an_empty_optimizer_list_is_refused_and_changes_nothing(trained):
    model, optimizer = trained("O1")
    before = everything(model, optimizer)
    with pytest.raises(ValueError, match="optimizers is empty.*Pass the optimizer"):
        with amp.scale_loss(loss_of(model, 0), []) as scaled:
            scaled.backward()
    assert_same(before, everything(model, optimizer))


class _Int(int):
    pass


@pytest.mark.usefixtures("deinitialized")
@pytest.mark.parametrize(
    "loss_id",
    [2, -1, -2, True, False, 2**70, -(2**70), 1.0, "0", None, torch.tensor(1), "np.int64"],
)
def test_a_loss_id_that_is_no_int_below_num_losses_is_refused_and_changes_nothing(loss_id):
    """Bools, negative ids (which a list would index from the end), ids too large for an index,
    and non-ints are refused before any gradient is taken; an int subclass below num_losses is
    taken."""
    if loss_id == "np.int64":
        np = pytest.importorskip("numpy")
        loss_id = np.int64(1)
    model, optimizer = setup(optimizer_class=torch.optim.SGD, num_losses=2)
    train_step(model, optimizer)
    loss = model(torch.randn(8, 4)).float().sum()
    loss.backward(retain_graph=True)
    grads = [p.grad.clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=r"num_losses=2, so use 0 to 1"):
        with amp.scale_loss(loss, optimizer, loss_id=loss_id) as scaled:
            scaled.backward()
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads))
    optimizer.zero_grad()
    with amp.scale_loss(loss * 1e-4, optimizer, loss_id=_Int(1)) as scaled:  # no overflow
        scaled.backward()
    # Nothing of the refused block was kept aside to come back: the masters hold this block's
    # gradients alone (the plain backward's as well if the refused block had kept them).
    for master, grad in zip(amp.master_params(optimizer), grads):
        torch.testing.assert_close(master.grad, grad.float() * 1e-4, rtol=1e-2, atol=1e-6)
    optimizer.step()
    assert amp.last_overflow() is None


# -- host work ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_gradients_are_never_compared_with_equality(monkeypatch, opt_level):
    """`None in grads` or `grads.count(None)` runs Tensor.__eq__ per gradient (some 20 us each):
    amp tests for absent gradients by identity."""
    model = make_stack(3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model, optimizer = amp.initialize(
        model, optimizer, opt_level=opt_level, dtype=torch.bfloat16, verbosity=0
    )
    compared = []
    original = torch.Tensor.__eq__

    def counting(self, other):
        compared.append(other)
        return original(self, other)

    try:
        monkeypatch.setattr(torch.Tensor, "__eq__", counting)
        for _ in range(2):  # the second block finds the first one's gradients (accumulation)
            loss = model(torch.randn(8, 4)).float().square().mean()
            with amp.scale_loss(loss, optimizer) as scaled:
                scaled.backward()
        optimizer.step()
        monkeypatch.undo()
        assert compared == []
    finally:
        amp.deinitialize()


@pytest.mark.parametrize("opt_level", ["O0", "O1", "O2", "O3"])
def test_loss_scaling_costs_no_more_calls_than_torchs_grad_scaler(opt_level):
    """At 10 parameter tensors, amp's scale_loss + step make no more Python calls than torch's
    GradScaler: the kernels' one-device path, the scaler's tensors read without a call,
    is_distributed() without torch.distributed's four calls; at O2 (an fp16 model: FP32 masters)
    also the master gradients sliced once per model, the state entries read once a step, and the
    model's writes checked and marked in one batch."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from measure import scaling_calls

    dtype = torch.float16 if opt_level == "O2" else torch.bfloat16
    amp_adds, torch_adds = scaling_calls(opt_level, dtype)
    assert amp_adds <= torch_adds, (amp_adds, torch_adds)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_an_o2_step_costs_no_more_calls_with_more_parameters(dtype):
    """O2's fused step makes a fixed number of Python calls whatever the parameter count (a bf16
    model's exact masters decoded and encoded in one buffer), where torch's own step and
    GradScaler make more with every tensor."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from measure import scaling_calls

    few, many = (scaling_calls("O2", dtype, layers=layers)[0] for layers in (5, 20))
    assert many <= few, (few, many)
