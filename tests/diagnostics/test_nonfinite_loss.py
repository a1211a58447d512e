"""The non-finite-loss warning (amp/diagnostics/nonfinite_loss.py) and the scale it keeps: no scale
spiral. A non-finite loss skips the step but keeps the scale, and warns once per run."""

import copy
import warnings

import pytest
import torch

import amp
from amp import distributed
from helpers.models import make_model


def make(opt_level, seed=0):
    model = make_model(seed, outputs=1)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    model, optimizer = amp.initialize(
        model, optimizer, opt_level=opt_level, loss_scale="dynamic", verbosity=0
    )
    return model, optimizer


def step(model, optimizer, index, bad):
    optimizer.zero_grad()
    x = torch.randn(16, 4, generator=torch.Generator().manual_seed(index))
    out = model(x).float()
    # log(0) = -inf: the loss itself is not finite, whatever the scale
    loss = torch.log(out.pow(2).mean() * 0) if bad else out.pow(2).mean() * 1e-3
    with amp.scale_loss(loss, optimizer) as scaled:
        scaled.backward()
    optimizer.step()


def scaler_state():
    state = amp.state_dict()["loss_scaler0"]
    return state["loss_scale"], state["unskipped"]


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_a_nan_loss_for_30_steps_keeps_the_scale_and_the_weights(opt_level):
    model, optimizer = make(opt_level)
    try:
        for index in range(3):
            step(model, optimizer, index, bad=False)
        before = copy.deepcopy((model.state_dict(), optimizer.state_dict()))
        scale_before = scaler_state()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for index in range(30):
                step(model, optimizer, 3 + index, bad=True)
        assert scaler_state() == scale_before  # the scale and its count of clean steps
        after = (model.state_dict(), optimizer.state_dict())
        for key, value in before[0].items():
            assert torch.equal(value, after[0][key]), key
        for index, state in before[1]["state"].items():
            for name, value in state.items():
                assert torch.equal(value, after[1]["state"][index][name]), name
        assert amp.last_overflow().nonfinite_loss
        assert amp.last_overflow().origin.module is None  # the loss, outside every module
        ours = [w for w in caught if issubclass(w.category, amp.NonFiniteLossWarning)]
        assert len(ours) == 1
        assert "the loss itself, outside every module" in str(ours[0].message)
        assert ours[0].filename == __file__  # points at the user's optimizer.step()
        step(model, optimizer, 40, bad=False)  # training goes on from the same scale
        assert amp.last_overflow().loss_scale == scale_before[0]
    finally:
        amp.deinitialize()


def test_a_gradient_overflow_still_backs_off():
    model, optimizer = make("O1")
    try:
        optimizer.zero_grad()
        x = torch.randn(16, 4)
        with amp.scale_loss(model(x).float().pow(2).mean(), optimizer) as scaled:
            scaled.backward()
            model[0].weight.grad.view(-1)[0] = float("inf")  # the loss is finite
        with warnings.catch_warnings():
            warnings.simplefilter("error", amp.NonFiniteLossWarning)
            optimizer.step()
        report = amp.last_overflow()
        assert not report.nonfinite_loss and report.loss_scale == 2.0**15
    finally:
        amp.deinitialize()


def test_the_warning_comes_once_per_run_of_bad_losses():
    model, optimizer = make("O1")
    pattern = [True] * 4 + [False] * 3 + [True] * 3 + [False] + [True] + [False] * 2
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for index, bad in enumerate(pattern):
                step(model, optimizer, index, bad)
    finally:
        amp.deinitialize()
    messages = [str(w.message) for w in caught if w.category is amp.NonFiniteLossWarning]
    # Two runs of several steps name the origin; the lone bad step could not be watched.
    assert len(messages) == 3
    assert "It started in the loss itself" in messages[0] and "It started in" in messages[1]
    assert "at one step" in messages[2]


