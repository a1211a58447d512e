"""O2 runs through amp's fused step and through the optimizer's own (the general path), and
their comparison bit for bit: the oracle of tests/weights/test_fused_step.py and test_owner.py."""

import torch

import amp
from helpers.floats import bits
from helpers.models import loss_of, make_model
from helpers.o2 import general_path

ADAMS = [
    (torch.optim.AdamW, dict(lr=0.01, weight_decay=0.1)),
    (torch.optim.Adam, dict(lr=0.01, weight_decay=0.1)),
    (torch.optim.Adam, dict(lr=0.01)),
]
SGDS = [
    (torch.optim.SGD, dict(lr=0.1, momentum=0.9, weight_decay=0.01)),
    (torch.optim.SGD, dict(lr=0.1, momentum=0.9, nesterov=True)),
    (torch.optim.SGD, dict(lr=0.1, momentum=0.8, dampening=0.25)),
    (torch.optim.SGD, dict(lr=0.1)),
]
IDS = ["adamw", "adam-l2", "adam", "sgd-momentum", "sgd-nesterov", "sgd-dampening", "sgd"]


def train(
    cls,
    options,
    steps=4,
    dtype=torch.bfloat16,
    general=False,
    batch_norm=True,
    hook=None,
    inside=None,
    width=None,
):
    """An O2 model trained `steps` steps; `general` forces the general path (AMP_FUSED_STEP=0). The
    optimizer is torch's fused implementation, the one amp's torch backend runs, so that its own
    steps (the first, and the general path's) compute what the fused step does."""
    sizes = dict(inputs=width, hidden=2 * width, outputs=width) if width else {}
    model = make_model(batch_norm=batch_norm, **sizes)
    loss_sizes = dict(inputs=width, outputs=width) if width else {}
    fused = {"fused": True} if cls in (torch.optim.AdamW, torch.optim.Adam, torch.optim.SGD) else {}
    optimizer = cls(model.parameters(), **options, **fused)
    with general_path(general):
        model, optimizer = amp.initialize(
            model, optimizer, opt_level="O2", dtype=dtype, verbosity=0
        )
    for step in range(steps):
        optimizer.zero_grad()
        with amp.scale_loss(loss_of(model, step, **loss_sizes), optimizer) as scaled:
            scaled.backward()
            if inside is not None:  # the model's gradients, still scaled
                inside(step, model, optimizer)
        if hook is not None:
            hook(step, model, optimizer)
        optimizer.step()
    return model, optimizer


def state_of(model, optimizer):
    weights = [p.detach().clone() for p in model.parameters()]
    masters = [p.detach().clone() for p in amp.master_params(optimizer)]
    return weights, masters, optimizer.state_dict()


_RESTS = ("master", "master_remainder", "master_correction")


def assert_bitwise_states(a, b):
    """The same masters and moments bit for bit; the same weights, but where an exact master's
    weight took a tie away from zero and an FP32 master's to even (their masters agree)."""
    (weights_a, masters_a, opt_a), (weights_b, masters_b, opt_b) = a, b
    for x, y in zip(masters_a, masters_b, strict=True):
        assert x.dtype == y.dtype and torch.equal(bits(x), bits(y))
    for x, y in zip(weights_a, weights_b, strict=True):
        assert x.dtype == y.dtype
        if not torch.equal(x, y):  # only at ties: a master whose low 16 bits are 0x8000
            master = next(m for m in masters_a if m.shape == x.shape and torch.equal(
                m.to(x.dtype)[x == y], x[x == y]))
            assert ((bits(master) & 0xFFFF)[x != y] == 0x8000).all()
    for index, state in opt_a["state"].items():
        theirs = opt_b["state"].get(index, {})
        for key, value in state.items():
            if key in _RESTS:  # the master's form: compared as the masters above
                continue
            if key == "step" and key not in theirs:  # an exact master's entry never stepped
                assert value.item() == 0 and not set(state) - {"step", *_RESTS}, index
                continue
            other = theirs[key]
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(other)), (index, key)
