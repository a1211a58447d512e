"""What a failed amp.initialize puts back (amp/weights/snapshot.py): the very objects it found, by
identity, whatever was changed in between."""

import torch

from amp.weights.snapshot import OptimizerSnapshot, Snapshot
from helpers.models import make_model


def test_parameters_buffers_and_optimizers_come_back_by_identity():
    model = make_model(batch_norm=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(4, 4)).sum().backward()
    optimizer.step()
    params = list(model.parameters())
    data, grads = [p.untyped_storage() for p in params], [p.grad for p in params]
    buffers = dict(model[1]._buffers)
    groups, group_params = optimizer.param_groups, list(optimizer.param_groups[0]["params"])
    state = optimizer.state
    snapshot = Snapshot([model], [optimizer])
    with torch.no_grad():  # what an initialize does, and more
        for param in params:
            param.data = param.data.half()
            param.grad = None
    model[1].running_mean = torch.ones(8)
    del model[1]._buffers["running_var"]
    optimizer.param_groups[0]["params"][0] = torch.nn.Parameter(torch.zeros(1))
    optimizer.param_groups[0]["lr"] = 5.0
    optimizer.state.clear()
    optimizer.extra = "added"
    snapshot.restore()
    assert all(p.dtype is torch.float32 for p in params)
    assert all(
        p.untyped_storage().data_ptr() == d.data_ptr() and p.grad is g
        for p, d, g in zip(params, data, grads)
    )
    assert model[1]._buffers == buffers
    assert all(a is b for a, b in zip(model[1]._buffers.values(), buffers.values()))
    assert optimizer.param_groups is groups and optimizer.param_groups[0]["params"] == group_params
    assert optimizer.param_groups[0]["lr"] == 0.1 and optimizer.state is state
    assert len(state) == len(params) and not hasattr(optimizer, "extra")


def test_an_optimizers_state_entries_come_back_as_they_were():
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(4, 4)).sum().backward()
    optimizer.step()
    entry = optimizer.state[next(model.parameters())]
    buffer = entry["momentum_buffer"]
    snapshot = OptimizerSnapshot(optimizer)
    entry["momentum_buffer"] = torch.zeros(1)
    entry["new"] = 1
    snapshot.restore()
    assert optimizer.state[next(model.parameters())] is entry
    assert entry == {"momentum_buffer": buffer}