def test_no_step_reads_the_loss_flag_from_the_device(monkeypatch):
    """The loss flag arrives on the host with the block's other results (on the CPU at once),
    on a clean step and on a skipped one."""
    model, optimizer = make("O1")
    try:
        step(model, optimizer, 0, bad=False)
        reads = []
        item = torch.Tensor.item
        monkeypatch.setattr(torch.Tensor, "item", lambda t: reads.append(t.dtype) or item(t))
        step(model, optimizer, 1, bad=False)
        step(model, optimizer, 2, bad=True)
        assert torch.bool not in reads and torch.int32 not in reads
        assert amp.last_overflow().nonfinite_loss
    finally:
        monkeypatch.undo()
        amp.deinitialize()


def test_a_bad_loss_on_another_rank_keeps_the_scale_on_every_rank(monkeypatch):
    """One collective carries both flags: a rank whose loss was fine keeps the scale too."""
    collectives = []

    def all_reduce(tensor, op=None):
        collectives.append(tensor.numel())
        if tensor.numel() == 2:
            tensor.fill_(1.0)  # the other rank overflowed because its loss was not finite

    model, optimizer = make("O1")
    try:
        step(model, optimizer, 0, bad=False)
        scale = scaler_state()
        monkeypatch.setattr(distributed, "default_group", object)
        monkeypatch.setattr(distributed, "is_distributed", lambda: True)
        monkeypatch.setattr(torch.distributed, "all_reduce", all_reduce)
        monkeypatch.setattr(torch.distributed, "get_backend", lambda *args: "gloo")
        monkeypatch.setattr(distributed, "nonfinite_names", lambda params, name_of: ())
        with pytest.warns(amp.NonFiniteLossWarning):
            for index in range(2):
                step(model, optimizer, 1 + index, bad=False)
        assert collectives == [2, 2]
        monkeypatch.undo()
        assert scaler_state() == scale
    finally:
        monkeypatch.undo()
        amp.deinitialize()


@pytest.mark.parametrize(
    "opt_level, dtype, options",
    [
        ("O1", torch.bfloat16, {}),
        ("O2", torch.bfloat16, {}),
        ("O2", torch.bfloat16, dict(master_weights="compact", optimizer_state="int8")),
        ("O2", torch.float16, {}),
    ],
    ids=["O1", "O2-exact", "O2-compact-int8", "O2-fp16"],
)
def test_a_non_finite_loss_with_finite_gradients_skips_the_step_and_warns(
    opt_level, dtype, options
):
    """`loss + inf` has the gradients of `loss`: finite. The loss is still not finite, so the step
    is skipped (no bit changes), the scale and its count are kept and the warning comes (the
    step was taken silently, and its count not advanced)."""
    model = make_model(0, outputs=1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    model, optimizer = amp.initialize(
        model, optimizer, opt_level=opt_level, dtype=dtype, verbosity=0, **options
    )
    try:
        step(model, optimizer, 0, bad=False)
        before = copy.deepcopy((model.state_dict(), optimizer.state_dict()))
        scale = scaler_state()
        optimizer.zero_grad()
        x = torch.randn(16, 4, generator=torch.Generator().manual_seed(1))
        loss = model(x).float().pow(2).mean() + float("inf")
        with amp.scale_loss(loss, optimizer) as scaled:
            scaled.backward()
        assert all(torch.isfinite(p.grad).all() for p in amp.master_params(optimizer))
        optimizer.step()
        assert scaler_state() == scale
        model_state, optimizer_state = model.state_dict(), optimizer.state_dict()
        for key, value in before[0].items():
            assert torch.equal(value, model_state[key]), key
        for index, entry in before[1]["state"].items():
            for name, value in entry.items():
                assert torch.equal(value, optimizer_state["state"][index][name]), name
        with pytest.warns(amp.NonFiniteLossWarning):
            step(model, optimizer, 2, bad=False)  # the warning waits for the step after
            amp.last_overflow()
        assert scaler_state() == (scale[0], scale[1] + 1)  # the clean step after counts
    finally:
        amp.deinitialize()
