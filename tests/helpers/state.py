"""Snapshots of what a refused call or a skipped step must leave as it was, and their comparisons."""

import copy

import torch

import amp
from helpers.models import loss_of


def everything(model, optimizer):
    """What an error must not change: parameters, gradients, masters, optimizer and amp state."""
    tensors = {f"param {n}": p for n, p in model.named_parameters()}
    tensors.update({f"grad {n}": p.grad for n, p in model.named_parameters()})
    for i, master in enumerate(amp.master_params(optimizer)):
        tensors[f"master {i}"] = master
        tensors[f"master grad {i}"] = master.grad
    return copy.deepcopy((tensors, optimizer.state_dict(), dict(amp.state_dict())))


def assert_same(before, after):
    (tensors_a, opt_a, amp_a), (tensors_b, opt_b, amp_b) = before, after
    assert tensors_a.keys() == tensors_b.keys()
    for key, value in tensors_a.items():
        other = tensors_b[key]
        assert (value is None and other is None) or (
            value is not None
            and other is not None
            and value.dtype == other.dtype
            and torch.equal(value, other)
        ), key
    assert amp_a == amp_b
    assert opt_a["param_groups"] == opt_b["param_groups"]
    assert opt_a["state"].keys() == opt_b["state"].keys()
    for index, state in opt_a["state"].items():  # the masters' rests among them (O2)
        assert state.keys() == opt_b["state"][index].keys(), index
        for name, value in state.items():
            assert torch.equal(value, opt_b["state"][index][name]), (index, name)


def saved_masters(optimizer_state):
    """{index: the master's rest} of an O2 optimizer's state dict (its entries' `master`,
    `master_remainder` or `master_correction`)."""
    found = {}
    for index, entry in optimizer_state["state"].items():
        for key in ("master", "master_remainder", "master_correction"):
            if key in entry:
                found[index] = entry[key]
    return found


def grads(model, optimizer):
    """Every gradient amp holds for the optimizer: model gradients and master gradients."""
    found = [p.grad for p in model.parameters()] + [m.grad for m in amp.master_params(optimizer)]
    return [None if g is None else g.clone() for g in found]


def assert_grads_equal(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert (x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))


def step_cleanly(model, optimizer, step=0):
    with amp.scale_loss(loss_of(model, step), optimizer) as scaled:
        scaled.backward()
    optimizer.step()
    optimizer.zero_grad()


def snapshot(model, optimizer):
    return copy.deepcopy((model.state_dict(), optimizer.state_dict()))


def assert_equal_states(a, b):
    (model_a, opt_a), (model_b, opt_b) = a, b
    for key in model_a:
        assert torch.equal(model_a[key], model_b[key]), key
    for index in opt_a["state"]:  # the masters' rests among them (O2)
        for name, value in opt_a["state"][index].items():
            other = opt_b["state"][index][name]
            assert torch.equal(value, other) if isinstance(value, torch.Tensor) else value == other


def scaled_step(model, optimizer, overflow=False):
    """One scale_loss block and step on a batch of ones; `overflow` puts an inf into the first
    parameter's scaled gradient (the loss stays finite: a non-finite loss keeps the scale)."""
    loss = model(torch.ones(2, 4)).float().sum()
    with amp.scale_loss(loss, optimizer) as scaled:
        scaled.backward()
        if overflow:
            next(model.parameters()).grad[0, 0] = float("inf")
    optimizer.step()
    optimizer.zero_grad()


def torch_autocast_state():
    """torch's own autocast state in this thread (what amp's casting sets): enabled on cpu and
    cuda, their dtypes, the cache flag."""
    return (
        torch.is_autocast_enabled("cpu"),
        torch.is_autocast_enabled("cuda"),
        torch.get_autocast_dtype("cpu"),
        torch.get_autocast_dtype("cuda"),
        torch.is_autocast_cache_enabled(),
    )
