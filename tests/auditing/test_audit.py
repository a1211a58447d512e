"""amp.audit (amp/auditing/audit.py, report.py): each module in FP32 and in low precision,
worst first; nothing changed afterwards."""

import copy
import random
import warnings

import pytest
import torch

import amp
from amp.auditing.report import AuditReport, AuditRow
from helpers.models import overflowing_net


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(8, 16)
        self.norm = torch.nn.BatchNorm1d(16)
        self.big = torch.nn.Linear(16, 16)
        self.drop = torch.nn.Dropout(0.5)
        self.head = torch.nn.Linear(16, 1)

    def forward(self, x):
        return self.head(self.drop(torch.relu(self.big(self.norm(self.inp(x))))))


def make(scale_big=1.0):
    torch.manual_seed(0)
    model = Net()
    with torch.no_grad():
        model.big.weight.mul_(scale_big)
    return model


X = torch.randn(32, 8, generator=torch.Generator().manual_seed(1))


def loss_fn(model):
    return lambda: model(X).float().pow(2).mean()


def test_a_module_that_overflows_float16_comes_first_and_is_suggested():
    model = make(scale_big=1e5)
    report = amp.audit(loss_fn(model), model)
    first = report.rows[0]
    assert first.module == "big" and first.op == "Linear"
    assert first.overflows and first.headroom < 1 and first.relative_error == float("inf")
    # What follows it overflows too (its FP32 values are beyond float16): the head, a Linear
    # that O1 runs in float16, must stay FP32 as well; the model itself is left out.
    assert report.keep_fp32()[0] == "big" and "head" in report.keep_fp32()
    assert "" not in report.keep_fp32()
    advice = report.suggest()
    assert "keep big (Linear) in FP32: its output overflows float16" in advice
    assert "fp32_modules=['big', " in advice
    table = str(report)
    assert table.splitlines()[0].startswith("amp.audit: float16 against float32")
    assert all(name in table for name in ("big", "inp", "norm", "drop", "head", "(model)"))


def test_a_healthy_model_needs_nothing_and_both_runs_share_the_dropout_mask():
    model = make()
    report = amp.audit(loss_fn(model), model, dtype=torch.bfloat16)
    assert report.keep_fp32() == []
    assert "Nothing needs to stay in FP32" in report.suggest()
    # Different dropout masks would make the error of order 1, not bfloat16's rounding.
    assert report.row("drop").relative_error < 0.02
    assert report.row("head").calls == 1


def test_the_suggestion_works_when_applied():
    """Without fp32_modules the broken layer makes every step skip; with the audit's, none."""
    skipped = {}
    for keep in (False, True):
        model = make(scale_big=1e5)
        fp32 = amp.audit(loss_fn(model), model).keep_fp32() if keep else None
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-12)
        model, optimizer = amp.initialize(
            model, optimizer, opt_level="O1", verbosity=0, fp32_modules=fp32
        )
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                skipped[keep] = 0
                for _ in range(3):
                    optimizer.zero_grad()
                    with amp.scale_loss(loss_fn(model)(), optimizer) as scaled:
                        scaled.backward()
                    optimizer.step()
                    report, amp._state.amp_state.last_overflow = amp.last_overflow(), None
                    skipped[keep] += report is not None and report.nonfinite_loss
        finally:
            amp.deinitialize()
        assert bool(caught) is not keep
    assert skipped == {False: 3, True: 0}


def test_weights_buffers_rng_grads_and_optimizer_are_untouched_bit_for_bit():
    model = make(scale_big=1e5)  # an overflow in the low-precision run changes nothing either
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    loss_fn(model)().backward()
    optimizer.step()  # real optimizer state and real gradients to keep
    model.head.bias.grad = None  # and a missing one
    state = copy.deepcopy(model.state_dict())  # batch norm's running stats included
    grads = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
    versions = [p._version for p in model.parameters()]
    optimizer_state = copy.deepcopy(optimizer.state_dict())
    torch_rng, python_rng = torch.get_rng_state(), random.getstate()
    report = amp.audit(loss_fn(model), model)
    assert report.rows
    for key, value in model.state_dict().items():
        assert torch.equal(value, state[key]), key
    for param, grad in zip(model.parameters(), grads):
        assert (param.grad is None) if grad is None else torch.equal(param.grad, grad)
    assert [p._version for p in model.parameters()] == versions  # not even rewritten
    assert torch.equal(torch.get_rng_state(), torch_rng) and random.getstate() == python_rng
    after = optimizer.state_dict()
    for index, entry in optimizer_state["state"].items():
        for name, value in entry.items():
            assert torch.equal(value, after["state"][index][name])
    assert model.training


