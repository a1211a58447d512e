"""The wrappers of patched functions (amp/casting/wrappers.py): what one patched call costs in
Python calls (cProfile counts, no timings), the compiled path, and the weight-cast cache."""

import pytest
import torch

import amp
from amp._state import amp_state
from helpers import casting
from helpers.profiling import CastCounter
from helpers.profiling import profile_calls as _profile_calls


def _called(names, fragment):
    return any(fragment in name for name in names)


@pytest.mark.parametrize("region", ["autocast", "O1"])
def test_a_patched_call_is_one_python_call_of_amp(region):
    """A patched op with weights runs the wrapper alone in amp's code: the converter and the
    weight-cast cache are inlined, and the compile test is one call (not is_compiling's two)."""
    layer = torch.nn.Linear(4, 4)
    x = torch.randn(2, 4)
    F = torch.nn.functional  # read at call time: amp patches F.linear when casting starts
    weight, bias = layer.weight, layer.bias
    with casting(region, torch.bfloat16, layer):
        amp_state.cast_cache.clear()
        miss = _profile_calls(lambda: F.linear(x, weight, bias))
        hit = _profile_calls(lambda: F.linear(x, weight, bias))
        out = F.linear(x, weight, bias)
    amp.deinitialize()
    assert out.dtype == torch.bfloat16
    for own, _total, names in (miss, hit):
        assert own == 1, own  # amp_wrapper
        assert not names & {"is_compiling", "is_scripting", "convert", "cached_cast"}, names
    # miss: the lambda, the wrapper, the compile test, three casts, a data_ptr per weight, the
    # op (grad mode is read off the casts); hit: the input's cast and a data_ptr check per weight.
    assert miss[1] == 9, miss
    assert not _called(miss[2], "is_grad_enabled"), miss
    assert hit[1] == 7, hit


@pytest.mark.parametrize("region", ["autocast", "O1"])
def test_a_call_with_keyword_arguments_takes_the_inlined_path(region):
    """Keyword arguments (`dim=-1`, `is_causal=True`, `bias=`) are read with the positional ones:
    the wrapper alone in amp's code, as for a positional call."""
    layer = torch.nn.Linear(4, 4)
    x, q = torch.randn(2, 4), torch.randn(1, 2, 3, 4)
    F = torch.nn.functional
    weight, bias = layer.weight, layer.bias
    calls = [
        lambda: x.sum(dim=-1),
        lambda: F.scaled_dot_product_attention(q, q, q, is_causal=True),
        lambda: F.linear(x, weight, bias=bias),
    ]
    with casting(region, torch.bfloat16, layer):
        counted = [_profile_calls(call) for call in calls]
        results = [call() for call in calls]
    amp.deinitialize()
    for own, _total, names in counted:
        assert own == 1, names  # amp_wrapper
    assert counted[0][1] == 4, counted[0]  # the lambda, the wrapper, values(), sum
    assert counted[1][1] == 8, counted[1]  # ... three casts, and len() to split them back
    assert [result.dtype for result in results] == [torch.float32] + [torch.bfloat16] * 2
    assert torch.equal(results[2], F.linear(x.bfloat16(), weight.bfloat16(), bias.bfloat16()))
    assert results[2].requires_grad


def test_a_weight_cast_made_under_no_grad_serves_no_grad_and_is_remade_for_grad_mode():
    """No grad-mode call on the way: a cast that requires grad was made in grad mode and is kept
    for every use; one made under no_grad serves no_grad calls, and the first grad-mode call
    casts again (an autograd edge to the weight) and keeps that one."""
    layer = torch.nn.Linear(4, 4)
    weight, bias = layer.weight, layer.bias
    x = torch.randn(2, 4)
    F = torch.nn.functional
    with amp.autocast(dtype=torch.bfloat16):
        amp_state.cast_cache.clear()
        with torch.no_grad():
            with CastCounter() as counter:
                first = F.linear(x, weight, bias)
                F.linear(x, weight, bias)
            assert counter.casts == 2 + 2  # the input twice, weight and bias once
            again = _profile_calls(lambda: F.linear(x, weight, bias))
        assert not first.requires_grad and len(amp_state.cast_cache) == 2
        # the input's cast; each weight served after a grad-mode check (a no-grad cast)
        assert again[1] == 9 and _called(again[2], "is_grad_enabled"), again
        with CastCounter() as counter:
            trained = F.linear(x, weight, bias)
        assert trained.requires_grad and counter.casts == 3  # weight and bias cast again
        served = _profile_calls(lambda: F.linear(x, weight, bias))
        assert served[1] == 7 and not _called(served[2], "is_grad_enabled"), served
        with torch.no_grad(), CastCounter() as counter:
            assert torch.equal(F.linear(x, weight, bias), first)
        assert counter.casts == 1  # the input: the grad-mode casts serve no_grad calls too
    trained.float().sum().backward()
    assert weight.grad is not None


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


@pytest.mark.parametrize("region", ["autocast", "O1"])
def test_keyword_and_literal_arguments_compile_in_one_graph_as_eager_casts_them(region):
    """Dynamo traces the inlined path with keyword arguments and literals (None, a float, a
    bool: Dynamo failed its own guard on them) too: no graph break, no recompile, the dtypes of
    eager."""
    from torch._dynamo.utils import counters

    layer = torch.nn.Linear(4, 4)
    F = torch.nn.functional

    def block(x):
        y = F.linear(x, layer.weight, bias=layer.bias)
        q = y.view(1, 2, 2, 2)
        q = F.scaled_dot_product_attention(q, q, q, None, 0.0, True)
        return F.scaled_dot_product_attention(q, q, q, is_causal=True).sum(dim=-1)

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(block, fullgraph=True, backend="eager")
    with casting(region, torch.bfloat16, layer):
        eager = block(torch.randn(2, 4))
        outputs = [compiled(torch.randn(2, 4)) for _ in range(2)]
    amp.deinitialize()
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]
    assert eager.dtype is torch.float32  # sum is FP32; its input came from bf16 attention
    assert all(output.dtype is eager.dtype and output.requires_grad for output in outputs)
