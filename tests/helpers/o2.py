"""O2 set-ups for the tests of masters, shadows and optimizer checkpoints: a 4-4-4 model, a step
from a seeded batch, the masters' values as their owner holds them."""

import io
import os
import unittest.mock

import torch

import amp
from helpers.models import make_model, make_stack


def general_path(general=True):
    """amp.initialize inside it sets O2 up without amp's fused master step, so that every step is
    the optimizer's own (AMP_FUSED_STEP=0, docs/o2.md); general=False changes nothing."""
    return unittest.mock.patch.dict(os.environ, {"AMP_FUSED_STEP": "0"} if general else {})


def make_square_model(seed=0):
    """Linear(4, 4), ReLU, Linear(4, 4)."""
    return make_model(seed, hidden=4, outputs=4)


def setup(optimizer_class=torch.optim.Adam, dtype=torch.float16, **kwargs):
    model = make_square_model()
    optimizer = optimizer_class(model.parameters(), lr=0.01)
    return amp.initialize(model, optimizer, opt_level="O2", dtype=dtype, verbosity=0, **kwargs)


def train_step(model, optimizer, seed=1, scale=1.0):
    optimizer.zero_grad()
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(seed))
    loss = model(x).float().square().mean() * scale
    with amp.scale_loss(loss, optimizer) as scaled:
        scaled.backward()
    optimizer.step()


def optimizer_params(optimizer):
    """The masters' FP32 values as the optimizer's owner holds them, read without a step or an
    amp.master_params (its rows' own reads, which write nothing)."""
    owner = vars(optimizer)["_amp_record"].owner
    values = []
    for group in optimizer.param_groups:
        for param in group["params"]:
            row = owner.index.get(id(param)) if hasattr(owner, "state_form") else None
            value = param if row is None else owner.value(row)
            values.append(value.detach().clone())
    return values


def saved(state):
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return buffer


def trained_o2(steps=2, **kwargs):
    model, optimizer = setup(**kwargs)
    for seed in range(steps):
        train_step(model, optimizer, seed=seed)
    return model, optimizer


def two_trained_optimizers():
    """Two O2 models, each with its SGD, after two steps of each: both batches of marks wait."""
    first, second = make_square_model(0), make_square_model(1)
    opt_first = torch.optim.SGD(first.parameters(), lr=0.1)
    opt_second = torch.optim.SGD(second.parameters(), lr=0.1)
    (first, second), (opt_first, opt_second) = amp.initialize(
        [first, second], [opt_first, opt_second], opt_level="O2", verbosity=0
    )
    for seed in range(2):
        train_step(first, opt_first, seed=seed)
        train_step(second, opt_second, seed=seed + 10)
    return first, second, opt_first, opt_second


def static_o2(optimizer_class=torch.optim.SGD):
    """Linear(4, 4), Linear(4, 2) and its optimizer (lr=0.1) at O2 with a static loss scale of
    128."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    optimizer = optimizer_class(model.parameters(), lr=0.1)
    return amp.initialize(model, optimizer, opt_level="O2", loss_scale=128.0, verbosity=0)


def linear_o2(lr):
    """Linear(4, 2) and its SGD(lr) at O2."""
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    return amp.initialize(model, optimizer, opt_level="O2", verbosity=0)


def stepped_stack(lr):
    """An O2 model and its SGD after one step (its marks batched)."""
    model = make_stack(3)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    model, optimizer = amp.initialize(
        model, optimizer, opt_level="O2", dtype=torch.bfloat16, verbosity=0
    )
    one_step(model, optimizer)
    return model, optimizer


def one_step(model, optimizer):
    loss = model(torch.randn(8, 4)).float().sum()
    with amp.scale_loss(loss, optimizer) as scaled:
        scaled.backward()
    optimizer.step()
