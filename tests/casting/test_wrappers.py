"""The wrappers of patched functions (amp/casting/wrappers.py): who decides a call on each device,
torch's autocast off where amp decides alone, what a call costs in Python calls (cProfile counts,
no timings), and the compiled path."""

import pytest
import torch

import amp
from amp import lists
from amp._state import amp_state
from amp.casting.wrappers import make_wrapper
from amp.lists.agreement import AMP, AMP_ALONE, TORCH
from helpers import casting
from helpers.profiling import profile_calls as _profile_calls


def _spy():
    """A function recording the dtypes it was given and whether torch's autocast was on."""
    seen = []

    def spy(*tensors):
        seen.append(([t.dtype for t in tensors], torch.is_autocast_enabled("cpu")))
        return tensors[0]

    return spy, seen


@pytest.mark.parametrize(
    "decider, cast, torch_on",
    [(TORCH, False, True), (AMP, True, True), (AMP_ALONE, True, False)],
)
def test_the_decider_of_the_calls_device_says_who_casts(decider, cast, torch_on):
    spy, seen = _spy()
    wrapped = make_wrapper(spy, lists.FP32, "spy", deciders={"cpu": decider, "cuda": AMP})
    x = torch.randn(2, 2).half()
    with amp.autocast(dtype=torch.bfloat16):
        wrapped(x, x)
    wrapped(x, x)  # outside any region: the original at once
    assert seen[0] == ([torch.float32 if cast else torch.float16] * 2, torch_on)
    assert seen[1] == ([torch.float16] * 2, False)


def test_a_python_function_is_decided_by_amp_and_its_calls_by_their_own_entries():
    """A decorated function gets its arguments cast; the ops it calls stay each decided as their
    tables say (torch.mm in low precision inside an FP32 function, as apex's patches did)."""

    @amp.float_function
    def mixed(a, b):
        return a.dtype, torch.mm(a, b).dtype

    x = torch.randn(2, 2).half()
    with amp.autocast(dtype=torch.bfloat16):
        assert mixed(x, x) == (torch.float32, torch.bfloat16)
    assert mixed(x, x) == (torch.float16, torch.float16)


@pytest.mark.parametrize("region", ["autocast", "O1"])
def test_an_op_torch_decides_costs_no_python_call_of_amp(region):
    layer = torch.nn.Linear(4, 4)
    weight, bias = layer.weight, layer.bias
    x, q = torch.randn(2, 4), torch.randn(1, 2, 3, 4)
    F = torch.nn.functional  # read at call time
    with casting(region, torch.bfloat16, layer):
        counted = [
            _profile_calls(lambda: F.linear(x, weight, bias)),
            _profile_calls(lambda: torch.matmul(x, weight)),
            _profile_calls(lambda: F.scaled_dot_product_attention(q, q, q, is_causal=True)),
        ]
        out = F.linear(x, weight, bias)
    amp.deinitialize()
    assert out.dtype is torch.bfloat16
    for own, total, names in counted:
        assert (own, total) == (0, 2), names  # the lambda and the op: torch's C++ casts


@pytest.mark.parametrize("region", ["autocast", "O1"])
def test_an_fp32_op_with_nothing_to_cast_is_one_python_call(region):
    x = torch.randn(2, 4)
    with casting(region, torch.bfloat16):
        counted = [
            _profile_calls(lambda: x.sum(dim=-1)),
            _profile_calls(lambda: x.softmax(-1)),
            _profile_calls(lambda: torch.layer_norm(x, (4,))),
        ]
        low = x.bfloat16().softmax(-1)
    amp.deinitialize()
    for own, total, names in counted:
        assert (own, total) == (1, 3), names  # the lambda, amp's wrapper, the op
    assert low.dtype is torch.float32
    assert torch.equal(low, x.bfloat16().float().softmax(-1))


def test_calls_of_other_devices_and_without_tensors_pass_through():
    spy, seen = _spy()
    wrapped = make_wrapper(spy, lists.FP32, "spy", deciders={"cpu": AMP, "cuda": AMP})
    meta = torch.empty(2, 2, dtype=torch.float16, device="meta")
    with amp.autocast(dtype=torch.bfloat16):
        wrapped(meta)
        assert make_wrapper(lambda n: n + 1, lists.FP32, "plain")(1) == 2
    assert seen == [([torch.float16], True)]


def test_the_export_flag_takes_the_compiled_path(monkeypatch):
    """torch.export's non-Dynamo tracing sets torch.compiler._is_compiling_flag: the wrappers
    then cast without amp's weight-cast cache, as under Dynamo."""
    weight = torch.nn.Parameter(torch.randn(4, 4))
    x = torch.randn(2, 4)
    cache = amp_state.cast_cache
    with amp.autocast(dtype=torch.bfloat16):
        monkeypatch.setattr(torch.compiler, "_is_compiling_flag", True)
        traced = torch.einsum("ij,kj->ik", x, weight)  # amp casts einsum on the CPU
        assert len(cache) == 0
        monkeypatch.setattr(torch.compiler, "_is_compiling_flag", False)
        eager = torch.einsum("ij,kj->ik", x, weight)
        assert len(cache) == 1
    assert traced.dtype == eager.dtype == torch.bfloat16
    assert torch.equal(traced, eager)


@pytest.mark.parametrize("region", ["autocast", "O1"])
def test_keyword_and_literal_arguments_compile_in_one_graph_as_eager_casts_them(region):
    """Dynamo traces the wrappers (a signature wrapper for sum) with keyword arguments and
    literals: no graph break, no recompile, the dtypes of eager."""
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
