"""Property-based: random sequences of what users do, with API.md's invariants checked after each.

Actions: clean steps, steps whose gradients overflow, exceptions inside scale_loss, gradient
accumulation with delay_unscale, checkpoints saved and loaded, deinitialize and re-initialize;
at O0-O3 x float16/bfloat16, with the opt level's loss scale or a dynamic one.
"""

import copy
import io

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import amp
from helpers import DTYPES, OPT_LEVELS
from helpers.models import loss_of, make_model

ACTIONS = ("step", "overflow", "raise", "accumulate", "checkpoint", "reinitialize")


def model_with_offset():
    model = make_model()
    model.register_buffer("offset", torch.full((2,), 1.0 / 3))  # not exact in low precision
    return model


def loss_with_offset(model, step):
    return loss_of(model, step, seed=0, size=8, offset=model.offset)


class Run:
    """One model and optimizer under amp, and the user's actions on them."""

    def __init__(self, opt_level, dtype, loss_scale):
        self.model = model_with_offset()
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.05, momentum=0.9)
        self.options = dict(opt_level=opt_level, dtype=dtype, loss_scale=loss_scale, verbosity=0)
        amp.initialize(self.model, self.optimizer, **self.options)
        self.dynamic = amp.state_dict()["loss_scaler0"]["loss_scale"] != 1.0 or (
            loss_scale == "dynamic"
        )
        self.counter = 0

    def batch(self):
        self.counter += 1
        return self.counter

    def state(self):
        """Everything a skipped step or a failed block must leave as it was, deep-copied."""
        weights = dict(self.model.named_parameters())
        grads = {name: p.grad for name, p in weights.items()}
        for i, master in enumerate(amp.master_params(self.optimizer)):
            weights[f"master {i}"] = master
            grads[f"master {i}"] = master.grad
        return copy.deepcopy(
            (weights, self.model.state_dict(), self.optimizer.state_dict(), grads, amp.state_dict())
        )

    def backward(self, delay_unscale=False, overflow=False):
        with amp.scale_loss(
            loss_with_offset(self.model, self.batch()), self.optimizer, delay_unscale=delay_unscale
        ) as scaled:
            scaled.backward()
            if overflow:
                # The scaled gradients may overflow by themselves too: those are reported as well.
                self.nonfinite = {
                    name
                    for name, param in self.model.named_parameters()
                    if param.grad is not None and not torch.isfinite(param.grad).all()
                }
                self.model[2].weight.grad.view(-1)[0] = float("inf")

    # -- the actions ----------------------------------------------------------------------------

    def step(self):
        self.backward()
        self.optimizer.step()
        self.optimizer.zero_grad()

    def overflow(self):
        before = self.state()
        scale = amp.state_dict()["loss_scaler0"]["loss_scale"]
        self.backward(overflow=True)
        self.optimizer.step()  # skipped
        after = self.state()
        self.optimizer.zero_grad()
        assert_same(before[:3], after[:3])  # weights, masters and optimizer state unchanged
        assert amp.state_dict()["loss_scaler0"]["loss_scale"] == max(scale / 2, 2.0**-126)
        names = [name for name, _ in self.model.named_parameters()]
        expected = tuple(name for name in names if name in self.nonfinite | {"2.weight"})
        assert amp.last_overflow().params == expected

    def raise_inside(self):
        loss_with_offset(self.model, self.batch()).backward()  # gradients from before, outside amp
        before = self.state()
        with pytest.raises(KeyError):
            loss = loss_with_offset(self.model, self.batch())
            with amp.scale_loss(loss, self.optimizer) as scaled:
                scaled.backward()
                raise KeyError("inside the block")
        assert_same(before, self.state())
        self.optimizer.zero_grad()

    def accumulate(self, micro_batches=3):
        """Accumulation with delay_unscale gives what separate blocks give (exactly where the
        gradients are FP32: O0, O1), then steps."""
        first = self.counter
        scale = amp.state_dict()
        for index in range(micro_batches):
            self.backward(delay_unscale=index < micro_batches - 1)
        delayed = self.gradients()
        self.optimizer.zero_grad()
        self.counter = first
        for _ in range(micro_batches):
            self.backward()
        separate = self.gradients()
        overflowed = amp.state_dict() != scale  # then the step is skipped either way
        for a, b in zip(delayed, separate):
            if overflowed:
                break
            if self.options["opt_level"] in ("O0", "O1"):
                assert torch.equal(a, b)
            else:
                torch.testing.assert_close(a, b, rtol=2e-2, atol=1e-3)
        self.optimizer.step()
        self.optimizer.zero_grad()

    def gradients(self):
        params = list(amp.master_params(self.optimizer))
        return [p.grad.float().clone() for p in params if p.grad is not None]

    def checkpoint(self):
        """Save, train on, load: back bit for bit; and the checkpoint reads weights-only."""
        buffer = io.BytesIO()
        torch.save(
            {
                "model": self.model.state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "amp": amp.state_dict(),
            },
            buffer,
        )
        before = self.state()
        self.step()
        buffer.seek(0)
        saved = torch.load(buffer, weights_only=True)
        self.model.load_state_dict(saved["model"])
        self.optimizer.load_state_dict(saved["optimizer"])
        amp.load_state_dict(saved["amp"])
        after = self.state()
        assert_same(before[:3] + before[4:], after[:3] + after[4:])  # all but the gradients

    def reinitialize(self):
        """deinitialize gives back FP32 weights and buffers; initialize again continues."""
        fp32 = copy.deepcopy(self.model.state_dict())
        scaler = amp.state_dict()
        amp.deinitialize()
        assert all(t.dtype is torch.float32 for t in self.model.state_dict().values())
        for key, value in self.model.state_dict().items():
            assert torch.equal(value, fp32[key]), key
        amp.initialize(self.model, self.optimizer, **self.options)
        amp.load_state_dict(scaler)
        for key, value in self.model.state_dict().items():
            assert torch.equal(value, fp32[key]), key

    # -- invariants after every action ----------------------------------------------------------

    def check(self):
        state = self.model.state_dict()
        assert all(value.dtype is torch.float32 for value in state.values())
        assert all(torch.isfinite(value).all() for value in state.values())
        if self.options["opt_level"] == "O2":
            dtype = self.options["dtype"]
            for param, master in zip(self.model.parameters(), amp.master_params(self.optimizer)):
                assert torch.equal(param, master.to(dtype))  # the model is its masters rounded


def assert_same(a, b):
    for x, y in zip(a, b):
        assert_tree_equal(x, y)


def assert_tree_equal(x, y):
    if isinstance(x, dict):
        assert x.keys() == y.keys()
        for key in x:
            assert_tree_equal(x[key], y[key])
    elif isinstance(x, (list, tuple)):
        assert len(x) == len(y)
        for a, b in zip(x, y):
            assert_tree_equal(a, b)
    elif isinstance(x, torch.Tensor):
        assert isinstance(y, torch.Tensor) and x.dtype == y.dtype and torch.equal(x, y)
    else:
        assert x == y


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("opt_level", OPT_LEVELS)
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    loss_scale=st.sampled_from([None, "dynamic"]),
    actions=st.lists(st.sampled_from(ACTIONS), min_size=1, max_size=6),
)
def test_random_user_sequences_keep_the_invariants(opt_level, dtype, loss_scale, actions):
    run = Run(opt_level, dtype, loss_scale)
    try:
        for action in actions:
            if action == "overflow" and not run.dynamic:
                continue  # a static scale applies what it gets, by definition
            getattr(run, "raise_inside" if action == "raise" else action)()
            run.check()
    finally:
        amp.deinitialize()
