"""Hostile round on the apex package and the diagnostics: each test is a defect a user hit."""

import warnings

import pytest
import torch

import amp
from amp._state import amp_state

apex = pytest.importorskip("apex", reason="needs amp's apex package: pip install -e ./compat/apex")
from apex.parallel import convert_syncbn_model  # noqa: E402


@pytest.fixture(autouse=True)
def clean_amp():
    yield
    amp.deinitialize()
    amp_state.origin_watch.disarm()
    amp_state.last_overflow = None


# --- apex.parallel.convert_syncbn_model ------------------------------------------------------


def test_convert_syncbn_model_keeps_the_layers_dtype_and_frozen_weights():
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(4, 6), torch.nn.Sequential(torch.nn.BatchNorm1d(6), torch.nn.ReLU())
    ).double()
    model[1][0].weight.requires_grad_(False)
    x = torch.randn(5, 4, dtype=torch.float64)
    expected = model(x)  # training mode: batch statistics, running stats updated once
    model[1][0].running_mean.zero_()
    model[1][0].running_var.fill_(1.0)
    model[1][0].num_batches_tracked.zero_()
    converted = convert_syncbn_model(model)
    bn = converted[1][0]
    assert type(bn) is apex.parallel.SyncBatchNorm
    assert bn.weight.dtype is bn.bias.dtype is torch.float64
    assert not bn.weight.requires_grad and bn.bias.requires_grad
    assert torch.equal(converted(x), expected)
    assert [p for p in converted.parameters() if p.requires_grad] == [
        converted[0].weight,
        converted[0].bias,
        bn.bias,
    ]


# --- the origin watch when no step ends it ---------------------------------------------------


def _small_net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


def _skip_last_step(opt_level="O1"):
    """Train two steps, the last one skipped (loss * inf): the watch is armed, no step follows."""
    model = _small_net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = amp.initialize(model, optimizer, opt_level=opt_level, verbosity=0)
    x = torch.randn(16, 4)
    for factor in (1.0, float("inf")):
        optimizer.zero_grad()
        loss = model(x).float().pow(2).mean() * factor
        with amp.scale_loss(loss, optimizer) as scaled:
            scaled.backward()
        optimizer.step()
    assert amp.last_overflow() is not None and amp_state.origin_watch.armed
    return model, optimizer, x


def test_evaluation_after_a_skipped_last_step_holds_a_bounded_number_of_checks():
    model, _, x = _skip_last_step()
    model.eval()
    with torch.no_grad():
        for _ in range(1500):  # 4 module outputs each: 6000 checks
            model(x)
    assert len(amp_state.origin_watch._events) < 4096


def test_checks_read_without_a_step_keep_the_first_bad_one_and_stop_watching(monkeypatch):
    from amp.diagnostics import origin
    from torch.nn.modules import module as nn_module

    monkeypatch.setattr(origin, "_HELD", 8)
    model, optimizer, x = _skip_last_step("O2")
    with torch.no_grad():
        for _ in range(5):  # 20 clean checks: read and dropped twice, still watching
            model(x)
    assert amp_state.origin_watch.armed and len(nn_module._global_forward_hooks) == 1
    with torch.no_grad():
        model[2].weight.mul_(1e6)  # float16 overflows in the last layer from here on
    optimizer.zero_grad()
    loss = model(x).float().pow(2).mean()
    with amp.scale_loss(loss, optimizer) as scaled:
        scaled.backward()  # more than 8 checks in all: read inside backward's hooks
    assert len(nn_module._global_forward_hooks) == 0  # found: nothing more is watched
    assert not any(p._backward_hooks for p in model.parameters())
    optimizer.step()
    origin_found = amp.last_overflow().origin
    assert (origin_found.module, origin_found.phase) == ("2", "forward")


# --- amp.audit -------------------------------------------------------------------------------


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


def test_an_audit_between_a_skip_and_the_watched_step_is_not_taken_for_that_step():
    model, optimizer, x = _skip_last_step()  # the next step is watched
    # What the warning advises: audit, here on a batch that overflows the first layer.
    amp.audit(lambda: model(x * 1e5).float().pow(2).mean(), model)
    with torch.no_grad():
        model[2].weight.mul_(1e6)  # what goes wrong in the watched step: the last layer
    optimizer.zero_grad()
    loss = model(x).float().pow(2).mean()
    with amp.scale_loss(loss, optimizer) as scaled:
        scaled.backward()
    optimizer.step()
    found = amp.last_overflow().origin
    assert (found.module, found.phase) == ("2", "forward")


# --- fp32_modules at O2/O3: a kept module whose output overflows the model dtype -------------


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Linear(8, 16)
        self.body = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.GELU())
        self.norm = torch.nn.LayerNorm(16)
        self.head = torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.head(self.norm(self.body(self.embed(x))))


def _overflowing_net():
    torch.manual_seed(0)
    model = _Net()
    with torch.no_grad():
        model.body[0].weight.mul_(1e5)  # FP32 output ~1e5: beyond float16's 65504
    return model, torch.randn(32, 8), torch.randint(0, 4, (32,))


def test_the_audits_advice_says_o2_casts_a_kept_overflowing_output_back():
    model, x, y = _overflowing_net()
    report = amp.audit(lambda: torch.nn.functional.cross_entropy(model(x), y), model)
    assert report.keep_fp32() == ["body"]
    advice = report.suggest()
    assert "At O2/O3" in advice and "train at O1" in advice


@pytest.mark.parametrize("opt_level", ["O2", "O3"])
def test_a_kept_modules_output_that_overflows_when_cast_back_is_named_as_the_origin(opt_level):
    model, x, y = _overflowing_net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model, optimizer = amp.initialize(
        model,
        optimizer,
        opt_level=opt_level,
        loss_scale="dynamic",
        verbosity=0,
        fp32_modules=["body"],
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", amp.NonFiniteLossWarning)
        for _ in range(2):
            optimizer.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x).float(), y)
            with amp.scale_loss(loss, optimizer) as scaled:
                scaled.backward()
            optimizer.step()
    found = amp.last_overflow().origin
    # Not 'norm', which only received the inf: 'body' in float16, after the cast back.
    assert (found.module, found.phase, found.dtype) == ("body", "forward", torch.float16)


class _TiedLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(10, 8)
        self.mid = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 10, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, tokens):
        return self.head(self.mid(self.emb(tokens)))


@pytest.mark.parametrize("opt_level", ["O2", "O3"])
@pytest.mark.parametrize("kept", ["head", "emb"])
def test_a_kept_module_tied_to_a_cast_one_is_refused_and_nothing_changes(opt_level, kept):
    torch.manual_seed(0)
    model = _TiedLM()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="tied weights"):
        amp.initialize(model, optimizer, opt_level=opt_level, verbosity=0, fp32_modules=[kept])
    assert model.head.weight is model.emb.weight and model.emb.weight.dtype is torch.float32
    assert optimizer.param_groups[0]["params"][0] is model.emb.weight
    # Keeping both holders works: the tied weight stays FP32 for both.
    model, optimizer = amp.initialize(
        model, optimizer, opt_level=opt_level, verbosity=0, fp32_modules=["head", "emb"]
    )
    assert model.emb.weight.dtype is torch.float32 and model.mid.weight.dtype is torch.float16
    assert model(torch.randint(0, 10, (4, 5))).isfinite().all()
