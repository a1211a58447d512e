"""amp's host work per training step does not grow with the number of parameters.

Python calls counted by cProfile: a load-independent figure (no timings in tests).
"""

import cProfile
import os
import pstats
import sys

import pytest
import torch

import amp
from amp._state import amp_state

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks"))
from measure import scaling_calls  # noqa: E402

AMP_DIR = os.path.dirname(amp.__file__)


def make_model(layers):
    torch.manual_seed(0)
    modules = []
    for _ in range(layers):
        modules += [torch.nn.Linear(4, 4), torch.nn.ReLU()]
    return torch.nn.Sequential(*modules)


def amp_calls_per_step(opt_level, layers):
    """Python calls made in amp's own code during one warmed-up training step."""
    model = make_model(layers)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model, optimizer = amp.initialize(
        model, optimizer, opt_level=opt_level, dtype=torch.bfloat16, verbosity=0
    )
    x = torch.randn(8, 4)

    def step():
        optimizer.zero_grad(set_to_none=True)
        loss = model(x).float().square().mean()
        with amp.scale_loss(loss, optimizer) as scaled:
            scaled.backward()
        optimizer.step()

    try:
        for _ in range(3):
            step()
        profile = cProfile.Profile()
        profile.enable()
        step()
        profile.disable()
    finally:
        amp.deinitialize()
    stats = pstats.Stats(profile).stats
    return sum(
        counts[1] for (filename, _, _), counts in stats.items() if filename.startswith(AMP_DIR)
    )


@pytest.mark.parametrize("opt_level", ["O2", "O3"])
def test_amp_bookkeeping_per_step_is_constant_in_the_parameter_count(opt_level):
    # 4 and 40 parameter tensors: master weights, shadows and gradients are handled in batches.
    assert amp_calls_per_step(opt_level, 2) == amp_calls_per_step(opt_level, 20)


