"""Training with float8: master weights, loss scaling and skipped steps, checkpoints that resume
bit for bit and hold nothing FP8, deinitialize, and the torch.amp-style API."""

import copy
import io

import pytest
import torch
from torch import nn

import amp

FP8_TYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(32, 64)
        self.body = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64))
        self.norm = nn.LayerNorm(64)
        self.head = nn.Linear(64, 16)

    def forward(self, x):
        return self.head(self.norm(self.body(self.embed(x))))


def _batch(step):
    generator = torch.Generator().manual_seed(step)
    x = torch.randn(32, 32, generator=generator)
    return x, torch.randint(0, 16, (32,), generator=generator)


def _setup(opt_level="O2", dtype=torch.bfloat16, recipe="tensorwise", seed=0, **options):
    torch.manual_seed(seed)
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return amp.initialize(
        model, optimizer, opt_level=opt_level, dtype=dtype, float8=recipe, verbosity=0, **options
    )


def _step(model, optimizer, step):
    x, y = _batch(step)
    optimizer.zero_grad()
    loss = nn.functional.cross_entropy(model(x).float(), y)
    with amp.scale_loss(loss, optimizer) as scaled:
        scaled.backward()
    optimizer.step()
    return loss.item()


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_o2_trains_fp32_masters_and_stores_nothing_fp8(recipe):
    model, optimizer = _setup(recipe=recipe)
    try:
        losses = [_step(model, optimizer, 0) for _ in range(12)]  # one batch, learnt
        assert losses[-1] < losses[0] * 0.8
        assert model.body[0].weight.dtype is torch.bfloat16
        masters = list(amp.master_params(optimizer))
        assert all(p.dtype is torch.float32 for p in masters)
        # The model's bf16 weights are the masters, rounded: no FP8 copy was written back.
        assert torch.equal(model.body[0].weight, masters[2].to(torch.bfloat16))
        saved = [model.state_dict(), optimizer.state_dict(), amp.state_dict()]
        dtypes = {t.dtype for t in _tensors(saved)}
        # FP32 values, step counts, the exact masters' int16 remainders: nothing else
        assert dtypes - {torch.int64, torch.int16} == {torch.float32}
        assert not any(t.dtype in FP8_TYPES for t in _tensors(saved))
        buffer = io.BytesIO()
        torch.save(saved, buffer)  # plain tensors only
    finally:
        amp.deinitialize()
    assert all(p.dtype is torch.float32 for p in model.parameters())
    assert torch.nn.functional.linear is torch._C._nn.linear  # the originals again


def test_resume_is_bit_exact():
    model, optimizer = _setup(recipe="rowwise")
    try:
        for step in range(3):
            _step(model, optimizer, step)
        checkpoint = copy.deepcopy(
            {
                "model": model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "amp": amp.state_dict(),
            }
        )
        losses = [_step(model, optimizer, step) for step in range(3, 7)]
        uninterrupted = copy.deepcopy(model.state_dict())
    finally:
        amp.deinitialize()
    model, optimizer = _setup(recipe="rowwise", seed=1)  # other weights, overwritten by the load
    try:
        model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        amp.load_state_dict(checkpoint["amp"])
        resumed_losses = [_step(model, optimizer, step) for step in range(3, 7)]
        resumed = model.state_dict()
    finally:
        amp.deinitialize()
    assert resumed_losses == losses
    assert all(torch.equal(resumed[name], value) for name, value in uninterrupted.items())


def test_a_skipped_step_changes_nothing_and_backs_the_scale_off():
    """float16 at O2 + float8: an inf gradient (a huge loss) skips the step; parameters and
    optimizer state stay bit for bit, the scale halves; the next clean step trains."""
    model, optimizer = _setup(dtype=torch.float16)
    try:
        _step(model, optimizer, 0)
        before = copy.deepcopy((model.state_dict(), optimizer.state_dict()))
        scale = amp.state_dict()["loss_scaler0"]["loss_scale"]
        x, y = _batch(1)
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(x).float(), y) * 1e30  # gradients overflow
        with amp.scale_loss(loss, optimizer) as scaled:
            scaled.backward()
        optimizer.step()
        after = (model.state_dict(), optimizer.state_dict())
        assert amp.state_dict()["loss_scaler0"]["loss_scale"] == scale / 2
        assert all(torch.equal(before[0][k], v) for k, v in after[0].items())
        assert all(torch.equal(a, b) for a, b in zip(_tensors(before[1]), _tensors(after[1])))
        assert amp.last_overflow() is not None
        _step(model, optimizer, 2)
        assert not torch.equal(before[0]["head.weight"], model.state_dict()["head.weight"])
    finally:
        amp.deinitialize()


def test_o1_and_o3_train():
    for opt_level, options in (("O1", {}), ("O3", {"loss_scale": "dynamic"})):
        model, optimizer = _setup(opt_level=opt_level, **options)
        try:
            losses = [_step(model, optimizer, 0) for _ in range(12)]  # one batch, learnt
        finally:
            amp.deinitialize()
        assert losses[-1] < losses[0] * 0.8, (opt_level, losses)


def test_autocast_and_grad_scaler_train():
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = amp.GradScaler()
    losses = []
    try:
        x, y = _batch(0)
        for _ in range(12):
            optimizer.zero_grad()
            with amp.autocast(dtype=torch.bfloat16, float8="tensorwise"):
                loss = nn.functional.cross_entropy(model(x).float(), y)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            losses.append(loss.item())
    finally:
        amp.deinitialize()
    assert losses[-1] < losses[0] * 0.8
    assert all(p.dtype is p.grad.dtype is torch.float32 for p in model.parameters())
