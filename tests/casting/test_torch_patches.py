"""The patches amp installs on torch (amp/casting/torch_patches.py): torch's C bindings take
their function's policy and are restored, and a tool that wraps a patched function does not
block amp."""

import functools

import pytest
import torch
import wrapt

import amp
from helpers.models import make_model


def _table_kinds():
    from amp import lists

    return {(entry.namespace, entry.name): entry.kind for entry in lists.entries()}


def test_c_bindings_take_their_functions_policy_and_are_restored():
    """A binding is patched with its function's policy where amp decides it on some device (its
    own aten op compared with torch's autocast); the others are torch's to cast."""
    from amp import lists
    from amp.lists import agreement

    bindings = lists.bindings()
    originals = {binding: getattr(torch._C._nn, binding[1]) for binding in bindings}
    kinds = _table_kinds()
    with amp.autocast(dtype=torch.bfloat16):
        for (_, name), source in bindings.items():
            function = getattr(torch._C._nn, name)
            op = agreement.aten_op("torch._C._nn", name, originals[("torch._C._nn", name)])
            decided = agreement.decides_everywhere(kinds[source], op)
            kind = getattr(function, "__amp_kind__", None)
            assert kind == (None if decided else kinds[source]), name
        x = torch.randn(2, 3, 4, 4, 4)
        assert torch._C._nn.linear(torch.randn(2, 4), torch.randn(3, 4)).dtype is torch.bfloat16
        assert torch._C._nn.softplus(x.bfloat16()).dtype is torch.float32
        assert torch._C._nn.upsample_nearest3d(x.bfloat16(), [8, 8, 8]).dtype is torch.float32
        assert torch._C._nn.avg_pool3d(x.bfloat16(), 2).dtype is torch.float32
        with pytest.raises(NotImplementedError, match="BCEWithLogitsLoss"):
            torch._C._nn.binary_cross_entropy(x.bfloat16().sigmoid(), x.bfloat16().sigmoid())
    amp.deinitialize()
    assert all(getattr(torch._C._nn, name) is originals[(path, name)] for path, name in bindings)


@pytest.mark.parametrize("wrap", ["functools", "wrapt"])
def test_a_tool_wrapping_a_patched_function_does_not_block_amp(wrap):
    original = torch.matmul
    amp.initialize(make_model(), opt_level="O1", verbosity=0)
    try:
        patched = torch.matmul
        if wrap == "functools":

            @functools.wraps(patched)
            def tool(*args, **kwargs):
                return patched(*args, **kwargs)

        else:
            tool = wrapt.FunctionWrapper(patched, lambda wrapped, _, args, kwargs: wrapped(*args))
        torch.matmul = tool  # e.g. a profiler hooking torch functions
        amp.deinitialize()
        amp.initialize(make_model(), opt_level="O1", verbosity=0)
        a = torch.randn(2, 2)
        assert torch.matmul(a, a).dtype is torch.float16
        amp.deinitialize()
        with amp.autocast():
            assert torch.matmul(a, a).dtype is torch.float16
    finally:
        amp.deinitialize()
        torch.matmul = original