def test_a_write_into_one_parameter_is_taken_into_its_master_alone():
    model = make_model(3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    model, optimizer = amp.initialize(
        model, optimizer, opt_level="O2", dtype=torch.bfloat16, verbosity=0
    )
    try:
        masters = amp.master_params(optimizer)
        before = [master.detach().clone() for master in masters]
        with torch.no_grad():
            model[2].weight.mul_(2)  # a power of two: exact in bfloat16
        loss = model(torch.randn(8, 4)).float().sum()
        with amp.scale_loss(loss, optimizer) as scaled:
            scaled.backward()
        optimizer.step()
        for index, (old, master) in enumerate(zip(before, masters)):
            if index == 2:  # the written weight: its master took the write
                assert torch.equal(master, model[2].weight.float())
                assert not torch.equal(master, old)
            else:  # the others keep their exact FP32 values (lr=0: no step changes them)
                assert torch.equal(master, old)
    finally:
        amp.deinitialize()


def _o2_stepped(lr):
    """An O2 model and its SGD after one step (its marks batched)."""
    model = make_model(3)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    model, optimizer = amp.initialize(
        model, optimizer, opt_level="O2", dtype=torch.bfloat16, verbosity=0
    )
    _o2_step(model, optimizer)
    return model, optimizer


def _o2_step(model, optimizer):
    loss = model(torch.randn(8, 4)).float().sum()
    with amp.scale_loss(loss, optimizer) as scaled:
        scaled.backward()
    optimizer.step()


def test_batched_marks_read_as_marks_made_one_by_one():
    """After a step amp marks its write into the model in one batch; the first look at a shadow
    on its own writes the batch into every shadow, which then reads as if marked one by one."""
    from amp.weights import shadows as shadows_module

    model, optimizer = _o2_stepped(lr=0.1)
    try:
        record = optimizer._amp_record
        shadows = record.shadows()
        assert shadows_module._lagging  # the step's marks wait in their batch
        stale = [(s.low_version, s.fp32_version) for s in shadows]
        now = [(s.current()._version, s.fp32._version) for s in shadows]
        assert stale != now  # not written into the shadows one by one
        shadows_module.flush()
        assert not shadows_module._lagging
        assert [(s.low_version, s.fp32_version) for s in shadows] == now
        assert all(s.low is s.current() for s in shadows)
    finally:
        amp.deinitialize()


@pytest.mark.parametrize("where", ["state_dict", "next step"])
def test_a_write_into_the_model_after_a_step_wins_over_the_batched_marks(where):
    """A write into a model parameter after the step (its marks still batched) is taken into the
    master, by a state dict or by the next step; it is never overwritten from the master."""
    model, optimizer = _o2_stepped(lr=0.0)
    try:
        with torch.no_grad():
            model[2].weight.mul_(2)  # a power of two: exact in bfloat16
        written = model[2].weight.detach().clone()
        if where == "state_dict":
            assert torch.equal(model.state_dict()["2.weight"], written.float())
        else:
            _o2_step(model, optimizer)  # lr=0: the master keeps what it took
        assert torch.equal(model[2].weight, written)
        masters = list(amp.master_params(optimizer))
        assert torch.equal(masters[2], written.float())
    finally:
        amp.deinitialize()


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_gradients_are_never_compared_with_equality(monkeypatch, opt_level):
    """`None in grads` or `grads.count(None)` runs Tensor.__eq__ per gradient (some 20 us each):
    amp tests for absent gradients by identity."""
    model = make_model(3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model, optimizer = amp.initialize(
        model, optimizer, opt_level=opt_level, dtype=torch.bfloat16, verbosity=0
    )
    compared = []
    original = torch.Tensor.__eq__

    def counting(self, other):
        compared.append(other)
        return original(self, other)

    try:
        monkeypatch.setattr(torch.Tensor, "__eq__", counting)
        for _ in range(2):  # the second block finds the first one's gradients (accumulation)
            loss = model(torch.randn(8, 4)).float().square().mean()
            with amp.scale_loss(loss, optimizer) as scaled:
                scaled.backward()
        optimizer.step()
        monkeypatch.undo()
        assert compared == []
    finally:
        amp.deinitialize()


def _profile_calls(fn):
    profile = cProfile.Profile()
    profile.enable()
    fn()
    profile.disable()
    stats = pstats.Stats(profile).stats
    own = sum(
        counts[1] for (filename, _, _), counts in stats.items() if filename.startswith(AMP_DIR)
    )
    names = {name for (_, _, name) in stats}
    # The profiler's own `disable` is counted once; leave it out.
    return own, pstats.Stats(profile).total_calls - 1, names


@pytest.mark.parametrize("region", ["autocast", "O1"])
def test_a_patched_call_is_one_python_call_of_amp(region):
    """A patched op with weights runs the wrapper alone in amp's code: the converter and the
    weight-cast cache are inlined, and the compile test is one call (not is_compiling's two)."""
    layer = torch.nn.Linear(4, 4)
    x = torch.randn(2, 4)
    F = torch.nn.functional  # read at call time: amp patches F.linear when casting starts
    if region == "O1":
        layer = amp.initialize(layer, opt_level="O1", dtype=torch.bfloat16, verbosity=0)
        context = torch.enable_grad()
    else:
        context = amp.autocast(dtype=torch.bfloat16)
    weight, bias = layer.weight, layer.bias
    try:
        with context:
            amp_state.cast_cache.clear()
            miss = _profile_calls(lambda: F.linear(x, weight, bias))
            hit = _profile_calls(lambda: F.linear(x, weight, bias))
            out = F.linear(x, weight, bias)
    finally:
        amp.deinitialize()
    assert out.dtype == torch.bfloat16
    for own, _total, names in (miss, hit):
        assert own == 1, own  # amp_wrapper
        assert not names & {"is_compiling", "is_scripting", "convert", "cached_cast"}, names
    # miss: the lambda, the wrapper, the compile test, three casts, the grad mode, a data_ptr
    # per weight, the op; hit: the input's cast and a data_ptr check per weight instead.
    assert miss[1] == 10, miss
    assert hit[1] == 7, hit


def test_the_export_flag_takes_the_compiled_path(monkeypatch):
    """torch.export's non-Dynamo tracing sets torch.compiler._is_compiling_flag: the wrappers
    then cast without the weight-cast cache, as under Dynamo."""
    layer = torch.nn.Linear(4, 4)
    with amp.autocast(dtype=torch.bfloat16):
        amp_state.cast_cache.clear()
        monkeypatch.setattr(torch.compiler, "_is_compiling_flag", True)
        traced = torch.nn.functional.linear(torch.randn(2, 4), layer.weight, layer.bias)
        assert len(amp_state.cast_cache) == 0
        monkeypatch.setattr(torch.compiler, "_is_compiling_flag", False)
        eager = torch.nn.functional.linear(torch.randn(2, 4), layer.weight, layer.bias)
        assert len(amp_state.cast_cache) == 2
    assert traced.dtype == eager.dtype == torch.bfloat16


@pytest.mark.parametrize("opt_level", ["O0", "O1", "O2", "O3"])
def test_loss_scaling_costs_no_more_calls_than_torchs_grad_scaler(opt_level):
    """At 10 parameter tensors, amp's scale_loss + step make no more Python calls than torch's
    GradScaler: the kernels' one-device path, the scaler's tensors read without a call,
    is_distributed() without torch.distributed's four calls; at O2 also the master gradients
    sliced once per model, and the model's writes checked and marked in one batch."""
    amp_adds, torch_adds = scaling_calls(opt_level)
    assert amp_adds <= torch_adds, (amp_adds, torch_adds)


def test_unscaling_tensors_on_one_device_is_one_backend_call():
    from amp import kernels

    tensors = [torch.full((3,), 4.0) for _ in range(10)]
    found_inf = torch.zeros(())
    inv_scale = torch.full((), 0.5)
    own, _, names = _profile_calls(lambda: kernels.unscale_(tensors, inv_scale, found_inf))
    assert own == 3, names  # unscale_, _flagged, the backend's unscale_
    assert all(torch.equal(t, torch.full((3,), 2.0)) for t in tensors)
    assert found_inf.item() == 0.0
    tensors[3][1] = float("inf")
    kernels.unscale_(tensors, inv_scale, found_inf)
    assert found_inf.item() == 1.0


def test_is_distributed_reads_the_default_group_now(monkeypatch):
    """Cheap (one Python call past itself) and never cached: a process group made later counts."""
    from amp import distributed

    _, total, _ = _profile_calls(distributed.is_distributed)
    assert total == 1, total  # is_distributed alone: the default group read as an attribute
    assert not distributed.is_distributed()
    world = torch.distributed.distributed_c10d._world
    monkeypatch.setattr(world, "_default_pg", object())
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


def test_the_weight_cast_cache_is_cleared_only_when_filled():
    """Every store into the weight-cast cache (the wrappers' inlined path and the cache's own
    function) marks it filled, so that scale_loss and step clear it; with nothing cast they make
    no call to clear."""
    cache = amp_state.cast_cache
    layer = torch.nn.Linear(4, 4)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    layer, optimizer = amp.initialize(
        layer, optimizer, opt_level="O1", dtype=torch.bfloat16, verbosity=0
    )
    F = torch.nn.functional
    try:
        cache.clear()
        F.linear(torch.randn(2, 4), layer.weight, layer.bias)  # the wrappers' inlined path
        assert cache.filled and len(cache) == 2
        cache.clear()
        assert not cache.filled and len(cache) == 0
        F.linear(torch.randn(2, 4), layer.weight, bias=layer.bias)  # keywords: the converter
        assert cache.filled and len(cache) == 2
        loss = layer(torch.randn(2, 4)).float().sum()
        with amp.scale_loss(loss, optimizer) as scaled:
            assert not cache.filled and len(cache) == 0  # the casts go before backward
            scaled.backward()
        _, _, names = _profile_calls(optimizer.step)
        assert "clear" not in names  # nothing was cast since
    finally:
        amp.deinitialize()


def test_a_patched_call_without_weights_makes_no_compile_test():
    """The compile test guards the weight-cast cache only: an op on activations runs the wrapper,
    its casts and the op, nothing else (Dynamo traces that path as plain code)."""
    a, b = torch.randn(2, 4), torch.randn(4, 3)
    with amp.autocast(dtype=torch.bfloat16):
        own, total, names = _profile_calls(lambda: torch.mm(a, b))
        out = torch.mm(a, b)
    assert out.dtype == torch.bfloat16
    assert own == 1 and "is_dynamo_compiling" not in names, names
    assert total == 5, names  # the lambda, the wrapper, two casts, mm
