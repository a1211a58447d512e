"""The wrappers of patched functions (amp/casting/wrappers.py): what one patched call costs in
Python calls (cProfile counts, no timings), the compiled path, and the weight-cast cache."""

import pytest
import torch

import amp
from amp._state import amp_state
from helpers.profiling import profile_calls as _profile_calls


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
