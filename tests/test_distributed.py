"""The rank agreement (amp/distributed.py): one collective per step carries the overflow flag,
one more names the skipped step's parameters, none in one process; is_distributed reads the
default group each time, cheaply. Two real processes: tests/weights/test_engines.py."""

import pytest
import torch

import amp
from amp import distributed
from helpers import distributed_scenarios as helper
from helpers.profiling import profile_calls as _profile_calls


# Before any test that makes a process group: is_distributed is read with none in place.


def test_is_distributed_reads_the_default_group_now(monkeypatch):
    """Cheap and never cached: a process group made later counts. default_group, which every step
    asks first, enters no frame of amp's (in one process it is the whole answer)."""
    from amp import distributed

    own, total, names = _profile_calls(distributed.default_group)
    assert (own, total) == (0, 1), names  # torch's default_pg property alone
    assert distributed.default_group() is None
    assert not distributed.is_distributed()
    world = torch.distributed.distributed_c10d._world
    monkeypatch.setattr(world, "_default_pg", object())
    assert distributed.default_group() is world._default_pg
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 2)
    assert distributed.is_distributed()
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 1)
    assert not distributed.is_distributed()


def test_is_distributed_follows_a_world_put_in_place_later(monkeypatch):
    """torch's threaded process groups (its multi-threaded tests) replace c10d's world object by
    a thread-local one whose default group is a property only: read at import, the world gave
    False under it (ranks deciding skips alone), or an AttributeError at every scale_loss."""
    from torch.testing._internal.distributed import multi_threaded_pg

    from amp import distributed

    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 2)
    world = multi_threaded_pg._install_threaded_pg()
    try:
        assert not distributed.is_distributed()
        world.default_pg = object()
        assert distributed.is_distributed()
        world.default_pg = None
    finally:
        multi_threaded_pg._uninstall_threaded_pg()
    assert not distributed.is_distributed()


@pytest.fixture
def count_collectives(monkeypatch):
    """Pretend to be one of several ranks; count the all_reduce calls amp makes."""
    calls = []
    monkeypatch.setattr(distributed, "default_group", object)
    monkeypatch.setattr(distributed, "is_distributed", lambda: True)
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda tensor, op=None: calls.append(op))
    monkeypatch.setattr(torch.distributed, "get_backend", lambda *args: "gloo")
    return calls


def test_scale_loss_reduces_the_flag_once_per_step_and_names_once_per_skip(count_collectives):
    model, optimizer = helper.model_and_optimizer()
    model, optimizer = amp.initialize(model, optimizer, opt_level="O1", verbosity=0)
    try:
        helper.one_step(model, optimizer)
        assert len(count_collectives) == 1  # the overflow flag
        inputs, targets = helper.batches(0)[0][0]
        with amp.scale_loss(
            helper.cross_entropy_part(model, inputs, targets, 1), optimizer
        ) as scaled:
            scaled.backward()
            helper.inject(model[0].weight.grad)
        optimizer.step()
        assert len(count_collectives) == 3  # the flag, then the names of the skipped step
        assert amp.last_overflow().params == ("0.weight",)
    finally:
        amp.deinitialize()


def test_grad_scaler_reduces_once_per_step_even_without_gradients(count_collectives):
    model, optimizer = helper.model_and_optimizer()
    scaler = amp.GradScaler()
    helper.one_step(model, optimizer, scaler)
    assert count_collectives == [torch.distributed.ReduceOp.MAX]
    # A rank whose shard got no gradient still takes part (and does not raise), so no rank hangs.
    scaler.scale(torch.ones((), requires_grad=True)).backward()
    scaler.step(optimizer)
    scaler.update()
    assert len(count_collectives) == 2


def test_no_collective_in_one_process(one_rank_group, monkeypatch):
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda *args, **kwargs: pytest.fail())
    model, optimizer = helper.model_and_optimizer()
    helper.one_step(model, optimizer, amp.GradScaler())
    model, optimizer = amp.initialize(model, optimizer, opt_level="O1", verbosity=0)
    try:
        helper.one_step(model, optimizer)
    finally:
        amp.deinitialize()