def test_gradient_underflow_depends_on_the_loss_scale():
    model = make()

    def tiny():
        return model(X).float().mean() * 1e-9

    low = amp.audit(tiny, model, loss_scale=1.0).row("big").grad_underflow
    high = amp.audit(tiny, model, loss_scale=2.0**24).row("big").grad_underflow
    assert low > 0.5 and high == 0.0
    assert "partly underflow" in amp.audit(tiny, model, loss_scale=1.0).suggest()


def test_at_o1_the_audit_runs_and_leaves_o1_as_it_was():
    model = make()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O1", verbosity=0)
    try:
        report = amp.audit(loss_fn(model), model)
        assert report.loss_scale == 2.0**16  # amp's current scale
        assert report.row("big").relative_error > 0  # the low run did cast
        with amp.trace() as trace:
            model(X)
        assert trace.records[0].ran_in is torch.float16  # O1 still casts
    finally:
        amp.deinitialize()


def test_bad_arguments():
    model = make()
    with pytest.raises(TypeError, match="callable"):
        amp.audit(model(X), model)
    with pytest.raises(TypeError, match="torch.nn.Module"):
        amp.audit(loss_fn(model), [model])
    with pytest.raises(ValueError, match="float16 or torch.bfloat16"):
        amp.audit(loss_fn(model), model, dtype=torch.float32)
    with pytest.raises(ValueError, match="finite and positive"):
        amp.audit(loss_fn(model), model, loss_scale=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O2", verbosity=0)
    try:
        with pytest.raises(RuntimeError, match="needs the FP32 model"):
            amp.audit(loss_fn(model), model)
    finally:
        amp.deinitialize()


def row(name, headroom=1e4, underflow=0.0, order=0):
    return AuditRow(name, "Linear", 1, headroom, 0.0, underflow, None, order)


def test_keep_fp32_names_a_parent_whose_parts_all_need_it_and_never_the_model():
    rows = [
        row("", headroom=0.5),
        row("a", headroom=0.5),
        row("a.x", headroom=0.5),
        row("a.y", underflow=0.2),
        row("b", headroom=0.5),
        row("b.x", headroom=0.5),
        row("b.y"),  # healthy: b is not kept whole, only b.x
        row("c"),
    ]
    report = AuditReport(rows, torch.float16, 1.0, 0.0, 0.0)
    assert sorted(report.keep_fp32()) == ["a", "b.x"]


class _Smoothed(torch.nn.Module):
    """A forward that assigns new tensors to its buffers, as user code often does."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.register_buffer("calls", torch.zeros(()))
        self.register_buffer("offset", torch.zeros(4))

    def forward(self, x):
        self.calls = self.calls + 1
        self.offset = self.offset + 1.0
        return self.lin(x) + self.offset


def test_audit_puts_back_buffers_a_forward_reassigns_and_compares_from_the_same_start():
    torch.manual_seed(0)
    model = torch.nn.Sequential(_Smoothed(), torch.nn.Linear(4, 1))
    x = torch.randn(8, 4)
    slots = dict(model[0]._buffers)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    report = amp.audit(lambda: model(x).pow(2).mean(), model)
    assert all(model[0]._buffers[k] is v for k, v in slots.items())
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    # Both runs started from offset 0: float16 differs from FP32 by rounding only.
    assert report.row("0").relative_error < 1e-2


def test_the_audits_advice_says_o2_casts_a_kept_overflowing_output_back():
    model, x, y = overflowing_net()
    report = amp.audit(lambda: torch.nn.functional.cross_entropy(model(x), y), model)
    assert report.keep_fp32() == ["body"]
    advice = report.suggest()
    assert "At O2/O3" in advice and "train at O1" in advice
